"""The training loop, read top to bottom: the run's parts (run_setup.py: mesh, data, policy, replay, rewards), restore,
then per step plan (replay) -> sample and reward -> compose -> update (the strategy observes the batch) -> log ->
eval -> checkpoint; each phase is a method of `Trainer`, called in that order by `run`.

With P processes (multi-host) every process runs this same loop. Each owns 1/P of the questions, runs its own replay
strategy on B / P questions per step (seed + process index) and builds its own rows of the update batch; the global
batch is the hosts' pieces side by side (`parallel.shard_batch`). What must agree across hosts (resume step, padded
shapes, ExGRPO's phase switch, sampler calls, logged metrics, evaluation) agrees through the collectives of
`multihost.py`, whose docstring lists the rules. Host 0 alone writes config.json, metrics and the progress bar; all
processes write the checkpoint together (checkpointing.py).
"""
import collections
import contextlib
import copy
import functools
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
from jaxrlvr import compile_ahead
from jaxrlvr import evaluate as evaluate_lib
from jaxrlvr import export as export_lib
from jaxrlvr import faults
from jaxrlvr import health
from jaxrlvr import logs
from jaxrlvr import multihost
from jaxrlvr import outputs
from jaxrlvr import packing
from jaxrlvr import parallel
from jaxrlvr import replay
from jaxrlvr import rewards
from jaxrlvr import rollout
from jaxrlvr import run_setup
from jaxrlvr import step as step_lib


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains (or resumes, or reports a finished run) and returns the last logged metrics."""
  config, mesh = run_setup.prepare(config)
  os.makedirs(workdir, exist_ok=True)
  checkpointer = checkpointing.Checkpointer(workdir, keep=config.keep_checkpoints)
  latest = _resumable_step(checkpointer, config, workdir)
  if latest is not None and latest >= config.total_steps:
    return {}
  if multihost.is_main():  # only now: a refused resumption leaves the run's config.json as it was
    with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
      json.dump(config.to_dict(), f, indent=2, sort_keys=True)

  trainer = Trainer(config, workdir, mesh, checkpointer)  # data, policy, compiled steps, replay, rewards
  start_step = 0 if latest is None else trainer.restore(latest)
  writer = trainer.open_writer(start_step)
  signals = faults.StopSignals()  # SIGTERM, Ctrl-C: the step in flight finishes, is saved, the run exits (faults.py)
  unsolvable = faults.UnsolvableWatch(config, start_step=start_step, num_eval=len(trainer.data.eval_examples),
                                      writer=writer)
  nonfinite = faults.NonFiniteStreak(config.optim.get("max_nonfinite_steps", 0), checkpointer.directory)
  token_marks = TokenMarks(config, workdir, start_step)  # eval.token_marks: the comparison's budget marks
  # Warns (train.stop_on_collapse: stops) when held-out accuracy falls back or the rollouts stop solving (health.py).
  watch = health.Watch(health.Thresholds.from_config(config),
                       num_train=run_setup.rl_train_size(config, trainer.data.train_set))
  trainer.prepare_first_rollout()  # in the background, beside the step-0 evaluation
  if start_step == 0:
    writer.write(0, _with_health(watch, config, 0, unsolvable.evaluated(trainer.evaluate(0))))
    _note_held_out(config, trainer.data, writer.latest)

  last = dict(writer.latest)
  # Everything built so far (libraries, model, compiled steps) lives until the end: freezing it keeps Python's cyclic
  # GC from re-scanning it in every full collection, which cost ExGRPO +5% step time on the embedded default.
  gc.collect()
  gc.freeze()
  rng = jax.random.key(config.seed)
  for step in range(start_step, config.total_steps):
    t_step = time.perf_counter()
    step_rng = jax.random.fold_in(rng, step)
    times = collections.Counter()

    # Plan: which questions, fresh or from the buffer; ExGRPO scores the stored answers it may replay.
    with _timer(times, "replay"):
      plan = trainer.plan(step)
    # Sample and reward.
    with _timer(times, "rollout"):
      sampled, rollout_info = trainer.sample(plan, step, step_rng)
    # Compose the batch the update trains on.
    with _timer(times, "replay"):
      groups = trainer.compose(plan, sampled, step)
      unsolvable.sampled(step + 1, sampled)  # stops a run that solves nothing (train.stop_if_unsolvable_steps)
    # Update: old log-probs under the current params, the strategy learns from the batch, the optimizer steps.
    with _timer(times, "update"):
      update_metrics, clip_fresh = trainer.update(plan, sampled, groups, rollout_info, times)

    # Log, evaluate, checkpoint.
    done = step + 1
    mark = token_marks.reached(rollout_info[outputs.TOKENS_KEY])  # before the `or`: it counts every step's tokens
    evaluating = done % config.eval_every == 0 or done == config.total_steps or mark
    if done % config.log_every == 0 or done == config.total_steps:
      times["step"] = time.perf_counter() - t_step
      row = trainer.log_row(sampled, rollout_info, update_metrics, clip_fresh, times)
      if evaluating:
        row.update(trainer.evaluate(done))
      row = _with_health(watch, config, done, row)
      writer.write(done, row)
      _log_host_row(done, row, jax.process_count())
      last = row
    elif evaluating:
      writer.write(done, _with_health(watch, config, done, trainer.evaluate(done)))
    writer.advance(done)
    _stop_if_collapsed(watch, config, done, writer)
    nonfinite.check(done, update_metrics["metrics"])

    saved = done % config.checkpoint_every == 0 or done == config.total_steps
    if saved:
      trainer.save(done)
    if done < config.total_steps and signals.agreed():  # the same point of every step on every host
      signals.stop(done, save=None if saved else lambda: trainer.save(done),
                   close=(writer.close, trainer.reward_pool.close, checkpointer.close))
  signals.restore()

  gc.unfreeze()
  trainer.export(config.total_steps)  # after the final checkpoint: a run killed here restarts as finished, exports then
  writer.close()
  trainer.reward_pool.close()
  checkpointer.close()
  return last


def _resumable_step(checkpointer: checkpointing.Checkpointer, config: ml_collections.ConfigDict,
                    workdir: str) -> int | None:
  """The step the run resumes from (None: a new run), its checkpoint checked against the config: a resumption that
  cannot be exact (or a change it would ignore) is refused before anything is loaded. A finished run is reported,
  its export written if it was killed before it."""
  latest = checkpointer.latest_readable_step()  # one whose metadata cannot be read is moved aside, and said
  multihost.check_same(-1 if latest is None else latest, "the latest checkpoint step")
  if latest is None:
    return None
  meta = checkpointer.read_meta(latest)
  checkpointer.check_config(meta, config, step=latest)
  if latest >= config.total_steps:
    export_lib.export_if_missing(workdir, latest)  # killed between its last checkpoint and its export
    logs.say(f"the run in {workdir} is finished (step {latest} of {config.total_steps}); nothing to do.")
    return latest
  checkpointer.check_processes(meta)
  extension = checkpointing.extension_note(meta["config"], config.to_dict(), step=latest)
  if extension and multihost.is_main():
    logs.say(f"the run in {workdir} {extension}.")
  return latest


class Trainer:
  """One run's parts (run_setup.py builds them) and the phases of its step, as `run` calls them in order."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, mesh, checkpointer):
    self.config, self.workdir, self.mesh, self.checkpointer = config, workdir, mesh, checkpointer
    self.batch_shards, self.num_hosts = parallel.batch_shards(mesh), jax.process_count()
    self.data = run_setup.load_data(config)
    self.questions = run_setup.question_iterator(config, self.data.train_set)
    self.shapes = run_setup.shapes(config, self.batch_shards, self.num_hosts)
    self.sampler = run_setup.sampler_settings(config, self.data.tokenizer)

    model, self.model_config = run_setup.build_policy(config, mesh, self.data.book)
    self.graphdef, params = nnx.split(model)
    sharding = f"\n{parallel.describe_sharding(model)}" if logs.log_sharding() else " (--log_sharding lists them)"
    logging.info("policy: %s parameters%s", f"{parallel.param_count(model):,}", sharding)
    optimizer = step_lib.make_optimizer(config)
    self.state = step_lib.create_state(params, optimizer, mesh)
    batch_sharding = parallel.batch_sharding(mesh)
    make_update = functools.partial(step_lib.make_update_fn, self.graphdef, config, optimizer,
                                    state_sharding=jax.tree.map(lambda x: x.sharding, self.state),
                                    batch_sharding=batch_sharding)
    self._update = make_update()
    # The update that runs each prompt once for its group's samples, for the batches laid out so (each compiles at
    # its first use: a GRPO run compiles only this one). prompt_group: its group size, 1 where it is off.
    group = config.rollout.group_size
    shared = config.train.get("share_prompts", False) and step_lib.prompt_group_fits(
        self.shapes.rows, group, config, self.batch_shards)
    self.prompt_group = group if shared else 1
    self._update_shared = make_update(prompt_group=group) if shared else None
    self.packed_rows = packing.row_options(config, shared=shared, batch_shards=self.batch_shards,
                                           num_hosts=self.num_hosts, micro_rows=self.shapes.micro_rows)
    make_score = functools.partial(step_lib.make_score_fn, self.graphdef,
                                   temperature=config.rollout.temperature or 1.0, batch_sharding=batch_sharding,
                                   max_chunk_rows=self.shapes.micro_rows)
    self._score = make_score()
    self._score_shared = make_score(prompt_group=group) if shared else None  # the update batch's, as above
    self.reference = jax.tree.map(jnp.copy, params) if config.loss.kl_coef > 0 else None
    self._compile_first_step_ahead(shared, batch_sharding)

    self.strategy = run_setup.replay_strategy(config, self.shapes.host_batch)
    self.reward_pool = rewards.MathRewardPool.from_config(config)
    self.judge = run_setup.build_judge(config, model, self.data.tokenizer, mesh)
    # BAPO samples with the parameters of `policy_delay` updates ago: history[d] = params d updates ago.
    max_delay = config.replay.get("policy_delay", 0)
    self.history = collections.deque(maxlen=max_delay) if max_delay else None
    self.writer = None
    self._first_rollout = None  # prepare_first_rollout's future

  def _compile_first_step_ahead(self, shared: bool, batch_sharding) -> None:
    """Starts compiling (or loading from the persistent cache) what the first update batch runs, in a thread
    (compile_ahead.py), so that it overlaps the step-0 evaluation and the first rollout: the scoring pass where one
    runs, then the update, each in the variant a batch of whole groups takes."""
    host = rollout.build_batch([], self.data.book, prompt_len=self.shapes.prompt_len,
                               completion_len=self.shapes.completion_len, rows=self.shapes.host_rows,
                               pad_id=self.sampler.pad_id, clip_fresh=False)  # filler rows only: the keys and dtypes
    batch = {k: jax.ShapeDtypeStruct((self.shapes.rows, *v.shape[1:]), jax.dtypes.canonicalize_dtype(v.dtype),
                                     sharding=batch_sharding) for k, v in host.items()}  # the global batch
    logp = jax.ShapeDtypeStruct((self.shapes.rows, self.shapes.completion_len), jnp.float32, sharding=batch_sharding)
    if step_lib.needs_score_pass(self.config):
      if shared:
        self._score_shared = compile_ahead.Ahead(self._score_shared, self.state.params, batch, name="score")
      else:
        self._score = compile_ahead.Ahead(self._score, self.state.params, batch, name="score")
      batch = {**batch, "old_logp": logp}
    if self.reference is not None:
      batch = {**batch, "ref_logp": logp}
    if shared:
      self._update_shared = compile_ahead.Ahead(self._update_shared, self.state, batch, name="update")
      # Then the packed updates (train.pack_completions): a batch packs once its row count's update is ready, so the
      # first step waits for one compile (or load from the cache), as without packing.
      self._packed_ready = {rows: self._update_shared.add(self.state, {**batch, **packing.example(
          self.config, rows, rows=self.shapes.rows, sharding=batch_sharding)}) for rows in self.packed_rows}
    else:
      self._update = compile_ahead.Ahead(self._update, self.state, batch, name="update")

  def prepare_first_rollout(self) -> None:
    """Starts compiling, or loading from the persistent cache, what the first rollout's sampler runs, in a thread
    beside the first update's compile (compile_ahead.py), so that it overlaps the step-0 evaluation; the first
    `sample` waits for it. Its prompts are the next fresh questions' (drawn from a copy of the iterator): their number
    and length fix the programs' shapes. The rollout engine only (`rollout.prepare_sampling`)."""
    if self.sampler.engine == "static":
      return
    group = self.config.rollout.group_size
    qids = copy.deepcopy(self.questions).next(self.shapes.host_batch)
    prompts = [self.data.book.prompt_ids(q) for q in qids for _ in range(group)]  # tokenised here, not in the thread
    self._first_rollout = compile_ahead.in_background(
        rollout.prepare_sampling, self.policy(self.state.params), prompts, self.sampler, mesh=self.mesh,
        pad_batch_to=self.shapes.host_batch * group)

  # ---------------------------------------------------------------------------------------------- Run state
  def restore(self, latest: int) -> int:
    """Loads the checkpoint of step `latest` (or the one before, if it is unreadable); returns its step."""
    target = lambda meta: checkpointing.abstract_like({"state": self.state,
                                                       "history": [self.state.params] * meta["history_len"]})
    latest, restored, host = self.checkpointer.restore_readable(latest, target, self.config)
    self.state = restored["state"]
    if self.history is not None:
      self.history.extend(restored["history"])
    self.strategy.load_state_dict(host["replay"])
    self.questions.load_state_dict(host["data"])
    logging.info("resumed from %s at step %d", self.checkpointer.directory, latest)
    return latest

  def open_writer(self, start_step: int) -> outputs.MetricWriter:
    self.writer = outputs.MetricWriter(
        self.workdir, total_steps=self.config.total_steps, initial_step=start_step, enabled=multihost.is_main(),
        summary_title=f"{self.config.method}: {os.path.basename(os.path.abspath(self.workdir))}")
    return self.writer

  def save(self, step: int) -> None:
    hist = list(self.history or ())
    self.checkpointer.save(step, {"state": self.state, "history": hist},
                           {"replay": self.strategy.state_dict(), "data": self.questions.state_dict()},
                           {"step": step, "config": self.config.to_dict(), "history_len": len(hist)})

  def export(self, step: int) -> None:
    """Writes DIR/hf from the policy of `step`, whose checkpoint is already written. An export the disk refuses stops
    the run with what is kept and how to write the export later."""
    try:
      export_lib.export_hf(self.policy(self.state.params), self.model_config, self.data.tokenizer,
                           os.path.join(self.workdir, export_lib.FINAL_DIR), dtype=export_lib.run_dtype(self.config))
    except export_lib.ExportError as e:
      raise export_lib.ExportError(
          f"{e}. The run's checkpoint of step {step} is kept: once there is room, the same command writes the "
          f"missing export (or python -m jaxrlvr.export --workdir={self.workdir})") from e

  def policy(self, params):
    return nnx.merge(self.graphdef, params)

  # ---------------------------------------------------------------------------------------------- A step's phases
  def plan(self, step: int) -> replay.Plan:
    """The strategy's plan of the step. ExGRPO scores the stored answers it may replay (mean token entropy under the
    current policy) and selects among them."""
    plan = self.strategy.plan(step, self.questions.next)
    # Every host pads its stored answers to the same row count (the largest), and joins the scoring call even with
    # none of its own to score.
    num_answers = multihost.agree_max(sum(len(r.tokens) for r in plan.score_requests))
    if num_answers:
      entropy_batch, owners = rollout.answer_entropy_batch(
          self.data.book, plan.score_requests, prompt_len=self.shapes.prompt_len,
          completion_len=self.shapes.completion_len,
          rows=_entropy_rows(num_answers, self.batch_shards // self.num_hosts), pad_id=self.sampler.pad_id)
      _, entropies = self._score(self.state.params, parallel.shard_batch(entropy_batch, self.mesh))
      if plan.score_requests:
        plan = self.strategy.select(plan, rollout.mean_entropies(
            multihost.local_rows(entropies), entropy_batch["completion_mask"], owners, plan.score_requests))
    return plan

  def sample(self, plan: replay.Plan, step: int, rng) -> tuple[list, dict]:
    """The plan's rollouts sampled (each at its policy delay) and rewarded: (sampled groups, rollout metrics)."""
    if self._first_rollout is not None:
      self._first_rollout.result()  # prepared (or nearly) beside the step-0 evaluation; raises what it raised
      self._first_rollout = None
    history, params = self.history, self.state.params
    policy_at = lambda delay: self.policy(history[min(delay, len(history)) - 1] if delay and history else params)
    pad_to = self.shapes.host_batch * self.config.rollout.group_size
    _join_sampler_calls(policy_at, plan.requests, self.data.book, self.sampler, rng=rng, mesh=self.mesh,
                        pad_batch_to=pad_to)
    return rollout.sample_groups(policy_at, plan.requests, self.data.book, self.reward_pool, self.sampler,
                                 step=step, rng=rng, mesh=self.mesh, pad_batch_to=pad_to)

  def compose(self, plan: replay.Plan, sampled: list, step: int) -> list:
    """The groups the update trains on (fresh and replayed); DIR/questions.jsonl records what each question scored
    at this visit (the comparison's revisit and signal figures)."""
    groups = self.strategy.compose(plan, sampled)
    if multihost.is_main():
      outputs.append_questions(self.workdir, step + 1, plan.requests, sampled, threshold=replay.CORRECT_THRESHOLD,
                               composed=groups)
    return groups

  def update(self, plan: replay.Plan, sampled: list, groups: list, rollout_info: dict,
             times: collections.Counter) -> tuple[dict, bool]:
    """The update batch built, scored under the current parameters where a later optimizer step needs its old
    log-probs, the optimizer stepped, and the batch shown to the strategy. Returns ({"metrics": the update's,
    "mismatch": the sampler's log-prob gap}, whether the fresh tokens were clipped); the strategy's share of the
    time goes to times["replay"], not "update"."""
    config, shapes = self.config, self.shapes
    clip_fresh = fresh_tokens_clipped(config, plan)
    dense = None
    if self.judge is not None:  # ExpRL: the judge's dense advantages replace the verifier's
      judged = rewards.judged_groups(groups, self.data.book, completion_len=shapes.completion_len)
      dense = rewards.dense_rewards(self.judge, judged, self.data.tokenizer,
                                    **rewards.dense_reward_kwargs(config.exprl))
      rollout_info.update(dense.metrics)
    host_batch = rollout.build_batch(
        groups, self.data.book, prompt_len=shapes.prompt_len, completion_len=shapes.completion_len,
        rows=shapes.host_rows, pad_id=self.sampler.pad_id, clip_fresh=clip_fresh,
        token_advantages=None if dense is None else dense.advantages,
        loss_mask=None if dense is None else dense.loss_mask,
        drop_constant_groups=config.loss.drop_constant_groups)
    update_fn, score_fn = self._update, self._score
    if self._update_shared is not None and not multihost.agree_any(
        not rollout.prompts_shared(host_batch, config.rollout.group_size)):  # every host's batch, or none
      update_fn, score_fn = self._update_shared, self._score_shared
      packed = packing.plan_batch(
          host_batch, prompt_len=shapes.prompt_len, group_size=self.prompt_group,
          num_minibatches=config.train.num_minibatches, num_microbatches=config.train.num_microbatches,
          packed_row_options=[n for n in self.packed_rows if self._packed_ready[n].done()],
          max_prompts=config.train.pack_max_prompts) if self.packed_rows else None
      if packed is not None:  # the answers fit fewer rows: the update runs those (packing.py)
        host_batch = {**host_batch, **packed}
    rollout_info["update/packed_rows"] = (host_batch["packing"]["ids"].shape[0] if "packing" in host_batch
                                          else shapes.rows) / shapes.rows
    batch = parallel.shard_batch(host_batch, self.mesh)
    # Both scored on the batch as built (one compiled scoring pass for both); pi_old only where a later optimizer
    # step needs it, else the update's own forward pass gives it.
    rows = {k: v for k, v in batch.items() if k not in ("packing", "unpack")}  # the scoring pass packs nothing
    old_logp = score_fn(self.state.params, rows)[0] if step_lib.needs_score_pass(config) else None
    if self.reference is not None:
      batch["ref_logp"], _ = score_fn(self.reference, rows)
    if old_logp is not None:
      batch["old_logp"] = old_logp
    if self.history is not None:
      self.history.appendleft(jax.tree.map(jnp.copy, self.state.params))
    self.state, metrics, old_logp = update_fn(self.state, batch)
    mismatch = _sampler_mismatch(batch, old_logp)
    jax.block_until_ready(self.state.step)
    t = time.perf_counter()
    self._observe(plan, sampled, groups, old_logp)
    observe_s = time.perf_counter() - t
    times["replay"] += observe_s
    times["update"] -= observe_s
    return {"metrics": metrics, "mismatch": mismatch}, clip_fresh

  def _observe(self, plan, sampled, groups, old_logp) -> None:
    """The strategy stores, buckets and retires from the final groups (after the update, which does not depend on
    it). `replay.behaviour_logprobs="trainer"` (ExGRPO's released code) stores the trainer's log-probs of each new
    answer under the parameters that sampled it (`old_logp`) as its pi_past, not the sampler's."""
    if self.config.replay.get("behaviour_logprobs", "sampler") == "trainer":
      rollout.record_logprobs(groups, multihost.local_rows(old_logp))
    self.strategy.observe(plan, sampled)
    # What the buffer now keeps joins the frozen objects after one collection of the young ones: otherwise every
    # automatic full collection re-scans the growing buffer (+5% of ExGRPO's step time on the embedded default).
    gc.collect()
    gc.freeze()
    multihost.agree_phase(self.strategy)  # ExGRPO: replay turns on for every host at once

  def log_row(self, sampled: list, rollout_info: dict, update: dict, clip_fresh: bool,
              times: collections.Counter) -> dict:
    """A logged step's metrics: the update's, the sampler's gap, and the hosts' mean of the rest."""
    sampled_rollouts = [r for g in sampled for r in g.rollouts]
    host_metrics = {
        **rollout_info, **self.strategy.metrics(),
        "rollout/solve_rate": np.mean([r.reward >= replay.CORRECT_THRESHOLD for r in sampled_rollouts]),
        "rollout/response_length": np.mean([len(r.tokens) for r in sampled_rollouts]),
        "rollout/truncated": np.mean([not r.finished for r in sampled_rollouts]),
        "loss/fresh_clip_on": float(clip_fresh),
        **{f"time/{k}_s": v for k, v in times.items()},
    }
    return {**jax.device_get(update["metrics"]), **jax.device_get(update["mismatch"]),
            **multihost.host_mean(host_metrics)}

  def evaluate(self, step: int) -> dict:
    """Held-out greedy accuracy (and pass@k / avg@k at eval.temperature) of the current parameters; a few greedy
    answers go to DIR/samples.jsonl."""
    config, tokenizer, sampler = self.config, self.data.tokenizer, self.sampler
    eval_model = self.policy(self.state.params)

    def generate_fn(prompts, temperature, n):
      # Each host samples its share of the rows; all hosts then hold every completion and score the same ones.
      ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
      prompt_rows = [p for p in ids for _ in range(n)]
      start, stop = multihost.split_rows(len(prompt_rows))
      mine = prompt_rows[start:stop] or prompt_rows[:1]  # a host without rows still joins the sampler call
      out = rollout.generate(eval_model, mine, max_new_tokens=self.shapes.completion_len,
                             rng=jax.random.key(config.seed + 1), temperature=temperature, eos_ids=sampler.eos_ids,
                             pad_id=sampler.pad_id, mesh=self.mesh, **sampler.memory_limits(),
                             **sampler.engine_settings())
      tokens = multihost.gather_rows(out.tokens[:stop - start], len(prompt_rows))  # [N * n, T]
      lengths = multihost.gather_rows(out.lengths[:stop - start], len(prompt_rows))  # [N * n]
      return rollout.decode(tokenizer, tokens, lengths), lengths

    metrics, samples = evaluate_lib.evaluate_with_samples(
        generate_fn, self.data.eval_examples, k=config.eval.k, temperature=config.eval.temperature,
        template=config.tokenizer.template, tokenizer=tokenizer,
        reward_fn=lambda c, a: self.reward_pool.score(c, a)[0], num_samples=config.eval.num_samples)
    self.writer.write_samples(step, samples)  # DIR/samples.jsonl: what the model answers, next to its accuracy
    return metrics


@contextlib.contextmanager
def _timer(times: collections.Counter, key: str):
  """Adds the seconds of the block to times[key]."""
  t = time.perf_counter()
  try:
    yield
  finally:
    times[key] += time.perf_counter() - t


class TokenMarks:
  """`eval.token_marks`: the run also evaluates at the first step whose cumulative generated rollout tokens reach each
  mark. The tokens are counted as metrics.jsonl logs them (`rollout/sampled_tokens`, the hosts' mean) and summed as
  the comparison sums them, so a comparison that passes its budget reads every arm at the budget itself."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, start_step: int):
    self.marks = sorted(float(m) for m in config.eval.get("token_marks", ()))
    self.tokens = self._tokens_before(workdir, start_step) if self.marks and start_step else 0.0
    self.passed = sum(m <= self.tokens for m in self.marks)  # marks a resumed run had reached already

  @staticmethod
  def _tokens_before(workdir: str, step: int) -> float:
    """A resumed run's tokens up to its checkpoint, from metrics.jsonl (host 0 writes it; the others get its sum)."""
    total = 0.0
    if multihost.is_main():
      rows = outputs.read_rows(os.path.join(workdir, "metrics.jsonl"))
      total = outputs.cumulative_tokens({s: r for s, r in rows.items() if s <= step}, source=workdir)[step]
    return multihost.host_mean({"tokens": total})["tokens"] * jax.process_count()  # host 0's total on every host

  def reached(self, step_tokens: float) -> bool:
    """Adds one step's tokens (this host's); True when the total reached a mark it had not reached before."""
    if not self.marks:
      return False
    self.tokens += multihost.host_mean({"tokens": step_tokens})["tokens"]  # the same total on every host
    passed = sum(m <= self.tokens for m in self.marks)
    reached, self.passed = passed > self.passed, passed
    return reached


def _with_health(watch: health.Watch, config: ml_collections.ConfigDict, step: int, row: dict) -> dict:
  """`row` with its health/ metrics. Each warning the row raises is one line (host 0's; every host sees the same
  global row); with train.stop_on_collapse the stop says it instead (`_stop_if_collapsed`)."""
  found = watch.observe(step, row)
  if found and multihost.is_main() and not config.train.get("stop_on_collapse", False):
    for _, message in found:
      logging.warning("%s", message)
  return {**row, **health.metrics(found)}


def _stop_if_collapsed(watch: health.Watch, config: ml_collections.ConfigDict, step: int,
                       writer: outputs.MetricWriter) -> None:
  """train.stop_on_collapse: a step whose row raised a health warning ends the run, on every host (the same row),
  its metrics written and its progress bar closed first so that the message comes last."""
  if watch.latest and config.train.get("stop_on_collapse", False):
    writer.close()
    raise health.Collapsed(f"stopped at step {step} of {config.total_steps} (train.stop_on_collapse=True): "
                           f"{watch.latest[0][1]}")


def _note_held_out(config: ml_collections.ConfigDict, data: run_setup.Data, step0: dict) -> None:
  """Says once, at start, how little a held-out set under health.SMALL_HELD_OUT questions can measure (host 0)."""
  if multihost.is_main() and health.ACCURACY_KEY in step0:
    note = health.held_out_note(len(data.eval_examples), step0[health.ACCURACY_KEY], config.data,
                                available=len(data.eval_set))
    if note:
      logging.info("%s", note)


def fresh_tokens_clipped(config: ml_collections.ConfigDict, plan: replay.Plan) -> bool:
  """Whether the PPO clip applies to the fresh tokens of the batch `plan` made: always, but in ExGRPO's mixed phase
  without `loss.mixed_clip` (the released code). The phase is the plan's, so the batch whose solve rate switches
  replay on is trained on-policy, clipped, as it was sampled."""
  return bool(config.loss.clip) and (bool(config.loss.mixed_clip) or not plan.mixed_phase)


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
    rollout.generate(policy_at(delay), [book.prompt_ids(requests[0].qid)], rng=jax.random.fold_in(rng, delay),
                     **settings.call_arguments(mesh, pad_batch_to))  # the same calls as the other hosts


def _log_host_row(step: int, row: dict, num_hosts: int) -> None:
  """Multi-host: every host logs the global metrics it computed (they must be the same on every host; the
  multi-host test compares them). metrics.jsonl has host 0's."""
  if num_hosts > 1:
    values = {k: outputs.to_python(v) for k, v in sorted(row.items())}
    logging.info("host %d global metrics at step %d: %s", jax.process_index(), step, json.dumps(values))


def _entropy_rows(n: int, granule: int) -> int:
  """Rows of the batch that scores n stored answers: the next power of two (at least `granule`, this host's batch
  shards, then a multiple of it), so the pass costs about what the answers do while the scorer compiles for a handful
  of shapes only."""
  rows = max(granule, 1 << max(n - 1, 0).bit_length())
  return -(-rows // granule) * granule


@jax.jit
def _sampler_mismatch(batch: dict, old_logp: jax.Array) -> dict:
  """How far the sampler's log-probs are from the trainer's (`old_logp` [R, T]) on fresh tokens (numerics, or a
  delayed policy)."""
  mask = batch["completion_mask"] * (~batch["replayed"])[:, None]
  diff = old_logp - batch["behaviour_logp"]
  count = jnp.maximum(mask.sum(), 1.0)
  return {"rollout/logp_mismatch_abs": jnp.sum(jnp.abs(diff) * mask) / count,
          "rollout/logp_mismatch_max": jnp.max(jnp.where(mask > 0, jnp.abs(diff), 0.0))}
