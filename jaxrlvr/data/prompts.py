"""The data against the run's limits, checked before anything heavy starts; and the warm start's token id pairs.

`check_prompts` tokenises every training and evaluation prompt once, with the template applied (what the sampler
sees), and stops on the first row whose prompt is longer than `data.max_prompt_len` or has characters the tokenizer
cannot encode, naming the config key, the spec (the file), the row and the lengths. The limit is not adapted to the
data: it fixes the padded prompt length of every update batch and the memory plan, and config.json has to say what a
run did. The message gives the value that would fit instead.
"""
import os
from typing import Callable, Sequence

from absl import logging
import numpy as np

from jaxrlvr.data import templates
from jaxrlvr.data import tokenizer as tokenizer_lib
from jaxrlvr.data.types import DataError
from jaxrlvr.data.types import describe_row
from jaxrlvr.data.types import Source

_CHUNK = 4096  # rows tokenised per call: the fast tokenizer batches them; only lengths are kept, so memory stays flat


def _unknown_characters(tokenizer, text: str) -> str:
  """The pieces of `text` the tokenizer maps to its unknown token, e.g. "'W', 'h', '?'" (fast tokenizers only)."""
  try:
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
  except (NotImplementedError, ValueError):
    return "some"
  pieces = dict.fromkeys(text[start:end] for token, (start, end) in zip(encoded["input_ids"],
                                                                         encoded["offset_mapping"])
                         if token == tokenizer.unk_token_id)
  return ", ".join(repr(p) for p in pieces) or "some"


def _encoding_hint(tokenizer) -> str:
  if os.path.basename(os.path.normpath(getattr(tokenizer, "name_or_path", "") or "")) == tokenizer_lib.EMBEDDED_NAME:
    known = "".join(sorted(t for t in tokenizer.get_vocab() if t not in tokenizer_lib.SPECIAL_TOKENS))
    return (f"the embedded tokenizer knows only the arithmetic task's characters ({known!r}); for other text give "
            "--config.tokenizer.path a Hugging Face tokenizer and --config.model.path a model with its vocabulary")
  return "use a tokenizer that covers this text (--config.tokenizer.path), or clean the rows"


def check_prompts(parts: Sequence[tuple[str, Source, int]], tokenizer, *, template: str, max_prompt_len: int,
                  max_new_tokens: int, model_context: int | None = None) -> int:
  """Checks the first `count` rows of each (config key, source, count) part; returns the longest prompt in tokens.

  Raises DataError, e.g. "data.source jsonl:/d/q.jsonl line 5 (row 4): the prompt has 21 tokens, but
  data.max_prompt_len is 16: raise --config.data.max_prompt_len to 21 (at most 230: the model's context of 256 less
  rollout.max_new_tokens=26)", with the count and the longest when several rows are too long. Answers with
  characters the tokenizer cannot produce get one warning: the model can then be rewarded on them only through an
  equivalent form the verifier accepts.
  """
  unk = tokenizer.unk_token_id
  found = []  # (key, source, lengths [count]) per part
  unwritable_answers, first_unwritable = 0, None
  for key, source, count in parts:
    lengths = np.zeros(count, np.int64)
    for start in range(0, count, _CHUNK):
      examples = [source[q] for q in range(start, min(start + _CHUNK, count))]
      texts = [templates.format_prompt(e, template=template, tokenizer=tokenizer) for e in examples]
      for i, (text, ids) in enumerate(zip(texts, tokenizer_lib.encode(tokenizer, texts))):
        qid = start + i
        lengths[qid] = len(ids)
        if unk is not None and unk in ids:
          raise DataError(f"{key} {source.name} {describe_row(source, qid)}: the prompt {text!r} has characters "
                          f"the tokenizer cannot encode ({_unknown_characters(tokenizer, text)}); "
                          f"{_encoding_hint(tokenizer)}")
        if not ids:
          raise DataError(f"{key} {source.name} {describe_row(source, qid)}: the prompt {text!r} is empty once "
                          "tokenised")
      if unk is not None:
        answers = tokenizer_lib.encode(tokenizer, [e.answer for e in examples])
        for i, ids in enumerate(answers):
          if unk in ids:
            unwritable_answers += 1
            first_unwritable = first_unwritable or (key, source, start + i, examples[i].answer)
    found.append((key, source, lengths))
  if first_unwritable:
    key, source, qid, answer = first_unwritable
    logging.warning("data: %d answers have characters the tokenizer cannot produce (the first: %s %s %s, %r); the "
                    "model can earn reward on them only through an equivalent form the verifier accepts",
                    unwritable_answers, key, source.name, describe_row(source, qid), answer)

  longest = max(((int(lengths.max()), int(lengths.argmax()), key, source) for key, source, lengths in found
                 if len(lengths)), key=lambda item: item[0], default=(0, 0, "", None))
  too_long = [(key, source, lengths) for key, source, lengths in found if (lengths > max_prompt_len).any()]
  if not too_long:
    return longest[0]
  key, source, lengths = too_long[0]
  qid = int(np.argmax(lengths > max_prompt_len))
  message = (f"{key} {source.name} {describe_row(source, qid)}: the prompt has {lengths[qid]} tokens, but "
             f"data.max_prompt_len is {max_prompt_len}")
  num_long = sum(int((lengths > max_prompt_len).sum()) for _, _, lengths in found)
  longest_len, longest_qid, longest_key, longest_source = longest
  if num_long > 1:
    total = sum(len(lengths) for _, _, lengths in found)
    place = describe_row(longest_source, longest_qid)
    if (longest_key, longest_source.name) != (key, source.name):
      place = f"{longest_key} {longest_source.name} {place}"
    message += f" ({num_long} of the {total} prompts are longer; the longest, {place}, has {longest_len} tokens)"
  allowed = model_context - max_new_tokens if model_context else None
  limit = (f"the model's context of {model_context} less rollout.max_new_tokens={max_new_tokens}"
           if model_context else "")
  if allowed is None:
    message += f": raise --config.data.max_prompt_len to {longest_len}"
  elif longest_len <= allowed:
    message += f": raise --config.data.max_prompt_len to {longest_len} (at most {allowed}: {limit})"
  else:
    message += (f": at most {allowed} tokens fit ({limit}); filter or shorten the longer rows, or lower "
                "--config.rollout.max_new_tokens")
  raise DataError(message)


