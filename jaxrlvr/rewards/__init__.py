"""Rewards computed on the host. `math` (math-verify in worker processes) is the verifiable reward of every
method; the ExpRL judge lives in `jaxrlvr.rewards.judge` and is imported from there."""
from jaxrlvr.rewards.math import MathRewardPool
from jaxrlvr.rewards.math import default_pool
from jaxrlvr.rewards.math import fast_verdict
from jaxrlvr.rewards.math import math_reward
from jaxrlvr.rewards.math import strip_think

__all__ = ["MathRewardPool", "default_pool", "fast_verdict", "math_reward", "strip_think"]
