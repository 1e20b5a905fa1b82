"""A run's programs compiled for an accelerator it does not have: compile-only devices of a TPU slice or GPUs.

    python -m jaxrlvr.plan --config=configs/exgrpo.py:model=qwen2.5-math-7b --topology=v5p:2x2x1
    python -m jaxrlvr.plan --config=configs/exgrpo.py:model=qwen2.5-math-7b --topology=h100:8

JAX compiles for a TPU slice on any host once libtpu is installed (`pip install -e '.[tpu]'`):
`jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name=...)` returns devices that can be
compiled for, never run on (MaxText's train_compile.py works the same way). A `Mesh` of them, the trainer's own
jitted functions lowered on ShapeDtypeStructs with the run's shardings (`plan/xla.py`), and `.compile()` give the
TPU compiler's per-chip memory and its optimized program. Nothing of the model's size is allocated. NVIDIA GPUs
work the same way with the CUDA plugin (`pip install -e '.[gpu]'`): `get_topology_desc(platform="cuda",
target_config=..., topology="1x1x8")` from a GpuTargetConfig of the card (gpu_specs/*.txtpb), with JAX_PLATFORMS=cpu
so that the plugin does not look for a driver. XLA:GPU gives the memory; its cost_analysis() gives nothing.

For each program (the update, the scoring pass, the configured sampler's prefill and decode) `report_lines` prints
the compile time, the TPU compiler's memory per chip (its peak and argument + output + temp - alias) against the
chip's HBM and against the planner (`plan/memory.py`), and a lower bound on its time: the largest of FLOPs at the
chip's peak, bytes at its HBM bandwidth, and the collectives the compiled program runs at its interconnect's
bandwidth. FLOPs and HBM bytes are the planner's arithmetic (the compiler's `cost_analysis()` counts a loop's body
once, and XLA:TPU writes its matmuls as convolutions with its own loops around them, so its FLOPs are not
used); the collectives' bytes are read from the optimized program (`plan/hlo.py`), each
counted as often as its loop runs (XLA's recorded trip counts; the decode's: max_new_tokens). The update's bound
gives an MFU bound (model FLOPs, 6 x parameters x tokens plus attention, over the chips' peak for that time), the
decode's a tokens/s bound.

The TPU-only environment (TPU_SKIP_MDS_QUERY, ALLOW_MULTIPLE_LIBTPU_LOAD, and the metadata libtpu asks for) is set
here, before libtpu loads, and nowhere else: a CPU run with libtpu installed is untouched (tests/test_tpu_compile.py).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from typing import Any

from jaxrlvr import config_lib
from jaxrlvr import parallel
from jaxrlvr.plan import hlo
from jaxrlvr.plan import memory as memory_lib

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator chip's public specifications (per chip; a v4 chip is two JAX devices)."""
  name: str
  hbm_bytes: int
  peak_flops: float  # dense bfloat16 FLOP/s
  hbm_bandwidth: float  # bytes/s
  ici_bandwidth: float | None  # bytes/s the chip sends and receives over its interconnect (bidirectional)
  devices_per_chip: int = 1


# Google Cloud's TPU pages (v4, v5e, v5p, v6e: "key specifications"); v4's page gives no per-chip ICI figure.
CHIPS = {
    "v4": Chip("TPU v4", 32 * GIB, 275e12, 1200e9, None, devices_per_chip=2),
    "v5e": Chip("TPU v5e", 16 * GIB, 197e12, 819e9, 400e9),
    "v5p": Chip("TPU v5p", 95 * GIB, 459e12, 2765e9, 1200e9),
    "v6e": Chip("TPU v6e", 32 * 10**9, 918e12, 1638e9, 800e9),
    # NVIDIA's H100 SXM and H200 datasheets: dense BF16 tensor FLOP/s, HBM3(e), NVLink 4's 900 GB/s a GPU.
    "h100": Chip("NVIDIA H100 80GB HBM3", 80 * 10**9, 989e12, 3.35e12, 900e9),
    "h200": Chip("NVIDIA H200 141GB HBM3e", 141 * 10**9, 989e12, 4.8e12, 900e9),
}
GPUS = ("h100", "h200")


@dataclasses.dataclass(frozen=True)
class Target:
  """A parsed --topology: the chip and JAX's topology name for it (for GPUs: 'h100:8', the card and its count)."""
  chip_key: str
  topology_name: str

  @property
  def platform(self) -> str:
    return "gpu" if self.chip_key in GPUS else "tpu"

  @property
  def chip(self) -> Chip:
    return CHIPS[self.chip_key]


_TPU_TOPOLOGY = re.compile(r"^(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})$")
_GPU_TOPOLOGY = re.compile(r"^(h100|h200):([1-9]\d*)$")


