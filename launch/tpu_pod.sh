#!/usr/bin/env bash
# jaxrlvr on a Cloud TPU VM slice (v5p, v5e, v4, ...): create or reuse the TPU VM, copy this repository to every
# worker, install it, and run the same command on every worker. JAX on a TPU VM finds its peers by itself, so
# jaxrlvr.main's jax.distributed.initialize() needs no addresses there.
#
#   TPU_NAME=exgrpo ZONE=us-east5-a ACCELERATOR_TYPE=v5p-16 launch/tpu_pod.sh -- \
#       python -m jaxrlvr.main --config=configs/exgrpo.py:model=qwen2.5-math-7b --workdir=gs://BUCKET/runs/exgrpo \
#       --config.model.path=/mnt/ckpt/Qwen2.5-Math-7B --config.data.source=parquet:/mnt/data/openr1.parquet
#
#   launch/tpu_pod.sh --delete      deletes the TPU VM (asks gcloud to confirm unless QUIET=1)
#
# Steps, each skipped when its switch is 0:
#   CREATE   (1) `gcloud compute tpus tpu-vm describe`; if the VM does not exist, `... tpu-vm create` it
#   COPY     (1) tar this repository's working tree (without .git and ignored build folders) and copy it to
#                $REMOTE_DIR on every worker (`tpu-vm scp --worker=all`), replacing what was there
#   INSTALL  (1) on every worker: pip install "$JAX_PACKAGE" and `pip install -e $REMOTE_DIR[tfds]`
#   RUN      (1) on every worker, in $REMOTE_DIR: the command after `--` (`tpu-vm ssh --worker=all`); the output of
#                all workers streams back here, and the script exits non-zero if any worker fails. The command is
#                exec'd, so a preemption's SIGTERM reaches the run, which saves and exits 0; run the script again
#                (CREATE=1 makes a new Spot VM) with the same command, and with a --workdir that outlived the VM
#                (gs://...), to resume.
#
# Variables:
#   TPU_NAME          name of the TPU VM (required)
#   ZONE              zone, e.g. us-east5-a for v5p, us-west4-a for v5e (required)
#   PROJECT           GCP project (default: gcloud's configured project)
#   ACCELERATOR_TYPE  slice type when creating (default v5p-16: 8 v5p chips on 2 hosts; v5e: v5litepod-16)
#   RUNTIME_VERSION   TPU VM image when creating (default: v2-alpha-tpuv5 for v5p, v2-alpha-tpuv5-lite for v5e,
#                     tpu-ubuntu2204-base otherwise)
#   SPOT              1: create a Spot VM (cheaper, can be preempted); default 0
#   CREATE_ARGS       extra arguments for `tpu-vm create` (e.g. "--network=my-net --reserved")
#   REMOTE_DIR        where the repository goes on each worker (default: jaxrlvr, i.e. ~/jaxrlvr)
#   JAX_PACKAGE       the JAX the workers install (default: "jax[tpu]")
#   PIP               the pip the workers run (default: "python3 -m pip")
#   ENV_VARS          environment set for the command on every worker, e.g. "HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=0"
#   GCLOUD            the gcloud binary (default: gcloud)
#   QUIET             1: pass --quiet to gcloud (no prompts); default 0
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GCLOUD="${GCLOUD:-gcloud}"
: "${TPU_NAME:?tpu_pod.sh: set TPU_NAME (the TPU VM to create or reuse)}"
: "${ZONE:?tpu_pod.sh: set ZONE (e.g. us-east5-a)}"
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v5p-16}"
case "$ACCELERATOR_TYPE" in
  v5p-*) default_runtime=v2-alpha-tpuv5 ;;
  v5litepod-* | v5e-*) default_runtime=v2-alpha-tpuv5-lite ;;
  *) default_runtime=tpu-ubuntu2204-base ;;
esac
RUNTIME_VERSION="${RUNTIME_VERSION:-$default_runtime}"
REMOTE_DIR="${REMOTE_DIR:-jaxrlvr}"
JAX_PACKAGE="${JAX_PACKAGE:-jax[tpu]}"
PIP="${PIP:-python3 -m pip}"
ENV_VARS="${ENV_VARS:-}"
CREATE="${CREATE:-1}" COPY="${COPY:-1}" INSTALL="${INSTALL:-1}" RUN="${RUN:-1}"
case "$REMOTE_DIR" in  # COPY starts with `rm -rf $REMOTE_DIR` on every worker
  "" | "/" | "." | "~" | "~/" | *..*)
    echo "tpu_pod.sh: REMOTE_DIR='$REMOTE_DIR' would be deleted and replaced; use a directory of its own" >&2
    exit 2 ;;
