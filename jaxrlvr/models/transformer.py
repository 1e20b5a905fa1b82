"""The Flax NNX decoder: Llama 3.x, Qwen2 / Qwen2.5 and Qwen3 in one module.

Differences between the families are config switches (`qkv_bias`, `qk_norm`, `tie_embeddings`, `rope_scaling`), so
a Hugging Face checkpoint of any of them maps tensor by tensor onto these parameters (see `models/hf.py`).

Shapes: B batch, T query length, S key length (cache slots), D hidden, N query heads, K kv heads, G = N // K query heads
per kv head, H head_dim, F MLP width, V vocab. Every parameter carries logical axis names in its `out_sharding`
metadata ('vocab', 'embed', 'q_heads', 'kv_heads', 'head_dim', 'mlp', 'norm'); `parallel.py` maps them to mesh axes.
Variables are created with `eager_sharding=False` so that building a model needs no mesh: `parallel.create_model`
places them.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrlvr.models import attention as attention_lib
# The xla path's pieces, importable from here as before the attention moved to models/attention.py.
from jaxrlvr.models.attention import attention_weights_mask, dot_product_attention  # noqa: F401
from jaxrlvr.models.config import ModelConfig

Cache = list  # one {'k': [B, K, S, H], 'v': [B, K, S, H]} dict per layer


def _param(rngs: nnx.Rngs | None, shape: tuple[int, ...], names: tuple[str, ...], dtype: Any, *,
           init: str = "normal", stddev: float = 0.02) -> nnx.Param:
  """A parameter with logical axis names; `init` is 'normal' (HF's initializer_range), 'zeros' or 'ones'."""
  assert len(shape) == len(names), (shape, names)
  if init == "normal":
    value = stddev * jax.random.normal(rngs.params(), shape, jnp.float32)
  elif init == "zeros":
    value = jnp.zeros(shape, jnp.float32)
  else:
    value = jnp.ones(shape, jnp.float32)
  return nnx.Param(value.astype(dtype), out_sharding=names, eager_sharding=False)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
  """Inverse RoPE frequencies [H/2] in float32, with HF's llama3 rescaling when `config.rope_scaling` asks for it."""
  dim = config.head_dim
  inv_freq = 1.0 / (np.float32(config.rope_theta) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
  inv_freq = inv_freq.astype(np.float32)
  scaling = config.rope_scaling
  if scaling is None or scaling.get("rope_type", scaling.get("type")) == "default":
    return inv_freq
  # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
  factor = float(scaling["factor"])
  low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
  old_len = float(scaling["original_max_position_embeddings"])
  low_wavelen, high_wavelen = old_len / low, old_len / high
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotates [B, T, heads, H] by `positions` [B, T] in HF's rotate-half layout (first half / second half pairs)."""
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
  cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, H/2]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class RMSNorm(nnx.Module):
  """RMSNorm as HF computes it: normalise in float32, cast back, then scale."""

  def __init__(self, dim: int, eps: float, param_dtype: Any):
    self.eps = eps
    self.scale = _param(None, (dim,), ("norm",), param_dtype, init="ones")

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(x.dtype) * y.astype(x.dtype)


class Attention(nnx.Module):
  """GQA self-attention with RoPE, optional q/k/v bias (Qwen2) and q/k RMSNorm (Qwen3), and a KV cache."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c, pd = config, config.param_dtype
    self.config = config
    d, n, kv, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    self.q_proj = _param(rngs, (d, n, h), ("embed", "q_heads", "head_dim"), pd, stddev=c.initializer_range)
    self.k_proj = _param(rngs, (d, kv, h), ("embed", "kv_heads", "head_dim"), pd, stddev=c.initializer_range)
    self.v_proj = _param(rngs, (d, kv, h), ("embed", "kv_heads", "head_dim"), pd, stddev=c.initializer_range)
    self.o_proj = _param(rngs, (n, h, d), ("q_heads", "head_dim", "embed"), pd, stddev=c.initializer_range)
    if c.qkv_bias:
      self.q_bias = _param(None, (n, h), ("q_heads", "head_dim"), pd, init="zeros")
      self.k_bias = _param(None, (kv, h), ("kv_heads", "head_dim"), pd, init="zeros")
      self.v_bias = _param(None, (kv, h), ("kv_heads", "head_dim"), pd, init="zeros")
    if c.qk_norm:
      self.q_norm = RMSNorm(h, c.rms_norm_eps, pd)
      self.k_norm = RMSNorm(h, c.rms_norm_eps, pd)

  def __call__(self, x: jax.Array, positions: jax.Array, key_mask: jax.Array, cache: dict | None,
               cache_index: jax.Array | None) -> tuple[jax.Array, dict | None]:
    c = self.config
    dt = x.dtype
    q = jnp.einsum("BTD,DNH->BTNH", x, self.q_proj[...].astype(dt))
    k = jnp.einsum("BTD,DKH->BTKH", x, self.k_proj[...].astype(dt))
    v = jnp.einsum("BTD,DKH->BTKH", x, self.v_proj[...].astype(dt))
    if c.qkv_bias:
      q = q + self.q_bias[...].astype(dt)
      k = k + self.k_bias[...].astype(dt)
      v = v + self.v_bias[...].astype(dt)
    if c.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = rope_inv_freq(c)  # a numpy constant at trace time
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq).swapaxes(1, 2)  # [B, K, T, H], the cache's layout
    v = v.swapaxes(1, 2)  # [B, K, T, H]

    t = x.shape[1]
    if cache is None:
      query_slots = jnp.arange(t)
      new_cache = None
    else:
      # Write this chunk's keys/values at slots [cache_index, cache_index + T) and attend over the whole cache.
      zero = jnp.zeros((), jnp.int32)
      idx = (zero, zero, jnp.asarray(cache_index, jnp.int32), zero)
      k = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), idx)  # [B, K, S, H]
      v = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), idx)  # [B, K, S, H]
      new_cache = {"k": k, "v": v}
      k, v = k.astype(dt), v.astype(dt)
      query_slots = cache_index + jnp.arange(t)
    out = attention_lib.attend(q, k, v, query_slots, key_mask, implementation=c.attention,
                               block_size=c.attention_block_size)  # [B, T, N, H]
    out = jnp.einsum("BTNH,NHD->BTD", out, self.o_proj[...].astype(dt))
    return out, new_cache


@jax.custom_vjp
def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
  """down(silu(x @ w_gate) * (x @ w_up)): x [B, T, D], w_gate and w_up [D, F], w_down [F, D] -> [B, T, D].

  The VJP is written out because autodiff's made the update step on XLA:CPU ~1.4x slower (docs/benchmarks.md).
  Its weight gradients contract over the N = B * T tokens (x^T . d_gate), and XLA:CPU materialised the wide operand
  transposed for them: d_gate as [F, N], an 11 MB copy per layer per step at the embedded default, written while the
  step's activations no longer fit in the 32 MB L3 of a machine whose memory moves ~7 GB/s. Below, the narrow
  operands ([N, D] inputs and output gradients) are the ones transposed, and the backward pass keeps only x, gate and
  up. The math is autodiff's; the elementwise derivative is taken in float32.
  """
  return _swiglu_fwd(x, w_gate, w_up, w_down)[0]


def _swiglu_fwd(x, w_gate, w_up, w_down):
  gate = jnp.einsum("BTD,DF->BTF", x, w_gate)
  up = jnp.einsum("BTD,DF->BTF", x, w_up)
  out = jnp.einsum("BTF,FD->BTD", jax.nn.silu(gate) * up, w_down)
  return out, (x, w_gate, w_up, w_down, gate, up)


def _swiglu_bwd(residuals, d_out):
  x, w_gate, w_up, w_down, gate, up = residuals
  dim, width = w_gate.shape
  gate32, up32 = gate.astype(jnp.float32), up.astype(jnp.float32)
  sigmoid = jax.nn.sigmoid(gate32)
  silu = gate32 * sigmoid
  d_hidden = jnp.einsum("BTD,FD->BTF", d_out, w_down).astype(jnp.float32)  # [B, T, F]
  d_up = (d_hidden * silu).astype(up.dtype)
  d_gate = (d_hidden * up32 * sigmoid * (1.0 + gate32 * (1.0 - sigmoid))).astype(gate.dtype)
  hidden = (silu * up32).astype(x.dtype)
  x_t = x.reshape(-1, dim).T  # [D, N]
  d_out_t = d_out.reshape(-1, dim).T  # [D, N]
  d_w_gate = x_t @ d_gate.reshape(-1, width)  # [D, F]
  d_w_up = x_t @ d_up.reshape(-1, width)  # [D, F]
  d_w_down = (d_out_t @ hidden.reshape(-1, width)).T  # [D, F] -> [F, D]
  d_x = jnp.einsum("BTF,DF->BTD", d_gate, w_gate) + jnp.einsum("BTF,DF->BTD", d_up, w_up)
  return d_x, d_w_gate, d_w_up, d_w_down


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)), with a hand-written VJP (`swiglu`)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c, pd = config, config.param_dtype
    self.gate_proj = _param(rngs, (c.hidden_size, c.intermediate_size), ("embed", "mlp"), pd,
                            stddev=c.initializer_range)
    self.up_proj = _param(rngs, (c.hidden_size, c.intermediate_size), ("embed", "mlp"), pd,
                          stddev=c.initializer_range)
    self.down_proj = _param(rngs, (c.intermediate_size, c.hidden_size), ("mlp", "embed"), pd,
                            stddev=c.initializer_range)

  def __call__(self, x: jax.Array) -> jax.Array:
    dt = x.dtype
    return swiglu(x, self.gate_proj[...].astype(dt), self.up_proj[...].astype(dt), self.down_proj[...].astype(dt))


class Block(nnx.Module):
  """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.param_dtype)
    self.attn = Attention(config, rngs=rngs)
    self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.param_dtype)
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x, positions, key_mask, cache, cache_index):
    h, new_cache = self.attn(self.input_norm(x), positions, key_mask, cache, cache_index)
    x = x + h
    x = x + self.mlp(self.post_attn_norm(x))
    return x, new_cache


