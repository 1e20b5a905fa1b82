"""Each method's loss as its own paper defines it, read through the shipped configs.

- Replayed tokens: ExGRPO shapes them with f(w) = w / (w + 0.1); advantage-priority replay and BAPO clip them like
  fresh tokens (the shaping is ExGRPO's alone).
- ExGRPO's mixed phase: the update of the step that switches replay on is still clipped; the next is not.
- `exgrpo_reference`: what the released code computes over micro-batches and data-parallel ranks.
- ExpRL: clip-high 0.28 for the outcome variant; the process variant is fully on-policy and judges prefixes.
- `loss.drop_constant_groups`: groups without signal leave the loss and its normaliser.
"""
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrlvr import diagnostics
from jaxrlvr import objectives
from jaxrlvr import parallel
from jaxrlvr import replay
from jaxrlvr import rollout
from jaxrlvr import step as step_lib
from jaxrlvr import train
from jaxrlvr.models import ModelConfig
from jaxrlvr.replay import Group, Rollout
from jaxrlvr.rewards import dense

_REPLAY_METHODS = ["exgrpo", "advantage_priority", "bapo"]


def _config(method: str, arg: str | None = None):
  return importlib.import_module(f"configs.{method}").get_config(arg)


def _row(replayed: bool, clip: bool) -> dict:
  """One token of one row at w = 1 (logp = old = behaviour), advantage 1."""
  return {"replayed": jnp.array([replayed]), "clip": jnp.array([clip]), "advantages": jnp.ones((1, 1)),
          "old_logp": jnp.full((1, 1), -1.0), "behaviour_logp": jnp.full((1, 1), -1.0)}


@pytest.mark.parametrize("method", _REPLAY_METHODS)
def test_replayed_token_gradient_relative_to_a_fresh_token(method):
  config = _config(method)
  settings = objectives.LossSettings.from_config(config)

  def grad_at_w1(replayed):
    micro = _row(replayed, clip=config.loss.clip)
    return jax.grad(lambda lp: step_lib.token_losses(lp, micro, settings).sum())(jnp.full((1, 1), -1.0))[0, 0]

  ratio = float(grad_at_w1(True) / grad_at_w1(False))
  # ExGRPO: d f(w) / d logp = beta * w / (w + beta)^2 = 0.1 / 1.1^2 at w = 1, against d w / d logp = 1 for a fresh
  # token. The other methods clip replayed tokens like fresh ones: the same gradient (BAPO's truncated importance
  # weight min(pi_old / pi_behaviour, 3) is 1 here for both).
  want = 0.1 / 1.1 ** 2 if method == "exgrpo" else 1.0
  assert ratio == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("method", ["grpo", "advantage_priority", "bapo", "exprl"])
def test_shaping_is_off_unless_the_method_is_exgrpo(method):
  config = _config(method)
  assert objectives.LossSettings.from_config(config).shaping_beta is None
  assert objectives.LossSettings.from_config(_config("exgrpo")).shaping_beta == 0.1
  with config.unlocked():
    config.loss.shaping_beta = -1.
  with pytest.raises(ValueError, match=r"loss.shaping_beta \(-1.0\)"):  # 0 is off; a negative value is a mistake
    objectives.LossSettings.from_config(config)


def test_replayed_tokens_are_clipped_and_counted_where_the_method_clips_them():
  """Advantage-priority replay: a replayed token with w = 1.5 > 1 + 0.28 and A > 0 has its gradient cut and counts
  in clip_frac_high; under ExGRPO the same token is shaped, never clipped, and not counted."""
  micro = _row(replayed=True, clip=True)
  logp = jnp.full((1, 1), -1.0 + np.log(1.5))
  for method, clipped in (("advantage_priority", True), ("exgrpo", False)):
    settings = objectives.LossSettings.from_config(_config(method))
    loss = functools.partial(step_lib.token_losses, micro=micro, settings=settings)
    grad = jax.grad(lambda lp, loss=loss: loss(lp).sum())(logp)[0, 0]
    assert (float(grad) == 0.0) == clipped, method
    kwargs = {**settings.policy_loss_kwargs(), "clip": micro["clip"]}
    stats = diagnostics.policy_stats(logp, step_lib.ratio_baseline(micro, settings), micro["advantages"],
                                     jnp.ones((1, 1)), replayed=micro["replayed"], **kwargs)
    assert float(stats["clip_high_count"]) == float(clipped), method


