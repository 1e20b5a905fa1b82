"""Memory planner: the per-device bytes of one RL step at a real model size, computed without allocating anything.

    python -m jaxrlvr.plan --config=configs/exgrpo.py:model=qwen2.5-math-7b --mesh=1,8,1 [--accelerator=h100]

Run from the repository root (config files import `configs.base`); `--config.x=y` overrides work as in `main.py`.
It prints parameters, optimizer state, gradients, activations of one micro-batch (with and without remat), the
sampler's KV cache, the transient peaks of the three device phases of a step, the host replay buffer, and whether the
peak fits an H100 (80 GB), H200 (141 GB), TPU v5p (95 GB) or v5e (16 GB) device. GB here is 1e9 bytes.

How the numbers are made
- Parameters: the model is built with `nnx.eval_shape` (shapes only), each parameter's PartitionSpec comes from
  `parallel.param_specs` on the requested mesh, and its per-device size is the shape divided, dimension by dimension,
  by the product of the mesh axes its spec names (`shard_shape`). When the local devices can form the mesh (e.g. 8
  fake CPU devices) the specs come from a real `parallel.make_mesh`, otherwise from a device-free
  `jax.sharding.AbstractMesh` of the same shape: `logical_to_spec` reads only axis sizes, so both give the same specs.
- Optimizer: AdamW keeps two moments in the parameter dtype (optax's default mu_dtype), sharded like the params.
- Gradients: one copy in the parameter dtype; two when `train.num_microbatches > 1` (the running sum and the
  current micro-batch's gradients, `step.py`'s scan).
- Resident copies: a frozen reference when `loss.kl_coef > 0`, and `replay.policy_delay` delayed policies (BAPO).
- Activations, per token of one layer, in compute-dtype bytes c (`_layer_token_bytes`):
      c * (4 D + 2 N H + 2 Kv H + 3 F)   +   N * kv_len * (8 + c)            [attention="xla"]
      norm in/out x2  q,k(roped),v,out  gate,up,silu*up   f32 scores and probs + the compute-dtype probs
  With attention="cudnn" (fused, flash-style) the score term is N * 4 (the log-sum-exp). N, Kv, F are divided by the
  tensor axis where their sharding rule splits them. Batch rows are split over data x fsdp; hidden states are not
  split over tensor (no sequence parallelism).
      no remat:  L layers of residuals + one layer of cotangents              = (L + 1) * b * S * per_token
      remat:     one [b, S, D] per layer (block inputs) + one layer recomputed in its backward, and its cotangents
                 = L * b * S * D * c + 2 * b * S * per_token
  plus the scorer's logits chunk (`scoring.py`: [b, chunk_size, vocab_chunk] f32, ~4 live copies in the backward),
  the attention mask [b, S, S] (bool) and the embedded/final hidden states. b = rows of one micro-batch on a device,
  S = bucketed prompt + max_new_tokens.
- Gathered weights: compute-dtype copies of two layers (current and prefetched) and of the unembedding; with
  fsdp > 1, also their full-size gradients before the reduce-scatter.
- Scoring pass (old log-probs, and reference log-probs with KL): `step.make_score_fn` scores the update batch one
  micro-batch of rows at a time, so one layer's forward intermediates for those rows of a device are live at once
  (`score_chunks` passes; the default, num_minibatches x num_microbatches, is what the code does).
- Sampler: every one of the B x K rollouts is sampled in one call (`rollout_chunks` models splitting it; 1 is the
  code). KV cache = L x 2 x rows x (bucketed prompt + max_new_tokens) x Kv x H x c. The prefill attends from the P
  prompt positions over all cache slots, so with attention="xla" its scores are [rows, N, P, P + T] f32.
- Host replay buffer (`replay/storage.py`): bytes per token and per row measured on a `RolloutStore`, x 8/7 for the
  dead tokens compaction allows, plus ~52 bytes a row for the order queue and the owner's index. Trajectories:
  ExGRPO stores `store_fraction` of all rollouts (0.2818 = the paper's 202,011 / (700 steps x 128 x 8)); the
  advantage-priority buffer holds min(capacity, tau_max x B x K); BAPO the last `window` steps' B x K. Tokens per
  trajectory default to min(1000, max_new_tokens): the released code's 1.77 GB / 202,011 = 8.8 KB a trajectory at
  ~8.8 bytes a token (text + float32 log-probs) is ~1,000 tokens.
- Fits: the largest phase peak <= `usable_fraction` (0.9) x capacity; XLA keeps some memory for itself and
  fragmentation costs more. On GPUs JAX preallocates 75% unless XLA_PYTHON_CLIENT_MEM_FRACTION is raised.
These are estimates of what XLA keeps alive, not measurements: the compiler may fuse away or add copies.
Calibration against XLA:CPU's buffer assignment (`compiled.memory_analysis()`, f32 compute, 2-6 layers, 512-1024
tokens): the no-remat training figure was 0.94-1.33x XLA's temp bytes, the forward-only scoring figure 1.2x.
XLA:CPU does not honour remat (a plain `jax.checkpoint` stack reports the same temp bytes), so the remat figure is
unchecked there, and no accelerator compile has checked any of them.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from jaxrlvr import models
from jaxrlvr import parallel
from jaxrlvr import scoring
from jaxrlvr.models.config import ModelConfig
from jaxrlvr.sampling import bucket_length

GB = 1e9
USABLE_FRACTION = 0.9
EXGRPO_STORE_FRACTION = 202_011 / (700 * 128 * 8)  # ExGRPO paper: trajectories stored / rollouts sampled
TOKENS_PER_TRAJECTORY = 1000  # see the module docstring
ROW_INDEX_BYTES = 52  # per stored row: order queue (2 x int64) + ~36 bytes in the owner's Python list of row ids
STORE_SLACK = 8 / 7  # replay/storage.py compacts a page once its dead tokens exceed 1/8


@dataclasses.dataclass(frozen=True)
class Accelerator:
  name: str
  memory: float  # bytes per device
  devices_per_host: int


ACCELERATORS = {
    "h100": Accelerator("NVIDIA H100 80GB", 80 * GB, 8),
    "h200": Accelerator("NVIDIA H200 141GB", 141 * GB, 8),
    "v5p": Accelerator("TPU v5p (95 GB a chip)", 95 * GB, 4),
    "v5e": Accelerator("TPU v5e (16 GB a chip)", 16 * GB, 4),
}


@dataclasses.dataclass(frozen=True)
class Workload:
  """The sizes the formulas use, derived from the config and the mesh (all per device unless named otherwise)."""
  model: ModelConfig
  mesh_shape: tuple[int, int, int]
  mesh_kind: str  # "devices" (specs from a real mesh) or "abstract" (jax.sharding.AbstractMesh)
  batch_shards: int  # data x fsdp
  rows: int  # rows of the global update batch (train.batch_rows)
  micro_rows: int  # one micro-batch, one device
  score_chunks: int  # scoring passes over the update batch
  score_rows: int  # one scoring pass, one device
  rollout_rows: int  # one sampler call, one device
  prompt_len: int  # bucketed, as the sampler and the batch pad it
  completion_len: int
  heads: int  # query heads on one device (split over tensor where the rule allows)
  kv_heads: int
  mlp: int
  vocab: int
  compute_bytes: int
  param_bytes: int

  @property
  def seq_len(self) -> int:
    return self.prompt_len + self.completion_len


def shard_shape(shape: Sequence[int], spec: PartitionSpec, axis_sizes: dict[str, int]) -> tuple[int, ...]:
  """Per-device shape of an array of `shape` laid out by `spec` on a mesh with `axis_sizes` (exact division)."""
  out = []
  entries = tuple(spec) + (None,) * (len(shape) - len(spec))
  for dim, entry in zip(shape, entries):
    axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    parts = math.prod(axis_sizes[a] for a in axes)
    if dim % parts:
      raise ValueError(f"plan.py: dimension {dim} of {tuple(shape)} is not divisible by {parts} ({spec})")
    out.append(dim // parts)
  return tuple(out)


def spec_mesh(mesh_shape: Sequence[int]) -> tuple[Any, str]:
  """A real mesh over the first local devices when there are enough, else an AbstractMesh of the same shape."""
  mesh_shape = tuple(int(s) for s in mesh_shape)
  n = math.prod(mesh_shape)
  if jax.device_count() >= n:
    return parallel.make_mesh(*mesh_shape, devices=jax.devices()[:n]), "devices"
  return AbstractMesh(mesh_shape, parallel.MESH_AXES), "abstract"


def model_config(config: Any) -> ModelConfig:
  """The architecture: from `config.model.path`'s config.json when set, else the preset; dtypes/remat from config."""
  m = config.model
  if m.path:
    from jaxrlvr.models import hf  # pylint: disable=g-import-not-at-top
    if not os.path.exists(os.path.join(m.path, "config.json")):
      raise FileNotFoundError(f"plan.py: config.model.path={m.path!r} has no config.json; clear it to plan the "
                              f"preset {m.preset!r}")
    return hf.config_from_hf(hf.read_config(m.path), param_dtype=m.param_dtype, compute_dtype=m.compute_dtype,
                             attention=m.attention, attention_block_size=m.attention_block_size, remat=m.remat)
  return models.from_config(config)


