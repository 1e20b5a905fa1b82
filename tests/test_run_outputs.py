"""What a run shows: DIR/summary.png and DIR/samples.jsonl at every evaluation, and output a person reads line by
line: each message once, no traceback, no absl prefix, no library INFO lines or sharding table, and its own lines
above the progress bar instead of through it. One smoke run of the
main job, as a user starts it, serves the end-to-end tests; the parts are tested in-process on hand-made inputs."""
import collections
import json
import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from matplotlib import image as mpimg

import light_compile
import shared_runs
from jaxrlvr import evaluate as evaluate_lib
from jaxrlvr import logs
from jaxrlvr import outputs
from jaxrlvr.data.sources import Example
from jaxrlvr.outputs import summary as run_summary_lib
from jaxrlvr.rewards import math_reward

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# absl's prefix: severity, date, time, thread, file:line] (group 1: the file)
_LOG_PREFIX = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ([\w.]+):\d+\] ")
_BAR = re.compile(r"^train: +\d+%\|")  # a frame of the progress bar


@pytest.fixture(scope="module")
def smoke_run(smoke_warm_start):
  """(workdir, stdout, stderr) of `python -m jaxrlvr.main --config=configs/grpo.py:smoke` as a user starts it: the
  test run's one (tests/shared_runs.py), which test_train.py's smoke test of GRPO reads too."""
  workdir, returncode, stdout, stderr = shared_runs.grpo_smoke(smoke_warm_start)
  # bytes: text mode would turn the bar's carriage returns into newlines
  assert returncode == 0, stderr.decode("utf-8")[-4000:]
  return workdir, stdout.decode("utf-8"), stderr.decode("utf-8")


def _main(workdir: str, cache: str) -> tuple[str, str]:
  env = {k: v for k, v in light_compile.job_env().items() if k not in (logs.VERBOSE_ENV, logs.SHARDING_ENV)}
  result = subprocess.run(
      [sys.executable, "-m", "jaxrlvr.main", "--config=configs/grpo.py:smoke", f"--workdir={workdir}",
       f"--config.warm_start.cache_dir={cache}"],
      cwd=_REPO, env=env, capture_output=True, timeout=600)
  # bytes: text mode would turn the bar's carriage returns into newlines
  stdout, stderr = result.stdout.decode("utf-8"), result.stderr.decode("utf-8")
  assert result.returncode == 0, stderr[-4000:]
  return stdout, stderr


def _lines(text: str) -> list[str]:
  """The lines a terminal shows, each frame of the progress bar (redrawn after a carriage return) one of them."""
  return [line.strip() for line in re.split(r"[\r\n]", text) if line.strip()]


def _eval_steps(workdir):
  return sorted(r["step"] for r in outputs.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
                if "eval/accuracy" in r)


@pytest.mark.slow  # the module fixture runs a whole main command
def test_summary_png_is_drawn(smoke_run):
  workdir, _, _ = smoke_run
  path = os.path.join(workdir, outputs.SUMMARY_FILE)
  with open(path, "rb") as f:
    assert f.read(8) == _PNG_SIGNATURE
  pixels = mpimg.imread(path)  # [height, width, RGBA]
  assert pixels.shape[:2] == (750, 1100)  # figsize (11, 7.5) at 100 dpi
  assert pixels[..., :3].std() > 0.05  # curves, text and axes, not a blank canvas
  assert not [n for n in os.listdir(workdir) if n.startswith(".partial-")]


@pytest.mark.slow  # the module fixture runs a whole main command
def test_samples_jsonl_has_greedy_answers_at_every_eval(smoke_run):
  workdir, _, _ = smoke_run
  rows = outputs.read_jsonl(os.path.join(workdir, outputs.SAMPLES_FILE))
  with open(os.path.join(workdir, "config.json")) as f:
    num_samples = json.load(f)["eval"]["num_samples"]
  assert num_samples > 0
  by_step = {}
  for row in rows:
    assert {"step", "prompt", "completion", "answer", "reward", "index", "data_source", "length"} <= set(row)
    by_step.setdefault(row["step"], []).append(row)
  assert sorted(by_step) == _eval_steps(workdir)
  assert all(len(v) == num_samples for v in by_step.values())
  # The same questions at every evaluation, so their answers can be followed.
  assert len({tuple(r["index"] for r in v) for v in by_step.values()}) == 1
  # Each reward is the verifier's on that completion and answer.
  expected = math_reward([r["completion"] for r in rows], [r["answer"] for r in rows])
  assert [r["reward"] for r in rows] == [float(x) for x in expected]
  assert all(r["prompt"].startswith("Q: ") for r in rows)  # the embedded task's plain template


