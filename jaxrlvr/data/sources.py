"""The file formats: random access to `Example` records by a stable integer id (the row's index in its file).

    jsonl:/data/train.jsonl       one JSON object per line, fields named by the caller
    parquet:/data/train.parquet   verl format: `prompt` chat list, `reward_model.ground_truth`
    tfds:NAME[/CONFIG]:SPLIT      tensorflow-datasets ArrayRecord data (no TensorFlow needed)
    hf_disk:/data/ds              a `datasets` dataset written by `save_to_disk`

`registry.make_source` opens a spec (these and the embedded `synthetic:arithmetic`). Every row is checked when it is
read (the file formats: all at load; tfds: at access, since reading a large ArrayRecord dataset in full would defeat
random access): a missing or empty question or answer stops with the file and the row. A file that cannot be read as
its kind (bytes that are not UTF-8, a file that is not Parquet, a directory `save_to_disk` did not write, a missing
optional package) stops with the path and what to do, never a library's traceback. `QuestionIterator` (iterator.py)
shuffles and shards the ids.
"""
import json
import os
from typing import Any, Sequence

import numpy as np

from jaxrlvr.data.types import DataError
from jaxrlvr.data.types import Example


def _text(value: Any, *, field: str, where: str, required: bool = True) -> str | None:
  """A field as a non-empty string: bytes are decoded, numbers printed, one-element lists unwrapped."""
  if isinstance(value, np.generic):
    value = value.item()
  if isinstance(value, (list, tuple, np.ndarray)) and len(value) == 1:
    value = value[0]
    if isinstance(value, np.generic):
      value = value.item()
  if isinstance(value, bytes):
    try:
      value = value.decode("utf-8")
    except UnicodeDecodeError as e:
      raise DataError(f"{where}: field '{field}' is not UTF-8 text (byte {value[e.start]:#04x} at byte "
                      f"{e.start + 1})") from None
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    value = str(value)
  if value is None or (isinstance(value, str) and not value.strip()):
    if required:
      raise DataError(f"{where}: field '{field}' is missing or empty")
    return None
  if not isinstance(value, str):
    raise DataError(f"{where}: field '{field}' must be text, got {type(value).__name__}: {str(value)[:80]!r}")
  return value


def _messages(value: Any, *, where: str) -> list[dict[str, str]] | None:
  """A verl `prompt` column as a list of {role, content} dicts, or None when the row has no chat list."""
  if value is None or isinstance(value, (str, bytes)):
    return None
  messages = []
  for i, message in enumerate(list(value)):
    if not isinstance(message, dict) or "role" not in message or "content" not in message:
      raise DataError(f"{where}: prompt message {i} must have 'role' and 'content', got {str(message)[:80]!r}")
    messages.append({"role": _text(message["role"], field=f"prompt[{i}].role", where=where),
                     "content": _text(message["content"], field=f"prompt[{i}].content", where=where)})
  return messages or None


def _no_field(field: str, key: str, verl: str, fields, *, has: str = "the row has") -> str:
  """The message for a row (or a file) without the field `config.data.<key>` names: the fields it has instead."""
  return (f"field '{field}' is missing and there is no verl '{verl}' ({has} {sorted(fields)}; "
          f"--config.data.{key}=NAME names another field)")


def row_to_example(row: dict[str, Any], *, qid: int, where: str, default_source: str, question_field: str,
                   answer_field: str, solution_field: str) -> Example:
  """Reads one row of any file format. The named fields come first; verl columns fill in what they lack.

  question: `question_field`, else the last user message of a verl `prompt` chat list.
  answer: `answer_field`, else `reward_model.ground_truth`.
  solution: `solution_field`, else a LUFFY-style `target` (reference answer as chat messages), else None.
  """
  messages = _messages(row.get("prompt"), where=where)
  if row.get(question_field) is not None:
    question = _text(row[question_field], field=question_field, where=where)
  elif messages:
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users:
      raise DataError(f"{where}: the 'prompt' chat list has no user message")
    question = users[-1]
  elif question_field not in row:
    raise DataError(f"{where}: {_no_field(question_field, 'question_field', 'prompt', row)}")
  else:
    raise DataError(f"{where}: field '{question_field}' is missing or empty (and there is no verl 'prompt')")
  reward_model = row.get("reward_model")
  if answer_field not in row and not isinstance(reward_model, dict):
    raise DataError(f"{where}: {_no_field(answer_field, 'answer_field', 'reward_model', row)}")
  if row.get(answer_field) is not None or not isinstance(reward_model, dict):
    answer = _text(row.get(answer_field), field=answer_field, where=where)
  else:
    answer = _text(reward_model.get("ground_truth"), field="reward_model.ground_truth", where=where)
  solution = _text(row.get(solution_field), field=solution_field, where=where, required=False)
  if solution is None and row.get("target") is not None:
    target = row["target"]
    if isinstance(target, (list, tuple)) and target and isinstance(target[0], dict):
      target = target[0].get("content")
    solution = _text(target, field="target", where=where, required=False)
  data_source = _text(row.get("data_source"), field="data_source", where=where, required=False)
  return Example(qid=qid, question=question, answer=answer, solution=solution,
                 data_source=data_source or default_source, messages=messages)


