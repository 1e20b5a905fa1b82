"""Figures of a method comparison, one PNG per question, the x axis in generated rollout tokens (the budget) but for
accuracy against training time (`accuracy_vs_wall`, where the supervised control, which generates no tokens, meets
the RL runs). One run's own summary against RL steps is the run's output (outputs/summary.py).

Comparison curves are per arm (a method or a variant of one): the mean over seeds with a band of the 95% t-interval
(no band with one seed).
Per-step metrics are smoothed with a trailing moving average before averaging, since a step's batch is small and
noisy. Inputs are `outputs.RunData` objects (anything with .method, .seed, .tokens and .series(key)).
"""
import os
import warnings
from collections.abc import Sequence

import numpy as np
from matplotlib import ticker
# Figure objects without pyplot: no backend to choose, no global state, so importing this module in a notebook
# leaves its inline plots alone, and it runs without a display in CI and on pods.
from matplotlib.figure import Figure

from jaxrlvr import outputs
from jaxrlvr.outputs import smooth

_GRID = 101  # points of the common budget axis every run is interpolated onto
_COLORS = {"grpo": "black", "exgrpo": "tab:red", "advantage_priority": "tab:blue", "bapo": "tab:green",
           "exprl": "tab:purple", "sft": "tab:gray"}
# Arms without a colour of their own (the ablations) take these in order of appearance: none of _COLORS' colours.
_EXTRA_COLORS = ("tab:orange", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "gold", "navy", "lime", "teal")


def _color(method: str, methods: Sequence[str]) -> str:
  if method in _COLORS:
    return _COLORS[method]
  others = [m for m in methods if m not in _COLORS]
  return _EXTRA_COLORS[others.index(method) % len(_EXTRA_COLORS)]


