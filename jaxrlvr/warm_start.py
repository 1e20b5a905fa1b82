"""Supervised warm start of the embedded default: a few hundred steps on worked solutions so RL starts above 0%.

The result is an ordinary Hugging Face checkpoint directory (models.save_pretrained) under a cache directory keyed by
everything that determines it (model architecture, tokenizer vocabulary, task, steps, learning rate, batch, seed), so
repeated runs, every method of a comparison and every seed of it start from the same weights without retraining.
"""
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx

import ml_collections

from jaxrlvr import data as data_lib
from jaxrlvr import file_lock
from jaxrlvr import models
from jaxrlvr import multihost
from jaxrlvr import parallel
from jaxrlvr import rollout
from jaxrlvr import scoring
from jaxrlvr import step as step_lib

_VERSION = 2


_EXECUTION_FIELDS = ("attention", "attention_block_size", "remat", "scan_layers")


KEY_SAMPLE = 64  # the pairs whose token ids the cache key hashes: they stand for the task's text format


@dataclasses.dataclass(frozen=True)
class PairSource:
  """A warm start's (prompt ids, solution ids + eos) pairs: the first `count` rows of `source`, each with a solution.

  `take(n)` tokenises the first n. The cache key needs only its sample of `KEY_SAMPLE` pairs, so a cached warm start
  skips tokenising the rest (19,200 prompts and solutions of the default command: about 1.3 s of every start on 2
  cores); a row that cannot be a pair (a solution too long, characters the tokenizer lacks) stops the run when the
  warm start trains on it.
  """
  source: data_lib.Source
  tokenizer: Any
  many_prompt_ids: Callable[[Sequence[int]], list[list[int]]]  # `rollout.PromptBook.many_prompt_ids`
  count: int
  completion_len: int  # rollout.max_new_tokens: a solution and its stop token must fit
  fit_hint: str = ""  # said after a row that does not fit, with what to change; empty: data_lib's own message

  def take(self, n: int) -> list[tuple[list[int], list[int]]]:
    try:
      pairs, missing = data_lib.warm_start_pairs(self.source, self.tokenizer, self.many_prompt_ids,
                                                 max_rows=min(n, self.count), completion_len=self.completion_len)
    except ValueError as e:  # a DataError too
      if not self.fit_hint:
        raise
      raise data_lib.DataError(self.fit_hint.format(error=e)) from e
    assert not missing, "the caller counted the rows without a solution first"
    return pairs


