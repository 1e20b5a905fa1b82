"""Rewards computed on the host.

- `math.py`: math-verify in worker processes, the verifiable reward of every method (`MathRewardPool`).
- `judge.py`, `judge_prompts.py`: ExpRL's judge (an HTTP endpoint, or a model run by our sampler) and its prompts.
- `dense.py`: ExpRL's dense rewards: the judge's scores of an answer's segments as per-token advantages.
"""
from jaxrlvr.rewards.dense import dense_reward_kwargs, dense_rewards, judged_groups
from jaxrlvr.rewards.judge import JudgeError, judge_from_config
from jaxrlvr.rewards.math import MathRewardPool
from jaxrlvr.rewards.math import default_pool
from jaxrlvr.rewards.math import fast_verdict
from jaxrlvr.rewards.math import math_reward
from jaxrlvr.rewards.math import strip_think

__all__ = ["JudgeError", "MathRewardPool", "default_pool", "dense_reward_kwargs", "dense_rewards", "fast_verdict",
           "judge_from_config", "judged_groups", "math_reward", "strip_think"]
