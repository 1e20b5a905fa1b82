"""BAPO (Wan et al., "Buffer Matters"): delayed-policy rollouts and an adaptive batch of three parts.

    python -m jaxrlvr.main --config=configs/bapo.py --workdir=/tmp/bapo

2-core CPU, about 10 minutes with the warm start; the README's results give what it reaches.
Paper scale: add `:model=qwen2.5-math-7b` (or another preset) with `--config.model.path` and `--config.data.source`.

Each batch is filled in order up to its capacity (B x K rollouts): X1, fresh groups with 1/K <= accuracy <= (K-1)/K;
X2, hard questions (accuracy <= c1) kept in a FIFO and re-rolled with the current policy every `reroll_every` steps
(at most `reroll_max`), taken when their new accuracy is in (c1, 1); X3, stored groups from the last `window` steps
with c2 <= accuracy <= c3, drawn at random. Rows keep their stored log-probs; token-level truncated importance
weights (cap `loss.importance_cap=3`); advantages recomputed over the final groups; no KL.
Where the paper and its released code differ:
- X3 bounds: `replay.adaptive_bounds=False` (released code: fixed [c2, c3] = [1/8, 2/8]) or `True` (paper: the
  bounds move with the buffer's mean accuracy).
- Rollout policy delay `replay.policy_delay=2` (v in the paper): rollouts come from the parameters of v steps ago.
- KL: the paper's analysis assumes KL-constrained updates; the runs here have no KL term (`loss.kl_coef=0`, as the
  released code's training script). `--config.loss.kl_coef` (with `loss.kl_estimator`) adds one to a frozen copy of
  the starting policy.
"""
from configs import base
from jaxrlvr import config_lib


def get_config(arg: str | None = None):
  args = config_lib.parse_arg(arg, model="tiny", smoke=False)
  config = base.get_base_config(args)
  config.method = "bapo"
  config.replay.name = "bapo"
  config.replay.c1 = 0.125
  config.replay.c2 = 0.125
  config.replay.c3 = 0.25
  config.replay.adaptive_bounds = False
  config.replay.hard_capacity = 0  # 0: the batch size
  config.replay.reroll_every = 2
  config.replay.reroll_max = 32
  config.replay.window = 3
  config.replay.policy_delay = 2
  config.replay.max_tokens = 0
  config.loss.importance_cap = 3.0
  if args.model not in ("tiny", "smollm2-135m"):
    # Memory only, the same update (the loss is normalised over the whole batch, not per micro-batch): 32
    # micro-batches keep one micro-batch's activations within a TPU v5p-8's 4 chips (fsdp=4; python -m
    # jaxrlvr.plan). Its two delayed policy copies stay resident beside the policy.
    config.train.num_microbatches = max(config.train.num_microbatches, 32)
  return config_lib.finalize(config)
