"""Hugging Face checkpoints in and out: config.json (transformers 4 and 5 styles) and safetensors (single or sharded).

Loading reads each tensor through a memory map of its safetensors file (safetensors' own numpy reader cannot
return bfloat16, so the small reader and writer of the format live here), transforms it
into our layout and puts it straight onto its sharded place, so a checkpoint never sits whole in host memory twice.
Saving writes transformers-5 style config.json plus safetensors that `transformers.AutoModelForCausalLM` loads.

Layout mapping (HF torch Linear weights are [out, in]; ours are [in, out] with heads split out):
  model.embed_tokens.weight        [V, D]      -> embed                [V, D]
  ...self_attn.q_proj.weight       [N*H, D]    -> attn.q_proj          [D, N, H]   (k/v: [K*H, D] -> [D, K, H])
  ...self_attn.q_proj.bias         [N*H]       -> attn.q_bias          [N, H]
  ...self_attn.o_proj.weight       [D, N*H]    -> attn.o_proj          [N, H, D]
  ...self_attn.q_norm.weight       [H]         -> attn.q_norm.scale    [H]         (Qwen3)
  ...mlp.gate_proj.weight          [F, D]      -> mlp.gate_proj        [D, F]      (up alike; down [D, F] -> [F, D])
  lm_head.weight                   [V, D]      -> lm_head              [D, V]      (untied only)
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxrlvr.models.config import MODEL_TYPES, ModelConfig
from jaxrlvr.models.sharding import BATCH_AXES, param_shardings
from jaxrlvr.models.transformer import Transformer

_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Buffers some older checkpoints carry that are recomputed here, never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


# ----------------------------------------------------------------------------------------------------------------------
# config.json
# ----------------------------------------------------------------------------------------------------------------------


def config_from_hf(hf: dict[str, Any], *, source: str = "config.json", **overrides: Any) -> ModelConfig:
  """ModelConfig from a parsed HF config.json of either style; `overrides` set our own fields (dtypes, remat, ...).

  transformers 4 keeps `rope_theta` / `rope_scaling` / `torch_dtype` at the top level; transformers 5 nests them in
  `rope_parameters` and writes `dtype`. Architecture options this decoder does not implement stop with the key.
  """
  model_type = hf.get("model_type")
  if model_type not in MODEL_TYPES:
    raise ValueError(f"models/hf.py: {source}: model_type={model_type!r} is not supported; supported: {MODEL_TYPES}")

  def unsupported(key: str, value: Any) -> ValueError:
    return ValueError(f"models/hf.py: {source}: {key}={value!r} is not supported for model_type {model_type!r}")

  if hf.get("hidden_act", "silu") != "silu":
    raise unsupported("hidden_act", hf["hidden_act"])
  if hf.get("mlp_bias", False):
    raise unsupported("mlp_bias", hf["mlp_bias"])
  if hf.get("use_sliding_window", False):
    raise unsupported("use_sliding_window", hf["use_sliding_window"])
  if model_type == "qwen2":
    qkv_bias = True  # Qwen2 always has q/k/v biases and no o_proj bias.
  else:
    if hf.get("attention_bias", False):  # Llama / Qwen3 attention_bias also adds an o_proj bias we do not have.
      raise unsupported("attention_bias", hf["attention_bias"])
    qkv_bias = False

  rope = hf.get("rope_parameters")
  if isinstance(rope, dict):  # transformers 5
    rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
  else:  # transformers 4
    rope_theta = float(hf.get("rope_theta", 10000.0))
    scaling = dict(hf.get("rope_scaling") or {})
  rope_type = scaling.get("rope_type", scaling.get("type", "default"))
  if rope_type == "default":
    scaling = None
  elif rope_type == "llama3":
    scaling = {"rope_type": "llama3", **{k: scaling[k] for k in (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}}
  else:
    raise unsupported("rope_type", rope_type)

  num_heads = int(hf["num_attention_heads"])
  fields = dict(
      model_type=model_type,
      vocab_size=int(hf["vocab_size"]),
      hidden_size=int(hf["hidden_size"]),
      intermediate_size=int(hf["intermediate_size"]),
      num_layers=int(hf["num_hidden_layers"]),
      num_heads=num_heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
      head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
      rope_theta=rope_theta,
      rope_scaling=scaling,
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      qkv_bias=qkv_bias,
      qk_norm=model_type == "qwen3",
      max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
      initializer_range=float(hf.get("initializer_range", 0.02)),
  )
  fields.update(overrides)
  return ModelConfig(**fields)


def checkpoint_dtype(hf: dict[str, Any]) -> str | None:
  """The dtype the checkpoint was saved in (`dtype` in transformers 5, `torch_dtype` in 4), if it says."""
  return hf.get("dtype") or hf.get("torch_dtype")


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
  """A transformers-5 style config.json dict; fails on combinations HF's classes cannot express."""
  c = config
  expected = {"qwen2": (True, False), "llama": (False, False), "qwen3": (False, True)}[c.model_type]
  if (c.qkv_bias, c.qk_norm) != expected:
    raise ValueError(f"models/hf.py: model_type {c.model_type!r} in transformers needs qkv_bias={expected[0]} and "
                     f"qk_norm={expected[1]}; got qkv_bias={c.qkv_bias}, qk_norm={c.qk_norm}")
  rope = {"rope_type": "default", "rope_theta": c.rope_theta}
  if c.rope_scaling is not None:
    rope = {**c.rope_scaling, "rope_theta": c.rope_theta}
  hf = {
      "architectures": [_ARCHITECTURES[c.model_type]],
      "model_type": c.model_type,
      "vocab_size": c.vocab_size,
      "hidden_size": c.hidden_size,
      "intermediate_size": c.intermediate_size,
      "num_hidden_layers": c.num_layers,
      "num_attention_heads": c.num_heads,
      "num_key_value_heads": c.num_kv_heads,
      "head_dim": c.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": c.max_position_embeddings,
      "rms_norm_eps": c.rms_norm_eps,
      "rope_parameters": rope,
      "tie_word_embeddings": c.tie_embeddings,
      "initializer_range": c.initializer_range,
      "use_cache": True,
      "dtype": c.param_dtype,
  }
  if c.model_type in ("llama", "qwen3"):
    hf["attention_bias"] = False
  if c.model_type == "llama":
    hf["mlp_bias"] = False
  if c.model_type in ("qwen2", "qwen3"):
    hf["use_sliding_window"] = False
  return hf


