"""Where a spec string becomes a source, and where a run's (train, eval) pair of sources is chosen.

    make_source("synthetic:arithmetic")          the embedded task (synthetic.py)
    make_source("jsonl:/data/train.jsonl")       one JSON object per line, fields named by the caller (sources.py)
    make_source("parquet:/data/train.parquet")   verl format: `prompt` chat list, `reward_model.ground_truth`
    make_source("tfds:NAME[/CONFIG]:SPLIT")       tensorflow-datasets ArrayRecord data (no TensorFlow needed)
    make_source("hf_disk:/data/ds")              a `datasets` dataset written by `save_to_disk`

Evaluation (`sources_from_config`): `data.eval_source` when it is set; otherwise the synthetic task's test split for
the synthetic task, and for any other source a held-out part of that source: `data.eval_fraction` of its rows
(rounded, at least one), removed from training. The held-out rows are drawn with a fixed seed, not the run's, so every
seed and every method of a comparison trains on the same rows and is evaluated on the same others.
"""
import dataclasses
import os
from typing import Sequence

from absl import logging
import numpy as np

from jaxrlvr.data import sources
from jaxrlvr.data import synthetic
from jaxrlvr.data.types import DataError
from jaxrlvr.data.types import describe_row
from jaxrlvr.data.types import Source

KINDS = ("synthetic", "jsonl", "parquet", "tfds", "hf_disk")
_EXAMPLES = {"jsonl": "jsonl:/data/train.jsonl", "parquet": "parquet:/data/train.parquet",
             "tfds": "tfds:gsm8k:train", "hf_disk": "hf_disk:/data/train_dataset"}
HOLD_OUT_SEED = 0  # fixed: the held-out rows of a file do not change with config.seed (module docstring)


def make_source(spec: str, *, split: str = "train", question_field: str = "question", answer_field: str = "answer",
                solution_field: str = "solution", seed: int = 0, size: int | None = None,
                data_dir: str | None = None, worked_fraction: float = 1.0, phrasing: str = "compact",
                worked_by_level: str = "", levels: str = "") -> Source:
  """Opens the source named by `spec` (see the module docstring for the forms).

  Args:
    split: 'train' or 'test' for the synthetic task; the split of an hf_disk DatasetDict; the tfds split when
      the spec has none. A jsonl or parquet file is one split.
    seed: the synthetic task's question set (its train and test questions are disjoint for every seed).
    size: number of synthetic questions (default 20,000 train, 200 test).
    worked_fraction: the synthetic task's share of questions whose solution shows its work (the rest: the bare
      boxed answer); see jaxrlvr/data/synthetic.py. Any other value with another kind of source is an error.
    levels: the synthetic task's mix of levels ("add2,addsub2,mul2x2"; empty: its four evenly); the same error with
      another kind of source.
    worked_by_level: the synthetic task's worked fraction per level ("add2=1,addsub2=0"; unnamed levels take
      worked_fraction); any other value with another kind of source is an error.
    phrasing: how the synthetic task's questions read, "compact" (47+38) or "sentence" (for chat models); the same
      error with another kind of source.
    data_dir: the tfds data directory (default $TFDS_DATA_DIR, then tfds's own default).
  """
  kind, _, rest = spec.partition(":")
  fields = dict(question_field=question_field, answer_field=answer_field, solution_field=solution_field)
  if kind == "synthetic":
    if rest != "arithmetic":
      raise DataError(f"data source {spec!r}: unknown synthetic task {rest!r}; known: 'arithmetic'")
    return synthetic.ArithmeticSource(split=split, seed=seed, size=size, worked_fraction=worked_fraction,
                                      phrasing=phrasing, worked_by_level=worked_by_level, levels=levels)
  if kind not in KINDS:
    raise DataError(f"data source {spec!r}: unknown kind {kind!r}; known: {', '.join(KINDS)}{_kind_hint(spec)}")
  if worked_fraction != 1.0 or worked_by_level:
    raise DataError(f"data source {spec!r}: worked_fraction={worked_fraction} / worked_by_level={worked_by_level!r} "
                    "apply to the synthetic task only; a dataset's solutions are what the file holds")
  if levels:
    raise DataError(f"data source {spec!r}: levels={levels!r} applies to the synthetic task only")
  if phrasing != "compact":
    raise DataError(f"data source {spec!r}: phrasing={phrasing!r} applies to the synthetic task only; a dataset's "
                    "questions are what the file holds")
  if not rest:
    raise DataError(f"data source {spec!r} names no {'dataset' if kind == 'tfds' else 'path'}; expected e.g. "
                    f"'{_EXAMPLES[kind]}'")
  if kind == "jsonl":
    return sources.load_jsonl(rest, **fields)
  if kind == "parquet":
    return sources.load_parquet(rest, **fields)
  if kind == "hf_disk":
    return sources.load_hf_disk(rest, split=split, **fields)
  name, tfds_split = sources.split_tfds_spec(rest)
  return sources.TfdsSource(name, tfds_split or split, data_dir=data_dir, **fields)


