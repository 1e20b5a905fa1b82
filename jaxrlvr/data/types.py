"""What every data module shares: the `Example` record, the `Source` protocol and `DataError`.

This module imports nothing of the package, so the others import it and never each other upwards:

    types <- templates <- synthetic <- tokenizer        types <- sources (the file formats)
    registry (make_source, sources_from_config, held-out splits) -> sources, synthetic
    prompts (checks before a run, warm-start pairs) -> templates
"""
import dataclasses
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class Example:
  """One question. `solution` is a worked solution or reference (the synthetic task's, or a dataset's reference
  column); `messages` is the verl chat prompt when the source has one."""
  qid: int
  question: str
  answer: str
  solution: str | None = None
  data_source: str = ""
  messages: list[dict[str, str]] | None = None


class Source(Protocol):
  """What the trainer needs from a source: a name (the spec it was opened from), a length and random access by qid.

  A source may also have `where(qid) -> str`, the row's place in its file ("line 5 (row 4)"), for messages.
  """
  name: str

  def __len__(self) -> int:
    ...

  def __getitem__(self, qid: int) -> Example:
    ...


class DataError(ValueError):
  """A row or a file that cannot be used, with the file and the row in the message."""


def describe_row(source, qid: int) -> str:
  """Where a qid lives in the user's terms: the source's own `where`, else 'row N'."""
  where = getattr(source, "where", None)
  return where(qid) if where is not None else f"row {qid}"
