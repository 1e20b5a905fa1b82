"""Step-time overhead of ExGRPO's replay over on-policy GRPO on the embedded default, measured side by side.

    python benchmarks/step_overhead.py [--steps=30] [--repeats=2]

Both methods run the same batch (B questions x K samples), model and warm start; ExGRPO replays from the first step
(`replay.start_solve_rate=0`) so every measured step pays for replay: the entropy pass over the sampled questions'
stored answers, plan/compose/observe, and the bigger buffer. Runs alternate (grpo, exgrpo, grpo, exgrpo, ...) so slow
drifts of a shared machine hit both. Reported: median step time over steps after the first `--skip` (compilation),
the overhead in percent (the paper reports +19% at 7B and +2.1% at 1.5B on GPUs), and the split of a step into
rollout, replay (including the entropy pass) and update.
"""
import argparse
import importlib
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrlvr import outputs
from jaxrlvr import train  # pylint: disable=g-import-not-at-top

_SPLIT = ("time/rollout_s", "time/replay_s", "time/update_s", "time/step_s")


def _config(method: str, steps: int, cache: str):
  config = importlib.import_module(f"configs.{method}").get_config()
  with config.unlocked():
    config.total_steps = steps
    config.log_every = 1
    config.eval_every = 10 * steps  # evaluation only at step 0 and at the end, outside the timed steps
    config.checkpoint_every = 10 * steps
    config.warm_start.cache_dir = cache
    if method == "exgrpo":
      config.replay.start_solve_rate = 0.0
  return config


def run_once(method: str, steps: int, skip: int, cache: str) -> dict:
  with tempfile.TemporaryDirectory() as workdir:
    train.run(_config(method, steps, cache), workdir)
    rows = [r for r in outputs.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
            if r["step"] > skip and "time/step_s" in r and r["step"] < steps]
  out = {key: float(np.median([r[key] for r in rows])) for key in _SPLIT}
  # Wall clock between the first and last measured rows, per step: includes what falls between steps' timers
  # (the loop's periodic garbage collection, logging).
  out["wall_per_step"] = (rows[-1]["time"] - rows[0]["time"]) / (rows[-1]["step"] - rows[0]["step"])
  out["replay/replayed_share"] = float(np.mean([r.get("replay/replayed_share", 0.0) for r in rows]))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--skip", type=int, default=5, help="first steps left out (compilation)")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--cache", default="", help="warm-start cache dir (default: the user cache)")
  args = parser.parse_args()
  results = {"grpo": [], "exgrpo": []}
  for _ in range(args.repeats):
    for method in results:
      results[method].append(run_once(method, args.steps, args.skip, args.cache))
  summary = {m: {k: float(np.median([r[k] for r in runs])) for k in runs[0]} for m, runs in results.items()}
  print(f"\nmedian over steps {args.skip + 1}..{args.steps - 1} and {args.repeats} runs each (seconds)")
  print(f"{'method':8s} " + " ".join(f"{k.split('/')[1]:>12s}" for k in _SPLIT) + "  wall/step  replayed share")
  for method, row in summary.items():
    print(f"{method:8s} " + " ".join(f"{row[k]:12.4f}" for k in _SPLIT) + f"  {row['wall_per_step']:9.4f}"
          f"  {row['replay/replayed_share']:.2f}")
  # Run by run, in the order they ran: a run that another job on the machine slowed shows here.
  for method, runs in results.items():
    print(f"{method:8s} median step of each run: " + " ".join(f"{r['time/step_s']:.4f}" for r in runs))
  overhead = summary["exgrpo"]["time/step_s"] / summary["grpo"]["time/step_s"] - 1
  wall = summary["exgrpo"]["wall_per_step"] / summary["grpo"]["wall_per_step"] - 1
  print(f"\nExGRPO step-time overhead over GRPO: {100 * overhead:+.1f}% median step, {100 * wall:+.1f}% wall clock "
        f"per step (target: at most +5%)")


if __name__ == "__main__":
  main()
