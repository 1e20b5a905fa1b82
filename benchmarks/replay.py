"""Host cost of replay at the paper's scale: memory per stored token and time per step of the ExGRPO buffer.

  python benchmarks/replay.py                       # ExGRPO: 200k trajectories of ~1k tokens, 128 x 8 batches
  python benchmarks/replay.py --trajectories 20000  # a quick run
  python benchmarks/replay.py --others              # also advantage priority (30k rollouts) and BAPO, same batch

Targets (issue 5): at most 8 bytes per stored token all included (the released ExGRPO code keeps decoded text
plus float32 log-probs: 1.77 GB for 202,011 trajectories, ~8.8 KB each at 7B scale), and plan + observe for a
128 x 8 batch within 10 ms of host time.

The buffer is filled through the real protocol (plan, select, compose, observe) with synthetic rollouts
(`jaxrlvr.replay.simulate`): completion lengths uniform in [500, 1500] tokens, questions solved with
probabilities uniform in [0, 1]. Memory is what tracemalloc attributes to the strategy (numpy buffers and every
Python object of its indexes), divided by the stored tokens; it is cross-checked against the store's own count.
Times are host wall-clock per call, excluding the synthetic sampler and the entropy stand-in.
"""
import argparse
import gc
import time
import tracemalloc

import ml_collections
import numpy as np

from jaxrlvr import replay
from jaxrlvr.replay import simulate


def make_config(name: str, batch: int, group: int, **replay_keys) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.rollout = ml_collections.ConfigDict({"batch_size": batch, "group_size": group})
  c.loss = ml_collections.ConfigDict({"scale_by_std": False})
  c.replay = ml_collections.ConfigDict({"name": name, "max_tokens": 0, **replay_keys})
  return c


def timed_step(strategy, sampler, fresh, step: int) -> dict:
  """One protocol step; returns wall-clock ('plan') and process CPU ('plan_cpu') seconds of each strategy call.

  CPU time is the host cost itself; wall time also counts waiting for a core, which on a shared 2-core machine
  adds whole scheduler slices (~4 ms) at random.
  """
  t = {}

  def call(name, fn, *a):
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn(*a)
    t[name], t[name + "_cpu"] = time.perf_counter() - w0, time.process_time() - c0
    return out

  plan = call("plan", strategy.plan, step, fresh)
  sampled = sampler.sample(plan)
  ent = sampler.mean_entropies(plan)
  plan = call("select", strategy.select, plan, ent)
  call("compose", strategy.compose, plan, sampled)
  call("observe", strategy.observe, plan, sampled)
  return t


def summarize(times: list, keys=("plan", "observe")) -> str:
  out = []
  for suffix, what in (("", "wall"), ("_cpu", "cpu")):
    ms = np.array([sum(t[k + suffix] for k in keys) for t in times]) * 1e3
    out.append(f"{what} median {np.median(ms):.2f} ms, p90 {np.percentile(ms, 90):.2f}, max {ms.max():.2f}")
  return f"{' + '.join(keys)} ({len(times)} steps): " + "; ".join(out)