def _apply_block(graphdef: nnx.GraphDef, state: nnx.State, x, positions, key_mask, cache, cache_index):
  return nnx.merge(graphdef, state)(x, positions, key_mask, cache, cache_index)


# One jitted function for every block. Inside an outer jit, JAX traces and lowers a nested jit once per (graph,
# input shapes) and reuses it, so the 30 blocks of a 30-layer model are traced once, not 30 times; XLA inlines the
# calls when it compiles, so the compiled program is the unrolled one. Tracing the smollm2-135m preset's update went
# from 2.9 s to 1.1 s (jax 0.10.2); a warm compilation cache saves the compile, not the tracing.
_apply_block_jit = jax.jit(_apply_block, static_argnums=0)


def _run_block(block: Block, x, positions, key_mask, cache, cache_index):
  graphdef, state = nnx.split(block)
  return _apply_block_jit(graphdef, state, x, positions, key_mask, cache, cache_index)


def _run_block_remat(block: Block, x, positions, key_mask, cache, cache_index):
  """`_run_block` under `jax.checkpoint`: the backward pass recomputes the block's activations from its input.

  The block enters a pure function as (graphdef, state) instead of through `nnx.remat`, which refuses parameters
  merged at an outer trace level (TraceContextError): the scorer and the sampler merge the model outside their
  lax.map / while_loop bodies, so with remat on they failed.
  """
  graphdef, state = nnx.split(block)
  remat = jax.checkpoint(_apply_block_jit, static_argnums=0)
  return remat(graphdef, state, x, positions, key_mask, cache, cache_index)


