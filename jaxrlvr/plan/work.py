"""The work of one call of each device program: FLOPs and HBM bytes, by arithmetic, for the step-time bounds.

`plan/topology.py` divides these by a chip's peak FLOP/s and HBM bandwidth. They are lower bounds on what the
program does, on purpose: only the matmuls and attention count as FLOPs (a token's forward is 2 x the dense
parameters, plus 2 x D x V for its logits where the program computes them, plus 4 x H_q x context a layer for
attention's two products), and only the weights, optimizer state and KV cache count as bytes (activations are
left out, which a fused program keeps on chip where it can). Remat recomputes the forward in the backward, so the
update's FLOPs are 4 forwards where `model_flops` (MFU's numerator) counts the 3 of the algorithm.

Shapes (memory_lib.Workload): R rows of the update batch, S = P + T tokens a row, r rows of one sampler call a
device, L layers, D hidden, F MLP width, N x H query width, K x H kv width, V vocabulary.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxrlvr.plan import memory as memory_lib


@dataclasses.dataclass(frozen=True)
class Work:
  """One call of a program, per device: FLOPs it must compute and bytes it must move through HBM."""
  flops: float
  hbm_bytes: float
  model_flops: float = 0.0  # the update's algorithmic FLOPs (MFU's numerator); 0 for the others
  tokens: int = 0  # tokens the call generates (decode) or processes


def _dense_params(m: Any) -> int:
  """Parameters a token's forward multiplies by, over all layers, without the embedding and the unembedding."""
  q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
  return m.num_layers * (2 * m.hidden_size * q + 2 * m.hidden_size * kv + 3 * m.hidden_size * m.intermediate_size)


def _forward_flops(m: Any, tokens: int, context: float, logit_tokens: int) -> float:
  """A forward over `tokens` tokens that attend over `context` keys each on average."""
  attention = 4 * m.num_layers * m.num_heads * m.head_dim * context
  return tokens * (2 * _dense_params(m) + attention) + logit_tokens * 2 * m.hidden_size * m.vocab_size


def program_work(config: Any, w: memory_lib.Workload, weights: dict[str, int], devices: int) -> dict[str, Work]:
  """name -> Work of each program of one RL step's calls, per device (global work / `devices`)."""
  m, s, p, t = w.model, w.seq_len, w.prompt_len, w.completion_len
  c = w.compute_bytes
  full_weights = weights["decode_copy"]  # every parameter without the batch axes' split, in the compute dtype
  micro_batches = config.train.num_minibatches * config.train.num_microbatches
  # Update: every row's S tokens forward and backward (causal: S / 2 keys on average), logits on the T completion
  # positions; each micro-batch reads every layer's gathered weights in the forward, the remat forward and the
  # backward; each optimizer step reads and writes the parameters and both moments and reads the gradients.
  forward = _forward_flops(m, w.rows * s, s / 2, w.rows * t)
  passes = 4 if m.remat else 3
  optimizer = config.train.num_minibatches * weights["params"] * 7  # parameters and moments r+w, gradients r
  update = Work(flops=passes * forward / devices, hbm_bytes=float(micro_batches * 3 * full_weights + optimizer),
                model_flops=3 * forward / devices, tokens=w.rows * s // devices)
  score = Work(flops=forward / devices, hbm_bytes=float(micro_batches * full_weights), tokens=w.rows * s // devices)
  # A sampler call of r rows a device: the prefill writes P prompt slots of the cache, the decode T tokens a row,
  # each step reading the weights once and the cache as far as it is filled (P + T / 2 slots on average).
  rows = w.rollout_rows * w.batch_shards
  cache_slot = m.num_layers * 2 * w.kv_heads * m.head_dim * c  # one row's k and v at one slot, one device
  prefill = Work(flops=_forward_flops(m, rows * p, p / 2, rows) / devices,
                 hbm_bytes=float(full_weights + w.rollout_rows * p * cache_slot), tokens=rows * p // devices)
  decode = Work(flops=t * _forward_flops(m, rows, p + t / 2, rows) / devices,
                hbm_bytes=float(t * (full_weights + w.rollout_rows * (p + t / 2) * cache_slot)),
                tokens=rows * t)
  return {"update": update, "score": score, "prefill": prefill, "decode": decode}
