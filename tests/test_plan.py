"""The memory planner: 7B figures against hand arithmetic, specs on real and abstract meshes, the fit rule, the
replay estimate and the command line. Everything is `jax.eval_shape`: nothing of 7B size is allocated."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding

from configs import advantage_priority, exgrpo, grpo
from jaxrlvr import parallel
from jaxrlvr import plan
from jaxrlvr.models import get_preset
from jaxrlvr.replay.storage import RolloutStore

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_7B = "model=qwen2.5-math-7b"


@pytest.fixture(scope="module")
def paper_plan():
  """ExGRPO at paper scale (128 x 8 rollouts, 1024 + 8192 tokens, remat, bf16 compute) on 1 x 8 x 1."""
  return plan.plan_memory(exgrpo.get_config(_7B), (1, 8, 1))


def test_7b_parameters_optimizer_and_gradients_per_device(paper_plan):
  assert jax.device_count() == 8  # conftest: the specs come from a real mesh of fake devices
  assert paper_plan["param_count"] == 7_615_616_512
  # Replicated (no 'embed' dimension, so no rule names fsdp): q/k/v biases (28 + 4 + 4) x 128 = 4,608 and two
  # norms 2 x 3,584 = 7,168 per layer, over 28 layers, plus the final norm 3,584:
  # 28 x 11,776 + 3,584 = 333,312. Everything else is split 8 ways over fsdp on its 'embed' dimension (3584 / 8).
  replicated = 28 * ((28 + 4 + 4) * 128 + 2 * 3584) + 3584
  assert replicated == 333_312
  per_device = (7_615_616_512 - replicated) // 8 + replicated  # 952,243,712 float32 values
  assert paper_plan["params"] == per_device * 4 == 3_808_974_848
  assert abs(paper_plan["params"] - 7.62e9 * 4 / 8) / 3.81e9 < 1e-3  # the model card's 7.62e9 x 4 bytes / 8 devices
  assert paper_plan["optimizer"] == 2 * 3_808_974_848  # AdamW mu and nu, float32, sharded like the params
  assert paper_plan["gradients"] == 2 * 3_808_974_848  # 16 micro-batches: the running sum + one micro-batch
  assert paper_plan["resident"] == 3 * 3_808_974_848


def test_7b_kv_cache_and_activations_by_hand(paper_plan):
  # Sampler: 1024 rollouts / 8 batch shards = 128 rows; 1024 + 8192 = 9216 slots; 28 layers x (k, v) x 4 kv heads x
  # 128 head_dim x 2 bytes (bf16) = 57,344 bytes a slot -> 128 x 9216 x 57,344 = 67,645,734,912 (67.6 GB).
  assert paper_plan["kv_cache"] == 128 * 9216 * 28 * 2 * 4 * 128 * 2 == 67_645_734_912
  # Update: 1024 rows / (2 minibatches x 16 micro-batches x 8 shards) = 4 rows of S = 9216 tokens a device.
  b, s, d, c = 4, 9216, 3584, 2
  dense = c * (4 * d + 2 * 28 * 128 + 2 * 4 * 128 + 3 * 18944)  # 158,720 bytes a token a layer
  scores = 28 * s * (8 + c)  # xla attention: f32 scores + f32 probs + bf16 probs per head and key: 2,580,480
  remat = 28 * b * s * d * c + 2 * b * s * (dense + scores)  # 7.40 GB of block inputs + 201.96 GB for one layer
  extra = b * s * s + 2 * b * s * d * c + 4 * b * 128 * 32768 * 4  # mask, embedded/final hidden, logits chunks
  assert paper_plan["activations_remat"] == remat + extra == 210_491_146_240
  assert paper_plan["activations_no_remat"] == 29 * b * s * (dense + scores) + extra
  assert paper_plan["activations"] == paper_plan["activations_remat"]  # the paper config turns remat on


def test_cudnn_attention_drops_the_quadratic_term():
  memory = plan.plan_memory(exgrpo.get_config(_7B), (1, 8, 1), score_chunks=32)
  config = exgrpo.get_config(_7B)
  config.unlock()
  config.model.attention = "cudnn"
  fused = plan.plan_memory(config, (1, 8, 1), score_chunks=32)
  b, s, d, c = 4, 9216, 3584, 2
  dense = c * (4 * d + 2 * 28 * 128 + 2 * 4 * 128 + 3 * 18944)
  # Only the per-layer attention term changes: 28 x S x 10 bytes a token becomes 28 heads x 4 bytes (log-sum-exp).
  assert memory["activations_remat"] - fused["activations_remat"] == 2 * b * s * (28 * s * 10 - 28 * 4)
  assert fused["activations_remat"] == 28 * b * s * d * c + 2 * b * s * (dense + 28 * 4) + (
      b * s * s + 2 * b * s * d * c + 4 * b * 128 * 32768 * 4)


def test_specs_from_an_abstract_mesh_equal_those_of_real_devices():
  cfg = get_preset("qwen2.5-math-1.5b")
  real, kind = plan.spec_mesh((1, 2, 4))
  assert kind == "devices"
  abstract = AbstractMesh((1, 2, 4), parallel.MESH_AXES)
  sizes = dict(abstract.shape)
  for (path, shape, spec, _), (_, _, abstract_spec, _) in zip(plan.param_table(cfg, real),
                                                              plan.param_table(cfg, abstract)):
    assert spec == abstract_spec, path
    assert plan.shard_shape(shape, abstract_spec, sizes) == NamedSharding(real, spec).shard_shape(shape), path
  # 16 devices do not exist here: the planner falls back to the abstract mesh and keeps the arithmetic.
  assert plan.spec_mesh((2, 8, 1))[1] == "abstract"
  two_replicas = plan.plan_memory(exgrpo.get_config(_7B), (2, 8, 1))
  assert two_replicas["params"] == 3_808_974_848  # data replicates: the same shards as 1 x 8 x 1
  assert two_replicas["kv_cache"] == 67_645_734_912 // 2  # 1024 rollouts over 16 batch shards: 64 rows a device


def test_tensor_axis_splits_heads_and_mlp():
  w = plan.workload(exgrpo.get_config(_7B), (1, 2, 4))
  # 28 query heads / 4 = 7, 4 kv heads / 4 = 1, 18944 / 4 = 4736, vocab 152064 / 4 = 38016.
  assert (w.heads, w.kv_heads, w.mlp, w.vocab) == (7, 1, 4736, 38016)
  assert w.micro_rows == 1024 // (2 * 16 * 2)  # batch shards are data x fsdp = 2
  w8 = plan.workload(exgrpo.get_config(_7B), (1, 1, 8))
  assert (w8.heads, w8.kv_heads) == (28, 4)  # 28 and 4 are not divisible by 8: replicated, as parallel.py does


def test_fits_rule_and_errors():
  # H100: 80e9 x 0.9 = 72e9 usable; v5e: 16e9 x 0.9 = 14.4e9.
  assert plan.fits({"peak": 72e9}, "h100")
  assert not plan.fits({"peak": 72e9 + 1}, "h100")
  assert plan.fits({"peak": 72e9 + 1}, "h100", usable_fraction=1.0)
  assert plan.fits({"peak": 14.4e9}, "v5e") and not plan.fits({"peak": 14.5e9}, "v5e")
  with pytest.raises(KeyError, match="unknown accelerator 'a100'"):
    plan.fits({"peak": 1}, "a100")
  with pytest.raises(ValueError, match="usable_fraction=1.5"):
    plan.fits({"peak": 1}, "h100", usable_fraction=1.5)


def test_paper_setting_fits_only_once_rollouts_are_split(paper_plan):
  # As the code stands (xla attention, one sampler call): nothing fits, and the sampler's prefill sets the peak.
  assert not any(plan.fits(paper_plan, name) for name in plan.ACCELERATORS)
  assert paper_plan["peak"] == paper_plan["rollout_peak"] > paper_plan["score_peak"]
  # The scorer takes one micro-batch of rows a pass (2 x 16 passes); the whole batch in one pass would not fit.
  assert paper_plan == plan.plan_memory(exgrpo.get_config(_7B), (1, 8, 1), score_chunks=32)
  one_pass = plan.plan_memory(exgrpo.get_config(_7B), (1, 8, 1), score_chunks=1)
  assert one_pass["peak"] == one_pass["score_peak"] > 20 * paper_plan["score_peak"]
  config = exgrpo.get_config(_7B)
  config.unlock()
  config.model.attention = "cudnn"
  split = plan.plan_memory(config, (1, 8, 1), rollout_chunks=2)
  assert plan.fits(split, "h100") and not plan.fits(split, "v5e")


def test_tiny_default_fits_everywhere():
  memory = plan.plan_memory(exgrpo.get_config(), (8, 1, 1))
  assert memory["param_count"] == 993_408  # models/config.py: the embedded default
  assert all(plan.fits(memory, name) for name in plan.ACCELERATORS)


def test_replay_buffer_estimate():
  store = RolloutStore()
  store.add(np.zeros(5, np.int32), np.zeros(5, np.float32), qid=0, step=0)
  per_row = store.live_nbytes() - 5 * 6  # int32 token + float16 log-prob = 6 bytes a token
  memory = plan.plan_memory(exgrpo.get_config(_7B), (1, 8, 1))
  # 700 steps x 1024 rollouts x 202,011 / 716,800 = 202,011 trajectories of 1,000 tokens (the paper's count).
  assert (memory["replay_trajectories"], memory["replay_tokens"]) == (202_011, 1000)
  expected = int(202_011 * (1000 * 6 + per_row) * 8 / 7 + 202_011 * 52)
  assert memory["replay_host"] == expected
  assert 1.35e9 < memory["replay_host"] < 1.77e9  # less than the released code's 1.77 GB for the same count
  assert plan.plan_memory(grpo.get_config(), (8, 1, 1))["replay_host"] == 0
  ap = plan.plan_memory(advantage_priority.get_config(_7B), (1, 8, 1))
  assert ap["replay_trajectories"] == min(30_000, 10 * 128 * 8)  # tau_max x B x K = 10,240 < capacity


def test_batch_rows_mirror_the_trainer():
  from jaxrlvr import train  # pylint: disable=g-import-not-at-top  (slow import; only here)
  for config in (exgrpo.get_config(_7B), advantage_priority.get_config(), grpo.get_config("smoke")):
    for shards in (1, 8):
      assert plan.batch_rows(config, shards) == train.batch_rows(config, shards)


def test_parse_mesh_names_the_flag():
  assert plan.parse_mesh("1,8,1") == (1, 8, 1)
  with pytest.raises(ValueError, match=r"--mesh='1,8' must be three positive"):
    plan.parse_mesh("1,8")
  with pytest.raises(ValueError, match=r"--mesh='a,b,c' must be three integers"):
    plan.parse_mesh("a,b,c")


def test_cli_prints_the_plan_for_the_7b_config():
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  result = subprocess.run(
      [sys.executable, "-m", "jaxrlvr.plan", f"--config=configs/exgrpo.py:{_7B}", "--mesh=1,8,1",
       "--accelerator=h100", "--config.model.attention=cudnn", "--rollout_chunks=2"],
      cwd=_ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  out = result.stdout
  assert "7,615,616,512 parameters" in out
  assert "parameters                                       3.81" in out  # 3,808,974,848 bytes
  assert "KV cache (64 rows x 9216 slots)                 33.82" in out  # half of 67.65 GB: 2 sampler calls
  assert "4 rows a device per pass, 32 passes" in out  # the scorer's default: one micro-batch a pass
  assert "NVIDIA H100 80GB" in out and "yes" in out and "v5e" not in out
