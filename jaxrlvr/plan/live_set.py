"""What a compiled program holds at its peak, read from XLA's dump of it: how the planner's TPU terms were fitted.

    XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" python -m jaxrlvr.plan --config=... --topology=v5p:2x2x1 \\
        --phases=update
    python -m jaxrlvr.plan.live_set DIR/module_0000.jit_update.cl_933746096   # one module's files, by their prefix

The sweep walks the module's flattened schedule (`*after_optimizations-live-range.txt`: each value's first and last
position) with the sizes and offsets of its buffer assignment (`*after_optimizations-buffer-assignment.txt`). A
temporary counts by the union of its [offset, offset + size) with the others live (an output XLA writes over its
input counts once); any other allocation (an argument, an output, which donation may alias) counts whole while any
of its values lives. On XLA:TPU the maximum is its `peak_memory_in_bytes` to within 0.5 GB (docs/pods.md, "The
planner against XLA:TPU"); the command prints it and the buffers live there, by shape.
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import re
import sys

_ALLOCATION = re.compile(r"allocation (\d+): size (\d+), (.*)")
_VALUE = re.compile(r"\s*value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")
_RANGE = re.compile(r"\s*(\S+?)(\{[^}]*\})?:(\d+)-(\d+)$")


@dataclasses.dataclass(frozen=True)
class Buffer:
  name: str
  start: int  # positions in the flattened schedule
  end: int
  allocation: int
  size: int
  offset: int
  shape: str  # e.g. bf16[8,9216,4096] (layout dropped)
  temp: bool  # in the preallocated temporaries


@dataclasses.dataclass(frozen=True)
class Peak:
  bytes: int
  position: int
  live: list[Buffer]


def _file(prefix: str, suffix: str) -> str:
  found = sorted(glob.glob(glob.escape(prefix) + "*" + suffix))
  if not found:
    raise FileNotFoundError(f"plan/live_set.py: no {prefix}*{suffix} (dump with XLA_FLAGS=\"--xla_dump_to=DIR "
                            "--xla_dump_hlo_as_text\")")
  return found[0]


def read_buffers(prefix: str) -> tuple[list[Buffer], dict[int, int]]:
  """(every value with a live range and an assigned buffer, allocation -> size) of the module at `prefix`."""
  values, sizes, temp = {}, {}, set()
  allocation = None
  with open(_file(prefix, "after_optimizations-buffer-assignment.txt")) as f:
    for line in f:
      if m := _ALLOCATION.match(line):
        allocation = int(m.group(1))
        sizes[allocation] = int(m.group(2))
        if "preallocated-temp" in m.group(3):
          temp.add(allocation)
      elif (m := _VALUE.match(line)) and allocation is not None:
        values[m.group(1)] = (allocation, int(m.group(2)), int(m.group(3)), m.group(4).split("{")[0])
  with open(_file(prefix, "after_optimizations-live-range.txt")) as f:
    ranges = f.read().split("BufferLiveRange:", 1)[-1].split("Live ranges at", 1)[0]
  buffers = []
  for line in ranges.splitlines():
    if m := _RANGE.match(line):
      name = m.group(1) + (m.group(2) if m.group(2) not in (None, "{}") else "")
      if name in values:
        allocation, size, offset, shape = values[name]
        buffers.append(Buffer(name, int(m.group(3)), int(m.group(4)), allocation, size, offset, shape,
                              allocation in temp))
  return buffers, sizes


def _union(intervals: list[tuple[int, int]]) -> int:
  total, end = 0, -1
  for start, stop in sorted(intervals):
    if stop > end:
      total += stop - max(start, end)
      end = stop
  return total


def sweep(prefix: str) -> Peak:
  """The largest live bytes over the module's schedule, where, and the buffers live there."""
  buffers, sizes = read_buffers(prefix)
  starting = collections.defaultdict(list)
  for b in buffers:
    starting[b.start].append(b)
  live: list[Buffer] = []
  best = Peak(0, 0, [])
  for position in sorted(starting):  # between two starts buffers only die: the live bytes cannot rise there
    live = [b for b in live if b.end >= position] + starting[position]
    held = sum(sizes[a] for a in {b.allocation for b in live if not b.temp})
    held += _union([(b.offset, b.offset + b.size) for b in live if b.temp])
    if held > best.bytes:
      best = Peak(held, position, live)
  return best


def format_peak(peak: Peak, top: int = 25) -> str:
  """The peak and its live buffers grouped by shape, largest first (temporaries and arguments/outputs apart)."""
  groups = collections.defaultdict(list)
  for b in peak.live:
    groups[(b.shape, "temp" if b.temp else "arg/out")].append(b)
  rows = sorted(groups.items(), key=lambda kv: -sum(b.size for b in kv[1]))[:top]
  lines = [f"peak {peak.bytes / 1e9:.2f} GB at schedule position {peak.position}; live there, by shape:"]
  lines += [f"  {sum(b.size for b in bs) / 1e9:9.3f} GB  {len(bs):5d} x {shape:<28} {kind}"
            for (shape, kind), bs in rows]
  return "\n".join(lines)


def main(argv: list[str]) -> int:
  if len(argv) != 2:
    print("usage: python -m jaxrlvr.plan.live_set DIR/module_NNNN.jit_NAME[.cl_NNN]", file=sys.stderr)
    return 2
  try:
    print(format_peak(sweep(argv[1])))
  except FileNotFoundError as e:
    print(e, file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
