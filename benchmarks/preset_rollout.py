"""A preset's own rollout calls: the static sampler against the rollout engine, on the prompts, lengths and stops
the training loop samples.

    python benchmarks/preset_rollout.py                                   # the smollm2-135m preset, GRPO
    python benchmarks/preset_rollout.py --config=configs/exgrpo.py:smoke --calls=3   # the embedded smoke config

Each call is one training step's sampling: `rollout.batch_size` fresh questions x `rollout.group_size` samples at
the config's temperature, top-p / top-k, `rollout.max_new_tokens` and the tokenizer's stop tokens, with the
config's memory bounds, on the policy the run starts from (the run's own set-up, `jaxrlvr.run_setup`, so a
pretrained preset answers its chat prompts and stops on its end-of-turn token). Both samplers get the same
questions and keys, in turn (static, engine, static, ...), after one warm-up call of each (compiles excluded), so
load from other jobs falls on both alike. The engine runs with the config's `rollout.decode_slots`,
`decode_chunk_steps` and `decode_weights`.

Printed per sampler: median and best call, sampled tokens per second (each row's tokens up to and including its
stop; median call), mean answer length, and the share of rows that stopped before the cap; then the share of rows
both sampled alike (both draw a row's tokens from that row's key, so rows differ only where float rounding of
two different computations flips a draw, and from there on) and the engine's median time over the static's. One process, the devices JAX starts with (one CPU device unless XLA_FLAGS or `jax_num_cpu_devices`
says more), as the main job runs.
"""
import argparse
import importlib.util
import os
import statistics
import sys
import time

import jax
import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)  # configs/ imports configs.base

from jaxrlvr import rollout  # pylint: disable=wrong-import-position
from jaxrlvr import run_setup  # pylint: disable=wrong-import-position
from jaxrlvr import xla_cpu  # pylint: disable=wrong-import-position


def load_config(spec: str):
  """`configs/<file>.py[:ARGS]` -> its get_config(ARGS), as `--config=` reads it."""
  path, _, arg = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("preset_config", os.path.join(_REPO, path))
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="configs/grpo.py:model=smollm2-135m")
  parser.add_argument("--calls", type=int, default=6, help="timed calls of each sampler, interleaved")
  parser.add_argument("--warm_start_cache", default="", help="warm-start cache directory (default: the config's)")
  args = parser.parse_args()
  xla_cpu.setup_process()  # as the main job runs: before JAX starts

  config = load_config(args.config)
  if args.warm_start_cache:
    config.warm_start.cache_dir = args.warm_start_cache
  config, mesh = run_setup.prepare(config)
  data = run_setup.load_data(config)
  policy, _ = run_setup.build_policy(config, mesh, data.book)
  settings = run_setup.sampler_settings(config, data.tokenizer)
  questions = run_setup.question_iterator(config, data.train_set)
  group = config.rollout.group_size
  batches = [questions.next(config.rollout.batch_size) for _ in range(args.calls + 1)]  # the first: warm-up

  def call(engine: str, batch: list[int], seed: int):
    prompts = [data.book.prompt_ids(q) for q in batch for _ in range(group)]
    kwargs = {**settings.engine_settings(), "engine": engine}
    start = time.perf_counter()
    out = rollout.generate(policy, prompts, max_new_tokens=settings.max_new_tokens, rng=jax.random.key(seed),
                           temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                           eos_ids=settings.eos_ids, pad_id=settings.pad_id, mesh=mesh,
                           **settings.memory_limits(), **kwargs)
    jax.block_until_ready(out.tokens)
    return time.perf_counter() - start, out

  engines = ("static", "continuous")
  times = {e: [] for e in engines}
  outs = {e: [] for e in engines}
  for i, batch in enumerate(batches):
    for engine in engines:
      seconds, out = call(engine, batch, config.seed + i)
      if i:  # call 0 compiles
        times[engine].append(seconds)
        outs[engine].append(out)

  print(f"{args.config}: {config.rollout.batch_size} questions x {group} samples, at most "
        f"{settings.max_new_tokens} new tokens, temperature {settings.temperature}, {jax.device_count()} "
        f"{jax.default_backend()} device(s), {args.calls} calls each")
  print(f"{'sampler':<12} {'median s':>9} {'best s':>8} {'tokens/s':>9} {'mean len':>9} {'stopped':>8}")
  medians = {}
  for engine in engines:
    lengths = np.concatenate([o.lengths for o in outs[engine]])
    tokens = [float(o.lengths.sum()) for o in outs[engine]]
    medians[engine] = statistics.median(times[engine])
    rate = statistics.median(t / s for t, s in zip(tokens, times[engine]))
    print(f"{engine:<12} {medians[engine]:>9.3f} {min(times[engine]):>8.3f} {rate:>9.0f} {lengths.mean():>9.1f} "
          f"{np.mean(lengths < settings.max_new_tokens):>8.0%}")
  same = np.concatenate([np.all(a.tokens == b.tokens, axis=1) for a, b in zip(outs["static"], outs["continuous"])])
  print(f"rows with the same tokens: {same.mean():.0%}; engine / static median time: "
        f"{medians['continuous'] / medians['static']:.2f}")


if __name__ == "__main__":
  main()
