"""The Hugging Face export: DIR/hf after a smoke run loads in transformers with jaxrlvr's logits, the CLI exports an
earlier checkpoint and refuses bad input in one line, and a finished run restarted writes a missing export."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from tokenizers import pre_tokenizers

from jaxrlvr import checkpointing
from jaxrlvr import data as data_lib
from jaxrlvr import export
from jaxrlvr import models
from jaxrlvr import step as step_lib
from jaxrlvr import train

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Token sequences of the embedded vocabulary (ids < 25 of the model's 64); the second is left-padded.
_IDS = np.array([[5, 9, 3, 14, 7, 22, 11, 4, 18, 6], [0, 0, 0, 8, 13, 5, 20, 9, 2, 16]], np.int64)
_MASK = (np.arange(_IDS.shape[1])[None] >= np.array([[0], [3]])).astype(np.int64)
_POSITIONS = np.maximum(np.cumsum(_MASK, axis=1) - 1, 0)


@pytest.fixture(scope="module")
def run(finished_smoke_run):
  """One GRPO smoke run (4 steps, checkpoints 2 and 4) shared by the tests below; from the random initialisation:
  what is exported is checked, not what the warm start taught (the whole command with it runs in
  tests/test_train.py)."""
  return finished_smoke_run


def _restore_params(workdir: str, config, step: int):
  """The policy parameters of checkpoint `step`, restored whole the way train.py resumes (not through export.py)."""
  model_config = models.from_config(config)
  abstract = nnx.eval_shape(lambda: models.Transformer(model_config, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(abstract)
  optimizer = step_lib.make_optimizer(config)
  state = step_lib.TrainState(params=params, opt_state=jax.eval_shape(optimizer.init, params),
                              step=jax.ShapeDtypeStruct((), jnp.int32), skipped=jax.ShapeDtypeStruct((), jnp.int32))
  checkpointer = checkpointing.Checkpointer(workdir)
  try:
    meta = checkpointer.read_meta(step)
    target = {"state": state, "history": [params] * meta["history_len"]}
    restored, _, _ = checkpointer.restore(step, checkpointing.abstract_like(target))
  finally:
    checkpointer.close()
  return graphdef, restored["state"].params


def _assert_same_params(a, b):
  flat_a, flat_b = dict(nnx.to_flat_state(a)), dict(nnx.to_flat_state(b))
  assert sorted(flat_a) == sorted(flat_b)
  for path in flat_a:
    np.testing.assert_array_equal(np.asarray(flat_a[path].get_value()), np.asarray(flat_b[path].get_value()),
                                  err_msg=str(path))


def _jax_logits(graphdef, params) -> np.ndarray:
  model = nnx.merge(graphdef, params)
  return np.asarray(model(jnp.asarray(_IDS, jnp.int32), attention_mask=jnp.asarray(_MASK, jnp.int32)))


def test_final_export_loads_in_transformers_with_jaxrlvrs_logits(run):
  workdir, config = run
  hf_dir = os.path.join(workdir, "hf")
  graphdef, params = _restore_params(workdir, config, 4)  # the final checkpoint

  hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = hf_model(input_ids=torch.tensor(_IDS), attention_mask=torch.tensor(_MASK),
                      position_ids=torch.tensor(_POSITIONS)).logits.numpy()
  ours = _jax_logits(graphdef, params)
  real = _MASK.astype(bool)
  scale = np.abs(ours[real]).max()
  np.testing.assert_allclose(theirs[real], ours[real], rtol=1e-5, atol=1e-5 * scale)
  # Written from the live parameters at the end of the run: exactly the final checkpoint's.
  loaded, _ = models.load_pretrained(hf_dir)
  _assert_same_params(nnx.state(loaded), params)

  # The embedded tokenizer and the stop ids travel with it. It loads as the class its files declare: transformers 5's
  # AutoTokenizer picks Qwen2Tokenizer for any qwen2 model directory (export.py's docstring).
  run_tokenizer = data_lib.tokenizer_from_config(config)
  tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(hf_dir, local_files_only=True)
  text = "Q: 17+25\nA: 17+25=42 \\boxed{42}"  # characters of the task: all in the vocabulary
  assert tokenizer(text)["input_ids"] == run_tokenizer(text)["input_ids"]
  assert tokenizer.decode(run_tokenizer(text)["input_ids"]) == text
  assert tokenizer.chat_template == run_tokenizer.chat_template is not None
  messages = [{"role": "user", "content": "3+4=?"}]
  assert (tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
          == run_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
  assert hf_model.generation_config.eos_token_id in ([run_tokenizer.eos_token_id], run_tokenizer.eos_token_id)
  assert hf_model.generation_config.pad_token_id == run_tokenizer.pad_token_id
  assert not [name for name in os.listdir(workdir) if name.startswith(".hf")], "a staging directory was left"
  # A next run from the export (stage II: model.path=DIR/hf, tokenizer.path empty) reads the same tokenizer.
  stage_two = config.copy_and_resolve_references()
  with stage_two.unlocked():
    stage_two.model.path = hf_dir
  next_run = data_lib.tokenizer_from_config(stage_two)
  assert next_run(text)["input_ids"] == run_tokenizer(text)["input_ids"]
  assert next_run.decode(next_run(text)["input_ids"]) == text


def _qwen_style_tokenizer():
  """A byte-level BPE Qwen2Tokenizer with a chat template and end-of-turn token, as a real run's tokenizer.path has."""
  vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}  # the 256 byte symbols
  merges = [("Ġ", "t"), ("h", "e")]
  for a, b in merges:
    vocab[a + b] = len(vocab)
  vocab["<|endoftext|>"] = len(vocab)
  tokenizer = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges)
  tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
  tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
  return tokenizer