def parse_topology(text: str) -> Target:
  """'v5p:2x2x1' (JAX's own topology names: a TPU version and its chips' grid) or 'h100:8' (a GPU and how many,
  one host's NVLink domain) -> Target; one clear error else."""
  text = text.strip()
  match = _TPU_TOPOLOGY.match(text) or _GPU_TOPOLOGY.match(text)
  if not match:
    raise config_lib.ConfigError(
        f"--topology={text!r}: expected a TPU version and its chips' grid as JAX names it, e.g. v5p:2x2x1 "
        f"(4 chips), v5p:4x4x4 (64), v5e:2x2, v6e:2x4, v4:2x2x1, or a GPU and a count, h100:8, h200:8")
  return Target(chip_key=match.group(1), topology_name=text)


def compile_only_devices(target: Target) -> list:
  """The topology's compile-only devices (libtpu's or the CUDA plugin's), after setting what the plugin needs off
  the machine it compiles for."""
  if target.platform == "gpu":
    return _gpu_devices(target)
  if importlib.util.find_spec("libtpu") is None:
    raise config_lib.ConfigError(f"--topology={target.topology_name}: libtpu is not installed; "
                                 f"pip install -e '.[tpu]' (jax[tpu] at the locked jax version)")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server off a TPU VM: do not wait for one
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # a second process may hold libtpu (tests, CI)
  # What a TPU VM's metadata says; unset, libtpu prints an error and two warnings for each, though the compile-only
  # devices do not depend on them (libtpu 0.0.42.1: v5p:4x4x4 gives its 64 devices under any of these values).
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", target.topology_name.replace(":", "-"))
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  return list(topologies.get_topology_desc(platform="tpu", topology_name=target.topology_name).devices)


def _gpu_devices(target: Target) -> list:
  if importlib.util.find_spec("jax_cuda12_plugin") is None:
    raise config_lib.ConfigError(f"--topology={target.topology_name}: the CUDA plugin is not installed; "
                                 f"pip install -e '.[gpu]' (jax[cuda12] at the locked jax version)")
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  if not os.environ.get("JAX_PLATFORMS"):
    # Compile only: the plugin must not look for a driver, which it skips when the platforms asked for leave CUDA
    # out. JAX read JAX_PLATFORMS when it was imported, so the setting goes to its config (no backend has started).
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
  spec = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_specs", f"{target.chip_key}.txtpb")
  with open(spec, encoding="utf-8") as f:
    config = f.read()
  count = int(target.topology_name.split(":")[1])
  return list(topologies.get_topology_desc(platform="cuda", target_config=config,
                                           topology=f"1x1x{count}").devices)


