"""The training loop, read top to bottom: mesh, data, model, replay and rewards, restore, then per step
plan (replay) -> sample -> reward -> compose and observe (replay) -> update -> log -> eval -> checkpoint.

With P processes (multi-host) every process runs this same loop. Each owns 1/P of the questions, runs its own replay
strategy on B / P questions per step (seed + process index) and builds its own rows of the update batch; the global
batch is the hosts' pieces side by side (`parallel.shard_batch`). What must agree across hosts (resume step, padded
shapes, ExGRPO's phase switch, sampler calls, logged metrics, evaluation) agrees through the collectives of
`multihost.py`, whose docstring lists the rules. Host 0 alone writes config.json, metrics and the progress bar; all
processes write the checkpoint together (checkpointing.py).
"""
import collections
import dataclasses
import gc
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
from jaxrlvr import export as export_lib
from jaxrlvr import faults
from jaxrlvr import logs
from jaxrlvr import metrics as metrics_lib
from jaxrlvr import models
from jaxrlvr import multihost
from jaxrlvr import parallel
from jaxrlvr import plan_memory
from jaxrlvr import replay
from jaxrlvr import rewards
from jaxrlvr import rollout
from jaxrlvr import run_data
from jaxrlvr import sampling
from jaxrlvr import step as step_lib
from jaxrlvr import warm_start
from jaxrlvr.models import hf as hf_lib
from jaxrlvr.models import pretrained
from jaxrlvr.rewards import dense as dense_lib
from jaxrlvr.rewards import judge as judge_lib


