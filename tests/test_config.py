"""Configs: every method file builds, locks, and refuses impossible values with the key and value in the message."""
import importlib

import pytest

from jaxrlvr import config_lib

METHODS = ("grpo", "exgrpo", "advantage_priority", "bapo")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arg", [None, "smoke", "model=qwen2.5-math-7b"])
def test_method_configs_build_and_lock(method, arg):
  config = importlib.import_module(f"configs.{method}").get_config(arg)
  assert config.replay.name == ("none" if method == "grpo" else method)
  with pytest.raises(AttributeError, match="no_such_key"):
    config.no_such_key = 1
  with pytest.raises(TypeError):
    config.seed = "abc"  # a wrong type is refused


def test_smoke_shrinks_and_paper_scale_sets_released_settings():
  smoke = importlib.import_module("configs.exgrpo").get_config("smoke")
  paper = importlib.import_module("configs.exgrpo").get_config("model=qwen2.5-math-7b")
  assert smoke.total_steps <= 5 and smoke.replay.start_solve_rate == 0.0
  assert (paper.rollout.batch_size, paper.rollout.group_size, paper.rollout.max_new_tokens) == (128, 8, 8192)
  assert (paper.optim.lr, paper.train.num_minibatches, paper.total_steps) == (1e-6, 2, 700)


def test_unknown_config_arg_names_the_key():
  with pytest.raises(config_lib.ConfigError, match="'modle'"):
    importlib.import_module("configs.grpo").get_config("modle=tiny")


@pytest.mark.parametrize("key, value, message", [
    ("rollout.group_size", 1, "rollout.group_size=1"),
    ("loss.aggregation", "mean", "loss.aggregation='mean'"),
    ("replay.bucket_scale", "log", "replay.bucket_scale='log'"),
    ("train.num_microbatches", 3, "train.num_microbatches=3"),
    ("train.keep_logits_mb", -1.0, "train.keep_logits_mb=-1.0"),
    ("train.pack_completions", (0.75, 1.0), "train.pack_completions=(0.75, 1.0)"),
    ("train.pack_max_prompts", 0, "train.pack_max_prompts=0"),
    ("rollout.temperature", -1.0, "rollout.temperature=-1.0"),
])
def test_impossible_values_name_key_and_value(key, value, message):
  config = importlib.import_module("configs.exgrpo").get_config()
  with config.unlocked():
    section, name = key.split(".")
    config[section][name] = value
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(config)
  assert message in str(e.value)


def test_batch_must_divide_over_the_mesh():
  config = importlib.import_module("configs.grpo").get_config()
  config.rollout.batch_size = 3  # 3 x 8 = 24 rollouts over 16 batch shards
  config.mesh.data = 16
  with pytest.raises(config_lib.ConfigError, match=r"rollout.batch_size=3.*16"):
    config_lib.validate(config, num_devices=16)
  with pytest.raises(config_lib.ConfigError, match="needs 16 devices, but 8 are present"):
    config_lib.mesh_shape(config.mesh, 8)