def bench_exgrpo(args) -> None:
  num_questions = 4 * args.trajectories
  sampler = simulate.SyntheticSampler(num_questions, seed=0, min_len=args.mean_tokens // 2,
                                      max_len=3 * args.mean_tokens // 2, vocab=150000, pool_tokens=1 << 25)
  fresh = simulate.FreshIterator(num_questions, seed=0)
  if args.tracemalloc:
    tracemalloc.start()
  gc.collect()
  base = tracemalloc.get_traced_memory()[0] if args.tracemalloc else 0
  s = replay.make("exgrpo", make_config("exgrpo", args.batch, args.group))
  step, t0 = 0, time.perf_counter()
  while s.store.num_rows < args.trajectories:
    simulate.run_step(s, sampler, fresh, step)
    step += 1
  fill_s = time.perf_counter() - t0
  gc.collect()
  traced = tracemalloc.get_traced_memory()[0] - base if args.tracemalloc else 0
  if args.tracemalloc:
    tracemalloc.stop()
  tokens, rows = s.store.live_tokens, s.store.num_rows
  print(f"ExGRPO buffer after {step} steps ({fill_s:.0f} s to fill, tracemalloc {'on' if args.tracemalloc else 'off'}):"
        f" {rows} trajectories, {s.num_questions} questions, {tokens / 1e6:.1f}M tokens "
        f"({tokens / rows:.0f} per trajectory), {len(s._retired)} retired")
  print(f"  store arrays: {s.store.nbytes() / 1e9:.3f} GB = {s.store.nbytes() / tokens:.2f} bytes/token")
  if args.tracemalloc:
    print(f"  all included (tracemalloc): {traced / 1e9:.3f} GB = {traced / tokens:.2f} bytes/token = "
          f"{traced / rows / 1e3:.2f} KB/trajectory (released code: 1.77 GB / 202,011 = 8.76 KB/trajectory)")
  times = [timed_step(s, sampler, fresh, step + i) for i in range(args.measure_steps)]
  step += args.measure_steps
  m = s.metrics()
  print(f"  B={args.batch} x K={args.group}: {int(m['replay/replay_questions'])} replay questions a step, "
        f"{m['replay/scored_answers']:.0f} stored answers to score, {m['replay/stored']:.0f} new answers stored "
        f"({m['replay/stored'] * tokens / rows * 6 / 1e6:.1f} MB of fresh memory a step)")
  print("  growing buffer (every step faults in new pages), " + summarize(times))
  print("  growing buffer, " + summarize(times, ("plan", "select", "compose", "observe")))
  # Steady state: cap the buffer at its size (replay.max_tokens); the oldest answers are evicted each step and
  # their pages recycled, so no new memory is touched once the first capped pages have cycled.
  s.max_tokens = s.store.live_tokens
  for i in range(args.measure_steps):
    simulate.run_step(s, sampler, fresh, step + i)
  step += args.measure_steps
  times = [timed_step(s, sampler, fresh, step + i) for i in range(args.measure_steps)]
  m = s.metrics()
  print(f"  capped at {s.max_tokens / 1e6:.1f}M tokens ({m['replay/evicted']:.0f} answers evicted on the last step, "
        f"{s.store.nbytes() / s.store.live_tokens:.2f} bytes/token of store arrays), " + summarize(times))
  print("  capped, " + summarize(times, ("plan", "select", "compose", "observe")))
  t0 = time.perf_counter()
  state = s.state_dict()
  print(f"  state_dict: {sum(v.nbytes for v in state.values()) / 1e9:.3f} GB of arrays in "
        f"{time.perf_counter() - t0:.2f} s")


def bench_others(args) -> None:
  for name, keys in (("advantage_priority", {"warmup_steps": 0}), ("bapo", {})):
    sampler = simulate.SyntheticSampler(10 ** 6, seed=1, min_len=args.mean_tokens // 2,
                                        max_len=3 * args.mean_tokens // 2, vocab=150000, pool_tokens=1 << 25)
    fresh = simulate.FreshIterator(10 ** 6, seed=1)
    s = replay.make(name, make_config(name, args.batch, args.group, **keys))
    for step in range(40):
      simulate.run_step(s, sampler, fresh, step)
    times = [timed_step(s, sampler, fresh, 40 + i) for i in range(args.measure_steps)]
    print(f"{name}: {s.store.num_rows} rollouts in the buffer; " + summarize(times) + "; "
          + summarize(times, ("plan", "select", "compose", "observe")))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--trajectories", type=int, default=200_000)
  p.add_argument("--mean_tokens", type=int, default=1000)
  p.add_argument("--batch", type=int, default=128)
  p.add_argument("--group", type=int, default=8)
  p.add_argument("--measure_steps", type=int, default=50)
  p.add_argument("--tracemalloc", action=argparse.BooleanOptionalAction, default=True)
  p.add_argument("--others", action="store_true")
  args = p.parse_args()
  bench_exgrpo(args)
  if args.others:
    bench_others(args)


if __name__ == "__main__":
  main()
