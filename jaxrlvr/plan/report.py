"""Memory planner: the per-device bytes of one RL step at a real model size, computed without allocating anything.

    python -m jaxrlvr.plan --config=configs/exgrpo.py:model=qwen2.5-math-7b --mesh=1,8,1 [--accelerator=h100]
    python -m jaxrlvr.plan --config=... --mesh=1,8,1 --xla [--layers=2]     # XLA's own figures on local devices

Run from the repository root (config files import `configs.base`); `--config.x=y` overrides work as in `main.py`.
It prints the resident state, the footprint of each of the step's four compiled device phases (update, scoring
pass, a sampler call's prefill and decode), the host replay buffer, and whether the largest phase fits an H100
(80 GB), H200 (141 GB), TPU v5p (95 GB) or v5e (16 GB) device. GB here is 1e9 bytes. The arithmetic lives in
`plan/memory.py`; `plan/xla.py` compiles the same phases with abstract inputs, and `--xla` prints XLA's figure of
each next to the plan's (on CPU use JAX_NUM_CPU_DEVICES=8 and a few `--layers`: a 28-layer update takes minutes).

What a phase's footprint is: the bytes its executable holds on one device while it runs, i.e. XLA's
argument + output + temp - alias (donated state counted once). A phase's peak adds what stays resident outside it.
Sizes: b rows of a device, S = P + T tokens (bucketed prompt + max_new_tokens), D hidden, F = MLP width, N query
heads, K kv heads, H head_dim (N, K, F and the vocabulary V divided by the tensor axis where their rule splits
them; rows over data x fsdp), L layers, c and p the compute and parameter dtype bytes.
- Parameters: the model is built with `nnx.eval_shape`; each parameter's per-device size is its shape divided by
  the mesh axes its `parallel.param_specs` spec names (a real mesh over local devices when there are enough, else a
  device-free `AbstractMesh` of the same shape: the rules read only axis sizes). Optimizer: AdamW's two moments,
  sharded like the parameters (`step.optimizer_state_sharding`). Frozen copies: the KL reference when
  `loss.kl_coef > 0` and `replay.policy_delay` delayed policies (BAPO). Resident = parameters + moments + copies.
- Update (`step.make_update_fn`, one micro-batch of b = rows / (minibatches x micro-batches x shards) rows):
    state       parameters and moments (arguments, donated)      batch   the update batch's arrays
    gradients   the scan's running sum and one micro-batch's (one copy with a single micro-batch, and on TPU
                up to 8 fsdp shards)
    activations remat: L x b S D c block inputs + one layer's backward, 6 [b, S, F] + 12 [b, S, D] arrays in c
                (gate, up, their gradients, the product and its gradient; the residual stream, its cotangent,
                the norms, q and the attention output in blocks and their cotangents, the MLP's input gradients:
                counted in XLA's buffer assignment of a 7B-wide layer) + the attention's backward transient;
                no remat: L x (6 [b, S, F] + 2 [b, S, D]) (XLA keeps each layer's MLP set from the forward:
                it merges the backward's recomputation of silu(gate) * up with the forward's) + 10 [b, S, D].
    gathered    see "Gathered weights"                          logits  the scorer's [b, 128, vocab chunk] f32
                                                                        logits, 4 live in the backward
- Scoring pass (`step.make_score_fn`: old log-probs over the update batch, one micro-batch of rows at a time):
  parameters, the batch and its two [rows, T] f32 outputs, one layer's forward at its MLP (3 [b, S, F] + 2
  [b, S, D] arrays in c) + the attention's forward transient, the gathered weights, 3 logits chunks.
- With `rollout.engine="continuous"` (`rollout/engine.py`): one state of r = `decode_slots` (else `max_rows_per_device`,
  else all rows) slots a device for the whole step, the same cache, and of the carry only the uniforms [r, T] (the
  chunks hand their tokens to the host); its prefill holds the prompts' own cache (L x 2 x U x P x K x H x c,
  U = `prefill_rows_per_device` or r distinct prompts) beside one layer's forward over P; with
  `decode_weights="replicated"` both phases read a copy of every parameter with the batch axes dropped, in c
  (`decode copy`), and gather nothing; the fsdp-sharded parameters stay resident. Its decode also holds every
  layer's o_proj once more, transposed to the order its dot sums in (L x N x H x D x c over 'tensor'). Both are
  checked against XLA (the static sampler gathers the copy inside its programs; on TPU the largest weight is held
  once more while XLA:TPU gathers it through a zeroed full-size buffer, `gather buffer`; the
  insert's prompt forward is planned as the static prefill's, which XLA:CPU compiles into ~1.3 GB less at 7B
  width: the plan is 11-19% high there).
- Sampler call (`rollout.generate`; a step's B x K rollouts in calls of r = min(rows a device,
  `run_setup.rows_per_sampler_call`: `rollout.max_rows_per_device`, else what `rollout.kv_cache_gb` holds) rows): KV cache =
  L x 2 x r x S x K x H x c, the decode carry (uniforms, tokens, log-probs, entropies [r, T], key mask [r, S]).
  Prefill: one layer's forward for a block of `rollout.prefill_rows_per_device` rows x
  `rollout.prefill_chunk_tokens` slots attending over S; when rows are blocked, the block's own cache (L x 2 x block
  rows x S x K x H x c) fills beside it and is then written into the call's, copying one k or v of it; + the [r, V]
  f32 logits of the last position. Decode: one token a row: attention over S slots and the sampler's 4 [r, V] f32.
- Attention transient (`models/attention.py`, "auto" resolved as `attention.resolve` does for the backend):
  xla: f32 scores and probabilities + compute-dtype probabilities [b, N, T, S] and the [b, T, S] mask (twice in
  the backward); blockwise: s and p of one [b, N, bq, bk] f32 block and the f32 output accumulator forward; s, p,
  dp, ds of a block and the f32 dk, dv accumulators [b, K, S, H] backward (bq = bk = attention_block_size);
  cudnn: the f32 log-sum-exp [b, N, T]; splash (TPU): q and the output heads-first in c (in the backward q, the
  kernel's residual, k and v heads-first) and the f32 log-sum-exp [b, N, T], its tiles in the core's memory.
- TPU (fitted to XLA:TPU's buffer assignments of the 7B and 8B programs on v5p-8 and v5p-64, docs/pods.md): the
  update's gradients are one f32 copy up to 8 fsdp shards (XLA adds each layer's into the running sum as the
  backward makes it; beyond, it defers layers' reductions and holds their micro-batch gradients too); a
  program that loops over micro-batches holds a copy of every local parameter shard in c (`compute copy`: XLA
  hoists the casts out of the loop); the update's remat backward keeps L + 2 [b, S, D] arrays, up to 5 [b, S, F]
  and splash's backward set; the scoring pass's forward 1 [b, S, F] and 3 [b, S, D] arrays (2 and 2 with one row a
  micro-batch); no logits chunk is at either peak, but it is counted.
- model.scan_layers: the update holds every layer's weights stacked in c for its scan, and their stacked gradient
  (2 x L x one layer's shard in c); the scoring pass the stacked weights.
- Gathered weights (fsdp > 1, or a compute dtype other than the parameters'): one layer's parameters with the
  batch axes dropped. GPU (held to XLA:GPU's compiles, docs/pods.md): the running and the prefetched layer in c,
  one gather in flight in p (its partitioner gathers and then casts), and in the backward one layer's full-size
  gradients before their reduce-scatter. TPU (XLA:TPU casts on the shard): the running layer in c; over more than
  8 fsdp shards, where it gathers through all-reduces combined across layers, half a layer more in a forward, and
  in a backward one more layer in c and one layer's full-size f32 gradient. CPU
  (measured): XLA:CPU keeps every layer's gathered copy, and in the backward every full-size gradient, so
  L x (1 or 2) copies in p. Decode with `rollout.decode_weights="training"`: XLA:CPU hoists the loop-invariant
  all-gathers out of the loop, so all L layers and the unembedding live through it (in p: its dots read the f32
  gathers); XLA:TPU gathers them inside the loop, every step (bytes over the interconnect), counted the same.
- Peaks: update + frozen copies; scoring pass + moments + frozen copies; max(prefill, decode) + moments + frozen
  copies (the sampled parameters, current or delayed, are the call's argument).
- Host replay buffer (`replay/storage.py`): bytes per token and per row measured on a `RolloutStore`, x 8/7 for the
  dead tokens compaction allows, plus ~52 bytes a row for the order queue and the owner's index. Trajectories:
  ExGRPO stores `store_fraction` of all rollouts (0.2818 = the paper's 202,011 / (700 steps x 128 x 8)); the
  advantage-priority buffer holds min(capacity, tau_max x B x K); BAPO the last `window` steps' B x K. Tokens per
  trajectory default to min(1000, max_new_tokens): the released code's 1.77 GB / 202,011 = 8.8 KB a trajectory at
  ~8.8 bytes a token (text + float32 log-probs) is ~1,000 tokens.
- Fits: the largest phase peak <= `usable_fraction` (0.9) x capacity, each accelerator planned for its own backend;
  XLA keeps some memory for itself and fragmentation costs more. On GPUs JAX preallocates 75% unless
  XLA_PYTHON_CLIENT_MEM_FRACTION is raised.
Checked against XLA (tests/test_plan_xla.py): the four phases compiled with abstract 7B-wide inputs (qwen2.5-math-7b
with 1, 2 and 3 layers, the paper's lengths, fsdp=8 over 8 CPU devices, float32 compute) agree with these formulas
for the CPU backend to within 10%. XLA:CPU needs two flags for that (`memory_lib.CPU_MEMORY_FLAGS`): its default
scheduler runs every layer's rematerialised forward before the backward, so remat saved nothing (18.8 GB of
temporaries a layer with remat, 21.6 GB without), and its YNNPACK fusion computes a one-layer model's whole MLP in
tiles, so its [b, S, F] arrays never exist (a 9.9 GB scoring pass measured 3.4 GB). In bfloat16 XLA:CPU computes
dots in float32, which an accelerator does not; the bf16 figures and every GPU/TPU-only term are unchecked.
"""
from __future__ import annotations

