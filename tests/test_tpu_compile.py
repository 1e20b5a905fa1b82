"""The run's programs through the TPU compiler, on libtpu's compile-only devices of a v5e:2x2 slice (no TPU needed).

The tiny preset's update and sampler compile for 4 TPU chips on an fsdp mesh, so a change that breaks TPU lowering
fails here; and the decode loop of the optimized program gathers no weight: with rollout.decode_weights
"replicated" (the default) the sampler gathers them once before its loop. The same compile with "training" (the
weights read in their fsdp layout, as the static sampler always read them before) puts an all-gather of every
weight inside the loop, once per generated token: the check sees what it is there to catch. `jaxrlvr.plan
--topology` reports the same programs (tests/test_plan.py checks its parsing).
"""
import importlib.util

import pytest

from configs import exgrpo
from jaxrlvr import parallel
from jaxrlvr.plan import hlo
from jaxrlvr.plan import topology
from jaxrlvr.plan import xla as plan_xla

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not installed (pip install -e '.[tpu]'; .ci/run installs it)")


@pytest.fixture(scope="module")
def mesh():
  devices = topology.compile_only_devices(topology.parse_topology("v5e:2x2"))
  assert [d.platform for d in devices] == ["tpu"] * 4
  return parallel.make_mesh(1, 4, 1, devices=devices)


def _config(**rollout):
  config = exgrpo.get_config("")
  config.unlock()
  config.rollout.update(rollout)
  return config


def _decode_gathers(config, mesh) -> tuple[int, int]:
  (compiled, _), = plan_xla.compile_programs(config, mesh, phases=("decode",)).values()
  text = compiled.as_text()
  return (hlo.count(hlo.collectives(text, in_loops=True), "all-gather"),
          hlo.count(hlo.collectives(text, in_loops=False), "all-gather"))


def test_the_update_compiles_for_tpu_within_its_hbm(mesh):
  (compiled, _), = plan_xla.compile_programs(_config(), mesh, phases=("update",)).values()
  stats = compiled.memory_analysis()
  assert 0 < stats.temp_size_in_bytes < topology.CHIPS["v5e"].hbm_bytes
  # fsdp over 4 chips: the update gathers the weights it computes with and reduce-scatters their gradients.
  ops = {c.op for c in hlo.collectives(compiled.as_text())}
  assert {"all-gather", "reduce-scatter"} <= ops or {"all-gather", "all-reduce"} <= ops, ops


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_the_decode_loop_gathers_no_weight(mesh, engine):
  in_loop, before = _decode_gathers(_config(engine=engine, decode_weights="replicated"), mesh)
  assert in_loop == 0
  if engine == "static":  # gathered inside the program, before its loop (the engine's copy is made before the call)
    assert before > 0


def test_the_training_layout_gathers_every_token(mesh):
  in_loop, _ = _decode_gathers(_config(engine="static", decode_weights="training"), mesh)
  assert in_loop > 0
