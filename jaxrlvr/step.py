"""The pure update: `update(state, batch) -> (state, metrics)`, jitted with explicit shardings and donated state.

One RL step's batch is R rollout rows of S = P + T tokens (prompt left-padded to P, completion right-padded to T).
Inside one jit: `num_minibatches` optimizer steps, each accumulating gradients over `num_microbatches` micro-batches
with `lax.scan`. Every loss is divided by a normaliser of the whole optimizer step's rows (objectives.loss_normalizer),
so the gradient is the same for any micro-batch count or device count -- except under `exgrpo_reference`, which
reproduces the released ExGRPO code and so, like it, scales with the micro-batch and data-parallel counts.

Log-prob roles, per completion token:
  old_logp:       the trainer's own log-probs before this RL step's first optimizer step. With several optimizer
                  steps a batch the loop recomputes them first (`make_score_fn`), so the later steps' ratios are
                  against the parameters the batch started from; with one (`train.num_minibatches=1`) the batch
                  comes without them and the update takes the detached log-probs of its own forward pass, the same
                  values without a second pass over the batch (a fresh token's ratio is then exactly 1);
  behaviour_logp: the log-probs of the policy that sampled the token: the sampler's for fresh rows, the recorded ones
                  for replayed rows.
The PPO ratio of a fresh token is against old_logp; a replayed token's ratio is against its behaviour log-probs
(ExGRPO's w* = pi / pi_past, shaped by f(w*); advantage-priority replay clips it like a fresh one). With
`loss.importance_cap > 0` every token is also weighted by min(pi_old / pi_behaviour, cap) (stop-gradient), which
corrects delayed-policy rollouts (BAPO) and sampler/trainer mismatch.
"""
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from jaxrlvr import diagnostics
from jaxrlvr import objectives
from jaxrlvr import parallel
from jaxrlvr import scoring


@flax.struct.dataclass
class TrainState:
  params: Any  # nnx.State of the policy's parameters
  opt_state: Any
  step: jax.Array  # RL steps completed, int32
  skipped: jax.Array  # optimizer steps skipped by the grad-norm rule, int32


def create_state(params, optimizer: optax.GradientTransformation, mesh) -> TrainState:
  """A fresh TrainState on `mesh`: optimizer moments sharded like their parameters, counters replicated."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  step, skipped = (jax.device_put(jnp.zeros((), jnp.int32), replicated) for _ in range(2))  # distinct buffers: donated
  return TrainState(params=params, opt_state=init_optimizer_state(params, optimizer, mesh), step=step,
                    skipped=skipped)


def init_optimizer_state(params, optimizer: optax.GradientTransformation, mesh) -> optax.OptState:
  """`optimizer.init(params)` placed as a jitted step returns it: moments sharded like their parameters, counters
  replicated over `mesh`, every leaf committed. Otherwise (init leaves its counters uncommitted on one device) the
  step's second call compiles again: ~5 s on the tiny default, ~1 s in the warm start."""
  param_sharding = jax.tree.map(lambda x: x.sharding, params)
  opt_state = jax.jit(optimizer.init, in_shardings=(param_sharding,),
                      out_shardings=optimizer_state_sharding(params, optimizer, mesh))(params)
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding), parallel.onto_mesh(opt_state, mesh))


