"""Flax NNX decoder (Llama 3.x, Qwen2 / Qwen2.5, Qwen3) with a KV cache, presets and HF safetensors in and out."""
from jaxrlvr.models.config import ModelConfig, PRESETS, get_preset, from_config
from jaxrlvr.models.transformer import Transformer

__all__ = ["ModelConfig", "PRESETS", "get_preset", "from_config", "Transformer"]
