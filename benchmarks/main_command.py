"""Reruns the README's main commands and prints their figures beside the ones the README states.

    python benchmarks/main_command.py [--methods=exgrpo,grpo] [--cache=DIR] [--smoke]

Each method runs exactly as the README says, `python -m jaxrlvr.main --config=configs/<method>.py --workdir=DIR`,
in a process of its own, one after the other, with `--config.warm_start.cache_dir` pointed at a fresh temporary
directory (or `--cache`), so the first command pays for the warm start as a new user's does and the second reuses
it. Printed per method: held-out greedy accuracy at step 0 and at the end (overall and per level), the greedy
answers' mean length, and the wall clock of the command; then the package versions and the CPU, because XLA:CPU
picks its kernels by CPU, so the same versions can give slightly different runs on another processor. `--smoke`
runs the `:smoke` configs (seconds; what the test suite checks).
"""
import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import workers

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "numpy", "math-verify")

# What the README states for the main commands (seed 0, the 2-core development machine, requirements-lock.txt);
# keep in step with the README's "Results" section when the figures are re-measured.
README = {
    "exgrpo": {"eval/accuracy@0": 0.390, "eval/accuracy@end": 0.565, "wall_s": 225.0},
    "grpo": {"eval/accuracy@0": 0.390, "eval/accuracy@end": 0.635, "wall_s": 76.0},
}


def run_command(method: str, workdir: str, cache: str, smoke: bool) -> float:
  """Runs the main command for `method`; returns its wall-clock seconds."""
  config = f"configs/{method}.py" + (":smoke" if smoke else "")
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the command as a user runs it: one CPU device
  start = time.perf_counter()
  command = [sys.executable, "-m", "jaxrlvr.main", f"--config={config}", f"--workdir={workdir}",
             f"--config.warm_start.cache_dir={cache}"]  # the README's command, its cache pointed at `cache`
  result = subprocess.run(command, cwd=_REPO, env=env, capture_output=True, text=True, check=False)
  wall = time.perf_counter() - start
  if result.returncode:
    sys.exit(f"main_command: the {method} command {workers.exit_status(result.returncode)}; the end of its "
             f"stderr:\n{result.stderr[-4000:]}")
  return wall


def figures(workdir: str) -> dict:
  """Step-0 and final evaluation rows of a run's metrics.jsonl."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  evals = [r for r in rows if "eval/accuracy" in r]
  return {"first": evals[0], "last": evals[-1]}


def _fmt(value, percent=True) -> str:
  if value is None:
    return "-"
  return f"{100 * value:.1f}%" if percent else f"{value:.1f}"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--methods", default="exgrpo,grpo")
  parser.add_argument("--cache", default="", help="warm-start cache directory (default: a fresh one)")
  parser.add_argument("--smoke", action="store_true", help="the :smoke configs, for the test suite")
  args = parser.parse_args()

  with tempfile.TemporaryDirectory(prefix="jaxrlvr-main-") as tmp:
    cache = args.cache or os.path.join(tmp, "warm-start")
    print(f"{'method':<8} {'figure':<34} {'this run':>10} {'README':>10}")
    for method in args.methods.split(","):
      workdir = os.path.join(tmp, method)
      wall = run_command(method, workdir, cache, args.smoke)
      got = figures(workdir)
      stated = {} if args.smoke else README.get(method, {})
      first, last = got["first"], got["last"]
      rows = [("eval/accuracy at step 0", first["eval/accuracy"], stated.get("eval/accuracy@0"), True),
              (f"eval/accuracy at step {last['step']}", last["eval/accuracy"], stated.get("eval/accuracy@end"), True)]
      for key in sorted(k for k in last if k.startswith("eval/") and k.endswith("/accuracy") and k != "eval/accuracy"):
        level = key[len("eval/"):-len("/accuracy")]  # a data_source: arithmetic/add2, ..., or a file's own
        rows.append((f"  {level} (0 -> end)", (first.get(key), last[key]), None, True))
      if "eval/response_length" in last:
        lengths = (first.get("eval/response_length"), last["eval/response_length"])
        rows.append(("greedy length (0 -> end)", lengths, None, False))
      rows.append(("wall clock (s)", wall, stated.get("wall_s"), False))
      for name, value, readme, percent in rows:
        shown = (" -> ".join(_fmt(v, percent) for v in value) if isinstance(value, tuple) else _fmt(value, percent))
        print(f"{method:<8} {name:<34} {shown:>10} {_fmt(readme, percent):>10}")
  versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in _PACKAGES)
  print(f"versions: Python {platform.python_version()}, {versions}")
  print(f"machine: {_cpu_model()}, {os.cpu_count()} cores")


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    return platform.processor() or platform.machine()


if __name__ == "__main__":
  main()