@pytest.mark.slow  # the module fixture runs a whole main command
def test_output_is_lines_for_a_person_each_once(smoke_run, smoke_warm_start):
  workdir, stdout, stderr = smoke_run
  # The same command again on the finished run: it says so, once.
  again_out, again_err = _main(workdir, smoke_warm_start)
  for out, err in ((stdout, stderr), (again_out, again_err)):
    lines = [line for line in _lines(out) + _lines(err) if not _BAR.match(line)]
    assert lines
    assert "Traceback" not in out + err
    assert not [line for line in lines if _LOG_PREFIX.search(line)], lines  # absl's prefix only with --verbosity
    assert not [line for line, n in collections.Counter(lines).items() if n > 1], lines
  assert [line for line in _lines(again_out + again_err) if "is finished" in line] == [
      f"jaxrlvr: the run in {workdir} is finished (step 4 of 4); nothing to do."]
  # What the first run said: the parameter count, the held-out set's size at start (16 questions: the smoke
  # config's), one line per evaluation with its standard error, the export; nothing from a library, no sharding table.
  lines = [line for line in _lines(stderr) if not _BAR.match(line)]
  evals = _eval_steps(workdir)
  assert len(lines) == 3 + len(evals), lines
  assert lines[0] == "policy: 993,408 parameters (--log_sharding lists them)"
  assert lines[2].startswith("the held-out set has 16 questions: at the step-0 accuracy ")
  assert lines[-1] == f"exported the policy (qwen2) to {workdir}/hf"
  for line, step in zip([lines[1], *lines[3:-1]], evals):
    assert re.fullmatch(rf"step {step}: held-out accuracy 0\.\d{{3}}±0\.\d{{3}} \(16 questions\), .*", line), line
  assert _lines(stdout) == []
  # The bar is whole: every line of ours starts a line of the terminal (the bar is cleared first), and it ends.
  for line in lines:
    start = stderr.index(line)
    assert start == 0 or stderr[start - 1] in "\r\n", stderr[max(0, start - 80):start + len(line)]
  assert "train: 100%" in stderr


def test_the_main_job_imports_no_torch():
  # tensorboardX imports torch whenever it is installed (~1.6 s in every run and test process); the
  # metric writer hides torch for that import, and torch still imports afterwards.
  pytest.importorskip("torch", reason="torch is not installed (the peers extra), so nothing can import it")
  code = "import sys, jaxrlvr.main; assert 'torch' not in sys.modules, 'jaxrlvr.main imported torch'; import torch"
  result = subprocess.run([sys.executable, "-c", code], cwd=_REPO, capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr[-2000:]


def _record(pathname, level):
  return logging.LogRecord("absl", level, pathname, 1, "message", None, None)


def test_library_info_is_filtered_but_not_ours_or_warnings():
  quiet = logs.OwnInfoOnly()
  ours = os.path.join(os.path.dirname(logs.__file__), "warm_start.py")
  library = os.path.join(os.path.dirname(logging.__file__), "orbax", "checkpoint_manager.py")
  assert quiet.filter(_record(ours, logging.INFO))
  assert not quiet.filter(_record(library, logging.INFO))
  assert quiet.filter(_record(library, logging.WARNING)) and quiet.filter(_record(library, logging.ERROR))


def test_setup_wraps_handlers_and_verbose_keeps_everything(monkeypatch):
  root = logging.getLogger()
  handler = logging.StreamHandler(sys.stderr)
  monkeypatch.setattr(root, "handlers", [handler])
  monkeypatch.delenv(logs.SHARDING_ENV, raising=False)
  logs.setup()
  (wrapped,) = root.handlers
  assert isinstance(wrapped, logs.AboveProgressBar) and wrapped.inner is handler
  assert [type(f) for f in wrapped.filters] == [logs.OwnInfoOnly] and not logs.log_sharding()
  logs.setup()  # again: still one wrapper and one filter
  assert root.handlers == [wrapped] and len(wrapped.filters) == 1
  logs.setup(verbose=True)
  assert root.handlers == [wrapped] and not wrapped.filters and logs.log_sharding()
  logs.setup(log_sharding=False)
  assert not logs.log_sharding()
  monkeypatch.setenv(logs.SHARDING_ENV, "1")
  assert logs.log_sharding()


def test_plain_lines_say_once_and_libraries_keep_their_prefix(monkeypatch, capsys):
  root = logging.getLogger()
  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter("PREFIX %(message)s"))
  monkeypatch.setattr(root, "handlers", [handler])
  monkeypatch.setattr(root, "level", logging.INFO)
  hidden = []  # the libraries' switches are process-wide: here only whether plain lines turn them
  monkeypatch.setattr(logs, "_hide_library_bars", lambda: hidden.append(True))
  try:
    logs.setup(plain=True)
    assert hidden == [True]
    handler.stream = sys.stderr  # capsys's
    ours = os.path.join(os.path.dirname(logs.__file__), "train.py")
    library = os.path.join(os.path.dirname(logging.__file__), "orbax", "checkpoint_manager.py")
    for pathname, level, message in ((ours, logging.INFO, "step 2: held-out accuracy"),
                                     (ours, logging.WARNING, "the batch solve rate has been 0"),
                                     (library, logging.INFO, "saving"), (library, logging.WARNING, "slow disk")):
      root.handle(logging.LogRecord("absl", level, pathname, 1, message, None, None))
    logs.say("the run is finished")
    out, err = capsys.readouterr()
    assert out == "jaxrlvr: the run is finished\n"  # on stdout, and not again on stderr
    assert err.splitlines() == ["step 2: held-out accuracy", "jaxrlvr: warning: the batch solve rate has been 0",
                                "PREFIX slow disk"]
    with logs.third_party_bars_hidden():
      sys.stderr.write("Converting and de-quantizing GGUF tensors...: 100%|##########|\r")
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError), logs.third_party_bars_hidden():
      sys.stderr.write("what the library said before it failed\n")
      raise ValueError
    assert capsys.readouterr().err == "what the library said before it failed\n"
  finally:
    logs.setup()  # plain off again for the tests that follow in this process