class ListSource:
  """Examples held in memory (the file formats are read and checked in full at load). `name` is the spec it was
  opened from; `positions[qid]`, when given, says where the row is in its file ("line 5 (row 4)")."""

  def __init__(self, name: str, examples: Sequence[Example], positions: Sequence[str] | None = None):
    if not examples:
      raise DataError(f"data source {name!r} has no rows")
    self.name = name
    self._examples = list(examples)
    self._positions = list(positions) if positions is not None else None

  def __len__(self) -> int:
    return len(self._examples)

  def __getitem__(self, qid: int) -> Example:
    return self._examples[qid]

  def where(self, qid: int) -> str:
    return self._positions[qid] if self._positions is not None else f"row {qid}"

  def __repr__(self) -> str:
    return self.name


def _field_kwargs(question_field: str, answer_field: str, solution_field: str) -> dict[str, str]:
  return dict(question_field=question_field, answer_field=answer_field, solution_field=solution_field)


def _check_path(path: str, spec: str, *, want: str) -> None:
  """Stops unless `path` exists and is what the kind reads: want='file' (jsonl, parquet) or 'directory' (hf_disk)."""
  if not os.path.exists(path):
    raise DataError(f"data source {spec!r}: {path} does not exist")
  if want == "file" and os.path.isdir(path):
    raise DataError(f"data source {spec!r}: {path} is a directory; {spec.split(':')[0]}: reads one file")
  if want == "directory" and not os.path.isdir(path):
    raise DataError(f"data source {spec!r}: {path} is a file; hf_disk: reads the directory `save_to_disk` wrote"
                    f"{_kind_hint(path)}")


def _kind_hint(path: str, kind: str = "") -> str:
  """'; it looks like Parquet: use parquet:PATH' when a file's first bytes say it is of another kind than `kind`,
  else ''."""
  try:
    with open(path, "rb") as f:
      head = f.read(4)
  except OSError:
    return ""
  if head == b"PAR1":  # every Parquet file starts (and ends) with these bytes
    looks = "parquet"
  elif head.lstrip()[:1] in (b"{", b"["):
    looks = "jsonl"
  else:
    return ""
  return f"; it looks like {looks}: use {looks}:{path}" if looks != kind else ""


def load_jsonl(path: str, *, question_field: str = "question", answer_field: str = "answer",
               solution_field: str = "solution") -> ListSource:
  """One JSON object per line, UTF-8 (a leading byte-order mark is allowed); blank lines are skipped (qids count
  the rows, errors name the line)."""
  spec = f"jsonl:{path}"
  _check_path(path, spec, want="file")
  name = os.path.splitext(os.path.basename(path))[0]
  examples, positions = [], []
  try:
    f = open(path, "rb")  # bytes, decoded a line at a time: a line that is not UTF-8 is named
  except OSError as e:  # permissions
    raise DataError(f"data source {spec!r}: {path} cannot be read ({e.strerror})") from None
  with f:
    for line_number, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
      except UnicodeDecodeError as e:
        hint = _kind_hint(path, "jsonl") if line_number == 1 else ""
        raise DataError(f"{path} line {line_number}: not UTF-8 text (byte {raw[e.start]:#04x} at byte {e.start + 1} "
                        f"of the line); save the file as UTF-8{hint}") from None
      if not line.strip():
        continue
      position = f"line {line_number} (row {len(examples)})"
      where = f"{path} {position}"
      try:
        row = json.loads(line.rstrip("\r\n"))  # with its newline, a cut-off row fails at "line 2 column 1"
      except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
      if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
      examples.append(row_to_example(row, qid=len(examples), where=where, default_source=name,
                                     **_field_kwargs(question_field, answer_field, solution_field)))
      positions.append(position)
  return ListSource(spec, examples, positions)


def _check_columns(path: str, columns: Sequence[str], *, question_field: str, answer_field: str) -> None:
  """A table (parquet, hf_disk) must have the question and the answer, by name or as verl's columns."""
  has = "its columns are"
  if question_field not in columns and "prompt" not in columns:
    raise DataError(f"{path}: {_no_field(question_field, 'question_field', 'prompt', columns, has=has)}")
  if answer_field not in columns and "reward_model" not in columns:
    raise DataError(f"{path}: {_no_field(answer_field, 'answer_field', 'reward_model', columns, has=has)}")


