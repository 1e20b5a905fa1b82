"""The long-tailed rollout workload of `benchmarks/sampler.py --workload=long_tail` (its module docstring says how).

A random Qwen2-style model (d256, 4 layers, 8 query / 2 kv heads of 32, MLP 1024, vocab 256), so that with one
stop token id a row stops after ~256 tokens on average (geometric lengths, cut at the cap): RL answers spread from a
few tokens to the cap the same way. 32-token prompts, cap 512, temperature 1, no top-k / top-p; rows as given by
--long_tail_rows (64 and 256 by default).

Contenders, timed round-robin after warm-up calls (so load from other jobs falls on all alike), best of --repeats:
- engine: `jaxrlvr.rollout.scheduler.generate` (continuous batching over decode slots, `--decode_slots` per device,
  0: a slot per row) on the benchmark's CPU devices, batch sharded, and on one device;
- static: `jaxrlvr.rollout.generate` on the same mesh (one batch decoded until its longest row stops);
- transformers' `generate` (static batch, its dynamic cache) and `generate_batch` (continuous batching, paged
  cache), same weights, in a process of their own, with each thread count of --hf_threads;
- with --slots_per_device=N, the memory-bound pair: the engine with N decode slots a device against the static
  sampler in calls of max_rows_per_device=N (the same KV cache), as paper-scale runs bound their sampler.
Useful tokens/s = tokens up to and including each row's stop token / seconds of the call. The useful share is the
useful tokens over the row-steps decoded (the engine counts its own; the static sampler decodes rows x the longest
row).

On a GPU, `gpu_engine_section` runs the engine alone on the --gpu_preset's shapes (qwen2.5-math-1.5b) with random
bf16 weights, --gpu_long_prompt_len-token prompts and answers up to --gpu_long_cap tokens. Random weights give
near-uniform next tokens, so the stop set is V / --gpu_long_mean_tokens token ids (148 of 151,936 for a mean of
1,024): geometric lengths again. It prints useful tokens/s and the share of peak memory bandwidth the decode used:
each decode step reads every weight once and the cache slots its attention visits (the engine's own count).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time

import jax
import numpy as np
from flax import nnx

import workers
from jaxrlvr import parallel, rollout
from jaxrlvr.models import ModelConfig, Transformer, load_pretrained, save_pretrained
from jaxrlvr.rollout import engine, scheduler

LONG_TAIL_MODEL = ModelConfig(model_type="qwen2", vocab_size=256, hidden_size=256, intermediate_size=1024, num_layers=4,
                              num_heads=8, num_kv_heads=2, head_dim=32, tie_embeddings=True, qkv_bias=True,
                              max_position_embeddings=1024)
STOP_ID, PAD_ID = 1, 0  # prompts draw from [2, 256): no prompt holds the stop token


def _useful(rows: np.ndarray) -> int:
  """Tokens up to and including the first stop of each row [R, T] (all T when a row never stops)."""
  hit = rows == STOP_ID
  return int(np.sum(np.where(hit.any(axis=1), np.argmax(hit, axis=1) + 1, rows.shape[1])))


def _hf_worker(conn, path: str, prompts: list, cap: int) -> None:
  """transformers in its own process; answers ("generate" | "generate_batch", threads) with (seconds, useful)."""
  import torch
  import transformers

  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  config = transformers.GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=cap,
                                         eos_token_id=STOP_ID, pad_token_id=PAD_ID)
  ids = torch.tensor(prompts)  # equal lengths: no padding
  conn.send("ready")
  with torch.no_grad():
    while (job := conn.recv()) is not None:
      mode, threads = job
      torch.set_num_threads(threads)
      start = time.perf_counter()
      if mode == "generate":
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        useful = _useful(out[:, ids.shape[1]:].numpy())
      else:
        results = hf.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        useful = sum(len(r.generated_tokens) for r in results.values())
        assert len(results) == len(prompts), len(results)
      conn.send((time.perf_counter() - start, useful))


def bench_rows(rows: int, args: argparse.Namespace) -> dict:
  """Useful tokens/s (best and median of args.repeats) of every contender on `rows` prompts."""
  rs = np.random.RandomState(0)
  prompts = [rs.randint(2, LONG_TAIL_MODEL.vocab_size, size=args.long_tail_prompt_len).tolist() for _ in range(rows)]
  cap = args.long_tail_cap
  devices = len(jax.devices())
  mesh = parallel.make_mesh(data=devices) if devices > 1 else None
  with tempfile.TemporaryDirectory() as path:
    save_pretrained(Transformer(LONG_TAIL_MODEL, rngs=nnx.Rngs(0)), LONG_TAIL_MODEL, path)
    ours, _ = load_pretrained(path, mesh=mesh)
    ours_one, _ = load_pretrained(path)
    conn, worker = workers.start(multiprocessing.get_context("spawn"), _hf_worker, (path, prompts, cap))
    try:
      assert workers.ask(conn, worker, "transformers worker") == "ready"
      hf_ask = lambda job: workers.ask(conn, worker, "transformers worker", job)
      return _contest(prompts, cap, ours, ours_one, mesh, hf_ask, args)
    finally:
      workers.stop(conn, worker)


def _contest(prompts, cap, ours, ours_one, mesh, hf_ask, args) -> dict:
  seeds = iter(range(1, 10**6))
  shares = {"engine": [], "static": []}
  common = dict(max_new_tokens=cap, temperature=1.0, eos_ids=(STOP_ID,), pad_id=PAD_ID)

  def engine_call(model, on_mesh):
    stats = {}
    start = time.perf_counter()
    out = scheduler.generate(model, prompts, rng=jax.random.key(next(seeds)), mesh=mesh if on_mesh else None,
                                    decode_slots=args.decode_slots, chunk_steps=args.decode_chunk_steps, stats=stats,
                                    **common)
    seconds = time.perf_counter() - start
    shares["engine"].append(stats["useful_row_steps"] / stats["row_steps"])
    return seconds, int(out.lengths.sum())

  def static_call(rows_per_device=0):
    start = time.perf_counter()
    out = rollout.generate(ours, prompts, rng=jax.random.key(next(seeds)), mesh=mesh,
                           max_rows_per_device=rows_per_device, **common)
    seconds = time.perf_counter() - start
    if not rows_per_device:
      shares["static"].append(out.lengths.sum() / (len(prompts) * out.lengths.max()))
    return seconds, int(out.lengths.sum())

  def bounded_engine_call():
    start = time.perf_counter()
    out = scheduler.generate(ours, prompts, rng=jax.random.key(next(seeds)), mesh=mesh,
                                    decode_slots=args.slots_per_device, chunk_steps=args.decode_chunk_steps, **common)
    return time.perf_counter() - start, int(out.lengths.sum())

  def hf_call(mode, threads):
    return hf_ask((mode, threads))

  contenders = {"engine": lambda: engine_call(ours, True)}
  if mesh is not None:
    contenders["engine1"] = lambda: engine_call(ours_one, False)
  contenders["static"] = static_call
  if args.slots_per_device:  # equal KV memory: the engine's slots against the static sampler's calls of that size
    contenders["engine_bounded"] = bounded_engine_call
    contenders["static_bounded"] = lambda: static_call(args.slots_per_device)
  for threads in args.hf_threads:
    contenders[f"generate{threads}"] = lambda t=threads: hf_call("generate", t)
    contenders[f"generate_batch{threads}"] = lambda t=threads: hf_call("generate_batch", t)
  for name, fn in contenders.items():  # warm-up: compilation; the engine twice (a compaction level one call missed)
    for _ in range(2 if name.startswith("engine") else 1):
      start = time.perf_counter()
      fn()
      print(f"  {len(prompts)} rows, {name}: warm-up call {time.perf_counter() - start:.1f} s", flush=True)
  traces = sum(engine.TRACE_COUNTS.values())
  rates = {name: [] for name in contenders}
  for _ in range(args.repeats):
    for name, fn in contenders.items():
      seconds, useful = fn()
      rates[name].append(useful / seconds)
      print(f"  {len(prompts)} rows, {name}: {useful} useful tokens in {seconds:.1f} s", flush=True)
  best = {name: max(r) for name, r in rates.items()}
  return dict(rows=len(prompts), best=best, median={n: statistics.median(r) for n, r in rates.items()},
              share_engine=statistics.mean(shares["engine"]), share_static=statistics.mean(shares["static"]),
              compiles_while_timed=sum(engine.TRACE_COUNTS.values()) - traces, devices=len(jax.devices()))


def print_table(results: list[dict], args: argparse.Namespace) -> None:
  print(f"\nLong-tailed answers ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end): random "
        f"d256 model, vocab 256, one stop id, {args.long_tail_prompt_len}-token prompts, cap {args.long_tail_cap}, "
        f"temperature 1; useful tokens/s, best of {args.repeats} interleaved calls; engine with "
        f"decode_slots={args.decode_slots} per device, chunks of {args.decode_chunk_steps} steps, on "
        f"{results[0]['devices']} CPU device(s) and on 1")
  header = (f"{'rows':>5} {'engine':>8} {'1 device':>9} {'static':>8} {'generate':>9} {'(thr)':>5} {'gen_batch':>9} "
            f"{'(thr)':>5} {'vs best hf':>10} {'vs static':>9} {'useful: engine':>14} {'static':>7}")
  print(header)
  print("-" * len(header))
  for r in results:
    best = r["best"]
    gen = max((n for n in best if n.startswith("generate") and not n.startswith("generate_batch")), key=best.get)
    batch = max((n for n in best if n.startswith("generate_batch")), key=best.get)
    one = best.get("engine1", best["engine"])
    print(f"{r['rows']:>5} {best['engine']:8.0f} {one:9.0f} {best['static']:8.0f} {best[gen]:9.0f} "
          f"{gen[len('generate'):]:>5} {best[batch]:9.0f} {batch[len('generate_batch'):]:>5} "
          f"{best['engine'] / max(best[gen], best[batch]):9.2f}x {best['engine'] / best['static']:8.2f}x "
          f"{r['share_engine']:14.0%} {r['share_static']:7.0%}")
  for r in results:
    if "engine_bounded" in r["best"]:
      best = r["best"]
      print(f"{r['rows']} rows at {args.slots_per_device} slots a device (the static sampler in calls of as many "
            f"rows): engine {best['engine_bounded']:.0f}, static {best['static_bounded']:.0f} tokens/s, "
            f"{best['engine_bounded'] / best['static_bounded']:.2f}x")
  print("medians: " + "; ".join(f"{r['rows']} rows: " + ", ".join(f"{n} {v:.0f}" for n, v in r["median"].items())
                                for r in results))
  print("engine compilations during the timed calls: " + ", ".join(
      f"{r['rows']} rows: {r['compiles_while_timed']}" for r in results))


def gpu_engine_section(args: argparse.Namespace, peak: float | None) -> None:
  """The engine on long-tailed answers of the GPU preset (random bf16 weights): tokens/s and bandwidth."""
  import jax.numpy as jnp

  from jaxrlvr.models import get_preset

  device = jax.devices()[0]
  config = get_preset(args.gpu_preset).replace(param_dtype="bfloat16", compute_dtype="bfloat16")
  mesh = parallel.make_mesh(data=1, devices=[device])
  model = parallel.create_model(config, mesh, seed=0)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  stops = max(1, config.vocab_size // args.gpu_long_mean_tokens)
  stop_ids = tuple(range(config.vocab_size - stops, config.vocab_size))  # prompts draw below them
  slot_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(jnp.bfloat16).itemsize
  print(f"\nGPU engine: {device.device_kind}, {args.gpu_preset} random bf16 weights ({param_bytes / 1e9:.2f} GB), "
        f"{args.gpu_long_prompt_len}-token prompts, answers up to {args.gpu_long_cap} tokens ({stops} stop ids: "
        f"~{args.gpu_long_mean_tokens} on average), temperature 1, a slot per row")
  print(f"{'rows':>6} {'useful tok/s':>12} {'mean len':>9} {'useful':>7} {'step ms':>8} {'TB/s':>6} {'of peak':>8}")
  for rows in args.gpu_batches:
    rs = np.random.RandomState(0)
    prompts = [rs.randint(0, config.vocab_size - stops, size=args.gpu_long_prompt_len).tolist() for _ in range(rows)]
    seeds = iter(range(10**6))
    stats = {}

    def call():
      stats.clear()
      start = time.perf_counter()
      out = scheduler.generate(model, prompts, max_new_tokens=args.gpu_long_cap, rng=jax.random.key(next(seeds)),
                                      temperature=1.0, eos_ids=stop_ids, mesh=mesh, stats=stats)
      return time.perf_counter() - start, out

    call()  # compilation
    seconds, out = min((call() for _ in range(args.repeats)), key=lambda r: r[0])
    moved = stats["decode_steps"] * param_bytes + stats["kv_slot_steps"] * slot_bytes
    fraction = "-" if peak is None else f"{moved / seconds / peak:7.1%}"
    print(f"{rows:>6} {out.lengths.sum() / seconds:12.0f} {out.lengths.mean():9.0f} "
          f"{stats['useful_row_steps'] / stats['row_steps']:7.0%} {seconds / stats['decode_steps'] * 1e3:8.2f} "
          f"{moved / seconds / 1e12:6.2f} {fraction:>8}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
  ints = lambda s: [int(x) for x in s.split(",")]
  parser.add_argument("--long_tail_rows", type=ints, default=[64, 256])
  parser.add_argument("--long_tail_prompt_len", type=int, default=32)
  parser.add_argument("--long_tail_cap", type=int, default=512)
  parser.add_argument("--hf_threads", type=ints, default=sorted({os.cpu_count() or 1, 1}, reverse=True),
                      help="transformers' thread counts (the faster is reported)")
  parser.add_argument("--decode_slots", type=int, default=0, help="the engine's slots per device; 0: one per row")
  parser.add_argument("--decode_chunk_steps", type=int, default=scheduler.DEFAULT_CHUNK_STEPS)
  parser.add_argument("--slots_per_device", type=int, default=0,
                      help="> 0 adds the memory-bound pair: the engine with this many decode slots a device against "
                           "the static sampler in calls of max_rows_per_device=this (the same KV cache)")
  parser.add_argument("--gpu_long_prompt_len", type=int, default=1024)
  parser.add_argument("--gpu_long_cap", type=int, default=4096)
  parser.add_argument("--gpu_long_mean_tokens", type=int, default=1024, help="V / this many stop ids")


def run(args: argparse.Namespace) -> None:
  results = []
  for rows in args.long_tail_rows:  # each workload's table as soon as it is measured, then all of them
    results.append(bench_rows(rows, args))
    print_table(results[-1:], args)
  if len(results) > 1:
    print_table(results, args)