def _kind_hint(spec: str) -> str:
  """' (did you mean 'jsonl:/data/train.jsonl'?)' for a spec without its kind, or with it in capitals."""
  kind, _, rest = spec.partition(":")
  if kind.lower() in KINDS:
    return f" (did you mean '{kind.lower()}:{rest}'?)"
  extension = os.path.splitext(spec)[1].lower()
  guess = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(extension)
  return f" (did you mean '{guess}:{spec}'?)" if guess else ""


class Subset:
  """Some rows of a source, renumbered: qid i is row `rows[i]` of `source`. Its name is the source's (the spec the
  user gave), and `where` names the source's own row, so messages point into the user's file."""

  def __init__(self, source: Source, rows: Sequence[int], *, part: str):
    if not len(rows):
      raise DataError(f"data source {source.name!r}: no {part}")
    self.source, self.part = source, part
    self.rows = [int(r) for r in rows]
    self.name = source.name

  def __len__(self) -> int:
    return len(self.rows)

  def __getitem__(self, qid: int):
    if not 0 <= qid < len(self.rows):
      raise IndexError(f"{self!r}: qid {qid} is outside [0, {len(self.rows)})")
    return dataclasses.replace(self.source[self.rows[qid]], qid=qid)

  def where(self, qid: int) -> str:
    return describe_row(self.source, self.rows[qid])

  def __repr__(self) -> str:
    return f"{self.name} ({self.part})"


def hold_out(source: Source, fraction: float) -> tuple[Subset, Subset]:
  """(training rows, held-out rows): round(fraction x rows), at least one, drawn with `HOLD_OUT_SEED`.

  The held-out rows keep the drawn order, so evaluating on the first `data.eval_size` of them is a random sample;
  the training rows keep the file's order (the question iterator shuffles them).
  """
  n = len(source)
  if not 0 < fraction < 1:
    raise DataError(f"config.data.eval_fraction={fraction!r}: must be in (0, 1) (the share of data.source "
                    f"{source.name} held out for evaluation), or set data.eval_source")
  num_eval = max(1, int(round(n * fraction)))
  if num_eval >= n:
    raise DataError(f"data.source {source.name} has {n} row(s): holding out {num_eval} for evaluation "
                    f"(data.eval_fraction={fraction}) leaves none to train on; set data.eval_source")
  order = np.random.default_rng(HOLD_OUT_SEED).permutation(n)
  return (Subset(source, np.sort(order[num_eval:]), part="training rows"),
          Subset(source, order[:num_eval], part="held-out rows"))


def sources_from_config(config) -> tuple[Source, Source]:
  """(train source, eval source) from `config.data` and `config.seed` (module docstring: which eval source).

  Reads data.{source, eval_source, question_field, answer_field, solution_field, eval_size} and, when present,
  data.eval_fraction (absent: 0, no held-out part), data.data_dir (tfds), data.train_size (synthetic; 0 or absent:
  20,000), data.worked_fraction and data.worked_by_level (the synthetic train split only; other sources ignore
  them), data.levels (the synthetic task's mix, both splits) and data.phrasing (the synthetic task's question text,
  both splits; other sources ignore it). The synthetic test split's solutions always show their work (they are
  references, never trained on).
  """
  data = config.data
  if not data.source:
    raise DataError("config.data.source is empty (the model= presets have no default data): give one, e.g. "
                    "--config.data.source=parquet:/data/train.parquet")
  kwargs = dict(question_field=data.question_field, answer_field=data.answer_field,
                solution_field=data.solution_field, seed=config.seed, data_dir=data.get("data_dir") or None)
  is_synthetic = data.source.startswith("synthetic:")
  phrasing = lambda spec: data.get("phrasing", "compact") if spec.startswith("synthetic:") else "compact"
  levels = lambda spec: data.get("levels", "") if spec.startswith("synthetic:") else ""
  train = make_source(data.source, split="train", size=data.get("train_size") or None,
                      worked_fraction=data.get("worked_fraction", 1.0) if is_synthetic else 1.0,
                      worked_by_level=data.get("worked_by_level", "") if is_synthetic else "",
                      phrasing=phrasing(data.source), levels=levels(data.source), **kwargs)
  if data.eval_source or is_synthetic:
    eval_spec = data.eval_source or data.source
    size = (data.eval_size or None) if eval_spec.startswith("synthetic:") else None
    return train, make_source(eval_spec, split="test", size=size, phrasing=phrasing(eval_spec),
                              levels=levels(eval_spec), **kwargs)
  fraction = data.get("eval_fraction", 0.0)
  if not fraction:
    raise DataError(f"data.source {data.source} has no evaluation set: data.eval_source is empty and "
                    f"data.eval_fraction is {fraction}; set --config.data.eval_fraction (e.g. 0.1) or "
                    "--config.data.eval_source")
  train, held_out = hold_out(train, fraction)
  logging.info("data: evaluating on %d held-out row%s of %s (data.eval_fraction=%g; the same rows for every seed) "
               "and training on the other %d; data.eval_source would evaluate elsewhere", len(held_out),
               "" if len(held_out) == 1 else "s", data.source, fraction, len(train))
  return train, held_out
