"""A user's mistake reaches `python -m jaxrlvr.main` as one line on stderr and exit code 2, never a traceback: the
line names the key, value, preset, file, row, column or path. A finished run says when a larger total_steps extends
it and refuses any other change, leaving its config.json as it was."""
import importlib
import json
import os
import shutil
import subprocess
import sys

import pytest

import light_compile
import shared_runs
from jaxrlvr import checkpointing
from jaxrlvr import config_lib
from jaxrlvr import outputs
from jaxrlvr import parallel

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TIMEOUT_S = 600


def _main(*args: str, env: dict | None = None, cwd: str = _REPO) -> subprocess.CompletedProcess:
  full_env = light_compile.job_env()
  full_env.pop("JAXRLVR_VERBOSE", None)
  full_env.update(env or {})
  return subprocess.run([sys.executable, "-m", "jaxrlvr.main", *args], cwd=cwd, env=full_env, capture_output=True,
                        text=True, timeout=_TIMEOUT_S)


def _error_line(result: subprocess.CompletedProcess) -> str:
  """The one line a user error prints: exit code 2, nothing else on stderr, no traceback."""
  assert result.returncode == 2, result.stderr[-3000:]
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1, result.stderr[-3000:]
  assert lines[0].startswith("jaxrlvr: error: ") and "Traceback" not in result.stderr
  return lines[0]


def _grpo(workdir, *extra: str) -> list[str]:
  return ["--config=configs/grpo.py:smoke", f"--workdir={workdir}",
          f"--config.warm_start.cache_dir={os.environ['JAXRLVR_WARM_START_CACHE']}", *extra]


# ------------------------------------------------------------------------------------------------ Flag parsing


@pytest.mark.parametrize("override, key, closest", [
    ("--config.optim.lrr=1e-4", "optim.lrr", "optim.lr"),
    ("--config.optimm.lr=1e-4", "optimm.lr", "optim.lr"),
    ("--config.rollout.groupsize=4", "rollout.groupsize", "rollout.group_size"),
    ("--config.lr=1e-4", "lr", "optim.lr"),  # a key at the wrong level: matched on its last part
])
def test_unknown_key_names_the_full_key_and_the_closest(tmp_path, override, key, closest):
  line = _error_line(_main("--config=configs/exgrpo.py", f"--workdir={tmp_path}", override))
  assert f"unknown config key {key!r} (did you mean {closest!r}" in line
  assert not os.listdir(tmp_path)  # refused before the run touched its workdir


def test_a_key_below_a_value_says_the_value_has_no_keys(tmp_path):
  line = _error_line(_main("--config=configs/exgrpo.py", f"--workdir={tmp_path}", "--config.optim.lr.x=1"))
  assert "'optim.lr.x'" in line and "config.optim.lr is a float" in line


def test_a_value_of_the_wrong_type_names_key_value_and_type(tmp_path):
  line = _error_line(_main("--config=configs/exgrpo.py", f"--workdir={tmp_path}", "--config.seed=abc"))
  assert line.startswith("jaxrlvr: error: --config.seed=abc: ") and "config.seed is of type int" in line


def test_unknown_preset_names_it_and_the_known_ones(tmp_path):
  line = _error_line(_main("--config=configs/exgrpo.py:model=foo", f"--workdir={tmp_path}"))
  assert "configs/exgrpo.py:model=foo" in line and "unknown model preset" in line and "'foo'" in line
  for known in ("tiny", "qwen2.5-math-7b", "llama3.1-8b"):
    assert f"'{known}'" in line
  assert "data source" not in line  # the paper-scale branch (empty data.source) is never reached


def test_unknown_config_arg_names_it(tmp_path):
  line = _error_line(_main("--config=configs/grpo.py:modle=tiny", f"--workdir={tmp_path}"))
  assert "unknown config arg 'modle'" in line and "'model'" in line


def test_missing_config_file_names_the_path(tmp_path):
  line = _error_line(_main("--config=configs/no_such_method.py", f"--workdir={tmp_path}", "--config.seed=1"))
  assert "'configs/no_such_method.py'" in line and "repository root" in line


def test_running_outside_the_repository_root_says_so(tmp_path):
  config = os.path.join(_REPO, "configs", "grpo.py")
  line = _error_line(_main(f"--config={config}", f"--workdir={tmp_path / 'run'}", cwd=str(tmp_path)))
  assert "run from the repository root" in line and str(tmp_path) in line


