"""The training loop, read top to bottom: mesh, data, model, replay and rewards, restore, then per step
plan (replay) -> sample -> reward -> compose and observe (replay) -> update -> log -> eval -> checkpoint.
"""
import collections
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from jaxrlvr import checkpointing
from jaxrlvr import config_lib
from jaxrlvr import data as data_lib
from jaxrlvr import evaluate as evaluate_lib
from jaxrlvr import metrics as metrics_lib
from jaxrlvr import models
from jaxrlvr import parallel
from jaxrlvr import replay
from jaxrlvr import rewards
from jaxrlvr import rollout
from jaxrlvr import sampling
from jaxrlvr import step as step_lib
from jaxrlvr import warm_start
from jaxrlvr.rewards import dense as dense_lib
from jaxrlvr.rewards import judge as judge_lib


def batch_rows(config: ml_collections.ConfigDict, batch_shards: int) -> int:
  """Rows of every update batch: the most rollouts the method can put in one step, rounded up so that every
  optimizer step's micro-batches split evenly over the batch shards (filler rows make up the difference)."""
  rollouts = config.rollout.batch_size * config.rollout.group_size
  if config.replay.name == "advantage_priority" and config.replay.composition == "fresh_anchored":
    rollouts += int(round(config.replay.replay_fraction * rollouts))
  multiple = config.train.num_minibatches * config.train.num_microbatches * batch_shards
  return -(-rollouts // multiple) * multiple


def build_policy(config, mesh, book: rollout.PromptBook):
  """The policy to start RL from: an HF checkpoint, or a preset initialised at random (+ the embedded warm start)."""
  if config.model.path:
    return models.load_pretrained(config.model.path, dtype=jnp.dtype(config.model.param_dtype),
                                  compute_dtype=config.model.compute_dtype, mesh=mesh, remat=config.model.remat,
                                  attention=config.model.attention)
  model_config = models.get_preset(config.model.preset)
  model_config = dataclasses.replace(model_config, param_dtype=config.model.param_dtype, compute_dtype=config.model.compute_dtype,
                                      remat=config.model.remat, attention=config.model.attention)
  tokenizer = book.tokenizer
  if len(tokenizer) > model_config.vocab_size:
    raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but model preset {config.model.preset!r} has "
                     f"vocab_size {model_config.vocab_size}")
  model = parallel.create_model(model_config, mesh, seed=config.seed)
  if config.warm_start.steps:
    qids = range(min(len(book.source), config.warm_start.steps * config.warm_start.batch_size))
    solutions = tokenizer([book.example(q).solution for q in qids], add_special_tokens=False)["input_ids"]
    pairs = [(book.prompt_ids(q), ids + [tokenizer.eos_token_id]) for q, ids in zip(qids, solutions)]
    model = warm_start.cached_warm_start(
        model, model_config, tokenizer, pairs, task=config.data.source, steps=config.warm_start.steps,
        lr=config.warm_start.lr, batch_size=config.warm_start.batch_size, seed=config.seed,
        prompt_len=config.data.max_prompt_len, completion_len=config.rollout.max_new_tokens,
        cache_dir=config.warm_start.cache_dir, mesh=mesh, batch_sharding=parallel.batch_sharding(mesh))
  return model, model_config


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains (or resumes, or reports a finished run) and returns the last logged metrics."""
  # ------------------------------------------------------------------------------------------------ Mesh
  num_devices = jax.device_count()
  config_lib.validate(config, num_devices=num_devices)
  mesh = parallel.make_mesh(*config_lib.mesh_shape(config.mesh, num_devices))
  batch_sharding = parallel.batch_sharding(mesh)
  batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
  is_main = jax.process_index() == 0
  os.makedirs(workdir, exist_ok=True)

  # ------------------------------------------------------------------------------------------------ Checkpoints
  checkpointer = checkpointing.Checkpointer(workdir, keep=config.keep_checkpoints)
  latest = checkpointer.latest_step()
  if latest is not None and latest >= config.total_steps:
    logging.info("run in %s already finished at step %d of %d", workdir, latest, config.total_steps)
    print(f"jaxrlvr: the run in {workdir} is finished (step {latest} of {config.total_steps}); nothing to do.")
    return {}
  if is_main:
    with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
      json.dump(config.to_dict(), f, indent=2, sort_keys=True)

  # ------------------------------------------------------------------------------------------------ Data
  tokenizer = data_lib.tokenizer_from_config(config)
  train_set, eval_set = data_lib.sources_from_config(config)
  eval_examples = [eval_set[q] for q in range(min(len(eval_set), config.data.eval_size or len(eval_set)))]
  questions = data_lib.QuestionIterator(train_set, seed=config.seed, host_id=jax.process_index(),
                                        num_hosts=jax.process_count())
  book = rollout.PromptBook(train_set, tokenizer, template=config.tokenizer.template,
                            max_prompt_len=config.data.max_prompt_len)
  sampler = rollout.SamplerSettings(
      max_new_tokens=config.rollout.max_new_tokens, temperature=config.rollout.temperature,
      top_p=config.rollout.top_p, top_k=config.rollout.top_k, eos_ids=tuple(data_lib.stop_token_ids(tokenizer)),
      pad_id=tokenizer.pad_token_id)
  prompt_len = sampling.bucket_length(config.data.max_prompt_len)
  completion_len = config.rollout.max_new_tokens
  rows = batch_rows(config, batch_shards)

  # ------------------------------------------------------------------------------------------------ Model
  model, model_config = build_policy(config, mesh, book)
  graphdef, params = nnx.split(model)
  logging.info("policy: %s parameters\n%s", f"{parallel.param_count(model):,}", parallel.describe_sharding(model))
  optimizer = step_lib.make_optimizer(config)
  state = step_lib.create_state(params, optimizer, mesh)
  state_sharding = jax.tree.map(lambda x: x.sharding, state)
  update = step_lib.make_update_fn(graphdef, config, optimizer, state_sharding=state_sharding,
                                   batch_sharding=batch_sharding)
  score = step_lib.make_score_fn(graphdef, temperature=config.rollout.temperature or 1.0,
                                 batch_sharding=batch_sharding,
                                 num_chunks=config.train.num_minibatches * config.train.num_microbatches)
  reference = jax.tree.map(jnp.copy, params) if config.loss.kl_coef > 0 else None

  # ------------------------------------------------------------------------------------------------ Replay, rewards
  strategy = replay.make(config.replay.name, config)
  reward_pool = rewards.MathRewardPool.from_config(config)
  judge = _build_judge(config, model, tokenizer, mesh) if config.method == "exprl" else None
  max_delay = config.replay.get("policy_delay", 0)
  # BAPO samples with the parameters of `policy_delay` updates ago: history[d] = params d updates ago.
  history = collections.deque(maxlen=max_delay) if max_delay else None

  # ------------------------------------------------------------------------------------------------ Restore
  start_step = 0
  if latest is not None:
    meta = checkpointer.read_meta(latest)
    checkpointer.check_config(meta, config)
    train_target = {"state": state, "history": [state.params] * meta["history_len"]}
    restored, host, _ = checkpointer.restore(latest, checkpointing.abstract_like(train_target))
    state = restored["state"]
    if history is not None:
      history.extend(restored["history"])
    strategy.load_state_dict(host["replay"])
    questions.load_state_dict(host["data"])
    start_step = latest
    logging.info("resumed from %s at step %d", checkpointer.directory, latest)
  writer = metrics_lib.MetricWriter(workdir, total_steps=config.total_steps, initial_step=start_step,
                                    enabled=is_main)
  rng = jax.random.key(config.seed)

  def policy(params):
    return nnx.merge(graphdef, params)

  def evaluate(params) -> dict:
    eval_model = policy(params)

    def generate_fn(prompts, temperature, n):
      ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
      out = sampling.generate(eval_model, [p for p in ids for _ in range(n)], max_new_tokens=completion_len,
                              rng=jax.random.key(config.seed + 1), temperature=temperature,
                              eos_ids=sampler.eos_ids, pad_id=sampler.pad_id, mesh=mesh)
      return rollout.decode(tokenizer, out.tokens, out.lengths), out.lengths

    return evaluate_lib.evaluate(generate_fn, eval_examples, k=config.eval.k, temperature=config.eval.temperature,
                                 template=config.tokenizer.template, tokenizer=tokenizer,
                                 reward_fn=lambda c, a: reward_pool.score(c, a)[0])

  def save(step: int) -> None:
    hist = list(history or ())
    checkpointer.save(step, {"state": state, "history": hist},
                      {"replay": strategy.state_dict(), "data": questions.state_dict()},
                      {"step": step, "config": config.to_dict(), "history_len": len(hist)})

  if start_step == 0:
    writer.write(0, evaluate(state.params))

  # ------------------------------------------------------------------------------------------------ Train loop
  last = dict(writer.latest)
  for step in range(start_step, config.total_steps):
    t_step = time.perf_counter()
    step_rng = jax.random.fold_in(rng, step)

    # Plan: which questions, fresh or from the buffer; ExGRPO scores the stored answers it may replay.
    t = time.perf_counter()
    plan = strategy.plan(step, questions.next)
    if plan.score_requests:
      entropy_batch, owners = rollout.answer_entropy_batch(
          book, plan.score_requests, prompt_len=prompt_len, completion_len=completion_len,
          rows=_round_up(sum(len(r.tokens) for r in plan.score_requests), rows), pad_id=sampler.pad_id)
      _, entropies = score(state.params, parallel.shard_batch(entropy_batch, mesh))
      plan = strategy.select(plan, rollout.mean_entropies(np.asarray(entropies), entropy_batch["completion_mask"],
                                                          owners, plan.score_requests))
    time_replay = time.perf_counter() - t

    # Sample and reward.
    t = time.perf_counter()
    sampled, rollout_info = rollout.sample_groups(
        lambda delay: policy(history[min(delay, len(history)) - 1] if delay and history else state.params),
        plan.requests, book, reward_pool, sampler, step=step, rng=step_rng, mesh=mesh,
        pad_batch_to=config.rollout.batch_size * config.rollout.group_size)
    time_rollout = time.perf_counter() - t

    # Compose the batch and let the strategy learn from what was sampled.
    t = time.perf_counter()
    groups = strategy.compose(plan, sampled)
    strategy.observe(plan, sampled)
    time_replay += time.perf_counter() - t

    # Update: old log-probs under the current params, then the jitted optimizer steps.
    t = time.perf_counter()
    clip_fresh = config.loss.clip and (config.loss.mixed_clip or not getattr(strategy, "active", False))
    dense = None
    if judge is not None:  # ExpRL: the judge's dense advantages replace the verifier's
      judged = rollout.dense_reward_groups(groups, book, completion_len=completion_len)
      dense = dense_lib.dense_rewards(judge, judged, tokenizer, **dense_lib.dense_reward_kwargs(config.exprl))
      rollout_info.update(dense.metrics)
    batch = parallel.shard_batch(rollout.build_batch(
        groups, book, prompt_len=prompt_len, completion_len=completion_len, rows=rows, pad_id=sampler.pad_id,
        clip_fresh=clip_fresh, token_advantages=None if dense is None else dense.advantages,
        loss_mask=None if dense is None else dense.loss_mask), mesh)
    batch["old_logp"], _ = score(state.params, batch)
    if reference is not None:
      batch["ref_logp"], _ = score(reference, batch)
    mismatch = _sampler_mismatch(batch)
    if history is not None:
      history.appendleft(jax.tree.map(jnp.copy, state.params))
    state, update_metrics = update(state, batch)
    jax.block_until_ready(state.step)
    time_update = time.perf_counter() - t

    # Log.
    done = step + 1
    if done % config.log_every == 0 or done == config.total_steps:
      sampled_rollouts = [r for g in sampled for r in g.rollouts]
      row = {
          **jax.device_get(update_metrics), **jax.device_get(mismatch), **rollout_info, **strategy.metrics(),
          "rollout/solve_rate": np.mean([r.reward >= replay.CORRECT_THRESHOLD for r in sampled_rollouts]),
          "rollout/response_length": np.mean([len(r.tokens) for r in sampled_rollouts]),
          "rollout/truncated": np.mean([not r.finished for r in sampled_rollouts]),
          "time/rollout_s": time_rollout, "time/update_s": time_update, "time/replay_s": time_replay,
          "time/step_s": time.perf_counter() - t_step,
      }
      if done % config.eval_every == 0 or done == config.total_steps:
        row.update(evaluate(state.params))
      writer.write(done, row)
      last = row
    elif done % config.eval_every == 0:
      writer.write(done, evaluate(state.params))
    writer.advance(done)

    if done % config.checkpoint_every == 0 or done == config.total_steps:
      save(done)

  writer.close()
  reward_pool.close()
  checkpointer.close()
  return last


def _build_judge(config, policy_model, tokenizer, mesh):
  """ExpRL's judge: an HTTP endpoint, a checkpoint run by our sampler, or (no path) a frozen copy of the policy."""
  judge_config = config.exprl.judge
  if judge_config.kind == "model":
    if judge_config.path:
      model, _ = models.load_pretrained(judge_config.path, mesh=mesh)
      tokenizer = data_lib.load_tokenizer(judge_config.path)
    else:
      graphdef, params = nnx.split(policy_model)
      model = nnx.merge(graphdef, jax.tree.map(jnp.copy, params))
    return judge_lib.judge_from_config(judge_config, model=model, tokenizer=tokenizer, mesh=mesh)
  return judge_lib.judge_from_config(judge_config)


def _round_up(n: int, multiple: int) -> int:
  return max(-(-n // multiple), 1) * multiple


@jax.jit
def _sampler_mismatch(batch: dict) -> dict:
  """How far the sampler's log-probs are from the trainer's on fresh tokens (numerics, or a delayed policy)."""
  mask = batch["completion_mask"] * (~batch["replayed"])[:, None]
  diff = batch["old_logp"] - batch["behaviour_logp"]
  count = jnp.maximum(mask.sum(), 1.0)
  return {"rollout/logp_mismatch_abs": jnp.sum(jnp.abs(diff) * mask) / count,
          "rollout/logp_mismatch_max": jnp.max(jnp.where(mask > 0, jnp.abs(diff), 0.0))}