def _scan_blocks(blocks, x, positions, key_mask, *, remat: bool, hold) -> jax.Array:
  """The blocks applied in order as one `jax.lax.scan` over their stacked weights (no cache): x [B, T, D] -> x.

  Why: XLA compiles the loop's body, one layer's program, once, where the unrolled loop gives it L copies to optimise
  and schedule; MaxText scans its layers for the same reason. The parameters keep their layout (one Block per layer,
  as checkpoints, HF loading and export, the sharding rules and the optimizer state have them): the stacked arrays
  are built here, inside the traced function. Each floating leaf is cast to the compute dtype before stacking, as the
  block casts every weight to it where it uses it, so no number changes and a float32 model's stack is half its size.

  What it costs: the stacked copy of the layers' weights in the compute dtype, [L, ...] per leaf, and in the update
  the stacked gradient of that copy (the scan's backward writes one layer's slice per iteration) before it is cast
  back and split into each layer's gradient.

  `hold` is `Transformer._hold_sharding`, kept on the carry as the unrolled loop keeps it between blocks. With
  `remat` the body goes under `jax.checkpoint`, as `_run_block_remat` does, and the backward recomputes one layer
  at a time.
  """
  dt = x.dtype
  graphdef = nnx.graphdef(blocks[0])  # every block has the same structure; only their weights differ
  states = [nnx.state(block) for block in blocks]

  def stack(*leaves):
    return jnp.stack([leaf.astype(dt) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf for leaf in leaves])

  stacked = jax.tree.map(stack, *states)  # one State whose leaves are [L, ...]

  def body(carry, state):
    out, _ = _apply_block(graphdef, state, carry, positions, key_mask, None, None)
    return hold(out), None

  if remat:
    # prevent_cse=False: the scan already keeps XLA from merging the recomputation back into the forward, so the
    # optimisation barriers prevent_cse adds are not needed there (jax.checkpoint's documentation). The scan's
    # residuals are then each layer's input x; the weights' slices are read again from the stacked copy.
    body = jax.checkpoint(body, prevent_cse=False)
  x, _ = jax.lax.scan(body, x, stacked)
  return x


