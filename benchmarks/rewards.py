"""How long the math reward takes for one ExGRPO step at paper scale: 128 questions x K=8 = 1,024 completions.

  python benchmarks/rewards.py                 # paper-scale chain-of-thought completions (default)
  python benchmarks/rewards.py --task=arithmetic --workers=2

Target (issue 6): under 1.5 s per 1,024 completions on 2 cores, with the pool already warm (the trainer keeps it
alive across steps). Prints the pool start time, the median batch time over repeats, the same batch with the
integer fast path turned off (everything through math-verify), and their ratio.
"""
import argparse
import os
import statistics
import time

import numpy as np

from jaxrlvr.rewards import MathRewardPool

_WORDS = ("we note that the sum of the terms is given by so then substituting into the equation yields hence "
          "therefore consider the case where each factor is positive and the remaining value").split()
# Gold answers in roughly the mix of a competition-math training set (OpenR1-Math, MATH): mostly integers.
_GOLDS = [("integer", 0.6), ("fraction", 0.15), ("radical", 0.1), ("decimal", 0.05), ("interval", 0.05),
          ("tuple", 0.05)]
_ENDINGS = ["\n\nTherefore, the answer is $\\boxed{{{}}}$.", "\n\nSo the answer is \\boxed{{{}}}.",
            "\n\n**Final Answer**\n\\[\n\\boxed{{{}}}\n\\]", "\n\nThus the final answer is $\\boxed{{{}}}$."]


def _answers(kind: str, rng: np.random.Generator) -> tuple[str, list[str], list[str]]:
  """(gold, correct answers as a model writes them, wrong answers it tends to repeat), all LaTeX."""
  a, b = (int(x) for x in rng.integers(2, 500, size=2))
  if kind == "integer":
    return str(a), [str(a)], [str(a + 1), str(a - 1), str(2 * a)]
  if kind == "fraction":
    return (f"\\frac{{{a}}}{{{a + b}}}", [f"\\frac{{{a}}}{{{a + b}}}", f"\\dfrac{{{a}}}{{{a + b}}}"],
            [f"\\frac{{{a + 1}}}{{{a + b}}}", f"\\frac{{{a + b}}}{{{a}}}"])
  if kind == "radical":
    return (f"{b % 9 + 2}\\sqrt{{{a % 7 + 2}}}", [f"{b % 9 + 2}\\sqrt{{{a % 7 + 2}}}"],
            [f"{b % 9 + 3}\\sqrt{{{a % 7 + 2}}}", f"\\sqrt{{{a % 7 + 2}}}"])
  if kind == "decimal":
    return f"{a}.{b % 10}5", [f"{a}.{b % 10}5", f"{a}.{b % 10}50"], [f"{a}.{b % 10}6", f"{a}.{b % 10}"]
  if kind == "interval":
    return f"[{-a}, {b})", [f"[{-a}, {b})", f"[{-a},{b})"], [f"({-a}, {b}]", f"[{-a}, {b}]"]
  return f"({a}, {b})", [f"({a}, {b})", f"({a},{b})"], [f"({b}, {a})", f"({a}, {b + 1})"]


def _cot(n_chars: int, rng: np.random.Generator) -> str:
  parts, size = [], 0
  while size < n_chars:
    r = rng.random()
    if r < 0.6:
      part = " ".join(rng.choice(_WORDS, size=12))
    elif r < 0.85:
      numerator, denominator = rng.integers(1, 99, size=2)
      part = f"$x_{rng.integers(1, 9)} = \\frac{{{numerator}}}{{{denominator}}} + {rng.integers(1, 9)}y$"
    else:
      part = f"\\[ {rng.integers(1, 99)}^2 - {rng.integers(1, 99)} = {rng.integers(1, 9999)} \\]"
    parts.append(part)
    size += len(part) + 1
  return " ".join(parts)


