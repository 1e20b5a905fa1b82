"""The launchers in launch/: syntax, and each one run for real against stand-ins (trivial commands, fake
`scontrol`/`srun`/`gcloud` on PATH) so that the environment every process receives is checked, not assumed."""
import os
import re
import stat
import subprocess
import sys
import time

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LAUNCH = os.path.join(_ROOT, "launch")
_SCRIPTS = ("local.sh", "slurm.sbatch", "tpu_pod.sh")
# Prints what a jaxrlvr process would read from the environment.
_SHOW_ENV = ("import os; print(*[os.environ.get(k, '-') for k in ('JAXRLVR_PROCESS_ID', 'JAXRLVR_NUM_PROCESSES', "
             "'JAXRLVR_COORDINATOR', 'JAX_PLATFORMS', 'CUDA_VISIBLE_DEVICES')])")


def _run(args, *, env=None, timeout=60, cwd=_ROOT):
  return subprocess.run(args, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                        timeout=timeout, check=False)


def _executable(path, text):
  with open(path, "w") as f:
    f.write(text)
  os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)


@pytest.mark.parametrize("script", _SCRIPTS)
def test_scripts_parse_and_are_executable(script):
  path = os.path.join(_LAUNCH, script)
  assert _run(["bash", "-n", path]).returncode == 0
  assert os.access(path, os.X_OK)


def test_local_starts_n_processes_with_their_ids_and_prefixes():
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES")}
  result = subprocess.run([os.path.join(_LAUNCH, "local.sh"), "3", "--port", "45678", "--", sys.executable, "-c",
                           _SHOW_ENV], cwd=_ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)
  assert result.returncode == 0, result.stderr
  lines = sorted(result.stdout.splitlines())
  assert lines == [f"[{i}] {i} 3 127.0.0.1:45678 cpu -" for i in range(3)]


def test_local_keeps_each_prefixed_line_whole_when_processes_print_at_once():
  # The prefixers share one stdout: each line must reach it in one write, or a line of one process can land inside
  # a line of another (mawk -W interactive writes the text and the newline of `print` separately; CI saw it).
  command = "for ((n = 0; n < 3000; n++)); do echo line $n of $JAXRLVR_PROCESS_ID; done"
  result = _run([os.path.join(_LAUNCH, "local.sh"), "4", "--", "bash", "-c", command])
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  malformed = [line for line in lines if not re.fullmatch(r"\[(\d)\] line \d+ of \1", line)]
  assert not malformed, malformed[:5]
  assert sorted(lines) == sorted(f"[{i}] line {n} of {i}" for i in range(4) for n in range(3000))


def test_local_fails_when_one_process_fails_and_stops_the_others():
  # Process 1 fails at once; process 0 would sleep for a minute: local.sh must stop it and return 3 quickly.
  command = "if [ $JAXRLVR_PROCESS_ID = 1 ]; then echo broken >&2; exit 3; fi; sleep 60"
  start = time.monotonic()
  result = _run([os.path.join(_LAUNCH, "local.sh"), "2", "--", "bash", "-c", command])
  assert result.returncode == 3
  assert time.monotonic() - start < 8
  assert "[1] broken" in result.stdout  # stderr of a process is prefixed too
  assert "process 1 exited with status 3" in result.stderr


def test_local_rejects_bad_arguments():
  assert "N must be a positive integer, got 'x'" in _run([os.path.join(_LAUNCH, "local.sh"), "x", "--",
                                                          "true"]).stderr
  assert _run([os.path.join(_LAUNCH, "local.sh"), "2", "true"]).returncode == 2  # the command needs `--`


_FAKE_SCONTROL = """#!/usr/bin/env bash
# scontrol show hostnames gpu[3-4]
[[ "$1 $2 $3" == "show hostnames gpu[3-4]" ]] || exit 9
printf 'gpu3\\ngpu4\\n'
"""
# srun: skip options, then run the task command once per task with SLURM's per-task variables, two tasks a node.
_FAKE_SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$((i % 2)) "$@" || exit $?
done
"""


@pytest.mark.parametrize("per_gpu", [False, True])
def test_slurm_sets_coordinator_from_the_first_node(tmp_path, per_gpu):
  _executable(tmp_path / "scontrol", _FAKE_SCONTROL)
  _executable(tmp_path / "srun", _FAKE_SRUN)
  env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu[3-4]", "SLURM_NTASKS": "4",
         "SLURM_JOB_ID": "123456", "SLURM_JOB_NUM_NODES": "2", "JAXRLVR_PER_GPU": "1" if per_gpu else "0"}
  result = _run(["bash", os.path.join(_LAUNCH, "slurm.sbatch"), sys.executable, "-c", _SHOW_ENV], env=env)
  assert result.returncode == 0, result.stderr
  # Port 20000 + 123456 % 10000 = 23456 on gpu3, the first host of the node list.
  gpus = ["0", "1", "0", "1"] if per_gpu else [os.environ.get("CUDA_VISIBLE_DEVICES", "-")] * 4
  platforms = os.environ.get("JAX_PLATFORMS", "-")
  header, *lines = result.stdout.splitlines()
  assert header == ("slurm.sbatch: 4 processes on 2 nodes, coordinator gpu3:23456, one process per "
                    + ("GPU" if per_gpu else "node"))
  assert lines == [f"{i} 4 gpu3:23456 {platforms} {gpus[i]}" for i in range(4)]


# srun that runs one task in the background, as SLURM does, and stops it with SIGTERM as a preemption does.
_SIGNALLING_SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
echo "srun $$"
SLURM_PROCID=0 SLURM_LOCALID=0 "$@" &
task=$!
while [[ ! -f "$READY" ]]; do sleep 0.05; done
echo "task $task"
kill -TERM "$task"
wait "$task"
echo "task exited $?"
"""
_RUN_STANDIN = ("import os, signal, sys, time\n"
                "def stop(*_):\n  print('python', os.getpid(), 'saved and exits', flush=True)\n  sys.exit(0)\n"
                "signal.signal(signal.SIGTERM, stop)\nopen(os.environ['READY'], 'w').close()\ntime.sleep(60)\n")


