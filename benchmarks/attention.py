"""Times the "xla" attention path against "blockwise" at several block sizes, to place `attention.XLA_MAX_SCORES`.

For each length S (T = S causal, or T = --query_len queries at the last slots, as a decode step or a prefill chunk;
every fourth row left-padded by S/4) it times one jitted forward pass and, for T = S, one jitted value-and-gradient
(what the update step runs under remat), at the tiny preset's heads (N=4, K=2, H=32). Calls alternate xla,
blockwise(b1), blockwise(b2), ... after a warm-up each; it prints the best call of each (median in parentheses) and
each blockwise best over xla's.

  python benchmarks/attention.py --lengths=42,128,256,512,768,1024 --block_sizes=64,128,512 --batch=16 --repeats=10
  python benchmarks/attention.py --query_len=1 --lengths=256,1024,4096,16384 --batch=16 --repeats=10
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from jaxrlvr.models import attention as attention_lib


def _callables(kind: str, block_sizes: list[int]) -> dict[str, object]:
  """name -> jitted f(q, k, v, slots, key_mask): the forward pass, or its value and gradient wrt q, k, v."""
  variants = {"xla": ("xla", 0)} | {f"blockwise {b}": ("blockwise", b) for b in block_sizes}
  fns = {}
  for name, (implementation, block_size) in variants.items():
    # The masks are arguments, not constants: XLA would otherwise fold the mask arithmetic at compile time.
    def forward(q, k, v, slots, key_mask, implementation=implementation, block_size=block_size):
      return attention_lib.attend(q, k, v, slots, key_mask, implementation=implementation,
                                  block_size=max(block_size, 1))
    if kind == "forward":
      fns[name] = jax.jit(forward)
    else:
      fns[name] = jax.jit(jax.value_and_grad(lambda *a, f=forward: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2)))
  return fns


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--lengths", default="42,128,256,512,768,1024")
  parser.add_argument("--block_sizes", default="64,128,512")
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--query_len", type=int, default=0, help="queries a call (0: T = S, with the backward pass)")
  args = parser.parse_args(argv)
  heads, kv_heads, head_dim = 4, 2, 32
  block_sizes = [int(x) for x in args.block_sizes.split(",")]
  print(f"jax {jax.__version__} on {jax.default_backend()}, batch {args.batch}, N={heads} K={kv_heads} H={head_dim}; "
        f"ms, best (median); blockwise columns: block size, then best over xla's best")
  for length in (int(x) for x in args.lengths.split(",")):
    queries = args.query_len or length
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (args.batch, queries, heads, head_dim))  # [B, T, N, H]
    k = jax.random.normal(keys[1], (args.batch, kv_heads, length, head_dim))  # [B, K, S, H]
    v = jax.random.normal(keys[2], (args.batch, kv_heads, length, head_dim))
    inputs = (q, k, v, length - queries + jnp.arange(queries),  # the last T slots
              jnp.ones((args.batch, length), bool).at[::4, :length // 4].set(False))
    for kind in ("forward",) if args.query_len else ("forward", "backward"):
      fns = _callables(kind, block_sizes)
      for fn in fns.values():
        jax.block_until_ready(fn(*inputs))  # warm-up: compile every variant before timing any
      times = {name: [] for name in fns}
      for _ in range(args.repeats):
        for name, fn in fns.items():
          start = time.perf_counter()
          jax.block_until_ready(fn(*inputs))
          times[name].append(time.perf_counter() - start)
      best_xla = min(times["xla"])
      cells = [f"xla {1e3 * best_xla:.2f} ({1e3 * statistics.median(times['xla']):.2f})"]
      for name in fns:
        if name != "xla":
          t = times[name]
          cells.append(f"{name.split()[1]}: {1e3 * min(t):.2f} ({1e3 * statistics.median(t):.2f}) "
                       f"{min(t) / best_xla:.2f}x")
      print(f"T={queries:<5} S={length:<6} {kind:<8} " + " | ".join(cells), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