def rows_without_solution(source: Source, max_rows: int) -> int:
  """How many of the first `max_rows` rows have no solution (the warm start imitates solutions: it needs them all)."""
  return sum(not source[q].solution for q in range(min(len(source), max_rows)))


def warm_start_pairs(source: Source, tokenizer, many_prompt_ids: Callable[[Sequence[int]], list[list[int]]], *,
                     max_rows: int, completion_len: int) -> tuple[list[tuple[list[int], list[int]]], int]:
  """(pairs, rows without a solution) over the first `max_rows` rows: pairs are (prompt ids, solution ids + eos);
  `many_prompt_ids` gives the prompts' ids of a list of rows (`rollout.PromptBook.many_prompt_ids`).

  The pairs are empty when any of those rows has no solution: the caller skips the warm start and says so (a warm
  start on the rows that happen to have one would imitate a biased part of the data). A solution the tokenizer cannot
  encode, or longer than the completion (`rollout.max_new_tokens` with the stop token), stops with its row.
  """
  missing = rows_without_solution(source, max_rows)
  if missing:
    return [], missing
  qids = range(min(len(source), max_rows))
  solutions = [source[q].solution for q in qids]
  pairs = []
  unk = tokenizer.unk_token_id
  for start in range(0, len(qids), _CHUNK):
    chunk = solutions[start:start + _CHUNK]
    prompts = many_prompt_ids(range(start, start + len(chunk)))
    for i, ids in enumerate(tokenizer_lib.encode(tokenizer, chunk)):
      qid = start + i
      where = f"data.source {source.name} {describe_row(source, qid)}"
      if unk is not None and unk in ids:
        raise DataError(f"{where}: the solution {chunk[i]!r} has characters the tokenizer cannot encode "
                        f"({_unknown_characters(tokenizer, chunk[i])}); {_encoding_hint(tokenizer)}; or skip the "
                        "warm start with --config.warm_start.steps=0")
      if len(ids) + 1 > completion_len:
        raise DataError(f"{where}: the solution has {len(ids)} tokens and the stop token, but "
                        f"rollout.max_new_tokens is {completion_len}; raise --config.rollout.max_new_tokens, or skip "
                        "the warm start with --config.warm_start.steps=0")
      pairs.append((prompts[i], ids + [tokenizer.eos_token_id]))
  return pairs, 0
