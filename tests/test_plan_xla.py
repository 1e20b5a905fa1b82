"""The planner against XLA: the four device phases of a paper-scale step compiled with abstract 7B-wide inputs.

The trainer's own jitted functions (update, scoring pass, a sampler call's prefill and decode, and the rollout
engine's insert and decode chunk from its decode copy of the weights; `jaxrlvr/plan/xla.py`) are lowered with
ShapeDtypeStructs sharded over fsdp=8 on 8 CPU devices and compiled, never run, for the
qwen2.5-math-7b preset cut to 1, 2 and 3 layers at the paper's lengths (1024 + 8192 tokens, 1024 rollouts, the
shipped sampler bounds). Compute is float32: XLA:CPU computes bfloat16 dots in float32 and keeps float32 copies an
accelerator would not. The compile runs in a subprocess because XLA:CPU reads `plan.CPU_MEMORY_FLAGS` only
when its client starts (plan/report.py's docstring says why they are needed). About 40 s on 2 cores.
"""
import json
import os
import subprocess
import sys

import pytest

import shared_runs
from configs import exgrpo
from jaxrlvr import plan
from jaxrlvr import run_setup

# Compiling 7B-wide phases is what these tests check, and it takes minutes: the slow tier.
pytestmark = pytest.mark.slow

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LAYERS = (1, 2, 3)
_TOLERANCE = 0.2

_SCRIPT = """
import json, sys
from configs import exgrpo
from jaxrlvr import parallel, run_setup
from jaxrlvr.plan import xla as plan_xla
config = exgrpo.get_config("model=qwen2.5-math-7b")
config.unlock()
config.rollout.max_rows_per_device = run_setup.rows_per_sampler_call(config)
config.model.compute_dtype = "float32"
mesh = parallel.make_mesh(1, 8, 1)
out = {}
for layers in %r:
  model = run_setup.model_config(config).replace(num_layers=layers)
  out[layers] = {phase: m.total for phase, m in plan_xla.compile_phases(config, mesh, model).items()}
config.rollout.engine = "continuous"  # the rollout engine's insert and decode chunk, from the decode copy
for layers in %r:
  model = run_setup.model_config(config).replace(num_layers=layers)
  phases = plan_xla.compile_phases(config, mesh, model, phases=%r)
  out[layers].update({"engine_" + phase: m.total for phase, m in phases.items()})
print("RESULT " + json.dumps(out))
"""
_ENGINE_PHASES = ("prefill", "decode")  # the engine's insert (its prefill) and decode chunk


def _config():
  config = exgrpo.get_config("model=qwen2.5-math-7b")
  config.unlock()
  # The rows a call holds in a bfloat16 run (the KV cache budget's 32), kept at float32 compute: in float32 the
  # same budget would hold 16.
  config.rollout.max_rows_per_device = run_setup.rows_per_sampler_call(config)
  config.model.compute_dtype = "float32"
  return config


def _compile(path: str) -> None:
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": (f"--xla_force_host_platform_device_count=8 {plan.CPU_MEMORY_FLAGS} "
                       f"{plan.CPU_COMPILE_ONLY_FLAGS}")}
  script = _SCRIPT % (_LAYERS, _LAYERS, _ENGINE_PHASES)
  result = subprocess.run([sys.executable, "-c", script], cwd=_ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  line = next(l for l in result.stdout.splitlines() if l.startswith("RESULT "))
  with open(os.path.join(path, "measured.json"), "w", encoding="utf-8") as f:
    f.write(line[len("RESULT "):])


@pytest.fixture(scope="module")
def measured():
  # Once a test run (tests/shared_runs.py): as a module fixture it compiled on each worker that ran one of these
  # tests, and xdist splits the module's tests over both (58.4 CPU-s on the first, 15.7 from the compilation cache
  # on the second, 2026-12-07).
  with open(os.path.join(shared_runs.once_per_test_run("plan_xla", _compile), "measured.json"), encoding="utf-8") as f:
    return {int(k): v for k, v in json.load(f).items()}


@pytest.fixture(scope="module")
def planned():
  config = _config()
  base = run_setup.model_config(config)
  out = {layers: plan.plan_memory(config, (1, 8, 1), backend="cpu", model=base.replace(num_layers=layers))
         for layers in _LAYERS}
  config.rollout.engine = "continuous"
  for layers in _LAYERS:
    engine_plan = plan.plan_memory(config, (1, 8, 1), backend="cpu", model=base.replace(num_layers=layers))
    out[layers].update({"engine_" + phase: engine_plan[phase] for phase in _ENGINE_PHASES})
  return out


_ALL_PHASES = (*plan.PHASE_FUNCTIONS, *("engine_" + phase for phase in _ENGINE_PHASES))


def test_the_shipped_bounds_are_what_is_compiled():
  w = plan.workload(_config(), (1, 8, 1), backend="cpu")
  # 1024 rollouts / 8 shards = 128 rows a device in 4 calls of 32; the prefill blocks 16 of them, the whole bucket.
  assert (w.rollout_rows, w.sampler_calls, w.prefill_rows, w.prefill_tokens) == (32, 4, 16, 1024)
  assert w.micro_rows == 4 and w.model.remat
  # "auto" on CPU: blockwise for the training pass and the prefill, the xla path for one decode token (1 x 9216).
  assert (w.attention(9216, 9216), w.attention(1024, 9216), w.attention(1, 9216)) == ("blockwise", "blockwise", "xla")


@pytest.mark.parametrize("phase", _ALL_PHASES)
def test_each_phase_agrees_with_xla_at_every_depth(measured, planned, phase):
  for layers in _LAYERS:
    ratio = planned[layers][phase] / measured[layers][phase]
    print(f"{phase} {layers} layers: plan {planned[layers][phase] / 1e9:.2f} GB, "
          f"XLA {measured[layers][phase] / 1e9:.2f} GB, ratio {ratio:.3f}")
    assert abs(ratio - 1) <= _TOLERANCE, (phase, layers, ratio)


@pytest.mark.parametrize("phase", _ALL_PHASES)
def test_each_phase_grows_per_layer_as_planned(measured, planned, phase):
  # The per-layer part, from 2 to 3 layers: from 1 to 2, XLA:CPU's heap packing of the first layer's buffers adds
  # up to 0.5 GB of slack to the scoring pass and the prefill (measured), which says nothing about a layer.
  plan_step = planned[3][phase] - planned[2][phase]
  xla_step = measured[3][phase] - measured[2][phase]
  print(f"{phase}: a layer adds {plan_step / 1e9:.2f} GB planned, {xla_step / 1e9:.2f} GB in XLA")
  assert abs(plan_step / xla_step - 1) <= _TOLERANCE, (phase, plan_step, xla_step)
  # And the fixed part is not what carries the agreement: it is a sizeable share of every phase.
  assert planned[2][phase] - 2 * plan_step > 0.1 * planned[2][phase]
