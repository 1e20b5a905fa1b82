"""The planner's arithmetic: per-device bytes of each device phase of an RL step, from shapes alone.

`plan/shapes.py` gives the sizes (the workload, each parameter's per-device shape); `plan/report.py` is the command
line and the report, and its docstring explains every term; `plan/xla.py` compiles the same phases for XLA's own
figures. Nothing here allocates.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from jaxrlvr import models
from jaxrlvr import parallel
from jaxrlvr import scoring
from jaxrlvr.plan.replay_host import EXGRPO_STORE_FRACTION, replay_estimate
# Accelerator, BACKENDS, GB and shard_shape are re-exported: the report and the tests read them from here.
from jaxrlvr.plan.shapes import (ACCELERATORS, BACKENDS, GB, Accelerator, Workload, param_table,
                                 per_device_count, shard_shape, spec_mesh, workload)

USABLE_FRACTION = 0.9
# XLA:CPU compiles the phases as an accelerator would only with these (plan/report.py's docstring): its memory-optimising
# scheduler, which honours remat, and no YNNPACK fusions (the list of fusion types replaced by one that matches
# nothing), which would compute a whole MLP in tiles. Read when JAX starts its CPU client: set in XLA_FLAGS first.
CPU_MEMORY_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false "
                    "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INVALID")
# The phases are compiled and never run, so LLVM's optimisation of the machine code is wasted work: buffer assignment
# (what the figures read) is done on the HLO before it. Level 0 gives the same figures byte for byte and compiles the
# 7B-wide phases of tests/test_plan_xla.py in 42 s instead of 70 (measured on 2 cores, jax 0.10.2). XLA:CPU's older
# LLVM emitters in place of its MLIR fusion emitters give the same figures again and halve the rest at level 0 (the
# 6 phases x 3 depths: 107 -> 57 CPU-s, 2026-12-05).
CPU_COMPILE_ONLY_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
# Arrays of one layer live at its peak, counted in XLA's buffer assignment of the 7B-wide phases (plan/report.py's
# docstring): [b, S, F] and [b, S, D] arrays in the compute dtype.
BACKWARD_MLP_ARRAYS, BACKWARD_HIDDEN_ARRAYS = 6, 12
FORWARD_MLP_ARRAYS, FORWARD_HIDDEN_ARRAYS = 3, 2
# XLA:TPU keeps one [b, S, F] array fewer in a forward (7B scoring pass, v5p:2x2x1: 17.45 GB compiled; 2 give 17.5).
TPU_FORWARD_MLP_ARRAYS = 2
# XLA:TPU's buffer assignments at each program's peak (docs/pods.md, "The planner against XLA:TPU"), in c: the
# update's backward keeps the L block inputs for remat and 2 more [b, S, D] arrays (the running layer's input and
# its cotangent), and up to 5 [b, S, F] (the 7B layer's; the 8B's writes its cotangents in place and holds 2); the
# scoring pass's forward one [b, S, F] array (silu(gate) * up written over gate) and 3 [b, S, D] (its f32 residual
# stream counts 2), and with one row a micro-batch, whose row axis it drops, gate and up both and 2 [b, S, D].
TPU_BACKWARD_HIDDEN_ARRAYS, TPU_BACKWARD_MLP_ARRAYS = 2, 5
TPU_SCORE_ARRAYS = {"rows": (1, 3), "one row": (2, 2)}  # ([b, S, F] arrays, [b, S, D] arrays)
# Over more fsdp shards than this XLA:TPU gathers a weight by writing its shard into a zeroed full-size buffer and
# all-reducing it, combining the small ones across layers (v5p:4x4x2 and 4x4x4; on v5p:2x2x1 real all-gathers).
TPU_ALL_GATHER_MAX_SHARDS = 8
LOGITS_CHUNK_COPIES = 4  # the scorer's [b, chunk, vocab chunk] f32 logits live at once in the backward (3 forward)
KEPT_LOGITS_COPIES = 3  # the update's kept [b, T, V] f32 logits and two of their size in its backward (train.keep_logits_mb)


def attention_bytes(w: Workload, rows: int, q_len: int, kv_len: int, *, backward: bool) -> int:
  """Transient bytes of one attention call of `rows` rows beyond q/k/v and its output (plan/report.py's docstring)."""
  impl = w.attention(q_len, kv_len)
  m, n, kv = w.model, w.heads, w.kv_heads
  if impl == "xla":  # f32 scores and probabilities, the compute-dtype probabilities, the [B, T, S] mask
    per = rows * n * q_len * kv_len * (8 + w.compute_bytes) + rows * q_len * kv_len
    return per * (2 if backward else 1)
  if impl == "cudnn":  # fused: the f32 log-sum-exp per query and head
    return rows * n * q_len * 4
  if impl == "splash":  # its tiles stay in the TPU core's memory; in HBM: q transposed to heads-first and its
    # output (backward: q and the kernel's residual, and k and v heads-first, as XLA:TPU's 7B and 8B updates
    # hold them), in c, and the f32 log-sum-exp
    q_bytes = rows * n * q_len * m.head_dim * w.compute_bytes
    kv_bytes = 2 * rows * kv * kv_len * m.head_dim * w.compute_bytes if backward else 0
    return 2 * q_bytes + kv_bytes + rows * n * q_len * 4
  bq, bk = min(m.attention_block_size, q_len), min(m.attention_block_size, kv_len)
  block = rows * n * bq * bk * 4  # one [B, K, G*bq, bk] f32 score block
  if backward:  # s, p, dp, ds of a block and the f32 dk, dv accumulators over all slots
    return 4 * block + 2 * rows * kv * kv_len * m.head_dim * 4
  return 2 * block + rows * n * bq * m.head_dim * 4  # s and p of a block, the f32 output accumulator


def _logits_chunk_bytes(w: Workload, rows: int, copies: int) -> int:
  """The scorer's [rows, chunk, vocab_chunk] f32 logits (`scoring.py`, over the completion positions), `copies` of
  them live at once."""
  chunk = min(scoring.DEFAULT_CHUNK_SIZE, w.completion_len)
  vocab_chunk = scoring._vocab_chunks(w.vocab, scoring.DEFAULT_VOCAB_CHUNK_SIZE)[1]  # pylint: disable=protected-access
  return copies * rows * chunk * vocab_chunk * 4


def _layer_forward_bytes(w: Workload, rows: int, q_len: int, kv_len: int) -> int:
  """One layer's forward live set at its peak (the MLP) for `rows` x `q_len` tokens, without remat's residuals."""
  m, c = w.model, w.compute_bytes
  mlp_arrays = TPU_FORWARD_MLP_ARRAYS if w.backend == "tpu" else FORWARD_MLP_ARRAYS
  dense = rows * q_len * (mlp_arrays * w.mlp + FORWARD_HIDDEN_ARRAYS * m.hidden_size) * c
  return dense + attention_bytes(w, rows, q_len, kv_len, backward=False)


def weights(w: Workload, mesh: Any, mesh_kind: str) -> dict[str, int]:
  """Per-device bytes of the parameters (`params`), of one layer's shard (`layer`) and of all-gathered copies of one
  layer and of the unembedding (`layer_full`, `unembed_full`: the batch axes dropped, in the parameter dtype);
  `param_count` counts elements."""
  m = w.model
  table = param_table(m, mesh)
  full = {path: per_device_count(shape, spec, mesh, mesh_kind, drop_axes=parallel.BATCH_AXES)
          for path, shape, spec, _ in table}
  local = {path: per_device_count(shape, spec, mesh, mesh_kind) for path, shape, spec, _ in table}
  p = w.param_bytes
  return {
      "param_count": sum(math.prod(shape) for _, shape, _, _ in table),
      "params": sum(local[path] * nbytes for path, _, _, nbytes in table),
      # engine.decode_layout: every parameter with the batch axes dropped, in the compute dtype
      "decode_copy": sum(full.values()) * w.compute_bytes,
      "embed_copy": full["embed"] * w.compute_bytes,  # its share of it: the embedding table
      "largest_copy": max(full.values()) * w.compute_bytes,  # and its largest weight
      # engine.heads_minor_o_proj: every layer's o_proj once more, as the decode reads it, in the compute dtype
      "o_proj_copy": m.num_layers * full["layers.0.attn.o_proj"] * w.compute_bytes,
      "layer": sum(n for path, n in local.items() if path.startswith("layers.0.")) * p,
      "layer_full": sum(n for path, n in full.items() if path.startswith("layers.0.")) * p,
      "unembed_full": full["embed" if m.tie_embeddings else "lm_head"] * p,
  }


def _gathered(w: Workload, wt: dict[str, int], *, layers: int, backward: bool) -> int:
  """All-gathered weight copies alive in a phase that runs `layers` layers (plan/report.py's docstring, "Gathered weights")."""
  if w.mesh_shape[1] == 1 and w.compute_bytes == w.param_bytes:
    return 0  # nothing to gather or cast: the layers read their parameters in place
  full, cast = wt["layer_full"], wt["layer_full"] * w.compute_bytes // w.param_bytes
  if w.backend == "tpu":
    # XLA:TPU's buffer assignments: the running layer's weights, gathered in c (it casts on the shard). Where it
    # gathers through all-reduces (more than TPU_ALL_GATHER_MAX_SHARDS shards) it combines the small weights of
    # several layers into one: a forward holds about half a layer more (the 8B and 7B scoring passes on v5p-64:
    # 0.60 and 0.40 GB gathered at their peaks), a backward one layer more and one layer's f32 gradient.
    if not _tpu_all_reduce_gathers(w):
      return cast
    return (2 * cast + full) if backward else (cast + cast // 2)
  if w.backend == "cpu":  # measured: every layer's gathered copy stays live (and in the backward its full gradient)
    return layers * full * (2 if backward else 1)
  # GPU: the layer running and the one prefetched, in the compute dtype, and one gather in flight in the parameter
  # dtype (the partitioner gathers, then casts); the backward adds one layer's full-size gradient before its
  # reduce-scatter.
  return 2 * cast + full + (full if backward else 0)


def _tpu_all_reduce_gathers(w: Workload) -> bool:
  """Whether XLA:TPU gathers the weights through all-reduces combined across layers (TPU_ALL_GATHER_MAX_SHARDS)."""
  return w.backend == "tpu" and w.mesh_shape[1] > TPU_ALL_GATHER_MAX_SHARDS


def _compute_copy(w: Workload, wt: dict[str, int], *, looped: bool) -> dict[str, int]:
  """{"compute_copy": bytes} where XLA:TPU hoists the cast of every local parameter shard to the compute dtype out
  of a program's micro-batch loop, so the copy lives through it (its 7B and 8B updates and scoring passes on v5p-8
  and v5p-64); else {}. With model.scan_layers the stacked layers are that copy."""
  if w.backend != "tpu" or not looped or w.compute_bytes == w.param_bytes or w.model.scan_layers:
    return {}
  return {"compute_copy": wt["params"] * w.compute_bytes // w.param_bytes}


def _stacked_layers(w: Workload, wt: dict[str, int]) -> int:
  """model.scan_layers: the layers' weights stacked in the compute dtype, split as the parameters are."""
  return w.model.num_layers * wt["layer"] * w.compute_bytes // w.param_bytes


def update_bytes(config: Any, w: Workload, wt: dict[str, int]) -> dict[str, int]:
  """The update step's footprint on one device, by term (its sum is the phase's `total`)."""
  m, c, b, s = w.model, w.compute_bytes, w.micro_rows, w.seq_len
  local_rows, t = w.rows // w.batch_shards, w.completion_len
  kl = int(config.loss.kl_coef > 0)
  out = {
      "state": 3 * wt["params"],  # parameters and AdamW's two moments (donated: counted once)
      "batch": local_rows * (2 * s * 4 + (4 + kl) * t * 4 + 2),
  }
  looped = config.train.num_microbatches > 1
  # The scan's running sum and one micro-batch's. XLA:TPU adds each layer's gradient into the sum as the backward
  # makes it (its 7B and 8B updates on v5p-8 hold one f32 copy), but where it gathers through all-reduces it defers
  # layers' reductions and holds their micro-batch gradients beside the sum (on v5p-64, 1.5 and 1.2 copies more).
  one_copy = w.backend == "tpu" and not _tpu_all_reduce_gathers(w)
  out["gradients"] = wt["params"] * (2 if looped and not one_copy else 1)
  out.update(_compute_copy(w, wt, looped=looped))
  mlp, hidden = b * s * w.mlp * c, b * s * m.hidden_size * c  # one [b, S, F] and one [b, S, D] array
  attention = attention_bytes(w, b, s, s, backward=True)
  if m.remat and w.backend == "tpu":  # every block's input, and one layer's backward as XLA:TPU holds it
    out["activations"] = ((m.num_layers + TPU_BACKWARD_HIDDEN_ARRAYS) * hidden + TPU_BACKWARD_MLP_ARRAYS * mlp
                          + attention)
  elif m.remat:  # every block's input, and one layer's backward
    out["activations"] = (m.num_layers * hidden + BACKWARD_MLP_ARRAYS * mlp + BACKWARD_HIDDEN_ARRAYS * hidden
                          + attention)
  else:
    # Every layer keeps its MLP's backward set from the forward (XLA merges the backward's recomputation of
    # silu(gate) * up with the forward's) and two [b, S, D] arrays; the running layer's backward adds the rest.
    out["activations"] = (m.num_layers * (BACKWARD_MLP_ARRAYS * mlp + FORWARD_HIDDEN_ARRAYS * hidden)
                          + (BACKWARD_HIDDEN_ARRAYS - FORWARD_HIDDEN_ARRAYS) * hidden + attention)
  out["gathered"] = _gathered(w, wt, layers=m.num_layers, backward=True)
  if m.scan_layers:  # the layers' weights stacked in the compute dtype for the scan, and their stacked gradient
    out["stacked"] = 2 * _stacked_layers(w, wt)
  if scoring.logits_kept(b, t, m.vocab_size, config.train.keep_logits_mb):  # decided on the whole vocabulary
    out["logits"] = KEPT_LOGITS_COPIES * b * t * w.vocab * 4  # the columns of one device
  else:
    out["logits"] = _logits_chunk_bytes(w, b, LOGITS_CHUNK_COPIES)
  return out


def score_bytes(config: Any, w: Workload, wt: dict[str, int]) -> dict[str, int]:
  """The scoring pass's footprint on one device (one micro-batch of rows at a time over the update batch)."""
  del config
  m, b, s, local_rows, t = w.model, w.micro_rows, w.seq_len, w.rows // w.batch_shards, w.completion_len
  if w.backend == "tpu":  # one layer's forward at its MLP, as XLA:TPU holds it, or its attention's if larger
    mlp_arrays, hidden_arrays = TPU_SCORE_ARRAYS["one row" if b == 1 else "rows"]
    hidden = b * s * hidden_arrays * m.hidden_size * w.compute_bytes
    dense = b * s * mlp_arrays * w.mlp * w.compute_bytes + hidden
    attention = hidden + attention_bytes(w, b, s, s, backward=False)
    activations = max(dense, attention)
  else:
    activations = _layer_forward_bytes(w, b, s, s)
  return {
      "params": wt["params"],
      **_compute_copy(w, wt, looped=local_rows > b),
      "batch": local_rows * (2 * s * 4 + 3 * t * 4 + 2) + 2 * local_rows * t * 4,  # inputs, then logp and entropy
      "activations": activations,
      "gathered": _gathered(w, wt, layers=w.model.num_layers, backward=False),
      **({"stacked": _stacked_layers(w, wt)} if w.model.scan_layers else {}),
      "logits": _logits_chunk_bytes(w, b, LOGITS_CHUNK_COPIES - 1),
  }


def kv_cache_bytes(w: Workload) -> int:
  """One sampler call's cache: layers x (k, v) x rows x slots x kv heads x head_dim, compute dtype."""
  m = w.model
  return m.num_layers * 2 * w.rollout_rows * w.seq_len * w.kv_heads * m.head_dim * w.compute_bytes


def _loop_state_bytes(w: Workload) -> int:
  """The decode carry besides the cache: the static sampler's uniforms, tokens, log-probs, entropies [r, T] and key
  mask [r, S]; the engine's slots hold only the uniforms [r, T] (its chunks hand their tokens to the host in
  [r, chunk] buffers, too small to count) and their lengths instead of a mask."""
  if w.engine:
    return w.rollout_rows * w.completion_len * 4
  return w.rollout_rows * (4 * w.completion_len * 4 + w.seq_len * 4)


def _sampler_weights(w: Workload, wt: dict[str, int], *, layers: int) -> dict[str, int]:
  """The weights a sampler phase holds: the parameters, and either the decode copy (decode_weights="replicated":
  the sampler reads only that, so nothing is gathered) or the gathered copies of `layers` layers and the
  unembedding (`gathered`)."""
  split = w.mesh_shape[1] > 1
  moved = split or w.compute_bytes != w.param_bytes  # else the weights are read where they are
  # The engine copies (and casts) whatever moves; the static sampler gathers only what fsdp splits, and casts
  # weights that nothing splits inside its layers, as below.
  if w.decode_copy and (split or w.engine):
    return {"params": wt["params"], "decode_copy": wt["decode_copy"] if moved else 0, "gathered": 0,
            "gather_buffer": _gather_buffer(w, wt)}
  # decode_weights="training": XLA:CPU hoists the loop-invariant all-gathers out of the loop, so every layer's
  # gathered copy and the unembedding's live through it; XLA:TPU gathers them inside the loop, every step (its
  # compile of the 7B decode on v5p-8), which costs bytes over the interconnect, not memory: counted the same.
  cast = w.compute_bytes if w.backend != "cpu" else w.param_bytes  # XLA:CPU's dots read the f32 gathers
  gathered = 0
  if moved:
    gathered = (layers * wt["layer_full"] + wt["unembed_full"]) * cast // w.param_bytes
  return {"params": wt["params"], "gathered": gathered}


def _gather_buffer(w: Workload, wt: dict[str, int]) -> int:
  """XLA:TPU gathers a weight over 64 chips by writing its shard into a zeroed full-size buffer and all-reducing it:
  the static sampler's gather of its decode copy (decode.in_decode_layout) holds the largest weight once more while
  it does (7B decode, v5p:4x4x4, one layer: 4.18 GB of temporaries, 1.09 GB over the copy; at 28 layers 27.01 GB
  against 25.34 planned). A prefill without a loop gathers layer by layer instead (7B, v5p:4x4x4: 12.26 GB compiled,
  13.34 planned without it). Counted wherever fsdp splits the weights on TPU, though on 4 chips XLA:TPU uses real
  all-gathers and needs no such buffer (7B decode, v5p-8: 40.63 GB compiled, 41.02 planned). The engine gathers in a
  program of its own."""
  return wt["largest_copy"] if w.backend == "tpu" and w.decode_copy and not w.engine and w.mesh_shape[1] > 1 else 0


def prefill_bytes(config: Any, w: Workload, wt: dict[str, int]) -> dict[str, int]:
  """One sampler call's prefill on one device: it writes the cache it returns."""
  del config
  m, r, c = w.model, w.rollout_rows, w.compute_bytes
  out = {"params": wt["params"], "kv_cache": kv_cache_bytes(w), "loop_state": _loop_state_bytes(w)}
  if w.engine:
    # engine._insert: the prompts' own cache [U, K, P, H] for every layer, their forward over it, their logits; then
    # copied into the slots' (donated) cache. U = prefill_rows distinct prompts a device.
    prompt_cache = m.num_layers * 2 * w.prefill_rows * w.prompt_len * w.kv_heads * m.head_dim * c
    out["activations"] = (prompt_cache + _layer_forward_bytes(w, w.prefill_rows, w.prefill_tokens, w.prompt_len)
                          + r * m.vocab_size * 4)
    return {**out, **_prefill_weights(w, wt)}
  activations = _layer_forward_bytes(w, w.prefill_rows, w.prefill_tokens, w.seq_len)
  if w.prefill_rows < r and w.backend != "tpu":
    # Row blocks on XLA:CPU and GPU: a block's cache fills layer by layer beside its forward, then is copied into
    # the call's whole (7B prefill, 8 x H100: 46.86 GB compiled, 38.1 without this term). XLA:TPU writes each
    # layer's block in place (v5p:2x2x1: 41.37 GB compiled; this term would add 8.2 GB).
    row = w.seq_len * w.kv_heads * m.head_dim * c  # one row's k (or v) of one layer
    block = 2 * w.prefill_rows * row
    activations = max(activations + (m.num_layers - 1) * block, r * row + m.num_layers * block)
  out["activations"] = activations + r * m.vocab_size * 4  # the last position's logits
  return {**out, **_prefill_weights(w, wt)}


def _prefill_weights(w: Workload, wt: dict[str, int]) -> dict[str, int]:
  """A prefill's weights: the decode copy where the sampler reads one through a loop (the engine's, made before
  the call; the static sampler's when its prefill loops over row blocks or prompt chunks), else a layer's gathered
  weights at a time. A static prefill without a loop runs each layer once, and the compiler gathers each layer's
  weights just before it (v5p:4x4x4, 16 rows a device in one block: the 7B prefill compiled to 12.26 GB a chip,
  less than the 15.23 GB copy and the 8.45 GB cache together)."""
  looped = w.prefill_rows < w.rollout_rows or w.prefill_tokens < w.prompt_len
  if w.decode_copy and (w.engine or looped):
    out = _sampler_weights(w, wt, layers=w.model.num_layers)
    if not w.engine and not w.model.tie_embeddings and out["decode_copy"]:
      # The static prefill reads an untied embedding table only through a row gather, which the partitioner runs
      # on its shards: XLA:CPU's 1-layer 7B-wide prefill held 9.55 GB, 2.9 GB under the whole copy's plan.
      out["decode_copy"] -= wt["embed_copy"]
    return out
  return {"gathered": _gathered(w, wt, layers=w.model.num_layers, backward=False)}


def decode_bytes(config: Any, w: Workload, wt: dict[str, int]) -> dict[str, int]:
  """The decode loop on one device: the cache and the carry are donated and updated in place."""
  del config
  m, r = w.model, w.rollout_rows
  out = {"kv_cache": kv_cache_bytes(w), "loop_state": _loop_state_bytes(w)}
  # One token a row: the attention over all slots (the engine's over the segments its rows reach, at most all) and
  # the sampler's [r, V] f32 softmax, cumsum and their kin.
  out["activations"] = attention_bytes(w, r, 1, w.seq_len, backward=False) + 4 * r * m.vocab_size * 4
  if w.engine:
    out["o_proj_copy"] = wt["o_proj_copy"]
  return {**out, **_sampler_weights(w, wt, layers=m.num_layers)}


PHASE_FUNCTIONS = {"update": update_bytes, "score": score_bytes, "prefill": prefill_bytes, "decode": decode_bytes}


def phase_terms(config: Any, mesh_shape: Sequence[int], *, backend: str = "gpu",
                model: models.ModelConfig | None = None) -> tuple[Workload, dict[str, int], dict[str, dict[str, int]]]:
  """(workload, weights, phase -> term -> bytes): every compiled phase's footprint on one device, by term."""
  mesh, mesh_kind = spec_mesh(mesh_shape)
  w = workload(config, mesh_shape, backend=backend, mesh=mesh, mesh_kind=mesh_kind, model=model)
  wt = weights(w, mesh, mesh_kind)
  return w, wt, {name: fn(config, w, wt) for name, fn in PHASE_FUNCTIONS.items()}


def plan_memory(config: Any, mesh_shape: Sequence[int], *, backend: str = "gpu", model: models.ModelConfig | None = None,
                replay_trajectories: int | None = None, tokens_per_trajectory: int | None = None,
                store_fraction: float = EXGRPO_STORE_FRACTION) -> dict[str, int]:
  """Bytes per device of one RL step on `backend` (and of the host replay buffer, over all hosts).

  Keys: params, optimizer, gradients, frozen_copies, resident; update, score, prefill, decode (each compiled phase's
  footprint, the figure plan/xla.py compares with XLA's) and their terms as "phase.term"; kv_cache, train_peak,
  score_peak, rollout_peak, peak, replay_host; and param_count, replay_trajectories, replay_tokens (counts).
  """
  w, wt, phases = phase_terms(config, mesh_shape, backend=backend, model=model)
  out: dict[str, int] = {"param_count": wt["param_count"], "params": wt["params"], "optimizer": 2 * wt["params"]}
  out["gradients"] = phases["update"]["gradients"]
  copies = int(config.loss.kl_coef > 0) + int(config.replay.get("policy_delay", 0))
  out["frozen_copies"] = copies * wt["params"]  # the KL reference and BAPO's delayed policies
  out["resident"] = out["params"] + out["optimizer"] + out["frozen_copies"]
  for name, terms in phases.items():
    out[name] = sum(terms.values())
    out.update({f"{name}.{term}": value for term, value in terms.items()})
  out["kv_cache"] = phases["prefill"]["kv_cache"]
  # A phase's footprint holds its own arguments; the rest of what stays resident is added: the update takes the state
  # (parameters and moments), the scorer and the sampler take one set of parameters.
  out["train_peak"] = out["update"] + out["frozen_copies"]
  out["score_peak"] = out["score"] + out["optimizer"] + out["frozen_copies"]
  out["rollout_peak"] = max(out["prefill"], out["decode"]) + out["optimizer"] + out["frozen_copies"]
  out["peak"] = max(out["train_peak"], out["score_peak"], out["rollout_peak"])
  replay_bytes, trajectories, tokens = replay_estimate(config, trajectories=replay_trajectories,
                                                       tokens_per_trajectory=tokens_per_trajectory,
                                                       store_fraction=store_fraction)
  out["replay_host"] = replay_bytes
  out["replay_trajectories"] = trajectories
  out["replay_tokens"] = tokens
  return out


def fits(memory: dict[str, int], accelerator: str, *, usable_fraction: float = USABLE_FRACTION) -> bool:
  """Whether the largest phase peak fits `usable_fraction` of one device of `accelerator` (a key of ACCELERATORS).

  `memory` is `plan_memory` for that accelerator's backend.
  """
  if accelerator not in ACCELERATORS:
    raise KeyError(f"plan/report.py: unknown accelerator {accelerator!r}; known: {sorted(ACCELERATORS)}")
  if not 0 < usable_fraction <= 1:
    raise ValueError(f"plan/report.py: usable_fraction={usable_fraction} must be in (0, 1]")
  return memory["peak"] <= usable_fraction * ACCELERATORS[accelerator].memory
