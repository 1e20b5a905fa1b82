"""ExpRL dense rewards: judge scores -> per-token advantages [N, T] and a per-rollout loss mask (numpy only).

Outcome variant: one judge score per rollout; advantage r_i - mean of the group's kept rollouts (Dr.GRPO; classic
GRPO divides by the std), the same value on every token of the rollout.

Process variant: the completion is cut into segments after each `###` delimiter (`split_segments`), the judge
scores each prefix -- the answer up to and including segment t, as a partial answer -- giving s_1..s_T (s_T grades
the whole answer), and each segment gets one advantage (`judging="step"` instead grades segment t alone, with
segments 1..t-1 as context):

  EndNorm    A_t = s_t - s_T                         (progress relative to where the answer ended up)
  DeltaNorm  A_1 = s_1 - s_T,  A_t = s_t - s_{t-1}   (step-to-step gain; the first step against the end)
  GroupNorm  A_t = s_t - m,  m = the mean of every segment score of the group's kept rollouts, pooled (a rollout
             with more segments weighs more). `group_mean="rollouts"` takes the mean of per-rollout means instead,
             `"trajectory"` the rollout's own mean. The ExpRL summary we have gives GroupNorm only as "s_t - group
             mean" / "trajectory-centred" (we worked without its Eq. 6), so the pooled mean is a choice, kept
             switchable.

Every token of a segment carries that segment's advantage (`token_segment_index` maps character spans to tokens).

Rules shared by both variants:
- A length-clipped rollout (no stop token, `finished=False`) is not sent to the judge: every score is 0.
  Consequence worth knowing: under EndNorm and DeltaNorm, which only compare a rollout with itself, a clipped
  rollout then gets zero advantage everywhere; under GroupNorm and the outcome variant it is pushed down.
- A rollout with any score the judge did not deliver (unparseable verdict, or a request that failed after its
  retries) is removed: loss mask 0, zero advantages, left out of the group means, counted in the metrics.
"""
from collections.abc import Callable, Sequence
import dataclasses
import functools
import re
import time

import numpy as np
import tokenizers

from jaxrlvr.rewards.judge import Judge, JudgeRequest, JudgeResult

DELIMITER = "###"
REWARDS = ("outcome", "process")
NORMS = ("end", "delta", "group")
GROUP_MEANS = ("segments", "rollouts", "trajectory")
PROCESS_JUDGING = ("prefix", "step")


# ---------------------------------------------------------------------------------------------------------------
# Segmentation
# ---------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _delimiter_pattern(delimiter: str) -> re.Pattern:
  """A run of delimiters is one cut: `######` after `###`, and `####` (a markdown h4) for a one-character `###`."""
  if not delimiter:
    raise ValueError("dense.split_segments: delimiter='' would cut between every character")
  if len(set(delimiter)) == 1:
    return re.compile(f"{re.escape(delimiter[0])}{{{len(delimiter)},}}")
  return re.compile(f"(?:{re.escape(delimiter)})+")


def split_segments(text: str, delimiter: str = DELIMITER) -> list[tuple[int, int]]:
  """Character spans [start, end) of the segments of `text`, contiguous and covering all of it.

  A cut falls right after each delimiter run, so the delimiter ends the EARLIER segment. A piece with nothing but
  delimiters and whitespace is not a step of its own: it joins the previous segment, or the next one when it comes
  first (`### Step 1 ...` starts with a heading marker, not an empty step). So: no delimiter -> one segment;
  a trailing delimiter stays on the last segment; `""` -> [(0, 0)].
  """
  pattern = _delimiter_pattern(delimiter)
  cuts = [m.end() for m in pattern.finditer(text) if m.end() < len(text)]
  bounds = [0] + cuts + [len(text)]
  spans = list(zip(bounds[:-1], bounds[1:]))

  def has_content(span):
    return bool(pattern.sub("", text[span[0]:span[1]]).strip())

  merged: list[tuple[int, int]] = []
  for span in spans:
    if merged and not has_content(span):
      merged[-1] = (merged[-1][0], span[1])
    else:
      merged.append(span)
  if len(merged) > 1 and not has_content(merged[0]):
    merged[:2] = [(merged[0][0], merged[1][1])]
  return merged


# ---------------------------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------------------------