# ---------------------------------------------------------------------------------------------------------------
# ExGRPO's phase switch


def _rollouts(qid, rewards, step):
  return [Rollout(qid, np.array([qid + 1, j + 1], np.int32), np.full(2, -0.5, np.float32), float(r), step)
          for j, r in enumerate(rewards)]


@pytest.mark.parametrize("mixed_clip", [False, True])
def test_exgrpo_update_uses_the_phase_its_batch_was_planned_in(mixed_clip):
  config = _config("exgrpo")
  with config.unlocked():
    config.loss.mixed_clip = mixed_clip
  strategy = replay.make("exgrpo", config, batch_size=4)
  fresh = iter(range(100))
  clipped = []
  for step in range(3):
    plan = strategy.plan(step, lambda n: [next(fresh) for _ in range(n)])
    if plan.score_requests:
      plan = strategy.select(plan, [np.arange(len(r.tokens), dtype=np.float32) for r in plan.score_requests])
    # Half of every group correct: a solve rate of 0.5 > 0.35, so step 0's observe switches replay on.
    sampled = [Group(r.qid, _rollouts(r.qid, [1, 0] * (r.n_samples // 2) + [1] * (r.n_samples % 2), step))
               for r in plan.requests]
    strategy.compose(plan, sampled)
    strategy.observe(plan, sampled)
    clipped.append(train.fresh_tokens_clipped(config, plan))
  assert strategy.active
  # Step 0 was planned on-policy and is clipped although its own solve rate turned replay on; then the mixed phase
  # drops the clip of fresh tokens (released code), unless mixed_clip keeps it (paper eq. 4).
  assert clipped == ([True, True, True] if mixed_clip else [True, False, False])


# ---------------------------------------------------------------------------------------------------------------
# exgrpo_reference: against the released code's computation, by hand

_ROWS, _PROMPT, _COMPLETION, _VOCAB = 16, 3, 6, 32
_MODEL = ModelConfig(vocab_size=_VOCAB, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=8, max_position_embeddings=16)


def _batch():
  rng = np.random.default_rng(0)
  ids = rng.integers(1, _VOCAB, size=(_ROWS, _PROMPT + _COMPLETION)).astype(np.int32)
  lengths = rng.integers(1, _COMPLETION + 1, size=_ROWS)
  completion_mask = (np.arange(_COMPLETION)[None] < lengths[:, None]).astype(np.float32)
  attention = np.ones_like(ids)
  attention[:, _PROMPT:] = completion_mask
  replayed = np.zeros(_ROWS, bool)
  replayed[::5] = True
  return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion_mask,
          "advantages": np.repeat(rng.normal(size=(_ROWS, 1)), _COMPLETION, 1).astype(np.float32),
          "old_logp": (-rng.uniform(0.5, 3, size=(_ROWS, _COMPLETION))).astype(np.float32),
          "behaviour_logp": (-rng.uniform(0.5, 3, size=(_ROWS, _COMPLETION))).astype(np.float32),
          "replayed": replayed, "clip": np.ones(_ROWS, bool)}


@pytest.mark.parametrize("width, divisor", [("max_len", 0), ("padded", 0), ("max_len", 16), ("max_len", 1)])
def test_exgrpo_reference_is_the_released_codes_loss_for_2_microbatches_on_2_devices(width, divisor):
  config = _config("exgrpo")
  with config.unlocked():
    config.loss.entropy_coef = 0.05  # large enough that a wrong entropy normaliser moves the gradient
    config.rollout.max_new_tokens = _COMPLETION
    config.loss.aggregation = "exgrpo_reference"
    config.loss.max_len = 8  # L; the batch's padded completion width is 6
    config.loss.reference_width = width
    config.loss.reference_divisor = divisor
    config.train.num_microbatches = 2
  settings = objectives.LossSettings.from_config(config)
  mesh = parallel.make_mesh(2, 1, 1, devices=jax.devices()[:2])
  graphdef, params = nnx.split(parallel.create_model(_MODEL, mesh, seed=0))
  batch = _batch()

  def released_code_loss(params):
    """verl's way: each rank r holds its rows of every micro-batch m; pg_rm = sum(token losses) / W, the entropy
    bonus is the token mean of the micro-batch's entropy (masked_mean), loss_rm = (pg_rm - c * entropy_rm) / D; a
    rank backpropagates sum_m loss_rm and the ranks' gradients are averaged. Returns (loss, its policy part)."""
    model = nnx.merge(graphdef, params)
    logp, entropy = step_lib.completion_logprobs(model, batch, 1.0)
    per_token = step_lib.token_losses(logp, batch, settings)
    W = 8 if width == "max_len" else _COMPLETION
    D = divisor or 2
    mask = batch["completion_mask"]
    policy, total = 0.0, 0.0
    for rank in range(2):
      for m in range(2):
        rows = np.arange(_ROWS)[m::2]  # the update interleaves rows into micro-batches (step._split_rows)
        rows = rows[rank * 4:(rank + 1) * 4]  # and each micro-batch is split over the 2 devices in blocks
        pg = jnp.sum(per_token[rows] * mask[rows]) / W
        entropy_mean = jnp.sum(entropy[rows] * mask[rows]) / mask[rows].sum()
        policy += pg / D / 2  # / 2: the average over the 2 ranks
        total += (pg - 0.05 * entropy_mean) / D / 2
    return total, policy

  (want_loss, want_policy), want_grad = jax.value_and_grad(released_code_loss, has_aux=True)(params)
  lr = 1e6  # read the applied gradient off one SGD step (the step dwarfs the parameters)
  state = step_lib.create_state(params, optax.sgd(lr), mesh)
  before = jax.device_get(state.params)
  update = step_lib.make_update_fn(graphdef, config, optax.sgd(lr),
                                   state_sharding=jax.tree.map(lambda x: x.sharding, state),
                                   batch_sharding=parallel.batch_sharding(mesh))
  new_state, metrics, _ = update(state, parallel.shard_batch(batch, mesh))
  np.testing.assert_allclose(float(metrics["loss/policy"]), float(want_policy), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["loss/total"]), float(want_loss), rtol=1e-5)
  got_grad = jax.tree.map(lambda b, a: (np.asarray(b, np.float64) - np.asarray(a, np.float64)) / lr, before,
                          jax.device_get(new_state.params))
  for got, want in zip(jax.tree.leaves(got_grad), jax.tree.leaves(jax.device_get(want_grad))):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(np.abs(want).max(), 1e-12))