def _nanmean(values, axis: int = 0):
  """Mean over `axis` ignoring NaNs (NaN where every value is NaN, without numpy's warning)."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    return np.nanmean(np.asarray(values, np.float64), axis=axis)


def _by_method(runs) -> dict:
  out: dict = {}
  for r in runs:
    out.setdefault(r.method, []).append(r)
  return out


def _band(ax, grid: np.ndarray, curves: np.ndarray, color: str, label: str, bounds=None) -> None:
  """Mean line and CI band over runs; columns where a run has no value (NaN) use the runs that do. `bounds` (lo, hi)
  clips the band to the metric's range (a t-interval over 3 seeds can reach past a rate's [0, 1])."""
  keep = ~np.all(np.isnan(curves), axis=0)
  if not keep.any():
    return
  grid, curves = grid[keep], curves[:, keep]
  if np.isnan(curves).any():
    mean = _nanmean(curves)
    half = np.full_like(mean, np.nan)
  else:
    mean, half = outputs.confidence_interval(curves)
  n = len(curves)
  ax.plot(grid, mean, color=color, label=f"{label} (n={n})", lw=1.6, zorder=3)  # lines above every band
  if not np.all(np.isnan(half)):
    lo, hi = (-np.inf, np.inf) if bounds is None else bounds
    ax.fill_between(grid, np.clip(mean - half, lo, hi), np.clip(mean + half, lo, hi), color=color, alpha=0.15, lw=0,
                    zorder=1)


def _interp(grid: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
  """y at the grid, linear between points and NaN outside them (no extrapolation of a metric)."""
  ok = ~np.isnan(y)
  if not ok.any():
    return np.full_like(grid, np.nan)
  out = np.interp(grid, x[ok], y[ok])
  return np.where((grid >= x[ok][0]) & (grid <= x[ok][-1]), out, np.nan)


def _finish(fig, ax, path: str, *, xlabel: str, ylabel: str, title: str, grid: bool = True) -> str:
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  if grid:
    ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return path


_BUDGET_LABEL = "rollout budget (generated tokens)"


def _regime(regime: str) -> str:
  return f" ({regime})" if regime else ""


def accuracy_vs_budget(runs, budget: float, path: str, *, key: str = outputs.ACCURACY_KEY,
                       ylabel: str = "held-out accuracy (greedy)", name: str = "Held-out accuracy",
                       regime: str = "") -> str | None:
  """An evaluation metric (greedy accuracy; or pass@k) against tokens: evaluations joined linearly, as the AUC reads
  them (`_budget_curve`). None (nothing written) when no run logged `key`."""
  grid = np.linspace(0, budget, _GRID)
  groups = _by_method(runs)
  if not any(len(r.series(key)[0]) for r in runs):
    return None
  fig = Figure(figsize=(7, 4.5))
  ax = fig.subplots()
  for method, members in groups.items():
    curves = []
    for r in members:
      _, x, y = r.series(key)
      keep = x <= budget
      if not keep.any():
        continue
      curves.append(_budget_curve(r, key, grid))
      ax.plot(x[keep], y[keep], ".", color=_color(method, groups), alpha=0.35, ms=4)
    if curves:
      _band(ax, grid, np.asarray(curves), _color(method, groups), method, bounds=(0, 1))
  ax.set_ylim(0, 1)
  return _finish(fig, ax, path, xlabel=_BUDGET_LABEL, ylabel=ylabel,
                 title=f"{name} vs rollout budget{_regime(regime)}\n(mean ± 95% CI over seeds; dots: single "
                 "evaluations)")


def _budget_curve(run, key: str, grid: np.ndarray) -> np.ndarray:
  """An evaluation metric of one run on the budget grid, as the AUC reads it: evaluations joined linearly up to the
  first one past the end of the grid (the budget's own, at most one step past it), the last one held where there is
  none; NaN before the first evaluation when it is not at 0 tokens."""
  _, x, y = run.series(key)
  keep = np.arange(len(x)) <= np.searchsorted(x, grid[-1], side="right")
  if not keep.any():
    return np.full_like(grid, np.nan)
  return np.interp(grid, x[keep], y[keep]) if x[keep][0] == 0 else _interp(grid, x[keep], y[keep])


def paired_vs_budget(runs, budget: float, path: str, *, baseline: str, key: str = outputs.ACCURACY_KEY,
                     name: str = "held-out accuracy", regime: str = "") -> str | None:
  """Each arm's metric minus the `baseline` run of the same seed against tokens, mean and 95% band over the seeds
  that have both: the paired difference the results table reads, along the budget. A seed moves accuracy by more
  than the methods do (the bands of `accuracy_vs_budget` overlap for that reason); pairing takes that out. None
  when there is no baseline run or no other arm."""
  grid = np.linspace(0, budget, _GRID)
  groups = _by_method(runs)
  reference = {r.seed: _budget_curve(r, key, grid) for r in groups.get(baseline, [])}
  others = {m: members for m, members in groups.items() if m != baseline}
  if not reference or not others or not any(len(r.series(key)[0]) for r in runs):
    return None
  fig = Figure(figsize=(7, 4.5))
  ax = fig.subplots()
  ax.axhline(0.0, color=_color(baseline, groups), lw=1.0, label=f"{baseline} (the baseline)")
  for method, members in others.items():
    curves = [_budget_curve(r, key, grid) - reference[r.seed] for r in members if r.seed in reference]
    if curves:
      _band(ax, grid, np.asarray(curves), _color(method, groups), method)
  return _finish(fig, ax, path, xlabel=_BUDGET_LABEL, ylabel=f"{name} - {baseline} (same seed)",
                 title=f"{name[0].upper() + name[1:]} minus {baseline}, paired by seed{_regime(regime)}\n(mean ± 95% "
                 "CI over seeds)")


def accuracy_vs_wall(runs, path: str, *, regime: str = "") -> str:
  """Greedy held-out accuracy against training seconds (`RunData.wall`: step times summed, evaluations excluded):
  the x axis on which the supervised control, which generates no tokens, is set against the RL runs. Each curve runs
  to the shortest run of its arm (the mean needs every seed)."""
  groups = _by_method(runs)
  end = max(max(r.wall.values()) for r in runs)
  grid = np.linspace(0, end, _GRID)
  fig = Figure(figsize=(7, 4.5))
  ax = fig.subplots()
  for method, members in groups.items():
    curves = []
    for r in members:
      steps, _, y = r.series(outputs.ACCURACY_KEY)
      x = np.asarray([r.wall[s] for s in steps], np.float64)
      curves.append(_interp(grid, x, y))
      ax.plot(x, y, ".", color=_color(method, groups), alpha=0.35, ms=4)
    curves = np.asarray(curves)
    curves[:, np.isnan(curves).any(axis=0)] = np.nan  # where a seed has ended, the mean would change its members
    _band(ax, grid, curves, _color(method, groups), method, bounds=(0, 1))
  ax.set_ylim(0, 1)
  return _finish(fig, ax, path, xlabel="training time (s: step times summed, evaluations excluded)",
                 ylabel="held-out accuracy (greedy)",
                 title=f"Held-out accuracy vs training time{_regime(regime)}\n(mean ± 95% CI over seeds; sft: "
                 "supervised control, no rollouts)")


def metric_vs_budget(runs, key: str, budget: float, path: str, *, ylabel: str, title: str, window: int = 10,
                     valid_key: str | None = None, bounds=None) -> str | None:
  """A per-step metric against tokens; steps where `valid_key` is 0 (e.g. no replayed tokens) are left out;
  `bounds` (lo, hi): the metric's range, for the axis and the bands. Returns None (writing nothing) when no run
  logs the metric."""
  grid = np.linspace(0, budget, _GRID)
  groups = _by_method(runs)
  curves = {}
  for method, members in groups.items():
    rows = []
    for r in members:
      steps, x, y = r.series(key)
      if not len(y):
        continue
      if valid_key is not None:
        valid = np.asarray([r.rows[s].get(valid_key, 0) > 0 for s in steps])
        y = np.where(valid, y, np.nan)
      rows.append(_interp(grid, x, smooth(y, window)))
    if rows and not np.all(np.isnan(np.asarray(rows))):
      curves[method] = np.asarray(rows)
  if not curves:
    return None
  fig = Figure(figsize=(7, 4.5))
  ax = fig.subplots()
  for method, rows in curves.items():
    _band(ax, grid, rows, _color(method, groups), method, bounds=bounds)
  if bounds is not None:
    ax.set_ylim(*bounds)
  return _finish(fig, ax, path, xlabel=_BUDGET_LABEL, ylabel=ylabel,
                 title=f"{title} ({window}-step moving average)" if window > 1 else title)


def bucket_heatmap(runs, path: str, *, method: str = "exgrpo") -> str | None:
  """ExGRPO's buffer over time: questions in each bucket k (k of K answers correct), mean over the method's seeds."""
  members = [r for r in runs if r.method == method]
  keys = sorted({k for r in members for row in r.rows.values() for k in row if k.startswith("replay/bucket_")},
                key=lambda k: int(k.rsplit("_", 1)[1]))
  if not keys:
    return None
  last = min(max(r.rows) for r in members)
  counts = np.full((len(members), len(keys), last), np.nan)  # [seeds, buckets, steps 1..last]
  for i, r in enumerate(members):
    for j, key in enumerate(keys):
      steps, _, y = r.series(key)
      keep = (steps >= 1) & (steps <= last)
      counts[i, j, steps[keep] - 1] = y[keep]
  mean = _nanmean(counts)  # [buckets, steps]
  fig = Figure(figsize=(8, 3.8))
  ax = fig.subplots()
  image = ax.imshow(mean, aspect="auto", origin="lower", interpolation="nearest", cmap="viridis", vmin=0,
                    extent=(0.5, last + 0.5, int(keys[0].rsplit("_", 1)[1]) - 0.5,
                            int(keys[-1].rsplit("_", 1)[1]) + 0.5))
  fig.colorbar(image, ax=ax, label="questions in the bucket")
  ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
  ax.yaxis.set_major_locator(ticker.MaxNLocator(integer=True))
  return _finish(fig, ax, path, xlabel="RL step", ylabel="bucket k (correct answers of K)", grid=False,
                 title=f"ExGRPO buffer: questions per bucket over time (mean of {len(members)} seed(s))")


def ratio_stats(runs, budget: float, path: str, *, window: int = 10) -> str:
  """Importance ratios of fresh and replayed tokens: mean ± std, and the extremes (log scale)."""
  grid = np.linspace(0, budget, _GRID)
  groups = _by_method(runs)
  fig = Figure(figsize=(11, 7))
  axes = fig.subplots(2, 2, sharex=True)
  for row, kind in enumerate(("fresh", "replayed")):
    for method, members in groups.items():
      color = _color(method, groups)
      curves = {}
      for stat in ("mean", "std", "max", "min"):
        rows = []
        for r in members:
          steps, x, y = r.series(f"policy/{kind}/ratio_{stat}")
          valid = np.asarray([r.rows[s].get(f"policy/{kind}/tokens", 0) > 0 for s in steps], bool)
          rows.append(_interp(grid, x, smooth(np.where(valid, y, np.nan), window)) if len(y) else
                      np.full_like(grid, np.nan))
        curves[stat] = None if np.all(np.isnan(rows)) else _nanmean(rows)
      if curves["mean"] is None:
        continue
      axes[row, 0].plot(grid, curves["mean"], color=color, label=method)
      axes[row, 0].fill_between(grid, curves["mean"] - curves["std"], curves["mean"] + curves["std"], color=color,
                                alpha=0.15, lw=0)
      axes[row, 1].plot(grid, curves["max"], color=color, label=f"{method} max")
      axes[row, 1].plot(grid, curves["min"], color=color, ls="--", label=f"{method} min")
    axes[row, 0].set_ylabel(f"{kind} tokens: ratio mean ± std")
    axes[row, 1].set_ylabel(f"{kind} tokens: ratio max / min")
    _ratio_axes(*axes[row], empty=f"no {kind} tokens in these runs")
  axes[0, 0].set_title("w = pi / pi_old (fresh), w* = pi / pi_recorded (replayed)")
  axes[0, 1].set_title("extremes of the ratio per step")
  for ax in axes[1]:
    ax.set_xlabel(_BUDGET_LABEL)
  fig.suptitle(f"Importance ratios by token kind (mean over seeds, {window}-step moving average)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return path


def _ratio_axes(linear, log, *, empty: str) -> None:
  """Readable ratio axes: at least [0.95, 1.05] and [0.5, 2], so float noise around w = 1 (one optimizer step per RL
  step makes every fresh ratio 1) reads as a flat line at 1 rather than as a magnified offset axis."""
  for ax in (linear, log):
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=7)
    else:
      ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center", color="gray")
  lo, hi = linear.get_ylim()
  linear.set_ylim(min(lo, 0.95), max(hi, 1.05))
  linear.ticklabel_format(axis="y", useOffset=False)
  log.set_yscale("log")
  lo, hi = log.get_ylim()
  log.set_ylim(min(lo, 0.5), max(hi, 2.0))
  log.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
  log.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
  log.yaxis.set_minor_formatter(ticker.NullFormatter())


def write_all(runs, budget: float, outdir: str, *, regime: str = "", baseline: str = "grpo") -> list[str]:
  """Every figure of the comparison into `outdir`; returns the paths written (a figure with no data is skipped).
  Runs of kind "sft" (no rollouts) appear in the training-time figure only; the paired figures take each arm's
  difference to the `baseline` run of its seed."""
  os.makedirs(outdir, exist_ok=True)
  out = os.path.join
  everything, runs = runs, [r for r in runs if getattr(r, "kind", "rl") != "sft"]
  pass_keys = sorted({k for r in runs for row in r.rows.values() for k in row
                      if k.startswith("eval/pass@") and k.count("/") == 1})
  paths = [
      accuracy_vs_budget(runs, budget, out(outdir, "accuracy_vs_budget.png"), regime=regime),
      *[accuracy_vs_budget(runs, budget, out(outdir, f"{k[len('eval/'):].replace('@', '_at_')}_vs_budget.png"),
                           key=k, name=f"Held-out {k[len('eval/'):]}", regime=regime,
                           ylabel=f"held-out {k[len('eval/'):]} (sampled at eval.temperature)") for k in pass_keys],
      paired_vs_budget(runs, budget, out(outdir, f"accuracy_minus_{baseline}_vs_budget.png"), baseline=baseline,
                       regime=regime),
      *[paired_vs_budget(runs, budget, out(outdir, f"{k[len('eval/'):].replace('@', '_at_')}_minus_{baseline}"
                                               "_vs_budget.png"), baseline=baseline, key=k,
                         name=f"held-out {k[len('eval/'):]}", regime=regime) for k in pass_keys],
      accuracy_vs_wall(everything, out(outdir, "accuracy_vs_training_time.png"), regime=regime),
      metric_vs_budget(runs, "rollout/solve_rate", budget, out(outdir, "solve_rate.png"),
                       ylabel="batch solve rate (correct / sampled rollouts)", title="Batch solve rate",
                       bounds=(0, 1)),
      metric_vs_budget(runs, "rollout/response_length", budget, out(outdir, "response_length.png"),
                       ylabel="mean sampled response length (tokens)", title="Response length"),
      bucket_heatmap(runs, out(outdir, "exgrpo_buckets.png")),
      metric_vs_budget(runs, "replay/replayed_share", budget, out(outdir, "replayed_share.png"),
                       ylabel="replayed rollouts / rollouts in the batch", title="Replayed share of each batch",
                       bounds=(0, 1)),
      ratio_stats(runs, budget, out(outdir, "ratio_stats.png")),
  ]
  return [p for p in paths if p is not None]
