"""Hugging Face exports of a run's policy: DIR/hf at the end of every run, and any kept checkpoint on demand.

    python -m jaxrlvr.export --workdir=DIR [--step=N] [--out=PATH] [--dtype=bfloat16]

An export is a directory that `transformers.AutoModelForCausalLM` and `AutoTokenizer` load with `from_pretrained`:
config.json and safetensors (`models.save_pretrained`), the run's tokenizer (its chat template included, when it has
one), and a generation_config.json whose eos ids are the ones the sampler stopped at, so `generate` stops there too.
It is also a `config.model.path` (and `config.tokenizer.path`) for a next run, e.g. ExpRL's stage II
(configs/exprl.py).

The embedded tokenizer is the exception to `AutoTokenizer`: transformers 5 loads the tokenizer class registered for
the config's model_type (Qwen2Tokenizer for the tiny qwen2 preset) whatever tokenizer_config.json declares, and a
Qwen2Tokenizer rebuilt from the character vocabulary drops spaces. Load it as the class it declares,
`transformers.PreTrainedTokenizerFast.from_pretrained(DIR/hf)`; jaxrlvr's own `data.load_tokenizer` does that, so a
run started from an export (`config.model.path=DIR/hf`, which also supplies the tokenizer) reads it right. A real
model's tokenizer loads with `AutoTokenizer` as it did from the model's own directory: the export has the same
model_type and the same tokenizer files.

The CLI reads DIR/config.json, rebuilds the model config and tokenizer from it, restores the parameters of checkpoint
N (default: the latest) and writes them to --out (default: DIR/hf for the latest step, DIR/hf-N for another). Every
export is written into a temporary directory beside its target and renamed into place when complete, so an earlier
export is replaced only by a whole one.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

from jaxrlvr import config_lib
from jaxrlvr import data as data_lib
from jaxrlvr import faults
from jaxrlvr import models
from jaxrlvr import multihost
from jaxrlvr import parallel
from jaxrlvr import run_setup

FINAL_DIR = "hf"  # DIR/hf: the policy at the end of the run


class ExportError(config_lib.ConfigError):
  """A bad --workdir, --step, --out or --dtype, or a run directory the export cannot rebuild: one line, no traceback
  (here and, for the export at the end of a run, in main)."""


def export_hf(model: models.Transformer, model_config: models.ModelConfig, tokenizer, out_dir: str, *,
              dtype=None) -> str:
  """Writes `model` (and `tokenizer`) to `out_dir` as a transformers directory; returns `out_dir`.

  Every process must call this: parameters spanning several processes are gathered one tensor at a time, and a
  gather is collective. Process 0 alone writes, into a temporary directory beside `out_dir` that replaces it once
  complete; the others wait for it, so every process returns with the export in place. `dtype` casts on save
  (default: the parameter dtype).
  """
  from transformers import GenerationConfig  # pylint: disable=g-import-not-at-top  (the tokenizer loaded it)

  out_dir = os.path.abspath(out_dir)
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):  # every process stops, before any collective
    raise ExportError(f"export to {out_dir}: it exists and is not a directory; move it or choose another --out")
  staging, refused = None, None
  try:
    if multihost.is_main():
      os.makedirs(os.path.dirname(out_dir), exist_ok=True)
      staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}-", dir=os.path.dirname(out_dir))
      os.chmod(staging, 0o777 & ~_umask())  # mkdtemp's 0700 would keep the export from other users
    # The other processes write nothing; the path they pass is never opened.
    models.save_pretrained(model, model_config, staging or out_dir, dtype=dtype)
    if staging:
      tokenizer.save_pretrained(staging)
      bos = tokenizer.bos_token_id
      GenerationConfig(eos_token_id=data_lib.stop_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       **({} if bos is None else {"bos_token_id": bos})).save_pretrained(staging)
      _replace_dir(staging, out_dir)
  except OSError as e:  # the disk is full, a file too large, a directory read-only: process 0's, said once below
    refused = faults.error_reason(e)
  finally:
    if staging:
      shutil.rmtree(staging, ignore_errors=True)  # gone already after a successful swap
  # Every process learns whether process 0 wrote it, so none waits at the barrier for a writer that stopped.
  if multihost.broadcast_flag(refused is not None):
    raise ExportError(f"cannot write the export {out_dir} ({refused or 'process 0 could not write it'}); an earlier "
                      "export there, if any, is unchanged")
  multihost.barrier(f"export {out_dir}")
  logging.info("exported the policy (%s) to %s", model_config.model_type, out_dir)
  return out_dir


def run_dtype(config: ml_collections.ConfigDict) -> str | None:
  """The dtype a run's exports are written in unless told otherwise: that of the checkpoint it started from
  (`model.path`'s config.json says it, e.g. bfloat16 for the released Qwen and Llama weights), so that DIR/hf of a
  7B run trained with float32 master weights is the 15 GB of its source and not 30; None (the parameter dtype) for
  a run from a preset or a checkpoint that does not say."""
  path = os.path.join(config.model.path, "config.json") if config.model.path else ""
  if not path or not os.path.isfile(path):
    return None
  return models.checkpoint_dtype(models.read_config(config.model.path))


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def _replace_dir(staging: str, out_dir: str) -> None:
  """Moves the complete `staging` to `out_dir`. A directory cannot be renamed over a non-empty one, so an earlier
  export first moves aside; only between the two renames (no writing in between) is there no `out_dir`."""
  if not os.path.exists(out_dir):
    os.rename(staging, out_dir)
    return
  old = staging + "-old"  # unique: staging is a fresh mkdtemp name
  os.rename(out_dir, old)
  os.rename(staging, out_dir)
  shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------------
# Exports of kept checkpoints
# ----------------------------------------------------------------------------------------------------------------------


def read_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The config the run in `workdir` wrote (config.json)."""
  if not os.path.isdir(workdir):
    raise ExportError(f"--workdir={workdir}: no such directory")
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise ExportError(f"--workdir={workdir} has no config.json: not a run directory of python -m jaxrlvr.main")
  with open(path, encoding="utf-8") as f:
    return ml_collections.ConfigDict(json.load(f))


def kept_steps(workdir: str) -> list[int]:
  """The steps of the complete checkpoints under WORKDIR/checkpoints (orbax skips half-written ones)."""
  manager = _manager(workdir)
  try:
    return sorted(manager.all_steps())
  finally:
    manager.close()


def _manager(workdir: str) -> ocp.CheckpointManager:
  # Orbax directly rather than checkpointing.Checkpointer: only the parameters are read, so an export needs neither
  # the writer's process count (the host state is per process) nor its optimizer.
  return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")),
                               options=ocp.CheckpointManagerOptions(create=False))