def test_slurm_sends_sigterm_before_the_limit_to_the_run_itself_and_requeues(tmp_path):
  with open(os.path.join(_LAUNCH, "slurm.sbatch")) as f:
    directives = re.findall(r"^#SBATCH (\S+)", f.read(), re.M)
  assert {"--signal=TERM@120", "--requeue", "--open-mode=append"} <= set(directives)
  _executable(tmp_path / "scontrol", _FAKE_SCONTROL)
  _executable(tmp_path / "srun", _SIGNALLING_SRUN)
  env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu[3-4]",
         "SLURM_NTASKS": "1", "READY": str(tmp_path / "ready")}
  proc = subprocess.Popen(["bash", os.path.join(_LAUNCH, "slurm.sbatch"), sys.executable, "-c", _RUN_STANDIN],
                          cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  stdout, stderr = proc.communicate(timeout=60)
  assert proc.returncode == 0, stderr
  lines = dict(line.rsplit(" ", 1) for line in stdout.splitlines()[1:] if not line.startswith("python"))
  # srun is the batch script's own process (exec), and the task SLURM signals is python itself (exec in the task
  # wrapper): the SIGTERM reaches the run, not a shell that would die of it.
  assert lines["srun"] == str(proc.pid)
  assert f"python {lines['task']} saved and exits" in stdout and lines["task exited"] == "0"


def test_slurm_refuses_to_run_outside_an_allocation():
  env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
  result = subprocess.run(["bash", os.path.join(_LAUNCH, "slurm.sbatch"), "true"], cwd=_ROOT, env=env,
                          capture_output=True, text=True, timeout=30, check=False)
  assert result.returncode != 0 and "not inside a SLURM allocation" in result.stderr


# gcloud stand-in: logs every call; `describe` fails until `create` ran; one worker whose home is $FAKE_HOME.
_FAKE_GCLOUD = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
case "$4" in
  describe) [[ -f "$FAKE_STATE" ]] || exit 1; printf 'v5p-16\\tREADY\\n' ;;
  create) touch "$FAKE_STATE" ;;
  scp) cp "$5" "$FAKE_HOME/jaxrlvr.tar.gz" ;;
  ssh) for a in "$@"; do [[ "$a" == --command=* ]] && cmd="${a#--command=}"; done
       cd "$FAKE_HOME" && bash -c "$cmd" ;;
  *) exit 9 ;;
esac
"""


def test_tpu_pod_creates_copies_installs_and_runs(tmp_path):
  gcloud, home, log = tmp_path / "gcloud", tmp_path / "worker", tmp_path / "calls.log"
  home.mkdir()
  _executable(gcloud, _FAKE_GCLOUD)
  env = {"GCLOUD": str(gcloud), "FAKE_LOG": str(log), "FAKE_STATE": str(tmp_path / "exists"),
         "FAKE_HOME": str(home), "TPU_NAME": "pod", "ZONE": "us-east5-a", "PIP": "echo pip",
         "ENV_VARS": "JAXRLVR_CHECK=yes"}
  run = [os.path.join(_LAUNCH, "tpu_pod.sh"), "--", sys.executable, "-c",
         "import os; print('configs', os.path.exists('configs/exgrpo.py'), os.environ['JAXRLVR_CHECK'])"]
  result = _run(run, env=env)
  assert result.returncode == 0, result.stderr
  assert "configs True yes" in result.stdout  # the command ran inside the copied repository, with ENV_VARS
  assert "pip install -q -U jax[tpu]\n" in result.stdout and "pip install -q -e .[tfds]" in result.stdout
  calls = log.read_text().splitlines()
  verbs = [c.split()[3] for c in calls]
  assert verbs == ["describe", "create", "scp", "ssh", "ssh", "ssh"]
  assert "--accelerator-type=v5p-16 --version=v2-alpha-tpuv5" in calls[1]
  assert all("--worker=all" in c for c in calls[2:])
  assert f"--command=cd jaxrlvr && exec env JAXRLVR_CHECK=yes {sys.executable} -c" in calls[5]  # SIGTERM reaches it
  # Second call: the VM exists, so it is reused; steps switched off are skipped.
  result = _run(run, env={**env, "COPY": "0", "INSTALL": "0"})
  assert result.returncode == 0, result.stderr
  assert "reusing TPU VM pod (v5p-16 READY)" in result.stderr
  assert [c.split()[3] for c in log.read_text().splitlines()[6:]] == ["describe", "describe", "ssh"]


def test_tpu_pod_requires_its_variables_and_a_safe_remote_dir():
  result = _run([os.path.join(_LAUNCH, "tpu_pod.sh"), "--", "true"], env={"TPU_NAME": "", "ZONE": "z"})
  assert result.returncode != 0 and "set TPU_NAME" in result.stderr
  result = _run([os.path.join(_LAUNCH, "tpu_pod.sh"), "--", "true"],
                env={"TPU_NAME": "pod", "ZONE": "z", "REMOTE_DIR": "/"})
  assert result.returncode == 2 and "REMOTE_DIR='/' would be deleted" in result.stderr
