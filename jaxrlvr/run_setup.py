"""What a run derives from its config before its first step, in one place: the mesh, the data and its prompt book,
the batch shapes, the sampler's settings and memory bounds, the policy (loaded, or initialised and warm-started), the
replay strategy, the reward pool and ExpRL's judge.

The training loop (train.py), the supervised control (compare/sft_control.py) and the memory planner (plan/) all
build from here, so that a config means the same rows, shapes and sampler calls to each of them.
"""
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging
from flax import nnx

from jaxrlvr import config_lib
from jaxrlvr import data as data_lib
from jaxrlvr import logs
from jaxrlvr import models
from jaxrlvr import multihost
from jaxrlvr import parallel
from jaxrlvr import replay
from jaxrlvr import rewards
from jaxrlvr import rollout
from jaxrlvr import warm_start


def prepare(config: ml_collections.ConfigDict) -> tuple[ml_collections.ConfigDict, jax.sharding.Mesh]:
  """The config checked against the devices (shipped weights' directory filled in) and the device mesh. Stops with
  a ConfigError, before anything is loaded, on what the run cannot do with this many processes."""
  num_devices, num_hosts = jax.device_count(), jax.process_count()
  config_lib.validate(config, num_devices=num_devices)
  config = models.resolve_paths(config)  # a preset with shipped weights and no model.path: their directory
  if num_hosts > 1 and config.method == "exprl" and config.exprl.judge.kind == "model":
    raise config_lib.ConfigError(
        f"config.exprl.judge.kind='model' runs on one process only ({num_hosts} here): the judge's sampler calls "
        "differ per host; serve the judge over HTTP (kind='http') for multi-process runs")
  if num_hosts > 1 and config.rollout.engine == "continuous":
    raise config_lib.ConfigError(f"config.rollout.engine='continuous' runs on one process only ({num_hosts} here); "
                                 "use rollout.engine='static' for multi-process runs")
  return config, parallel.make_mesh(*config_lib.mesh_shape(config.mesh, num_devices))


# ------------------------------------------------------------------------------------------------ Data
@dataclasses.dataclass(frozen=True)
class Data:
  tokenizer: object
  train_set: data_lib.Source
  eval_set: data_lib.Source
  eval_examples: list  # the held-out questions every evaluation answers (data.eval_size of eval_set)
  book: rollout.PromptBook  # the training questions' prompts, tokenised once


def load_data(config: ml_collections.ConfigDict, *, check_prompts: bool = True) -> Data:
  """The tokenizer, the training and held-out sets and the prompt book. With `check_prompts` every prompt the run
  will see is checked now: a row that does not fit stops here with its file and row."""
  tokenizer = data_lib.tokenizer_from_config(config)
  train_set, eval_set = data_lib.sources_from_config(config)
  num_eval = min(len(eval_set), config.data.eval_size or len(eval_set))
  if check_prompts:
    eval_key = "data.eval_source" if config.data.eval_source else "data.source"
    data_lib.check_prompts([("data.source", train_set, len(train_set)), (eval_key, eval_set, num_eval)], tokenizer,
                           template=config.tokenizer.template, max_prompt_len=config.data.max_prompt_len,
                           max_new_tokens=config.rollout.max_new_tokens, model_context=model_context(config))
  book = rollout.PromptBook(train_set, tokenizer, template=config.tokenizer.template,
                            max_prompt_len=config.data.max_prompt_len)
  return Data(tokenizer, train_set, eval_set, [eval_set[q] for q in range(num_eval)], book)


def rl_train_size(config: ml_collections.ConfigDict, train_set) -> int:
  """How many training rows RL draws its fresh questions from: the first `data.rl_train_size` (0: all). The warm
  start reads every row either way, so a data-limited run starts from the same weights as one with all of them."""
  size = config.data.get("rl_train_size", 0)  # absent from a config built by hand: all rows
  if not 0 <= size <= len(train_set):
    raise config_lib.ConfigError(f"config.data.rl_train_size={size}: must be in [0, {len(train_set)}], the rows of "
                                 f"data.source {train_set!r} (0: all of them)")
  return size or len(train_set)


def question_iterator(config: ml_collections.ConfigDict, train_set) -> data_lib.QuestionIterator:
  """This process's fresh questions: its share of the first `rl_train_size` rows, reshuffled every epoch."""
  return data_lib.QuestionIterator(range(rl_train_size(config, train_set)), seed=config.seed,
                                   host_id=jax.process_index(), num_hosts=jax.process_count())


def model_context(config: ml_collections.ConfigDict) -> int | None:
  """The model's max_position_embeddings, for messages about prompt lengths (None: the checkpoint's config.json
  cannot be read; loading the model reports that)."""
  if not config.model.path:
    return models.get_preset(config.model.preset).max_position_embeddings
  try:
    return int(models.read_config(config.model.path).get("max_position_embeddings", 0)) or None
  except (OSError, ValueError):
    return None


