"""Where a GRPO update's time goes, as achieved FLOP/s against this machine's own matmul throughput.

    python benchmarks/update_split.py [--model=smollm2-135m] [--rows=16] [--prompt=64] [--completion=64] \
        [--minibatches=0] [--repeats=3]

On one CPU device, with a model preset's shapes (random weights: speed does not depend on their values) and a batch
of `rows` full-length rows, it times, round-robin after one warm-up call each:
  - matmul: a [2048, 2048] float32 `jnp.dot`, the peak this process can reach;
  - update: the jitted GRPO update (`step.make_update_fn`, the preset's own config: optimizer, micro-batches),
    each group's prompt run once for its samples as the loop does (`train.share_prompts`; the batch's rows come in
    groups of rollout.group_size with one prompt each); and, when that applies, "update, prompt per row": the same
    update with every row scoring its own copy of the prompt;
  - score: the scoring pass the loop runs before it for the old log-probs (`step.make_score_fn`);
  - body forward, body forward+backward: the decoder stack alone (`model.hidden`), a sum of squares as the loss;
  - head forward+backward: the log-prob and entropy head alone (`scoring.chunked_logprobs`) on fixed hidden states
    of the completion positions, the ones the update scores, its logits kept or computed again in the backward
    pass as the update's are (`train.keep_logits_mb`).
Each is reported as its best call (median), the FLOPs it must do (2 x parameters x tokens per matmul pass, plus
attention's score and value products; a backward pass is twice a forward), and that as a share of the matmul
throughput. The share says how far each part is from what this CPU can do.
"""
import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import grpo  # pylint: disable=g-import-not-at-top
from jaxrlvr import parallel  # pylint: disable=g-import-not-at-top
from jaxrlvr import run_setup  # pylint: disable=g-import-not-at-top
from jaxrlvr import scoring  # pylint: disable=g-import-not-at-top
from jaxrlvr import step as step_lib  # pylint: disable=g-import-not-at-top
from jaxrlvr import xla_cpu  # pylint: disable=g-import-not-at-top

_MATMUL = 2048


