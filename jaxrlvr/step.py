"""The pure update: `update(state, batch) -> (state, metrics)`, jitted with explicit shardings and donated state.

One RL step's batch is R rollout rows of S = P + T tokens (prompt left-padded to P, completion right-padded to T).
Inside one jit: `num_minibatches` optimizer steps, each accumulating gradients over `num_microbatches` micro-batches
with `lax.scan`. Every loss is divided by a normaliser of the whole optimizer step's rows (objectives.loss_normalizer),
so the gradient is the same for any micro-batch count or device count.

Log-prob roles, per completion token:
  old_logp:       the trainer's own log-probs before this RL step's first optimizer step (recomputed by the loop with
                  `make_score_fn`, so two mini-batches per step stay correct);
  behaviour_logp: the log-probs of the policy that sampled the token: the sampler's for fresh rows, the recorded ones
                  for replayed rows.
The PPO ratio of a fresh token is against old_logp; a replayed token's ratio is against its behaviour log-probs
(ExGRPO's w* = pi / pi_past, shaped by f(w*); advantage-priority replay clips it like a fresh one). With
`loss.importance_cap > 0` every token is also weighted by min(pi_old / pi_behaviour, cap) (stop-gradient), which
corrects delayed-policy rollouts (BAPO) and sampler/trainer mismatch.
"""
import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from jaxrlvr import diagnostics
from jaxrlvr import objectives
from jaxrlvr import scoring


@flax.struct.dataclass
class TrainState:
  params: Any  # nnx.State of the policy's parameters
  opt_state: Any
  step: jax.Array  # RL steps completed, int32
  skipped: jax.Array  # optimizer steps skipped by the grad-norm rule, int32


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The static part of the loss, read once from `config.loss`."""
  aggregation: str
  max_len: int
  clip: bool
  clip_low: float
  clip_high: float
  dual_clip: float | None
  shaping_beta: float | None
  entropy_coef: float
  kl_coef: float
  kl_estimator: str
  importance_cap: float
  temperature: float

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> "LossConfig":
    c = config.loss
    return cls(aggregation=c.aggregation, max_len=c.max_len or config.rollout.max_new_tokens, clip=c.clip,
               clip_low=c.clip_low, clip_high=c.clip_high, dual_clip=c.dual_clip or None,
               shaping_beta=c.shaping_beta if c.shaping_beta >= 0 else None, entropy_coef=c.entropy_coef,
               kl_coef=c.kl_coef, kl_estimator=c.kl_estimator, importance_cap=c.importance_cap,
               temperature=config.rollout.temperature or 1.0)


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


def completion_logprobs(model, batch: dict, temperature: float):
  """Teacher-forced log-probs and entropies of the completion tokens: ([R, T], [R, T])."""
  logp, entropy = scoring.token_logprobs(model, batch["input_ids"], batch["attention_mask"], temperature=temperature)
  num_completion = batch["completion_mask"].shape[1]
  return logp[:, -num_completion:], entropy[:, -num_completion:]


def _policy_loss(params, graphdef, micro: dict, normalizer, loss_config: LossConfig):
  """One micro-batch's share of the optimizer step's loss, and its diagnostics."""
  lc = loss_config
  model = nnx.merge(graphdef, params)
  logp, entropy = completion_logprobs(model, micro, lc.temperature)  # [r, T] each
  mask = micro["completion_mask"]
  replayed = micro["replayed"]  # [r]
  # Fresh tokens: ratio to the trainer's old policy. Replayed tokens: ratio to the policy that wrote them.
  old_logp = jnp.where(replayed[:, None], micro["behaviour_logp"], micro["old_logp"])
  shaped_loss = objectives.token_policy_loss(
      logp, old_logp, micro["advantages"], replayed=replayed, clip=lc.clip, clip_low=lc.clip_low,
      clip_high=lc.clip_high, dual_clip=lc.dual_clip, shaping_beta=lc.shaping_beta)
  # ExGRPO's mixed phase (mixed_clip=False) removes the clip of fresh tokens; each row says whether it is clipped.
  unclipped_loss = objectives.token_policy_loss(
      logp, old_logp, micro["advantages"], replayed=replayed, clip=False, shaping_beta=lc.shaping_beta)
  per_token = jnp.where(micro["clip"][:, None], shaped_loss, unclipped_loss)
  if lc.importance_cap > 0:
    per_token = per_token * objectives.truncated_importance_weights(
        micro["old_logp"], micro["behaviour_logp"], cap=lc.importance_cap)
  policy_loss = objectives.aggregate_loss(per_token, mask, mode=lc.aggregation, max_len=lc.max_len,
                                          normalizer=normalizer)
  entropy_loss = objectives.aggregate_loss(entropy, mask, mode=lc.aggregation, max_len=lc.max_len,
                                           normalizer=normalizer)
  loss = policy_loss - lc.entropy_coef * entropy_loss
  kl_loss = jnp.zeros(())
  if lc.kl_coef > 0:
    kl = objectives.kl_penalty(logp, micro["ref_logp"], estimator=lc.kl_estimator)
    kl_loss = objectives.aggregate_loss(kl, mask, mode=lc.aggregation, max_len=lc.max_len, normalizer=normalizer)
    loss = loss + lc.kl_coef * kl_loss
  # Sums over tokens, so that micro-batch diagnostics add up to the step's.
  stats = diagnostics.ratio_sums(logp, old_logp, mask, replayed=replayed, clip_low=lc.clip_low,
                                 clip_high=lc.clip_high)
  aux = {"loss/policy": policy_loss, "loss/entropy": entropy_loss, "loss/kl": kl_loss, **stats}
  return loss, aux


def _split_rows(x: jax.Array, num_minibatches: int, num_micro: int) -> jax.Array:
  """[R, ...] -> [M, n, R / (M n), ...], interleaved so every micro-batch takes rows from every device's block."""
  rows = x.shape[0] // (num_minibatches * num_micro)
  x = x.reshape(rows, num_minibatches, num_micro, *x.shape[1:])  # [r, M, n, ...]
  return jnp.moveaxis(x, 0, 2)  # [M, n, r, ...]


