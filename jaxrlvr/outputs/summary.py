"""One run at a glance: DIR/summary.png, which the trainer's metric writer redraws at every evaluation, against RL
steps (held-out accuracy, the batch solve rate, response lengths, the replayed share of each batch)."""
import numpy as np
from matplotlib import ticker
# Figure objects without pyplot: no backend to choose and no global state, so a notebook's inline plots are left
# alone, and it draws without a display in CI and on pods.
from matplotlib.figure import Figure

from jaxrlvr import health
from jaxrlvr.outputs import records
from jaxrlvr.outputs.records import smooth


def run_summary(rows: dict[int, dict], path: str, *, title: str, total_steps: int | None = None) -> str:
  """One run at a glance against RL steps: held-out accuracy (all questions, and per data source when there are
  several), the batch solve rate, response lengths, and the replayed share of each batch. `rows` is {step: row} of
  the run's metrics.jsonl (`records.read_rows`); the x axis runs to `total_steps` so the figure shows how far along
  the run is."""
  def series(key: str) -> tuple[np.ndarray, np.ndarray]:
    steps = [s for s in sorted(rows) if key in rows[s]]
    return np.asarray(steps, np.int64), np.asarray([rows[s][key] for s in steps], np.float64)

  fig = Figure(figsize=(11, 7.5))
  (accuracy_ax, solve_ax), (length_ax, replay_ax) = fig.subplots(2, 2, sharex=True)
  eval_steps, accuracy = series(records.ACCURACY_KEY)
  sources = sorted(k for k in {k for row in rows.values() for k in row}
                   if k.startswith("eval/") and k.endswith("/accuracy") and k != records.ACCURACY_KEY)
  for i, key in enumerate(sources):
    source = key[len("eval/"):-len("/accuracy")]
    accuracy_ax.plot(*series(key), ".-", color=f"C{i}", lw=1, ms=4, alpha=0.7, label=source)
  accuracy_ax.plot(eval_steps, accuracy, "o-", color="black", lw=2, ms=5, label="all held-out questions", zorder=3)
  count_steps, counts = series(health.QUESTIONS_KEY)
  if len(counts) == len(accuracy) and len(counts):  # a run from before eval/questions was logged has no band
    se = np.asarray([health.standard_error(p, int(n)) for p, n in zip(accuracy, counts)])
    sizes = sorted({int(n) for n in counts})
    accuracy_ax.fill_between(count_steps, np.clip(accuracy - se, 0, 1), np.clip(accuracy + se, 0, 1), color="black",
                             alpha=0.15, lw=0,
                             label=f"±1 standard error ({', '.join(map(str, sizes))} questions)")
  accuracy_ax.set(ylim=(-0.02, 1.02), ylabel="held-out accuracy (greedy)", title="Held-out accuracy")

  _per_step(solve_ax, *series("rollout/solve_rate"), color="tab:blue", label="correct / sampled rollouts")
  solve_ax.set(ylim=(-0.02, 1.02), ylabel="batch solve rate", title="Solve rate of the sampled rollouts")

  _per_step(length_ax, *series("rollout/response_length"), color="tab:orange", label="sampled rollouts (mean)")
  length_ax.plot(*series("eval/response_length"), "o-", color="black", lw=1.5, ms=4, label="held-out, greedy (mean)")
  length_ax.set_ylim(bottom=0)
  length_ax.set(ylabel="response length (tokens)", title="Response length")

  share_steps, share = series("replay/replayed_share")
  _per_step(replay_ax, share_steps, share, color="tab:red", label="replayed rollouts / batch rollouts")
  token_steps = [s for s in sorted(rows) if "policy/replayed/tokens" in rows[s] and "policy/fresh/tokens" in rows[s]]
  replayed, fresh = (np.asarray([rows[s][f"policy/{kind}/tokens"] for s in token_steps], np.float64)
                     for kind in ("replayed", "fresh"))
  _per_step(replay_ax, np.asarray(token_steps, np.int64), replayed / np.maximum(replayed + fresh, 1.0),
            color="tab:purple", label="replayed tokens / trained tokens")
  if not np.nan_to_num(share).any():
    replay_ax.text(0.5, 0.5, "no rollout replayed so far" if len(share) else "no training step logged yet",
                   transform=replay_ax.transAxes, ha="center", va="center", color="gray")
  replay_ax.set(ylim=(-0.02, 1.02), ylabel="replayed share", title="Replay in the update batch")

  last = max(rows) if rows else 0
  for ax in (accuracy_ax, solve_ax, length_ax, replay_ax):
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    right = max(total_steps or 0, last, 1)
    ax.set_xlim(-0.01 * right, 1.01 * right)  # the margin keeps the markers of step 0 and the last step whole
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8, loc="best")
  for ax in (length_ax, replay_ax):
    ax.set_xlabel("RL step")
  progress = f"step {last}" + (f" of {total_steps}" if total_steps else "")
  if len(accuracy):
    first, last_row = rows[int(eval_steps[0])], rows[int(eval_steps[-1])]
    shown = lambda row, p: (health.interval(p, int(row[health.QUESTIONS_KEY])) if row.get(health.QUESTIONS_KEY)
                            else f"{p:.3f}")
    progress += (f"; held-out accuracy {shown(first, accuracy[0])} (step {eval_steps[0]}) -> "
                 f"{shown(last_row, accuracy[-1])} (step {eval_steps[-1]})")
  fig.suptitle(f"{title}\n{progress}")
  # Fixed margins rather than tight_layout, which measures every label and would double the drawing time.
  fig.subplots_adjust(left=0.065, right=0.985, bottom=0.075, top=0.87, wspace=0.17, hspace=0.2)
  fig.savefig(path, dpi=100)
  return path


def _per_step(ax, steps: np.ndarray, values: np.ndarray, *, color: str, label: str) -> None:
  """A per-step metric: the logged values, faint, and over many steps a trailing moving average on top (one step's
  batch is small and noisy)."""
  if not len(values):
    return
  window = len(values) // 20 if len(values) >= 40 else 1
  if window <= 1:
    ax.plot(steps, values, ".-", color=color, lw=1.2, ms=4, label=label)
    return
  ax.plot(steps, values, color=color, lw=0.8, alpha=0.3)
  ax.plot(steps, smooth(values, window), color=color, lw=1.8, label=f"{label} ({window}-step moving average)")
