"""GGUF files into Hugging Face checkpoint directories that `models.load_pretrained` and transformers load.

    python -m jaxrlvr.models.convert --gguf=FILE --out=DIR

transformers reads the GGUF (`from_pretrained(dir, gguf_file=...)`, which needs the `gguf` and `accelerate` packages
and torch) and de-quantizes every tensor to float32. The model it returns carries the file's `quantization_config`,
which its own `save_pretrained` refuses, so a plain model is rebuilt from the config without it (on torch's meta
device: no random initialisation of weights that are replaced at once) and takes over the de-quantized tensors. The
directory gets config.json and model.safetensors (float32), the GGUF's tokenizer with its chat template, and a
generation_config.json whose eos ids are the ones our sampler stops at (`data.templates.stop_token_ids`: eos and the
chat format's end-of-turn token), as the run's export (`jaxrlvr/export.py`) writes them.

Only architectures our decoder implements convert (`GGUF_ARCHITECTURES`); any other stops, before anything heavy is
read, with the file and the architecture. The directory is written beside its target and renamed into place, so a
conversion that dies half-way leaves nothing a later run could take for a checkpoint.
"""
import argparse
import contextlib
import functools
import os
import shutil
import sys
import tempfile

from jaxrlvr import config_lib
from jaxrlvr import data as data_lib
from jaxrlvr.models import hf as hf_lib
from jaxrlvr.models.config import MODEL_TYPES

# GGUF `general.architecture` -> our model_type (llama.cpp's names for these three are HF's). transformers maps a
# "llama" file whose name says mistral to its mistral class; config_from_hf refuses that one after loading.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
assert set(GGUF_ARCHITECTURES.values()) <= set(MODEL_TYPES)
_NEEDED = "pip install gguf accelerate torch"


class ConvertError(config_lib.ConfigError):
  """A GGUF file that cannot be converted (missing, unreadable, unsupported) or an --out that cannot be written: one
  line, no traceback (here, and in main when a preset's weights are converted at the start of a run)."""


def gguf_architecture(gguf_file: str) -> str:
  """The `general.architecture` of a GGUF file (only its header is parsed; the tensors are memory-mapped)."""
  if not os.path.isfile(gguf_file):
    raise ConvertError(f"--gguf={gguf_file}: no such file")
  try:
    import gguf  # pylint: disable=g-import-not-at-top  (an optional dependency, for GGUF files only)
  except ImportError as e:
    raise ConvertError(f"--gguf={gguf_file}: reading GGUF files needs the gguf package ({_NEEDED})") from e
  try:
    field = gguf.GGUFReader(gguf_file).fields.get("general.architecture")
  except (ValueError, OSError) as e:  # not a GGUF file (bad magic), or a truncated one
    raise ConvertError(f"--gguf={gguf_file}: not a readable GGUF file ({e})") from e
  if field is None:
    raise ConvertError(f"--gguf={gguf_file}: the file has no general.architecture key")
  return str(field.contents())


def check_architecture(gguf_file: str) -> str:
  """Our model_type for the file's architecture; an unsupported one stops with the file and the supported ones."""
  architecture = gguf_architecture(gguf_file)
  if architecture not in GGUF_ARCHITECTURES:
    raise ConvertError(f"--gguf={gguf_file}: GGUF architecture {architecture!r} is not supported; supported: "
                       f"{', '.join(sorted(GGUF_ARCHITECTURES))}")
  return GGUF_ARCHITECTURES[architecture]