def make_update_fn(graphdef, config: ml_collections.ConfigDict, optimizer: optax.GradientTransformation, *,
                   state_sharding, batch_sharding):
  """Returns the jitted `update(state, batch) -> (state, metrics)`; `state` is donated."""
  loss_config = LossConfig.from_config(config)
  num_minibatches = config.train.num_minibatches
  num_micro = config.train.num_microbatches
  skip_norm = config.optim.skip_grad_norm
  grad_fn = jax.grad(_policy_loss, has_aux=True)

  def optimizer_step(carry, minibatch):
    params, opt_state, skipped = carry
    # The normaliser belongs to the whole optimizer step: all its micro-batches, on all devices.
    normalizer = objectives.loss_normalizer(
        minibatch["completion_mask"].reshape(-1, minibatch["completion_mask"].shape[-1]),
        mode=loss_config.aggregation, max_len=loss_config.max_len)

    def accumulate(grads_and_aux, micro):
      grads_sum, aux_sum = grads_and_aux
      micro = jax.lax.with_sharding_constraint(micro, batch_sharding)
      grads, aux = grad_fn(params, graphdef, micro, normalizer, loss_config)
      return (jax.tree.map(jnp.add, grads_sum, grads), jax.tree.map(jnp.add, aux_sum, aux)), None

    zero_grads = jax.tree.map(jnp.zeros_like, params)
    first = jax.tree.map(lambda x: x[0], minibatch)
    zero_aux = jax.tree.map(jnp.zeros_like, jax.eval_shape(
        lambda m: grad_fn(params, graphdef, m, normalizer, loss_config)[1], first))
    (grads, aux), _ = jax.lax.scan(accumulate, (zero_grads, zero_aux), minibatch)
    grad_norm = optax.global_norm(grads)
    # Skip rule (released ExGRPO code): no update when the pre-clip norm is not finite or above the bound.
    ok = jnp.isfinite(grad_norm) & (grad_norm <= skip_norm)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_params, params)
    opt_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_opt_state, opt_state)
    aux = {**aux, "optim/grad_norm": grad_norm, "optim/skipped": (~ok).astype(jnp.float32)}
    return (params, opt_state, skipped + (~ok).astype(jnp.int32)), aux

  def update(state: TrainState, batch: dict):
    rows = jax.tree.map(lambda x: _split_rows(x, num_minibatches, num_micro), batch)  # [M, n, r, ...]
    (params, opt_state, skipped), aux = jax.lax.scan(
        optimizer_step, (state.params, state.opt_state, state.skipped), rows)
    metrics = diagnostics.finalize_ratio_stats(jax.tree.map(jnp.sum, aux))
    for key in ("loss/policy", "loss/entropy", "loss/kl", "optim/grad_norm"):
      metrics[key] = jnp.mean(aux[key]) if key == "optim/grad_norm" else jnp.sum(aux[key]) / num_minibatches
    metrics["optim/skipped"] = jnp.sum(aux["optim/skipped"])
    return TrainState(params=params, opt_state=opt_state, step=state.step + 1, skipped=skipped), metrics

  return jax.jit(update, in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, None),
                 donate_argnums=(0,))


def make_score_fn(graphdef, *, temperature: float, batch_sharding):
  """Jitted (params, batch) -> completion (log-probs, entropies) [R, T]: old log-probs and ExGRPO's answer entropy."""

  def score(params, batch):
    return completion_logprobs(nnx.merge(graphdef, params), batch, temperature)

  return jax.jit(score, in_shardings=(None, batch_sharding), out_shardings=batch_sharding)
