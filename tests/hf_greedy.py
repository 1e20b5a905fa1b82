"""What the samplers' transformers parity tests share: a tiny random transformers model and its greedy tokens."""
import numpy as np


def tiny_model(kind: str = "qwen2", max_positions: int = 128):
  """A tiny random transformers model (torch, float32): "qwen2" (tied embeddings) or "llama" (untied)."""
  import torch
  import transformers

  torch.manual_seed(0)
  common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=max_positions, initializer_range=0.2, rms_norm_eps=1e-6)
  if kind == "qwen2":
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=True, **common)).eval()
  return transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=False, **common)).eval()


def greedy(hf, prompts: list[list[int]], new_tokens: int, eos: int | None = None) -> np.ndarray:
  """transformers' greedy `generate` on the prompts left-padded into one batch: [rows, tokens] after the prompts.
  Without `eos` every row makes exactly `new_tokens`; with it, rows pad after their stop (pad id 0)."""
  import torch

  width = max(len(p) for p in prompts)
  ids = torch.zeros((len(prompts), width), dtype=torch.long)
  mask = torch.zeros_like(ids)
  for row, p in enumerate(prompts):
    ids[row, width - len(p):] = torch.tensor(p)
    mask[row, width - len(p):] = 1
  lower = {} if eos is not None else {"min_new_tokens": new_tokens}
  with torch.no_grad():
    out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, pad_token_id=0,
                      eos_token_id=eos, **lower)
  return out[:, width:].numpy()
