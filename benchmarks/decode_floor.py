"""A decode step against this CPU's floor: the weights read once, the step's matmuls alone, the engine's own step.

    python benchmarks/decode_floor.py [--model=smollm2-135m] [--rows=16] [--steps=32] [--repeats=5]

A decode step on few rows reads every weight once and does 2 FLOPs per weight and row, so on a CPU its floor is the
time to stream the weights from memory. On one CPU device, with a preset's shapes and random weights (speed does
not depend on their values), this times, round-robin after one warm-up call each:
  - read: a sum over a float32 array as large as the weights, the streaming floor;
  - matmuls: the step's matmuls alone at `rows` rows, each layer's projections (q, k, v, o, gate, up, down) in a
    scan over the layers as the model runs them, then the model's head (below);
  - head: the model's head as `Transformer.logits` computes it (the embedding read transposed when tied), and a
    log-softmax;
  - head, vocabulary-major: the same product from a [V, D] table, as [V, rows] with the softmax along the
    vocabulary (XLA:CPU's kernels for the two layouts differ; a tied model's embedding is that table already);
  - engine step: the rollout engine's time per decode step at `rows` rows, from two calls of `rollout.generate`
    with `--steps` and 2 x `--steps` new tokens and no stop token (their difference over the extra steps: the
    prefill cancels).
Printed per part: best time (median), the weights' bytes over the time, GFLOP/s, and the time as a multiple of
the read's.
"""
import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import grpo  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxrlvr import parallel  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxrlvr import rollout  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxrlvr import run_setup  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxrlvr import xla_cpu  # pylint: disable=g-import-not-at-top,wrong-import-position


def projection_shapes(c) -> dict[str, tuple[int, int]]:
  """A layer's matmul weights as [in, out]: attention's q, k, v, o and the MLP's gate, up and down."""
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  return {"q": (c.hidden_size, q), "k": (c.hidden_size, kv), "v": (c.hidden_size, kv), "o": (q, c.hidden_size),
          "gate": (c.hidden_size, c.intermediate_size), "up": (c.hidden_size, c.intermediate_size),
          "down": (c.intermediate_size, c.hidden_size)}