def cache_key(model_config, tokenizer, sample, *, num_pairs: int, task: str, steps: int, lr: float,
              batch_size: int, seed: int) -> str:
  """A hash of everything the warm-started weights depend on; `sample`, the first `KEY_SAMPLE` of the `num_pairs`
  pairs, stands for the task's text format."""
  vocab = sorted(tokenizer.get_vocab().items())
  # How the model is computed (attention kernel, remat, scanned layers) does not change what it learns: not part of
  # the key.
  architecture = {k: v for k, v in dataclasses.asdict(model_config).items() if k not in _EXECUTION_FIELDS}
  sample = [(list(map(int, p)), list(map(int, c))) for p, c in sample[:KEY_SAMPLE]]
  blob = json.dumps({"version": _VERSION, "model": repr(sorted(architecture.items())), "vocab": vocab, "task": task,
                     "steps": steps, "lr": lr, "batch_size": batch_size, "seed": seed, "pairs": sample,
                     "num_pairs": num_pairs}, sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_dir() -> str:
  return os.path.join(os.path.expanduser("~"), ".cache", "jaxrlvr", "warm_start")


def pack_sequences(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *, prompt_len: int,
                   completion_len: int, pad_id: int) -> dict:
  """(prompt ids, completion ids) pairs -> the RL batch layout: prompt left-padded to P, completion right-padded to T.

  Returns numpy `input_ids` [B, P + T], `attention_mask` [B, P + T] and `completion_mask` [B, T].
  """
  batch = len(pairs)
  ids = np.full((batch, prompt_len + completion_len), pad_id, np.int32)
  mask = np.zeros_like(ids)
  completion_mask = np.zeros((batch, completion_len), np.float32)
  for row, (prompt, completion) in enumerate(pairs):
    _check_fits(row, prompt, completion, prompt_len, completion_len)
    ids[row, prompt_len - len(prompt):prompt_len] = prompt
    ids[row, prompt_len:prompt_len + len(completion)] = completion
    mask[row, prompt_len - len(prompt):prompt_len + len(completion)] = 1
    completion_mask[row, :len(completion)] = 1
  return {"input_ids": ids, "attention_mask": mask, "completion_mask": completion_mask}


def _check_fits(row: int, prompt: Sequence[int], completion: Sequence[int], prompt_len: int,
                completion_len: int) -> None:
  if not 0 < len(prompt) <= prompt_len or len(completion) > completion_len:
    raise ValueError(f"warm start row {row}: prompt of {len(prompt)} tokens (max {prompt_len}) or completion of "
                     f"{len(completion)} tokens (max {completion_len}) does not fit")


def first_fit_rows(lengths: Sequence[int], row_len: int) -> list[int]:
  """The row of each sequence when sequences of `lengths` tokens are packed into rows of `row_len` tokens, longest
  first, each into the first row with room (first-fit decreasing). Rows are numbered in order of opening."""
  rows = [0] * len(lengths)
  room: list[int] = []
  for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
    if not 0 < lengths[i] <= row_len:
      raise ValueError(f"a sequence of {lengths[i]} tokens does not fit a row of {row_len}")
    rows[i] = next((r for r, free in enumerate(room) if free >= lengths[i]), len(room))
    if rows[i] == len(room):
      room.append(row_len)
    room[rows[i]] -= lengths[i]
  return rows


def pack_rows(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *, row_len: int, num_rows: int,
              pad_id: int, rows: Sequence[int] | None = None) -> dict:
  """(prompt ids, completion ids) pairs -> `num_rows` rows of `row_len` tokens holding several pairs each
  (`first_fit_rows`), for a model that attends within each pair only (`Transformer.hidden(segment_ids=...)`).

  Returns numpy [num_rows, row_len] `input_ids`; `segment_ids` (a pair's number in its row from 1, 0 for padding);
  `positions` (each pair's own, from 0, as it has alone); and `loss_mask`, 1 on the completion tokens. The same
  pairs left-padded one to a row (`pack_sequences`) give the same loss up to float rounding, for fewer rows: the
  embedded default's pairs take 23 of their 42 tokens on average. `rows`: each pair's row, when the caller has
  `first_fit_rows` of them already.
  """
  if rows is None:
    rows = first_fit_rows([len(p) + len(c) for p, c in pairs], row_len)
  if max(rows, default=-1) >= num_rows:
    raise ValueError(f"{len(pairs)} pairs take {max(rows) + 1} packed rows, more than the {num_rows} given")
  ids = np.full((num_rows, row_len), pad_id, np.int32)
  segments, positions = np.zeros_like(ids), np.zeros_like(ids)
  loss_mask = np.zeros((num_rows, row_len), np.float32)
  filled = [0] * num_rows
  for (prompt, completion), row in zip(pairs, rows):
    start, length = filled[row], len(prompt) + len(completion)
    filled[row] += length
    ids[row, start:start + length] = list(prompt) + list(completion)
    segments[row, start:start + length] = 1 + int(segments[row].max())
    positions[row, start:start + length] = np.arange(length)
    loss_mask[row, start + len(prompt):start + length] = 1
  return {"input_ids": ids, "segment_ids": segments, "positions": positions, "loss_mask": loss_mask}


def make_sft_step(graphdef, optimizer: optax.GradientTransformation, *, param_sharding, opt_sharding, batch_sharding):
  """Jitted (params, opt_state, batch) -> (params, opt_state, loss): one step on the mean negative log-likelihood of
  the completion tokens, of a batch of packed rows (`pack_rows`) or of one pair a row (`pack_sequences`). Its
  outputs keep the placement of its inputs, so every call with a batch of the same shape reuses the first compile."""

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    if "segment_ids" in batch:
      logp, _ = scoring.score(model, batch["input_ids"], None, positions=batch["positions"],
                              segment_ids=batch["segment_ids"])  # [rows, row_len]
      mask = batch["loss_mask"]
    else:
      logp, _ = step_lib.completion_logprobs(model, batch, 1.0)  # [rows, T]
      mask = batch["completion_mask"]
    return -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)

  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(train_step, in_shardings=(param_sharding, opt_sharding, batch_sharding),
                 out_shardings=(param_sharding, opt_sharding, None))


