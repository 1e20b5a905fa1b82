#!/usr/bin/env bash
# Runs N copies of a command as the N processes of one JAX job on this machine (CPU), the way a pod would run them.
#
#   launch/local.sh N [--port PORT] -- python -m jaxrlvr.main --config=configs/exgrpo.py:smoke --workdir=/tmp/run
#
# Process i gets, besides the caller's environment:
#   JAXRLVR_COORDINATOR=127.0.0.1:PORT   where process 0 serves jax.distributed's coordination service
#   JAXRLVR_NUM_PROCESSES=N
#   JAXRLVR_PROCESS_ID=i                 0 .. N-1
#   JAX_PLATFORMS=cpu                    (unless already set)
# jaxrlvr.main passes these to jax.distributed.initialize. PORT defaults to $JAXRLVR_PORT, else a free port.
#
# Each output line (stdout and stderr) is prefixed with "[i] ". The script waits for all processes and exits with
# the first non-zero status; when one process fails the others are stopped (SIGTERM, then SIGKILL after 10 s),
# since their collectives would otherwise wait for it forever. Ctrl-C stops them all.
set -uo pipefail

usage() {
  echo "usage: $0 N [--port PORT] -- command [args...]" >&2
  exit 2
}

[[ $# -ge 1 ]] || usage
num="$1"
shift
[[ "$num" =~ ^[1-9][0-9]*$ ]] || { echo "local.sh: N must be a positive integer, got '$num'" >&2; exit 2; }
port="${JAXRLVR_PORT:-}"
while [[ $# -gt 0 && "$1" != "--" ]]; do
  case "$1" in
    --port) [[ $# -ge 2 ]] || usage; port="$2"; shift 2 ;;
    *) echo "local.sh: unknown option '$1' (the command goes after --)" >&2; usage ;;
  esac
done
[[ $# -ge 2 && "$1" == "--" ]] || usage
shift
if [[ -z "$port" ]]; then
  port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
fi
[[ "$port" =~ ^[0-9]+$ ]] || { echo "local.sh: port must be a number, got '$port'" >&2; exit 2; }

# Job control: each command starts as the leader of its own process group, so stopping the group also stops what
# it started (reward workers). Its output goes through a FIFO to an awk that prefixes the lines. The awks are jobs
# of this script, so the final `wait` lets them print every last line (with `> >(awk ...)` the script could exit
# first, and a loaded machine lost lines); $! of each command is the command itself.
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
# mawk (Debian's default awk) reads its input in blocks: without -W interactive the prefixed lines would appear only
# when a buffer fills or the process ends, and be lost if it hangs. -W interactive also makes its stdout unbuffered,
# and there `print` writes a line's text and its newline in two writes, which the other prefixers' lines can land
# between; so each line goes out as one string through printf, in one write (tests/test_launch.py checks it).
prefixer=(awk)
if awk -W version 2>&1 | head -n 1 | grep -qi mawk; then
  prefixer=(awk -W interactive)
fi
fifos="$(mktemp -d "${TMPDIR:-/tmp}/local.sh.XXXXXX")" || exit 1
trap 'rm -rf "$fifos"' EXIT
set -m
pids=()
for ((i = 0; i < num; i++)); do
  mkfifo "$fifos/$i" || exit 1
  "${prefixer[@]}" -v prefix="[$i] " '{ printf "%s", prefix $0 "\n"; fflush() }' < "$fifos/$i" &
  JAXRLVR_COORDINATOR="127.0.0.1:${port}" JAXRLVR_NUM_PROCESSES="$num" JAXRLVR_PROCESS_ID="$i" \
    "$@" < /dev/null > "$fifos/$i" 2>&1 &
  pids+=("$!")
done
set +m
# From here on the script's own stderr is fd 3: bash's job reports ("Terminated ...") go to /dev/null, the children
# (started above) keep the real stderr.
exec 3>&2 2>/dev/null

stop_all() {  # $1: signal
  local pid
  for pid in "${pids[@]}"; do
    kill -"$1" -- "-$pid" 2>/dev/null
  done
}

on_signal() {  # $1: the signal received; exit 128 + its number, as a shell would
  echo "local.sh: got SIG$1; stopping ${num} processes" >&3
  stop_all TERM
  # A process blocked in a collective may not act on SIGTERM: SIGKILL whatever is left after 10 s.
  local waited=0 pid alive
  while [[ $waited -lt 50 ]]; do
    alive=""
    for pid in "${pids[@]}"; do
      kill -0 "$pid" 2>/dev/null && alive=1
    done
    [[ -z "$alive" ]] && break
    sleep 0.2
    waited=$((waited + 1))
  done
  [[ -n "$alive" ]] && stop_all KILL
  wait
  [[ "$1" == INT ]] && exit 130
  exit 143
}
trap 'on_signal INT' INT
trap 'on_signal TERM' TERM

# Poll instead of `wait -n` so that the bash 3.2 of macOS works too. After a failure the others get SIGTERM at once
# and again a second later (a child caught between fork and exec can miss the first), then SIGKILL after 10 s.
status=0
remaining=$num
stop_at=""
resent=""
killed=""
declare -a done_flags
while [[ $remaining -gt 0 ]]; do
  for ((i = 0; i < num; i++)); do
    [[ -n "${done_flags[$i]:-}" ]] && continue
    if ! kill -0 "${pids[$i]}" 2>/dev/null; then
      wait "${pids[$i]}"
      rc=$?
      done_flags[$i]=1
      remaining=$((remaining - 1))
      if [[ $rc -ne 0 && $status -eq 0 ]]; then
        status=$rc
        echo "local.sh: process $i exited with status $rc; stopping the others" >&3
        stop_all TERM
        stop_at=$SECONDS
      fi
    fi
  done
  if [[ -n "$stop_at" && $remaining -gt 0 ]]; then
    if [[ -z "$resent" && $((SECONDS - stop_at)) -ge 1 ]]; then
      stop_all TERM
      resent=1
    elif [[ -z "$killed" && $((SECONDS - stop_at)) -ge 10 ]]; then
      echo "local.sh: $remaining process(es) ignored SIGTERM for 10 s; sending SIGKILL" >&3
      stop_all KILL
      killed=1
    fi
  fi
  [[ $remaining -gt 0 ]] && sleep 0.2
done
wait  # the prefixing awks: let them print the last lines
exit "$status"