class Transformer(nnx.Module):
  """Decoder-only language model. See the module docstring for shapes and `models/__init__.py` for the API."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    self.config = config
    self.embed = _param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"), c.param_dtype,
                        stddev=c.initializer_range)
    self.layers = nnx.List([Block(c, rngs=rngs) for _ in range(c.num_layers)])
    self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.param_dtype)
    if not c.tie_embeddings:
      self.lm_head = _param(rngs, (c.hidden_size, c.vocab_size), ("embed", "vocab"), c.param_dtype,
                            stddev=c.initializer_range)
    # The sharding the hidden states [B, T, D] are held to (`_hold_sharding`); parallel.create_model and
    # models.load_pretrained set it to their mesh's batch sharding. None: no constraint (no mesh).
    self.activation_sharding = None

  def __call__(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
               attention_mask: jax.Array | None = None) -> jax.Array:
    """input_ids [B, T] -> logits [B, T, V] float32 (no cache)."""
    hidden, _ = self.hidden(input_ids, positions=positions, attention_mask=attention_mask)
    return self.logits(hidden)

  def hidden(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
             attention_mask: jax.Array | None = None, cache: Cache | None = None,
             cache_index: jax.Array | None = None,
             segment_ids: jax.Array | None = None) -> tuple[jax.Array, Cache | None]:
    """Final-norm hidden states [B, T, D] and the updated cache (None without one).

    Without a cache, `attention_mask` is [B, T] over the inputs. With one, it is [B, S] over the cache slots and the
    inputs are written at slots [cache_index, cache_index + T); or, with `positions`, a boolean [B, T, S]: which
    slots each input attends to, as given (no causal rule added). Completions packed after shared prompts use it
    (`scoring.score_packed_completions`): a token sees its own prompt's slots and the earlier tokens of its own
    completion.

    `segment_ids` [B, T] (without a cache, in place of `attention_mask`) packs several sequences into a row, one
    after another: each token's sequence number (1, 2, ...), 0 for padding. A token attends only to the earlier
    tokens of its own sequence, so each gets the hidden states it would get alone, given `positions` [B, T] (each
    sequence's own, from 0), which are then required.
    """
    c = self.config
    dt = jnp.dtype(c.compute_dtype)
    b, t = input_ids.shape
    if segment_ids is not None:
      if cache is not None or attention_mask is not None or positions is None:
        raise ValueError("models/transformer.py: segment_ids (packed rows) go without a cache and attention_mask, "
                         "and with each sequence's positions")
      key_mask = segment_ids.astype(jnp.int32)  # segment ids: attention.attention_weights_mask
    elif cache is not None:
      if len(cache) != c.num_layers:
        raise ValueError(f"models/transformer.py: cache has {len(cache)} layers, the model {c.num_layers}")
      if cache_index is None:
        raise ValueError("models/transformer.py: cache_index is required when a cache is given")
      cache_index = jnp.asarray(cache_index, jnp.int32)
      num_slots = cache[0]["k"].shape[2]  # [B, K, S, H]
      key_mask = (jnp.ones((b, num_slots), bool) if attention_mask is None else attention_mask.astype(bool))
      if key_mask.ndim == 3 and (positions is None or key_mask.shape != (b, t, num_slots)):
        raise ValueError(f"models/transformer.py: a per-input attention_mask {key_mask.shape} must be [B, T, S] = "
                         f"{(b, t, num_slots)} and come with positions")
      if positions is None:
        if attention_mask is None:
          positions = jnp.broadcast_to(cache_index + jnp.arange(t), (b, t))
        else:
          # Position of a slot = number of real slots before it (left padding), read at this chunk's slots.
          slot_positions = jnp.maximum(jnp.cumsum(key_mask.astype(jnp.int32), axis=1) - 1, 0)  # [B, S]
          positions = jax.lax.dynamic_slice_in_dim(slot_positions, cache_index, t, axis=1)  # [B, T]
    else:
      key_mask = jnp.ones((b, t), bool) if attention_mask is None else attention_mask.astype(bool)
      if positions is None:
        if attention_mask is None:
          positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        else:
          positions = jnp.maximum(jnp.cumsum(key_mask.astype(jnp.int32), axis=1) - 1, 0)  # [B, T]

    x = self._hold_sharding(jnp.take(self.embed[...], input_ids, axis=0).astype(dt))  # [B, T, D]
    if c.scan_layers and cache is None:
      # The update's and the scorer's passes. The sampler keeps the unrolled loop: its cache is one dict per layer.
      x = _scan_blocks(list(self.layers), x, positions, key_mask, remat=c.remat, hold=self._hold_sharding)
      return self.final_norm(x), None
    run = _run_block_remat if c.remat else _run_block
    new_cache = [] if cache is not None else None
    for i, block in enumerate(self.layers):
      x, layer_cache = run(block, x, positions, key_mask, None if cache is None else cache[i], cache_index)
      x = self._hold_sharding(x)
      if cache is not None:
        new_cache.append(layer_cache)
    return self.final_norm(x), new_cache

  def _hold_sharding(self, x: jax.Array) -> jax.Array:
    """x [B, T, D] constrained to `activation_sharding` (rows over the batch axes), when one is set.

    Without it the partitioner gave the hidden states the embedding table's split of D over 'fsdp' and replicated
    the rows: on a 1 x 8 x 1 mesh every device computed all rows of a batch, 8x the activations (the scorer of a
    7B-wide layer: 90.5 GB of temporaries instead of 3.4 GB, `compiled.memory_analysis()`); with the rows held,
    each layer's weights are all-gathered instead, which is what FSDP means.
    """
    if self.activation_sharding is None:
      return x
    return jax.lax.with_sharding_constraint(x, self.activation_sharding)

  def unembedding(self) -> jax.Array:
    """The [D, V] output projection in the compute dtype (the transposed embedding when tied)."""
    dt = jnp.dtype(self.config.compute_dtype)
    if self.config.tie_embeddings:
      return self.embed[...].astype(dt).T  # [D, V]
    return self.lm_head[...].astype(dt)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> logits [..., V] in float32 (accumulated in float32 whatever the compute dtype)."""
    w = self.unembedding()
    return jnp.einsum("...D,DV->...V", hidden.astype(w.dtype), w, preferred_element_type=jnp.float32)

  def init_cache(self, batch_size: int, max_len: int, dtype: Any = None) -> Cache:
    """Zeroed KV cache: one {'k', 'v'} dict of [B, K, S, H] per layer, in the compute dtype unless `dtype` is given."""
    c = self.config
    dtype = jnp.dtype(c.compute_dtype if dtype is None else dtype)
    shape = (batch_size, c.num_kv_heads, max_len, c.head_dim)
    return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(c.num_layers)]
