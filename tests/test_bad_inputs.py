"""Every bad input is one line: a data source that cannot be opened, decoded or recognised as its kind, and a config
value out of its range, stop with an error that names the file, row, key or value (`python -m jaxrlvr.main` prints it
as one `jaxrlvr: error:` line and exits 2).

The tables call what the main command calls (`data.sources_from_config`, `config_lib.validate`) in-process; one row
runs the real command, which costs seconds."""
import importlib
import json
import os
import subprocess
import sys

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import light_compile
from jaxrlvr import config_lib
from jaxrlvr import data as data_lib

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ROW = {"question": "1+1", "answer": "2"}


def _write(path, content: bytes | str) -> str:
  with open(path, "wb") as f:
    f.write(content.encode() if isinstance(content, str) else content)
  return str(path)


def _jsonl(path, *rows) -> str:
  return _write(path, "".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))


def _parquet(path, rows, *, keep_rows: int | None = None, keep_bytes: int | None = None) -> str:
  """`rows` as a Parquet file; only the first `keep_rows` of them, or only its first `keep_bytes` bytes."""
  pq.write_table(pa.Table.from_pylist(rows).slice(0, keep_rows), str(path))
  if keep_bytes is not None:
    with open(path, "rb") as f:
      _write(path, f.read()[:keep_bytes])
  return str(path)


def _hf_disk(path, dataset) -> str:
  dataset.save_to_disk(str(path))
  return str(path)


# (case, spec(tmp_path) -> the data.source, words the one line must hold; "{tmp}" stands for tmp_path)
DATA_CASES = [
    # jsonl
    ("jsonl not UTF-8", lambda t: "jsonl:" + _write(t / "latin1.jsonl", b'{"question": "caf\xe9", "answer": "1"}\n'),
     ["{tmp}/latin1.jsonl line 1: not UTF-8 text (byte 0xe9 at byte 18 of the line)"]),
    ("jsonl missing", lambda t: f"jsonl:{t}/nope.jsonl", ["{tmp}/nope.jsonl does not exist"]),
    ("jsonl directory", lambda t: f"jsonl:{t}", ["{tmp} is a directory; jsonl: reads one file"]),
    ("jsonl empty", lambda t: "jsonl:" + _write(t / "empty.jsonl", "\n\n"), ["empty.jsonl' has no rows"]),
    ("jsonl cut-off row", lambda t: "jsonl:" + _jsonl(t / "cut.jsonl", _ROW, '{"question": "2+2"'),
     ["{tmp}/cut.jsonl line 2 (row 1): not valid JSON"]),
    ("jsonl row not an object", lambda t: "jsonl:" + _jsonl(t / "list.jsonl", _ROW, "[1, 2]"),
     ["{tmp}/list.jsonl line 2 (row 1): expected a JSON object, got list"]),
    ("jsonl question field named otherwise", lambda t: "jsonl:" + _jsonl(t / "q.jsonl", {"problem": "1+1", "gt": 2}),
     ["{tmp}/q.jsonl line 1 (row 0): field 'question' is missing", "['gt', 'problem']",
      "--config.data.question_field=NAME"]),
    ("jsonl answer field named otherwise", lambda t: "jsonl:" + _jsonl(t / "a.jsonl", {"question": "1+1", "gt": 2}),
     ["{tmp}/a.jsonl line 1 (row 0): field 'answer' is missing", "--config.data.answer_field=NAME"]),
    ("jsonl empty answer", lambda t: "jsonl:" + _jsonl(t / "e.jsonl", _ROW, {"question": "2+2", "answer": " "}),
     ["{tmp}/e.jsonl line 2 (row 1): field 'answer' is missing or empty"]),
    ("jsonl without a path", lambda t: "jsonl:", ["'jsonl:' names no path", "jsonl:/data/train.jsonl"]),
    ("no kind", lambda t: "/data/train.jsonl", ["unknown kind", "did you mean 'jsonl:/data/train.jsonl'?"]),
    ("unknown kind", lambda t: "csv:/data/train.csv", ["unknown kind 'csv'; known: synthetic, jsonl, parquet"]),
    # parquet
    ("parquet not Parquet", lambda t: "parquet:" + _write(t / "text.parquet", "question,answer\n1+1,2\n"),
     ["{tmp}/text.parquet is not a Parquet file that can be read"]),
    ("parquet of JSON lines", lambda t: "parquet:" + _jsonl(t / "rows.parquet", _ROW),
     ["is not a Parquet file", "it looks like jsonl: use jsonl:{tmp}/rows.parquet"]),
    ("parquet empty file", lambda t: "parquet:" + _write(t / "empty.parquet", b""),
     ["{tmp}/empty.parquet is not a Parquet file", "0 bytes"]),
    ("parquet cut short", lambda t: "parquet:" + _parquet(t / "short.parquet", [_ROW] * 20, keep_bytes=200),
     ["{tmp}/short.parquet is not a Parquet file"]),
    ("parquet missing", lambda t: f"parquet:{t}/nope.parquet", ["{tmp}/nope.parquet does not exist"]),
    ("parquet directory", lambda t: f"parquet:{t}", ["{tmp} is a directory; parquet: reads one file"]),
    ("parquet columns named otherwise", lambda t: "parquet:" + _parquet(t / "c.parquet", [{"problem": "1", "a": "2"}]),
     ["{tmp}/c.parquet: field 'question' is missing and there is no verl 'prompt'",
      "its columns are ['a', 'problem']"]),
    ("parquet no rows", lambda t: "parquet:" + _parquet(t / "none.parquet", [_ROW], keep_rows=0),
     ["none.parquet' has no rows"]),
    # hf_disk
    ("hf_disk a plain file", lambda t: "hf_disk:" + _parquet(t / "d.parquet", [_ROW]),
     ["{tmp}/d.parquet is a file; hf_disk: reads the directory `save_to_disk` wrote",
      "use parquet:{tmp}/d.parquet"]),
    ("hf_disk not a dataset", lambda t: f"hf_disk:{t}", ["{tmp} is not a dataset written by `save_to_disk`"]),
    ("hf_disk missing", lambda t: f"hf_disk:{t}/nope", ["{tmp}/nope does not exist"]),
    ("hf_disk no such split", lambda t: "hf_disk:" + _hf_disk(
        t / "dd", datasets.DatasetDict({"test": datasets.Dataset.from_list([_ROW])})),
     ["no split 'train'; it has ['test']"]),
    ("hf_disk columns named otherwise", lambda t: "hf_disk:" + _hf_disk(
        t / "ds", datasets.Dataset.from_list([{"question": "1+1", "gt": "2"}])),
     ["{tmp}/ds: field 'answer' is missing", "its columns are ['gt', 'question']"]),
    # tfds
    ("tfds unknown dataset", lambda t: "tfds:no_such_dataset_xyz:train",
     ["'tfds:no_such_dataset_xyz:train'", "cannot be opened: DatasetNotFoundError", "tfds build no_such_dataset_xyz"]),
    ("tfds without a name", lambda t: "tfds:", ["'tfds:' names no dataset", "tfds:gsm8k:train"]),
]


