"""The embedded task: graded arithmetic that a ~1M-parameter model learns on a laptop CPU in minutes.

Four levels, mixed evenly (qid % 4), fixed-width operands, answers in `\\boxed{}`. The worked solutions (the warm
start's targets) work column by column, least significant digit first:

    level    question      worked solution
    add2     47+38         15,8,\\boxed{85}                   (7+8=15, then 4+3+1=8)
    add3     472+389       11,16,8,\\boxed{861}
    addsub2  47+38-21      15,8,85-21=4,6,\\boxed{64}         (sums of 47+38, then 5-1=4, 8-2=6; c <= a+b)
             80+14-16      4,9,94-16=-2,7,\\boxed{78}         (4-6=-2 borrows: its digit is 8; then 9-1-1=7)
    mul1x2   7*38          56,21,26,\\boxed{266}              (7*8=56, 7*3=21, then 21+5=26)

Why columns: with the answer alone, a 1M-parameter model must learn carries from the most significant digit first;
on 2 CPU cores it sat near 3-9% greedy accuracy after 1,750 steps of batch 64. With column sums each token is a
small lookup. The subtraction and the product show their last step too (the borrows, the carry added to 7*3): when
they did not, the warm-started model answered 6% of the subtractions and 30% of the products, and 250 RL steps
barely moved either (the subtraction is still the hardest level: 19-41% after RL). With the embedded tokenizer and
the `plain` template a prompt is at most 15 tokens ("Q: 47+38-21\\nA: ") and a solution at most 25 (addsub2) plus
the stop token.

`worked_fraction` (config `data.worked_fraction`; the embedded default uses 0.4, the class default is 1) keeps the
worked solution for that share of the train questions and gives the rest the bare answer (`\\boxed{85}`), a fixed
draw per (seed, qid) that does not depend on the question. The warm start then imitates a teacher that often skips
its work: the greedy model answers nearly everything bare, which the model does about as well as the worked form
on 2-digit sums but much worse on 3-digit sums and products (a 1,200-step warm start, 200 held-out questions x 8
samples at temperature 1: add3 8% bare against 49% worked, mul1x2 21% against 33%). RL on the verifier's reward
learns to show the work where it pays: the greedy answers double in length and held-out accuracy rises by 17-25
points within 50-200 steps (seed 0; README, "Results"). `worked_by_level` (config `data.worked_by_level`, e.g.
"add2=1,addsub2=0") sets the share per level instead, and `levels` (config `data.levels`) the mix: the levels qids
cycle through, the four above by default, or any of them and two more, `add1x2` ("8+47") and `mul2x2` ("47*38",
worked as the partial products 376,141, then the answer). The comparison's paper-shaped regime uses both for a
model that always solves some levels and almost never others (jaxrlvr/compare/arms.py).

`phrasing` (config `data.phrasing`) is how a question reads: "compact" ("47+38", the embedded tokenizer's
characters, for the tiny model) or "sentence" for a pretrained chat model, which answers in words and boxes its
answer only when asked: "What is 47 + 38? Put the final answer in \\boxed{}." (the operators spaced, `*` kept).
The operands, answers and solutions are the same; only the question text changes.

Each level's question space is enumerated and permuted once per seed. The first `HELD_OUT_PER_SLOT` questions of
each permutation, times the times the level is named in the mix, are reserved for the 'test' split whatever its size,
so 'train' never contains a test question and a test split can hold 128 questions a slot of the mix. 'train' walks
the rest and wraps around when asked for more (mul1x2 has only 720 - 128 = 592 train questions, 464 when named
twice).
"""
import functools
import re

import numpy as np

from jaxrlvr.data import templates
from jaxrlvr.data.types import DataError
from jaxrlvr.data.types import Example

# Test questions reserved per slot of the mix: a level named r times in `data.levels` reserves r x 128, so the test
# split holds at most len(levels) x 128 (512 for the embedded 4-level mix), and a mix without repeats keeps its split.
HELD_OUT_PER_SLOT = 128
DEFAULT_SIZES = {"train": 20_000, "test": 200}
LEVELS = ("add2", "add3", "addsub2", "mul1x2")  # the embedded task's mix (`data.levels` empty)
# Two more, for a mix of one's own (`data.levels`): a 1-digit plus a 2-digit number, and two 2-digit factors.
EXTRA_LEVELS = ("add1x2", "mul2x2")
ALL_LEVELS = LEVELS + EXTRA_LEVELS
_TWO_DIGIT = np.arange(10, 100)
PHRASINGS = ("compact", "sentence")
_SENTENCE = "What is {}? Put the final answer in \\boxed{{}}."


def _level_space(level: str) -> int:
  """How many distinct questions a level has before filtering."""
  return {"add2": 90 * 90, "add3": 900 * 900, "addsub2": 90 ** 3, "mul1x2": 8 * 90, "add1x2": 8 * 90,
          "mul2x2": 90 * 90}[level]