def param_table(cfg: ModelConfig, mesh: Any) -> list[tuple[str, tuple[int, ...], PartitionSpec, int]]:
  """(path, global shape, PartitionSpec, dtype bytes) of every parameter, from an abstract model (no memory)."""
  abstract = nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
  state = nnx.state(abstract, nnx.Param)
  specs = dict(nnx.to_flat_state(parallel.param_specs(state, mesh)))
  table = []
  for path, var in nnx.to_flat_state(state):
    spec = specs[path].get_value()
    table.append((".".join(str(p) for p in path), tuple(var.shape), spec, jnp.dtype(var.dtype).itemsize))
  return table


def _per_device(shape, spec, mesh, mesh_kind: str, drop_axes: Sequence[str] = ()) -> int:
  """Elements on one device; `drop_axes` are treated as unsharded (an all-gathered copy over them)."""
  if drop_axes:
    spec = PartitionSpec(*[_drop(e, drop_axes) for e in spec])
  if mesh_kind == "devices" and not drop_axes:
    return math.prod(NamedSharding(mesh, spec).shard_shape(shape))
  return math.prod(shard_shape(shape, spec, dict(mesh.shape)))


def _drop(entry, axes):
  if entry is None:
    return None
  kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a not in axes)
  return None if not kept else (kept[0] if len(kept) == 1 else kept)