import math
import os
import sys
from typing import Any, Sequence

import jax

from jaxrlvr import config_lib
from jaxrlvr import run_setup
from jaxrlvr.plan import memory as memory_lib
from jaxrlvr.plan import replay_host
from jaxrlvr.plan import topology
from jaxrlvr.plan.memory import (ACCELERATORS, BACKENDS, CPU_COMPILE_ONLY_FLAGS, CPU_MEMORY_FLAGS, GB,
                                 USABLE_FRACTION, fits, plan_memory, workload)


def plans_by_backend(config: Any, mesh_shape: Sequence[int], accelerators: Sequence[str],
                     **kwargs: Any) -> dict[str, dict[str, int]]:
  """backend -> plan_memory, for the backends of `accelerators`."""
  backends = sorted({ACCELERATORS[name].backend for name in accelerators})
  return {b: plan_memory(config, mesh_shape, backend=b, **kwargs) for b in backends}


def _gb(x: float) -> str:
  return f"{x / GB:9.2f}"


def _n(count: int, noun: str) -> str:
  return f"{count} {noun}" + ("" if count == 1 else ("es" if noun.endswith(("s", "h")) else "s"))


def _row(label: str, value: float, indent: str = "  ") -> str:
  return f"{indent + label:<50}{_gb(value)}"