def mesh_sizes(config: Any, num_devices: int, mesh: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
  """(data, fsdp, tensor): `mesh` when given, else the config's mesh (one size may be -1) over the devices."""
  if mesh is not None:
    if math.prod(mesh) != num_devices:
      raise config_lib.ConfigError(f"--mesh={','.join(map(str, mesh))}: {math.prod(mesh)} devices, but the "
                                   f"topology has {num_devices}")
    return tuple(int(s) for s in mesh)
  return tuple(config_lib.mesh_shape(config.mesh, num_devices))


@dataclasses.dataclass(frozen=True)
class ProgramReport:
  """One compiled program on the topology, per chip."""
  name: str
  compile_s: float
  peak_bytes: int | None  # the compiler's peak_memory_in_bytes where it reports one
  total_bytes: int  # argument + output + temp - alias
  planned_bytes: int
  flops: float  # the planner's FLOPs per chip for one call
  hbm_bytes: float  # the planner's bytes read and written per chip
  collective_bytes: float  # from the optimized program, loops' trip counts multiplied in
  loop_all_gathers: int
  seconds: float  # the lower bound on the call's time
  bound_by: str  # what sets it: "FLOPs", "HBM" or "ICI"
  # --min_hbm: (low, high], the bytes between which the least HBM it compiles in lies (xla_tpu_max_hbm_size_mib)
  min_hbm_bytes: tuple[int, int] | None = None


def analyse(name: str, compiled: Any, compile_s: float, *, planned_bytes: int, flops: float, hbm_bytes: float,
            loop_trips: int, chip: Chip) -> ProgramReport:
  """A ProgramReport of one compiled program: its memory and collectives, and the time bound they and the
  planner's FLOPs and bytes give on `chip`."""
  stats = compiled.memory_analysis()
  total = (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
           - stats.alias_size_in_bytes)
  peak = getattr(stats, "peak_memory_in_bytes", None) or None
  text = compiled.as_text()
  inside = hlo.collectives(text, in_loops=True)
  collective_bytes = hlo.collective_bytes(text, unknown_trips=loop_trips)
  per_device = chip.devices_per_chip
  times = {"FLOPs": flops / (chip.peak_flops / per_device), "HBM": hbm_bytes / (chip.hbm_bandwidth / per_device),
           "ICI": collective_bytes / (chip.ici_bandwidth / per_device) if chip.ici_bandwidth else 0.0}
  bound_by = max(times, key=times.get)
  return ProgramReport(name=name, compile_s=compile_s, peak_bytes=peak, total_bytes=total,
                       planned_bytes=planned_bytes, flops=flops, hbm_bytes=hbm_bytes,
                       collective_bytes=collective_bytes,
                       loop_all_gathers=hlo.count(inside, "all-gather"), seconds=times[bound_by],
                       bound_by=bound_by)


def compile_on_topology(config: Any, target: Target, mesh: tuple[int, int, int] | None = None,
                        phases: tuple[str, ...] = ("update", "score", "prefill", "decode"),
                        echo: Any = None, min_hbm: bool = False
                        ) -> tuple[tuple[int, int, int], list[ProgramReport], list[str], dict]:
  """((data, fsdp, tensor), a ProgramReport a program, notes, the planner's work by program) of `config`'s programs
  compiled for `target`.

  A `train.num_microbatches` whose micro-batches do not split over the mesh's batch shards is replaced by
  `config_lib.splitting_microbatches`' and said in the notes. `echo(line)` hears of each program as it compiles
  (minutes each at 7B on 2 cores). `min_hbm`: also bracket the least HBM each program compiles in, over XLA:TPU's
  xla_tpu_max_hbm_size_mib (`least_hbm_bracket`: 2 more compiles where the planner is within 10% of it, ~5 if not).
  """
  from jaxrlvr.plan import work as work_lib  # pylint: disable=g-import-not-at-top
  from jaxrlvr.plan import xla as plan_xla  # pylint: disable=g-import-not-at-top
  devices = compile_only_devices(target)
  sizes = mesh_sizes(config, len(devices), mesh)
  notes = []
  shards = sizes[0] * sizes[1]
  proposal = config_lib.splitting_microbatches(config, shards)
  if proposal is not None:
    notes.append(f"train.num_microbatches {config.train.num_microbatches} -> {proposal}: the configured count's "
                 f"micro-batches do not split over the {shards} batch shards; {proposal} is the largest that does")
    config = config.copy_and_resolve_references()
    config.train.num_microbatches = proposal
  config_lib.validate(config, num_devices=len(devices))
  mesh_obj = parallel.make_mesh(*sizes, devices=devices)
  w, wt, terms = memory_lib.phase_terms(config, sizes, backend=target.platform)
  work = work_lib.program_work(config, w, wt, len(devices))
  reports = []
  if min_hbm and target.platform != "tpu":
    notes.append("--min_hbm bisects XLA:TPU's HBM cap; XLA:GPU has none: not run")
    min_hbm = False
  for phase in phases:
    if echo:
      echo(f"compiling {phase} for {target.topology_name} (mesh {','.join(map(str, sizes))})...")
    (compiled, seconds), = plan_xla.compile_programs(config, mesh_obj, phases=(phase,)).values()
    loop_trips = _unknown_trips(config, w)[phase]
    report = analyse(phase, compiled, seconds, planned_bytes=sum(terms[phase].values()),
                     flops=work[phase].flops, hbm_bytes=work[phase].hbm_bytes, loop_trips=loop_trips,
                     chip=target.chip)
    del compiled
    if min_hbm:
      if echo:
        echo(f"bracketing {phase}'s least HBM...")
      mib = lambda b: int(b // 2**20)
      bracket = least_hbm_bracket(lambda cap: _compiles_within(config, mesh_obj, phase, cap),
                                  planned_mib=mib(report.planned_bytes), floor_mib=mib(report.total_bytes) // 4,
                                  ceiling_mib=mib(target.chip.hbm_bytes / target.chip.devices_per_chip))
      report = dataclasses.replace(report, min_hbm_bytes=bracket and (bracket[0] * 2**20, bracket[1] * 2**20))
    reports.append(report)
  return sizes, reports, notes, work


def least_hbm_bracket(compiles_within: Any, *, planned_mib: int, floor_mib: int, ceiling_mib: int,
                      within: float = 0.10) -> tuple[int, int] | None:
  """(low, high] in MiB: the least HBM cap under which `compiles_within(mib)` still compiles lies above low and at
  or below high; None when the chip's `ceiling_mib` does not compile.

  The first probes are the planner's band, planned / (1 + within) and planned / (1 - within): where the first fails
  and the second compiles, two compiles show that the planner is within `within` of the least HBM, and the
  bracket is that band. Otherwise the bracket is halved (in ratio) from there, between `floor_mib` (assumed too
  small, not compiled) and the ceiling, until high / low is no wider than the band's (1 + within) / (1 - within).
  A compile of a 7B update takes minutes to a quarter of an hour on 2 cores, hence the few probes.
  """
  width = (1 + within) / (1 - within)
  low, high = floor_mib, None
  for probe in (planned_mib / (1 + within), planned_mib / (1 - within)):
    probe = min(int(probe), ceiling_mib)
    if probe <= low:
      continue
    if compiles_within(probe):
      high = probe
      break
    low = probe
  if high is None:
    if low >= ceiling_mib or not compiles_within(ceiling_mib):
      return None
    high = ceiling_mib
  while high > low * width:
    middle = int(math.sqrt(low * high)) if low else high // 2
    if not low < middle < high:  # a bracket of a few MiB: as narrow as whole MiB go
      break
    if compiles_within(middle):
      high = middle
    else:
      low = middle
  return low, high


def _compiles_within(config: Any, mesh: Any, phase: str, mib: int) -> bool:
  """Whether `phase` compiles with XLA:TPU's HBM capped at `mib` MiB (it fails with RESOURCE_EXHAUSTED when its
  buffers cannot be placed in that much)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrlvr.plan import xla as plan_xla  # pylint: disable=g-import-not-at-top
  try:
    plan_xla.compile_programs(config, mesh, phases=(phase,), compiler_options={"xla_tpu_max_hbm_size_mib": str(mib)})
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" in str(e):
      return False
    raise
  return True


def _unknown_trips(config: Any, w: memory_lib.Workload) -> dict[str, int]:
  """The trip count to assume for a loop whose count XLA did not record (`hlo.multiplicities`): the decode's stops
  once every row is done, after at most max_new_tokens steps (the engine's decode program is one chunk of
  decode_chunk_steps); the others' loops over micro-batches, row blocks and prompt chunks are counted ones."""
  micro = config.train.num_minibatches * config.train.num_microbatches
  blocks = -(-w.rollout_rows // w.prefill_rows) * -(-w.prompt_len // w.prefill_tokens)
  steps = int(config.rollout.decode_chunk_steps) if w.engine else w.completion_len
  return {"update": micro, "score": micro, "prefill": blocks, "decode": steps}


def format_report(config: Any, target: Target, sizes: tuple[int, int, int], reports: list[ProgramReport],
                  notes: list[str], work: dict) -> str:
  """The printed table: one row a program, per chip."""
  chip = target.chip
  hbm = chip.hbm_bytes / chip.devices_per_chip
  gb = lambda b: "-" if b is None else f"{b / 1e9:.2f}"
  lines = [f"{config.model.preset} on {target.topology_name}: {chip.name}, mesh data,fsdp,tensor = "
           f"{','.join(map(str, sizes))}, {hbm / 1e9:.1f} GB HBM a device; engine "
           f"{config.rollout.get('engine', 'static')}, decode_weights {config.rollout.get('decode_weights')}",
           *(f"  note: {n}" for n in notes),
           "program   compile s  peak GB  arg+out+temp-alias GB  least HBM GB  fits  planner GB  planner/peak  "
           "loop all-gathers  collective GB  bound ms  bound by"]
  for r in reports:
    # The compiler's peak is what a program needs: XLA:TPU compiles a program under an HBM cap down to about its
    # peak and not below (docs/pods.md, "The least HBM"), while arg+out+temp-alias counts buffers that never coexist.
    used = r.peak_bytes or r.total_bytes
    lines.append(f"{r.name:<9} {r.compile_s:>9.0f}  {gb(r.peak_bytes):>7}  {gb(r.total_bytes):>21}  "
                 f"{'-' if r.min_hbm_bytes is None else '-'.join(map(gb, r.min_hbm_bytes)):>12}  "
                 f"{'yes' if used <= hbm else 'NO':>4}  {gb(r.planned_bytes):>10}  "
                 f"{r.planned_bytes / used:>12.2f}  "
                 f"{r.loop_all_gathers:>16}  {r.collective_bytes / 1e9:>13.2f}  {r.seconds * 1e3:>8.1f}  "
                 f"{r.bound_by}")
  by_name = {r.name: r for r in reports}
  if "update" in by_name:
    u = by_name["update"]
    mfu = work["update"].model_flops / (u.seconds * chip.peak_flops / chip.devices_per_chip)
    devices = math.prod(sizes)
    lines.append(f"update: MFU bound {mfu:.0%} (model FLOPs {work['update'].model_flops * devices:.3g} "
                 f"a step over {devices} devices at the bound)")
  if "decode" in by_name:
    d = by_name["decode"]
    lines.append(f"decode: {work['decode'].tokens / d.seconds:,.0f} tokens/s bound over the slice "
                 f"({work['decode'].tokens} tokens a call)")
  return "\n".join(lines)