# ----------------------------------------------------------------------------------------------------------------------
# Tensor name and layout mapping
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One HF tensor and the parameter it becomes. `kind` says how the layouts differ (see module docstring)."""
  hf_name: str
  path: tuple[Any, ...]
  kind: str  # identity | linear | heads_in | heads_bias | heads_out


def _hf_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
  if kind == "identity":
    return shape
  if kind == "linear":  # ours [in, out]
    return (shape[1], shape[0])
  if kind == "heads_in":  # ours [D, N, H]
    return (shape[1] * shape[2], shape[0])
  if kind == "heads_bias":  # ours [N, H]
    return (shape[0] * shape[1],)
  return (shape[2], shape[0] * shape[1])  # heads_out, ours [N, H, D]


def _to_ours(kind: str, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  if kind == "identity":
    return w
  if kind == "linear":
    return w.T
  return w.T.reshape(shape) if kind in ("heads_in", "heads_out") else w.reshape(shape)


def _to_hf(kind: str, p: np.ndarray) -> np.ndarray:
  if kind == "identity":
    return p
  if kind == "linear":
    return p.T
  if kind == "heads_in":
    return p.reshape(p.shape[0], -1).T  # [D, N*H] -> [N*H, D]
  if kind == "heads_bias":
    return p.reshape(-1)
  return p.reshape(-1, p.shape[-1]).T  # [N*H, D] -> [D, N*H]


def param_map(config: ModelConfig) -> list[_Entry]:
  """Every HF tensor of a checkpoint for `config`, with the parameter path it maps to."""
  entries = [_Entry("model.embed_tokens.weight", ("embed",), "identity")]
  for i in range(config.num_layers):
    p, a = f"model.layers.{i}.", ("layers", i)
    entries.append(_Entry(p + "input_layernorm.weight", a + ("input_norm", "scale"), "identity"))
    entries.append(_Entry(p + "post_attention_layernorm.weight", a + ("post_attn_norm", "scale"), "identity"))
    for name in ("q", "k", "v"):
      entries.append(_Entry(p + f"self_attn.{name}_proj.weight", a + ("attn", f"{name}_proj"), "heads_in"))
      if config.qkv_bias:
        entries.append(_Entry(p + f"self_attn.{name}_proj.bias", a + ("attn", f"{name}_bias"), "heads_bias"))
    entries.append(_Entry(p + "self_attn.o_proj.weight", a + ("attn", "o_proj"), "heads_out"))
    if config.qk_norm:
      entries.append(_Entry(p + "self_attn.q_norm.weight", a + ("attn", "q_norm", "scale"), "identity"))
      entries.append(_Entry(p + "self_attn.k_norm.weight", a + ("attn", "k_norm", "scale"), "identity"))
    for name in ("gate", "up", "down"):
      entries.append(_Entry(p + f"mlp.{name}_proj.weight", a + ("mlp", f"{name}_proj"), "linear"))
  entries.append(_Entry("model.norm.weight", ("final_norm", "scale"), "identity"))
  if not config.tie_embeddings:
    entries.append(_Entry("lm_head.weight", ("lm_head",), "linear"))
  return entries


# ----------------------------------------------------------------------------------------------------------------------
# The safetensors format: 8-byte little-endian header size, a JSON header {name: {dtype, shape, data_offsets}}, then
# the raw little-endian C-order bytes. https://github.com/huggingface/safetensors#format
# ----------------------------------------------------------------------------------------------------------------------

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


def _read_header(file: str) -> tuple[dict[str, Any], int]:
  """The tensor entries of a safetensors file and the byte offset where the data starts."""
  with open(file, "rb") as f:
    (size,) = np.frombuffer(f.read(8), dtype="<u8")
    header = json.loads(f.read(int(size)))
  header.pop("__metadata__", None)
  return header, 8 + int(size)


class _Readers:
  """Memory maps of the open safetensors files; `get` returns a zero-copy view of one tensor."""

  def __init__(self):
    self._files: dict[str, tuple[dict[str, Any], np.memmap]] = {}

  def get(self, file: str, name: str) -> np.ndarray:
    if file not in self._files:
      header, start = _read_header(file)
      self._files[file] = (header, np.memmap(file, dtype=np.uint8, mode="r", offset=start))
    header, data = self._files[file]
    if name not in header:
      raise ValueError(f"models/hf.py: tensor {name!r} is listed in the index but absent from {file!r}")
    entry = header[name]
    if entry["dtype"] not in _ST_DTYPES:
      raise ValueError(f"models/hf.py: tensor {name!r} in {file!r} has unsupported dtype {entry['dtype']!r}")
    begin, end = entry["data_offsets"]
    return data[begin:end].view(_ST_DTYPES[entry["dtype"]]).reshape(entry["shape"])

  def close(self) -> None:
    self._files.clear()  # dropping the memmaps unmaps the files


def _write_safetensors(file: str, specs: list[tuple], *, metadata: dict[str, str], write: bool = True) -> int:
  """Writes tensors given as (name, shape, dtype, getter) one at a time; returns the data size in bytes.

  With write=False the getters still run (they may be collective gathers every process must join) but nothing is
  written.
  """
  header, offset = {}, 0
  for name, shape, dtype, _ in specs:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    header[name] = {"dtype": _ST_NAMES[np.dtype(dtype)], "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  header["__metadata__"] = metadata
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the data should start 8-byte aligned
  f = open(file, "wb") if write else None
  try:
    if f:
      f.write(np.uint64(len(blob)).astype("<u8").tobytes())
      f.write(blob)
    for name, shape, dtype, getter in specs:
      value = getter()
      assert value.shape == tuple(shape) and value.dtype == dtype, (name, value.shape, value.dtype)
      if f:
        f.write(value.tobytes())  # numpy's native order, little-endian on every platform jax supports
  finally:
    if f:
      f.close()
  return offset


# ----------------------------------------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------------------------------------


def read_config(path: str) -> dict[str, Any]:
  config_path = os.path.join(path, "config.json")
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"models/hf.py: no config.json in checkpoint directory {path!r}")
  with open(config_path) as f:
    return json.load(f)


def _weight_files(path: str) -> dict[str, str]:
  """HF tensor name -> safetensors file (single file, or sharded through the index)."""
  index_path = os.path.join(path, _INDEX_FILE)
  if os.path.isfile(index_path):
    with open(index_path) as f:
      weight_map = json.load(f)["weight_map"]
    return {name: os.path.join(path, file) for name, file in weight_map.items()}
  single = os.path.join(path, _SINGLE_FILE)
  if os.path.isfile(single):
    return {name: single for name in _read_header(single)[0]}
  raise FileNotFoundError(f"models/hf.py: neither {_SINGLE_FILE} nor {_INDEX_FILE} in checkpoint directory {path!r}")


def load_pretrained(path: str, *, dtype: Any = jnp.float32, compute_dtype: Any = None,
                    mesh: jax.sharding.Mesh | None = None, rules: Any = None,
                    **config_overrides: Any) -> tuple[Transformer, ModelConfig]:
  """Loads an HF checkpoint directory into a Transformer.

  Args:
    path: directory with config.json and model.safetensors or model.safetensors.index.json + shards.
    dtype: parameter dtype (tensors are cast on the host, one at a time); None keeps the checkpoint's dtype.
    compute_dtype: matmul dtype; None means `dtype`.
    mesh, rules: when a mesh is given each tensor is placed with the NamedSharding its logical axes get from `rules`
      (default `models.sharding.DEFAULT_RULES`); otherwise on the default device.
    config_overrides: other ModelConfig fields (attention, remat).
  Returns:
    (model, model_config).
  """
  hf = read_config(path)
  source = os.path.join(path, "config.json")
  if dtype is None:
    dtype = checkpoint_dtype(hf) or "float32"
  config = config_from_hf(hf, source=source, param_dtype=dtype,
                          compute_dtype=dtype if compute_dtype is None else compute_dtype, **config_overrides)
  files = _weight_files(path)
  entries = param_map(config)

  expected = {e.hf_name for e in entries}
  ignored = {n for n in files if n.endswith(_IGNORED_SUFFIXES)}
  if config.tie_embeddings:
    ignored |= {"lm_head.weight"} & set(files)  # tied: HF also ignores a stored copy of the embedding
  missing = sorted(expected - set(files))
  if missing:
    raise ValueError(f"models/hf.py: checkpoint {path!r} is missing {len(missing)} tensor(s) that model_type "
                     f"{config.model_type!r} needs, e.g. {missing[:5]}")
  unexpected = sorted(set(files) - expected - ignored)
  if unexpected:
    raise ValueError(f"models/hf.py: checkpoint {path!r} has {len(unexpected)} unexpected tensor(s), e.g. "
                     f"{unexpected[:5]} in {os.path.basename(files[unexpected[0]])}")

  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  if mesh is not None:  # rows of the hidden states over the batch axes (Transformer._hold_sharding)
    abstract.activation_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(BATCH_AXES))
  graphdef, abs_state = nnx.split(abstract)
  flat = dict(nnx.to_flat_state(abs_state))
  shardings = None
  if mesh is not None:
    shardings = dict(nnx.to_flat_state(param_shardings(abs_state, mesh, rules)))

  readers = _Readers()
  try:
    for e in entries:
      var = flat[e.path]
      shape = tuple(var.shape)
      w = readers.get(files[e.hf_name], e.hf_name)
      if tuple(w.shape) != _hf_shape(e.kind, shape):
        raise ValueError(f"models/hf.py: tensor {e.hf_name!r} in {os.path.basename(files[e.hf_name])} has shape "
                         f"{tuple(w.shape)}, config.json implies {_hf_shape(e.kind, shape)}")
      value = np.ascontiguousarray(_to_ours(e.kind, w, shape)).astype(var.dtype, copy=False)  # one tensor on host
      if shardings is None:
        var.set_value(jax.device_put(value))
      else:
        sharding = shardings[e.path].get_value() if isinstance(shardings[e.path], nnx.Variable) else shardings[e.path]
        var.set_value(jax.make_array_from_callback(shape, sharding, lambda idx, v=value: v[idx]))
      del value
  finally:
    readers.close()
  return nnx.merge(graphdef, nnx.from_flat_state(list(flat.items()))), config


# ----------------------------------------------------------------------------------------------------------------------
# Save
# ----------------------------------------------------------------------------------------------------------------------


def _host_array(x: jax.Array) -> np.ndarray:
  """The full value on this host (gathered across processes when the array spans several)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def save_pretrained(model: Transformer, model_config: ModelConfig, path: str, *, dtype: Any = None,
                    max_shard_bytes: int = 5 * 2**30) -> None:
  """Writes `path`/config.json and safetensors that transformers' AutoModelForCausalLM loads.

  Tensors are fetched and written one at a time. Above `max_shard_bytes` the weights are split into
  model-0000i-of-0000n.safetensors files with a model.safetensors.index.json, as transformers does. `dtype` casts on
  save (default: the parameter dtype). Every process must call this (gathers are collective); process 0 writes.
  """
  hf = config_to_hf(model_config)
  entries = param_map(model_config)
  flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  out_dtype = np.dtype(jnp.dtype(dtype if dtype is not None else model_config.param_dtype))
  hf["dtype"] = out_dtype.name

  specs = []  # (name, shape, dtype, getter)
  for e in entries:
    var = flat[e.path]
    shape = _hf_shape(e.kind, tuple(var.shape))
    getter: Callable[[], np.ndarray] = (
        lambda v=var, k=e.kind: np.ascontiguousarray(_to_hf(k, _host_array(v[...]))).astype(out_dtype, copy=False))
    specs.append((e.hf_name, shape, out_dtype, getter))

  # Split into shards of at most max_shard_bytes (a single tensor larger than that gets a shard of its own).
  shards: list[list[tuple]] = [[]]
  size = 0
  for spec in specs:
    nbytes = int(np.prod(spec[1])) * spec[2].itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(spec)
    size += nbytes

  write = jax.process_index() == 0
  if write:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump(hf, f, indent=2)
  names = ([_SINGLE_FILE] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  weight_map, total = {}, 0
  for name, shard in zip(names, shards):
    total += _write_safetensors(os.path.join(path, name), shard, metadata={"format": "pt"}, write=write)
    weight_map.update({spec[0]: name for spec in shard})
  if write and len(shards) > 1:
    with open(os.path.join(path, _INDEX_FILE), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