def _config(source: str, tmp_path, **data):
  config = importlib.import_module("configs.grpo").get_config("smoke")
  with config.unlocked():
    config.data.source = source
    config.data.data_dir = str(tmp_path)
    config.data.update(data)
  return config


def _one_line(error: Exception, tmp_path) -> str:
  message = str(error)
  assert "\n" not in message and "Traceback" not in message, message
  return message.replace(str(tmp_path), "{tmp}")


@pytest.mark.parametrize("case, spec, words", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_a_bad_data_source_is_one_line_naming_it(tmp_path, case, spec, words):
  del case
  config = _config(spec(tmp_path), tmp_path)
  with pytest.raises(data_lib.DataError) as e:
    data_lib.sources_from_config(config)
  message = _one_line(e.value, tmp_path)
  for word in words:
    assert word in message, message


@pytest.mark.parametrize("kind, module, install", [
    ("tfds:gsm8k:train", "tensorflow_datasets", "pip install -e '.[tfds]'"),
    ("hf_disk:{tmp}", "datasets", "pip install datasets"),
])
def test_a_kind_whose_package_is_missing_says_what_to_install(tmp_path, monkeypatch, kind, module, install):
  monkeypatch.setitem(sys.modules, module, None)  # `import module` now fails as if it were not installed
  with pytest.raises(data_lib.DataError) as e:
    data_lib.sources_from_config(_config(kind.replace("{tmp}", str(tmp_path)), tmp_path))
  assert install in _one_line(e.value, tmp_path)


def test_a_non_utf8_text_column_names_the_row_and_field(tmp_path):
  rows = [{"question": b"1+1", "answer": b"2"}, {"question": b"q\xff", "answer": b"1"}]
  path = _parquet(tmp_path / "bytes.parquet", rows)
  with pytest.raises(data_lib.DataError) as e:
    data_lib.sources_from_config(_config(f"parquet:{path}", tmp_path))
  assert "{tmp}/bytes.parquet row 1: field 'question' is not UTF-8 text (byte 0xff at byte 2)" in _one_line(
      e.value, tmp_path)


# (method config, key, value, words the one line must hold)
CONFIG_CASES = [
    ("grpo", "seed", -3, "config.seed=-3: must be an integer in [0, 2**32)"),
    ("grpo", "keep_checkpoints", 0, "config.keep_checkpoints=0: must be at least 1"),
    ("grpo", "data.eval_fraction", 1.5, "config.data.eval_fraction=1.5: the held-out share"),
    ("grpo", "data.eval_size", -1, "config.data.eval_size=-1: must be >= 0"),
    ("grpo", "data.max_prompt_len", 0, "config.data.max_prompt_len=0: must be at least 1"),
    ("grpo", "model.attention", "flash", "config.model.attention='flash': must be one of ['auto', 'xla'"),
    ("grpo", "model.compute_dtype", "int8", "config.model.compute_dtype='int8': must be one of"),
    ("grpo", "reward.name", "code", "config.reward.name='code': must be 'math'"),
    ("grpo", "reward.num_workers", 0, "config.reward.num_workers=0: must be at least 1"),
    ("grpo", "optim.b2", 1.0, "config.optim.b2=1.0: Adam's second-moment decay must be in [0, 1)"),
    ("grpo", "optim.grad_clip", 0.0, "config.optim.grad_clip=0.0: the gradient norm's clip must be positive"),
    ("grpo", "optim.warmup_steps", -5, "config.optim.warmup_steps=-5: must be >= 0"),
    ("grpo", "warm_start.steps", -1, "config.warm_start.steps=-1: must be >= 0"),
    ("grpo", "eval.k", 4, "config.eval.k=4: 4 samples at eval.temperature=0.0 would all be the greedy answer"),
    ("grpo", "train.stop_if_unsolvable_steps", -1, "config.train.stop_if_unsolvable_steps=-1: must be >= 0"),
    ("exgrpo", "replay.start_solve_rate", -0.5, "config.replay.start_solve_rate=-0.5: a batch solve rate, >= 0"),
    ("bapo", "replay.c2", 0.5, "config.replay.c2=0.5: must be <= replay.c3 (0.25)"),
    ("bapo", "replay.window", -1, "config.replay.window=-1: must be >= 0"),
    ("advantage_priority", "replay.replay_fraction", -0.5, "config.replay.replay_fraction=-0.5: must be >= 0"),
    ("exprl", "exprl.judge.kind", "grpc", "config.exprl.judge.kind='grpc': must be 'http' or 'model'"),
    ("exprl", "exprl.delimiter", "", "config.exprl.delimiter='': must not be empty"),
    ("exprl", "exprl.judge.timeout_s", 0.0, "config.exprl.judge.timeout_s=0.0: must be positive"),
]


@pytest.mark.parametrize("method, key, value, words", CONFIG_CASES, ids=[f"{c[0]} {c[1]}" for c in CONFIG_CASES])
def test_a_config_value_out_of_range_is_one_line_naming_it(method, key, value, words):
  config = importlib.import_module(f"configs.{method}").get_config()
  config_lib.validate(config)  # the method's own settings pass
  *parents, last = key.split(".")
  with config.unlocked():
    node = config
    for part in parents:
      node = node[part]
    node[last] = value
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(config, num_devices=1)  # as the run checks it, with its device count
  assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


# ------------------------------------------------------------------------------------------------ The main command
# One row through the real command (a few seconds): the seed the table above checks in-process. A bad data file
# reaches it the same way (tests/test_main_errors.py runs a malformed jsonl row through it), at twice the cost.


def _main_error_line(*args: str) -> str:
  env = light_compile.job_env()
  env.pop("JAXRLVR_VERBOSE", None)
  result = subprocess.run([sys.executable, "-m", "jaxrlvr.main", "--config=configs/grpo.py:smoke", *args,
                           f"--config.warm_start.cache_dir={os.environ['JAXRLVR_WARM_START_CACHE']}"],
                          cwd=_REPO, env=env, capture_output=True, text=True, timeout=600)
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert lines[0].startswith("jaxrlvr: error: ")
  return lines[0]


def test_the_main_command_prints_a_value_out_of_range_as_one_line(tmp_path):
  line = _main_error_line(f"--workdir={tmp_path / 'run'}", "--config.seed=-3")
  assert "config.seed=-3: must be an integer in [0, 2**32)" in line, line