def _reserved(level: str, levels: tuple[str, ...]) -> int:
  """The first questions of `level`'s order kept for the test split: HELD_OUT_PER_SLOT for each time it is named."""
  return HELD_OUT_PER_SLOT * levels.count(level)


def _operands(level: str, index: np.ndarray) -> tuple[np.ndarray, ...]:
  """Decodes enumeration indices into operands, vectorised: add2 (a, b), add3 (a, b), addsub2 (a, b, c), mul (d, x)."""
  if level == "add2":
    return 10 + index // 90, 10 + index % 90
  if level == "add3":
    return 100 + index // 900, 100 + index % 900
  if level == "addsub2":
    return 10 + index // 8100, 10 + (index // 90) % 90, 10 + index % 90
  if level == "mul2x2":
    return 10 + index // 90, 10 + index % 90
  return 2 + index // 90, 10 + index % 90  # mul1x2, add1x2: a digit 2..9 and 10..99.


@functools.lru_cache(maxsize=16)
def _permutation(level: str, seed: int) -> np.ndarray:
  """The level's valid questions in a seed-dependent order (addsub2 keeps only c <= a+b)."""
  index = np.random.default_rng([seed, ALL_LEVELS.index(level)]).permutation(_level_space(level))
  if level == "addsub2":
    a, b, c = _operands(level, index)
    index = index[c <= a + b]
  return index


def column_sums(a: int, b: int) -> list[int]:
  """Column sums of a + b, least significant first, each including the carry from the column before."""
  sums, carry = [], 0
  while a or b or not sums:
    total = a % 10 + b % 10 + carry
    sums.append(total)
    carry, a, b = total // 10, a // 10, b // 10
  return sums


def column_differences(s: int, c: int) -> list[int]:
  """Column differences of s - c (s >= c), least significant first, each including the borrow from the column before.

  A negative entry is a column that borrows: its digit is the entry + 10 and the next column takes 1 less, as a
  column sum of 10 or more carries 1 (94 - 16 -> [-2, 7]: 4-6 = -2 borrows, 9-1-1 = 7; the answer is 78).
  """
  diffs, borrow = [], 0
  while s or c or not diffs:
    diff = s % 10 - c % 10 - borrow
    diffs.append(diff)
    borrow, s, c = int(diff < 0), s // 10, c // 10
  return diffs