def test_evaluate_with_samples_returns_spread_greedy_answers():
  examples = [Example(qid=i, question=f"{i}+{i}", answer=str(2 * i), data_source=f"level{i // 5}") for i in range(10)]

  def generate_fn(prompts, temperature, n):
    # Right on even questions; a completion that names its prompt, so a sample can be matched to its question.
    completions = [f"{p.strip()} \\boxed{{{2 * i if i % 2 == 0 else -1}}}" for i, p in enumerate(prompts)
                   for _ in range(n)]
    return completions, [3 + i for i in range(len(prompts)) for _ in range(n)]

  metrics, samples = evaluate_lib.evaluate_with_samples(generate_fn, examples, num_samples=3)
  assert metrics["eval/accuracy"] == pytest.approx(0.5)
  assert [s["index"] for s in samples] == [0, 4, 9] == evaluate_lib.sample_indices(10, 3)  # both levels
  for s in samples:
    i = s["index"]
    assert s["prompt"] == f"Q: {i}+{i}\nA: " and s["completion"].startswith(s["prompt"].strip())
    assert (s["reward"], s["length"], s["answer"], s["data_source"]) == (float(i % 2 == 0), 3 + i, str(2 * i),
                                                                         f"level{i // 5}")
  assert evaluate_lib.evaluate_with_samples(generate_fn, examples)[1] == []  # num_samples defaults to 0
  assert evaluate_lib.sample_indices(2, 4) == [0, 1]  # never more than the questions
  assert evaluate_lib.evaluate(generate_fn, examples) == metrics


def test_run_summary_draws_replay_and_sources(tmp_path):
  rng = np.random.default_rng(0)
  rows = {}
  for step in range(61):
    row = {"step": step}
    if step:
      row.update({"rollout/solve_rate": rng.uniform(), "rollout/response_length": 20 + step,
                  "replay/replayed_share": 0.5 * (step > 10), "policy/replayed/tokens": 50.0 * (step > 10),
                  "policy/fresh/tokens": 100.0})
    if step % 10 == 0:
      row.update({"eval/accuracy": step / 100, "eval/level1/accuracy": step / 80, "eval/level2/accuracy": step / 120,
                  "eval/response_length": 15.0})
    rows[step] = row
  path = run_summary_lib.run_summary(rows, str(tmp_path / "summary.png"), title="exgrpo: test", total_steps=100)
  assert mpimg.imread(path).shape[:2] == (750, 1100)
  only_eval = run_summary_lib.run_summary({0: {"step": 0, "eval/accuracy": 0.2}}, str(tmp_path / "start.png"), title="t")
  assert os.path.getsize(only_eval) > 0  # the step-0 evaluation alone, before any training step, draws too


def test_writer_redraws_the_summary_from_every_row_a_resumed_run_included(tmp_path, monkeypatch):
  drawn = []
  monkeypatch.setattr(run_summary_lib, "run_summary", lambda rows, path, **kw: drawn.append((sorted(rows), kw)) or
                      open(path, "wb").close())
  writer = outputs.MetricWriter(str(tmp_path), total_steps=4, show_progress=False, summary_title="grpo: run")
  writer.write(0, {"eval/accuracy": 0.1})
  writer.write(1, {"rollout/solve_rate": 0.5})
  writer.write_samples(1, [{"prompt": "p", "completion": "c", "reward": 1.0}])
  writer.close()
  resumed = outputs.MetricWriter(str(tmp_path), total_steps=4, initial_step=1, show_progress=False,
                                 summary_title="grpo: run")
  resumed.write(2, {"rollout/solve_rate": 0.6, "eval/accuracy": 0.3})
  resumed.close()
  settings = {"title": "grpo: run", "total_steps": 4}
  assert drawn == [([0], settings), ([0, 1, 2], settings)]
  assert os.path.exists(tmp_path / "summary.png")
  assert outputs.read_jsonl(str(tmp_path / "samples.jsonl")) == [
      {"step": 1, "prompt": "p", "completion": "c", "reward": 1.0}]
