"""Where metrics go: DIR/metrics.jsonl (one JSON object per logged step), TensorBoard events, a progress bar, and at
every evaluation a log line, DIR/summary.png (the run so far as a picture) and DIR/samples.jsonl (a few held-out
prompts with their greedy completions and rewards).

Only process 0 writes. Values arrive as host floats: the loop fetches device metrics once per logging step.
"""
import concurrent.futures
import json
import os
import sys
import time

import numpy as np
import tqdm
from absl import logging

from jaxrlvr import health
from jaxrlvr.outputs import records


def _summary_writer_class():
  """tensorboardX's SummaryWriter, imported without torch.

  tensorboardX imports torch whenever it is installed (the `peers` extra installs it), only to accept torch tensors,
  which this writer never passes; that import cost every run and test process ~1.6 s. With torch hidden
  for the import, tensorboardX takes it as absent; a later `import torch` works as usual. A torch already imported
  stays as it is."""
  hide = "torch" not in sys.modules
  if hide:
    sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
  try:
    from tensorboardX import SummaryWriter as writer_class  # pylint: disable=g-import-not-at-top
  finally:
    if hide:
      del sys.modules["torch"]
  return writer_class


SummaryWriter = _summary_writer_class()

# Shown in the progress bar, in this order, when present.
_PROGRESS_KEYS = (("rollout/solve_rate", "solve"), ("eval/accuracy", "eval"), ("time/step_s", "s/step"),
                  ("replay/replayed_share", "replay"))
SUMMARY_FILE = "summary.png"
SAMPLES_FILE = "samples.jsonl"


def to_python(value):
  """A JSON-able Python scalar from a numpy/jax scalar."""
  value = np.asarray(value)
  if value.size != 1:
    raise ValueError(f"metric values must be scalars, got shape {value.shape}")
  return value.item()


class MetricWriter:
  """Appends to DIR/metrics.jsonl and TensorBoard; keeps the last value of each metric for the progress bar.

  With `summary_title`, every row that holds an evaluation also redraws DIR/summary.png (`summary.run_summary`, titled
  so) from every row of metrics.jsonl, a resumed run's earlier ones included. The final step always evaluates, so the
  last picture is the finished run. The figure is drawn in a background thread (a third of a second, and two for the
  first import of matplotlib) while training goes on; the next drawing and `close` wait for it.
  """

  def __init__(self, workdir: str, *, total_steps: int, initial_step: int = 0, enabled: bool = True,
               show_progress: bool = True, summary_title: str | None = None):
    self.enabled = enabled
    self.workdir = workdir
    self.latest: dict[str, float] = {}
    self._total_steps = total_steps
    self._summary_title = summary_title
    self._rows: dict[int, dict] = {}  # every step's last row, for the summary
    self._drawer = None
    self._drawing = None  # the Future of the summary being drawn
    self._jsonl = None
    self._tb = None
    self._bar = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "metrics.jsonl")
    if summary_title is not None:
      self._rows = records.read_rows(path) if os.path.exists(path) else {}
      self._drawer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="summary")
    self._jsonl = open(path, "a", encoding="utf-8")
    self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
    if show_progress:
      self._bar = tqdm.tqdm(total=total_steps, initial=initial_step, dynamic_ncols=True, desc="train")

  def write(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    row = {"step": int(step), "time": time.time()}
    row.update({k: to_python(v) for k, v in sorted(metrics.items())})
    self._jsonl.write(json.dumps(row) + "\n")
    self._jsonl.flush()
    for key, value in row.items():
      if key not in ("step", "time") and np.isfinite(value):
        self._tb.add_scalar(key, value, step)
    self._tb.flush()
    self.latest.update(row)
    self._rows[row["step"]] = row
    if records.ACCURACY_KEY in row:
      logging.info("step %d: %s", step, eval_line(row))
      if self._drawer is not None:
        self._wait_for_summary()
        self._drawing = self._drawer.submit(_draw_summary, dict(self._rows), os.path.join(self.workdir, SUMMARY_FILE),
                                            title=self._summary_title, total_steps=self._total_steps)

  def _wait_for_summary(self) -> None:
    """Waits for the summary being drawn; a drawing that failed raises here, in the training thread."""
    if self._drawing is not None:
      drawing, self._drawing = self._drawing, None
      drawing.result()

  def write_samples(self, step: int, samples: list[dict]) -> None:
    """Appends one JSON object per sample (prompt, completion, reward, ...) with `step` to DIR/samples.jsonl."""
    if not self.enabled or not samples:
      return
    with open(os.path.join(self.workdir, SAMPLES_FILE), "a", encoding="utf-8") as f:
      for sample in samples:
        f.write(json.dumps({"step": int(step), **sample}) + "\n")

  def advance(self, step: int) -> None:
    """Moves the progress bar to `step` finished steps, showing the latest headline metrics."""
    if self._bar is None:
      return
    shown = {label: f"{self.latest[k]:.3g}" for k, label in _PROGRESS_KEYS if k in self.latest}
    if "eval" in shown and self.latest.get(health.QUESTIONS_KEY):  # beside it, its standard error
      shown["eval"] = health.interval(self.latest[records.ACCURACY_KEY], int(self.latest[health.QUESTIONS_KEY]))
    self._bar.set_postfix(shown, refresh=False)
    self._bar.update(step - self._bar.n)

  def close(self) -> None:
    if self._drawer is not None:
      self._wait_for_summary()
      self._drawer.shutdown()
    if self._bar is not None:
      self._bar.close()
    if self._jsonl is not None:
      self._jsonl.close()
      self._tb.close()


def _draw_summary(rows: dict[int, dict], path: str, *, title: str, total_steps: int) -> str:
  # Imported here, in the drawing thread: matplotlib takes seconds to import, and only a writer that draws needs it.
  from jaxrlvr.outputs import summary
  # Drawn beside it, then renamed over it: an image viewer that reloads the file never reads half a PNG.
  partial = os.path.join(os.path.dirname(path), ".partial-" + os.path.basename(path))
  summary.run_summary(rows, partial, title=title, total_steps=total_steps)
  os.replace(partial, path)
  return path


def eval_line(row: dict) -> str:
  """An evaluation row in one line: accuracy with its standard error and question count, then pass@k, avg@k and the
  greedy response length when present (the per-source values are in metrics.jsonl and the summary figure)."""
  accuracy, n = row[records.ACCURACY_KEY], int(row.get(health.QUESTIONS_KEY, 0))
  parts = [f"held-out accuracy {health.interval(accuracy, n)} ({n} questions)" if n
           else f"held-out accuracy {accuracy:.3f}"]
  for key in sorted(row):
    name = key[len("eval/"):]
    if key.startswith("eval/") and "/" not in name and key not in (records.ACCURACY_KEY, health.QUESTIONS_KEY):
      parts.append(f"{name} {row[key]:.3g}")
  return ", ".join(parts)


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