def outcome_advantages(rewards: np.ndarray, keep: np.ndarray | None = None, *, scale_by_std: bool = False,
                       eps: float = 1e-6) -> np.ndarray:
  """[n] group advantages r_i - mean (over kept rollouts), optionally / (std + eps); removed rollouts get 0."""
  rewards = np.asarray(rewards, np.float64)
  keep = np.ones(rewards.shape, bool) if keep is None else np.asarray(keep, bool)
  out = np.zeros(rewards.shape, np.float64)
  if keep.any():
    kept = rewards[keep]
    adv = kept - kept.mean()
    if scale_by_std:  # the sample std (ddof=1), the package's one convention (objectives.group_advantages)
      adv = adv / ((kept.std(ddof=1) if kept.size > 1 else 0.0) + eps)
    out[keep] = adv
  return out.astype(np.float32)


def segment_advantages(scores: Sequence[np.ndarray], keep: np.ndarray | None = None, *, norm: str,
                       group_mean: str = "segments") -> list[np.ndarray]:
  """Per-segment advantages for one group: scores[i] is [S_i] (s_1..s_T of rollout i) -> list of [S_i].

  See the module docstring for EndNorm / DeltaNorm / GroupNorm. Removed rollouts (keep False) get zeros and do
  not enter the group mean.
  """
  if norm not in NORMS:
    raise ValueError(f"dense.segment_advantages: norm={norm!r}; expected one of {NORMS}")
  if group_mean not in GROUP_MEANS:
    raise ValueError(f"dense.segment_advantages: group_mean={group_mean!r}; expected one of {GROUP_MEANS}")
  scores = [np.asarray(s, np.float64) for s in scores]
  keep = np.ones(len(scores), bool) if keep is None else np.asarray(keep, bool)
  for i, s in enumerate(scores):
    if keep[i] and (s.ndim != 1 or s.size == 0):
      raise ValueError(f"dense.segment_advantages: rollout {i} has scores of shape {s.shape}; need [S >= 1]")
  kept = [s for s, k in zip(scores, keep) if k]
  pooled = None
  if norm == "group" and kept:
    if group_mean == "segments":
      pooled = np.concatenate(kept).mean()
    elif group_mean == "rollouts":
      pooled = np.mean([s.mean() for s in kept])
  out = []
  for s, k in zip(scores, keep):
    if not k:
      out.append(np.zeros(s.shape, np.float32))
      continue
    if norm == "end":
      adv = s - s[-1]
    elif norm == "delta":
      adv = np.concatenate([[s[0] - s[-1]], np.diff(s)])
    else:
      adv = s - (s.mean() if group_mean == "trajectory" else pooled)
    out.append(adv.astype(np.float32))
  return out


# ---------------------------------------------------------------------------------------------------------------
# Characters -> tokens
# ---------------------------------------------------------------------------------------------------------------


def as_decoder(tokenizer) -> Callable[[Sequence[int]], str]:
  """A `ids -> text` function from a transformers / tokenizers tokenizer (special tokens skipped) or a callable."""
  if hasattr(tokenizer, "decode"):
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)
  if callable(tokenizer):
    return tokenizer
  raise TypeError(f"dense.as_decoder: {type(tokenizer).__name__} has no decode() and is not callable")


