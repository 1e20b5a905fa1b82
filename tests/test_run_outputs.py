"""What a run shows: DIR/summary.png and DIR/samples.jsonl at every evaluation, and a quiet stderr (no library INFO
lines, no sharding table) in which log lines go above the progress bar instead of through it. One smoke run of the
main job, as a user starts it, serves the end-to-end tests; the parts are tested in-process on hand-made inputs."""
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


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, smoke_warm_start):
  """(workdir, stderr) of `python -m jaxrlvr.main --config=configs/grpo.py:smoke` with the test run's warm start."""
  workdir = str(tmp_path_factory.mktemp("run_outputs") / "grpo-smoke")
  env = {k: v for k, v in light_compile.job_env().items() if k not in (logs.VERBOSE_ENV, logs.SHARDING_ENV)}
  result = subprocess.run(
      [sys.executable, "-m", "jaxrlvr.main", "--config=configs/grpo.py:smoke", f"--workdir={workdir}",
       f"--config.warm_start.cache_dir={smoke_warm_start}"],
      cwd=_REPO, env=env, capture_output=True, timeout=600)
  stderr = result.stderr.decode("utf-8")  # bytes: text mode would turn the bar's carriage returns into newlines
  assert result.returncode == 0, stderr[-4000:]
  return workdir, stderr


def _eval_steps(workdir):
  return sorted(r["step"] for r in outputs.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
                if "eval/accuracy" in r)


@pytest.mark.slow  # the module fixture runs a whole main command
def test_summary_png_is_drawn(smoke_run):
  workdir, _ = smoke_run
  path = os.path.join(workdir, outputs.SUMMARY_FILE)
  with open(path, "rb") as f:
    assert f.read(8) == _PNG_SIGNATURE
  pixels = mpimg.imread(path)  # [height, width, RGBA]
  assert pixels.shape[:2] == (750, 1100)  # figsize (11, 7.5) at 100 dpi
  assert pixels[..., :3].std() > 0.05  # curves, text and axes, not a blank canvas
  assert not [n for n in os.listdir(workdir) if n.startswith(".partial-")]


@pytest.mark.slow  # the module fixture runs a whole main command
def test_samples_jsonl_has_greedy_answers_at_every_eval(smoke_run):
  workdir, _ = smoke_run
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
def test_stderr_is_quiet_and_the_bar_whole(smoke_run):
  workdir, stderr = smoke_run
  assert "Unable to initialize backend" not in stderr
  assert not re.search(r"checkpoint_manager|orbax|atomicity\.py|async_checkpointer", stderr)
  assert "P(None" not in stderr and "logical" not in stderr  # the sharding table
  assert "(--log_sharding lists them)" in stderr
  # What is left is jaxrlvr's own: the warm start (one line when its cache is reused, four when it trains), the
  # parameter count, one line per evaluation and the export of the final policy.
  sources = [m.group(1) for m in _LOG_PREFIX.finditer(stderr)]
  ours = {name for _, _, files in os.walk(os.path.join(_REPO, "jaxrlvr")) for name in files}
  assert sources and set(sources) <= ours, sources
  evals = len(_eval_steps(workdir))
  assert [s for s in sources if s != "warm_start.py"] == ["train.py"] + ["writer.py"] * evals + ["export.py"]
  assert 1 <= sources.count("warm_start.py") <= 4
  assert len(re.findall(r"\] step \d+: held-out accuracy", stderr)) == evals
  # Every log line starts a line of the terminal: the bar is cleared (a carriage return) before one is written, so
  # none is glued to the end of a bar ("...replay=0]I1201 ...").
  for match in _LOG_PREFIX.finditer(stderr):
    assert match.start() == 0 or stderr[match.start() - 1] in "\r\n", stderr[max(0, match.start() - 80):match.end()]
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
