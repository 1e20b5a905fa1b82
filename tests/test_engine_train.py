"""The rollout engine inside a run: config keys reach every sampler call, and RL steps compile nothing new."""
import collections
import os
import threading
import types

import pytest
from flax import nnx

from configs import grpo
from jaxrlvr import config_lib
from jaxrlvr import rollout
from jaxrlvr import run_setup
from jaxrlvr import train
from jaxrlvr.models import ModelConfig, Transformer
from jaxrlvr.rewards import judge as judge_lib
from jaxrlvr.rollout import engine
from jaxrlvr.rollout import scheduler


class _TracesByThread(collections.Counter):
  """engine.TRACE_COUNTS that also logs (thread, function) for each trace: the engine's functions count their traces
  with `TRACE_COUNTS[name] += 1` while they are traced, in the thread that traces them."""

  def __init__(self):
    super().__init__()
    self.log = []

  def __setitem__(self, key, value):
    self.log.append((threading.get_ident(), key))
    super().__setitem__(key, value)


@pytest.mark.slow
def test_three_rl_steps_of_the_embedded_default_compile_once(tmp_path, monkeypatch):
  """The embedded default (GRPO, the tiny model, 16 x 8 rows) with rollout.engine='continuous': each step's rollout
  goes through the engine, and none of the three traces an engine function: the first's were prepared beside the
  step-0 evaluation (`Trainer.prepare_first_rollout`), the later ones reuse them."""
  calls = []
  real = scheduler.generate
  traces = _TracesByThread()
  monkeypatch.setattr(engine, "TRACE_COUNTS", traces)

  def spy(model, prompts, **kwargs):
    # A rollout's own traces: those of the thread that calls the sampler. Another thread's (a compile ahead still
    # finishing, a background job of an earlier test in this worker) are not the rollout's; they are shown if it fails.
    before = len(traces.log)
    out = real(model, prompts, **kwargs)
    during = traces.log[before:]
    calls.append(dict(rows=len(prompts), temperature=kwargs["temperature"],
                      traced=sum(thread == threading.get_ident() for thread, _ in during),
                      other_threads=[name for thread, name in during if thread != threading.get_ident()]))
    return out

  monkeypatch.setattr(scheduler, "generate", spy)
  config = grpo.get_config()
  with config.unlocked():
    config.warm_start.cache_dir = os.environ["JAXRLVR_WARM_START_CACHE"]
    # What compiles depends on the shapes (16 x 8 rows, the default's lengths), not on what the policy learnt: the
    # random initialisation makes the same sampler calls without the warm start's own compile and steps (this test
    # 38.8 -> 26.7 CPU-s on an empty compilation cache).
    config.warm_start.steps = 0
    config.total_steps = 3
    config.eval_every = 100  # evaluation at the start and the end only, of 16 questions
    config.data.eval_size = 16
    config.rollout.engine = "continuous"
  train.run(config, str(tmp_path / "run"))
  rollouts = [c for c in calls if c["temperature"] == config.rollout.temperature and c["rows"] == 128]
  assert len(rollouts) == 3, calls
  assert [c["traced"] for c in rollouts] == [0, 0, 0], calls


def test_config_keys_reach_the_rollout_sampler_and_the_judge(monkeypatch):
  config = grpo.get_config("smoke")
  with config.unlocked():
    config.rollout.engine = "continuous"
    config.rollout.decode_slots = 3
    config.rollout.decode_chunk_steps = 5
    config.rollout.decode_weights = "training"
  expected = {"engine": "continuous", "decode_slots": 3, "decode_chunk_steps": 5, "decode_weights": "training"}
  assert run_setup.sampler_engine(config) == expected
  calls = []
  real = rollout.generate

  def spy(model, prompts, **kwargs):
    calls.append({k: kwargs.get(k) for k in rollout.ENGINE_SETTINGS})
    return real(model, prompts, **kwargs)

  monkeypatch.setattr(rollout, "generate", spy)  # before the judge binds rollout.generate
  tokenizer = types.SimpleNamespace(eos_token_id=1, pad_token_id=0, encode=lambda text, **_: types.SimpleNamespace(
      ids=[2 + ord(c) % 60 for c in text[:20]]), decode=lambda ids, **_: "score: 3")
  cfg = types.SimpleNamespace(kind="model", max_new_tokens=3, batch_size=2, get=lambda key, default: default)
  tiny = Transformer(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                 num_kv_heads=1, head_dim=16), rngs=nnx.Rngs(1))
  judge = judge_lib.judge_from_config(cfg, model=tiny, tokenizer=tokenizer,
                                      sampler_limits={**run_setup.sampler_limits(config), **run_setup.sampler_engine(config)})
  results = judge.score([judge_lib.JudgeRequest("q", "r", "a")])
  assert calls == [expected]
  assert len(results) == 1 and results[0].text == "score: 3"
  with pytest.raises(ValueError, match="engine='paged'"):
    judge_lib.ModelJudge(tiny, tokenizer, engine="paged", generate_fn=rollout.generate)