esac

common=(--zone="$ZONE")
[[ -n "${PROJECT:-}" ]] && common+=(--project="$PROJECT")
[[ "${QUIET:-0}" == 1 ]] && common+=(--quiet)

log() { echo "tpu_pod.sh: $*" >&2; }

on_all_workers() {  # $1: a shell command line run on every worker
  "$GCLOUD" compute tpus tpu-vm ssh "$TPU_NAME" "${common[@]}" --worker=all --command="$1"
}

if [[ "${1:-}" == "--delete" ]]; then
  log "deleting TPU VM $TPU_NAME in $ZONE"
  exec "$GCLOUD" compute tpus tpu-vm delete "$TPU_NAME" "${common[@]}"
fi
if [[ "${1:-}" != "--" || $# -lt 2 ]]; then
  [[ "$RUN" == 1 ]] && { echo "usage: $0 -- command [args...]   (or: $0 --delete)" >&2; exit 2; }
fi
[[ "${1:-}" == "--" ]] && shift

if [[ "$CREATE" == 1 ]]; then
  if "$GCLOUD" compute tpus tpu-vm describe "$TPU_NAME" "${common[@]}" --format="value(state)" > /dev/null 2>&1; then
    log "reusing TPU VM $TPU_NAME ($("$GCLOUD" compute tpus tpu-vm describe "$TPU_NAME" "${common[@]}" \
        --format="value(acceleratorType,state)" | tr '\t' ' '))"
  else
    log "creating TPU VM $TPU_NAME: $ACCELERATOR_TYPE, runtime $RUNTIME_VERSION, zone $ZONE"
    create=("$GCLOUD" compute tpus tpu-vm create "$TPU_NAME" "${common[@]}" --accelerator-type="$ACCELERATOR_TYPE"
            --version="$RUNTIME_VERSION")
    [[ "${SPOT:-0}" == 1 ]] && create+=(--spot)
    # shellcheck disable=SC2206
    [[ -n "${CREATE_ARGS:-}" ]] && create+=(${CREATE_ARGS})
    "${create[@]}"
  fi
fi

if [[ "$COPY" == 1 ]]; then
  tmp_dir="$(mktemp -d)"
  trap 'rm -rf "$tmp_dir"' EXIT
  archive="$tmp_dir/jaxrlvr.tar.gz"
  # The working tree as the user sees it (uncommitted edits included): in a git checkout the tracked and untracked
  # files that .gitignore does not exclude, else everything but git metadata and build output.
  if git -C "$repo_root" rev-parse --is-inside-work-tree > /dev/null 2>&1; then
    (cd "$repo_root" && git ls-files -z --cached --others --exclude-standard \
      | while IFS= read -r -d '' f; do [[ -e "$f" ]] && printf '%s\0' "$f"; done \
      | tar -czf "$archive" --null -T -)
  else
    tar -czf "$archive" -C "$repo_root" --exclude=.git --exclude=__pycache__ --exclude='*.egg-info' .
  fi
  log "copying $(du -h "$archive" | cut -f1) of $repo_root to ~/$REMOTE_DIR on every worker"
  "$GCLOUD" compute tpus tpu-vm scp "$archive" "$TPU_NAME":jaxrlvr.tar.gz "${common[@]}" --worker=all
  remote="$(printf %q "$REMOTE_DIR")"
  on_all_workers "rm -rf $remote && mkdir -p $remote && tar -xzf jaxrlvr.tar.gz -C $remote && rm jaxrlvr.tar.gz"
fi

if [[ "$INSTALL" == 1 ]]; then
  log "installing $JAX_PACKAGE and the package on every worker"
  on_all_workers "$PIP install -q -U $(printf %q "$JAX_PACKAGE") && cd $(printf %q "$REMOTE_DIR") && \
$PIP install -q -e '.[tfds]'"
fi

if [[ "$RUN" == 1 ]]; then
  command_line="$(printf '%q ' "$@")"
  log "running on every worker: $command_line"
  # exec: the run is the session's process, so the SIGTERM of a Spot VM's preemption (or of `ssh` hanging up: SIGHUP
  # stays fatal) reaches python, which saves the step in flight; the same command resumes on a new VM.
  on_all_workers "cd $(printf %q "$REMOTE_DIR") && exec ${ENV_VARS:+env $ENV_VARS }$command_line"
fi
