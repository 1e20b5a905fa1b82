"""The main job: `python -m jaxrlvr.main --config=configs/exgrpo.py --workdir=DIR`.

Run from the repository root (the config files import `configs.base`). Structural choices go through the config arg
(`--config=configs/exgrpo.py:model=qwen2.5-math-7b,smoke`), scalars through `--config.optim.lr=1e-6`.
"""
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/exgrpo.py[:arg].",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics.jsonl and TensorBoard events go.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", "", "Multi-process: host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 0, "Multi-process: how many processes in all.")
_PROCESS_ID = flags.DEFINE_integer("process_id", -1, "Multi-process: this process's index.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from jaxrlvr import parallel  # pylint: disable=g-import-not-at-top  (flags parse before jax initialises)
  from jaxrlvr import train  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.INFO)
  parallel.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  train.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
