"""Held-out evaluation: pure metric functions, and a driver that takes the trainer's generate function.

Metrics (names as logged):
  eval/accuracy            greedy (temperature 0) accuracy, one completion per question
  eval/questions           how many held-out questions it is over (its standard error: jaxrlvr/health.py)
  eval/pass@{k}            unbiased pass@k from n = k samples per question at the sampling temperature
  eval/avg@{k}             mean accuracy of those samples (avg@k)
  eval/response_length     mean greedy completion length in tokens
  eval/boxed               share of greedy completions with a `\\boxed{}` (what the reward reads first)
  eval/<data_source>/...   the same per `data_source` (MATH-500, AIME, ... share one verl file; the embedded
                           task reports its four levels)
"""
import collections
from typing import Callable, Sequence

import numpy as np

from jaxrlvr import data as data_lib

# generate_fn(prompts, temperature, n) -> (completions, lengths); n samples per prompt, prompt-major:
# completions[i * n + j] is sample j of prompt i, lengths are their token counts.
GenerateFn = Callable[[list[str], float, int], tuple[list[str], Sequence[int]]]


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k (Chen et al., 2021): 1 - C(n-c, k) / C(n, k), as a product so large n does not overflow.

  C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i).
  """
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass_at_k: need 0 <= c ({c}) <= n ({n}) and 1 <= k ({k}) <= n")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(correct: np.ndarray, k: int) -> float:
  """Mean pass@k over questions from a [Q, n] 0/1 matrix of sample correctness."""
  correct = np.asarray(correct)
  n = correct.shape[1]
  return float(np.mean([pass_at_k(n, int(c), k) for c in correct.sum(axis=1)]))


def avg_at_k(correct: np.ndarray) -> float:
  """avg@k: the mean over questions of each question's fraction of correct samples, from a [Q, k] matrix."""
  return float(np.mean(np.asarray(correct, np.float64).mean(axis=1)))


def by_source(values: Sequence[float], sources: Sequence[str]) -> dict[str, float]:
  """Mean of `values` per data source."""
  groups = collections.defaultdict(list)
  for value, source in zip(values, sources, strict=True):
    groups[source].append(value)
  return {source: float(np.mean(v)) for source, v in sorted(groups.items())}


def mean_length(lengths: Sequence[int]) -> float:
  return float(np.mean(np.asarray(lengths, np.float64))) if len(lengths) else 0.0


def evaluate(generate_fn: GenerateFn, examples: Sequence[data_lib.Example], **kwargs) -> dict[str, float]:
  """The metrics named in the module docstring; the arguments are evaluate_with_samples' (without num_samples)."""
  metrics, _ = evaluate_with_samples(generate_fn, examples, **kwargs)
  return metrics


def sample_indices(num_examples: int, num_samples: int) -> list[int]:
  """`num_samples` questions spread evenly over the held-out set (its levels or sources, when they come in order),
  the same ones at every evaluation so that their answers can be followed through training."""
  if num_samples < 0:
    raise ValueError(f"num_samples must be >= 0, got {num_samples}")
  return sorted({int(i) for i in np.linspace(0, num_examples - 1, min(num_samples, num_examples)).round()})


def evaluate_with_samples(generate_fn: GenerateFn, examples: Sequence[data_lib.Example], *, k: int = 1,
                          temperature: float = 0.0, template: str = "plain", tokenizer=None, reward_fn=None,
                          greedy: bool = True, num_samples: int = 0) -> tuple[dict[str, float], list[dict]]:
  """Generates for every example and scores it; returns the metrics named in the module docstring and `num_samples`
  greedy answers (`sample_indices`; none without the greedy pass), each {"index", "data_source", "prompt",
  "completion", "answer", "reward", "length"}.

  Args:
    generate_fn: the trainer's sampler on text (see GenerateFn).
    examples: the held-out questions.
    k: samples per question for pass@k and avg@k. k > 1 needs temperature > 0 (greedy samples are identical).
    temperature: the sampling temperature for pass@k / avg@k (ExGRPO evaluates at 0.6). With k == 1 and
      temperature 0 only the greedy pass runs.
    template, tokenizer: how questions become prompts (`jaxrlvr.data.templates.format_prompt`).
    reward_fn: (completions, answers) -> [N] 0/1; default `jaxrlvr.rewards.math_reward`.
    greedy: run the temperature-0 pass that gives eval/accuracy.
    num_samples: how many of the greedy answers to return as samples.
  """
  if not examples:
    raise ValueError("evaluate: no examples")
  if k < 1:
    raise ValueError(f"evaluate: k ({k}) must be >= 1")
  if k > 1 and temperature <= 0:
    raise ValueError(f"evaluate: k={k} samples at temperature {temperature} would all be the greedy answer; "
                     "set eval.temperature > 0 or eval.k = 1")
  if reward_fn is None:
    from jaxrlvr.rewards import math_reward  # pylint: disable=g-import-not-at-top
    reward_fn = math_reward
  prompts = [data_lib.format_prompt(e, template=template, tokenizer=tokenizer) for e in examples]
  answers = [e.answer for e in examples]
  sources = [e.data_source for e in examples]
  metrics, samples = {}, []

  def run(temp: float, n: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    completions, lengths = generate_fn(prompts, temp, n)
    if len(completions) != len(prompts) * n or len(lengths) != len(completions):
      raise ValueError(f"evaluate: generate_fn returned {len(completions)} completions and {len(lengths)} lengths "
                       f"for {len(prompts)} prompts x n={n}")
    rewards = np.asarray(reward_fn(list(completions), [a for a in answers for _ in range(n)]), np.float64)
    shape = (len(prompts), n)  # [Q * n] prompt-major -> [Q, n]
    return list(completions), rewards.reshape(shape), np.asarray(lengths, np.float64).reshape(shape)

  if greedy:
    completions, correct, lengths = run(0.0, 1)
    metrics["eval/accuracy"] = float(correct.mean())
    metrics["eval/questions"] = float(len(prompts))
    metrics["eval/response_length"] = mean_length(lengths.ravel())
    metrics["eval/boxed"] = float(np.mean(["\\boxed{" in c for c in completions]))
    for source, value in by_source(correct[:, 0], sources).items():
      metrics[f"eval/{source}/accuracy"] = value
    samples = [{"index": i, "data_source": sources[i], "prompt": prompts[i], "completion": completions[i],
                "answer": answers[i], "reward": float(correct[i, 0]), "length": int(lengths[i, 0])}
               for i in sample_indices(len(prompts), num_samples)]
  if temperature > 0:
    _, correct, lengths = run(temperature, k)
    metrics[f"eval/pass@{k}"] = mean_pass_at_k(correct, k)
    metrics[f"eval/avg@{k}"] = avg_at_k(correct)
    metrics["eval/sampled_response_length"] = mean_length(lengths.ravel())
    per_question_pass = [pass_at_k(k, int(c), k) for c in correct.sum(axis=1)]
    for source, value in by_source(per_question_pass, sources).items():
      metrics[f"eval/{source}/pass@{k}"] = value
    for source, value in by_source(correct.mean(axis=1), sources).items():
      metrics[f"eval/{source}/avg@{k}"] = value
  return metrics, samples
