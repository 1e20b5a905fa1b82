"""Update-step speed on the embedded default: the hand-written SwiGLU VJP against autodiff's, with and without
micro-batches, timed side by side.

    python benchmarks/update_step.py [--repeats=8] [--microbatches=1,4]

One jitted update (`step.make_update_fn`, the GRPO loss) on a batch shaped like the embedded default's: 128 rows of
a 16-token prompt and 26 completion tokens, the tiny model on one CPU device. "autodiff" traces the same model with
`models.transformer.swiglu` swapped for the plain expression, so JAX differentiates it itself. Variants are timed
round-robin after one warm-up call each; the best call is reported, with the median beside it. Also checked: both
variants give the same gradient norm.
"""
import argparse
import contextlib
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import grpo  # pylint: disable=g-import-not-at-top
from jaxrlvr import parallel  # pylint: disable=g-import-not-at-top
from jaxrlvr import step as step_lib  # pylint: disable=g-import-not-at-top
from jaxrlvr.models import get_preset  # pylint: disable=g-import-not-at-top
from jaxrlvr.models import transformer as transformer_lib  # pylint: disable=g-import-not-at-top

ROWS, PROMPT, COMPLETION = 128, 16, 26


def _plain_swiglu(x, w_gate, w_up, w_down):
  return jnp.einsum("BTF,FD->BTD", jax.nn.silu(x @ w_gate) * (x @ w_up), w_down)


@contextlib.contextmanager
def _swiglu(kind: str):
  """While tracing, the model's MLP uses the hand-written VJP ('hand') or autodiff of the plain expression."""
  saved = transformer_lib.swiglu
  if kind == "autodiff":
    transformer_lib.swiglu = _plain_swiglu
  try:
    yield
  finally:
    transformer_lib.swiglu = saved


def _batch(mesh):
  rs = np.random.RandomState(0)
  width = PROMPT + COMPLETION
  batch = dict(input_ids=rs.randint(1, 60, (ROWS, width)).astype(np.int32),
               attention_mask=np.ones((ROWS, width), np.int32),
               completion_mask=np.ones((ROWS, COMPLETION), np.float32),
               advantages=rs.randn(ROWS, COMPLETION).astype(np.float32),
               old_logp=-np.ones((ROWS, COMPLETION), np.float32),
               behaviour_logp=-np.ones((ROWS, COMPLETION), np.float32),
               replayed=np.zeros(ROWS, bool), clip=np.ones(ROWS, bool))
  return parallel.shard_batch(batch, mesh)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=8)
  parser.add_argument("--microbatches", default="1,4", help="comma-separated train.num_microbatches values")
  args = parser.parse_args()

  mesh = parallel.make_mesh(data=1, devices=jax.devices()[:1])
  graphdef, params = nnx.split(parallel.create_model(get_preset("tiny"), mesh, seed=0))
  batch = _batch(mesh)
  variants = {}  # name -> [update_fn, state]
  norms = {}
  for kind in ("autodiff", "hand"):
    for micro in (int(m) for m in args.microbatches.split(",")):
      config = grpo.get_config()
      with config.unlocked():
        config.train.num_microbatches = micro
      optimizer = step_lib.make_optimizer(config)
      state = step_lib.create_state(jax.tree.map(jnp.copy, params), optimizer, mesh)
      update = step_lib.make_update_fn(graphdef, config, optimizer,
                                       state_sharding=jax.tree.map(lambda x: x.sharding, state),
                                       batch_sharding=parallel.batch_sharding(mesh))
      with _swiglu(kind):  # traced and compiled here, with this MLP; a retrace after it would fail the check below
        state, metrics, _ = update(state, batch)
        jax.block_until_ready(state.step)
      assert update._cache_size() == 1  # pylint: disable=protected-access
      name = f"{kind}, {micro} micro-batch{'es' if micro > 1 else ''}"
      norms[name] = float(metrics["optim/grad_norm"])
      variants[name] = [update, state]

  times = {name: [] for name in variants}
  for _ in range(args.repeats):
    for name, entry in variants.items():
      start = time.perf_counter()
      entry[1], _, _ = entry[0](entry[1], batch)
      jax.block_until_ready(entry[1].step)
      times[name].append(time.perf_counter() - start)
  for name, entry in variants.items():  # one compile each: the timed calls ran what was traced under _swiglu
    assert entry[0]._cache_size() == 1, name  # pylint: disable=protected-access

  reference = min(times[next(iter(times))])
  print(f"\nupdate of {ROWS} rows x {PROMPT + COMPLETION} tokens, tiny model, 1 CPU device; ms, best of "
        f"{args.repeats} interleaved calls (median)")
  print(f"{'variant':32s} {'best':>8s} {'median':>8s} {'speed-up':>9s} {'grad norm (first call)':>23s}")
  for name, t in times.items():
    print(f"{name:32s} {1e3 * min(t):8.1f} {1e3 * statistics.median(t):8.1f} {reference / min(t):8.2f}x "
          f"{norms[name]:23.6f}")


if __name__ == "__main__":
  main()
