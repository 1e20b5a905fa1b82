"""The supervised control of the method comparison: more supervised training from the same warm start, for as many
training seconds as an RL run took, so that an RL gain can be told from more training of any kind.

    python -m jaxrlvr.compare.sft_control --config=configs/grpo.py --workdir=DIR --config.seed=0 --wall_s=120 --evals=8

The run starts from the warm start the RL runs of its config and seed start from (run_setup.build_policy, the same
cache entry) and trains on the teacher's solutions of the questions RL draws from (the first `data.rl_train_size`
training rows, all when 0: the same data as the RL runs; `--all_questions`: every training row, as the warm start),
with the warm start's step (warm_start.make_sft_step: mean negative log-likelihood of the
solution tokens, AdamW without weight decay), batches of `warm_start.batch_size` one pair a row (the warm start packs
several to a row since the comparisons in docs/results.md ran; packed, the control would take ~25% more steps in
the same seconds), at a constant learning rate: by
default warm_start.lr / 10, where the warm start's cosine schedule ended (a schedule needs a length; a wall time fixes
none). It trains until its step times sum to `--wall_s` (evaluations excluded, as they are from the RL runs' step
times) and evaluates with the RL runs' evaluator and settings (greedy accuracy, pass@k at eval.k and
eval.temperature, the same held-out questions) at step 0 and each time another `--wall_s / --evals` seconds have
passed, and at the end.

The run directory reads like an RL run's (compare/runner.py and outputs.load_run read it): config.json, metrics.jsonl (one
row per step with `rollout/sampled_tokens` = 0, `time/step_s`, `sft/loss`, `sft/elapsed_s`, the evaluations),
samples.jsonl, and DIR/sft_control.json ({"target_wall_s", "evals", "lr", "finished", ...}), which marks it as a
control. It keeps no checkpoint: a killed control starts again from the warm start (it costs one RL run's training
time). One process only.
"""
import json
import os
import sys
import time

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from jaxrlvr import config_lib
from jaxrlvr import data as data_lib
from jaxrlvr import logs
from jaxrlvr import outputs
from jaxrlvr import xla_cpu

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/grpo.py[:smoke].",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where metrics.jsonl and sft_control.json go.")
_WALL_S = flags.DEFINE_float("wall_s", None, "Training seconds (the step times summed) to train for.")
_EVALS = flags.DEFINE_integer("evals", 8, "Evaluations after step 0, one each wall_s / evals seconds.")
_LR = flags.DEFINE_float("lr", 0.0, "Constant learning rate; 0: warm_start.lr / 10, where the warm start ended.")
_ALL_QUESTIONS = flags.DEFINE_bool("all_questions", False, "Train on every training row's solution, not only on "
                                   "those of the data.rl_train_size questions RL draws from.")
flags.mark_flags_as_required(["config", "workdir", "wall_s"])


def _write_state(workdir: str, state: dict) -> None:
  path = os.path.join(workdir, outputs.SFT_FILE)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(state, f, indent=2, sort_keys=True)
  os.replace(path + ".tmp", path)  # a reader never sees half a file