@pytest.mark.parametrize("how", ["flag", "env"])
def test_verbose_shows_the_traceback(tmp_path, how):
  args = ["--config=configs/exgrpo.py", f"--workdir={tmp_path}", "--config.optim.lrr=1e-4"]
  result = _main(*args, "--verbose") if how == "flag" else _main(*args, env={"JAXRLVR_VERBOSE": "1"})
  assert result.returncode not in (0, 2) and "Traceback (most recent call last)" in result.stderr
  assert "lrr" in result.stderr


# ------------------------------------------------------------------------------------------------ Workdir


def test_workdir_that_is_a_file(tmp_path):
  path = tmp_path / "file"
  path.write_text("x")
  line = _error_line(_main("--config=configs/grpo.py:smoke", f"--workdir={path}"))
  assert f"--workdir={path} is a file" in line


def test_workdir_whose_parent_is_a_file(tmp_path):
  (tmp_path / "file").write_text("x")
  path = tmp_path / "file" / "run"
  line = _error_line(_main("--config=configs/grpo.py:smoke", f"--workdir={path}"))
  assert f"--workdir={path}: cannot create the directory (Not a directory)" in line


def _unwritable_dir(tmp_path) -> str:
  path = tmp_path / "read-only"
  path.mkdir()
  path.chmod(0o500)
  try:  # root writes anyway: fall back to a directory no one can write in
    (path / "probe").write_text("x")
  except OSError:
    return str(path)
  for candidate in ("/sys", "/proc"):
    try:
      with open(os.path.join(candidate, "jaxrlvr-probe"), "w", encoding="utf-8"):
        pass
    except OSError:
      return candidate
  pytest.skip("no unwritable directory on this machine")


def test_read_only_workdir_names_the_path_and_what_to_do(tmp_path):
  path = _unwritable_dir(tmp_path)
  line = _error_line(_main("--config=configs/grpo.py:smoke", f"--workdir={path}"))
  assert f"--workdir={path}: cannot write in the directory" in line and "give another --workdir" in line


# ------------------------------------------------------------------------------------------------ In the run


def test_config_error_in_the_run_is_one_line(tmp_path):
  line = _error_line(_main(*_grpo(tmp_path / "run", "--config.rollout.group_size=1")))
  assert "config.rollout.group_size=1" in line and "at least 2" in line


@pytest.mark.parametrize("flags, env, words", [
    (["--coordinator_address=node0"], {}, "--coordinator_address='node0'"),  # no port
    ([], {"JAXRLVR_COORDINATOR": "node0:1234", "JAXRLVR_NUM_PROCESSES": "two"}, "JAXRLVR_NUM_PROCESSES='two'"),
])
def test_a_bad_multi_process_setting_names_it(tmp_path, flags, env, words):
  line = _error_line(_main(*_grpo(tmp_path / "run"), *flags, env=env))
  assert words in line, line