@contextlib.contextmanager
def _each_file_parsed_once():
  """Within it, `gguf.GGUFReader(path)` parses a file once and then hands out the same (read-only) reader, and
  `gguf.get_tensor_name_map` builds each map once. transformers parses a GGUF again for the config, the tokenizer and
  the weights (with the architecture check, four parses of SmolLM2's 49,152-token vocabulary and merges), and
  builds the tensor name map again for every module (397 times): SmolLM2-135M's conversion took 21.0 CPU-s, 8.7
  with both kept (transformers 5.24, gguf 0.19, 2 cores; tests/test_smollm2.py converts the real file). transformers
  imports both names from `gguf` when it calls them, so replacing the module's attributes reaches it; they are
  restored on exit. Without the gguf package it changes nothing (`check_architecture` names what to install)."""
  try:
    import gguf  # pylint: disable=g-import-not-at-top  (an optional dependency, for GGUF files only)
  except ImportError:
    yield
    return
  real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
  readers = {}

  def reader(path, *args, **kwargs):
    key = (os.path.abspath(os.fspath(path)), args, tuple(sorted(kwargs.items())))
    if key not in readers:
      readers[key] = real_reader(path, *args, **kwargs)
    return readers[key]

  gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_name_map)
  try:
    yield
  finally:
    gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map


def convert_gguf(gguf_file: str, out_dir: str) -> str:
  """Converts `gguf_file` into the Hugging Face directory `out_dir` (which must not exist yet); returns it."""
  gguf_file, out_dir = os.path.abspath(gguf_file), os.path.abspath(out_dir)
  with _each_file_parsed_once():
    check_architecture(gguf_file)
    return _convert(gguf_file, out_dir)


def _convert(gguf_file: str, out_dir: str) -> str:
  if os.path.exists(out_dir):
    raise ConvertError(f"--out={out_dir}: it exists already; remove it or choose another --out")
  try:
    import torch  # pylint: disable=g-import-not-at-top  (transformers de-quantizes GGUF tensors in torch)
    import transformers  # pylint: disable=g-import-not-at-top
    import accelerate  # pylint: disable=g-import-not-at-top,unused-import  (transformers' GGUF loading needs it)
  except ImportError as e:
    raise ConvertError(f"--gguf={gguf_file}: converting GGUF files needs {e.name} ({_NEEDED})") from e
  folder, name = os.path.split(gguf_file)
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
  config = loaded.config
  del config.quantization_config  # save_pretrained refuses a model that says it is quantized
  config_dict = config.to_dict()
  # Options our decoder does not implement stop here, naming the file, rather than when a run loads the directory.
  try:
    hf_lib.config_from_hf(config_dict, source=gguf_file)
  except ValueError as e:
    raise ConvertError(f"--gguf={gguf_file}: {e}") from e
  with torch.device("meta"):
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  plain.load_state_dict(loaded.state_dict(), assign=True)
  plain.tie_weights()  # assign=True replaced the tied parameters one by one: tie lm_head to the embedding again
  del loaded

  parent = os.path.dirname(out_dir)
  try:
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}-", dir=parent)
  except OSError as e:
    raise ConvertError(f"--out={out_dir}: cannot write in {parent} ({e.strerror})") from e
  try:
    plain.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    bos = tokenizer.bos_token_id
    transformers.GenerationConfig(
        eos_token_id=data_lib.stop_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id,
        **({} if bos is None else {"bos_token_id": bos})).save_pretrained(staging)
    # mkdtemp's 0700 (and the 0600 the weights are written with) would keep the directory from other users.
    os.chmod(staging, 0o777 & ~_umask())
    for entry in os.listdir(staging):
      os.chmod(os.path.join(staging, entry), 0o666 & ~_umask())
    try:
      os.rename(staging, out_dir)
    except OSError as e:  # e.g. another process finished a conversion into the same place first (the caller checks)
      raise ConvertError(f"--out={out_dir}: cannot move the finished conversion into place ({e.strerror})") from e
  finally:
    shutil.rmtree(staging, ignore_errors=True)  # gone already after the rename
  return out_dir


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxrlvr.models.convert", description=__doc__.split("\n")[0])
  parser.add_argument("--gguf", required=True, help="the GGUF file (architectures: "
                                                    f"{', '.join(sorted(GGUF_ARCHITECTURES))})")
  parser.add_argument("--out", required=True, help="the Hugging Face directory to write (must not exist)")
  args = parser.parse_args(argv)
  try:
    out = convert_gguf(args.gguf, args.out)
  except ConvertError as e:
    print(f"jaxrlvr.models.convert: error: {e}", file=sys.stderr)
    return 2
  print(f"jaxrlvr.models.convert: {args.gguf} -> {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