def _peak_phase(memory: dict[str, int]) -> str:
  phases = {"update": memory["train_peak"], "scoring pass": memory["score_peak"], "rollout": memory["rollout_peak"]}
  return max(phases, key=phases.get)


def format_plan(config: Any, mesh_shape: Sequence[int], plans: dict[str, dict[str, int]], *, backend: str,
                accelerators: Sequence[str], usable_fraction: float = USABLE_FRACTION) -> str:
  """The printed report: the inputs, one line per term (GB per device, for `backend`), the host buffer, the fits
  (each accelerator with the plan of its own backend)."""
  w = workload(config, mesh_shape, backend=backend)
  m, t, mem = w.model, config.train, plans[backend]
  n = math.prod(w.mesh_shape)
  k = config.rollout.group_size
  s, p = w.seq_len, w.prompt_len
  used = {"update": w.attention(s, s), "prefill": w.attention(w.prefill_tokens, s), "decode": w.attention(1, s)}
  lines = [
      f"model {config.model.preset}{' (' + config.model.path + ')' if config.model.path else ''}: "
      f"{mem['param_count']:,} parameters, {m.param_dtype} params, {m.compute_dtype} compute, "
      f"remat {'on' if m.remat else 'off'}, attention {m.attention} "
      f"({', '.join(f'{phase} {impl}' for phase, impl in used.items())} on {backend})",
      f"mesh data={w.mesh_shape[0]} x fsdp={w.mesh_shape[1]} x tensor={w.mesh_shape[2]} = {n} devices (specs from "
      + ("local devices)" if w.mesh_kind == "devices" else "an abstract mesh: fewer local devices)"),
      f"step: {config.rollout.batch_size} questions x {k} = {config.rollout.batch_size * k} rollouts; update batch "
      f"{w.rows} rows of {p} + {w.completion_len} = {s} tokens",
      f"      {_n(t.num_minibatches, 'optimizer step')} x {_n(t.num_microbatches, 'micro-batch')}: "
      f"{_n(w.micro_rows, 'row')} a device per micro-batch and per scoring pass; sampler: "
      + (f"the engine, {_n(w.rollout_rows, 'decode slot')} a device, prefill up to {w.prefill_rows} prompts x "
         f"{w.prefill_tokens} slots at a time" if w.engine else
         f"{_n(w.rollout_rows, 'row')} a device per call, {_n(w.sampler_calls, 'call')}, prefill "
         f"{w.prefill_rows} rows x {w.prefill_tokens} slots at a time"),
      "",
      f"{'per device (' + backend + ')':<50}{'GB':>9}",
      _row("parameters", mem["params"]),
      _row("optimizer state (AdamW: 2 moments)", mem["optimizer"]),
      _row("frozen copies (KL reference, delayed)", mem["frozen_copies"]),
      _row("resident", mem["resident"]),
      "update (one micro-batch):",
      _row("gradients" + (" (sum + micro-batch)" if mem["gradients"] > mem["params"] else ""), mem["gradients"]),
      *([_row("compute-dtype copy of the shards (XLA:TPU)", mem["update.compute_copy"])]
        if "update.compute_copy" in mem else []),
      _row("activations" + (f" (remat: {m.num_layers} block inputs + 1 layer)" if m.remat else " (no remat)"),
           mem["update.activations"] + mem["update.logits"]),
      _row("gathered weights (fsdp / dtype copies)", mem["update.gathered"]),
      _row("batch arrays", mem["update.batch"]),
      _row("peak", mem["train_peak"]),
      "scoring pass (old log-probs, forward only):",
      _row("one layer's forward, one pass's rows", mem["score.activations"] + mem["score.logits"]),
      _row("gathered weights", mem["score.gathered"]),
      *([_row("compute-dtype copy of the shards (XLA:TPU)", mem["score.compute_copy"])]
        if "score.compute_copy" in mem else []),
      _row("peak", mem["score_peak"]),
      "rollout (one sampler call):",
      _row(f"KV cache ({w.rollout_rows} rows x {s} slots)", mem["kv_cache"]),
      _row(f"prefill transient ({w.prefill_rows} rows x {w.prefill_tokens} slots)", mem["prefill.activations"]),
      _row("decode transient", mem["decode.activations"]),
      _row("gathered weights (decode: every layer)", mem["decode.gathered"]),
      *([_row("decode copy of the weights (engine.decode_layout)", mem["decode.decode_copy"])]
        if "decode.decode_copy" in mem else []),
      *([_row("o_proj as the decode reads it (engine.heads_minor_o_proj)", mem["decode.o_proj_copy"])]
        if "decode.o_proj_copy" in mem else []),
      *([_row("gather buffer (XLA:TPU: the largest weight)", mem["decode.gather_buffer"])]
        if mem.get("decode.gather_buffer") else []),
      _row("peak", mem["rollout_peak"]),
      _row(f"PEAK ({_peak_phase(mem)})", mem["peak"], indent=""),
      "",
      f"host replay buffer ({config.replay.name}): {mem['replay_trajectories']:,} trajectories x "
      f"{mem['replay_tokens']:,} tokens = {mem['replay_host'] / GB:.2f} GB over all hosts (each host keeps its own "
      "questions' share)",
  ]
  if s > m.max_position_embeddings:
    lines.append(f"warning: {s} tokens exceed the model's max_position_embeddings "
                 f"({m.max_position_embeddings}); the checkpoint's RoPE was not trained that far")
  lines += ["", f"fits: peak <= {usable_fraction:.0%} of one device's memory (each planned for its own backend)",
            "  accelerator                 memory   usable     peak  fits   replay/host"]
  for name in accelerators:
    acc = ACCELERATORS[name]
    hosts = max(1, n // acc.devices_per_host)
    mine = plans[acc.backend]
    ok = fits(mine, name, usable_fraction=usable_fraction)
    lines.append(f"  {acc.name:<24}{_gb(acc.memory)}{_gb(usable_fraction * acc.memory)}{_gb(mine['peak'])}  "
                 f"{'yes' if ok else 'NO ':<4}{_gb(mine['replay_host'] / hosts)} ({hosts} host{'s' * (hosts > 1)})")
  return "\n".join(lines)


def format_xla(config: Any, mesh_shape: Sequence[int], layers: int) -> str:
  """XLA's figure of each phase compiled on the local devices, next to the plan for the local backend."""
  from jaxrlvr import parallel  # pylint: disable=g-import-not-at-top
  from jaxrlvr.plan import xla as xla_lib  # pylint: disable=g-import-not-at-top  (imports the trainer's step functions)
  n = math.prod(mesh_shape)
  if jax.device_count() < n:
    raise ValueError(f"plan/report.py: --xla compiles on local devices; the mesh {tuple(mesh_shape)} needs {n}, there are "
                     f"{jax.device_count()} (on CPU: JAX_NUM_CPU_DEVICES={n})")
  backend = jax.default_backend() if jax.default_backend() in BACKENDS else "gpu"
  model = run_setup.model_config(config)
  if layers:
    model = model.replace(num_layers=layers)
  mesh = parallel.make_mesh(*mesh_shape, devices=jax.devices()[:n])
  xla = xla_lib.compile_phases(config, mesh, model)
  planned = plan_memory(config, mesh_shape, backend=backend, model=model)
  lines = [f"XLA's footprints ({backend}, {model.num_layers} layers): argument + output + temp - alias per device",
           f"  {'phase':<10}{'plan GB':>10}{'XLA GB':>10}{'ratio':>8}"]
  for phase, stats in xla.items():
    lines.append(f"  {phase:<10}{planned[phase] / GB:10.2f}{stats.total / GB:10.2f}{planned[phase] / stats.total:8.2f}")
  if backend == "cpu" and model.compute_dtype != "float32":
    lines.append(f"  (XLA:CPU computes {model.compute_dtype} dots in float32 and keeps float32 copies an accelerator "
                 "would not: compare with --config.model.compute_dtype=float32)")
  return "\n".join(lines)


def parse_mesh(text: str) -> tuple[int, int, int]:
  """'1,8,1' -> (1, 8, 1); the error names the flag and the value."""
  try:
    sizes = tuple(int(s) for s in text.split(","))
  except ValueError as e:
    raise ValueError(f"plan/report.py: --mesh={text!r} must be three integers data,fsdp,tensor (e.g. 1,8,1)") from e
  if len(sizes) != 3 or min(sizes) < 1:
    raise ValueError(f"plan/report.py: --mesh={text!r} must be three positive integers data,fsdp,tensor (e.g. 1,8,1)")
  return sizes


def main(argv: Sequence[str]) -> None:
  from absl import app  # pylint: disable=g-import-not-at-top
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    _plan()
  except (config_lib.ConfigError, FileNotFoundError) as e:  # a user's setting: one line, as jaxrlvr.main says it
    sys.stderr.write(f"jaxrlvr.plan: error: {' '.join(str(e).splitlines())}\n")
    sys.exit(2)


def _plan() -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  if f.xla:  # before JAX starts its CPU client (harmless elsewhere: the flags are XLA:CPU's)
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} {CPU_MEMORY_FLAGS} {CPU_COMPILE_ONLY_FLAGS}".strip())
  config = f.config
  if f.topology:  # the run's programs through the TPU compiler, for compile-only devices (plan/topology.py)
    target = topology.parse_topology(f.topology)
    echo = lambda line: print(line, file=sys.stderr, flush=True)
    phases = tuple(p for p in f.phases.split(",") if p)
    results = topology.compile_on_topology(config, target, parse_mesh(f.mesh) if f.mesh else None, phases, echo,
                                           min_hbm=f.min_hbm)
    print(topology.format_report(config, target, *results))
    return
  if f.mesh:
    mesh_shape = parse_mesh(f.mesh)
  else:
    mesh_shape = config_lib.mesh_shape(config.mesh, f.num_devices)
  config_lib.validate(config, num_devices=math.prod(mesh_shape))
  accelerators = sorted(ACCELERATORS) if f.accelerator == "all" else [f.accelerator]
  backend = f.backend or ACCELERATORS[accelerators[0]].backend
  kwargs = dict(replay_trajectories=None if f.replay_trajectories < 0 else f.replay_trajectories,
                tokens_per_trajectory=None if f.tokens_per_trajectory < 0 else f.tokens_per_trajectory,
                store_fraction=f.store_fraction)
  plans = plans_by_backend(config, mesh_shape, accelerators, **kwargs)
  if backend not in plans:
    plans[backend] = plan_memory(config, mesh_shape, backend=backend, **kwargs)
  print(format_plan(config, mesh_shape, plans, backend=backend, accelerators=accelerators,
                    usable_fraction=f.usable_fraction))
  if f.xla:
    print()
    print(format_xla(config, mesh_shape, f.layers))