def test_exgrpo_reference_divisor_of_the_paper_config_is_the_released_scripts():
  # run_exgrpo.sh: ppo_mini_batch_size // ppo_micro_batch_size = 64 // 64 = 1 (both scale alike with the world
  # size), whatever the real micro-batch count; L = 8192 on 8 ranks, so a step's token sum is divided by 8192 * 8,
  # not by 8192 * 8 * 16 (this config's 16 micro-batches).
  config = _config("exgrpo", "model=qwen2.5-math-7b")
  with config.unlocked():
    config.loss.aggregation = "exgrpo_reference"
  assert config.train.num_microbatches == 16 and config.rollout.max_new_tokens == 8192
  kwargs = objectives.LossSettings.from_config(config).normalizer_kwargs(
      num_ranks=8, num_microbatches=config.train.num_microbatches)
  assert kwargs["reference_divisor"] == 1
  assert float(objectives.loss_normalizer(jnp.ones((4, 3)), **kwargs)) == 8192 * 8
  # 0 divides by this run's micro-batch count instead.
  with config.unlocked():
    config.loss.reference_divisor = 0
  kwargs = objectives.LossSettings.from_config(config).normalizer_kwargs(num_ranks=8, num_microbatches=16)
  assert float(objectives.loss_normalizer(jnp.ones((4, 3)), **kwargs)) == 8192 * 8 * 16


def test_exgrpo_reference_normaliser_by_hand():
  # One optimizer step of 2 micro-batches on 8 devices, L = 1024: the token sum is divided by 1024 * 8 * 2.
  mask = jnp.ones((4, 3))
  assert float(objectives.loss_normalizer(mask, mode="exgrpo_reference", max_len=1024, reference_ranks=8,
                                          reference_divisor=2)) == 1024 * 8 * 2
  # The public single-batch form stays sum / L.
  assert float(objectives.aggregate_loss(jnp.ones((4, 3)), mask, mode="exgrpo_reference", max_len=4)) == 12 / 4


