"""What the ExpRL judge is asked, and how its 1-5 verdict is read back.

The judge sees the question, a reference solution the policy never sees, and the policy's whole answer (outcome
variant), a prefix of it -- the answer so far, up to the end of one segment (process variant, the default) -- or one
segment of it with the earlier segments as context (process variant, `exprl.process_judging="step"`). All ask
the judge to *check* the text against the reference -- not to solve the problem, and not to fill in or repair
missing steps -- and to end with one line `SCORE: k`, k in 1..5. A verdict k becomes the reward (k - 1) / 4, so
scores live in [0, 1] with 0 for "nothing useful" and 1 for "fully matches the reference".

The wording is this project's own; the paper's prompts (ExpRL, appendix A.1.2) were not copied.
"""
import dataclasses
import re

MIN_SCORE = 1
MAX_SCORE = 5

SYSTEM_PROMPT = (
    "You are a careful grader of mathematical reasoning. You compare a student's work with a trusted reference "
    "solution. You do not solve the problem yourself, you do not complete unfinished steps and you do not fix "
    "mistakes: you judge only what the student actually wrote.")

_SCALE = """Scale:
5 - everything written is correct and follows a route that reaches the reference's result;
4 - correct and useful progress with at most a minor slip;
3 - partly correct: some steps agree with the reference, others are missing or doubtful;
2 - mostly wrong or unhelpful, with a small correct piece;
1 - wrong, irrelevant or empty."""

_OUTCOME_TEMPLATE = """Grade the student's answer against the reference solution.

## Problem
{question}

## Reference solution (hidden from the student)
{reference}

## Student's answer
{answer}

## Instructions
Check the student's answer claim by claim against the reference. A different method is fine if every step holds.
Count only what is written: do not supply missing steps or correct errors on the student's behalf.
{scale}

Explain briefly, then finish with a last line of exactly this form: SCORE: <a whole number from 1 to 5>"""

_PROCESS_TEMPLATE = """Grade ONE step of a student's work against the reference solution.

## Problem
{question}

## Reference solution (hidden from the student)
{reference}

## The student's earlier steps (context only, do not grade them)
{context}

## The step to grade
{segment}

## Instructions
Judge only the step to grade: is it correct, and does it move toward the reference's result (or repeat,
stall, or go wrong)? Do not solve the rest of the problem and do not repair the step.
{scale}

Explain briefly, then finish with a last line of exactly this form: SCORE: <a whole number from 1 to 5>"""

_PREFIX_TEMPLATE = """Grade a student's UNFINISHED work against the reference solution.

## Problem
{question}

## Reference solution (hidden from the student)
{reference}

## The student's work so far (it may stop before the end)
{answer}

## Instructions
Judge how far what is written so far goes toward the reference's result: is every written step correct, and does
it make real progress (or repeat, stall, or go wrong)? Do not hold it against the work that it is not finished,
and do not complete it or repair it on the student's behalf.
{scale}

Explain briefly, then finish with a last line of exactly this form: SCORE: <a whole number from 1 to 5>"""

_NO_CONTEXT = "(none: this is the first step)"


@dataclasses.dataclass(frozen=True)
class JudgeRequest:
  """One thing to grade.

  `answer` is the whole completion (outcome), a prefix of it (`prefix=True`: process, judged as unfinished
  work) or one segment (process, judged alone); `context` holds the segments before that segment (step judging
  only; None selects the outcome or prefix prompt).
  """
  question: str
  reference: str
  answer: str
  context: str | None = None
  prefix: bool = False

  def __post_init__(self):
    if self.prefix and self.context is not None:
      raise ValueError("JudgeRequest: a prefix request grades the answer so far and takes no separate context")

  @property
  def is_process(self) -> bool:
    return self.context is not None or self.prefix


def build_messages(request: JudgeRequest) -> list[dict[str, str]]:
  """OpenAI-style chat messages (system + user) for one request."""
  if request.prefix:
    user = _PREFIX_TEMPLATE.format(question=request.question.strip(), reference=request.reference.strip(),
                                   answer=request.answer.strip() or "(empty)", scale=_SCALE)
  elif request.is_process:
    user = _PROCESS_TEMPLATE.format(question=request.question.strip(), reference=request.reference.strip(),
                                    context=request.context.strip() or _NO_CONTEXT,
                                    segment=request.answer.strip() or "(empty)", scale=_SCALE)
  else:
    user = _OUTCOME_TEMPLATE.format(question=request.question.strip(), reference=request.reference.strip(),
                                    answer=request.answer.strip() or "(empty)", scale=_SCALE)
  return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


# Reasoning judges (Qwen3, R1) think before they answer; a score drafted inside the thinking is not the verdict.
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_OPEN_THINK = re.compile(r"<think>", re.IGNORECASE)
# Accepted verdict spellings, searched from the end: "SCORE: 4", "**Score**: 4", "score = 4/5", "Score - [4]",
# "Final score: **4**"; then "\boxed{4}" and "[[4]]" as fallbacks some judges use.
_SCORE_PATTERNS = (
    re.compile(r"score\W{0,6}?[:=\-]\s*[\*\[\(]{0,3}\s*(\d+(?:\.\d+)?)\s*(?:/\s*5)?\s*[\*\]\)]{0,3}", re.IGNORECASE),
    re.compile(r"\\boxed\{\s*(\d+(?:\.\d+)?)\s*\}"),
    re.compile(r"\[\[\s*(\d+(?:\.\d+)?)\s*\]\]"),
)


def parse_verdict(text: str) -> int | None:
  """The judge's 1-5 verdict, or None when the reply does not state one.

  The last stated score wins (judges sometimes quote the scale or revise themselves). A value outside 1..5 or a
  fraction ("3.5") is not a verdict: it returns None rather than being rounded, so a confused judge is counted
  as a parse failure instead of silently shaping the reward.
  """
  if text is None:
    return None
  visible = _THINK_BLOCK.sub("", text)
  if _OPEN_THINK.search(visible):  # thinking never closed: the reply was cut off before any verdict
    return None
  for pattern in _SCORE_PATTERNS:
    matches = pattern.findall(visible)
    if matches:
      value = matches[-1]
      if "." in value:
        whole, _, frac = value.partition(".")
        if frac.strip("0"):
          return None
        value = whole
      verdict = int(value)
      return verdict if MIN_SCORE <= verdict <= MAX_SCORE else None
  return None


def verdict_to_score(verdict: int | None) -> float | None:
  """Maps a verdict k in 1..5 to the reward (k - 1) / 4 in [0, 1]; None stays None."""
  if verdict is None:
    return None
  return (verdict - MIN_SCORE) / (MAX_SCORE - MIN_SCORE)


def parse_score(text: str) -> float | None:
  """The reward in [0, 1] stated by a judge reply, or None when it cannot be parsed."""
  return verdict_to_score(parse_verdict(text))