def test_a_real_models_tokenizer_loads_with_autotokenizer(tmp_path):
  tokenizer = _qwen_style_tokenizer()
  model_config = dataclasses.replace(models.get_preset("tiny"), vocab_size=len(tokenizer) + 3, num_layers=1)
  model = models.Transformer(model_config, rngs=nnx.Rngs(0))
  out = export.export_hf(model, model_config, tokenizer, str(tmp_path / "hf"))

  loaded = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
  assert type(loaded) is type(tokenizer)
  text = "the sum: 17 + 25 = ?\nthe end"
  assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
  messages = [{"role": "user", "content": "the sum"}]
  assert (loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
          == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
  generation = transformers.GenerationConfig.from_pretrained(out)
  assert sorted(generation.eos_token_id) == sorted(tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"]))
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
  assert hf_model.config.vocab_size == model_config.vocab_size


def test_cli_exports_an_earlier_checkpoint(run):
  workdir, config = run
  result = subprocess.run([sys.executable, "-m", "jaxrlvr.export", f"--workdir={workdir}", "--step=2"], cwd=_REPO,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-4000:]
  out = os.path.join(workdir, "hf-2")
  assert out in result.stdout
  _, step2 = _restore_params(workdir, config, 2)
  loaded, _ = models.load_pretrained(out)
  _assert_same_params(nnx.state(loaded), step2)
  _, step4 = _restore_params(workdir, config, 4)
  assert not np.array_equal(np.asarray(step2["embed"].get_value()), np.asarray(step4["embed"].get_value()))


def test_cli_replaces_an_export_and_casts(run, tmp_path):
  workdir, _ = run
  out = str(tmp_path / "bf16")
  os.makedirs(out)
  with open(os.path.join(out, "stale.txt"), "w") as f:
    f.write("from an earlier export")
  assert export.main([f"--workdir={workdir}", f"--out={out}", "--dtype=bfloat16"]) == 0
  assert "stale.txt" not in os.listdir(out)
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["dtype"] == "bfloat16"
  loaded, _ = models.load_pretrained(out, dtype=None)
  assert loaded.embed.get_value().dtype == jnp.bfloat16
  assert not [name for name in os.listdir(tmp_path) if name.startswith(".bf16")], "a staging directory was left"


def test_an_export_keeps_the_dtype_of_the_checkpoint_the_run_started_from(run, tmp_path):
  """A run from a bfloat16 checkpoint (model.path) exports bfloat16 unless --dtype says otherwise: the same run
  directory, its config.json pointed at a bfloat16 export of its own policy (the same architecture)."""
  workdir, _ = run
  source = str(tmp_path / "bf16_source")
  assert export.main([f"--workdir={workdir}", f"--out={source}", "--dtype=bfloat16"]) == 0
  copy = str(tmp_path / "run_from_bf16")
  shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("hf"))
  with open(os.path.join(copy, "config.json")) as f:
    run_config = json.load(f)
  run_config["model"]["path"] = source
  with open(os.path.join(copy, "config.json"), "w") as f:
    json.dump(run_config, f)
  dtypes = {}
  for name, flags in (("default", []), ("float32", ["--dtype=float32"])):
    out = str(tmp_path / name)
    assert export.main([f"--workdir={copy}", f"--out={out}", *flags]) == 0
    with open(os.path.join(out, "config.json")) as f:
      dtypes[name] = json.load(f)["dtype"]
  assert dtypes == {"default": "bfloat16", "float32": "float32"}
  assert export.run_dtype(export.read_run_config(workdir)) is None  # the preset's run: the parameter dtype


@pytest.mark.parametrize("case", ["no_workdir", "no_step", "out_is_a_file"])
def test_cli_bad_input_is_one_line_and_exit_2(run, case, tmp_path, capsys):
  workdir, _ = run
  (tmp_path / "file").write_text("not an export")
  argv = {"no_workdir": [f"--workdir={tmp_path / 'nowhere'}"], "no_step": [f"--workdir={workdir}", "--step=3"],
          "out_is_a_file": [f"--workdir={workdir}", f"--out={tmp_path / 'file'}"]}[case]
  assert export.main(argv) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "Traceback" not in err, err
  expected = {"no_workdir": f"--workdir={tmp_path / 'nowhere'}: no such directory",
              "no_step": "--step=3: no checkpoint 3 in", "out_is_a_file": "it exists and is not a directory"}[case]
  assert err.startswith("jaxrlvr.export: ") and expected in err, err
  if case == "no_step":
    assert err.rstrip().endswith("kept steps: 2, 4"), err
  assert (tmp_path / "file").read_text() == "not an export"


def test_a_finished_run_started_again_writes_a_missing_export_only(run, capsys):
  workdir, config = run
  hf_dir = os.path.join(workdir, "hf")
  before = os.stat(os.path.join(hf_dir, "model.safetensors")).st_mtime_ns
  assert train.run(config, workdir) == {}
  assert os.stat(os.path.join(hf_dir, "model.safetensors")).st_mtime_ns == before  # left alone
  os.rename(hf_dir, hf_dir + ".moved")
  try:
    train.run(config, workdir)
    assert "was missing; exported checkpoint 4" in capsys.readouterr().out
    moved, _ = models.load_pretrained(hf_dir + ".moved")
    again, _ = models.load_pretrained(hf_dir)
    _assert_same_params(nnx.state(again), nnx.state(moved))
  finally:
    if not os.path.isdir(hf_dir):
      os.rename(hf_dir + ".moved", hf_dir)
