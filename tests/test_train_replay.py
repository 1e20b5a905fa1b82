"""The training loop with replay actually replaying, end to end.

The smoke model solves nothing in a few steps, so a smoke run never stores anything and never replays. Here the
verifier is replaced by a biased coin fixed by each completion's text (about a quarter of the rollouts are
"correct"), so groups are mixed, and some all wrong, from the first step: the buffer fills, replayed questions and
rollouts enter the batch, and the update's replayed-token path and the buffer's checkpoint run inside the real loop on
the 8-device test mesh.

The loop's scoring pass of the update batch (old log-probs) runs only where a later optimizer step of the batch needs
it; with one optimizer step a batch the update's own forward pass gives pi_old, with the same parameters after.
"""
import concurrent.futures
import importlib
import json
import os
import types
import zlib

import numpy as np
import pytest
import safetensors.numpy

from configs import grpo
from jaxrlvr import compile_ahead
from jaxrlvr import outputs
from jaxrlvr import rollout
from jaxrlvr import step as step_lib
from jaxrlvr import train
from jaxrlvr.rewards import math as math_rewards


def _biased_coin_score(self, completions, answers, **kwargs):
  # A quarter of each scored call is right, chosen by a hash of each row's position and text: with 2 rows or more,
  # never all wrong or all right, whatever the policy samples. (A coin on the text alone once left a step-2 batch all
  # wrong.)
  order = np.argsort([zlib.crc32(f"{i}|{c}".encode()) for i, c in enumerate(completions)], kind="stable")
  rewards = np.zeros(len(completions), np.float32)
  rewards[order[:max(1, len(completions) // 4)]] = 1.0
  return rewards, dict(fast_path=len(completions), verified=0, timeouts=0, crashes=0, missing_think=0, seconds=0.0)


def _sampler_logprobs_of(value: float):
  """rollout.sample_groups with every sampled token's recorded log-prob replaced by `value`, so what a replayed
  answer's ratio is taken against shows whose log-probs were stored: the sampler's (this value) or the trainer's."""
  sample_groups = rollout.sample_groups

  def patched(*args, **kwargs):
    groups, info = sample_groups(*args, **kwargs)
    for g in groups:
      for r in g.rollouts:
        r.logprobs = np.full(len(r.tokens), value, np.float32)
    return groups, info
  return patched


class _Counted:
  """A jitted function that calls `on_call(path, *args)` before each call: path "jit" for a call of the function,
  "ahead" for one of the executable jaxrlvr/compile_ahead.py compiled from it before the first call."""

  def __init__(self, fn, on_call, path="jit"):
    self.fn, self.on_call, self.path = fn, on_call, path

  def __call__(self, *args):
    self.on_call(self.path, *args)
    return self.fn(*args)

  def lower(self, *args):
    lowered = self.fn.lower(*args)
    return types.SimpleNamespace(compile=lambda: _Counted(lowered.compile(), self.on_call, "ahead"))


def _count_score_calls(monkeypatch) -> list[str]:
  """What each batch the trainer's scoring function is called on from now on is: "update" (it has advantages) or
  "answers" (ExGRPO's stored answers, for their entropy)."""
  rows, make_score_fn = [], step_lib.make_score_fn

  def counting_make_score_fn(*args, **kwargs):
    return _Counted(make_score_fn(*args, **kwargs),
                    lambda path, params, batch: rows.append("update" if "advantages" in batch else "answers"))

  monkeypatch.setattr(step_lib, "make_score_fn", counting_make_score_fn)
  return rows


@pytest.mark.parametrize("method", ["exgrpo", "advantage_priority", "bapo"])
def test_replay_methods_replay_inside_the_loop(method, tmp_path, monkeypatch):
  monkeypatch.setattr(math_rewards.MathRewardPool, "score", _biased_coin_score)
  scored_rows = _count_score_calls(monkeypatch)
  if method == "exgrpo":
    monkeypatch.setattr(train.rollout, "sample_groups", _sampler_logprobs_of(-30.0))
  config = importlib.import_module(f"configs.{method}").get_config("smoke")
  with config.unlocked():
    config.warm_start.cache_dir = os.environ["JAXRLVR_WARM_START_CACHE"]  # the embedded tokenizer's cache
    config.warm_start.steps = 0  # the coin decides the rewards: no warm start needed (nor trained in the fast tier)
    config.total_steps = 4
    config.eval_every = 4
    if method == "exgrpo":  # replay turns on after step 1 (the coin's solve rate is ~0.25), not from the start
      config.replay.start_solve_rate = 0.1
  workdir = str(tmp_path / method)
  train.run(config, workdir)

  rows = outputs.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  steps = [r for r in rows if "loss/policy" in r]
  assert [r["step"] for r in steps] == [1, 2, 3, 4]
  solve = [r["rollout/solve_rate"] for r in steps]
  assert all(0 < s < 1 for s in solve), solve  # the coin: neither all wrong (smoke) nor all right
  replayed_tokens = [r["policy/replayed/tokens"] for r in steps]
  assert replayed_tokens[0] == 0, replayed_tokens  # nothing stored before the first step
  if method == "bapo":  # X3 (the replayed groups) only fills what fresh X1 and re-rolled X2 groups leave free
    assert any(t > 0 for t in replayed_tokens[1:]), replayed_tokens
  else:  # a non-empty buffer replays every step
    assert all(t > 0 for t in replayed_tokens[1:]), replayed_tokens
  assert all(np.isfinite(r["loss/policy"]) and np.isfinite(r["optim/grad_norm"]) for r in steps)
  if method == "exgrpo":
    # The phase of an update is the one its batch was planned in: step 1 switched replay on but was planned
    # on-policy, so its fresh tokens are clipped; from step 2 on (mixed phase, mixed_clip=False) they are not.
    assert [r["loss/fresh_clip_on"] for r in steps] == [1, 0, 0, 0], [r["replay/phase"] for r in steps]
    # Each replayed question brings one stored answer; where it has several, the entropy pass scores them all and
    # the lowest-entropy one is chosen (a question with a single stored answer needs no scoring).
    counts = [(r["replay/replay_questions"], r["replay/scored_answers"]) for r in steps]
    assert all(questions > 0 for questions, _ in counts[1:]), counts
    assert any(scored >= 2 for _, scored in counts), counts  # the entropy pass ran inside the loop
    # replay.behaviour_logprobs="trainer" (released code): a stored answer's pi_past is the trainer's recomputed
    # log-probs, so its ratio pi / pi_past stays near 1 after a few small updates; had the sampler's (-30 here) been
    # stored, the ratio would be exp(20) (the log-ratio clamp).
    ratios = [r["policy/replayed/ratio_mean"] for r in steps[1:]]
    assert all(0.5 < x < 2.0 for x in ratios), ratios
    # One optimizer step a batch: those log-probs come from the update's own forward pass, and the scorer only sees
    # the stored answers of the entropy pass, never the update batch.
    assert config.train.num_minibatches == 1
    assert "answers" in scored_rows and "update" not in scored_rows, scored_rows
  # The run saved its config and a checkpoint of the last step (whose host state holds the buffer).
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["replay"]["name"] == method
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "4"))


def _count_update_calls(monkeypatch) -> list[tuple[int, str]]:
  """The prompt group (1: every row its own prompt) of each update the trainer calls from now on, and whether the
  call ran the executable compiled ahead ("ahead") or the jitted function ("jit")."""
  groups, make_update_fn = [], step_lib.make_update_fn

  def counting_make_update_fn(*args, prompt_group=1, **kwargs):
    return _Counted(make_update_fn(*args, prompt_group=prompt_group, **kwargs),
                    lambda path, state, batch: groups.append((prompt_group, path)))

  monkeypatch.setattr(step_lib, "make_update_fn", counting_make_update_fn)
  return groups


def test_one_optimizer_step_a_batch_skips_the_scoring_pass_and_trains_the_same(tmp_path, monkeypatch):
  """GRPO's smoke run (one optimizer step a batch) calls no scorer and runs each group's prompt once; forced through
  the scoring pass and a prompt per row, as it ran before, it ends with the same parameters (its export) and logs
  the same losses. The coin gives every step's groups mixed rewards, so the parameters move."""
  monkeypatch.setattr(math_rewards.MathRewardPool, "score", _biased_coin_score)

  def smoke_run(name, **train_settings):
    config = grpo.get_config("smoke")
    with config.unlocked():
      config.warm_start.cache_dir = os.environ["JAXRLVR_WARM_START_CACHE"]  # the embedded tokenizer's cache
      config.warm_start.steps = 0  # two runs from the same random initialisation: no warm start to train
      config.rollout.batch_size = 8  # 8 groups of 4: whole groups on each of the 8 test devices
      config.total_steps = 2
      config.eval_every = 100
      config.train.update(train_settings)
    workdir = str(tmp_path / name)
    train.run(config, workdir)
    rows = [r for r in outputs.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "loss/policy" in r]
    return safetensors.numpy.load_file(os.path.join(workdir, "hf", "model.safetensors")), rows

  scored_rows, update_groups = _count_score_calls(monkeypatch), _count_update_calls(monkeypatch)
  params, rows = smoke_run("own_forward")
  # Each group's prompt ran once, and every update ran the executable compiled while the step-0 evaluation ran.
  assert scored_rows == [] and update_groups == [(4, "ahead"), (4, "ahead")]
  monkeypatch.setattr(step_lib, "needs_score_pass", lambda config: True)  # the loop before the change
  want_params, want_rows = smoke_run("scoring_pass", share_prompts=False)
  assert scored_rows == ["update", "update"]  # one scoring pass of the update batch a step
  assert update_groups[2:] == [(1, "ahead"), (1, "ahead")]
  assert all(r["optim/grad_norm"] > 0 for r in want_rows), want_rows
  assert params.keys() == want_params.keys()
  for name, want in want_params.items():
    np.testing.assert_allclose(params[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
  for got, want in zip(rows, want_rows, strict=True):
    for key in ("loss/policy", "loss/total", "optim/grad_norm", "policy/fresh/ratio_mean"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_the_loop_packs_ragged_answers_on_the_updates_compiled_ahead(tmp_path, monkeypatch):
  """GRPO's smoke run on one batch shard (the 8 test devices on the tensor axis) with train.pack_completions: the
  random policy's answers stop at ragged lengths, so its updates run on fewer rows (update/packed_rows, the
  packed batch's rows), each on the executable compiled ahead for its row count, and train. The compiles run at
  once here: a run packs from the step its packed update is ready (before that, the unpacked one runs). That a
  packed update equals the unpacked one is tests/test_step.py's."""
  monkeypatch.setattr(math_rewards.MathRewardPool, "score", _biased_coin_score)
  calls, make_update_fn = [], step_lib.make_update_fn

  def counting_make_update_fn(*args, **kwargs):
    return _Counted(make_update_fn(*args, **kwargs), lambda path, state, batch: calls.append(
        (path, batch["packing"]["ids"].shape[0] if "packing" in batch else batch["input_ids"].shape[0])))

  monkeypatch.setattr(step_lib, "make_update_fn", counting_make_update_fn)

  class AtOnce:
    def submit(self, fn, *args):
      done = concurrent.futures.Future()
      done.set_result(fn(*args))
      return done

  monkeypatch.setattr(compile_ahead, "_POOL", AtOnce())
  config = grpo.get_config("smoke")
  with config.unlocked():
    config.warm_start.cache_dir = os.environ["JAXRLVR_WARM_START_CACHE"]  # the embedded tokenizer's cache
    config.warm_start.steps = 0
    config.rollout.batch_size = 8  # 32 rows of at most 26 tokens
    config.total_steps = 2
    config.eval_every = 100
    config.mesh.data, config.mesh.tensor = 1, -1
    config.train.pack_completions = (0.9,)  # 29 rows of the 32: one more compiled update
  workdir = str(tmp_path / "packed")
  train.run(config, workdir)
  rows = [r for r in outputs.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "loss/policy" in r]
  assert [r["update/packed_rows"] for r in rows] == [n / 32 for _, n in calls]
  assert [n for _, n in calls] == [29, 29] and [path for path, _ in calls] == ["ahead", "ahead"], calls
  assert all(np.isfinite(r["loss/total"]) and r["optim/grad_norm"] > 0 for r in rows), rows