@pytest.mark.parametrize("key,value,words", [("engine", "paged", "'static' or 'continuous'"),
                                             ("decode_slots", -1, ">= 0"), ("decode_chunk_steps", 0, ">= 1"),
                                             ("decode_weights", "sharded", "'replicated' or 'training'")])
def test_bad_engine_keys_name_themselves(key, value, words):
  config = grpo.get_config("smoke")
  with config.unlocked():
    config.rollout[key] = value
  with pytest.raises(config_lib.ConfigError, match=f"rollout.{key}") as error:
    config_lib.validate(config, num_devices=8)
  assert words in str(error.value)


def test_engine_settings_may_change_when_a_run_resumes():
  from jaxrlvr import checkpointing

  saved = grpo.get_config("smoke").to_dict()
  current = grpo.get_config("smoke")
  with current.unlocked():
    current.rollout.engine = "continuous"
    current.rollout.decode_slots = 8
    current.rollout.decode_chunk_steps = 4
    current.rollout.decode_weights = "training"
  assert checkpointing.incompatible_changes(saved, current.to_dict()) == []


def test_rewards_are_scored_while_the_engine_decodes():
  """sample_groups hands the engine's finished rows to the reward pool as they leave: the pool sees several batches,
  the first before the sampler returns, and every row's reward lands on its own rollout."""
  import threading
  import time

  import jax
  import numpy as np

  from jaxrlvr import replay
  from jaxrlvr import rollout

  model = Transformer(ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, initializer_range=0.3),
                      rngs=nnx.Rngs(0))
  prompts = {qid: [3 + qid, 14, 15, 9][:1 + qid % 4] for qid in range(6)}
  book = types.SimpleNamespace(prompt_ids=prompts.__getitem__, answer=lambda qid: str(qid),
                               tokenizer=types.SimpleNamespace(batch_decode=lambda rows, **_: [
                                   " ".join(map(str, row)) for row in rows]))
  batches = []

  def score(completions, answers):  # the reward: the answer's length, so that a misplaced reward shows
    batches.append((time.monotonic(), threading.current_thread().name, len(completions)))
    return np.asarray([len(c) for c in completions], np.float32), {"timeouts": 0}

  returned = []
  real = scheduler.generate

  def timed(*args, **kwargs):
    out = real(*args, **kwargs)
    returned.append(time.monotonic())
    return out

  settings = rollout.SamplerSettings(max_new_tokens=40, temperature=1.0, top_p=1.0, top_k=0, eos_ids=(5, 11, 17),
                                     pad_id=0, engine="continuous", decode_slots=8, decode_chunk_steps=4)
  requests = [replay.Request(qid=qid, n_samples=4) for qid in range(6)]
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(scheduler, "generate", timed)
    groups, _ = rollout.sample_groups(lambda delay: model, requests, book, types.SimpleNamespace(score=score),
                                      settings, step=0, rng=jax.random.key(3))
  assert len(batches) > 2, batches
  assert batches[0][0] < returned[0], "no row was scored before the sampler returned"
  assert all(name.startswith("rewards") for _, name, _ in batches)
  assert sum(n for _, _, n in batches) == 24
  for group in groups:
    for r in group.rollouts:
      assert r.reward == len(" ".join(map(str, r.tokens.tolist()))), (group.qid, r.tokens, r.reward)