def batch_rows(config: ml_collections.ConfigDict, batch_shards: int, num_hosts: int = 1) -> int:
  """Rows of every (global) update batch: each host's rows x `num_hosts`. A host's rows are the most rollouts the
  method can put in one step from its B / num_hosts questions, rounded up so that every optimizer step's
  micro-batches split evenly over the host's batch shards (filler rows make up the difference)."""
  rollouts = host_batch_size(config, num_hosts) * config.rollout.group_size
  if config.replay.name == "advantage_priority" and config.replay.composition == "fresh_anchored":
    rollouts += int(round(config.replay.replay_fraction * rollouts))
  if batch_shards % num_hosts:
    raise config_lib.ConfigError(f"config.mesh: the batch axes (data x fsdp) have {batch_shards} shards, not a "
                                 f"multiple of the {num_hosts} processes; each process must own whole batch shards")
  multiple = config.train.num_minibatches * config.train.num_microbatches * (batch_shards // num_hosts)
  return num_hosts * (-(-rollouts // multiple) * multiple)


def host_batch_size(config: ml_collections.ConfigDict, num_hosts: int) -> int:
  """Questions per step of each host: B / P, so every host contributes the same number of rows."""
  batch_size = config.rollout.batch_size
  if batch_size % num_hosts:
    raise config_lib.ConfigError(f"config.rollout.batch_size={batch_size}: must be divisible by the number of "
                                 f"processes ({num_hosts}); each process samples batch_size / {num_hosts} questions")
  return batch_size // num_hosts


def build_policy(config, mesh, book: rollout.PromptBook):
  """The policy to start RL from: an HF checkpoint, or a preset initialised at random, warm-started on the training
  rows' solutions (the embedded task's worked solutions, a dataset's `data.solution_field`) when every row has one.
  Rows without one on the embedded preset and tokenizer warm-start on the embedded task's worked solutions instead
  (`warm_start.embedded_fallback`): at random initialisation the model never finds a first correct answer."""
  if config.model.path:
    if config.warm_start.steps:
      logging.info("warm start skipped: model.path is set (the warm start is for a preset initialised at random)")
    return models.load_pretrained(config.model.path, dtype=jnp.dtype(config.model.param_dtype),
                                  compute_dtype=config.model.compute_dtype, mesh=mesh, remat=config.model.remat,
                                  attention=config.model.attention,
                                  attention_block_size=config.model.attention_block_size)
  model_config = models.get_preset(config.model.preset)
  model_config = dataclasses.replace(model_config, param_dtype=config.model.param_dtype,
                                     compute_dtype=config.model.compute_dtype, remat=config.model.remat,
                                     attention=config.model.attention,
                                     attention_block_size=config.model.attention_block_size)
  tokenizer = book.tokenizer
  if len(tokenizer) > model_config.vocab_size:
    raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but model preset {config.model.preset!r} has "
                     f"vocab_size {model_config.vocab_size}")
  model = parallel.create_model(model_config, mesh, seed=config.seed)
  if config.warm_start.steps:
    max_rows = config.warm_start.steps * config.warm_start.batch_size
    pairs, missing = data_lib.warm_start_pairs(book.source, tokenizer, book.prompt_ids, max_rows=max_rows,
                                               completion_len=config.rollout.max_new_tokens)
    task = config.data.source
    if missing and warm_start.embedded_fallback(config):
      pairs, task = warm_start.embedded_pairs(config, tokenizer, max_rows), warm_start.EMBEDDED_TASK
      note = (f"{missing} of the first {min(len(book.source), max_rows)} training rows of {config.data.source} have no "
              f"'{config.data.solution_field}' (data.solution_field) to imitate, so the {config.model.preset!r} preset "
              f"is warm-started on the embedded task's worked solutions ({warm_start.EMBEDDED_TASK}, the default "
              f"command's cached warm start) and RL then trains on the rows of {config.data.source}; "
              "--config.warm_start.embedded_fallback=False skips this")
      logging.info("warm start on the embedded task: %s", note)
      if multihost.is_main():
        print(f"jaxrlvr: {note}.")
    if missing and not pairs:
      logging.info("warm start skipped: %d of the first %d training rows of %s have no '%s' (data.solution_field) to "
                   "imitate, so RL starts from the %r preset at random initialisation", missing,
                   min(len(book.source), max_rows), config.data.source, config.data.solution_field,
                   config.model.preset)
    else:
      model = warm_start.cached_warm_start(
          model, model_config, tokenizer, pairs, task=task, steps=config.warm_start.steps,
          lr=config.warm_start.lr, batch_size=config.warm_start.batch_size, seed=config.seed,
          prompt_len=config.data.max_prompt_len, completion_len=config.rollout.max_new_tokens,
          cache_dir=config.warm_start.cache_dir, mesh=mesh)
  return model, model_config


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains (or resumes, or reports a finished run) and returns the last logged metrics."""
  # ------------------------------------------------------------------------------------------------ Mesh
  num_devices = jax.device_count()
  config_lib.validate(config, num_devices=num_devices)
  config = pretrained.resolve_paths(config)  # a preset with shipped weights and no model.path: their directory
  mesh = parallel.make_mesh(*config_lib.mesh_shape(config.mesh, num_devices))
  batch_sharding = parallel.batch_sharding(mesh)
  batch_shards = parallel.batch_shards(mesh)
  num_hosts, host_id = jax.process_count(), jax.process_index()
  host_batch = host_batch_size(config, num_hosts)
  is_main = multihost.is_main()
  if num_hosts > 1 and config.method == "exprl" and config.exprl.judge.kind == "model":
    raise config_lib.ConfigError(
        f"config.exprl.judge.kind='model' runs on one process only ({num_hosts} here): the judge's sampler calls "
        "differ per host; serve the judge over HTTP (kind='http') for multi-process runs")
  if num_hosts > 1 and config.rollout.engine == "continuous":
    raise config_lib.ConfigError(f"config.rollout.engine='continuous' runs on one process only ({num_hosts} here); "
                                 "use rollout.engine='static' for multi-process runs")
  os.makedirs(workdir, exist_ok=True)

  # ------------------------------------------------------------------------------------------------ Checkpoints
  checkpointer = checkpointing.Checkpointer(workdir, keep=config.keep_checkpoints)
  latest = checkpointer.latest_readable_step()  # one whose metadata cannot be read is moved aside, and said
  multihost.check_same(-1 if latest is None else latest, "the latest checkpoint step")
  if latest is not None:  # refuse a resumption that cannot be exact (or a change it would ignore) before anything
    meta = checkpointer.read_meta(latest)
    checkpointer.check_config(meta, config, step=latest)
    if latest >= config.total_steps:
      logging.info("run in %s already finished at step %d of %d", workdir, latest, config.total_steps)
      export_lib.export_if_missing(workdir, latest)  # killed between its last checkpoint and its export
      print(f"jaxrlvr: the run in {workdir} is finished (step {latest} of {config.total_steps}); nothing to do.")
      return {}
    checkpointer.check_processes(meta)
    extension = checkpointing.extension_note(meta["config"], config.to_dict(), step=latest)
    if extension and is_main:
      logging.info("the run in %s %s", workdir, extension)
      print(f"jaxrlvr: the run in {workdir} {extension}.")
  if is_main:  # only now: a refused resumption leaves the run's config.json as it was
    with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
      json.dump(config.to_dict(), f, indent=2, sort_keys=True)

  # ------------------------------------------------------------------------------------------------ Data
  tokenizer = data_lib.tokenizer_from_config(config)
  train_set, eval_set = data_lib.sources_from_config(config)
  num_eval = min(len(eval_set), config.data.eval_size or len(eval_set))
  eval_examples = [eval_set[q] for q in range(num_eval)]
  # Every prompt the run will see, checked now: a row that does not fit stops here with its file and row.
  eval_key = "data.eval_source" if config.data.eval_source else "data.source"
  data_lib.check_prompts([("data.source", train_set, len(train_set)), (eval_key, eval_set, num_eval)], tokenizer,
                         template=config.tokenizer.template, max_prompt_len=config.data.max_prompt_len,
                         max_new_tokens=config.rollout.max_new_tokens, model_context=_model_context(config))
  questions = data_lib.QuestionIterator(range(rl_train_size(config, train_set)), seed=config.seed, host_id=host_id,
                                        num_hosts=num_hosts)
  book = rollout.PromptBook(train_set, tokenizer, template=config.tokenizer.template,
                            max_prompt_len=config.data.max_prompt_len)
  sampler = rollout.SamplerSettings(
      max_new_tokens=config.rollout.max_new_tokens, temperature=config.rollout.temperature,
      top_p=config.rollout.top_p, top_k=config.rollout.top_k, eos_ids=tuple(data_lib.stop_token_ids(tokenizer)),
      pad_id=tokenizer.pad_token_id, **sampler_limits(config), **sampler_engine(config))
  prompt_len = sampling.bucket_length(config.data.max_prompt_len)
  completion_len = config.rollout.max_new_tokens
  rows = batch_rows(config, batch_shards, num_hosts)
  host_rows = rows // num_hosts  # this host's piece of every update batch
  micro_rows = rows // (config.train.num_minibatches * config.train.num_microbatches)  # rows of one micro-batch

  # ------------------------------------------------------------------------------------------------ Model
  model, model_config = build_policy(config, mesh, book)
  graphdef, params = nnx.split(model)
  sharding = f"\n{parallel.describe_sharding(model)}" if logs.log_sharding() else " (--log_sharding lists them)"
  logging.info("policy: %s parameters%s", f"{parallel.param_count(model):,}", sharding)
  optimizer = step_lib.make_optimizer(config)
  state = step_lib.create_state(params, optimizer, mesh)
  state_sharding = jax.tree.map(lambda x: x.sharding, state)
  update = step_lib.make_update_fn(graphdef, config, optimizer, state_sharding=state_sharding,
                                   batch_sharding=batch_sharding)
  score = step_lib.make_score_fn(graphdef, temperature=config.rollout.temperature or 1.0,
                                 batch_sharding=batch_sharding, max_chunk_rows=micro_rows)
  reference = jax.tree.map(jnp.copy, params) if config.loss.kl_coef > 0 else None

  # ------------------------------------------------------------------------------------------------ Replay, rewards
  strategy = replay.make(config.replay.name, config, batch_size=host_batch, seed=config.seed + host_id)
  reward_pool = rewards.MathRewardPool.from_config(config)
  judge = _build_judge(config, model, tokenizer, mesh) if config.method == "exprl" else None
  max_delay = config.replay.get("policy_delay", 0)
  # BAPO samples with the parameters of `policy_delay` updates ago: history[d] = params d updates ago.
  history = collections.deque(maxlen=max_delay) if max_delay else None

  # ------------------------------------------------------------------------------------------------ Restore
  start_step = 0
  if latest is not None:
    target = lambda meta: checkpointing.abstract_like({"state": state, "history": [state.params] * meta["history_len"]})
    latest, restored, host = checkpointer.restore_readable(latest, target, config)  # or the one before, if unreadable
    state = restored["state"]
    if history is not None:
      history.extend(restored["history"])
    strategy.load_state_dict(host["replay"])
    questions.load_state_dict(host["data"])
    start_step = latest
    logging.info("resumed from %s at step %d", checkpointer.directory, latest)
  writer = metrics_lib.MetricWriter(workdir, total_steps=config.total_steps, initial_step=start_step,
                                    enabled=is_main,
                                    summary_title=f"{config.method}: {os.path.basename(os.path.abspath(workdir))}")
  rng = jax.random.key(config.seed)
  signals = faults.StopSignals()  # SIGTERM, Ctrl-C: the step in flight finishes, is saved, the run exits (faults.py)

  def policy(params):
    return nnx.merge(graphdef, params)

  def evaluate(params, step: int) -> dict:
    eval_model = policy(params)

    def generate_fn(prompts, temperature, n):
      # Each host samples its share of the rows; all hosts then hold every completion and score the same ones.
      ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
      prompt_rows = [p for p in ids for _ in range(n)]
      start, stop = multihost.split_rows(len(prompt_rows))
      mine = prompt_rows[start:stop] or prompt_rows[:1]  # a host without rows still joins the sampler call
      out = sampling.generate(eval_model, mine, max_new_tokens=completion_len,
                              rng=jax.random.key(config.seed + 1), temperature=temperature,
                              eos_ids=sampler.eos_ids, pad_id=sampler.pad_id, mesh=mesh, **sampler.memory_limits(),
                              **sampler.engine_settings())
      tokens = multihost.gather_rows(out.tokens[:stop - start], len(prompt_rows))  # [N * n, T]
      lengths = multihost.gather_rows(out.lengths[:stop - start], len(prompt_rows))  # [N * n]
      return rollout.decode(tokenizer, tokens, lengths), lengths

    metrics, samples = evaluate_lib.evaluate_with_samples(
        generate_fn, eval_examples, k=config.eval.k, temperature=config.eval.temperature,
        template=config.tokenizer.template, tokenizer=tokenizer, reward_fn=lambda c, a: reward_pool.score(c, a)[0],
        num_samples=config.eval.num_samples)
    writer.write_samples(step, samples)  # DIR/samples.jsonl: what the model answers, next to its accuracy
    return metrics

  def save(step: int) -> None:
    hist = list(history or ())
    checkpointer.save(step, {"state": state, "history": hist},
                      {"replay": strategy.state_dict(), "data": questions.state_dict()},
                      {"step": step, "config": config.to_dict(), "history_len": len(hist)})

  def observe(plan, sampled, groups, old_logp) -> float:
    """The strategy stores, buckets and retires from the final groups before the update, and returns the seconds it
    took. `replay.behaviour_logprobs="trainer"` (ExGRPO's released code) stores the trainer's recomputed log-probs
    of each new answer as its pi_past, not the sampler's."""
    t = time.perf_counter()
    if config.replay.get("behaviour_logprobs", "sampler") == "trainer":
      rollout.record_logprobs(groups, multihost.local_rows(old_logp))
    strategy.observe(plan, sampled)
    # What the buffer now keeps joins the frozen objects after one collection of the young ones: otherwise every
    # automatic full collection re-scans the growing buffer (+5% of ExGRPO's step time on the embedded default).
    gc.collect()
    gc.freeze()
    multihost.agree_phase(strategy)  # ExGRPO: replay turns on for every host at once
    return time.perf_counter() - t

  unsolvable = faults.UnsolvableWatch(config, start_step=start_step, num_eval=num_eval, writer=writer)
  if start_step == 0:
    writer.write(0, unsolvable.evaluated(evaluate(state.params, 0)))

  # ------------------------------------------------------------------------------------------------ Train loop
  last = dict(writer.latest)
  # Everything built so far (libraries, model, compiled steps) lives until the end: freezing it keeps Python's cyclic
  # GC from re-scanning it in every full collection, which cost ExGRPO +5% step time on the embedded default.
  gc.collect()
  gc.freeze()
  nonfinite = faults.NonFiniteStreak(config.optim.get("max_nonfinite_steps", 0), checkpointer.directory)
  for step in range(start_step, config.total_steps):
    t_step = time.perf_counter()
    step_rng = jax.random.fold_in(rng, step)

    # Plan: which questions, fresh or from the buffer; ExGRPO scores the stored answers it may replay.
    t = time.perf_counter()
    plan = strategy.plan(step, questions.next)
    # Every host pads its stored answers to the same row count (the largest), and joins the scoring call even with
    # none of its own to score.
    num_answers = multihost.agree_max(sum(len(r.tokens) for r in plan.score_requests))
    if num_answers:
      entropy_batch, owners = rollout.answer_entropy_batch(
          book, plan.score_requests, prompt_len=prompt_len, completion_len=completion_len,
          rows=_entropy_rows(num_answers, batch_shards // num_hosts), pad_id=sampler.pad_id)
      _, entropies = score(state.params, parallel.shard_batch(entropy_batch, mesh))
      if plan.score_requests:
        plan = strategy.select(plan, rollout.mean_entropies(
            multihost.local_rows(entropies), entropy_batch["completion_mask"], owners, plan.score_requests))
    time_replay = time.perf_counter() - t

    # Sample and reward.
    t = time.perf_counter()
    policy_at = lambda delay: policy(history[min(delay, len(history)) - 1] if delay and history else state.params)
    _join_sampler_calls(policy_at, plan.requests, book, sampler, rng=step_rng, mesh=mesh,
                        pad_batch_to=host_batch * config.rollout.group_size)
    sampled, rollout_info = rollout.sample_groups(
        policy_at, plan.requests, book, reward_pool, sampler, step=step, rng=step_rng, mesh=mesh,
        pad_batch_to=host_batch * config.rollout.group_size)
    time_rollout = time.perf_counter() - t

    # Compose the batch.
    t = time.perf_counter()
    groups = strategy.compose(plan, sampled)
    unsolvable.sampled(step + 1, sampled)  # stops a run that solves nothing (train.stop_if_unsolvable_steps)
    if is_main:  # DIR/questions.jsonl: what each question scored at each visit (the comparison's revisit share)
      run_data.append_questions(workdir, step + 1, plan.requests, sampled, threshold=replay.CORRECT_THRESHOLD,
                                composed=groups)
    time_replay += time.perf_counter() - t

    # Update: old log-probs under the current params, the strategy learns from the batch, the optimizer steps.
    t = time.perf_counter()
    clip_fresh = fresh_tokens_clipped(config, plan)
    dense = None
    if judge is not None:  # ExpRL: the judge's dense advantages replace the verifier's
      judged = rollout.dense_reward_groups(groups, book, completion_len=completion_len)
      dense = dense_lib.dense_rewards(judge, judged, tokenizer, **dense_lib.dense_reward_kwargs(config.exprl))
      rollout_info.update(dense.metrics)
    batch = parallel.shard_batch(rollout.build_batch(
        groups, book, prompt_len=prompt_len, completion_len=completion_len, rows=host_rows, pad_id=sampler.pad_id,
        clip_fresh=clip_fresh, token_advantages=None if dense is None else dense.advantages,
        loss_mask=None if dense is None else dense.loss_mask,
        drop_constant_groups=config.loss.drop_constant_groups), mesh)
    batch["old_logp"], _ = score(state.params, batch)
    time_observe = observe(plan, sampled, groups, batch["old_logp"])
    if reference is not None:
      batch["ref_logp"], _ = score(reference, batch)
    mismatch = _sampler_mismatch(batch)
    if history is not None:
      history.appendleft(jax.tree.map(jnp.copy, state.params))
    state, update_metrics = update(state, batch)
    jax.block_until_ready(state.step)
    time_update = time.perf_counter() - t - time_observe
    time_replay += time_observe

    # Log.
    done = step + 1
    if done % config.log_every == 0 or done == config.total_steps:
      sampled_rollouts = [r for g in sampled for r in g.rollouts]
      host_metrics = {
          **rollout_info, **strategy.metrics(),
          "rollout/solve_rate": np.mean([r.reward >= replay.CORRECT_THRESHOLD for r in sampled_rollouts]),
          "rollout/response_length": np.mean([len(r.tokens) for r in sampled_rollouts]),
          "rollout/truncated": np.mean([not r.finished for r in sampled_rollouts]),
          "loss/fresh_clip_on": float(clip_fresh),
          "time/rollout_s": time_rollout, "time/update_s": time_update, "time/replay_s": time_replay,
          "time/step_s": time.perf_counter() - t_step,
      }
      row = {**jax.device_get(update_metrics), **jax.device_get(mismatch), **multihost.host_mean(host_metrics)}
      if done % config.eval_every == 0 or done == config.total_steps:
        row.update(evaluate(state.params, done))
      writer.write(done, row)
      _log_host_row(done, row, num_hosts)
      last = row
    elif done % config.eval_every == 0:
      writer.write(done, evaluate(state.params, done))
    writer.advance(done)
    nonfinite.check(done, update_metrics)

    saved = done % config.checkpoint_every == 0 or done == config.total_steps
    if saved:
      save(done)
    if done < config.total_steps and signals.agreed():  # the same point of every step on every host
      signals.stop(done, save=None if saved else lambda: save(done),
                close=(writer.close, reward_pool.close, checkpointer.close))
  signals.restore()

  gc.unfreeze()
  # After the final checkpoint: a run killed here restarts as finished and writes the export then.
  export_lib.export_hf(policy(state.params), model_config, tokenizer, os.path.join(workdir, export_lib.FINAL_DIR),
                       dtype=export_lib.run_dtype(config))
  writer.close()
  reward_pool.close()
  checkpointer.close()
  return last


def rl_train_size(config: ml_collections.ConfigDict, train_set) -> int:
  """How many training rows RL draws its fresh questions from: the first `data.rl_train_size` (0: all). The warm
  start reads every row either way, so a data-limited run starts from the same weights as one with all of them."""
  size = config.data.get("rl_train_size", 0)  # absent from a config built by hand: all rows
  if not 0 <= size <= len(train_set):
    raise config_lib.ConfigError(f"config.data.rl_train_size={size}: must be in [0, {len(train_set)}], the rows of "
                                 f"data.source {train_set!r} (0: all of them)")
  return size or len(train_set)


def fresh_tokens_clipped(config: ml_collections.ConfigDict, plan: replay.Plan) -> bool:
  """Whether the PPO clip applies to the fresh tokens of the batch `plan` made: always, but in ExGRPO's mixed phase
  without `loss.mixed_clip` (the released code). The phase is the plan's, so the batch whose solve rate switches
  replay on is trained on-policy, clipped, as it was sampled."""
  return bool(config.loss.clip) and (bool(config.loss.mixed_clip) or not plan.mixed_phase)


def _model_context(config) -> int | None:
  """The model's max_position_embeddings, for messages about prompt lengths (None: the checkpoint's config.json
  cannot be read; loading the model reports that)."""
  if not config.model.path:
    return models.get_preset(config.model.preset).max_position_embeddings
  try:
    return int(hf_lib.read_config(config.model.path).get("max_position_embeddings", 0)) or None
  except (OSError, ValueError):
    return None


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
    return judge_lib.judge_from_config(judge_config, model=model, tokenizer=tokenizer, mesh=mesh,
                                       sampler_limits={**sampler_limits(config), **sampler_engine(config)})
  return judge_lib.judge_from_config(judge_config)


def sampler_limits(config) -> dict[str, int]:
  """The rollout.* memory bounds of every sampler call (rollouts, evaluation, the model judge), as keyword
  arguments of `sampling.generate`; max_rows_per_device as `plan_memory.rows_per_sampler_call` resolves it."""
  limits = {name: int(config.rollout[name]) for name in sampling.MEMORY_LIMITS}
  return {**limits, "max_rows_per_device": plan_memory.rows_per_sampler_call(config)}


def sampler_engine(config) -> dict:
  """How every sampler call decodes (config rollout.engine, decode_slots, decode_chunk_steps, decode_weights), as
  keyword arguments of `sampling.generate`."""
  return {name: config.rollout[name] for name in sampling.ENGINE_SETTINGS}


def _join_sampler_calls(policy_at, requests, book: rollout.PromptBook, settings: rollout.SamplerSettings, *, rng,
                        mesh, pad_batch_to: int) -> None:
  """Multi-host: joins, with a throw-away prompt, the sampler calls other hosts make for policy delays this host has
  no request for (BAPO re-rolls only where the FIFO is not empty). `rollout.sample_groups` samples the delays in
  increasing order, after these calls, so only delays below this host's smallest can be joined this way."""
  local = {r.policy_delay for r in requests}
  for delay in multihost.missing_delays(local):
    if delay > min(local):
      raise RuntimeError(f"train.py: another host samples at policy delay {delay}, between this host's delays "
                         f"{sorted(local)}; the sampler calls cannot be matched")
    sampling.generate(policy_at(delay), [book.prompt_ids(requests[0].qid)], max_new_tokens=settings.max_new_tokens,
                      rng=jax.random.fold_in(rng, delay), temperature=settings.temperature, top_p=settings.top_p,
                      top_k=settings.top_k, eos_ids=settings.eos_ids, pad_id=settings.pad_id, mesh=mesh,
                      pad_batch_to=pad_batch_to, **settings.memory_limits(),
                      **settings.engine_settings())  # the same calls as the other hosts


def _log_host_row(step: int, row: dict, num_hosts: int) -> None:
  """Multi-host: every host logs the global metrics it computed (they must be the same on every host; the
  multi-host test compares them). metrics.jsonl has host 0's."""
  if num_hosts > 1:
    values = {k: metrics_lib.to_python(v) for k, v in sorted(row.items())}
    logging.info("host %d global metrics at step %d: %s", jax.process_index(), step, json.dumps(values))


def _entropy_rows(n: int, granule: int) -> int:
  """Rows of the batch that scores n stored answers: the next power of two (at least `granule`, this host's batch
  shards, then a multiple of it), so the pass costs about what the answers do while the scorer compiles for a handful
  of shapes only."""
  rows = max(granule, 1 << max(n - 1, 0).bit_length())
  return -(-rows // granule) * granule


@jax.jit
def _sampler_mismatch(batch: dict) -> dict:
  """How far the sampler's log-probs are from the trainer's on fresh tokens (numerics, or a delayed policy)."""
  mask = batch["completion_mask"] * (~batch["replayed"])[:, None]
  diff = batch["old_logp"] - batch["behaviour_logp"]
  count = jnp.maximum(mask.sum(), 1.0)
  return {"rollout/logp_mismatch_abs": jnp.sum(jnp.abs(diff) * mask) / count,
          "rollout/logp_mismatch_max": jnp.max(jnp.where(mask > 0, jnp.abs(diff), 0.0))}
