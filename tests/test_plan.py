"""The memory planner: 7B figures against hand arithmetic, specs on real and abstract meshes, the attention and
sampler terms, the shipped paper-scale defaults fitting every method, the fit rule, the replay estimate and the
command line. Everything is `jax.eval_shape`: nothing of 7B size is allocated (tests/test_plan_xla.py holds the
formulas to XLA's compiled figures)."""
import importlib
import os
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding

from configs import advantage_priority, exgrpo, grpo
from jaxrlvr import config_lib
from jaxrlvr import parallel
from jaxrlvr import plan
from jaxrlvr import run_setup
from jaxrlvr.models import get_preset
from jaxrlvr.replay.storage import RolloutStore
from jaxrlvr.rollout import bounded

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_7B = "model=qwen2.5-math-7b"
_METHODS = ("grpo", "exgrpo", "advantage_priority", "bapo", "exprl")


def _with(config, **changes):
  config.unlock()
  for key, value in changes.items():
    section, name = key.split("__")
    config[section][name] = value
  return config


@pytest.fixture(scope="module")
def paper_plan():
  """ExGRPO at paper scale (128 x 8 rollouts, 1024 + 8192 tokens, remat, bf16 compute) on 1 x 8 x 1, for a GPU."""
  return plan.plan_memory(exgrpo.get_config(_7B), (1, 8, 1), backend="gpu")


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