def forward_flops(model_config, params, rows: int, length: int, scored: int, prompt_group: int = 1,
                  packed: tuple[int, int] | None = None) -> tuple[float, float]:
  """(decoder stack, head) FLOPs of one forward pass over rows x length tokens, the head on the last `scored` of
  each row (the completion: `scoring.score(last=...)`). With `prompt_group` K > 1 the first length - scored tokens
  (the prompt) run once per K rows (`scoring.score_shared_prompts`); `packed` (packed rows, prompt blocks a row):
  the completions run packed into that many rows, each attending to its prompt blocks
  (`scoring.score_packed_completions`)."""
  c = model_config
  unembedding = c.vocab_size * c.hidden_size
  # The input embedding is a gather; with tied embeddings its table is the unembedding, counted once, in the head.
  body = sum(x.size for x in jax.tree.leaves(params)) - unembedding * (1 if c.tie_embeddings else 2)
  per_key = 4 * c.num_heads * c.head_dim * c.num_layers  # q.k and p.v, every key (no causal saving)
  if packed is not None:
    (completion_rows, blocks), prompt = packed, length - scored
    tokens = rows // prompt_group * prompt + completion_rows * scored
    attention = per_key * (rows // prompt_group * prompt * prompt + completion_rows * scored * (blocks * prompt + scored))
    return 2.0 * body * tokens + attention, 2.0 * unembedding * completion_rows * scored
  if prompt_group > 1:
    prompt = length - scored
    tokens = rows // prompt_group * prompt + rows * scored
    attention = per_key * (rows // prompt_group * prompt * prompt + rows * scored * length)
  else:
    tokens = rows * length
    attention = per_key * rows * length * length
  return 2.0 * body * tokens + attention, 2.0 * unembedding * rows * scored


def matmul_peak(repeats: int = 5) -> float:
  """FLOP/s of a [2048, 2048] float32 `jnp.dot` in this process, best of `repeats` calls after a warm-up one."""
  square = jnp.ones((_MATMUL, _MATMUL), jnp.float32)
  dot = jax.jit(jnp.dot)
  jax.block_until_ready(dot(square, square))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(dot(square, square))
    best = min(best, time.perf_counter() - start)
  return 2.0 * _MATMUL ** 3 / best


def _batch(rows: int, prompt: int, completion: int, vocab: int, group: int) -> dict:
  """Full-length rows, every `group` consecutive ones with the same prompt (a GRPO group's samples)."""
  rs = np.random.RandomState(0)
  width = prompt + completion
  ids = rs.randint(1, vocab, (rows, width)).astype(np.int32)
  ids[:, :prompt] = np.repeat(ids[::group, :prompt], group, axis=0)
  return dict(input_ids=ids,
              attention_mask=np.ones((rows, width), np.int32),
              completion_mask=np.ones((rows, completion), np.float32),
              advantages=rs.randn(rows, completion).astype(np.float32),
              old_logp=-np.ones((rows, completion), np.float32), behaviour_logp=-np.ones((rows, completion), np.float32),
              replayed=np.zeros(rows, bool), clip=np.ones(rows, bool))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="smollm2-135m", help="model preset (its config arg: configs/grpo.py:model=)")
  parser.add_argument("--rows", type=int, default=16, help="rollout rows (the smollm2 preset: 4 questions x 4)")
  parser.add_argument("--prompt", type=int, default=64)
  parser.add_argument("--completion", type=int, default=64)
  parser.add_argument("--minibatches", type=int, default=0,
                      help="train.num_minibatches (optimizer steps per batch); 0: the config's")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--share_prompts", type=int, default=-1,
                      help="train.share_prompts: 1 on, 0 off; -1: the config's (on where the batch splits in groups)")
  args = parser.parse_args()
  xla_cpu.setup_process()  # as the main job runs: before JAX starts

  config = grpo.get_config(f"model={args.model}")
  with config.unlocked():
    if args.minibatches:
      config.train.num_minibatches = args.minibatches
    if args.share_prompts >= 0:
      config.train.share_prompts = bool(args.share_prompts)
  group = config.rollout.group_size
  prompt_group = group if config.train.share_prompts and step_lib.prompt_group_fits(args.rows, group, config, 1) else 1
  mesh = parallel.make_mesh(data=1, devices=jax.devices()[:1])
  model_config = run_setup.model_config(config)
  graphdef, params = nnx.split(parallel.create_model(model_config, mesh, seed=0))
  batch = parallel.shard_batch(_batch(args.rows, args.prompt, args.completion, model_config.vocab_size, group), mesh)
  length = args.prompt + args.completion
  body_flops, head_flops = forward_flops(model_config, params, args.rows, length, args.completion)
  shared_body_flops, _ = forward_flops(model_config, params, args.rows, length, args.completion, prompt_group)

  optimizer = step_lib.make_optimizer(config)
  state = step_lib.create_state(jax.tree.map(jnp.copy, params), optimizer, mesh)
  make_update = lambda group: step_lib.make_update_fn(
      graphdef, config, optimizer, state_sharding=jax.tree.map(lambda x: x.sharding, state),
      batch_sharding=parallel.batch_sharding(mesh), prompt_group=group)
  score = step_lib.make_score_fn(graphdef, temperature=config.rollout.temperature or 1.0,
                                 batch_sharding=parallel.batch_sharding(mesh),
                                 max_chunk_rows=args.rows // config.train.num_microbatches)
  ids, mask = batch["input_ids"], batch["attention_mask"]

  def body_loss(p):
    hidden, _ = nnx.merge(graphdef, p).hidden(ids, attention_mask=mask)  # [B, S, D]
    return jnp.sum(hidden * hidden)

  # The head's inputs: the hidden states before each completion token, [rows, completion, D].
  hidden = jnp.asarray(np.random.RandomState(1).randn(args.rows, args.completion, model_config.hidden_size),
                       jnp.float32)

  # As the update computes it: its logits kept for the backward pass where they fit train.keep_logits_mb.
  keep_logits = scoring.logits_kept(args.rows // config.train.num_microbatches, args.completion,
                                    model_config.vocab_size, config.train.keep_logits_mb)

  def head_loss(p, h):
    logp, entropy = scoring.chunked_logprobs(h, nnx.merge(graphdef, p).unembedding(), ids[:, -args.completion:],
                                             chunk_size=scoring.DEFAULT_CHUNK_SIZE,
                                             vocab_chunk_size=scoring.DEFAULT_VOCAB_CHUNK_SIZE,
                                             keep_logits=keep_logits)
    return jnp.sum(logp) + jnp.sum(entropy)

  square = jnp.ones((_MATMUL, _MATMUL), jnp.float32)
  state_box = [state]

  def run_update(update):
    state_box[0], metrics, _ = update(state_box[0], batch)
    return metrics

  parts = {  # name -> (call, FLOPs)
      "matmul": (lambda f=jax.jit(jnp.dot): f(square, square), 2.0 * _MATMUL ** 3),
      "update": (lambda f=make_update(prompt_group): run_update(f), 3 * (shared_body_flops + head_flops)),
      "score": (lambda: score(state_box[0].params, batch), body_flops + head_flops),
      "body forward": (lambda f=jax.jit(body_loss): f(params), body_flops),
      "body forward+backward": (lambda f=jax.jit(jax.grad(body_loss)): f(params), 3 * body_flops),
      "head forward+backward": (lambda f=jax.jit(jax.grad(head_loss, argnums=(0, 1))): f(params, hidden),
                                3 * head_flops),
  }
  if prompt_group > 1:
    parts["update, prompt per row"] = (lambda f=make_update(1): run_update(f), 3 * (body_flops + head_flops))
  times = {name: [] for name in parts}
  for name, (call, _) in parts.items():
    jax.block_until_ready(call())  # compile
  for _ in range(args.repeats):
    for name, (call, _) in parts.items():
      start = time.perf_counter()
      jax.block_until_ready(call())
      times[name].append(time.perf_counter() - start)

  peak = parts["matmul"][1] / min(times["matmul"])
  print(f"\n{args.model}: {args.rows} rows x {length} tokens ({args.prompt} prompt + {args.completion} completion), "
        f"train.num_minibatches={config.train.num_minibatches}, num_microbatches={config.train.num_microbatches}, "
        + (f"prompts shared by groups of {prompt_group}, " if prompt_group > 1 else "a prompt per row, ")
        + f"{model_config.compute_dtype}, 1 CPU device; jax {jax.__version__}; best of {args.repeats} interleaved "
        "calls (median)")
  print(f"{'part':24s} {'best s':>9s} {'median s':>9s} {'GFLOP':>9s} {'GFLOP/s':>8s} {'of matmul':>9s}")
  for name, (_, flops) in parts.items():
    best = min(times[name])
    print(f"{name:24s} {best:9.3f} {statistics.median(times[name]):9.3f} {flops / 1e9:9.1f} "
          f"{flops / best / 1e9:8.0f} {flops / best / peak:8.0%}")


if __name__ == "__main__":
  main()
