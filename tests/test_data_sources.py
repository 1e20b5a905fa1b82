"""Data sources on small files written here (jaxrlvr/data/sources.py): jsonl, verl parquet, tfds, hf_disk."""
import ast
import json
import os

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow_datasets as tfds

from jaxrlvr.data import DataError, make_source

VERL_ROWS = [
    {"data_source": "math500", "prompt": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "What is 1/2 + 1/4?"}],
     "reward_model": {"ground_truth": "\\frac{3}{4}", "style": "rule"}, "target": [
         {"role": "assistant", "content": "1/2 + 1/4 = 3/4, so \\boxed{\\frac{3}{4}}"}]},
    {"data_source": "aime24", "prompt": [{"role": "user", "content": "Find x if 2x = 10."}],
     "reward_model": {"ground_truth": "5", "style": "rule"}, "target": None},
]


def _write_jsonl(path, rows):
  with open(path, "w") as f:
    for row in rows:
      f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
  return str(path)


def test_jsonl_fields_numbers_blank_lines(tmp_path):
  path = _write_jsonl(tmp_path / "gsm.jsonl", [
      {"problem": "2+3?", "gt": 5, "worked": "2+3=5"},
      "",  # blank lines are skipped and do not take a qid
      {"problem": "Half of 3?", "gt": "1.5", "data_source": "gsm8k"}])
  source = make_source(f"jsonl:{path}", question_field="problem", answer_field="gt", solution_field="worked")
  assert len(source) == 2
  first, second = source[0], source[1]
  assert (first.qid, first.question, first.answer, first.solution) == (0, "2+3?", "5", "2+3=5")
  assert first.data_source == "gsm"  # no data_source column: the file's name
  assert (second.qid, second.answer, second.solution, second.data_source) == (1, "1.5", None, "gsm8k")


@pytest.mark.parametrize("bad_row,message", [
    ({"question": "q2"}, r"field 'answer' is missing and there is no verl 'reward_model' \(the row has \['question'\]"),
    ({"question": "  ", "answer": "1"}, "field 'question' is missing or empty"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
])
def test_jsonl_bad_row_names_file_and_line(tmp_path, bad_row, message):
  path = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "q1", "answer": "1"}, bad_row])
  with pytest.raises(DataError, match=message) as e:
    make_source(f"jsonl:{path}")
  assert f"{path} line 2 (row 1)" in str(e.value)


def test_empty_and_missing_files(tmp_path):
  path = _write_jsonl(tmp_path / "empty.jsonl", ["", ""])
  with pytest.raises(DataError, match="has no rows"):
    make_source(f"jsonl:{path}")
  with pytest.raises(DataError, match="does not exist"):
    make_source(f"jsonl:{tmp_path}/nope.jsonl")
  with pytest.raises(DataError, match="unknown kind 'csv'"):
    make_source("csv:/x.csv")


def test_parquet_verl_format(tmp_path):
  path = str(tmp_path / "val.parquet")
  pq.write_table(pa.Table.from_pylist(VERL_ROWS), path)
  source = make_source(f"parquet:{path}")
  assert len(source) == 2
  first, second = source[0], source[1]
  assert first.question == "What is 1/2 + 1/4?"  # the last user message of the chat prompt
  assert first.answer == "\\frac{3}{4}" and first.data_source == "math500"
  assert first.messages == VERL_ROWS[0]["prompt"]
  assert first.solution == "1/2 + 1/4 = 3/4, so \\boxed{\\frac{3}{4}}"  # LUFFY-style reference column
  assert (second.answer, second.solution, second.data_source) == ("5", None, "aime24")


def test_parquet_bad_row_and_empty(tmp_path):
  rows = [dict(VERL_ROWS[0]), dict(VERL_ROWS[1], reward_model={"ground_truth": "", "style": "rule"})]
  path = str(tmp_path / "bad.parquet")
  pq.write_table(pa.Table.from_pylist(rows), path)
  with pytest.raises(DataError, match=r"bad\.parquet row 1: field 'reward_model.ground_truth' is missing or empty"):
    make_source(f"parquet:{path}")
  empty = str(tmp_path / "empty.parquet")
  pq.write_table(pa.Table.from_pylist([], schema=pa.Table.from_pylist(VERL_ROWS).schema), empty)
  with pytest.raises(DataError, match="has no rows"):
    make_source(f"parquet:{empty}")


