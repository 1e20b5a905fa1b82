"""A jitted function compiled before its first call, in a background thread, while the run goes on.

A run's update compiles at its first call: on the smollm2-135m preset that is 17 s of XLA compile on a first run and
8-12 s of loading the executable from the persistent compilation cache on every later one (XLA:CPU rebuilds its
thunks from the stored program), all of it inside the first step, after the step-0 evaluation and the first
rollout. `Ahead` traces and lowers the function on the calling thread at once (abstract arguments: nothing runs),
then compiles it in a thread. XLA compiles and deserialises without Python's lock, so the evaluation and the first
rollout go on meanwhile, and the first update finds its executable ready or nearly so.

Calls whose arguments have the example's structure, shapes, dtypes and shardings run that executable; any other call
goes to the jitted function, which compiles for it as usual (the result is the same either way, only the timing
differs). The first such call is logged, since it means the compile ahead was wasted. A process that ends before the
first call waits for the compile to finish as it exits.

`in_background` runs other work in a second thread, beside those compiles: the trainer prepares its first
rollout's sampler programs there (`rollout.prepare_sampling`), which a second run of the smollm2-135m preset
otherwise traced and loaded inside its first step (~5 s). Beside, not after: the first rollout waits for them, and
behind the update's compile (8-20 s to load on 2 cores) they would hold it up when the step-0 evaluation is short.
"""
import concurrent.futures
from typing import Any, Callable

import jax
from absl import logging

# One compile at a time: on a small machine the rollout needs the other cores. `in_background` has its own thread.
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile_ahead")
_OTHER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="in_background")


def signature(args: Any) -> tuple:
  """What a compiled executable is specific to: the tree structure and each leaf's shape, dtype, weak type and
  sharding (arrays and jax.ShapeDtypeStruct alike)."""
  leaves, tree = jax.tree.flatten(args)
  return tree, tuple((x.shape, x.dtype, bool(getattr(x, "weak_type", False)), x.sharding) for x in leaves)


class Ahead:
  """`fn` (a jax.jit function) compiled for `example_args` (arrays or jax.ShapeDtypeStruct with shardings) in a
  background thread, starting now. Call it as `fn`."""

  def __init__(self, fn: Callable, *example_args: Any, name: str = ""):
    self.fn, self.name = fn, name or getattr(fn, "__name__", "function")
    self._compiled = {}
    self._warned = False
    self.add(*example_args)

  def add(self, *example_args: Any) -> concurrent.futures.Future:
    """Also compiles `fn` for these arguments (another variant the run may call, e.g. a packed update), after
    the compiles already queued; the future says when it is ready."""
    compiled = self._compiled[signature(example_args)] = _POOL.submit(self.fn.lower(*example_args).compile)
    return compiled

  def __call__(self, *args: Any) -> Any:
    compiled = self._compiled.get(signature(args))
    if compiled is not None:
      return compiled.result()(*args)
    if not self._warned:
      self._warned = True
      logging.info("%s: compiled ahead for other argument shapes than this call's; compiling for them now", self.name)
    return self.fn(*args)


def in_background(fn: Callable, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
  """`fn(*args, **kwargs)` in a thread of its own kind (one at a time), beside `Ahead`'s compiles."""
  return _OTHER.submit(fn, *args, **kwargs)
