"""Checkpoints: host state packs losslessly, a failed write leaves the last good step, resumption-breaking changes
are named."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlvr import checkpointing


def test_host_state_round_trip_keeps_dtypes_empty_arrays_and_scalars():
  state = {"replay": {"exgrpo/store/rows": np.zeros((0,), np.int32), "rng": np.arange(6, dtype=np.uint64),
                      "keys": np.array(["a", "bc"]), "phase": True},
           "data": {"epoch": 3, "position": 17, "name": "train"}}
  restored = checkpointing.unpack_host_state(checkpointing.pack_host_state(state))
  assert restored["data"] == state["data"] and restored["replay"]["phase"] is True
  for key in ("exgrpo/store/rows", "rng", "keys"):
    np.testing.assert_array_equal(restored["replay"][key], state["replay"][key])
    assert restored["replay"][key].dtype == state["replay"][key].dtype


def test_failed_write_keeps_the_last_good_checkpoint(tmp_path):
  ckpt = checkpointing.Checkpointer(str(tmp_path))
  train = {"w": jnp.arange(4.0)}
  ckpt.save(2, train, {"x": {"n": 1}}, {"step": 2, "config": {}})
  # The meta item cannot be serialised, so orbax fails inside the write of step 4, after other items started.
  with pytest.raises(Exception):
    ckpt.save(4, {"w": jnp.arange(4.0) + 1}, {"x": {"n": 2}}, {"step": 4, "config": {}, "bad": object()})
  ckpt.close()
  reopened = checkpointing.Checkpointer(str(tmp_path))
  assert reopened.latest_step() == 2
  restored, host, meta = reopened.restore(2, checkpointing.abstract_like(train))
  np.testing.assert_array_equal(restored["w"], np.arange(4.0))
  assert host == {"x": {"n": 1}} and meta["step"] == 2


def test_incompatible_changes_name_the_key_and_allow_schedule_keys():
  saved = {"total_steps": 10, "rollout": {"group_size": 8}, "mesh": {"data": 8}}
  current = {"total_steps": 20, "rollout": {"group_size": 4}, "mesh": {"data": 4}}
  assert checkpointing.incompatible_changes(saved, current) == ["rollout.group_size: 8 -> 4"]


def test_a_tuple_equals_the_list_config_json_saved_it_as():
  saved = json.loads(json.dumps({"total_steps": 4, "train": {"pack_completions": (), "x": (0.5, 1)}}))  # lists
  current = {"total_steps": 4, "train": {"pack_completions": (), "x": (0.5, 1)}}
  assert checkpointing.refused_changes(saved, current, step=4) == []  # a finished run, every key compared
  assert checkpointing.refused_changes(saved, {**current, "train": {"pack_completions": (), "x": (0.5, 2)}},
                                       step=4) == ["train.x: [0.5, 1] -> [0.5, 2]"]


def test_a_checkpoint_resumes_only_with_the_process_count_that_wrote_it(tmp_path):
  ckpt = checkpointing.Checkpointer(str(tmp_path))
  ckpt.save(1, {"w": jnp.zeros(2)}, {"data": {"position": 3}}, {"step": 1, "config": {}})
  meta = ckpt.read_meta(1)
  assert meta["num_processes"] == 1
  ckpt.check_processes(meta)
  with pytest.raises(ValueError, match=r"written by 2 process\(es\).*this run has 1"):
    ckpt.check_processes({**meta, "num_processes": 2})
  ckpt.close()


def test_where_the_compilation_cache_lives_never_refuses_a_run():
  saved = {"total_steps": 4, "compilation_cache_dir": "~/.cache/jaxrlvr/xla", "optim": {"lr": 1e-5}}
  moved = {**saved, "compilation_cache_dir": ""}
  assert checkpointing.incompatible_changes(saved, moved) == []
  assert checkpointing.refused_changes(saved, moved, step=4) == []  # a finished run is still finished
  older = {k: v for k, v in saved.items() if k != "compilation_cache_dir"}  # a run from before the key
  assert checkpointing.refused_changes(older, saved, step=4) == []
  assert checkpointing.refused_changes(saved, {**saved, "optim": {"lr": 1e-4}}, step=4) == [
      "optim.lr: 1e-05 -> 0.0001"]


def test_the_main_command_keeps_compiled_programs_where_the_config_says(tmp_path):
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrlvr import main  # pylint: disable=g-import-not-at-top
  before = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
  assert main.use_compilation_cache("~/x", environ={"JAX_COMPILATION_CACHE_DIR": "/set/by/caller"}) == "/set/by/caller"
  assert main.use_compilation_cache("", environ={}) == ""
  try:
    assert main.use_compilation_cache(str(tmp_path / "xla"), environ={}) == str(tmp_path / "xla")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
  finally:
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