def cli() -> None:
  """`python -m jaxrlvr.plan` (plan/__main__.py). The flags exist only when the planner runs as a program, so
  importing it next to `jaxrlvr.main` (tests, notebooks) does not define --config twice."""
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

  config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/exgrpo.py:model=...",
                                            lock_config=True)
  flags.DEFINE_string("mesh", "", "data,fsdp,tensor sizes, e.g. 1,8,1; empty: config.mesh on --num_devices")
  flags.DEFINE_integer("num_devices", 8, "Devices to resolve a -1 in config.mesh when --mesh is empty.")
  flags.DEFINE_enum("accelerator", "all", ["all", *sorted(ACCELERATORS)], "Accelerator to check.")
  flags.DEFINE_enum("backend", "", ["", *BACKENDS], "Backend of the printed terms; empty: that of the "
                               "first accelerator checked.")
  flags.DEFINE_float("usable_fraction", USABLE_FRACTION, "Share of device memory the plan may use.")
  flags.DEFINE_bool("xla", False, "Also compile the four phases on the local devices (abstract inputs) and "
                           "print XLA's figures next to the plan's.")
  flags.DEFINE_integer("layers", 0, "With --xla: compile this many layers (0: the model's).")
  flags.DEFINE_string("topology", "", "Compile the run's programs for a TPU topology's compile-only devices, e.g. "
                      "v5p:2x2x1, v5p:4x4x4, v5e:2x2 (needs pip install -e '.[tpu]'); --mesh or config.mesh over it.")
  flags.DEFINE_string("phases", "update,score,prefill,decode", "With --topology: the programs to compile.")
  flags.DEFINE_bool("min_hbm", False, "With --topology: also bracket the least HBM each program compiles in "
                    "(XLA:TPU's xla_tpu_max_hbm_size_mib): 2 more compiles a program where the planner is within "
                    "10% of it, ~5 where not.")
  flags.DEFINE_integer("replay_trajectories", -1, "Stored trajectories; -1: estimate.")
  flags.DEFINE_integer("tokens_per_trajectory", -1, "Mean stored tokens; -1: "
                                                f"min({replay_host.TOKENS_PER_TRAJECTORY}, max_new_tokens).")
  flags.DEFINE_float("store_fraction", replay_host.EXGRPO_STORE_FRACTION,
                                       "ExGRPO: stored / sampled rollouts.")
  flags.mark_flags_as_required(["config"])
  app.run(main)