# ------------------------------------------------------------------------------------------------ Batch shapes
@dataclasses.dataclass(frozen=True)
class Shapes:
  """The fixed shapes of a run's update batches, so every step's update compiles once."""
  prompt_len: int  # P: the prompt bucket every row is left-padded to
  completion_len: int  # T: rollout.max_new_tokens
  rows: int  # R: rows of the global update batch (filler rows pad it)
  host_rows: int  # this process's piece of every update batch
  micro_rows: int  # rows of one micro-batch of the global batch
  host_batch: int  # questions per step this process samples (B / P)


def host_batch_size(config: ml_collections.ConfigDict, num_hosts: int) -> int:
  """Questions per step of each host: B / P, so every host contributes the same number of rows."""
  batch_size = config.rollout.batch_size
  if batch_size % num_hosts:
    raise config_lib.ConfigError(f"config.rollout.batch_size={batch_size}: must be divisible by the number of "
                                 f"processes ({num_hosts}); each process samples batch_size / {num_hosts} questions")
  return batch_size // num_hosts


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


def shapes(config: ml_collections.ConfigDict, batch_shards: int, num_hosts: int = 1) -> Shapes:
  rows = batch_rows(config, batch_shards, num_hosts)
  return Shapes(prompt_len=rollout.bucket_length(config.data.max_prompt_len),
                completion_len=config.rollout.max_new_tokens, rows=rows, host_rows=rows // num_hosts,
                micro_rows=rows // (config.train.num_minibatches * config.train.num_microbatches),
                host_batch=host_batch_size(config, num_hosts))


# ------------------------------------------------------------------------------------------------ Sampler
def model_config(config: ml_collections.ConfigDict) -> models.ModelConfig:
  """The architecture: from `config.model.path`'s config.json when set, else the preset; dtypes, remat, scan_layers
  and attention from the config (scan_layers read with .get: a run's config.json from before the option lacks it).
  Reads no weights."""
  m = config.model
  if m.path:
    if not os.path.exists(os.path.join(m.path, "config.json")):
      raise FileNotFoundError(f"config.model.path={m.path!r} has no config.json; clear it to use the preset "
                              f"{m.preset!r}")
    return models.config_from_hf(models.read_config(m.path), param_dtype=m.param_dtype, compute_dtype=m.compute_dtype,
                                 attention=m.attention, attention_block_size=m.attention_block_size, remat=m.remat,
                                 scan_layers=m.get("scan_layers", False))
  return models.from_config(config)


