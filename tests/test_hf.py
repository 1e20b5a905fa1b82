"""HF checkpoints: logits parity with transformers' PyTorch models, both config.json styles, save -> transformers,
sharded safetensors, and clear errors for bad checkpoints."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from flax import nnx

from jaxrlvr.models import Transformer, get_preset, load_pretrained, save_pretrained
from jaxrlvr.models import hf as hf_lib

_VOCAB = 50
_COMMON = dict(vocab_size=_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
_HF_CONFIGS = {
    "qwen2_tied": lambda: transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True),
    "qwen2_untied": lambda: transformers.Qwen2Config(**_COMMON, tie_word_embeddings=False),
    # theta 500000, head_dim 8: wavelengths 6.3, 167, 4443, 1.2e5 against the llama3 band [64, 256] of an original
    # length 256, so one frequency each is kept, smoothed and divided by the factor.
    "llama3_scaled": lambda: transformers.LlamaConfig(**_COMMON, head_dim=8, tie_word_embeddings=False,
                                                      rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    # head_dim 16 differs from hidden / heads = 8, as in the real Qwen3 models.
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=True),
}

# A left-padded batch: row 1 has two padding slots. HF gets the same positions (cumsum(mask) - 1) explicitly.
_IDS = np.array([[3, 17, 5, 9, 44, 2, 31, 8], [0, 0, 12, 7, 28, 40, 1, 19]], np.int64)
_MASK = np.array([[1] * 8, [0, 0] + [1] * 6], np.int64)
_POSITIONS = np.maximum(np.cumsum(_MASK, axis=1) - 1, 0)


def _hf_model(name: str, path: str) -> transformers.PreTrainedModel:
  """A tiny random transformers model, with noise on every weight (norm scales and biases included), saved to path."""
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(_HF_CONFIGS[name](), dtype=torch.float32).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  model.save_pretrained(path)
  return model


def _hf_logits(model) -> np.ndarray:
  with torch.no_grad():
    out = model(input_ids=torch.tensor(_IDS), attention_mask=torch.tensor(_MASK),
                position_ids=torch.tensor(_POSITIONS))
  return out.logits.float().numpy()


@nnx.jit
def _our_logits(model, ids, mask):
  return model(ids, attention_mask=mask)


def _assert_close_on_real_tokens(ours, theirs):
  real = _MASK.astype(bool)
  np.testing.assert_allclose(np.asarray(ours)[real], theirs[real], atol=1e-4, rtol=1e-4)


def _to_transformers4_style(path: str) -> None:
  """Rewrites a transformers-5 config.json as transformers 4 wrote it: top-level rope_theta / rope_scaling and
  torch_dtype instead of rope_parameters and dtype."""
  config_path = os.path.join(path, "config.json")
  with open(config_path) as f:
    config = json.load(f)
  rope = config.pop("rope_parameters")
  config["rope_theta"] = rope.pop("rope_theta")
  config["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
  config["torch_dtype"] = config.pop("dtype")
  with open(config_path, "w") as f:
    json.dump(config, f)


@pytest.mark.parametrize("name", sorted(_HF_CONFIGS))
def test_logits_match_transformers_and_save_round_trips(name, tmp_path):
  hf_model = _hf_model(name, str(tmp_path / "hf"))
  expected = _hf_logits(hf_model)

  model, config = load_pretrained(str(tmp_path / "hf"))
  assert config.model_type == hf_model.config.model_type
  assert config.tie_embeddings == bool(hf_model.config.tie_word_embeddings)
  _assert_close_on_real_tokens(_our_logits(model, jnp.asarray(_IDS), jnp.asarray(_MASK)), expected)

  # Our save_pretrained output loads in transformers and gives the same logits.
  save_pretrained(model, config, str(tmp_path / "ours"))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32).eval()
  np.testing.assert_allclose(_hf_logits(reloaded), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama3_scaled", "qwen2_untied"])
def test_transformers4_config_style(name, tmp_path):
  path = str(tmp_path / "hf")
  expected = _hf_logits(_hf_model(name, path))
  _to_transformers4_style(path)
  with open(os.path.join(path, "config.json")) as f:
    assert "rope_parameters" not in json.load(f)
  model, config = load_pretrained(path)
  if name == "llama3_scaled":
    assert config.rope_theta == 500000.0 and config.rope_scaling["rope_type"] == "llama3"
  _assert_close_on_real_tokens(_our_logits(model, jnp.asarray(_IDS), jnp.asarray(_MASK)), expected)


def test_sharded_safetensors_and_bfloat16_round_trip(tmp_path):
  """Saving above max_shard_bytes writes shards + index (as transformers does); both loaders read them."""
  config = get_preset("tiny").replace(num_layers=2)
  model = Transformer(config, rngs=nnx.Rngs(0))
  path = str(tmp_path / "sharded")
  save_pretrained(model, config, path, max_shard_bytes=200_000)
  with open(os.path.join(path, "model.safetensors.index.json")) as f:
    files = set(json.load(f)["weight_map"].values())
  assert len(files) > 1 and not os.path.exists(os.path.join(path, "model.safetensors"))
  loaded, loaded_config = load_pretrained(path)
  assert loaded_config == config
  ids = jnp.asarray(_IDS % config.vocab_size)
  mask = jnp.asarray(_MASK)
  np.testing.assert_allclose(np.asarray(_our_logits(loaded, ids, mask)), np.asarray(_our_logits(model, ids, mask)),
                             atol=1e-6)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = hf_model(input_ids=torch.tensor(np.asarray(ids)), attention_mask=torch.tensor(_MASK),
                      position_ids=torch.tensor(_POSITIONS)).logits.numpy()
  _assert_close_on_real_tokens(_our_logits(model, ids, mask), theirs)

  # bfloat16 on disk (safetensors' numpy reader cannot do bf16; ours memory-maps it), read back as bfloat16.
  bf16_path = str(tmp_path / "bf16")
  save_pretrained(model, config, bf16_path, dtype=jnp.bfloat16)
  with open(os.path.join(bf16_path, "config.json")) as f:
    assert json.load(f)["dtype"] == "bfloat16"
  bf16, bf16_config = load_pretrained(bf16_path, dtype=None)
  assert bf16_config.param_dtype == "bfloat16" and bf16.embed[...].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(bf16.embed[...]), np.asarray(model.embed[...].astype(jnp.bfloat16)))


# ----------------------------------------------------------------------------------------------------------------------
# Bad checkpoints: each stops with a message naming what is wrong.
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_checkpoint(tmp_path):
  config = get_preset("tiny").replace(num_layers=1)
  path = str(tmp_path / "ckpt")
  save_pretrained(Transformer(config, rngs=nnx.Rngs(0)), config, path)
  return path


def _edit_tensors(path, edit):
  file = os.path.join(path, "model.safetensors")
  tensors = safetensors.numpy.load_file(file)
  edit(tensors)
  safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor(tiny_checkpoint):
  _edit_tensors(tiny_checkpoint, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
  with pytest.raises(ValueError, match="missing 1 tensor.*model.layers.0.mlp.up_proj.weight"):
    load_pretrained(tiny_checkpoint)


def test_unexpected_tensor(tiny_checkpoint):
  _edit_tensors(tiny_checkpoint, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)}))
  with pytest.raises(ValueError, match="unexpected tensor.*model.layers.0.mlp.extra.weight.*model.safetensors"):
    load_pretrained(tiny_checkpoint)


def test_shape_mismatch(tiny_checkpoint):
  _edit_tensors(tiny_checkpoint, lambda t: t.update({"model.norm.weight": np.ones(100, np.float32)}))
  with pytest.raises(ValueError, match=r"'model.norm.weight'.*shape \(100,\).*\(128,\)"):
    load_pretrained(tiny_checkpoint)


def test_unsupported_model_type(tiny_checkpoint):
  config_path = os.path.join(tiny_checkpoint, "config.json")
  with open(config_path) as f:
    config = json.load(f)
  config["model_type"] = "gpt_neox"
  with open(config_path, "w") as f:
    json.dump(config, f)
  with pytest.raises(ValueError, match="config.json: model_type='gpt_neox' is not supported"):
    load_pretrained(tiny_checkpoint)


def test_unsupported_architecture_option_names_the_key():
  hf = hf_lib.config_to_hf(get_preset("llama3.1-8b"))
  hf["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
  with pytest.raises(ValueError, match="rope_type='yarn'"):
    hf_lib.config_from_hf(hf)


def test_published_config_files_map_to_the_presets():
  """config.json of Llama-3.1-8B as published (transformers 4 style, abridged to the keys that matter) gives the
  preset, and every preset survives config_to_hf -> config_from_hf."""
  llama = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "hidden_act": "silu", "hidden_size": 4096,
           "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
           "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
           "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
           "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256}
  assert hf_lib.config_from_hf(llama) == get_preset("llama3.1-8b")
  assert hf_lib.checkpoint_dtype(llama) == "bfloat16"
  for name in ("tiny", "qwen2.5-math-1.5b", "qwen2.5-math-7b", "llama3.1-8b", "qwen3-4b"):
    assert hf_lib.config_from_hf(hf_lib.config_to_hf(get_preset(name))) == get_preset(name), name