def _split(name: str, size: int, mesh: Any) -> int:
  """`size` divided by the mesh axes the sharding rule of logical axis `name` gives it (1 when it does not divide)."""
  spec = parallel.logical_to_spec((name,), (size,), mesh)
  return shard_shape((size,), spec, dict(mesh.shape))[0]


def batch_rows(config: Any, batch_shards: int) -> int:
  """Rows of every update batch; mirrors `train.batch_rows` (a test checks they agree)."""
  rollouts = config.rollout.batch_size * config.rollout.group_size
  if config.replay.name == "advantage_priority" and config.replay.composition == "fresh_anchored":
    rollouts += int(round(config.replay.replay_fraction * rollouts))
  multiple = config.train.num_minibatches * config.train.num_microbatches * batch_shards
  return -(-rollouts // multiple) * multiple


def workload(config: Any, mesh_shape: Sequence[int], *, score_chunks: int | None = None, rollout_chunks: int = 1,
             mesh: Any = None, mesh_kind: str | None = None) -> Workload:
  """The sizes of one RL step on a (data, fsdp, tensor) mesh; see the module docstring."""
  if len(mesh_shape) != 3 or any(int(s) < 1 for s in mesh_shape):
    raise ValueError(f"plan.py: mesh {tuple(mesh_shape)} must be three positive sizes (data, fsdp, tensor)")
  if score_chunks is None:
    score_chunks = config.train.num_minibatches * config.train.num_microbatches  # the code: one micro-batch a pass
  if score_chunks < 1 or rollout_chunks < 1:
    raise ValueError(f"plan.py: score_chunks={score_chunks} and rollout_chunks={rollout_chunks} must be >= 1")
  if mesh is None:
    mesh, mesh_kind = spec_mesh(mesh_shape)
  cfg = model_config(config)
  data, fsdp, _ = (int(s) for s in mesh_shape)
  shards = data * fsdp
  rows = batch_rows(config, shards)
  t = config.train
  rollouts = config.rollout.batch_size * config.rollout.group_size
  return Workload(
      model=cfg, mesh_shape=tuple(int(s) for s in mesh_shape), mesh_kind=mesh_kind, batch_shards=shards, rows=rows,
      micro_rows=rows // (t.num_minibatches * t.num_microbatches * shards),
      score_chunks=score_chunks, score_rows=-(-rows // (shards * score_chunks)),
      rollout_rows=-(-rollouts // (shards * rollout_chunks)),
      prompt_len=bucket_length(config.data.max_prompt_len), completion_len=config.rollout.max_new_tokens,
      heads=_split("q_heads", cfg.num_heads, mesh), kv_heads=_split("kv_heads", cfg.num_kv_heads, mesh),
      mlp=_split("mlp", cfg.intermediate_size, mesh), vocab=_split("vocab", cfg.vocab_size, mesh),
      compute_bytes=jnp.dtype(cfg.compute_dtype).itemsize, param_bytes=jnp.dtype(cfg.param_dtype).itemsize)


def _layer_token_bytes(w: Workload, kv_len: int) -> int:
  """Bytes one layer keeps per token for its backward (= its forward live set): see the module docstring."""
  m, c = w.model, w.compute_bytes
  dense = c * (4 * m.hidden_size + 2 * w.heads * m.head_dim + 2 * w.kv_heads * m.head_dim + 3 * w.mlp)
  if m.attention == "xla":
    scores = w.heads * kv_len * (8 + c)
  else:
    scores = w.heads * 4
  return dense + scores


def _logits_chunk_bytes(w: Workload, rows: int, copies: int) -> int:
  """The scorer's [rows, chunk, vocab_chunk] f32 logits (`scoring.py`), `copies` of them live at once."""
  chunk = min(scoring.DEFAULT_CHUNK_SIZE, w.seq_len)
  return copies * rows * chunk * min(scoring.DEFAULT_VOCAB_CHUNK_SIZE, w.model.vocab_size) * 4


def activation_bytes(w: Workload, *, remat: bool) -> int:
  """Activations of one micro-batch's forward and backward on one device (module docstring formula)."""
  b, s, m, c = w.micro_rows, w.seq_len, w.model, w.compute_bytes
  layer = b * s * _layer_token_bytes(w, kv_len=s)
  if remat:
    kept = m.num_layers * b * s * m.hidden_size * c + 2 * layer
  else:
    kept = (m.num_layers + 1) * layer
  extra = b * s * s + 2 * b * s * m.hidden_size * c + _logits_chunk_bytes(w, b, copies=4)
  return kept + extra


def _replay(config: Any, *, trajectories: int | None, tokens_per_trajectory: int | None,
            store_fraction: float) -> tuple[int, int, int]:
  """(host bytes, trajectories, tokens per trajectory) of the replay buffer at its expected size."""
  from jaxrlvr.replay.storage import RolloutStore  # pylint: disable=g-import-not-at-top  (numpy only)
  r, name = config.replay, config.replay.name
  rollouts = config.rollout.batch_size * config.rollout.group_size
  if trajectories is None:
    if name == "exgrpo":
      trajectories = round(config.total_steps * rollouts * store_fraction)
    elif name == "advantage_priority":
      trajectories = min(r.capacity, r.tau_max * rollouts)
    elif name == "bapo":
      trajectories = r.window * rollouts
    else:
      trajectories = 0
  if tokens_per_trajectory is None:
    tokens_per_trajectory = min(TOKENS_PER_TRAJECTORY, config.rollout.max_new_tokens)
  max_tokens = r.get("max_tokens", 0)
  if max_tokens and trajectories * tokens_per_trajectory > max_tokens:
    trajectories = max_tokens // tokens_per_trajectory
  # Measure the store's own accounting: one row of 1 token, then one of 3: A = row + tok, B = 2 row + 4 tok.
  store = RolloutStore()
  store.add(np.zeros(1, np.int32), np.zeros(1, np.float32), qid=0, step=0)
  one = store.live_nbytes()
  store.add(np.zeros(3, np.int32), np.zeros(3, np.float32), qid=1, step=0)
  per_token = (store.live_nbytes() - 2 * one) // 2
  per_row = one - per_token
  live = trajectories * (tokens_per_trajectory * per_token + per_row)
  return int(live * STORE_SLACK + trajectories * ROW_INDEX_BYTES), int(trajectories), int(tokens_per_trajectory)


def plan_memory(config: Any, mesh_shape: Sequence[int], *, score_chunks: int | None = None, rollout_chunks: int = 1,
                replay_trajectories: int | None = None, tokens_per_trajectory: int | None = None,
                store_fraction: float = EXGRPO_STORE_FRACTION) -> dict[str, int]:
  """Bytes per device of each part of one RL step (and of the host replay buffer, over all hosts).

  Keys: params, optimizer, gradients, frozen_copies, resident, batch, gathered_weights, activations (the config's
  remat choice), activations_remat, activations_no_remat, train_peak, score, score_peak, kv_cache, prefill, decode,
  rollout_peak, peak, replay_host; and param_count, replay_trajectories, replay_tokens (counts, not bytes).
  """
  mesh, mesh_kind = spec_mesh(mesh_shape)
  w = workload(config, mesh_shape, score_chunks=score_chunks, rollout_chunks=rollout_chunks, mesh=mesh,
               mesh_kind=mesh_kind)
  m, c, p = w.model, w.compute_bytes, w.param_bytes
  table = param_table(m, mesh)
  params = sum(_per_device(shape, spec, mesh, mesh_kind) * nbytes for _, shape, spec, nbytes in table)

  # Compute-dtype copies of one layer and of the unembedding, all-gathered over the batch axes (tensor kept split).
  gathered = {path: _per_device(shape, spec, mesh, mesh_kind, drop_axes=parallel.BATCH_AXES)
              for path, shape, spec, _ in table}
  layer = sum(n for path, n in gathered.items() if path.startswith("layers.0."))
  unembed = gathered["embed" if m.tie_embeddings else "lm_head"]
  copies_needed = w.mesh_shape[1] > 1 or c != p
  forward_gathered = (2 * layer + unembed) * c if copies_needed else 0
  train_gathered = forward_gathered + ((layer + unembed) * p if w.mesh_shape[1] > 1 else 0)

  out: dict[str, int] = {}
  out["param_count"] = sum(math.prod(shape) for _, shape, _, _ in table)
  out["params"] = params
  out["optimizer"] = 2 * params
  out["gradients"] = params * (2 if config.train.num_microbatches > 1 else 1)
  frozen = int(config.loss.kl_coef > 0) + int(config.replay.get("policy_delay", 0))
  out["frozen_copies"] = frozen * params
  out["resident"] = out["params"] + out["optimizer"] + out["frozen_copies"]
  local_rows = w.rows // w.batch_shards
  ref = int(config.loss.kl_coef > 0)
  out["batch"] = local_rows * (2 * w.seq_len * 4 + (5 + ref) * w.completion_len * 4)
  out["gathered_weights"] = train_gathered
  out["activations_remat"] = activation_bytes(w, remat=True)
  out["activations_no_remat"] = activation_bytes(w, remat=False)
  out["activations"] = out["activations_remat"] if m.remat else out["activations_no_remat"]
  out["train_peak"] = out["resident"] + out["gradients"] + out["activations"] + train_gathered + out["batch"]

  b, s = w.score_rows, w.seq_len
  out["score"] = (b * s * _layer_token_bytes(w, kv_len=s) + b * s * s + 2 * b * s * m.hidden_size * c
                  + _logits_chunk_bytes(w, b, copies=3) + 2 * local_rows * w.completion_len * 4)
  out["score_peak"] = out["resident"] + out["batch"] + out["score"] + forward_gathered

  r, prompt, slots = w.rollout_rows, w.prompt_len, w.seq_len
  out["kv_cache"] = m.num_layers * 2 * r * slots * w.kv_heads * m.head_dim * c
  outputs = r * w.completion_len * 12 + r * slots * 4  # tokens, logprobs, entropies; the key mask
  out["prefill"] = (r * prompt * _layer_token_bytes(w, kv_len=slots) + r * prompt * slots
                    + 2 * r * prompt * m.hidden_size * c + r * m.vocab_size * 4 + outputs)
  out["decode"] = r * _layer_token_bytes(w, kv_len=slots) + 4 * r * m.vocab_size * 4 + outputs
  out["rollout_peak"] = out["resident"] + out["kv_cache"] + max(out["prefill"], out["decode"]) + forward_gathered
  out["peak"] = max(out["train_peak"], out["score_peak"], out["rollout_peak"])

  replay_bytes, trajectories, tokens = _replay(config, trajectories=replay_trajectories,
                                               tokens_per_trajectory=tokens_per_trajectory,
                                               store_fraction=store_fraction)
  out["replay_host"] = replay_bytes
  out["replay_trajectories"] = trajectories
  out["replay_tokens"] = tokens
  return out


def fits(memory: dict[str, int], accelerator: str, *, usable_fraction: float = USABLE_FRACTION) -> bool:
  """Whether the largest phase peak fits `usable_fraction` of one device of `accelerator` (a key of ACCELERATORS)."""
  if accelerator not in ACCELERATORS:
    raise KeyError(f"plan.py: unknown accelerator {accelerator!r}; known: {sorted(ACCELERATORS)}")
  if not 0 < usable_fraction <= 1:
    raise ValueError(f"plan.py: usable_fraction={usable_fraction} must be in (0, 1]")
  return memory["peak"] <= usable_fraction * ACCELERATORS[accelerator].memory


def _gb(x: float) -> str:
  return f"{x / GB:9.2f}"


def format_plan(config: Any, mesh_shape: Sequence[int], memory: dict[str, int], *, accelerators: Sequence[str],
                usable_fraction: float = USABLE_FRACTION, score_chunks: int | None = None,
                rollout_chunks: int = 1) -> str:
  """The printed report: the inputs, one line per memory term (GB per device), the host buffer, the fit table."""
  w = workload(config, mesh_shape, score_chunks=score_chunks, rollout_chunks=rollout_chunks)
  m, t, mem = w.model, config.train, memory
  n = math.prod(w.mesh_shape)
  k = config.rollout.group_size
  lines = [
      f"model {config.model.preset}{' (' + config.model.path + ')' if config.model.path else ''}: "
      f"{mem['param_count']:,} parameters, {m.param_dtype} params, {m.compute_dtype} compute, "
      f"remat {'on' if m.remat else 'off'}, attention {m.attention}",
      f"mesh data={w.mesh_shape[0]} x fsdp={w.mesh_shape[1]} x tensor={w.mesh_shape[2]} = {n} devices (specs from "
      + ("local devices)" if w.mesh_kind == "devices" else "an abstract mesh: fewer local devices)"),
      f"step: {config.rollout.batch_size} questions x {k} = {config.rollout.batch_size * k} rollouts; update batch "
      f"{w.rows} rows of {w.prompt_len} + {w.completion_len} = {w.seq_len} tokens",
      f"      {_n(t.num_minibatches, 'optimizer step')} x {_n(t.num_microbatches, 'micro-batch')}: "
      f"{_n(w.micro_rows, 'row')} a device per micro-batch; scoring: {_n(w.score_rows, 'row')} a device "
      f"per pass, {_n(w.score_chunks, 'pass')}; sampler: {_n(w.rollout_rows, 'row')} a device per call, "
      f"{_n(rollout_chunks, 'call')}",
      "",
      f"{'per device':<46}{'GB':>9}",
      _row("parameters", mem["params"]),
      _row("optimizer state (AdamW: 2 moments)", mem["optimizer"]),
      _row("frozen copies (KL reference, delayed)", mem["frozen_copies"]),
      _row("resident", mem["resident"]),
      "update (one micro-batch):",
      _row("gradients" + (" (sum + micro-batch)" if t.num_microbatches > 1 else ""), mem["gradients"]),
      _row("activations, remat" + (" (used)" if m.remat else ""), mem["activations_remat"]),
      _row("activations, no remat" + ("" if m.remat else " (used)"), mem["activations_no_remat"]),
      _row("gathered weights (fsdp / dtype copies)", mem["gathered_weights"]),
      _row("batch arrays", mem["batch"]),
      _row("peak", mem["train_peak"]),
      "scoring pass (old log-probs, forward only):",
      _row("one layer's forward, all rows of a pass", mem["score"]),
      _row("peak", mem["score_peak"]),
      "rollout (sampler):",
      _row(f"KV cache ({w.rollout_rows} rows x {w.seq_len} slots)", mem["kv_cache"]),
      _row("prefill transient", mem["prefill"]),
      _row("decode transient", mem["decode"]),
      _row("peak", mem["rollout_peak"]),
      _row(f"PEAK ({_peak_phase(mem)})", mem["peak"], indent=""),
      "",
      f"host replay buffer ({config.replay.name}): {mem['replay_trajectories']:,} trajectories x "
      f"{mem['replay_tokens']:,} tokens = {mem['replay_host'] / GB:.2f} GB over all hosts (each host keeps its own "
      "questions' share)",
  ]
  if w.seq_len > m.max_position_embeddings:
    lines.append(f"warning: {w.seq_len} tokens exceed the model's max_position_embeddings "
                 f"({m.max_position_embeddings}); the checkpoint's RoPE was not trained that far")
  lines += ["", f"fits: peak <= {usable_fraction:.0%} of one device's memory",
            "  accelerator                 memory   usable     peak  fits   replay/host"]
  for name in accelerators:
    acc = ACCELERATORS[name]
    hosts = max(1, n // acc.devices_per_host)
    ok = fits(mem, name, usable_fraction=usable_fraction)
    lines.append(f"  {acc.name:<24}{_gb(acc.memory)}{_gb(usable_fraction * acc.memory)}{_gb(mem['peak'])}  "
                 f"{'yes' if ok else 'NO ':<4}{_gb(mem['replay_host'] / hosts)} ({hosts} host{'s' * (hosts > 1)})")
  return "\n".join(lines)


def _n(count: int, noun: str) -> str:
  return f"{count} {noun}" + ("" if count == 1 else ("es" if noun.endswith(("s", "h")) else "s"))


def _row(label: str, value: float, indent: str = "  ") -> str:
  return f"{indent + label:<46}{_gb(value)}"


def _peak_phase(memory: dict[str, int]) -> str:
  phases = {"update": memory["train_peak"], "scoring pass": memory["score_peak"], "rollout": memory["rollout_peak"]}
  return max(phases, key=phases.get)


def parse_mesh(text: str) -> tuple[int, int, int]:
  """'1,8,1' -> (1, 8, 1); the error names the flag and the value."""
  try:
    sizes = tuple(int(s) for s in text.split(","))
  except ValueError as e:
    raise ValueError(f"plan.py: --mesh={text!r} must be three integers data,fsdp,tensor (e.g. 1,8,1)") from e
  if len(sizes) != 3 or min(sizes) < 1:
    raise ValueError(f"plan.py: --mesh={text!r} must be three positive integers data,fsdp,tensor (e.g. 1,8,1)")
  return sizes


def main(argv: Sequence[str]) -> None:
  from jaxrlvr import config_lib  # pylint: disable=g-import-not-at-top
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  if _MESH.value:
    mesh_shape = parse_mesh(_MESH.value)
  else:
    mesh_shape = config_lib.mesh_shape(config.mesh, _NUM_DEVICES.value)
  config_lib.validate(config, num_devices=math.prod(mesh_shape))
  accelerators = sorted(ACCELERATORS) if _ACCELERATOR.value == "all" else [_ACCELERATOR.value]
  kwargs = dict(score_chunks=_SCORE_CHUNKS.value or None, rollout_chunks=_ROLLOUT_CHUNKS.value)
  memory = plan_memory(
      config, mesh_shape, **kwargs,
      replay_trajectories=None if _REPLAY_TRAJECTORIES.value < 0 else _REPLAY_TRAJECTORIES.value,
      tokens_per_trajectory=None if _TOKENS_PER_TRAJECTORY.value < 0 else _TOKENS_PER_TRAJECTORY.value,
      store_fraction=_STORE_FRACTION.value)
  print(format_plan(config, mesh_shape, memory, accelerators=accelerators, usable_fraction=_USABLE.value, **kwargs))


if __name__ == "__main__":
  # Flags exist only when this runs as a program, so importing the planner next to `jaxrlvr.main` (tests, notebooks)
  # does not define --config twice.
  from absl import app
  from absl import flags
  from ml_collections import config_flags

  _CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/exgrpo.py:model=...",
                                            lock_config=True)
  _MESH = flags.DEFINE_string("mesh", "", "data,fsdp,tensor sizes, e.g. 1,8,1; empty: config.mesh on --num_devices")
  _NUM_DEVICES = flags.DEFINE_integer("num_devices", 8, "Devices to resolve a -1 in config.mesh when --mesh is empty.")
  _ACCELERATOR = flags.DEFINE_enum("accelerator", "all", ["all", *sorted(ACCELERATORS)], "Accelerator to check.")
  _USABLE = flags.DEFINE_float("usable_fraction", USABLE_FRACTION, "Share of device memory the plan may use.")
  _SCORE_CHUNKS = flags.DEFINE_integer("score_chunks", 0, "Passes the old-log-prob scoring is split into; 0: the "
                                       "code's, num_minibatches x num_microbatches.")
  _ROLLOUT_CHUNKS = flags.DEFINE_integer("rollout_chunks", 1, "Sampler calls a step's rollouts are split into "
                                         "(code: 1).")
  _REPLAY_TRAJECTORIES = flags.DEFINE_integer("replay_trajectories", -1, "Stored trajectories; -1: estimate.")
  _TOKENS_PER_TRAJECTORY = flags.DEFINE_integer("tokens_per_trajectory", -1, "Mean stored tokens; -1: "
                                                f"min({TOKENS_PER_TRAJECTORY}, max_new_tokens).")
  _STORE_FRACTION = flags.DEFINE_float("store_fraction", EXGRPO_STORE_FRACTION, "ExGRPO: stored / sampled rollouts.")
  flags.mark_flags_as_required(["config"])
  app.run(main)