def run(config, workdir: str, *, wall_s: float, evals: int = 8, lr: float = 0.0, all_questions: bool = False) -> dict:
  """Trains the control (module doc) and returns its last evaluation."""
  # Imported here: flags parse (and xla_cpu sizes the CPU thread pool) before jax initialises.
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jaxrlvr import evaluate as evaluate_lib  # pylint: disable=g-import-not-at-top
  from jaxrlvr import outputs  # pylint: disable=g-import-not-at-top
  from jaxrlvr import parallel  # pylint: disable=g-import-not-at-top
  from jaxrlvr import rewards  # pylint: disable=g-import-not-at-top
  from jaxrlvr import rollout  # pylint: disable=g-import-not-at-top
  from jaxrlvr import run_setup  # pylint: disable=g-import-not-at-top
  from jaxrlvr import step as step_lib  # pylint: disable=g-import-not-at-top
  from jaxrlvr import warm_start  # pylint: disable=g-import-not-at-top

  if not wall_s > 0 or evals < 1:
    raise config_lib.ConfigError(f"sft_control: --wall_s ({wall_s}) must be > 0 and --evals ({evals}) >= 1")
  if jax.process_count() > 1:
    raise config_lib.ConfigError(f"sft_control runs on one process, not {jax.process_count()}")
  config, mesh = run_setup.prepare(config)
  if config.model.path or not config.warm_start.steps:
    raise config_lib.ConfigError("sft_control continues the supervised warm start of a preset initialised at random "
                                 f"(model.path={config.model.path!r}, warm_start.steps={config.warm_start.steps}); "
                                 "this config has none to continue")
  lr = lr or config.warm_start.lr / 10
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config.to_dict(), f, indent=2, sort_keys=True)
  for name in ("metrics.jsonl", outputs.SAMPLES_FILE):  # an unfinished earlier try starts over
    if os.path.exists(os.path.join(workdir, name)):
      os.remove(os.path.join(workdir, name))
  state = {"target_wall_s": float(wall_s), "evals": int(evals), "lr": float(lr), "all_questions": bool(all_questions),
           "finished": False}
  _write_state(workdir, state)

  data = run_setup.load_data(config, check_prompts=False)
  tokenizer, train_set, eval_examples, book = data.tokenizer, data.train_set, data.eval_examples, data.book
  model, _ = run_setup.build_policy(config, mesh, book)
  completion_len = config.rollout.max_new_tokens
  pairs, missing = data_lib.warm_start_pairs(book.source, tokenizer, book.many_prompt_ids,
                                             max_rows=len(train_set) if all_questions else
                                             run_setup.rl_train_size(config, train_set),
                                             completion_len=completion_len)
  if missing:
    raise data_lib.DataError(f"sft_control: {missing} of the training rows have no solution to train on")

  graphdef, params = nnx.split(model)
  optimizer = optax.adamw(lr, weight_decay=0.0)
  opt_state = step_lib.init_optimizer_state(params, optimizer, mesh)
  batch_sharding = parallel.batch_sharding(mesh)
  sft_step = warm_start.make_sft_step(graphdef, optimizer, param_sharding=jax.tree.map(lambda x: x.sharding, params),
                                      opt_sharding=jax.tree.map(lambda x: x.sharding, opt_state),
                                      batch_sharding=batch_sharding)
  reward_pool = rewards.MathRewardPool.from_config(config)
  sampler = run_setup.sampler_settings(config, tokenizer)  # the stop and pad ids, memory bounds and engine of a run
  pad_id = sampler.pad_id
  prompt_len = config.data.max_prompt_len  # as the warm start packs its batches
  writer = outputs.MetricWriter(workdir, total_steps=0, show_progress=False)

  def evaluate(step: int) -> dict:
    policy = nnx.merge(graphdef, params)

    def generate_fn(prompts, temperature, n):  # as the trainer's evaluator, on one process
      ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
      out = rollout.generate(policy, [p for p in ids for _ in range(n)], max_new_tokens=completion_len,
                             rng=jax.random.key(config.seed + 1), temperature=temperature, eos_ids=sampler.eos_ids,
                             pad_id=pad_id, mesh=mesh, **sampler.memory_limits(), **sampler.engine_settings())
      return rollout.decode(tokenizer, out.tokens, out.lengths), out.lengths

    metrics, samples = evaluate_lib.evaluate_with_samples(
        generate_fn, eval_examples, k=config.eval.k, temperature=config.eval.temperature,
        template=config.tokenizer.template, tokenizer=tokenizer, reward_fn=lambda c, a: reward_pool.score(c, a)[0],
        num_samples=config.eval.num_samples)
    writer.write_samples(step, samples)
    return metrics

  last = evaluate(0)
  writer.write(0, last)
  rng = np.random.default_rng([config.seed, 1])  # not the warm start's stream (default_rng(seed)): new batches
  interval = wall_s / evals
  elapsed, step, next_eval = 0.0, 0, 1
  while elapsed < wall_s:
    t = time.perf_counter()
    rows = rng.choice(len(pairs), size=config.warm_start.batch_size, replace=len(pairs) < config.warm_start.batch_size)
    batch = warm_start.pack_sequences([pairs[r] for r in rows], prompt_len=prompt_len, completion_len=completion_len,
                                      pad_id=pad_id)
    params, opt_state, loss = sft_step(params, opt_state, parallel.put_global(batch, batch_sharding))
    loss = float(loss)  # waits for the step, so its time is its own
    step_s = time.perf_counter() - t
    elapsed += step_s
    step += 1
    row = {outputs.TOKENS_KEY: 0.0, outputs.STEP_TIME_KEY: step_s, "sft/loss": loss, "sft/elapsed_s": elapsed}
    if elapsed >= next_eval * interval or elapsed >= wall_s:
      last = evaluate(step)
      row.update(last)
      next_eval = int(elapsed // interval) + 1
    writer.write(step, row)
  writer.close()
  reward_pool.close()
  _write_state(workdir, {**state, "finished": True, "steps": step, "elapsed_s": elapsed, "pairs": len(pairs)})
  logging.info("sft_control: %d steps in %.1f s of training; held-out accuracy %.3f", step, elapsed,
               last[outputs.ACCURACY_KEY])
  return last


def main(argv) -> None:
  if len(argv) > 1:
    sys.exit(f"sft_control: error: unexpected arguments {argv[1:]}")
  logs.setup()
  xla_cpu.setup_process()  # before JAX starts (as the main job's)
  try:
    run(_CONFIG.value, _WORKDIR.value, wall_s=_WALL_S.value, evals=_EVALS.value, lr=_LR.value,
        all_questions=_ALL_QUESTIONS.value)
  except (config_lib.ConfigError, data_lib.DataError) as e:
    sys.stderr.write(f"sft_control: error: {' '.join(str(e).split())}\n")
    sys.exit(2)


if __name__ == "__main__":
  app.run(main)