def model_config_from_run(config: ml_collections.ConfigDict) -> models.ModelConfig:
  """The policy's ModelConfig as the run built it (run_setup.model_config): the HF directory's config.json, or the
  preset."""
  try:
    return run_setup.model_config(config)
  except FileNotFoundError:
    raise ExportError(f"config.model.path={config.model.path!r} (the run's config.json) has no config.json any "
                      "more; the export takes the architecture from it") from None


def restore_policy(workdir: str, step: int, model_config: models.ModelConfig,
                   mesh: jax.sharding.Mesh) -> models.Transformer:
  """The policy of checkpoint `step`, its parameters restored sharded on `mesh` (the optimizer state is not read)."""
  abstract = nnx.eval_shape(lambda: models.Transformer(model_config, rngs=nnx.Rngs(0)))
  graphdef, abstract_params = nnx.split(abstract)  # the structure train.py checkpoints as state.params
  shardings = parallel.param_shardings(abstract_params, mesh)
  target = {"state": {"params": jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_params, shardings)}}
  manager = _manager(workdir)
  try:
    restored = manager.restore(step, args=ocp.args.Composite(train=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True)))
  finally:
    manager.close()
  return nnx.merge(graphdef, restored.train["state"]["params"])


def export_checkpoint(workdir: str, step: int | None = None, out: str | None = None, dtype=None) -> tuple[int, str]:
  """Exports checkpoint `step` (None: the latest) of the run in `workdir`; returns (step, export directory).

  Default `out`: DIR/hf for the latest step, DIR/hf-N for another; default `dtype`: `run_dtype`. Every process must
  call this.
  """
  config = read_run_config(workdir)
  steps = kept_steps(workdir)
  if not steps:
    raise ExportError(f"--workdir={workdir} has no checkpoint yet ({os.path.join(workdir, 'checkpoints')} holds none)")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise ExportError(f"--step={step}: no checkpoint {step} in {os.path.join(workdir, 'checkpoints')}; kept steps: "
                      f"{', '.join(map(str, steps))}")
  if out is None:
    out = os.path.join(workdir, FINAL_DIR if step == steps[-1] else f"{FINAL_DIR}-{step}")
  try:
    tokenizer = data_lib.tokenizer_from_config(config)
  except data_lib.DataError as e:
    raise ExportError(f"the run's tokenizer (config.json of {workdir}): {e}") from e
  model_config = model_config_from_run(config)
  mesh = parallel.make_mesh(data=1, fsdp=-1, tensor=1)  # any device count: the rules replicate what does not divide
  model = restore_policy(workdir, step, model_config, mesh)
  return step, export_hf(model, model_config, tokenizer, out, dtype=run_dtype(config) if dtype is None else dtype)


def export_if_missing(workdir: str, step: int) -> None:
  """A finished run started again: writes DIR/hf from checkpoint `step` when it is not there (a run stopped between
  its last checkpoint and its export, or one from before exports); an existing export is left alone."""
  if multihost.broadcast_flag(os.path.isdir(os.path.join(workdir, FINAL_DIR))):
    return
  _, out = export_checkpoint(workdir, step, os.path.join(workdir, FINAL_DIR))
  if multihost.is_main():
    print(f"jaxrlvr: {out} was missing; exported checkpoint {step} there.")


def _dtype(name: str):
  if not name:
    return None
  try:
    return jnp.dtype(name)
  except TypeError as e:
    raise ExportError(f"--dtype={name}: not a dtype; e.g. float32 or bfloat16") from e


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxrlvr.export", description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="the run directory (python -m jaxrlvr.main --workdir)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: the latest)")
  parser.add_argument("--out", default=None, help="export directory (default: WORKDIR/hf, or WORKDIR/hf-STEP for a "
                                                  "step other than the latest)")
  parser.add_argument("--dtype", default="", help="cast the weights on save, e.g. float32 (default: the dtype of the "
                      "checkpoint the run started from, else as trained)")
  args = parser.parse_args(argv)
  try:
    step, out = export_checkpoint(args.workdir, args.step, args.out, _dtype(args.dtype))
  except ExportError as e:
    print(f"jaxrlvr.export: {e}", file=sys.stderr)
    return 2
  print(f"jaxrlvr.export: checkpoint {step} of {args.workdir} -> {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