def paper_batch(n: int, seed: int = 0, group_size: int = 8) -> tuple[list[str], list[str]]:
  """n/group_size questions x group_size chain-of-thought completions (400 to 24,000 characters).

  Each question has its own solve rate (uniform), as in a replay-worthy training batch; a sample is a correct
  answer (sometimes written differently from the gold), one of a few wrong answers, or cut off unanswered (5%).
  """
  rng = np.random.default_rng(seed)
  kinds, weights = zip(*_GOLDS)
  completions, golds = [], []
  for _ in range(n // group_size):
    gold, right, wrong = _answers(str(rng.choice(kinds, p=weights)), rng)
    solve_rate = rng.random()
    for _ in range(group_size):
      answer = str(rng.choice(right)) if rng.random() < solve_rate else str(rng.choice(wrong))
      length = int(np.exp(rng.uniform(np.log(400), np.log(24_000))))
      ending = _ENDINGS[rng.integers(len(_ENDINGS))] if rng.random() > 0.05 else " and so on"
      completions.append(_cot(length, rng) + ending.format(answer))
      golds.append(gold)
  return completions, golds


def arithmetic_batch(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
  """Completions like the embedded task's after warm start: short, mostly well formed, some garbage."""
  from jaxrlvr.data import make_source  # pylint: disable=g-import-not-at-top
  source = make_source("synthetic:arithmetic", split="train", seed=seed)
  rng = np.random.default_rng(seed)
  completions, golds = [], []
  for i in range(n):
    example = source[i % len(source)]
    r = rng.random()
    if r < 0.8:
      completion = example.solution if rng.random() < 0.4 else example.solution.replace(
          example.answer + "}", str(int(example.answer) + 1) + "}")
    elif r < 0.9:
      completion = example.solution[:len(example.solution) // 2]  # cut off by max_new_tokens
    else:
      completion = "".join(rng.choice(list("0123456789+-*= {}"), size=20))
    completions.append(completion)
    golds.append(example.answer)
  return completions, golds


def _cpu_seconds(pids: list[int]) -> float:
  """User + system CPU seconds the given processes have used so far (Linux /proc), 0 where unreadable."""
  total = 0.0
  for pid in pids:
    try:
      with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
      pass
  return total


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--task", choices=["paper", "arithmetic"], default="paper")
  parser.add_argument("--n", type=int, default=1024)
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()

  completions, golds = (paper_batch if args.task == "paper" else arithmetic_batch)(args.n)
  chars = sum(map(len, completions))
  print(f"task={args.task}: {args.n} completions, {chars / 1e6:.1f} M characters, workers={args.workers}")
  for fast_path in (True, False):
    t0 = time.perf_counter()
    pool = MathRewardPool(num_workers=args.workers, timeout_s=5.0, fast_path=fast_path)
    # Wait until the workers are up (an item the fast path cannot settle): the trainer pays this once per run.
    pool.score(["1/2"] * 2 * args.workers, ["0.5"] * 2 * args.workers)
    start = time.perf_counter() - t0
    times, infos, rewards, cpu = [], [], None, []
    for _ in range(args.repeats):
      pids = pool.worker_pids()
      c0, p0, t0 = _cpu_seconds(pids), time.process_time(), time.perf_counter()
      rewards, info = pool.score(completions, golds)
      times.append(time.perf_counter() - t0)
      cpu.append((_cpu_seconds(pids) - c0, time.process_time() - p0))
      infos.append(info)
    pool.close()
    median = statistics.median(times)
    label = "fast path on " if fast_path else "fast path off"
    print(f"{label}: start {start:.2f} s | batch median {median:.3f} s (min {min(times):.3f}, max {max(times):.3f})"
          f" | {args.n / median:,.0f} completions/s | solve rate {rewards.mean():.3f} | "
          f"fast {infos[-1]['fast_path']}, math-verify {infos[-1]['verified']}, timeouts {infos[-1]['timeouts']}")
    # On a busy machine wall time overstates the cost; CPU time says what an idle one would need.
    workers_cpu = statistics.median(c for c, _ in cpu)
    parent_cpu = statistics.median(p for _, p in cpu)
    print(f"    CPU per batch: workers {workers_cpu:.2f} s in total ({workers_cpu / args.workers:.2f} s each if "
          f"balanced), parent {parent_cpu:.2f} s; load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if fast_path:
      on = median
  print(f"ratio (off / on): {median / on:.2f}x; target: < 1.5 s per 1,024 with the fast path on")


if __name__ == "__main__":
  main()
