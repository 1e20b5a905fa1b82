"""Worker processes of the benchmarks that run a peer library beside jaxrlvr (peer_grpo.py, sampler.py,
sampler_long_tail.py): when one dies, the harness says which, with its exit status and the likely cause, and exits
non-zero with that one line instead of a BrokenPipeError or EOFError traceback (or waiting forever). main_command.py
states its commands' exit status the same way.

    conn, process = workers.start(context, target, args)   # multiprocessing: the parent keeps only its own end
    reply = workers.ask(conn, process, "transformers worker", message)
    workers.stop(conn, process)

    @workers.one_line_on_death("sampler")
    def main(): ...
"""
import contextlib
import functools
import os
import signal
import sys

# What a signal that ends a worker usually means here: a benchmark's peer sits at the machine's memory limit.
_CAUSES = {
    signal.SIGKILL: "usually the kernel's out-of-memory killer (`dmesg | grep -i oom` says so; try a smaller "
                    "workload or fewer threads), or a `kill -9`",
    signal.SIGSEGV: "a crash in native code (a library's C++ or CUDA)",
    signal.SIGABRT: "an abort in native code (a library's failed check; its log has the reason)",
    signal.SIGBUS: "a crash in native code, or a full /dev/shm",
    signal.SIGTERM: "stopped from outside (a job scheduler, a timeout or a `kill`)",
    signal.SIGINT: "Ctrl-C",
}


class WorkerDied(Exception):
  """A worker process ended before it answered; the message names it, its exit status and the likely cause."""


# Signals sent from outside the worker: its log ends wherever it was, so its last line says nothing of the cause.
_FROM_OUTSIDE = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)


def _signal(returncode: int | None) -> int | None:
  """The signal that ended a process, from `Popen.returncode` or `Process.exitcode` (minus the signal's number;
  128 + the number when a shell reports it), or None."""
  if returncode is None or returncode in range(0, 129):
    return None
  number = -returncode if returncode < 0 else returncode - 128
  return number if number in signal.valid_signals() else None


def exit_status(returncode: int | None) -> str:
  """How a process ended, in words, from its `Popen.returncode` or `Process.exitcode`."""
  if returncode is None:
    return "closed its output but is still running"
  number = _signal(returncode)
  if number is None:
    return f"exited with status {returncode}"
  name = signal.Signals(number).name
  how = (f"was killed by signal {number} ({name})" if returncode < 0 else
         f"exited with status {returncode} (128 + signal {number}, {name})")
  cause = _CAUSES.get(number)
  return f"{how}: {cause}" if cause else how


def _last_line(log_path: str) -> str:
  """The last non-empty line of a worker's log (a traceback's last line names the exception), or ''."""
  try:
    with open(log_path, "rb") as f:
      f.seek(max(0, os.path.getsize(log_path) - 4096))
      lines = [line.strip() for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
  except OSError:
    return ""
  return lines[-1][:300] if lines else ""


def died(name: str, returncode: int | None, log_path: str | None = None) -> WorkerDied:
  """The error for worker `name` that stopped answering: its exit status, the likely cause, and its log."""
  message = f"the {name} {exit_status(returncode)}"
  if log_path:
    last = "" if _signal(returncode) in _FROM_OUTSIDE else _last_line(log_path)
    message += f"; its log: {log_path}" + (f" (last line: {last})" if last else "")
  return WorkerDied(message)


def one_line_on_death(program: str):
  """Decorates a harness's main: a WorkerDied becomes one line, `PROGRAM: error: ...`, and exit status 1."""
  def decorate(main):
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
      try:
        return main(*args, **kwargs)
      except WorkerDied as e:
        sys.stdout.flush()
        print(f"{program}: error: {e}", file=sys.stderr)
        sys.exit(1)
    return wrapper
  return decorate


# ----------------------------------------------------------------------------------- multiprocessing workers


def start(context, target, args: tuple):
  """Starts `target(child_conn, *args)` in a process of `context`; returns (conn, process). The parent closes its
  copy of the child's end, so that `conn.recv()` sees the end of the pipe when the child dies instead of waiting."""
  conn, child_conn = context.Pipe()
  process = context.Process(target=target, args=(child_conn, *args))
  process.start()
  child_conn.close()
  return conn, process


_NOTHING = object()


def ask(conn, process, name: str, message=_NOTHING):
  """Sends `message` (when given) and returns the worker's reply; raises WorkerDied when it has died."""
  try:
    if message is not _NOTHING:
      conn.send(message)
    return conn.recv()
  except (EOFError, BrokenPipeError, ConnectionResetError):
    process.join(timeout=30)
    raise died(name, process.exitcode) from None


def stop(conn, process, *, timeout_s: float = 60) -> None:
  """Tells the worker to finish (None), whether or not it is still there, and waits for it."""
  with contextlib.suppress(OSError):  # BrokenPipeError: it has died already
    conn.send(None)
  process.join(timeout=timeout_s)
  if process.is_alive():
    process.kill()
    process.join()
  conn.close()
