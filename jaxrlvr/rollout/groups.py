"""The one place text meets arrays: question ids -> prompt token ids -> sampler -> completions -> rewards -> Batch.

Everything on either side works on ids: replay on question ids and completion token ids, the update on fixed-shape
arrays. Here prompts are formatted and tokenised (once per question, cached), completions are decoded for the
verifier, and the final groups become the padded batch of `step.make_update_fn`:

  input_ids      [R, P + T]  prompt left-padded to P, completion right-padded to T
  attention_mask [R, P + T]
  completion_mask[R, T]      1 on completion tokens of rows that train (0 for filler rows)
  advantages     [R, T]      the row's advantage on every token
  behaviour_logp [R, T]      log-probs of the policy that sampled each token (sampler's, or recorded for replay)
  replayed       [R]         bool
  clip           [R]         bool: the PPO clip applies to this row's fresh tokens
R is fixed per run (filler rows pad it), so the update compiles once.
"""
import collections
from collections.abc import Callable, Sequence
import concurrent.futures
import dataclasses
from typing import Any

import jax
import numpy as np

from jaxrlvr import data as data_lib
from jaxrlvr import replay
from jaxrlvr.rollout import sampler


class PromptBook:
  """Question id -> prompt token ids and gold answer, tokenised once per question."""

  def __init__(self, source, tokenizer, *, template: str, max_prompt_len: int):
    self.source = source
    self.tokenizer = tokenizer
    self.template = template
    self.max_prompt_len = max_prompt_len
    self._ids: dict[int, list[int]] = {}

  def example(self, qid: int):
    return self.source[qid]

  def prompt_ids(self, qid: int) -> list[int]:
    return self.many_prompt_ids([qid])[0]

  def many_prompt_ids(self, qids: Sequence[int], chunk: int = 4096) -> list[list[int]]:
    """The prompts of `qids`; those not seen yet are tokenised `chunk` to a tokenizer call (a call a prompt cost the
    warm start's 19,200 rows about 1 s more on 2 cores)."""
    todo = [q for q in dict.fromkeys(qids) if q not in self._ids]
    for start in range(0, len(todo), chunk):
      part = todo[start:start + chunk]
      texts = [data_lib.format_prompt(self.source[q], template=self.template, tokenizer=self.tokenizer) for q in part]
      for qid, ids in zip(part, data_lib.encode(self.tokenizer, texts)):
        if not 0 < len(ids) <= self.max_prompt_len:
          raise ValueError(f"question {qid} of {self.source!r}: its prompt has {len(ids)} tokens, but "
                           f"data.max_prompt_len is {self.max_prompt_len}; raise it or filter the data")
        self._ids[qid] = ids
    return [self._ids[q] for q in qids]

  def answer(self, qid: int) -> str:
    return self.source[qid].answer


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
  max_new_tokens: int
  temperature: float
  top_p: float
  top_k: int
  eos_ids: tuple[int, ...]
  pad_id: int
  # Memory bounds of a sampler call (config rollout.*; `sampler.generate`'s arguments of the same names), 0: off.
  max_rows_per_device: int = 0
  prefill_rows_per_device: int = 0
  prefill_chunk_tokens: int = 0
  # How the sampler decodes (config rollout.*; `sampler.generate`'s arguments of the same names).
  engine: str = "static"
  decode_slots: int = 0
  decode_chunk_steps: int = 16
  decode_weights: str = "replicated"

  def memory_limits(self) -> dict[str, int]:
    return {name: getattr(self, name) for name in sampler.MEMORY_LIMITS}

  def engine_settings(self) -> dict:
    return {name: getattr(self, name) for name in sampler.ENGINE_SETTINGS}

  def call_arguments(self, mesh: Any, pad_batch_to: int) -> dict:
    """`sampler.generate`'s keyword arguments for these settings, all but `rng`."""
    return dict(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                top_k=self.top_k, eos_ids=self.eos_ids, pad_id=self.pad_id, mesh=mesh, pad_batch_to=pad_batch_to,
                **self.memory_limits(), **self.engine_settings())


