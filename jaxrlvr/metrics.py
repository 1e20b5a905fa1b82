"""Where metrics go: DIR/metrics.jsonl (one JSON object per logged step), TensorBoard events, a progress bar.

Only process 0 writes. Values arrive as host floats: the loop fetches device metrics once per logging step.
"""
import json
import os
import time

import numpy as np
import tqdm
from tensorboardX import SummaryWriter

# Shown in the progress bar, in this order, when present.
_PROGRESS_KEYS = (("rollout/solve_rate", "solve"), ("eval/accuracy", "eval"), ("time/step_s", "s/step"),
                  ("replay/replayed_share", "replay"))


def to_python(value):
  """A JSON-able Python scalar from a numpy/jax scalar."""
  value = np.asarray(value)
  if value.size != 1:
    raise ValueError(f"metric values must be scalars, got shape {value.shape}")
  return value.item()


class MetricWriter:
  """Appends to DIR/metrics.jsonl and TensorBoard; keeps the last value of each metric for the progress bar."""

  def __init__(self, workdir: str, *, total_steps: int, initial_step: int = 0, enabled: bool = True,
               show_progress: bool = True):
    self.enabled = enabled
    self.latest: dict[str, float] = {}
    self._jsonl = None
    self._tb = None
    self._bar = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
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

  def advance(self, step: int) -> None:
    """Moves the progress bar to `step` finished steps, showing the latest headline metrics."""
    if self._bar is None:
      return
    shown = {label: f"{self.latest[k]:.3g}" for k, label in _PROGRESS_KEYS if k in self.latest}
    self._bar.set_postfix(shown, refresh=False)
    self._bar.update(step - self._bar.n)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
    if self._jsonl is not None:
      self._jsonl.close()
      self._tb.close()


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