class JaxrlvrTestQa(tfds.core.GeneratorBasedBuilder):
  """A three-row question/answer dataset; row 2 has an empty answer."""
  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        "question": tfds.features.Text(), "answer": tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples()}

  def _generate_examples(self):
    for i, (q, a) in enumerate([("1+1", "2"), ("2+2", "4"), ("3+3", "")]):
      yield i, {"question": q, "answer": a}


def test_tfds_array_record_source(tmp_path):
  JaxrlvrTestQa(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
  source = make_source("tfds:jaxrlvr_test_qa:train", data_dir=str(tmp_path))
  assert len(source) == 3
  example = source[1]  # tfds Text features come back as bytes; the source decodes them.
  assert (example.qid, example.question, example.answer, example.data_source) == (1, "2+2", "4", "jaxrlvr_test_qa")
  with pytest.raises(DataError, match=r"jaxrlvr_test_qa.*row 2: field 'answer' is missing or empty"):
    source[2]  # checked on access: reading all of a large ArrayRecord set up front would defeat random access
  assert len(make_source("tfds:jaxrlvr_test_qa:train[:2]", data_dir=str(tmp_path))) == 2
  with pytest.raises(DataError, match="tfds:no_such_dataset_xyz:train.*cannot be opened"):
    make_source("tfds:no_such_dataset_xyz:train", data_dir=str(tmp_path))


def test_hf_disk_dataset_and_dataset_dict(tmp_path):
  flat = str(tmp_path / "flat")
  rows = [{"question": "3*3", "answer": "9"}, {"question": "4*4", "answer": "16"}]
  datasets.Dataset.from_list(rows).save_to_disk(flat)
  source = make_source(f"hf_disk:{flat}")
  assert [source[i].answer for i in range(len(source))] == ["9", "16"]

  verl = str(tmp_path / "verl")
  datasets.DatasetDict({"test": datasets.Dataset.from_list(VERL_ROWS)}).save_to_disk(verl)
  held_out = make_source(f"hf_disk:{verl}", split="test")
  assert held_out[0].question == "What is 1/2 + 1/4?" and held_out[1].answer == "5"
  with pytest.raises(DataError, match=r"no split 'train'; it has \['test'\]"):
    make_source(f"hf_disk:{verl}", split="train")

  bad = str(tmp_path / "bad")
  datasets.Dataset.from_list([{"question": "x", "answer": "1"}, {"question": "y", "answer": None}]).save_to_disk(bad)
  with pytest.raises(DataError, match=r"bad row 1: field 'answer' is missing or empty"):
    make_source(f"hf_disk:{bad}")
  empty = str(tmp_path / "empty")
  # (`filter` rather than an empty `from_dict`: datasets cannot save a table built with no rows.)
  datasets.Dataset.from_list([{"question": "x", "answer": "1"}]).filter(lambda row: False).save_to_disk(empty)
  with pytest.raises(DataError, match="has no rows"):
    make_source(f"hf_disk:{empty}")


def test_data_modules_import_one_way():
  """No import cycle inside jaxrlvr/data, lazy imports included: each module imports only modules below it."""
  package = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jaxrlvr", "data")
  modules = {name[:-3] for name in os.listdir(package) if name.endswith(".py") and name != "__init__.py"}
  imports = {}
  for module in modules:
    with open(os.path.join(package, f"{module}.py")) as f:
      tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module == "jaxrlvr.data":
        found.update(alias.name for alias in node.names)
      elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxrlvr.data."):
        found.add(node.module.split(".")[2])
      elif isinstance(node, ast.ImportFrom) and node.module == "jaxrlvr":
        assert "data" not in {a.name for a in node.names}, f"{module}.py imports the package jaxrlvr.data itself"
      elif isinstance(node, ast.Import):
        found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("jaxrlvr.data."))
    imports[module] = found & modules
  order = []  # a topological order exists iff there is no cycle
  while len(order) < len(modules):
    ready = sorted(m for m in modules if m not in order and imports[m] <= set(order))
    assert ready, f"import cycle among {sorted(set(modules) - set(order))}: {imports}"
    order.extend(ready)