def decode(tokenizer, tokens: np.ndarray, lengths: np.ndarray) -> list[str]:
  return tokenizer.batch_decode([row[:n].tolist() for row, n in zip(tokens, lengths)], skip_special_tokens=True)


class ScoreAsRowsFinish:
  """The sampler's `on_rows_done`: decodes and scores rows on a background thread as the sampler hands them over.

  The rollout engine hands rows over as they stop, while the device decodes the rest, so math-verify's workers score
  the early rows during decoding rather than all rows after it; the static sampler hands every row over at the end.
  One thread calls the pool, so its `score` calls never overlap each other. `result` waits for every batch and
  returns the rewards [n] in row order and the pool's counters summed over the batches.
  """

  def __init__(self, reward_pool, tokenizer, answers: Sequence[str]):
    self._pool, self._tokenizer, self._answers = reward_pool, tokenizer, answers
    self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rewards")
    self._batches: list[tuple[np.ndarray, concurrent.futures.Future]] = []

  def __enter__(self) -> "ScoreAsRowsFinish":
    return self

  def __exit__(self, *exc) -> None:
    self._thread.shutdown(wait=True, cancel_futures=True)

  def __call__(self, rows: np.ndarray, tokens: np.ndarray, lengths: np.ndarray) -> None:
    rows, tokens, lengths = np.asarray(rows), np.array(tokens), np.array(lengths)  # copies: the caller reuses its own
    self._batches.append((rows, self._thread.submit(self._score, rows, tokens, lengths)))

  def _score(self, rows: np.ndarray, tokens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, dict]:
    return self._pool.score(decode(self._tokenizer, tokens, lengths), [self._answers[r] for r in rows])

  def result(self) -> tuple[np.ndarray, dict[str, float]]:
    rewards = np.full(len(self._answers), np.nan, np.float32)
    info: collections.Counter = collections.Counter()
    for rows, batch in self._batches:
      scores, counts = batch.result()
      rewards[rows] = scores
      info.update(counts)
    if np.isnan(rewards).any():
      raise RuntimeError(f"rollout/groups.py: the sampler handed over {int((~np.isnan(rewards)).sum())} of "
                         f"{len(rewards)} rows")  # a sampler bug, never a user's
    info["batches"] = len(self._batches)
    return rewards, dict(info)


def sample_groups(models_by_delay: Callable[[int], object], requests: Sequence[replay.Request], book: PromptBook,
                  reward_pool, settings: SamplerSettings, *, step: int, rng, mesh=None,
                  pad_batch_to: int = 1) -> tuple[list[replay.Group], dict]:
  """Samples every request (grouped by the policy version it asks for) and scores the completions as the sampler
  hands them over (`ScoreAsRowsFinish`).

  Returns one Group per request, in order, and host-side info (tokens sampled, reward counters).
  """
  groups: list[replay.Group | None] = [None] * len(requests)
  info = {"rollout/sampled_tokens": 0.0, "reward/timeouts": 0.0, "reward/crashes": 0.0, "reward/not_literal": 0.0,
          "reward/worker_restarts": 0.0}
  for delay in sorted({r.policy_delay for r in requests}):
    indices = [i for i, r in enumerate(requests) if r.policy_delay == delay]
    prompts = [book.prompt_ids(requests[i].qid) for i in indices for _ in range(requests[i].n_samples)]
    answers = [book.answer(requests[i].qid) for i in indices for _ in range(requests[i].n_samples)]
    with ScoreAsRowsFinish(reward_pool, book.tokenizer, answers) as scorer:
      out = sampler.generate(models_by_delay(delay), prompts, **settings.call_arguments(mesh, pad_batch_to),
                             rng=jax.random.fold_in(rng, delay), on_rows_done=scorer)
      rewards, reward_info = scorer.result()
    info["rollout/sampled_tokens"] += float(out.lengths.sum())
    info["reward/timeouts"] += reward_info.get("timeouts", 0)
    info["reward/crashes"] += reward_info.get("crashes", 0)
    info["reward/worker_restarts"] += reward_info.get("worker_restarts", 0)
    info["reward/not_literal"] += reward_info.get("not_literal", 0)
    row = 0
    for i in indices:
      rollouts = []
      for _ in range(requests[i].n_samples):
        n = int(out.lengths[row])
        tokens = out.tokens[row, :n].copy()
        finished = n > 0 and int(tokens[-1]) in settings.eos_ids
        rollouts.append(replay.Rollout(qid=requests[i].qid, tokens=tokens, logprobs=out.logprobs[row, :n].copy(),
                                       reward=float(rewards[row]), step=step, finished=finished))
        row += 1
      groups[i] = replay.Group(requests[i].qid, rollouts, source=requests[i].kind)
  return groups, info