def layer_matmuls(x, layers):
  """x [rows, D] through every layer's projections, in a scan over the layers as the model runs them."""
  def layer(h, w):
    attended = (h @ w["q"]) + jnp.sum(h @ w["k"]) + jnp.sum(h @ w["v"])  # [rows, H*K]; k, v only read
    h = h + attended @ w["o"]  # [rows, D]
    return h + (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"], None
  h, _ = jax.lax.scan(layer, x, layers)
  return h


def model_logits(x, table, tied: bool):
  """[rows, V] as `Transformer.logits` computes them from the table the model keeps: its embedding [V, D], read
  transposed, when tied; else lm_head [D, V]."""
  unembedding = table.T if tied else table  # [D, V]
  return jnp.einsum("...D,DV->...V", x, unembedding, preferred_element_type=jnp.float32)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="smollm2-135m", help="model preset (its config arg: configs/grpo.py:model=)")
  parser.add_argument("--rows", type=int, default=16, help="rows decoding together (the smollm2 preset: 4 x 4)")
  parser.add_argument("--steps", type=int, default=32, help="decode steps of the shorter engine call")
  parser.add_argument("--prompt", type=int, default=64, help="prompt tokens a row")
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  xla_cpu.setup_process()  # as the main job runs: before JAX starts

  config = grpo.get_config(f"model={args.model}")
  c = run_setup.model_config(config)
  mesh = parallel.make_mesh(data=1, devices=jax.devices()[:1])
  policy = parallel.create_model(c, mesh, seed=0)
  weights = sum(x.size for x in jax.tree.leaves(nnx.state(policy, nnx.Param)))
  weight_bytes = 4.0 * weights
  rs = np.random.RandomState(0)
  shapes = projection_shapes(c)
  layers = {n: jnp.asarray(rs.randn(c.num_layers, *s).astype(np.float32) * 0.02) for n, s in shapes.items()}
  flat = jnp.asarray(rs.rand(weights).astype(np.float32))
  x = jnp.asarray(rs.randn(args.rows, c.hidden_size).astype(np.float32))
  # The head's table as the model keeps it. Timed through jitted functions of arrays, not of the model: nnx.jit's
  # per-call walk over the model's modules would be timed with them.
  table = (policy.embed if c.tie_embeddings else policy.lm_head)[...]
  vocab_major = table if c.tie_embeddings else jnp.asarray(np.ascontiguousarray(np.asarray(table).T))  # [V, D]
  tied = c.tie_embeddings
  matmul_weights = c.num_layers * sum(a * b for a, b in shapes.values()) + c.hidden_size * c.vocab_size

  prompts = [rs.randint(1, c.vocab_size, args.prompt).tolist() for _ in range(args.rows)]

  def engine_call(steps: int):
    out = rollout.generate(policy, prompts, max_new_tokens=steps, rng=jax.random.key(0), temperature=1.0,
                           pad_id=0, mesh=mesh, engine="continuous")
    return out.tokens

  parts = {  # name -> (call, FLOPs, bytes of weights it reads)
      "read": (lambda f=jax.jit(jnp.sum): f(flat), 0.0, weight_bytes),
      "matmuls": (lambda f=jax.jit(lambda x, w, t: model_logits(layer_matmuls(x, w), t, tied)): f(x, layers, table),
                  2.0 * args.rows * matmul_weights, 4.0 * matmul_weights),
      "head": (lambda f=jax.jit(lambda x, t: jax.nn.log_softmax(model_logits(x, t, tied), -1)): f(x, table),
               2.0 * args.rows * c.hidden_size * c.vocab_size, 4.0 * c.hidden_size * c.vocab_size),
      "head, vocabulary-major": (lambda f=jax.jit(lambda x, u: jax.nn.log_softmax(u @ x.T, axis=0)): f(x, vocab_major),
                                 2.0 * args.rows * c.hidden_size * c.vocab_size, 4.0 * c.hidden_size * c.vocab_size),
      f"engine, {args.steps} steps": (lambda: engine_call(args.steps), 0.0, 0.0),
      f"engine, {2 * args.steps} steps": (lambda: engine_call(2 * args.steps), 0.0, 0.0),
  }
  times = {name: [] for name in parts}
  for call, _, _ in parts.values():
    jax.block_until_ready(call())  # compile
  for _ in range(args.repeats):
    for name, (call, _, _) in parts.items():
      start = time.perf_counter()
      jax.block_until_ready(call())
      times[name].append(time.perf_counter() - start)

  short, long = times.pop(f"engine, {args.steps} steps"), times.pop(f"engine, {2 * args.steps} steps")
  times["engine step"] = [(b - a) / args.steps for a, b in zip(short, long)]
  parts["engine step"] = (None, 2.0 * args.rows * weights, weight_bytes)
  read = min(times["read"])
  print(f"\n{args.model}: {weights / 1e6:.1f}M float32 weights ({weight_bytes / 1e9:.2f} GB), {args.rows} rows, "
        f"prompt {args.prompt}, engine steps from {args.steps} and {2 * args.steps} new tokens; 1 CPU device; "
        f"jax {jax.__version__}; best of {args.repeats} interleaved calls (median)")
  print(f"{'part':24s} {'best ms':>9s} {'median ms':>10s} {'GB/s':>6s} {'GFLOP/s':>8s} {'x read':>7s}")
  for name in ("read", "matmuls", "head", "head, vocabulary-major", "engine step"):
    _, flops, read_bytes = parts[name]
    best = min(times[name])
    rate = f"{flops / best / 1e9:8.0f}" if flops else f"{'-':>8s}"
    print(f"{name:24s} {1e3 * best:9.2f} {1e3 * statistics.median(times[name]):10.2f} {read_bytes / best / 1e9:6.1f} "
          f"{rate} {best / read:7.2f}")


if __name__ == "__main__":
  main()