def rows_per_sampler_call(config: ml_collections.ConfigDict) -> int:
  """The rows a sampler call holds per batch shard, the sampler's `max_rows_per_device` (0: no bound).

  `rollout.max_rows_per_device` when it is set; else, with `rollout.kv_cache_gb` set, the largest power of two of
  rows whose KV cache fits that budget: rows x (prompt bucket + max_new_tokens) slots x layers x (k, v) x kv heads x
  head_dim x the compute dtype's bytes, for the whole model (kv heads counted unsplit, so with a tensor axis a
  device holds less than the budget). Resolved from the config as the run has it, command-line overrides applied:
  --config.rollout.max_new_tokens=16384 halves the rows instead of doubling the cache."""
  r = config.rollout
  if r.max_rows_per_device > 0 or not r.get("kv_cache_gb", 0):
    return int(r.max_rows_per_device)
  m = model_config(config)
  slots = rollout.bucket_length(config.data.max_prompt_len) + r.max_new_tokens
  row_bytes = m.num_layers * 2 * m.num_kv_heads * m.head_dim * jnp.dtype(m.compute_dtype).itemsize * slots
  rows = int(r.kv_cache_gb * 1e9 // row_bytes)
  if rows < 1:
    raise config_lib.ConfigError(
        f"config.rollout.kv_cache_gb={r.kv_cache_gb!r}: holds no row; one row's KV cache at {slots} slots is "
        f"{row_bytes / 1e9:.2f} GB")
  return 1 << (rows.bit_length() - 1)


def sampler_limits(config: ml_collections.ConfigDict) -> dict[str, int]:
  """The rollout.* memory bounds of every sampler call (rollouts, evaluation, the model judge), as keyword
  arguments of `rollout.generate`; max_rows_per_device as `rows_per_sampler_call` resolves it."""
  limits = {name: int(config.rollout[name]) for name in rollout.MEMORY_LIMITS}
  return {**limits, "max_rows_per_device": rows_per_sampler_call(config)}


def sampler_engine(config: ml_collections.ConfigDict) -> dict:
  """How every sampler call decodes (config rollout.engine, decode_slots, decode_chunk_steps, decode_weights), as
  keyword arguments of `rollout.generate`."""
  return {name: config.rollout[name] for name in rollout.ENGINE_SETTINGS}


def sampler_settings(config: ml_collections.ConfigDict, tokenizer) -> rollout.SamplerSettings:
  """The rollouts' sampler: the rollout.* temperature, top-p, top-k, length, memory bounds and engine, the
  tokenizer's stop and pad ids."""
  return rollout.SamplerSettings(
      max_new_tokens=config.rollout.max_new_tokens, temperature=config.rollout.temperature,
      top_p=config.rollout.top_p, top_k=config.rollout.top_k, eos_ids=tuple(data_lib.stop_token_ids(tokenizer)),
      pad_id=tokenizer.pad_token_id, **sampler_limits(config), **sampler_engine(config))


# ------------------------------------------------------------------------------------------------ Policy
def build_policy(config: ml_collections.ConfigDict, mesh, book: rollout.PromptBook):
  """(model, its ModelConfig): the policy to start RL from. An HF checkpoint, or a preset initialised at random and
  warm-started on the training rows' solutions (the embedded task's worked solutions, a dataset's
  `data.solution_field`) when every row has one. Rows without one on the embedded preset and tokenizer warm-start on
  the embedded task's worked solutions instead (`warm_start.embedded_fallback`): at random initialisation the model
  never finds a first correct answer."""
  if config.model.path:
    if config.warm_start.steps:
      logging.info("warm start skipped: model.path is set (the warm start is for a preset initialised at random)")
    return models.load_pretrained(config.model.path, dtype=jnp.dtype(config.model.param_dtype),
                                  compute_dtype=config.model.compute_dtype, mesh=mesh, remat=config.model.remat,
                                  scan_layers=config.model.get("scan_layers", False),
                                  attention=config.model.attention,
                                  attention_block_size=config.model.attention_block_size)
  model_cfg = models.get_preset(config.model.preset)
  model_cfg = dataclasses.replace(model_cfg, param_dtype=config.model.param_dtype,
                                  compute_dtype=config.model.compute_dtype, remat=config.model.remat,
                                  scan_layers=config.model.get("scan_layers", False),
                                  attention=config.model.attention,
                                  attention_block_size=config.model.attention_block_size)
  tokenizer = book.tokenizer
  if len(tokenizer) > model_cfg.vocab_size:
    raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but model preset {config.model.preset!r} has "
                     f"vocab_size {model_cfg.vocab_size}")
  make_model = functools.partial(parallel.create_model, model_cfg, mesh, seed=config.seed)  # at random init
  if not config.warm_start.steps:
    return make_model(), model_cfg
  max_rows = config.warm_start.steps * config.warm_start.batch_size
  missing = data_lib.rows_without_solution(book.source, max_rows)
  pairs = warm_start.PairSource(book.source, tokenizer, book.many_prompt_ids, count=min(len(book.source), max_rows),
                                completion_len=config.rollout.max_new_tokens)
  task = config.data.source
  if missing and warm_start.embedded_fallback(config):
    pairs, task = warm_start.embedded_pairs(config, tokenizer, max_rows), warm_start.EMBEDDED_TASK
    note = (f"{missing} of the first {min(len(book.source), max_rows)} training rows of {config.data.source} have no "
            f"'{config.data.solution_field}' (data.solution_field) to imitate, so the {config.model.preset!r} preset "
            f"is warm-started on the embedded task's worked solutions ({warm_start.EMBEDDED_TASK}, the default "
            f"command's cached warm start) and RL then trains on the rows of {config.data.source}; "
            "--config.warm_start.embedded_fallback=False skips this")
    if multihost.is_main():
      logs.say(f"{note}.")
  elif missing:
    logging.info("warm start skipped: %d of the first %d training rows of %s have no '%s' (data.solution_field) to "
                 "imitate, so RL starts from the %r preset at random initialisation", missing,
                 min(len(book.source), max_rows), config.data.source, config.data.solution_field,
                 config.model.preset)
    return make_model(), model_cfg
  model = warm_start.cached_warm_start(
      make_model, model_cfg, pairs, task=task, steps=config.warm_start.steps, lr=config.warm_start.lr,
      batch_size=config.warm_start.batch_size, seed=config.seed, prompt_len=config.data.max_prompt_len,
      cache_dir=config.warm_start.cache_dir, mesh=mesh)
  return model, model_cfg


# ------------------------------------------------------------------------------------------------ Replay, rewards
def replay_strategy(config: ml_collections.ConfigDict, host_batch: int) -> replay.Strategy:
  """This process's replay strategy over its B / P questions a step (seeded per process)."""
  return replay.make(config.replay.name, config, batch_size=host_batch, seed=config.seed + jax.process_index())


def build_judge(config: ml_collections.ConfigDict, policy_model, tokenizer, mesh):
  """ExpRL's judge (None for the other methods): an HTTP endpoint, a checkpoint run by our sampler, or (no path) a
  frozen copy of the policy."""
  if config.method != "exprl":
    return None
  judge_config = config.exprl.judge
  if judge_config.kind == "model":
    if judge_config.path:
      model, _ = models.load_pretrained(judge_config.path, mesh=mesh)
      tokenizer = data_lib.load_tokenizer(judge_config.path)
    else:
      graphdef, params = nnx.split(policy_model)
      model = nnx.merge(graphdef, jax.tree.map(jnp.copy, params))
    return rewards.judge_from_config(judge_config, model=model, tokenizer=tokenizer, mesh=mesh,
                                     sampler_limits={**sampler_limits(config), **sampler_engine(config)})
  return rewards.judge_from_config(judge_config)