def prepare_sampling(model, prompts: Sequence[Sequence[int]], settings: SamplerSettings, *, mesh=None,
                     pad_batch_to: int = 1) -> bool:
  """Compiles, or loads from the persistent compilation cache, what `sample_groups` runs for these prompts (a
  question's samples in a row) at the current policy, and samples nothing (`sampler.prepare`: the rollout engine;
  the static sampler compiles at its first call). Returns whether it did."""
  return sampler.prepare(model, prompts, **settings.call_arguments(mesh, pad_batch_to), rng=jax.random.key(0))


def pack_rows(book: PromptBook, qids: Sequence[int], completions: Sequence[np.ndarray], *, prompt_len: int,
              completion_len: int, rows: int, pad_id: int) -> dict:
  """Prompt + completion token rows in the batch layout; rows beyond len(qids) are filler (one pad token)."""
  if len(qids) > rows:
    raise ValueError(f"{len(qids)} rollouts do not fit the batch of {rows} rows")
  ids = np.full((rows, prompt_len + completion_len), pad_id, np.int32)
  attention = np.zeros_like(ids)
  completion_mask = np.zeros((rows, completion_len), np.float32)
  for row, (qid, completion) in enumerate(zip(qids, completions)):
    prompt = book.prompt_ids(qid)
    n = len(completion)
    if n > completion_len:
      raise ValueError(f"a completion of question {qid} has {n} tokens; the batch holds {completion_len}")
    ids[row, prompt_len - len(prompt):prompt_len] = prompt
    ids[row, prompt_len:prompt_len + n] = completion
    attention[row, prompt_len - len(prompt):prompt_len + n] = 1
    completion_mask[row, :n] = 1
  attention[len(qids):, prompt_len - 1] = 1  # filler rows: one visible token, so no attention row is empty
  return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion_mask}


def build_batch(groups: Sequence[replay.Group], book: PromptBook, *, prompt_len: int, completion_len: int,
                rows: int, pad_id: int, clip_fresh: bool, token_advantages: np.ndarray | None = None,
                loss_mask: np.ndarray | None = None, drop_constant_groups: bool = False) -> dict:
  """The update's batch (module doc) from the final groups, whose every rollout has its advantage set.

  token_advantages [N, completion_len] and loss_mask [N] (ExpRL's dense rewards), when given, replace the
  rollouts' scalar advantages and drop the rollouts whose mask is 0 from the loss.
  drop_constant_groups (`loss.drop_constant_groups`): a group whose advantages are all 0 (rewards all equal, or an
  ExpRL group without a score difference) leaves the loss: its rows get completion_mask 0, so they count neither in
  the loss nor in its normaliser (their tokens and sequences are not counted), and the entropy and KL terms skip
  them too. A group of one row with a stored advantage (advantage-priority replay) is kept.
  """
  rollouts = [r for g in groups for r in g.rollouts]
  batch = pack_rows(book, [r.qid for r in rollouts], [r.tokens for r in rollouts], prompt_len=prompt_len,
                    completion_len=completion_len, rows=rows, pad_id=pad_id)
  advantages = np.zeros((rows, completion_len), np.float32)
  behaviour = np.zeros((rows, completion_len), np.float32)
  replayed = np.zeros(rows, bool)
  for row, r in enumerate(rollouts):
    if r.advantage is None:
      raise ValueError(f"a rollout of question {r.qid} reached the batch without an advantage")
    if r.logprobs is None or len(r.logprobs) != len(r.tokens):
      raise ValueError(f"a rollout of question {r.qid} (replayed={r.replayed}) has no recorded behaviour "
                       "log-probs; its importance ratio would be meaningless")
    advantages[row] = r.advantage
    behaviour[row, :len(r.logprobs)] = r.logprobs
    replayed[row] = r.replayed
  if token_advantages is not None:
    advantages[:len(rollouts)] = token_advantages
  if loss_mask is not None:
    batch["completion_mask"][:len(rollouts)] *= np.asarray(loss_mask, np.float32)[:, None]
  if drop_constant_groups:
    start = 0
    for g in groups:
      stop = start + len(g.rollouts)
      if not np.any(advantages[start:stop] * batch["completion_mask"][start:stop]):
        batch["completion_mask"][start:stop] = 0
      start = stop
  batch.update(advantages=advantages, behaviour_logp=behaviour, replayed=replayed,
               clip=np.full(rows, clip_fresh, bool))
  return batch


