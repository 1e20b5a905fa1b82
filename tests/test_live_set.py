"""plan/live_set.py: the live set at a compiled program's peak, from XLA's dump (buffer assignment + live ranges)."""
import glob

import jax
import jax.numpy as jnp

from jaxrlvr.plan import live_set

_ASSIGNMENT = """BufferAssignment:
allocation 0: size 4096, parameter 0, shape |f32[32,32]| at ShapeIndex {}, maybe-live-out:
 value: <1 param.1 @0> (size=4096,offset=0): f32[32,32]{1,0}
allocation 1: size 6144, preallocated-temp:
 value: <2 fusion.1 @0> (size=4096,offset=0): f32[32,32]{1,0}
 value: <3 fusion.2 @0> (size=4096,offset=0): f32[32,32]{1,0}
 value: <4 tuple.3{1} @0> (size=2048,offset=4096): f32[16,32]{1,0}
"""
_RANGES = """HloLiveRange (max 5):
  InstructionSequence:
    0:param.1
  BufferLiveRange:
    param.1{}:0-2
    fusion.1{}:1-3
    fusion.2{}:3-5
    tuple.3{1}:3-4
  Live ranges at 3 (peak):
"""


def test_the_sweep_counts_an_output_written_over_its_input_once(tmp_path):
  prefix = str(tmp_path / "module_0000.jit_f.")
  (tmp_path / "module_0000.jit_f.after_optimizations-buffer-assignment.txt").write_text(_ASSIGNMENT)
  (tmp_path / "module_0000.jit_f.after_optimizations-live-range.txt").write_text(_RANGES)
  peak = live_set.sweep(prefix)
  # At 1-2 the parameter (its allocation, whole) and fusion.1: 8,192. At 3 fusion.1, fusion.2 (written over it, the
  # same offsets: once) and tuple.3 beside them: 6,144, and the parameter is dead.
  assert (peak.bytes, peak.position) == (8192, 1)
  assert sorted(b.name for b in peak.live) == ["fusion.1", "param.1"]
  assert "f32[32,32]" in live_set.format_peak(peak)


def test_the_sweep_of_a_real_xla_dump(tmp_path):
  def loss(w1, w2, x):
    return jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2) ** 2)

  shapes = [(256, 4096), (4096, 256), (64, 256)]
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
      *[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]).compile(
          compiler_options={"xla_dump_to": str(tmp_path), "xla_dump_hlo_as_text": True})
  stats = compiled.memory_analysis()
  (assignment,) = glob.glob(str(tmp_path / "*jit_loss*after_optimizations-buffer-assignment.txt"))
  peak = live_set.sweep(assignment.split("after_optimizations-")[0])
  # Every argument is live at the first instruction; nothing beyond what the executable allocates is ever live.
  assert stats.argument_size_in_bytes <= peak.bytes
  assert peak.bytes <= stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
  # The backward needs tanh(x @ w1), [64, 4096], at the peak.
  assert "f32[64,4096]" in {b.shape for b in peak.live}


def test_the_command_names_a_missing_dump(tmp_path, capsys):
  assert live_set.main(["live_set", str(tmp_path / "module_0000.jit_update")]) == 2
  assert "module_0000.jit_update*after_optimizations-buffer-assignment.txt" in capsys.readouterr().err
