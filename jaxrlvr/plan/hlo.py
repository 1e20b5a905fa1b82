"""Reading a compiled program's optimized HLO text: which collectives run inside its loops, and how many bytes.

`compiled.as_text()` of a jitted function is the program as the backend will run it (after SPMD partitioning and
XLA's loop-invariant code motion). A collective inside a `while` body runs once per iteration, so an all-gather of
the weights there is paid on every decoded token; the same all-gather in the entry computation is paid once per
call. The planner's step estimate (`plan/topology.py`) and the decode test (tests/test_tpu_compile.py) read the
program through these functions rather than trusting what the source meant XLA to do.

The text format: computations are blocks `%name (params) -> result {` ... `}` (the entry one starts with `ENTRY`);
an instruction names the computations it runs with `body=`, `condition=`, `calls=`, `to_apply=` or a braced list
(`branch_computations={%a, %b}`, `called_computations={...}`).
"""
from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_SINGLE_CALL = re.compile(r"\b(?:body|condition|calls|to_apply)=%([\w.\-]+)")
_LIST_CALL = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
# `%x = bf16[64,128]{...} all-gather(...)` or its async start; the result shape precedes the op name.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.+?)\s([a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction: its op ("all-gather", ...), the bytes of its result, and its computation."""
  op: str
  result_bytes: int
  computation: str


def computations(text: str) -> dict[str, list[str]]:
  """name -> the instruction lines of each computation of an HLO module's text; the entry one is also "ENTRY"."""
  out: dict[str, list[str]] = {}
  current = None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = header.group(2)
      out[current] = []
      if header.group(1):
        out["ENTRY"] = out[current]
    elif line.rstrip() == "}":  # not "}}, metadata=...": a Pallas call's backend config spans several lines
      current = None
    elif current is not None:
      out[current].append(line)
  return out


def _callees(lines: list[str]) -> set[str]:
  names = set()
  for line in lines:
    names.update(_SINGLE_CALL.findall(line))
    for group in _LIST_CALL.findall(line):
      names.update(n.strip().lstrip("%") for n in group.split(",") if n.strip())
  return names


def reachable(comps: dict[str, list[str]], roots: set[str]) -> set[str]:
  """The computations `roots` run, directly or through the computations they call."""
  seen, todo = set(), list(roots)
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    todo.extend(_callees(comps[name]))
  return seen


def loop_bodies(comps: dict[str, list[str]]) -> set[str]:
  """Every computation that runs once per iteration of some `while` loop (bodies, conditions, what they call)."""
  roots = set()
  for lines in comps.values():
    for line in lines:
      if " while(" in line:
        roots.update(_SINGLE_CALL.findall(line))  # body= and condition=
  return reachable(comps, roots)


_TRIP_COUNT = re.compile(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)')


def multiplicities(comps: dict[str, list[str]], unknown_trips: int = 1) -> dict[str, int]:
  """How many times one call of the program runs each computation: a `while` body (and its condition) as often as
  the loop's trip count times its caller's, XLA's `known_trip_count` where it gave one (scans, fori loops), else
  `unknown_trips` (a loop that stops on a value: the decode's, up to max_new_tokens; or XLA:TPU's loops, which
  keep no count: the update's over optimizer steps and micro-batches). `unknown_trips` is the count of a whole
  nest, so it multiplies the outermost loop without a count on each path once: the 8B update on v5p:2x2x1 nests
  three such loops, and multiplying each by its 32 micro-batches counted its gathers 1,024 times a step."""
  entry = next((name for name, lines in comps.items() if name != "ENTRY" and lines is comps.get("ENTRY")), None)
  counts: collections.Counter = collections.Counter()

  def visit(name: str, times: int, counted: bool) -> None:
    counts[name] += times
    for line in comps.get(name, ()):
      if " while(" in line:
        trip = _TRIP_COUNT.search(line)
        if trip:
          loop_times, loop_counted = times * int(trip.group(1)), counted
        else:
          loop_times, loop_counted = times * (1 if counted else unknown_trips), True
        for callee in _SINGLE_CALL.findall(line):  # body= and condition=
          visit(callee, loop_times, loop_counted)
      else:
        for callee in _callees([line]):
          visit(callee, times, counted)

  if entry is not None:
    visit(entry, 1, False)
  return dict(counts)


def collective_bytes(text: str, *, unknown_trips: int = 1) -> int:
  """The bytes one call of the program moves in collectives (results' bytes), each collective counted as often as
  its computation runs (`multiplicities`)."""
  times = multiplicities(computations(text), unknown_trips)
  return sum(c.result_bytes * times.get(c.computation, 0) for c in collectives(text))


def _array_bytes(shape_text: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(shape_text):
    total += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
  return total


def collectives(text: str, *, in_loops: bool | None = None) -> list[Collective]:
  """The collective instructions of a compiled program's text; `in_loops` True keeps those that run inside a
  `while` loop, False those that do not, None all. An async pair (`all-gather-start`/`-done`) counts once, at its
  start; the bytes are the gathered (or reduced) result's, the start's tuple minus its operand."""
  comps = computations(text)
  looped = loop_bodies(comps)
  out = []
  for name, lines in comps.items():
    if name == "ENTRY" or (in_loops is True and name not in looped) or (in_loops is False and name in looped):
      continue
    for line in lines:
      match = _INSTRUCTION.match(line)
      if not match:
        continue
      shape, op = match.groups()
      base = op[:-len("-start")] if op.endswith("-start") else op
      if base not in COLLECTIVES or op.endswith("-done"):
        continue
      size = _array_bytes(shape)
      if op.endswith("-start") and shape.startswith("("):  # (operand, result, ...): keep the result's bytes
        arrays = _ARRAY.findall(shape)
        size = _array_bytes(" ".join(f"{d}[{s}]" for d, s in arrays[1:2])) if len(arrays) > 1 else size
      out.append(Collective(op=base, result_bytes=size, computation=name))
  return out


def count(items: list[Collective], op: str) -> int:
  return sum(1 for c in items if c.op == op)


def bytes_by_op(items: list[Collective]) -> dict[str, int]:
  totals: collections.Counter = collections.Counter()
  for c in items:
    totals[c.op] += c.result_bytes
  return dict(totals)