def prompts_shared(batch: dict, group: int) -> bool:
  """Whether every `group` consecutive rows of an update batch (`build_batch`) share their prompt columns, ids and
  mask (filler rows share theirs): then the update may run each prompt once for its group."""
  completion_len = batch["completion_mask"].shape[1]
  rows, length = batch["input_ids"].shape
  if group < 2 or rows % group:
    return False
  prompt_len = length - completion_len
  for key in ("input_ids", "attention_mask"):
    prompts = np.asarray(batch[key])[:, :prompt_len].reshape(rows // group, group, prompt_len)  # [G, K, P]
    if not np.array_equal(prompts, np.broadcast_to(prompts[:, :1], prompts.shape)):
      return False
  return True


def record_logprobs(groups: Sequence[replay.Group], logprobs: np.ndarray) -> None:
  """Gives every new rollout of the final groups the log-probs of its batch row (`build_batch`'s order) as its
  behaviour log-probs, in place: the trainer's recomputed ones [rows, T], which ExGRPO's released code stores as a
  replayed answer's pi_past. Stored answers (replayed) keep what they were stored with."""
  rollouts = [r for g in groups for r in g.rollouts]
  if len(rollouts) > len(logprobs):
    raise ValueError(f"record_logprobs: {len(rollouts)} rollouts but {len(logprobs)} rows of log-probs")
  for row, r in enumerate(rollouts):
    if not r.replayed:
      r.logprobs = np.asarray(logprobs[row, :len(r.tokens)], np.float32).copy()


def answer_entropy_batch(book: PromptBook, score_requests: Sequence[replay.ScoreRequest], *, prompt_len: int,
                         completion_len: int, rows: int, pad_id: int) -> tuple[dict, list[tuple[int, int]]]:
  """ExGRPO: the stored answers to score, packed; and (request, answer) of each row, to read the result back."""
  qids, completions, owners = [], [], []
  for k, request in enumerate(score_requests):
    for j, tokens in enumerate(request.tokens):
      qids.append(request.qid)
      completions.append(np.asarray(tokens))
      owners.append((k, j))
  return pack_rows(book, qids, completions, prompt_len=prompt_len, completion_len=completion_len, rows=rows,
                   pad_id=pad_id), owners


def mean_entropies(entropies: np.ndarray, completion_mask: np.ndarray, owners, score_requests) -> list[np.ndarray]:
  """Per score request, the mean per-token entropy of each of its stored answers (over the answer's tokens only)."""
  per_row = (entropies * completion_mask).sum(-1) / np.maximum(completion_mask.sum(-1), 1)
  out = [np.zeros(len(r.tokens), np.float32) for r in score_requests]
  for row, (k, j) in enumerate(owners):
    out[k][j] = per_row[row]
  return out
