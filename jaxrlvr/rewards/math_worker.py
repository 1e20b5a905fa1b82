"""A math-verify worker process: reads (seq, completion, gold, timeout, literal) frames on stdin, writes
(seq, score, not_literal).

Started by `jaxrlvr.rewards.math.MathRewardPool` as `python -m jaxrlvr.rewards.math_worker`, a fresh interpreter
that imports only the standard library and math-verify. Why a fresh interpreter and not a forked one: jax is not
fork-safe, and the 'spawn' start method would re-run the trainer's `__main__` (jax, the model, ...) in every
worker. math-verify needs the main thread of its own process because it times itself with `signal.alarm`.

Frames are a little-endian uint32 byte count followed by a pickle. The first frame out is `("ready", pid)`.
Nothing else may write to stdout, so stdout is re-pointed at stderr before math-verify is imported.
"""
import functools
import logging
import os
import pickle
import re
import struct
import sys

_HEADER = struct.Struct("<I")
# A number as written: 861, -3, 2.5, 1,024. With `literal`, a number for gold must be answered with one of these.
NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def is_number(text: str) -> bool:
  return NUMBER.fullmatch(text.strip()) is not None


def _read_exact(stream, n: int) -> bytes | None:
  """Reads n bytes, or returns None at end of input (the parent closed the pipe or died)."""
  chunks = []
  while n:
    chunk = stream.read(n)
    if not chunk:
      return None
    chunks.append(chunk)
    n -= len(chunk)
  return b"".join(chunks)


def _write_frame(stream, obj) -> None:
  payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
  stream.write(_HEADER.pack(len(payload)) + payload)
  stream.flush()


def main() -> None:
  channel_in = sys.stdin.buffer
  channel_out = sys.stdout.buffer
  sys.stdout = sys.stderr  # A stray print() in a library must not corrupt the frame stream.

  # math-verify logs every timeout with the full input (a 1 MB completion would be echoed); silence it.
  logging.disable(logging.CRITICAL)
  import math_verify  # pylint: disable=g-import-not-at-top

  @functools.lru_cache(maxsize=4096)
  def parse_gold(gold: str, timeout: int):
    return math_verify.parse("$" + gold + "$", parsing_timeout=timeout)

  def score(completion: str, gold: str, timeout: int, literal: bool) -> tuple[float, bool]:
    """(verdict, not_literal). math-verify's parse gives [value..., the string it extracted]; with `literal`, an
    expression extracted for a number (`27+79-81` for 25, `5^2`) scores 0 however it evaluates."""
    gold_parsed = parse_gold(gold, timeout)
    pred_parsed = math_verify.parse(completion, parsing_timeout=timeout)
    if literal and is_number(gold) and not (pred_parsed and is_number(str(pred_parsed[-1]))):
      return 0.0, bool(pred_parsed)
    return float(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=timeout)), False

  score("\\boxed{1}", "1", 5, True)  # Compile math-verify's regexes before announcing readiness.
  _write_frame(channel_out, ("ready", os.getpid()))
  while True:
    header = _read_exact(channel_in, _HEADER.size)
    if header is None:
      return
    (size,) = _HEADER.unpack(header)
    body = _read_exact(channel_in, size)
    if body is None:
      return
    seq, completion, gold, timeout, literal = pickle.loads(body)
    try:
      result, not_literal = score(completion, gold, timeout, literal)
    except Exception:  # pylint: disable=broad-except
      # math-verify already turns its own errors into False; anything that still escapes
      # (RecursionError from deep nesting, MemoryError) is an unverifiable answer.
      result, not_literal = 0.0, False
    _write_frame(channel_out, (seq, result, not_literal))


if __name__ == "__main__":
  main()