def _render(level: str, operands: tuple[int, ...]) -> tuple[str, str, str]:
  """(question, answer, worked solution) text for one question."""
  if level in ("add2", "add3", "add1x2"):
    a, b = operands
    work = ",".join(str(s) for s in column_sums(a, b))
    return f"{a}+{b}", str(a + b), f"{work},\\boxed{{{a + b}}}"
  if level == "addsub2":
    a, b, c = operands
    sums = ",".join(str(s) for s in column_sums(a, b))
    diffs = ",".join(str(s) for s in column_differences(a + b, c))
    return f"{a}+{b}-{c}", str(a + b - c), f"{sums},{a + b}-{c}={diffs},\\boxed{{{a + b - c}}}"
  if level == "mul2x2":  # the partial products by the units and the tens digit, then their sum
    a, b = operands
    low, high = a * (b % 10), a * (b // 10)
    return f"{a}*{b}", str(a * b), f"{low},{high},\\boxed{{{a * b}}}"
  d, x = operands
  low = d * (x % 10)
  tens = d * (x // 10)
  return f"{d}*{x}", str(d * x), f"{low},{tens},{tens + low // 10},\\boxed{{{d * x}}}"


class ArithmeticSource:
  """`synthetic:arithmetic` as a Source: deterministic from (seed, split, qid), nothing stored but permutations."""

  def __init__(self, *, split: str = "train", seed: int = 0, size: int | None = None, worked_fraction: float = 1.0,
               phrasing: str = "compact", worked_by_level: str = "", levels: str = ""):
    if split not in DEFAULT_SIZES:
      raise DataError(f"synthetic:arithmetic: split must be 'train' or 'test', got {split!r}")
    size = DEFAULT_SIZES[split] if size is None else int(size)
    if size < 1:
      raise DataError(f"synthetic:arithmetic: size ({size}) must be >= 1")
    self.levels = parse_levels(levels)
    for level in sorted(set(self.levels)):
      if _reserved(level, self.levels) >= _level_space(level):
        raise DataError(f"synthetic:arithmetic: config.data.levels names {level!r} {self.levels.count(level)} times: "
                        f"its {_reserved(level, self.levels)} reserved test questions leave none of its "
                        f"{_level_space(level)} to train on")
    if split == "test" and size > len(self.levels) * HELD_OUT_PER_SLOT:
      raise DataError(f"synthetic:arithmetic: test size ({size}) must be <= {len(self.levels) * HELD_OUT_PER_SLOT} "
                      f"({HELD_OUT_PER_SLOT} reserved questions per slot of the mix {list(self.levels)})")
    if not 0.0 <= worked_fraction <= 1.0:
      raise DataError(f"synthetic:arithmetic: worked_fraction must lie in [0, 1], got {worked_fraction!r}")
    if phrasing not in PHRASINGS:
      raise DataError(f"synthetic:arithmetic: config.data.phrasing={phrasing!r} is not one of {list(PHRASINGS)}")
    self.phrasing = phrasing
    self.name = f"synthetic:arithmetic:{split}"
    self.split, self.seed, self.size = split, seed, size
    # Which questions the teacher answers without showing its work: a fixed draw per (seed, qid), so the same
    # question always gets the same kind of solution and the fraction holds within any range of qids.
    draws = np.random.default_rng([seed, len(LEVELS), 1]).random(size)
    fractions = parse_worked_by_level(worked_by_level, default=worked_fraction)
    self._bare = draws >= np.asarray([fractions[self.levels[q % len(self.levels)]] for q in range(size)])
    # Each question rendered once: a run reads every training row two or three times at start-up (prompt checks,
    # warm-start pairs), at ~20 us a render.
    self._examples: dict[int, Example] = {}

  def __len__(self) -> int:
    return self.size

  def __repr__(self) -> str:
    return self.name

  def __getitem__(self, qid: int) -> Example:
    if qid not in self._examples:
      self._examples[qid] = self._make(qid)
    return self._examples[qid]

  def _make(self, qid: int) -> Example:
    if not 0 <= qid < self.size:
      raise IndexError(f"{self.name}: qid {qid} is outside [0, {self.size})")
    slot = qid % len(self.levels)
    level = self.levels[slot]
    order = _permutation(level, self.seed)
    # A level named r times in the mix takes every r-th question of its order at each of its slots, so repeats of a
    # level in `data.levels` weight it without repeating its questions.
    j = (qid // len(self.levels)) * self.levels.count(level) + self.levels[:slot].count(level)
    if self.split == "test":
      position = j
    else:
      reserved = _reserved(level, self.levels)
      position = reserved + j % (len(order) - reserved)
    operands = tuple(int(v) for v in _operands(level, np.asarray(order[position])))
    question, answer, solution = _render(level, operands)
    if self.phrasing == "sentence":
      question = _SENTENCE.format(re.sub(r"([-+*])", r" \1 ", question))  # operands are positive: "-" is an operator
    if self._bare[qid]:
      solution = f"\\boxed{{{answer}}}"
    return Example(qid=qid, question=question, answer=answer, solution=solution,
                   data_source=f"arithmetic/{level}")


def parse_levels(spec: str) -> tuple[str, ...]:
  """The levels qids cycle through (qid % len): config `data.levels`, e.g. "add1x2,add2,add3,addsub2,mul2x2"; a
  level named twice gets twice the questions. Empty: the embedded task's four, evenly."""
  levels = tuple(filter(None, (part.strip() for part in spec.split(",")))) or LEVELS
  unknown = [level for level in levels if level not in ALL_LEVELS]
  if unknown:
    raise DataError(f"synthetic:arithmetic: config.data.levels={spec!r}: unknown level(s) {unknown}; known: "
                    f"{list(ALL_LEVELS)}")
  return levels


def parse_worked_by_level(spec: str, *, default: float) -> dict[str, float]:
  """Each level's worked fraction: `default`, but for the levels `spec` names ("add2=1,addsub2=0": config
  `data.worked_by_level`), so a warm start can leave some levels always solved and others almost never."""
  fractions = dict.fromkeys(ALL_LEVELS, default)
  for item in filter(None, (part.strip() for part in spec.split(","))):
    level, sep, value = item.partition("=")
    try:
      fraction = float(value) if sep else float("nan")
    except ValueError:
      fraction = float("nan")
    if level not in ALL_LEVELS or not 0.0 <= fraction <= 1.0:
      raise DataError(f"synthetic:arithmetic: config.data.worked_by_level={spec!r}: {item!r} must be LEVEL=FRACTION "
                      f"with LEVEL one of {list(ALL_LEVELS)} and FRACTION in [0, 1]")
    fractions[level] = fraction
  return fractions


def warm_start_texts(source, *, template: str = "plain", tokenizer=None, qids=None) -> list[tuple[str, str]]:
  """(prompt, completion) pairs for the supervised warm start: the loss goes on the completion only.

  The completion is the example's worked solution followed by the tokenizer's eos token (the stop token the
  sampler ends on), so the model learns to stop. Every example must carry a solution.
  """
  eos = (getattr(tokenizer, "eos_token", None) or "") if tokenizer is not None else ""
  pairs = []
  for qid in range(len(source)) if qids is None else qids:
    example = source[qid]
    if not example.solution:
      raise DataError(f"{source.name} qid {qid}: no solution to warm-start on")
    pairs.append((templates.format_prompt(example, template=template, tokenizer=tokenizer), example.solution + eos))
  return pairs
