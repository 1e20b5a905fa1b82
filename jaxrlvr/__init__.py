"""jaxrlvr: experience replay for reinforcement learning with verifiable rewards, in JAX/Flax."""

__version__ = "0.1.0"