# ---------------------------------------------------------------------------------------------------------------
# ExpRL


def test_exprl_variants_follow_the_paper():
  outcome, process = _config("exprl", "reward=outcome"), _config("exprl", "reward=process")
  assert outcome.loss.clip_high == 0.28 and outcome.loss.clip_low == 0.2
  assert process.train.num_minibatches == 1  # fully on-policy
  assert process.exprl.process_judging == "prefix"
  paper_scale = _config("exprl", "reward=process,model=qwen2.5-math-7b")
  assert paper_scale.train.num_minibatches == 1  # the paper-scale base takes 2; the process variant keeps 1


class _RecordingJudge:
  def __init__(self):
    self.requests = []

  def score(self, requests):
    from jaxrlvr.rewards.judge import JudgeResult  # pylint: disable=g-import-not-at-top
    self.requests.extend(requests)
    return [JudgeResult(score=min(len(r.answer) / 20, 1.0), text="", latency_s=0.0, tokens_sent=None)
            for r in requests]


def test_exprl_process_judge_receives_prefixes():
  words = {1: "", 2: "a=1 ###", 3: "b=2 ###", 4: "so 3"}
  decode = lambda ids: " ".join(words[i] for i in ids if words.get(i))
  group = dense.RolloutGroup(question="q", reference="ref", token_ids=np.array([[2, 3, 4, 1]]),
                             lengths=np.array([4]), finished=np.array([True]))
  judge = _RecordingJudge()
  dense.dense_rewards(judge, [group], decode, reward="process", norm="end")
  # Segment t's request is the answer up to and including segment t, judged as unfinished work.
  assert [r.answer for r in judge.requests] == ["a=1 ###", "a=1 ### b=2 ###", "a=1 ### b=2 ### so 3"]
  assert all(r.prefix and r.context is None for r in judge.requests)
  step_judge = _RecordingJudge()
  dense.dense_rewards(step_judge, [group], decode, reward="process", norm="end", judging="step")
  assert [(r.answer, r.context) for r in step_judge.requests] == [
      ("a=1 ###", ""), (" b=2 ###", "a=1 ###"), (" so 3", "a=1 ### b=2 ###")]


# ---------------------------------------------------------------------------------------------------------------
# drop_constant_groups


class _Book:
  def prompt_ids(self, qid):
    return [5, qid + 1]


def test_drop_constant_groups_removes_groups_without_signal_from_the_loss():
  def group(qid, rewards, advantages):
    return Group(qid, [Rollout(qid, np.array([7, 8], np.int32), np.zeros(2, np.float32), r, 0, advantage=a)
                       for r, a in zip(rewards, advantages)])
  groups = [group(0, [1, 0], [0.5, -0.5]), group(1, [1, 1], [0.0, 0.0]),
            Group(2, [Rollout(2, np.array([7], np.int32), np.zeros(1, np.float32), 1.0, 0, True, 0.7)], "replay")]
  kwargs = dict(prompt_len=2, completion_len=3, rows=6, pad_id=0, clip_fresh=True)
  kept = rollout.build_batch(groups, _Book(), **kwargs)
  dropped = rollout.build_batch(groups, _Book(), drop_constant_groups=True, **kwargs)
  np.testing.assert_array_equal(kept["completion_mask"].sum(-1), [2, 2, 2, 2, 1, 0])
  np.testing.assert_array_equal(dropped["completion_mask"].sum(-1), [2, 2, 0, 0, 1, 0])  # the all-correct group
  # The normaliser no longer counts them: dr_grpo's N drops from 5 sequences to 3.
  assert float(objectives.loss_normalizer(dropped["completion_mask"], mode="dr_grpo", max_len=3)) == 3 * 3


def test_one_group_std_convention_on_device_and_host():
  rewards = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
  on_device = np.asarray(objectives.group_advantages(rewards[None], scale_by_std=True))[0]
  np.testing.assert_allclose(replay.base.group_advantages_np(rewards, scale_by_std=True), on_device, rtol=1e-6)
  np.testing.assert_allclose(dense.outcome_advantages(rewards, scale_by_std=True), on_device, rtol=1e-6)
  assert replay.base.group_std(rewards) == pytest.approx(np.std(rewards, ddof=1))
