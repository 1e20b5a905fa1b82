"""Rollout-level advantage-priority replay: GRPO plus a buffer of single rollouts sampled by (|A|+eps)^alpha.

    python -m jaxrlvr.main --config=configs/advantage_priority.py --workdir=/tmp/ap

2-core CPU, about 10 minutes with the warm start; the README's results give what it reaches.
Paper scale: add `:model=qwen2.5-math-7b` (or another preset) with `--config.model.path` and `--config.data.source`.

Every rollout is stored with its advantage at birth and its birth step, never as a group; a replayed rollout keeps
its stored advantage and its ratio is taken against its stored behaviour log-probs. Choices and where they come from:
- `replay.alpha=0.5`: the priority exponent comes from a third-party reimplementation, not the paper; configurable.
- `replay.composition="fresh_anchored"` (paper's method: all fresh rollouts plus round(replay_fraction x fresh)
  replayed ones) or `"pool"` (the ablation that mixes stale and fresh data in one pool).
- `replay.priority="abs_advantage"` (paper's method), `"group_std"` or `"uniform"` (the query-level ablations).
- `replay.tau_max=10` age eviction in steps (ablated in the paper), `replay.capacity=30000` (oldest out),
  `replay.warmup_steps=20` without replay.
- Loss: zero-variance groups dropped before training and before insertion (`loss.drop_constant_groups=True`),
  clip-higher 0.2 / 0.28, dual clip 10, `loss.aggregation="token-mean"` as in the paper's setup.
"""
from configs import base
from jaxrlvr import config_lib


def get_config(arg: str | None = None):
  args = config_lib.parse_arg(arg, model="tiny", smoke=False)
  config = base.get_base_config(args)
  config.method = "advantage_priority"
  config.replay.name = "advantage_priority"
  config.replay.capacity = 30000
  config.replay.tau_max = 10
  config.replay.alpha = 0.5
  config.replay.priority_eps = 1e-6
  config.replay.warmup_steps = 20
  config.replay.replay_fraction = 0.5
  config.replay.composition = "fresh_anchored"
  config.replay.priority = "abs_advantage"
  config.replay.max_tokens = 0
  config.loss.clip_low = 0.2
  config.loss.clip_high = 0.28
  config.loss.dual_clip = 10.0
  config.loss.aggregation = "token-mean"
  config.loss.drop_constant_groups = True
  if args.model not in ("tiny", "smollm2-135m"):
    # Memory only, the same update (the loss is normalised over the whole batch, not per micro-batch): 32
    # micro-batches keep one micro-batch's activations within a TPU v5p-8's 4 chips (fsdp=4; python -m
    # jaxrlvr.plan). Its update batch is larger than GRPO's: the stored rows join the fresh ones (1,536 rows
    # against 1,024).
    config.train.num_microbatches = max(config.train.num_microbatches, 32)
  if args.smoke:
    config.replay.warmup_steps = 1
  return config_lib.finalize(config)