def train_supervised(model, pairs, *, steps: int, lr: float, batch_size: int, seed: int, prompt_len: int,
                     completion_len: int, pad_id: int, batch_sharding, log_every: int = 100):
  """AdamW (linear warm-up, cosine decay to lr/10) on the mean negative log-likelihood of the completion tokens; the
  model's parameters live on `batch_sharding.mesh`.

  Each step draws `batch_size` pairs and packs them into rows of prompt_len + completion_len tokens (`pack_rows`),
  as many rows as the fullest step needs (a multiple of the batch shards), so every step has one shape. With
  "blockwise" attention, which takes no packed rows, each pair has a row of its own (`pack_sequences`).
  """
  for i, (prompt, completion) in enumerate(pairs):
    _check_fits(i, prompt, completion, prompt_len, completion_len)
  rng = np.random.default_rng(seed)
  draws = [rng.choice(len(pairs), size=batch_size, replace=len(pairs) < batch_size) for _ in range(steps)]
  row_len = prompt_len + completion_len
  packed = models.resolve_attention(model.config.attention, q_len=row_len, kv_len=row_len,
                                    dtype=model.config.compute_dtype) != "blockwise"
  if packed:
    shards = parallel.batch_shards(batch_sharding.mesh)
    lengths = [len(p) + len(c) for p, c in pairs]
    layouts = [first_fit_rows([lengths[r] for r in rows], row_len) for rows in draws]  # each pair's row, per step
    num_rows = -(-max((1 + max(layout) for layout in layouts), default=1) // shards) * shards

  graphdef, params = nnx.split(model)
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(100, max(steps // 10, 1)), max(steps, 2), lr / 10)
  optimizer = optax.adamw(schedule, weight_decay=0.0)
  opt_state = step_lib.init_optimizer_state(params, optimizer, batch_sharding.mesh)
  train_step = make_sft_step(graphdef, optimizer, param_sharding=jax.tree.map(lambda x: x.sharding, params),
                             opt_sharding=jax.tree.map(lambda x: x.sharding, opt_state),
                             batch_sharding=batch_sharding)

  start = time.time()
  previous_loss = None
  for i, rows in enumerate(draws):
    chosen = [pairs[r] for r in rows]
    if packed:
      batch = pack_rows(chosen, row_len=row_len, num_rows=num_rows, pad_id=pad_id, rows=layouts[i])
    else:
      batch = pack_sequences(chosen, prompt_len=prompt_len, completion_len=completion_len, pad_id=pad_id)
    batch = parallel.put_global(batch, batch_sharding)  # the same batch on every process
    params, opt_state, loss = train_step(params, opt_state, batch)
    # At most one step queued behind the running one: the next batch is packed while a step runs, and a device never
    # nears XLA:CPU's 32 queued programs, past which an unbounded queue can deadlock the CPU all-reduce when the
    # client's thread pool is small (see xla_cpu.py).
    if previous_loss is not None:
      jax.block_until_ready(previous_loss)
    previous_loss = loss
    if log_every and (i + 1) % log_every == 0:
      logging.info("warm start step %d/%d: loss %.4f (%.0f s)", i + 1, steps, float(loss), time.time() - start)
  return nnx.merge(graphdef, params)


def cached_warm_start(make_model: Callable[[], Any], model_config, pairs: PairSource, *, task: str, steps: int,
                      lr: float, batch_size: int, seed: int, prompt_len: int, cache_dir: str, mesh):
  """The warm-started model, trained once from `make_model()` (a model at random initialisation) and then loaded
  from `cache_dir/<key>` (an HF checkpoint directory); a cached one neither initialises a model nor tokenises more
  than the key's sample of `pairs`."""
  key = cache_key(model_config, pairs.tokenizer, pairs.take(KEY_SAMPLE), num_pairs=pairs.count, task=task,
                  steps=steps, lr=lr, batch_size=batch_size, seed=seed)
  path = os.path.join(cache_dir or default_cache_dir(), key)
  with _one_trainer(path):
    # Several processes: process 0 alone decides whether the entry exists (another run may finish it between two
    # processes' checks), all of them train alike on the global mesh, process 0 alone writes, and the others read
    # only after the barrier, so nobody races on the file or reads it half-written.
    if not multihost.broadcast_flag(os.path.exists(os.path.join(path, "config.json"))):
      logging.info("warm start: training %d supervised steps (cache %s)", steps, path)
      model = train_supervised(make_model(), pairs.take(pairs.count), steps=steps, lr=lr, batch_size=batch_size,
                               seed=seed, prompt_len=prompt_len, completion_len=pairs.completion_len,
                               pad_id=pairs.tokenizer.pad_token_id, batch_sharding=parallel.batch_sharding(mesh))
      if multihost.is_main():
        # Write beside the target and rename, so a killed run never leaves a half-written cache entry.
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}-")
        models.save_pretrained(model, model_config, tmp)
        try:
          os.rename(tmp, path)
        except OSError:  # another run (one that could not take the lock) finished the same warm start first
          shutil.rmtree(tmp, ignore_errors=True)
      multihost.barrier(f"warm_start_{key}")
    else:
      logging.info("warm start: reusing %s", path)
  loaded, _ = models.load_pretrained(path, dtype=jnp.dtype(model_config.param_dtype), mesh=mesh)
  return loaded


@contextlib.contextmanager
def _one_trainer(path: str):
  """Runs started together (the arms of `compare --parallel=N`, a test run's workers) train each warm start once: the
  others wait, then read it. A multi-process run takes no lock: its processes train together, and one waiting on a
  lock would stall the others in their collectives."""
  if jax.process_count() > 1:
    yield
    return
  with file_lock.one_writer(path, "warm start"):
    yield


EMBEDDED_PRESET = "tiny"  # the embedded default's model (configs/base.py)
EMBEDDED_TASK = "synthetic:arithmetic"  # its task, whose worked solutions the default command warm-starts on


def embedded_fallback(config) -> bool:
  """Whether rows without a solution warm-start on the embedded task: `warm_start.embedded_fallback` on (absent from
  a config built by hand: off) and `embedded_model`."""
  return bool(config.warm_start.get("embedded_fallback", False)) and embedded_model(config)


def embedded_model(config) -> bool:
  """The embedded preset with the embedded tokenizer (the model the embedded task's warm start is for: another
  preset or tokenizer could not load or use it) on another task than the embedded one."""
  return (config.model.preset == EMBEDDED_PRESET and not config.tokenizer.path
          and config.data.source != EMBEDDED_TASK)


def embedded_pairs(config, tokenizer, max_rows: int) -> PairSource:
  """The warm-start pairs of the default command (`data.source=synthetic:arithmetic` and this config's seed,
  template, worked_fraction, ...): the same source, prompts and solutions, so the same cache key and weights."""
  embedded = ml_collections.ConfigDict(config.to_dict())
  embedded.data.source, embedded.data.eval_source, embedded.data.eval_size = EMBEDDED_TASK, "", 1  # eval: unused
  train_set, _ = data_lib.sources_from_config(embedded)
  book = rollout.PromptBook(train_set, tokenizer, template=config.tokenizer.template,
                            max_prompt_len=config.data.max_prompt_len)
  # This run's lengths may be shorter than the embedded task's.
  hint = ("config.warm_start.embedded_fallback=True: the embedded task's warm start does not fit this run ({error}); "
          "restore the embedded default's lengths, or skip it with --config.warm_start.embedded_fallback=False")
  return PairSource(train_set, tokenizer, book.many_prompt_ids, count=min(len(train_set), max_rows),
                    completion_len=config.rollout.max_new_tokens, fit_hint=hint)