def optimizer_state_sharding(params, optimizer: optax.GradientTransformation, mesh) -> Any:
  """The shardings of `optimizer.init(params)` (arrays or ShapeDtypeStructs with shardings): every copy of the
  parameter tree (AdamW's moments) sharded like the parameters, everything else (counters) replicated. Given, not
  left to the partitioner: it replicated zeros_like(param), which at 7B on fsdp=8 put 61 GB of AdamW moments on
  every device instead of 7.6 GB."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return optax.tree_map_params(optimizer, lambda _, sharding: sharding, jax.eval_shape(optimizer.init, params),
                               jax.tree.map(lambda x: x.sharding, params), transform_non_params=lambda _: replicated)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """AdamW with the configured schedule, after clipping the global gradient norm."""
  o = config.optim
  total = max(config.total_steps * config.train.num_minibatches, 1)
  if o.schedule == "cosine":
    lr = optax.warmup_cosine_decay_schedule(0.0, o.lr, max(o.warmup_steps, 1), total)
  elif o.warmup_steps:
    lr = optax.join_schedules([optax.linear_schedule(0.0, o.lr, o.warmup_steps), optax.constant_schedule(o.lr)],
                              [o.warmup_steps])
  else:
    lr = o.lr
  return optax.chain(optax.clip_by_global_norm(o.grad_clip),
                     optax.adamw(lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))


def completion_logprobs(model, batch: dict, temperature: float, prompt_group: int = 1, *, keep_logits_mb: float = 0.0,
                        batch_shards: int = 1):
  """Teacher-forced log-probs and entropies of the completion tokens: ([R, T], [R, T]). With `prompt_group` K > 1
  every K consecutive rows share their prompt, which then runs through the model once for the K of them.
  `keep_logits_mb` (the update's `train.keep_logits_mb`): the head keeps its logits for the backward pass where one
  device's [R / batch_shards, T, V] float32 take at most that (`scoring.logits_kept`)."""
  rows, completion_len = batch["completion_mask"].shape
  packed = "packing" in batch  # the completions packed into fewer rows (packing.py): the head runs over those
  if packed:
    rows = batch["packing"]["ids"].shape[0]
  keep_logits = scoring.logits_kept(rows // batch_shards, completion_len, model.config.vocab_size, keep_logits_mb)
  if packed:
    return scoring.score_packed_completions(model, batch["input_ids"], batch["attention_mask"], batch["packing"],
                                            batch["unpack"], group_size=prompt_group,
                                            prompt_len=batch["input_ids"].shape[1] - completion_len,
                                            temperature=temperature, keep_logits=keep_logits)
  if prompt_group > 1:
    return scoring.score_shared_prompts(model, batch["input_ids"], batch["attention_mask"], group_size=prompt_group,
                                        prompt_len=batch["input_ids"].shape[1] - completion_len,
                                        temperature=temperature, keep_logits=keep_logits)
  return scoring.score(model, batch["input_ids"], batch["attention_mask"], temperature=temperature,
                       last=completion_len, keep_logits=keep_logits)


def ratio_baseline(micro: dict, settings: objectives.LossSettings) -> jax.Array:
  """[r, T] the log-probs each token's importance ratio is taken against (see the module doc)."""
  if settings.importance_cap is None:
    # Fresh tokens: ratio to the trainer's old policy. Replayed tokens: ratio to the policy that wrote them.
    return jnp.where(micro["replayed"][:, None], micro["behaviour_logp"], micro["old_logp"])
  return micro["old_logp"]  # decoupled: ratio to pi_old, times min(pi_old / pi_behaviour, cap) in token_losses


def token_losses(logp: jax.Array, micro: dict, settings: objectives.LossSettings) -> jax.Array:
  """[r, T] per-token policy loss of a micro-batch as the update computes it, from its log-probs [r, T]: the
  method's ratio baseline, clip (per row), shaping of replayed tokens and truncated importance weights."""
  policy_kwargs = {**settings.policy_loss_kwargs(), "clip": micro["clip"]}  # per row: ExGRPO's mixed phase
  per_token = objectives.token_policy_loss(logp, ratio_baseline(micro, settings), micro["advantages"],
                                           replayed=micro["replayed"], **policy_kwargs)
  if settings.importance_cap is not None:
    per_token = per_token * objectives.truncated_importance_weights(
        micro["old_logp"], micro["behaviour_logp"], cap=settings.importance_cap)
  return per_token


def _policy_loss(params, graphdef, micro: dict, normalizer, settings: objectives.LossSettings,
                 temperature: float, reference_blocks: dict, prompt_group: int, keep_logits_mb: float,
                 batch_shards: int):
  """One micro-batch's share of the optimizer step's loss, and its additive diagnostics. `reference_blocks`: the
  ranks and divisor of `exgrpo_reference`'s entropy bonus (objectives.reference_entropy_term)."""
  model = nnx.merge(graphdef, params)
  logp, entropy = completion_logprobs(model, micro, temperature, prompt_group, keep_logits_mb=keep_logits_mb,
                                      batch_shards=batch_shards)  # [r, T] each
  if "old_logp" not in micro:  # one optimizer step a batch: pi_old is the policy being differentiated, detached
    micro = {**micro, "old_logp": jax.lax.stop_gradient(logp)}
  mask = micro["completion_mask"]
  replayed = micro["replayed"]  # [r]
  old_logp = ratio_baseline(micro, settings)
  policy_kwargs = {**settings.policy_loss_kwargs(), "clip": micro["clip"]}
  per_token = token_losses(logp, micro, settings)
  aggregate = functools.partial(objectives.aggregate_loss, mask=mask, normalizer=normalizer,
                                **settings.aggregate_kwargs())
  policy_loss = aggregate(per_token)
  if settings.aggregation == "exgrpo_reference":  # the released code: a token mean per rank and micro-batch
    entropy_loss = objectives.reference_entropy_term(entropy, mask, **reference_blocks)
  else:
    entropy_loss = aggregate(entropy)
  loss = policy_loss - settings.entropy_coef * entropy_loss
  kl_loss = jnp.zeros(())
  if settings.kl_coef > 0:
    kl_loss = aggregate(objectives.kl_penalty(logp, micro["ref_logp"], estimator=settings.kl_estimator))
    loss = loss + settings.kl_coef * kl_loss
  stats = diagnostics.policy_stats(logp, old_logp, micro["advantages"], mask, replayed=replayed, **policy_kwargs)
  losses = {"loss/policy": policy_loss, "loss/entropy": entropy_loss, "loss/kl": kl_loss, "loss/total": loss,
            # The replayed rows' part of the policy loss: its gradient is what replay adds to the update.
            "loss/replayed_policy": aggregate(per_token * replayed[:, None].astype(per_token.dtype))}
  return loss, (losses, stats, micro["old_logp"])


def _loss_and_replayed_grads(params, graphdef, micro: dict, *args):
  """(gradient of the loss, gradient of its replayed rows' policy part, aux) from one forward pass and two
  backward ones: the second pull of the same vjp reuses the forward's residuals. `args`: `_policy_loss`'s after
  the micro-batch."""
  def both(p):
    loss, aux = _policy_loss(p, graphdef, micro, *args)
    return jnp.stack([loss, aux[0]["loss/replayed_policy"]]), aux

  _, pull, aux = jax.vjp(both, params, has_aux=True)
  (grads,), (replayed_grads,) = pull(jnp.array([1.0, 0.0])), pull(jnp.array([0.0, 1.0]))
  return grads, replayed_grads, aux


def _split_rows(x: jax.Array, num_minibatches: int, num_micro: int, group: int = 1) -> jax.Array:
  """[R, ...] -> [M, n, R / (M n), ...], interleaved so every micro-batch takes rows from every device's block;
  blocks of `group` consecutive rows (a prompt's samples) stay together and in order."""
  groups = x.shape[0] // (group * num_minibatches * num_micro)
  x = x.reshape(groups, num_minibatches, num_micro, group, *x.shape[1:])  # [g, M, n, K, ...]
  x = jnp.moveaxis(x, 0, 2)  # [M, n, g, K, ...]
  return x.reshape(num_minibatches, num_micro, groups * group, *x.shape[4:])  # [M, n, g K, ...]


def _join_rows(x: jax.Array, group: int = 1) -> jax.Array:
  """`_split_rows` undone for one optimizer step: [n, g K, ...] -> [R, ...] in the batch's row order."""
  num_micro, rows = x.shape[:2]
  x = x.reshape(num_micro, rows // group, group, *x.shape[2:])  # [n, g, K, ...]
  return jnp.moveaxis(x, 0, 1).reshape(num_micro * rows, *x.shape[3:])  # [g, n, K, ...] -> [R, ...]


def prompt_group_fits(rows: int, group: int, config: ml_collections.ConfigDict, batch_shards: int) -> bool:
  """Whether an update batch of `rows` rows splits into its micro-batches and batch shards in whole groups of
  `group` rows, which sharing a prompt across a group's rows (`make_update_fn(prompt_group=...)`) needs."""
  parts = config.train.num_minibatches * config.train.num_microbatches * batch_shards
  return group > 1 and rows % (group * parts) == 0


def make_update_fn(graphdef, config: ml_collections.ConfigDict, optimizer: optax.GradientTransformation, *,
                   state_sharding, batch_sharding, prompt_group: int = 1):
  """Returns the jitted `update(state, batch) -> (state, metrics, old_logp)`; `state` is donated.

  `prompt_group` K > 1: every K consecutive rows of each batch share their prompt (ids and mask), and each prompt
  runs through the model once for its K samples (`scoring.score_shared_prompts`); the rows must split into the
  micro-batches and batch shards in whole groups (`prompt_group_fits`). The loop passes the rollout group size
  when `train.share_prompts` is on and the batch is laid out so (`rollout.prompts_shared`).

  `batch` holds R rows (R divisible by num_minibatches x num_microbatches x batch shards):
    input_ids, attention_mask [R, P + T] int32; completion_mask [R, T] (0 for padding rows and dropped rollouts);
    advantages [R, T] f32; behaviour_logp [R, T] f32 (see the module doc); replayed [R] bool;
    clip [R] bool (whether fresh tokens of the row are PPO-clipped); ref_logp [R, T] when loss.kl_coef > 0;
    old_logp [R, T] f32, needed when train.num_minibatches > 1 (`needs_score_pass`), else optional;
    packing and unpack: the completions packed into fewer rows (`packing.plan_batch`, with `prompt_group` > 1 and
    one batch shard), else absent; each packed row count compiles once.
  `old_logp` comes back [R, T]: the batch's, or the log-probs the single optimizer step's forward pass took as pi_old
  (the trainer's log-probs under the parameters the step started from).
  """
  settings = objectives.LossSettings.from_config(config)
  temperature = config.rollout.temperature or 1.0
  num_minibatches = config.train.num_minibatches
  num_micro = config.train.num_microbatches
  skip_norm = config.optim.skip_grad_norm
  batch_shards = parallel.batch_shards(batch_sharding.mesh)
  normalizer_kwargs = settings.normalizer_kwargs(num_ranks=batch_shards, num_microbatches=num_micro)
  reference_blocks = {k: normalizer_kwargs[k] for k in ("reference_ranks", "reference_divisor")}
  # train.replayed_grad_share: also the gradient of the replayed rows' policy loss, for its norm's share of the
  # update's (a second backward pass per micro-batch; the comparison's mechanism figure).
  replayed_share = bool(config.train.get("replayed_grad_share", False))
  keep_logits_mb = config.train.keep_logits_mb
  grad_fn = jax.grad(_policy_loss, has_aux=True)

  def optimizer_step(carry, minibatch):
    params, opt_state, skipped = carry
    # The normaliser belongs to the whole optimizer step: all its micro-batches, on all devices.
    mask = minibatch["completion_mask"]  # [n, r, T]
    normalizer = objectives.loss_normalizer(mask.reshape(-1, mask.shape[-1]), **normalizer_kwargs)

    def micro_grads(micro):
      """({"all": gradient, "replayed": its replayed part or nothing}, (losses, stats)) of one micro-batch."""
      micro = jax.lax.with_sharding_constraint(micro, batch_sharding)
      args = (params, graphdef, micro, normalizer, settings, temperature, reference_blocks, prompt_group,
              keep_logits_mb, batch_shards)
      if replayed_share:
        grads, replayed_grads, aux = _loss_and_replayed_grads(*args)
        return {"all": grads, "replayed": replayed_grads}, aux
      grads, aux = grad_fn(*args)
      return {"all": grads}, aux

    def accumulate(carry, micro):
      grads_sum, losses_sum, stats_sum = carry
      grads, (losses, stats, old_logp) = micro_grads(micro)
      return (jax.tree.map(jnp.add, grads_sum, grads), jax.tree.map(jnp.add, losses_sum, losses),
              diagnostics.merge_stats(stats_sum, stats)), old_logp

    # Gradients and losses are sums over micro-batches (each already divided by the global normaliser). The
    # micro-batch's forward and backward pass appear once in the program, which is most of what XLA compiles (a copy
    # outside the scan for the first micro-batch doubled the update's compile).
    first_micro = jax.tree.map(lambda x: x[0], minibatch)
    if num_micro == 1:
      grad_parts, (losses, stats, old_logp) = micro_grads(first_micro)
      old_logp = old_logp[None]  # [1, r, T]
    else:
      grad_shapes, (loss_shapes, _, _) = jax.eval_shape(micro_grads, first_micro)
      start = (jax.tree.map(jnp.zeros_like, grad_shapes), jax.tree.map(jnp.zeros_like, loss_shapes),
               diagnostics.empty_stats())
      (grad_parts, losses, stats), old_logp = jax.lax.scan(accumulate, start, minibatch)  # old_logp [n, r, T]
    grads = grad_parts["all"]
    grad_norm = optax.tree.norm(grads)
    if replayed_share:
      losses["policy/replayed_grad_share"] = optax.tree.norm(grad_parts["replayed"]) / jnp.maximum(grad_norm, 1e-30)
    del losses["loss/replayed_policy"]
    # Skip rule (released ExGRPO code): no update when the pre-clip norm is not finite or above the bound.
    ok = jnp.isfinite(grad_norm) & (grad_norm <= skip_norm)

    def apply(state):
      params, opt_state = state
      updates, new_opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), new_opt_state

    # A branch, not `jnp.where(ok, new, old)` over every array: the select was one more pass over the parameters
    # and both Adam moments (0.2-0.3 s of the smollm2-135m preset's 6.5 s update on 2 CPU cores).
    params, opt_state = jax.lax.cond(ok, apply, lambda state: state, (params, opt_state))
    losses = {**losses, "optim/grad_norm": grad_norm, "optim/skipped": (~ok).astype(jnp.float32)}
    return (params, opt_state, skipped + (~ok).astype(jnp.int32)), (losses, stats, old_logp)

  def update(state: TrainState, batch: dict):
    if "old_logp" not in batch and num_minibatches > 1:
      raise ValueError(f"train.num_minibatches={num_minibatches}: the batch needs old_logp (step.make_score_fn); "
                       "only a single optimizer step takes its own forward pass's log-probs as pi_old")
    rows = {k: v for k, v in batch.items() if k != "packing"}
    minibatches = jax.tree.map(lambda x: _split_rows(x, num_minibatches, num_micro, prompt_group),
                               rows)  # [M, n, r, ...]
    if "packing" in batch:  # each micro-batch's packed rows follow the one before's (packing.plan_batch)
      packed_rows = batch["packing"]["ids"].shape[0] // (num_minibatches * num_micro)
      minibatches["packing"] = jax.tree.map(lambda x: _split_rows(x, num_minibatches, num_micro, packed_rows),
                                            batch["packing"])  # [M, n, Rp, ...]
    (params, opt_state, skipped), (losses, stats, old_logp) = jax.lax.scan(
        optimizer_step, (state.params, state.opt_state, state.skipped), minibatches)
    metrics = {k: jnp.mean(v) for k, v in losses.items()}  # over the M optimizer steps
    metrics["optim/skipped"] = jnp.sum(losses["optim/skipped"])
    metrics.update({f"policy/{k}": v for k, v in diagnostics.finalize_stats(diagnostics.reduce_stats(stats)).items()})
    if "old_logp" in batch:
      old_logp = batch["old_logp"]
    else:  # [1, n, r, T] -> [R, T]
      old_logp = _join_rows(old_logp[0], prompt_group)
    return TrainState(params=params, opt_state=opt_state, step=state.step + 1, skipped=skipped), metrics, old_logp

  return jax.jit(update, in_shardings=(state_sharding, batch_sharding),
                 out_shardings=(state_sharding, None, batch_sharding), donate_argnums=(0,))


def needs_score_pass(config: ml_collections.ConfigDict) -> bool:
  """Whether the loop scores the update batch before the update (old log-probs): only when a later optimizer step
  of the same batch must take its ratio against the parameters the batch started from."""
  return config.train.num_minibatches > 1


def make_score_fn(graphdef, *, temperature: float, batch_sharding, max_chunk_rows: int = 0, prompt_group: int = 1):
  """Jitted (params, batch) -> completion (log-probs, entropies) [R, T]: old log-probs and ExGRPO's answer entropy.

  The rows are scored at most `max_chunk_rows` at a time (the update's micro-batch rows; 0: all at once), so the
  forward pass never holds more activations than one micro-batch of the update does, while a batch that small (ExGRPO's
  stored answers, a handful of rows) is one pass rather than a fixed number of tiny ones. `prompt_group` K > 1: every
  K consecutive rows share their prompt, scored once for them, as in `make_update_fn`; the chunks take whole groups.
  """
  row_shards = parallel.batch_shards(batch_sharding.mesh)
  max_chunk_groups = max(max_chunk_rows // prompt_group, 1) if max_chunk_rows else 0

  def score(params, batch):
    model = nnx.merge(graphdef, params)
    groups = batch["input_ids"].shape[0] // prompt_group
    num_chunks = _num_score_chunks(groups, max_chunk_groups, row_shards)
    chunks = jax.tree.map(lambda x: _split_rows(x, 1, num_chunks, prompt_group)[0], batch)  # [n, R / n, ...]

    def score_chunk(chunk):
      chunk = jax.lax.with_sharding_constraint(chunk, batch_sharding)
      return completion_logprobs(model, chunk, temperature, prompt_group)

    logp, entropy = jax.lax.map(score_chunk, chunks)  # [n, R / n, T] each
    return _join_rows(logp, prompt_group), _join_rows(entropy, prompt_group)

  return jax.jit(score, in_shardings=(None, batch_sharding), out_shardings=batch_sharding)


def _num_score_chunks(rows: int, max_chunk_rows: int, row_shards: int) -> int:
  """The fewest chunks of at most `max_chunk_rows` rows (or groups of rows) that still split every device's rows
  evenly."""
  if rows % row_shards:
    raise ValueError(f"score: {rows} rows do not split over the {row_shards} batch shards of the mesh")
  if not max_chunk_rows or rows <= max_chunk_rows:
    return 1
  per_shard = rows // row_shards  # each chunk takes per_shard / n rows from every shard's block (see _split_rows)
  fewest = min(-(-rows // max_chunk_rows), per_shard)  # a chunk has at least one row per shard
  return next(n for n in range(fewest, per_shard + 1) if per_shard % n == 0)