def _streamed_starts(ids: list[int], tokenizer, decode: Callable[[Sequence[int]], str]) -> np.ndarray | None:
  """[L] P(k) for every token from one streaming pass (O(L) decoding), or None when unavailable.

  Uses `tokenizers.decoders.DecodeStream` on a `tokenizers.Tokenizer` (or a transformers tokenizer's backend).
  The stream holds back tokens that only open a multi-byte character and then emits the whole chunk at once; for
  such a run, P is recomputed by decoding just the run (with the previous run as context, so a SentencePiece
  leading space is not lost). The result is trusted only if the streamed chunks rebuild exactly the text `decode`
  gives; otherwise (a tokenizer that post-processes its output, an answer cut inside a character) the caller
  falls back to the prefix search.
  """
  backend = tokenizer if isinstance(tokenizer, tokenizers.Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
  if not isinstance(backend, tokenizers.Tokenizer):
    return None
  stream = tokenizers.decoders.DecodeStream(skip_special_tokens=True)
  starts = np.zeros(len(ids), np.int64)
  chunks, offset = [], 0
  run_start, context = 0, 0  # first token of the current run; first token of the previous run
  try:
    for k, token in enumerate(ids):
      starts[k] = offset
      chunk = stream.step(backend, token)
      if not chunk:
        continue
      if k > run_start:  # a held-back run [run_start, k]: where does each of its tokens start?
        base = len(decode(ids[context:run_start]))
        for j in range(run_start + 1, k + 1):
          inside = len(decode(ids[context:j]).rstrip("\ufffd")) - base
          starts[j] = offset + min(max(inside, 0), len(chunk))
      chunks.append(chunk)
      offset += len(chunk)
      context, run_start = run_start, k + 1
  except Exception:  # pylint: disable=broad-except  (any decoder error: fall back to the exact slow path)
    return None
  if "".join(chunks) != decode(ids):
    return None
  return np.maximum.accumulate(starts)


def token_segment_index(token_ids: Sequence[int], spans: Sequence[tuple[int, int]], tokenizer) -> np.ndarray:
  """[L] segment index of each token of a completion (L = len(token_ids), padding already removed).

  Token k covers the characters [P(k), P(k+1)) with P(k) = len(decode(ids[:k])), and belongs to the segment that
  holds its FIRST character: a token straddling a cut (`##\\n` ...) goes with the earlier segment, as the
  delimiter does. Tokens that decode to nothing (a skipped stop token) join the segment before them.
  `tokenizer`: a `tokenizers.Tokenizer` or transformers tokenizer (one streaming pass, O(L)), or any
  `ids -> text` callable (each boundary found by binary search over decoded prefixes, O(segments * log L)
  decodes). `spans` must come from `split_segments(decode(token_ids))`.
  """
  ids = [int(i) for i in token_ids]
  n = len(ids)
  if len(spans) <= 1 or n == 0:
    return np.zeros(n, np.int32)
  decode = as_decoder(tokenizer)
  bounds = np.asarray([start for start, _ in spans[1:]], np.int64)
  starts = _streamed_starts(ids, tokenizer, decode)
  if starts is not None:
    firsts = np.searchsorted(starts, bounds, side="left")  # smallest k with P(k) >= boundary
  else:
    cache: dict[int, int] = {0: 0}

    def prefix_len(k: int) -> int:
      if k not in cache:
        # A prefix ending inside a multi-byte character decodes to U+FFFD: it has not reached the next char yet.
        cache[k] = len(decode(ids[:k]).rstrip("\ufffd"))
      return cache[k]

    firsts = []
    for start in bounds:
      lo, hi = 0, n
      while lo < hi:  # smallest k with P(k) >= start
        mid = (lo + hi) // 2
        if prefix_len(mid) >= start:
          hi = mid
        else:
          lo = mid + 1
      firsts.append(lo)
    firsts = np.asarray(firsts, np.int64)
  firsts = np.maximum.accumulate(firsts)
  return np.searchsorted(firsts, np.arange(n), side="right").astype(np.int32)


def token_advantages(token_ids: Sequence[int], spans: Sequence[tuple[int, int]], seg_adv: np.ndarray,
                     tokenizer, *, max_len: int) -> np.ndarray:
  """[max_len] per-token advantages: each token takes its segment's advantage; 0 past the completion."""
  out = np.zeros(max_len, np.float32)
  if len(token_ids):
    seg = token_segment_index(token_ids, spans, tokenizer)
    out[:len(token_ids)] = np.asarray(seg_adv, np.float32)[seg]
  return out


# ---------------------------------------------------------------------------------------------------------------
# A batch of groups -> advantages, loss mask, metrics
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RolloutGroup:
  """The n completions of one question, as the sampler returned them, plus what the judge needs."""
  question: str
  reference: str  # the hidden reference solution (dataset field `solution`)
  token_ids: np.ndarray  # [n, T] int, padded after the stop token
  lengths: np.ndarray  # [n] tokens up to and including the stop token
  finished: np.ndarray  # [n] bool: stopped before max_new_tokens (False: length-clipped)


@dataclasses.dataclass
class DenseRewards:
  """What the trainer consumes: rows follow the groups in order (N = sum of group sizes)."""
  advantages: np.ndarray  # [N, T] float32, 0 past each completion and on removed rollouts
  loss_mask: np.ndarray  # [N] float32, 0 = removed (the judge gave no usable score)
  rewards: np.ndarray  # [N] float32: outcome score, or the last segment's score s_T (process); 0 when removed
  metrics: dict[str, float]
  texts: list[str]  # the decoded completions the judge saw
  segments: list[list[tuple[int, int]]]  # character spans per rollout
  scores: list[np.ndarray]  # [S_i] per rollout; NaN where no score arrived


@dataclasses.dataclass(frozen=True)
class _Rollout:
  group: int
  ids: list[int]  # the completion's tokens up to its length
  text: str  # what the judge sees
  spans: list[tuple[int, int]]
  finished: bool


def judge_metrics(results: Sequence[JudgeResult], *, wall_s: float | None = None) -> dict[str, float]:
  """`judge/*` metrics of one batch of judge calls."""
  scores = [r.score for r in results if r.score is not None]
  latencies = [r.latency_s for r in results]
  metrics = {
      "judge/requests": float(len(results)),
      "judge/score_mean": float(np.mean(scores)) if scores else float("nan"),
      "judge/parse_failures": float(sum(r.parse_failed for r in results)),
      "judge/request_failures": float(sum(r.error is not None for r in results)),
      "judge/retries": float(sum(r.attempts - 1 for r in results)),
      "judge/latency_mean_s": float(np.mean(latencies)) if latencies else 0.0,
      "judge/latency_max_s": float(np.max(latencies)) if latencies else 0.0,
      "judge/tokens_sent": float(sum(r.tokens_sent for r in results if r.tokens_sent is not None)),
  }
  if wall_s is not None:
    metrics["judge/wall_s"] = float(wall_s)
  return metrics


def dense_rewards(judge: Judge, groups: Sequence[RolloutGroup], tokenizer, *, reward: str = "outcome",
                  norm: str = "end", group_mean: str = "segments", delimiter: str = DELIMITER,
                  scale_by_std: bool = False, judging: str = "prefix") -> DenseRewards:
  """Judges every completion of every group in ONE `judge.score` call (the HTTP judge runs them concurrently) and
  returns per-token advantages [N, T], the per-rollout loss mask and `judge/*` metrics.

  tokenizer: anything with `decode(ids, skip_special_tokens=True)`, or an `ids -> text` callable. The text the
  judge sees is decoded here from the token ids, so character spans and tokens always agree.
  """
  if reward not in REWARDS:
    raise ValueError(f"dense.dense_rewards: reward={reward!r}; expected one of {REWARDS}")
  if norm not in NORMS:
    raise ValueError(f"dense.dense_rewards: norm={norm!r}; expected one of {NORMS}")
  if group_mean not in GROUP_MEANS:
    raise ValueError(f"dense.dense_rewards: group_mean={group_mean!r}; expected one of {GROUP_MEANS}")
  if judging not in PROCESS_JUDGING:
    raise ValueError(f"dense.dense_rewards: judging={judging!r}; expected one of {PROCESS_JUDGING}")
  if not groups:
    raise ValueError("dense.dense_rewards: no groups")
  decode = as_decoder(tokenizer)
  max_len = np.asarray(groups[0].token_ids).shape[1]

  # Decode, segment and build the requests; `owner[j]` = (rollout row, segment) of request j.
  rows: list[_Rollout] = []
  requests, owner = [], []
  for g, group in enumerate(groups):
    token_ids = np.asarray(group.token_ids)
    lengths, finished = np.asarray(group.lengths), np.asarray(group.finished, bool)
    if token_ids.ndim != 2 or token_ids.shape[1] != max_len:
      raise ValueError(f"dense.dense_rewards: group {g} token_ids has shape {token_ids.shape}; every group needs "
                       f"[n, {max_len}]")
    if lengths.shape != (token_ids.shape[0],) or finished.shape != lengths.shape:
      raise ValueError(f"dense.dense_rewards: group {g} lengths {lengths.shape} / finished {finished.shape} do not "
                       f"match token_ids {token_ids.shape}")
    for i in range(token_ids.shape[0]):
      ids = token_ids[i, :int(lengths[i])].tolist()
      text = decode(ids)
      spans = split_segments(text, delimiter) if reward == "process" else [(0, len(text))]
      row = len(rows)
      rows.append(_Rollout(group=g, ids=ids, text=text, spans=spans, finished=bool(finished[i])))
      if not finished[i]:
        continue  # length-clipped: scores 0, not judged
      for t, (start, end) in enumerate(spans):
        if reward == "process" and judging == "prefix":
          requests.append(JudgeRequest(group.question, group.reference, text[:end], prefix=True))
        elif reward == "process":
          requests.append(JudgeRequest(group.question, group.reference, text[start:end], context=text[:start]))
        else:
          requests.append(JudgeRequest(group.question, group.reference, text))
        owner.append((row, t))

  t0 = time.monotonic()
  results = judge.score(requests) if requests else []
  wall = time.monotonic() - t0
  if len(results) != len(requests):
    raise RuntimeError(f"dense.dense_rewards: {type(judge).__name__} returned {len(results)} results for "
                       f"{len(requests)} requests")

  scores = [np.zeros(len(r.spans), np.float64) for r in rows]
  for (row, t), result in zip(owner, results):
    scores[row][t] = np.nan if result.score is None else result.score
  keep = np.array([not np.isnan(s).any() for s in scores], bool)

  # Advantages per group, then spread over tokens.
  n_rows = len(rows)
  advantages = np.zeros((n_rows, max_len), np.float32)
  rewards = np.array([s[-1] if k else 0.0 for s, k in zip(scores, keep)], np.float32)
  row_ids = np.arange(n_rows)
  group_of = np.array([r.group for r in rows])
  for g in range(len(groups)):
    members = row_ids[group_of == g]
    if reward == "outcome":
      adv = outcome_advantages(rewards[members], keep[members], scale_by_std=scale_by_std)
      for row, a in zip(members, adv):
        advantages[row, :len(rows[row].ids)] = a
    else:
      seg_adv = segment_advantages([scores[r] for r in members], keep[members], norm=norm, group_mean=group_mean)
      for row, a in zip(members, seg_adv):
        advantages[row] = token_advantages(rows[row].ids, rows[row].spans, a, tokenizer, max_len=max_len)

  metrics = judge_metrics(results, wall_s=wall)
  metrics.update({
      "judge/segments_per_answer": float(np.mean([len(r.spans) for r in rows])),
      "judge/clipped_rollouts": float(sum(not r.finished for r in rows)),
      "judge/removed_rollouts": float((~keep).sum()),
      "judge/reward_mean": float(rewards[keep].mean()) if keep.any() else float("nan"),
  })
  return DenseRewards(advantages=advantages, loss_mask=keep.astype(np.float32), rewards=rewards, metrics=metrics,
                      texts=[r.text for r in rows], segments=[r.spans for r in rows],
                      scores=[s.astype(np.float32) for s in scores])


def judged_groups(groups, book, *, completion_len: int) -> list[RolloutGroup]:
  """The trainer's final groups (replay.Group) as the judge's RolloutGroups: the question and its hidden reference
  solution from the prompt book (rollout.PromptBook), the completions' token ids padded to `completion_len`."""
  out = []
  for g in groups:
    ids = np.zeros((len(g.rollouts), completion_len), np.int32)
    for i, r in enumerate(g.rollouts):
      ids[i, :len(r.tokens)] = r.tokens
    example = book.example(g.qid)
    if not example.solution:
      raise ValueError(f"ExpRL needs a reference solution: question {g.qid} of {book.source!r} has none "
                       "(set data.solution_field)")
    out.append(RolloutGroup(question=example.question, reference=example.solution, token_ids=ids,
                                  lengths=np.array([len(r.tokens) for r in g.rollouts]),
                                  finished=np.array([r.finished for r in g.rollouts])))
  return out



def dense_reward_kwargs(cfg) -> dict:
  """Keyword arguments of `dense_rewards` from the `exprl` config block (reward, norm, group_mean, delimiter,
  scale_by_std), checked here so a typo fails before the first rollout."""
  kwargs = {"reward": cfg.reward, "norm": cfg.norm, "group_mean": cfg.get("group_mean", "segments"),
            "delimiter": cfg.get("delimiter", DELIMITER), "scale_by_std": bool(cfg.get("scale_by_std", False)),
            "judging": cfg.get("process_judging", "prefix")}
  for key, allowed in (("reward", REWARDS), ("norm", NORMS), ("group_mean", GROUP_MEANS),
                       ("judging", PROCESS_JUDGING)):
    if kwargs[key] not in allowed:
      raise ValueError(f"config exprl.{key}={kwargs[key]!r}: expected one of {allowed}")
  if not kwargs["delimiter"]:
    raise ValueError("config exprl.delimiter='': the process variant needs a delimiter such as '###'")
  return kwargs