def test_7b_update_and_kv_cache_by_hand(paper_plan):
  # Sampler: 1024 rollouts / 8 shards = 128 rows a device, in calls of the shipped 32; 1024 + 8192 = 9216 slots;
  # 28 layers x (k, v) x 4 kv heads x 128 head_dim x 2 bytes (bf16) = 57,344 bytes a slot -> 32 x 9216 x 57,344.
  assert paper_plan["kv_cache"] == 32 * 9216 * 28 * 2 * 4 * 128 * 2 == 16_911_433_728
  # Update: 1024 rows / (2 minibatches x 16 micro-batches x 8 shards) = 4 rows of S = 9216 tokens a device.
  b, s, d, f, c = 4, 9216, 3584, 18944, 2
  kept = 28 * b * s * d * c  # remat: every block's input, 7.40 GB
  backward = b * s * (6 * f + 12 * d) * c  # one layer's backward: 6 [b, S, F] and 12 [b, S, D] arrays, 11.55 GB
  lse = b * 28 * s * 4  # attention "auto" on a GPU in bf16 is cuDNN's: its f32 log-sum-exp
  assert paper_plan["update.activations"] == kept + backward + lse == 18_953_994_240
  # One layer with fsdp dropped: 233,057,792 values (q, o 3584 x 3584; k, v 3584 x 512; biases; norms; the MLP's
  # 3 x 3584 x 18944) in f32 = 932 MB; on a GPU: two layers in bf16, one f32 gather in flight, one layer's f32
  # gradients before the reduce-scatter.
  layer = (2 * 3584 * 3584 + 2 * 3584 * 512 + 4608 + 7168 + 3 * 3584 * 18944) * 4
  assert layer == 932_231_168
  assert paper_plan["update.gathered"] == 2 * (layer // 2) + layer + layer
  batch = 128 * (2 * s * 4 + 4 * 8192 * 4 + 2)  # ids, mask [S] int32; completion mask, advantages, 2 log-probs [T]
  assert paper_plan["update.batch"] == batch
  assert paper_plan["update"] == (3 * 3_808_974_848 + batch + 2 * 3_808_974_848 + paper_plan["update.activations"]
                                  + paper_plan["update.gathered"] + paper_plan["update.logits"])
  # Decode (rollout.decode_weights="replicated"): the sampler gathers every weight once, before its loop, into a
  # bf16 copy without the fsdp split (28 layers, the embedding and the unembedding 3584 x 152064, the final norm)
  # and gathers nothing inside it.
  assert paper_plan["decode.gathered"] == 0
  assert paper_plan["decode.decode_copy"] == (28 * layer + 2 * 3584 * 152064 * 4 + 3584 * 4) // 2


def test_attention_terms_by_implementation():
  config = exgrpo.get_config(_7B)
  b, s, n = 4, 9216, 28
  terms = {}
  for implementation in ("xla", "blockwise", "cudnn"):
    _with(config, model__attention=implementation)
    terms[implementation] = plan.plan_memory(config, (1, 8, 1), backend="gpu")["update.activations"]
  # Only the attention transient differs. xla: [b, N, S, S] f32 scores and probs + bf16 probs, and the [b, S, S]
  # mask, twice in the backward (575 GB: why it is not the default).
  assert terms["xla"] - terms["cudnn"] == 2 * (b * n * s * s * 10 + b * s * s) - b * n * s * 4
  # blockwise: s, p, dp, ds of one [b, N, 512, 512] f32 block and the f32 dk, dv [b, 4, S, 128].
  assert terms["blockwise"] - terms["cudnn"] == 4 * b * n * 512 * 512 * 4 + 2 * b * 4 * s * 128 * 4 - b * n * s * 4
  # splash (TPU): in the backward q and the kernel's residual heads-first in bf16, k and v heads-first, and the f32
  # log-sum-exp; its score tiles stay in the core.
  _with(config, model__attention="splash")
  splash = plan.plan_memory(config, (1, 8, 1), backend="tpu")["update.activations"]
  _with(config, model__attention="cudnn")
  cudnn = plan.plan_memory(config, (1, 8, 1), backend="tpu")["update.activations"]
  assert splash - cudnn == 2 * b * n * s * 128 * 2 + 2 * b * 4 * s * 128 * 2
  # auto resolves per backend: cuDNN on a GPU in bf16, splash on a TPU for the update's T = S.
  _with(config, model__attention="auto")
  assert plan.workload(config, (1, 8, 1), backend="gpu").attention(s, s) == "cudnn"
  assert plan.workload(config, (1, 8, 1), backend="tpu").attention(s, s) == "splash"


def test_sampler_bounds_mirror_the_sampler():
  config = _with(exgrpo.get_config(_7B), rollout__kv_cache_gb=0.0)
  mesh = parallel.make_mesh(1, 8, 1)
  for max_rows in (0, 32, 48, 200):
    _with(config, rollout__max_rows_per_device=max_rows)
    w = plan.workload(config, (1, 8, 1))
    calls = bounded.plan_calls([[1]] * 1024, pad_id=0, vocab_size=None, mesh=mesh, pad_batch_to=1,
                                        max_rows_per_device=max_rows)
    assert (w.rollout_rows * 8, w.sampler_calls) == (calls.rows, calls.count), max_rows
  # A KV cache scales with the call's rows; the prefill transient with its block, not with the call.
  _with(config, rollout__max_rows_per_device=0)  # and no kv_cache_gb
  whole = plan.plan_memory(config, (1, 8, 1))
  assert whole["kv_cache"] == 4 * 16_911_433_728  # all 128 rows a device in one call: 67.6 GB
  _with(config, rollout__max_rows_per_device=32, rollout__prefill_rows_per_device=8)
  smaller = plan.plan_memory(config, (1, 8, 1))
  _with(config, rollout__prefill_rows_per_device=16)
  assert plan.plan_memory(config, (1, 8, 1))["prefill.activations"] > smaller["prefill.activations"]


@pytest.mark.parametrize("model, rows", [("qwen2.5-math-7b", 32), ("llama3.1-8b", 16), ("qwen2.5-math-1.5b", 64)])
def test_the_kv_cache_budget_is_resolved_with_the_overrides(model, rows):
  config = exgrpo.get_config(f"model={model}")
  assert config.rollout.kv_cache_gb == 30.0 and config.rollout.max_rows_per_device == 0
  layers, kv_heads = {"qwen2.5-math-7b": (28, 4), "llama3.1-8b": (32, 8), "qwen2.5-math-1.5b": (28, 2)}[model]
  slot_bytes = layers * 2 * kv_heads * 128 * 2  # (k, v) x head_dim 128 x bf16
  # The largest power of two whose cache (rows x 9216 slots) fits 30 GB; the next power of two would not.
  assert rows * 9216 * slot_bytes <= 30e9 < 2 * rows * 9216 * slot_bytes
  assert run_setup.sampler_limits(config)["max_rows_per_device"] == rows
  assert plan.workload(config, (1, 8, 1)).rollout_rows == rows
  # Longer answers on the command line: fewer rows a call, the same budget (a precomputed row count would have
  # kept 32 rows and doubled the cache).
  _with(config, rollout__max_new_tokens=16384)
  assert run_setup.sampler_limits(config)["max_rows_per_device"] == rows // 2
  memory = plan.plan_memory(config, (1, 8, 1))
  assert memory["kv_cache"] == rows // 2 * (1024 + 16384) * slot_bytes <= 30e9
  # A row count set by hand wins; a budget that holds no row is one line naming the key.
  _with(config, rollout__max_rows_per_device=48)
  assert run_setup.sampler_limits(config)["max_rows_per_device"] == 48
  _with(config, rollout__max_rows_per_device=0, rollout__kv_cache_gb=0.1)
  with pytest.raises(config_lib.ConfigError, match=r"rollout.kv_cache_gb=0.1: holds no row; one row's KV cache"):
    run_setup.sampler_limits(config)


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
  assert two_replicas["kv_cache"] == 16_911_433_728  # 64 rows a device, still 32 a call


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
  with pytest.raises(ValueError, match="backend='ipu'"):
    plan.workload(exgrpo.get_config(), (8, 1, 1), backend="ipu")


@pytest.mark.parametrize("model", ["qwen2.5-math-7b", "llama3.1-8b"])
def test_shipped_paper_settings_fit_8_h100_and_v5p_for_every_method(model):
  for method in _METHODS:
    config = importlib.import_module(f"configs.{method}").get_config(f"model={model}")
    # The paper's batch, group and lengths are kept; only execution bounds were chosen.
    r = config.rollout
    assert (r.batch_size, r.group_size, r.max_new_tokens, config.data.max_prompt_len) == (128, 8, 8192, 1024)
    micro = 32 if method in ("advantage_priority", "bapo") else 16  # those two: more rows or delayed copies
    assert config.train.num_minibatches == 2 and config.train.num_microbatches == micro and config.model.remat
    # 8 x H100, 8 v5p chips (fsdp=8), and a v5p-8 slice, whose 4 chips give fsdp=4.
    for accelerator, mesh in (("h100", (1, 8, 1)), ("v5p", (1, 8, 1)), ("v5p", (1, 4, 1))):
      memory = plan.plan_memory(config, mesh, backend=plan.ACCELERATORS[accelerator].backend)
      assert plan.fits(memory, accelerator), (model, method, accelerator, mesh, memory["peak"] / 1e9)
    # Without the sampler's KV cache budget the cache of 128 rows a device would not fit an H100 (with the weights
    # gathered for the decode).
    _with(config, rollout__kv_cache_gb=0.0)
    assert not plan.fits(plan.plan_memory(config, (1, 8, 1), backend="gpu"), "h100"), (model, method)


@pytest.mark.parametrize("model", ["qwen2.5-math-7b", "llama3.1-8b"])
def test_grpo_and_exgrpo_paper_configs_build_the_same_scoring_and_sampler_programs(model):
  # docs/pods.md compiles ExGRPO's scoring pass, prefill and decode and says GRPO's are the same programs: they are
  # built from the model, config.rollout and the workload's shapes, and the two configs differ in none of these.
  configs = [importlib.import_module(f"configs.{method}").get_config(f"model={model}") for method in ("grpo", "exgrpo")]
  assert configs[0].rollout.to_dict() == configs[1].rollout.to_dict()
  assert configs[0].model.to_dict() == configs[1].model.to_dict()
  for mesh, backend in (((1, 4, 1), "tpu"), ((1, 64, 1), "tpu"), ((1, 8, 1), "gpu")):
    grpo_workload, exgrpo_workload = (plan.workload(c, mesh, backend=backend) for c in configs)
    assert grpo_workload == exgrpo_workload, (mesh, backend)


# XLA:TPU's figures (GB a chip) for the shipped ExGRPO config, `python -m jaxrlvr.plan --topology=... [--min_hbm]`
# (docs/pods.md; v5p-64 with train.num_microbatches=8, as the command proposes): each program's peak_memory_in_bytes
# and, where it was bracketed, the least HBM it compiles in, (low, high]. The planner's TPU terms are fitted to these.
_TPU_COMPILED = {
    ("qwen2.5-math-7b", (1, 4, 1)): {"update": (66.63, (62.59, 73.55)), "score": (15.98, (15.54, 17.18)),
                                     "prefill": (40.95, None), "decode": (40.05, (37.29, 45.57))},
    ("qwen2.5-math-7b", (1, 64, 1)): {"update": (8.54, (8.83, 9.16)), "score": (2.03, (2.10, 2.15)),
                                      "prefill": (11.12, None), "decode": (25.27, (23.03, 28.15))},
    ("llama3.1-8b", (1, 4, 1)): {"update": (64.26, (63.43, 76.91)), "score": (16.13, (15.33, 16.20)),
                                 "prefill": (28.67, None), "decode": (43.70, (40.50, 49.50))},
    ("llama3.1-8b", (1, 64, 1)): {"update": (8.56, (9.06, 9.60)), "score": (2.10, (2.26, 2.30)),
                                  "prefill": (21.93, None), "decode": (36.96, (33.66, 41.14))},
}


@pytest.mark.parametrize("model, mesh", sorted(_TPU_COMPILED))
def test_the_tpu_plan_is_within_10_percent_of_the_least_hbm_xla_tpu_needs(model, mesh):
  config = exgrpo.get_config(f"model={model}")
  proposal = config_lib.splitting_microbatches(config, mesh[0] * mesh[1])
  if proposal:
    _with(config, train__num_microbatches=proposal)
  memory = plan.plan_memory(config, mesh, backend="tpu")
  for phase, (peak, least) in _TPU_COMPILED[model, mesh].items():
    planned = memory[phase] / 1e9
    # Within 10% of every value the bracket allows (its ends were probed at an earlier planner's figure / 1.1 and
    # / 0.9, hence the rounding margin); of the peak where none was taken (on v5p-8 the least HBM is the peak).
    low, high = least or (peak, peak)
    assert planned / high >= 0.9 * 0.999 and planned / low <= 1.1 * 1.001, (phase, planned, peak, least)


def test_shipped_1_5b_fits_one_h100_for_every_method():
  for method in _METHODS:
    config = importlib.import_module(f"configs.{method}").get_config("model=qwen2.5-math-1.5b")
    assert plan.fits(plan.plan_memory(config, (1, 1, 1), backend="gpu"), "h100"), method
  # Its 64 micro-batches are what fits one device: 16 would hold 32 rows a device.
  config = _with(grpo.get_config("model=qwen2.5-math-1.5b"), train__num_microbatches=16)
  assert not plan.fits(plan.plan_memory(config, (1, 1, 1), backend="gpu"), "h100")


def test_tiny_default_fits_everywhere():
  memory = plan.plan_memory(exgrpo.get_config(), (8, 1, 1))
  assert memory["param_count"] == 993_408  # models/config.py: the embedded default
  assert all(plan.fits(memory, name) for name in plan.ACCELERATORS)
  assert memory["update.gathered"] == 0  # f32 everywhere, no fsdp: the layers read their parameters in place


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


def test_the_plan_has_the_rows_of_the_run():
  for config in (exgrpo.get_config(_7B), advantage_priority.get_config(), grpo.get_config("smoke")):
    for mesh_shape in ((1, 1, 1), (1, 8, 1), (2, 4, 1)):
      shards = mesh_shape[0] * mesh_shape[1]
      assert plan.workload(config, mesh_shape, backend="cpu").rows == run_setup.batch_rows(config, shards)


def test_parse_mesh_names_the_flag():
  assert plan.parse_mesh("1,8,1") == (1, 8, 1)
  with pytest.raises(ValueError, match=r"--mesh='1,8' must be three positive"):
    plan.parse_mesh("1,8")
  with pytest.raises(ValueError, match=r"--mesh='a,b,c' must be three integers"):
    plan.parse_mesh("a,b,c")


def test_cli_prints_the_plan_for_the_7b_config():
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  result = subprocess.run(
      [sys.executable, "-m", "jaxrlvr.plan", f"--config=configs/exgrpo.py:{_7B}", "--mesh=1,8,1"],
      cwd=_ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  out = result.stdout
  assert "7,615,616,512 parameters" in out
  assert "parameters                                           3.81" in out  # 3,808,974,848 bytes
  assert "KV cache (32 rows x 9216 slots)                     16.91" in out
  assert "sampler: 32 rows a device per call, 4 calls, prefill 16 rows x 1024 slots at a time" in out
  fits = {line.split()[0] + line.split()[1]: line for line in out.splitlines() if "80GB" in line or "v5p" in line}
  assert "yes" in fits["NVIDIAH100"] and "yes" in fits["TPUv5p"]
  # The old --rollout_chunks flag is gone: the sampler's bound is the config's rollout.max_rows_per_device.
  result = subprocess.run(
      [sys.executable, "-m", "jaxrlvr.plan", f"--config=configs/exgrpo.py:{_7B}", "--mesh=1,8,1",
       "--rollout_chunks=2"], cwd=_ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode != 0 and "rollout_chunks" in result.stderr
  # A setting that cannot work is one line naming it, exit code 2.
  result = subprocess.run(
      [sys.executable, "-m", "jaxrlvr.plan", f"--config=configs/exgrpo.py:{_7B}", "--mesh=1,8,1",
       "--config.rollout.kv_cache_gb=0.1"], cwd=_ROOT, env=env, capture_output=True, text=True, timeout=120,
      check=False)
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert "jaxrlvr.plan: error: config.rollout.kv_cache_gb=0.1: holds no row" in result.stderr


def test_topology_names_and_the_proposed_micro_batches():
  from jaxrlvr.plan import topology
  assert topology.parse_topology("v5p:4x4x4") == topology.Target("v5p", "v5p:4x4x4")
  assert topology.parse_topology("h100:8").platform == "gpu"
  for bad in ("v5p-8", "v5p:4x4x4x4", "a100:8", "h100:0"):
    with pytest.raises(config_lib.ConfigError, match="--topology="):
      topology.parse_topology(bad)
  # The paper-scale batch: 128 x 8 rollouts, 2 optimizer steps of 16 micro-batches: 32 rollouts a micro-batch,
  # which 64 batch shards cannot split; 8 micro-batches of 64 can, and 16 of 32 on 8 shards need no change.
  config = exgrpo.get_config(_7B)
  assert config_lib.splitting_microbatches(config, 8) is None
  assert config_lib.splitting_microbatches(config, 64) == 8


def test_the_report_holds_the_planner_to_the_compilers_peak():
  # The 7B update on v5p-8 as compiled (docs/pods.md): peak 66.63 GB, arg+out+temp-alias 84.88, planner 80.90. Its
  # least HBM lies in (62.59, 73.55] GB, about its peak, so the ratio printed is the planner's over the peak.
  from jaxrlvr.plan import topology
  report = topology.ProgramReport(name="update", compile_s=667, peak_bytes=66.63e9, total_bytes=84.88e9,
                                  planned_bytes=80.90e9, flops=0.0, hbm_bytes=0.0, collective_bytes=434.61e9,
                                  loop_all_gathers=199, seconds=326.0, bound_by="FLOPs",
                                  min_hbm_bytes=(62.59e9, 73.55e9))
  work = {"update": types.SimpleNamespace(model_flops=4.49e17 / 4)}  # a step's model FLOPs, per device
  text = topology.format_report(exgrpo.get_config(_7B), topology.parse_topology("v5p:2x2x1"), (1, 4, 1), [report],
                                [], work)
  header, row, mfu = text.splitlines()[1:4]
  assert "planner/peak" in header and "plan/compiler" not in header
  assert row.split()[:9] == ["update", "667", "66.63", "84.88", "62.59-73.55", "yes", "80.90", "1.21", "199"]
  assert mfu.startswith("update: MFU bound 75% ")  # 4.49e17 FLOPs in 326 s on 4 chips of 459 TFLOP/s


_HLO = """HloModule m

%body.1 (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %pallas.1 = bf16[8,128]{1,0} custom-call(%q), custom_call_target="tpu_custom_call", backend_config={"body": "kernel
}}, metadata={op_name="splash_mha_fwd/pallas_call"}
  %ag.1 = bf16[64,128]{1,0} all-gather(%x), channel_id=1, dimensions={0}
  ROOT %t = (s32[], f32[8]) tuple(%a, %b)
}

%cond.1 (p: (s32[], f32[8])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%inner (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %w.2 = (s32[], f32[8]) while(%t0), condition=%cond.1, body=%body.1, backend_config={"known_trip_count":{"n":"28"}}
  %ar.1 = f32[1024]{0} all-reduce(%g), channel_id=2, to_apply=%add
  ROOT %t2 = (s32[], f32[8]) tuple(%a, %b)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %ag.0 = f32[256]{0} all-gather(%a), channel_id=3, dimensions={0}
  %w.1 = (s32[], f32[8]) while(%t), condition=%cond.1, body=%inner
  ROOT %r = f32[8] get-tuple-element(%w.1), index=1
}
"""


def test_hlo_collectives_inside_loops_and_their_trip_counts():
  from jaxrlvr.plan import hlo
  # A Pallas call's backend config spans lines, one starting with "}}": the loop body goes on after it.
  inside = hlo.collectives(_HLO, in_loops=True)
  assert sorted((c.op, c.result_bytes) for c in inside) == [("all-gather", 64 * 128 * 2), ("all-reduce", 4096)]
  assert [(c.op, c.result_bytes) for c in hlo.collectives(_HLO, in_loops=False)] == [("all-gather", 1024)]
  # The outer loop records no trip count (5 assumed), the inner one 28: its all-gather runs 5 x 28 times a call.
  assert hlo.collective_bytes(_HLO, unknown_trips=5) == 1024 + 5 * 4096 + 5 * 28 * 64 * 128 * 2
  # Without the inner count too (XLA:TPU keeps none), the 5 is the nest's: the inner loop is not multiplied again.
  uncounted = _HLO.replace(', backend_config={"known_trip_count":{"n":"28"}}', "")
  assert hlo.collective_bytes(uncounted, unknown_trips=5) == 1024 + 5 * 4096 + 5 * 64 * 128 * 2


@pytest.mark.parametrize("least,probes", [
    (950, [909, 1111]),  # the planner (1000 MiB) within 10%: its band's two probes settle it
    (700, [909, 476, 657, 772]),  # over by more: ratios halved down from the band's lower edge (sqrt(250 x 909) ...)
    (1500, [909, 1111, 4000, 2108, 1530, 1303]),  # under by more: the ceiling, then halved down to the band's width
    (5000, [909, 1111, 4000]),  # more than the chip: None
])
def test_least_hbm_bracket_probes_the_planners_band_first(least, probes):
  from jaxrlvr.plan import topology
  asked = []

  def compiles_within(mib):
    asked.append(mib)
    return mib >= least

  bracket = topology.least_hbm_bracket(compiles_within, planned_mib=1000, floor_mib=250, ceiling_mib=4000)
  assert asked == probes
  if least > 4000:
    assert bracket is None
  else:
    low, high = bracket
    assert low < least <= high and high <= low * 1.1 / 0.9 + 1