def test_a_coordinator_without_a_valid_process_count_or_id_names_them(monkeypatch):
  for name in ("JAXRLVR_COORDINATOR", "JAXRLVR_NUM_PROCESSES", "JAXRLVR_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  with pytest.raises(config_lib.ConfigError, match="needs --num_processes"):
    parallel.initialize_distributed("node0:1234")
  with pytest.raises(config_lib.ConfigError, match="got 2 and 2"):
    parallel.initialize_distributed("node0:1234", 2, 2)


def test_a_model_path_that_is_not_a_checkpoint_names_it(tmp_path):
  missing = tmp_path / "no_such_ckpt"
  line = _error_line(_main(*_grpo(tmp_path / "run", f"--config.model.path={missing}")))
  assert f"config.model.path='{missing}'" in line and "does not exist" in line and "Hugging Face checkpoint" in line


def test_malformed_jsonl_row_names_file_line_row_and_column(tmp_path):
  good = json.dumps({"question": "1+1", "answer": "2"})
  cut_off = json.dumps({"question": "what is 2+2", "answer": "4"})[:-1]  # the closing brace is missing
  path = tmp_path / "train.jsonl"
  path.write_text(f"{good}\n\n{cut_off}\n")  # a blank line: line 3 holds row 1
  line = _error_line(_main(*_grpo(tmp_path / "run", f"--config.data.source=jsonl:{path}",
                                  "--config.data.worked_fraction=1.0")))
  assert f"{path} line 3 (row 1): not valid JSON" in line
  assert f"at column {len(cut_off) + 1})" in line  # where the missing brace should be, not column 1 of line 2


# ------------------------------------------------------------------------------------------------ Finished runs


@pytest.fixture(scope="module")
def finished_run(smoke_warm_start):
  """A grpo smoke run finished at step 4, the test run's one (tests/shared_runs.py: its own 1-step run here was one
  more main command, ~9.6 CPU-s); each test works on a copy."""
  workdir, returncode, _, stderr = shared_runs.grpo_smoke(smoke_warm_start)
  assert returncode == 0, stderr.decode()[-4000:]
  # The shared run's command is this module's `_grpo`.
  assert [a for a in _grpo(workdir) if not a.startswith("--workdir=")] == [
      "--config=configs/grpo.py:smoke", f"--config.warm_start.cache_dir={smoke_warm_start}"]
  return workdir


@pytest.fixture
def finished_copy(finished_run, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(finished_run, workdir)
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    return workdir, f.read()


def _config_json(workdir) -> str:
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    return f.read()


@pytest.mark.slow  # a finished main command (the module fixture), then the same command again
def test_finished_run_with_the_same_config_has_nothing_to_do(finished_copy):
  workdir, config_json = finished_copy
  result = _main(*_grpo(workdir, "--config.total_steps=4"))
  assert result.returncode == 0 and "is finished (step 4 of 4); nothing to do" in result.stdout
  assert _config_json(workdir) == config_json


@pytest.mark.slow  # a finished main command (the module fixture), then the same command again
@pytest.mark.parametrize("override, change", [
    ("--config.optim.lr=1e-3", "optim.lr: 3e-05 -> 0.001"),  # a change an unfinished run refuses too
    ("--config.log_every=3", "log_every: 1 -> 3"),  # one it allows: a finished run would still ignore it
])
def test_finished_run_refuses_a_change_it_would_ignore(finished_copy, override, change):
  workdir, config_json = finished_copy
  line = _error_line(_main(*_grpo(workdir, "--config.total_steps=4", override)))
  assert f"the run in {workdir} is finished (step 4 of 4)" in line and change in line
  assert _config_json(workdir) == config_json


@pytest.mark.slow  # a finished main command (the module fixture), then the same command again
def test_extending_a_finished_run_refuses_a_change_that_breaks_resumption(finished_copy):
  workdir, config_json = finished_copy
  line = _error_line(_main(*_grpo(workdir, "--config.total_steps=5", "--config.optim.lr=1e-3")))
  assert "optim.lr: 3e-05 -> 0.001" in line and "break resumption" in line
  assert _config_json(workdir) == config_json


@pytest.mark.slow  # a finished main command (the module fixture), then the same command again
def test_a_larger_total_steps_extends_a_finished_run_and_says_so(finished_copy):
  workdir, _ = finished_copy
  result = _main(*_grpo(workdir, "--config.total_steps=5"))
  assert result.returncode == 0, result.stderr[-4000:]
  assert f"the run in {workdir} finished at step 4; total_steps=5 extends it from 4 to 5 steps" in result.stdout
  assert json.loads(_config_json(workdir))["total_steps"] == 5
  assert max(row["step"] for row in outputs.read_jsonl(os.path.join(workdir, "metrics.jsonl"))) == 5


# ------------------------------------------------------------------------------------------------ The rules


def test_refused_changes_on_unfinished_extended_and_finished_runs():
  saved = {"total_steps": 4, "log_every": 1, "optim": {"lr": 1e-4}}
  # Unfinished (checkpoint at 2 of 4): the schedule keys may change, the rest may not.
  assert checkpointing.refused_changes(saved, {**saved, "total_steps": 8, "log_every": 2}, step=2) == []
  assert checkpointing.refused_changes(saved, {**saved, "optim": {"lr": 1e-3}}, step=2) == ["optim.lr: 0.0001 -> 0.001"]
  # Finished at 4 and extended to 8: as unfinished, and the note says so.
  assert checkpointing.refused_changes(saved, {**saved, "total_steps": 8, "log_every": 2}, step=4) == []
  assert "extends it from 4 to 8 steps" in checkpointing.extension_note(saved, {**saved, "total_steps": 8}, step=4)
  assert checkpointing.extension_note(saved, {**saved, "total_steps": 8}, step=2) is None  # not finished
  # Finished with nothing left to do: every change but total_steps.
  assert checkpointing.refused_changes(saved, {**saved, "log_every": 2}, step=4) == ["log_every: 1 -> 2"]
  assert checkpointing.refused_changes(saved, {**saved, "total_steps": 3}, step=4) == []


def test_unknown_key_error_matches_whole_keys_then_last_parts():
  config = importlib.import_module("configs.grpo").get_config()
  assert config_lib.unknown_key_error(config, "optim.lr") is None
  assert config_lib.unknown_key_error(config, "optim") is None
  assert "(did you mean 'optim.lr' or 'warm_start.lr'?)" in config_lib.unknown_key_error(config, "lr")
  assert config_lib.unknown_key_error(config, "zzzz") == "unknown config key 'zzzz'"