def load_parquet(path: str, *, question_field: str = "question", answer_field: str = "answer",
                 solution_field: str = "solution") -> ListSource:
  """A parquet file, typically verl's layout (`prompt`, `reward_model`, `data_source`, ...)."""
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  spec = f"parquet:{path}"
  _check_path(path, spec, want="file")
  try:
    table = pq.read_table(path)
  except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError, its ArrowIOError an OSError
    reason = " ".join(str(e).split())[:300]
    raise DataError(f"data source {spec!r}: {path} is not a Parquet file that can be read ({reason})"
                    f"{_kind_hint(path, 'parquet')}") from None
  _check_columns(path, table.column_names, question_field=question_field, answer_field=answer_field)
  name = os.path.splitext(os.path.basename(path))[0]
  wanted = {question_field, answer_field, solution_field, "prompt", "reward_model", "target", "data_source"}
  columns = {c: table.column(c).to_pylist() for c in table.column_names if c in wanted}
  examples = []
  for i in range(table.num_rows):
    row = {c: values[i] for c, values in columns.items()}
    examples.append(row_to_example(row, qid=i, where=f"{path} row {i}", default_source=name,
                                   **_field_kwargs(question_field, answer_field, solution_field)))
  return ListSource(spec, examples)


def load_hf_disk(path: str, *, split: str = "train", question_field: str = "question",
                 answer_field: str = "answer", solution_field: str = "solution") -> ListSource:
  """A `datasets.Dataset` (or a `DatasetDict`, from which `split` is taken) saved with `save_to_disk`."""
  spec = f"hf_disk:{path}"
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise DataError(f"data source {spec!r}: hf_disk: needs the datasets package: pip install datasets") from None
  _check_path(path, spec, want="directory")
  try:
    dataset = datasets.load_from_disk(path)
  except (OSError, ValueError) as e:  # FileNotFoundError: not save_to_disk's directory; pyarrow's: a damaged one
    reason = " ".join(str(e).split())[:300]
    raise DataError(f"data source {spec!r}: {path} is not a dataset written by `save_to_disk` ({reason})") from None
  if isinstance(dataset, datasets.DatasetDict):
    if split not in dataset:
      raise DataError(f"hf_disk:{path}: no split {split!r}; it has {sorted(dataset)}")
    dataset = dataset[split]
  _check_columns(path, dataset.column_names, question_field=question_field, answer_field=answer_field)
  name = os.path.basename(os.path.normpath(path))
  examples = [row_to_example(row, qid=i, where=f"{path} row {i}", default_source=name,
                             **_field_kwargs(question_field, answer_field, solution_field))
              for i, row in enumerate(dataset)]
  return ListSource(spec, examples)


class TfdsSource:
  """A tfds dataset through `tfds.data_source` (ArrayRecord random access). Rows are checked when read."""

  def __init__(self, name: str, split: str, *, data_dir: str | None, question_field: str, answer_field: str,
               solution_field: str):
    self.name = f"tfds:{name}:{split}"
    needs = f"data source {self.name!r}: tfds: needs tensorflow-datasets and array-record: pip install -e '.[tfds]'"
    try:
      import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise DataError(needs) from None
    self._fields = _field_kwargs(question_field, answer_field, solution_field)
    self._default_source = name
    data_dir = data_dir or os.environ.get("TFDS_DATA_DIR") or None
    try:
      self._rows = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except ImportError as e:  # array_record, imported when a dataset is opened
      raise DataError(f"{needs} ({e})") from None
    except Exception as e:  # tfds raises several types, some with a list of every dataset it knows.
      # Up to tfds's list of every dataset it knows, when it gives one.
      reason = " ".join(str(e).split("\nAvailable datasets")[0].split())[:400]
      raise DataError(f"data source {self.name!r} (data_dir={data_dir!r}) cannot be opened: {type(e).__name__}: "
                      f"{reason} (nothing is downloaded: prepare it first, `tfds build {name} "
                      "--file_format=array_record --data_dir=DIR`, and set data.data_dir=DIR)") from None
    if len(self._rows) == 0:
      raise DataError(f"data source {self.name!r} (data_dir={data_dir!r}) has no rows")
    self._where = os.path.join(data_dir or "~/tensorflow_datasets", name)

  def __len__(self) -> int:
    return len(self._rows)

  def __repr__(self) -> str:
    return self.name

  def __getitem__(self, qid: int) -> Example:
    if not 0 <= qid < len(self._rows):
      raise IndexError(f"{self.name}: qid {qid} is outside [0, {len(self._rows)})")
    return row_to_example(dict(self._rows[qid]), qid=qid, where=f"{self._where} ({self.name}) row {qid}",
                          default_source=self._default_source, **self._fields)


def split_tfds_spec(rest: str) -> tuple[str, str]:
  """'NAME[/CONFIG][:VERSION][:SPLIT]' -> (name, split): the split follows the last ':' outside brackets, so
  slices such as 'train[:10%]' stay whole."""
  depth = 0
  for i in range(len(rest) - 1, -1, -1):
    depth += {"]": 1, "[": -1}.get(rest[i], 0)
    if rest[i] == ":" and depth == 0:
      name, split = rest[:i], rest[i + 1:]
      if split[:1].isdigit():  # 'mnist:3.0.1' names a version, not a split.
        return rest, ""
      return name, split
  return rest, ""
