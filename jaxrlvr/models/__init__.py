"""Flax NNX decoder (Llama 3.x, Qwen2 / Qwen2.5, Qwen3) with a KV cache, presets and HF safetensors in and out."""
from jaxrlvr.models.config import PRESETS, ModelConfig, from_config, get_preset
from jaxrlvr.models.transformer import Transformer
from jaxrlvr.models.hf import load_pretrained, save_pretrained

__all__ = ["ModelConfig", "PRESETS", "get_preset", "from_config", "Transformer", "load_pretrained",
           "save_pretrained"]
