"""compile_ahead.Ahead: the executable compiled in a thread runs the calls it was compiled for, the jit the rest."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlvr import compile_ahead


def test_calls_like_the_example_run_the_executable_compiled_ahead_and_others_the_jit():
  traces = []

  @functools.partial(jax.jit, donate_argnums=0)
  def f(x, y):
    traces.append(x.shape)  # once per trace
    return x * 2 + y

  y = jnp.ones(8)
  ahead = compile_ahead.Ahead(f, jax.ShapeDtypeStruct((8,), jnp.float32, sharding=y.sharding), y)
  assert traces == [(8,)]  # traced at once, on the calling thread; compiled in the background
  np.testing.assert_array_equal(ahead(jnp.arange(8.0), y), np.arange(8.0) * 2 + 1)
  np.testing.assert_array_equal(ahead(jnp.ones(8), y), np.full(8, 3.0))
  assert traces == [(8,)]  # neither call traced: both ran the compiled executable
  np.testing.assert_array_equal(ahead(jnp.ones(4), jnp.ones(4)), np.full(4, 3.0))  # other shapes: the jit
  assert traces == [(8,), (4,)]
  ahead(jnp.ones(8, jnp.int32), y)  # another dtype: the jit again
  assert len(traces) == 3


def test_the_signature_is_what_an_executable_is_compiled_for_arrays_and_abstract_ones_alike():
  x = jnp.ones((2, 3))
  abstract = jax.ShapeDtypeStruct((2, 3), jnp.float32, sharding=x.sharding)
  assert compile_ahead.signature({"a": x}) == compile_ahead.signature({"a": abstract})
  assert compile_ahead.signature({"a": x}) != compile_ahead.signature({"b": x})  # another tree
  assert compile_ahead.signature(x) != compile_ahead.signature(jnp.ones((3, 2)))
  assert compile_ahead.signature(jnp.asarray(1.0)) != compile_ahead.signature(1.0 * jnp.ones(()))  # weak type


def test_added_variants_compile_after_the_first_and_run_their_executables():
  traces = []

  @jax.jit
  def f(x):
    traces.append(x.shape)
    return x + 1

  spec = lambda n: jax.ShapeDtypeStruct((n,), jnp.float32, sharding=jnp.ones(1).sharding)
  ahead = compile_ahead.Ahead(f, spec(8))
  ready = ahead.add(spec(4))  # a second variant (the trainer's packed updates), queued after the first
  assert traces == [(8,), (4,)]
  np.testing.assert_array_equal(ahead(jnp.ones(4)), np.full(4, 2.0))
  assert ready.done()
  np.testing.assert_array_equal(ahead(jnp.ones(8)), np.full(8, 2.0))
  assert traces == [(8,), (4,)]  # both calls ran what was compiled ahead
