"""Config plumbing: the `:key=value` config arg, and the checks that stop an impossible config early.

Every method file in `configs/` does

    args = config_lib.parse_arg(arg, model="tiny", smoke=False)
    config = base.get_base_config(args)
    ...  # method settings
    return config_lib.finalize(config)

`finalize` locks the config, so ml_collections refuses `--config.no_such_key=1` and a wrong type
(`--config.seed=abc`); `main` turns those into one line (`unknown_key_error` names the closest key). `validate` runs
again in `train.run` once the overrides are applied and the device count is known.
"""
from collections.abc import Sequence
import difflib
import os
import types

import ml_collections

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "dr_grpo", "exgrpo_reference")
REPLAY_NAMES = ("none", "exgrpo", "advantage_priority", "bapo")
TEMPLATES = ("plain", "qwen_math", "r1", "chat")
KL_ESTIMATORS = ("k1", "k2", "k3")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
  """A config value that cannot work; the message names the key and the value."""


def parse_arg(arg: str | None, **defaults) -> types.SimpleNamespace:
  """Parses `model=qwen2.5-math-7b,smoke` into a namespace over `defaults`; a bare name sets a bool to True."""
  values = dict(defaults)
  for item in filter(None, (arg or "").split(",")):
    key, sep, value = item.partition("=")
    key = key.strip()
    if key not in defaults:
      raise ConfigError(f"unknown config arg {key!r} in {arg!r}; known: {sorted(defaults)}")
    default = defaults[key]
    if not sep:
      if not isinstance(default, bool):
        raise ConfigError(f"config arg {key!r} needs a value ({key}=...), got {arg!r}")
      values[key] = True
    elif isinstance(default, bool):
      if value.lower() not in ("true", "false", "1", "0"):
        raise ConfigError(f"config arg {key}={value!r} must be true or false")
      values[key] = value.lower() in ("true", "1")
    else:
      try:
        values[key] = type(default)(value)
      except ValueError:
        raise ConfigError(f"config arg {key}={value!r} must be a {type(default).__name__}") from None
  return types.SimpleNamespace(**values)


def finalize(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  validate(config)
  config.lock()
  return config


def _check(condition: bool, key: str, value, why: str) -> None:
  if not condition:
    raise ConfigError(f"config.{key}={value!r}: {why}")


def _one_of(config, key: str, allowed: Sequence[str]) -> None:
  value = config
  for part in key.split("."):
    value = value[part]
  _check(value in allowed, key, value, f"must be one of {list(allowed)}")


def validate(config: ml_collections.ConfigDict, *, num_devices: int | None = None) -> None:
  """Raises ConfigError naming the key and value of the first impossible setting."""
  c = config
  for key in ("total_steps", "log_every", "eval_every", "checkpoint_every"):
    _check(c[key] >= 1 if key != "total_steps" else c[key] >= 0, key, c[key], "must be positive")
  r = c.rollout
  _check(r.group_size >= 2, "rollout.group_size", r.group_size, "K must be at least 2 (advantages are r - group mean)")
  _check(r.batch_size >= 1, "rollout.batch_size", r.batch_size, "must be at least 1")
  _check(r.max_new_tokens >= 1, "rollout.max_new_tokens", r.max_new_tokens, "must be at least 1")
  _check(r.temperature >= 0, "rollout.temperature", r.temperature, "must be >= 0 (0 is greedy)")
  _check(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "must be in (0, 1]")
  _check(r.top_k >= 0, "rollout.top_k", r.top_k, "must be >= 0 (0 is off)")
  for key in ("max_rows_per_device", "prefill_rows_per_device", "prefill_chunk_tokens"):
    _check(r[key] >= 0, f"rollout.{key}", r[key], "must be >= 0 (0: no limit)")
  _check(r.kv_cache_gb >= 0, "rollout.kv_cache_gb", r.kv_cache_gb, "must be >= 0 (0: no budget)")
  _check(r.engine in ("static", "continuous"), "rollout.engine", r.engine, "must be 'static' or 'continuous'")
  _check(r.decode_slots >= 0, "rollout.decode_slots", r.decode_slots, "must be >= 0 (0: one slot per row)")
  _check(r.decode_chunk_steps >= 1, "rollout.decode_chunk_steps", r.decode_chunk_steps, "must be >= 1")
  _check(r.decode_weights in ("replicated", "training"), "rollout.decode_weights", r.decode_weights,
         "must be 'replicated' or 'training'")
  loss = c.loss
  _one_of(c, "loss.aggregation", AGGREGATION_MODES)
  _one_of(c, "loss.kl_estimator", KL_ESTIMATORS)
  _check(0 <= loss.clip_low < 1, "loss.clip_low", loss.clip_low, "must be in [0, 1)")
  _check(loss.clip_high >= 0, "loss.clip_high", loss.clip_high, "must be >= 0")
  _check(loss.dual_clip == 0 or loss.dual_clip > 1, "loss.dual_clip", loss.dual_clip, "must be 0 (off) or > 1")
  _check(loss.max_len >= 0, "loss.max_len", loss.max_len, "must be >= 0 (0: rollout.max_new_tokens)")
  _check(loss.shaping_beta >= 0, "loss.shaping_beta", loss.shaping_beta, "must be >= 0 (0: no shaping, ExGRPO: 0.1)")
  _one_of(c, "loss.reference_width", ("max_len", "padded"))
  _check(loss.reference_divisor >= 0, "loss.reference_divisor", loss.reference_divisor,
         "must be >= 0 (0: the number of micro-batches)")
  _check(c.optim.lr > 0, "optim.lr", c.optim.lr, "must be positive")
  _one_of(c, "optim.schedule", ("constant", "cosine"))
  _check(c.optim.skip_grad_norm > 0, "optim.skip_grad_norm", c.optim.skip_grad_norm, "must be positive")
  _check(c.optim.get("max_nonfinite_steps", 0) >= 0, "optim.max_nonfinite_steps", c.optim.get("max_nonfinite_steps"),
         "must be >= 0 (0: never stop)")
  _one_of(c, "tokenizer.template", TEMPLATES)
  _one_of(c, "replay.name", REPLAY_NAMES)
  if c.replay.name == "exgrpo":
    _check(0 <= c.replay.rho < 1, "replay.rho", c.replay.rho, "the replayed share of the batch must be in [0, 1)")
    _check(c.replay.bucket_sigma > 0, "replay.bucket_sigma", c.replay.bucket_sigma, "must be positive")
    _one_of(c, "replay.bucket_scale", ("count", "accuracy"))
    _one_of(c, "replay.behaviour_logprobs", ("sampler", "trainer"))
  if c.replay.name == "advantage_priority":
    _one_of(c, "replay.composition", ("fresh_anchored", "pool"))
    _one_of(c, "replay.priority", ("abs_advantage", "group_std", "uniform"))
  t = c.train
  _check(t.num_minibatches >= 1, "train.num_minibatches", t.num_minibatches, "must be at least 1")
  _check(t.num_microbatches >= 1, "train.num_microbatches", t.num_microbatches, "must be at least 1")
  _check(t.keep_logits_mb >= 0, "train.keep_logits_mb", t.keep_logits_mb, "must be >= 0 (0: always recompute)")
  _check(all(isinstance(f, (int, float)) and 0 < f < 1 for f in t.pack_completions), "train.pack_completions",
         t.pack_completions, "packed row counts are fractions of a micro-batch's rows, each in (0, 1); (): off")
  _check(t.pack_max_prompts >= 1, "train.pack_max_prompts", t.pack_max_prompts, "must be at least 1")
  _check(c.eval.num_samples >= 0, "eval.num_samples", c.eval.num_samples, "must be >= 0 (0: no DIR/samples.jsonl)")
  marks = c.eval.get("token_marks", ())
  _check(isinstance(marks, (tuple, list)) and all(isinstance(m, (int, float)) and m > 0 for m in marks),
         "eval.token_marks", marks, "cumulative generated rollout tokens, each > 0, e.g. (50000, 100000); (): none")
  rows = r.batch_size * r.group_size
  _check(rows % (t.num_minibatches * t.num_microbatches) == 0, "train.num_microbatches", t.num_microbatches,
         f"rollouts per step ({r.batch_size} x {r.group_size} = {rows}) must be divisible by "
         f"num_minibatches x num_microbatches ({t.num_minibatches} x {t.num_microbatches})")
  for axis in ("data", "fsdp", "tensor"):
    size = c.mesh[axis]
    _check(size == -1 or size >= 1, f"mesh.{axis}", size, "must be -1 (fill) or a positive size")
  _check_ranges(c)
  if num_devices is not None:  # at run time, with the command line's overrides applied
    from jaxrlvr import models  # pylint: disable=g-import-not-at-top  (JAX only once the flags are parsed)
    _one_of(c, "model.attention", models.ATTENTION_IMPLEMENTATIONS)
    _check_checkpoint_dir(c.model.path, "model.path")
    sizes = mesh_shape(c.mesh, num_devices)
    shards = sizes[0] * sizes[1]
    micro_rows = rows // (t.num_minibatches * t.num_microbatches)
    fewer = splitting_microbatches(c, shards)
    _check(micro_rows % shards == 0, "rollout.batch_size", r.batch_size,
           f"each micro-batch ({micro_rows} rollouts) must be divisible by the batch shards of the mesh "
           f"(data x fsdp = {sizes[0]} x {sizes[1]} = {shards} of {num_devices} devices)"
           + (f"; --config.train.num_microbatches={fewer} splits it" if fewer else ""))


def splitting_microbatches(config: ml_collections.ConfigDict, batch_shards: int) -> int | None:
  """A `train.num_microbatches` whose micro-batches split evenly over `batch_shards`, when the configured one's do
  not: the largest count below it that does (the fewest rows a device, over as many micro-batches as split
  evenly); None when the configured count is fine or no count is."""
  t, r = config.train, config.rollout
  rows = r.batch_size * r.group_size
  splits = lambda n: rows % (t.num_minibatches * n) == 0 and (rows // (t.num_minibatches * n)) % batch_shards == 0
  if splits(t.num_microbatches):
    return None
  return next((n for n in range(int(t.num_microbatches) - 1, 0, -1) if splits(n)), None)


# (key, test, what the key may be): the keys the checks above leave out, each checked where it is present (a config
# built by hand may lack some). A value out of range would otherwise end in a library's traceback (numpy on a
# negative seed), deep in the run (an optimizer that diverges at once), or be ignored (an unknown reward.name).
_FRACTION_BELOW_1 = lambda v: 0 <= v < 1
_NON_NEGATIVE = lambda v: v >= 0
_POSITIVE = lambda v: v > 0
_AT_LEAST_1 = lambda v: v >= 1
_RANGES = (
    ("seed", lambda v: 0 <= v < 2**32, "must be an integer in [0, 2**32) (it seeds numpy's and JAX's generators)"),
    ("keep_checkpoints", _AT_LEAST_1, "must be at least 1 (the checkpoints kept on disk)"),
    ("model.param_dtype", lambda v: v in DTYPES, f"must be one of {list(DTYPES)}"),
    ("model.compute_dtype", lambda v: v in DTYPES, f"must be one of {list(DTYPES)}"),
    ("model.attention_block_size", _AT_LEAST_1, "must be at least 1"),
    ("data.eval_fraction", _FRACTION_BELOW_1, "the held-out share of data.source must be in [0, 1) (0: none)"),
    ("data.eval_size", _NON_NEGATIVE, "must be >= 0 (0: all of the eval set)"),
    ("data.rl_train_size", _NON_NEGATIVE, "must be >= 0 (0: all the training rows)"),
    ("data.train_size", _NON_NEGATIVE, "must be >= 0 (0: the synthetic task's default)"),
    ("data.max_prompt_len", _AT_LEAST_1, "must be at least 1 (prompt tokens)"),
    ("data.worked_fraction", lambda v: 0 <= v <= 1, "must be in [0, 1] (a share of the synthetic task's solutions)"),
    ("rollout.eval_temperature", _NON_NEGATIVE, "must be >= 0 (0 is greedy)"),
    ("reward.name", lambda v: v == "math", "must be 'math' (the only reward of the math tasks)"),
    ("reward.timeout_s", _POSITIVE, "must be positive (seconds a worker may take over one answer)"),
    ("reward.num_workers", _AT_LEAST_1, "must be at least 1 (reward worker processes)"),
    ("optim.warmup_steps", _NON_NEGATIVE, "must be >= 0 (0: no warmup)"),
    ("optim.b1", _FRACTION_BELOW_1, "Adam's first-moment decay must be in [0, 1)"),
    ("optim.b2", _FRACTION_BELOW_1, "Adam's second-moment decay must be in [0, 1)"),
    ("optim.weight_decay", _NON_NEGATIVE, "must be >= 0"),
    ("optim.grad_clip", _POSITIVE, "the gradient norm's clip must be positive"),
    ("loss.kl_coef", _NON_NEGATIVE, "must be >= 0 (0: no KL term)"),
    ("loss.importance_cap", _NON_NEGATIVE, "must be >= 0 (0: off)"),
    ("train.stop_if_unsolvable_steps", _NON_NEGATIVE, "must be >= 0 (0: never stop)"),
    ("warm_start.steps", _NON_NEGATIVE, "must be >= 0 (0: no warm start)"),
    ("warm_start.lr", _POSITIVE, "must be positive"),
    ("warm_start.batch_size", _AT_LEAST_1, "must be at least 1"),
    ("eval.k", _AT_LEAST_1, "must be at least 1 (samples per question)"),
    ("eval.temperature", _NON_NEGATIVE, "must be >= 0 (0 is greedy)"),
)
_REPLAY_RANGES = {
    "exgrpo": (("replay.start_solve_rate", _NON_NEGATIVE, "a batch solve rate, >= 0 (0: at once; above 1: never)"),
               ("replay.max_tokens", _NON_NEGATIVE, "must be >= 0 (0: no cap)")),
    "bapo": (("replay.c1", _FRACTION_BELOW_1, "the hard questions' accuracy bound must be in [0, 1)"),
             ("replay.c2", lambda v: 0 <= v <= 1, "must be in [0, 1]"),
             ("replay.c3", lambda v: 0 <= v <= 1, "must be in [0, 1]"),
             *((f"replay.{key}", _NON_NEGATIVE, "must be >= 0") for key in (
                 "hard_capacity", "reroll_every", "reroll_max", "window", "policy_delay", "max_tokens"))),
    "advantage_priority": tuple((f"replay.{key}", _NON_NEGATIVE, "must be >= 0") for key in (
        "capacity", "tau_max", "warmup_steps", "alpha", "priority_eps", "replay_fraction", "max_tokens")),
}
_EXPRL_RANGES = (
    ("exprl.reward", lambda v: v in ("outcome", "process"), "must be 'outcome' or 'process'"),
    ("exprl.norm", lambda v: v in ("end", "delta", "group"), "must be one of ['end', 'delta', 'group']"),
    ("exprl.group_mean", lambda v: v in ("segments", "rollouts", "trajectory"),
     "must be one of ['segments', 'rollouts', 'trajectory']"),
    ("exprl.process_judging", lambda v: v in ("prefix", "step"), "must be 'prefix' or 'step'"),
    ("exprl.delimiter", bool, "must not be empty: it cuts an answer into segments, e.g. '###'"),
    ("exprl.judge.kind", lambda v: v in ("http", "model"), "must be 'http' or 'model'"),
    ("exprl.judge.on_failure", lambda v: v in ("skip", "error"), "must be 'skip' or 'error'"),
    ("exprl.judge.timeout_s", _POSITIVE, "must be positive (seconds)"),
    ("exprl.judge.max_retries", _NON_NEGATIVE, "must be >= 0"),
    ("exprl.judge.max_concurrency", _AT_LEAST_1, "must be at least 1"),
    ("exprl.judge.max_tokens", _AT_LEAST_1, "must be at least 1"),
    ("exprl.judge.max_new_tokens", _AT_LEAST_1, "must be at least 1"),
    ("exprl.judge.batch_size", _AT_LEAST_1, "must be at least 1"),
    ("exprl.judge.max_prompt_tokens", _NON_NEGATIVE, "must be >= 0 (0: no limit)"),
)


def _check_all(config: ml_collections.ConfigDict, ranges) -> None:
  """Each (key, test, why) of `ranges` whose key `config` has."""
  for key, test, why in ranges:
    node, parts = config, key.split(".")
    for part in parts:
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        break
      node = node[part]
    else:
      _check(test(node), key, node, why)


def _check_ranges(c: ml_collections.ConfigDict) -> None:
  _check_all(c, _RANGES)
  _check_all(c, _REPLAY_RANGES.get(c.replay.name, ()))
  if "exprl" in c:
    _check_all(c, _EXPRL_RANGES)
  k, temperature = c.eval.get("k", 1), c.eval.get("temperature", 0.0)
  _check(k == 1 or temperature > 0, "eval.k", k, f"{k} samples at eval.temperature={temperature} would all be the "
         "greedy answer: set eval.temperature > 0, or eval.k=1")
  if c.replay.name == "bapo":
    _check(c.replay.c2 <= c.replay.c3, "replay.c2", c.replay.c2, f"must be <= replay.c3 ({c.replay.c3})")


def _check_checkpoint_dir(path: str, key: str) -> None:
  """A set `path` must be a local Hugging Face checkpoint directory (nothing is downloaded)."""
  if path:
    what = "does not exist" if not os.path.exists(path) else "has no config.json"
    _check(os.path.isfile(os.path.join(path, "config.json")), key, path,
           f"{what}: give a local Hugging Face checkpoint directory (config.json and *.safetensors; nothing is "
           "downloaded), or '' for a preset initialised at random")


def mesh_shape(mesh_config, num_devices: int) -> tuple[int, int, int]:
  """Resolves the -1 entry of (data, fsdp, tensor) against the device count."""
  sizes = [mesh_config.data, mesh_config.fsdp, mesh_config.tensor]
  if sizes.count(-1) > 1:
    raise ConfigError(f"config.mesh={tuple(sizes)}: at most one axis may be -1")
  known = 1
  for s in sizes:
    known *= s if s != -1 else 1
  if -1 in sizes:
    if num_devices % known:
      raise ConfigError(f"config.mesh={tuple(sizes)}: {num_devices} devices are not divisible by {known}")
    sizes[sizes.index(-1)] = num_devices // known
  if sizes[0] * sizes[1] * sizes[2] != num_devices:
    raise ConfigError(f"config.mesh={tuple(sizes)} needs {sizes[0] * sizes[1] * sizes[2]} devices, "
                      f"but {num_devices} are present")
  return tuple(sizes)


def leaf_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  """Every settable key of `config`, dotted: ['data.source', ..., 'optim.lr', ...]."""
  keys = []
  for name in config.keys():
    value = config[name]
    if isinstance(value, ml_collections.ConfigDict):
      keys.extend(leaf_keys(value, f"{prefix}{name}."))
    else:
      keys.append(prefix + name)
  return keys


def unknown_key_error(config: ml_collections.ConfigDict, key: str) -> str | None:
  """None when the dotted `key` names a field of `config`; otherwise the message that says so, with the closest
  existing keys: "unknown config key 'optim.lrr' (did you mean 'optim.lr'?)"."""
  node, parts = config, key.split(".")
  for depth, part in enumerate(parts):
    if not isinstance(node, ml_collections.ConfigDict):
      parent = ".".join(parts[:depth])
      return f"unknown config key {key!r}: config.{parent} is a {type(node).__name__} ({node!r}), it has no keys"
    if part not in node:
      break
    node = node[part]
  else:
    return None
  known = leaf_keys(config)
  # The whole dotted key first (catches typos anywhere in it), then the last part alone (`lr` -> optim.lr, ...).
  close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
  if not close:
    by_name = {}
    for k in known:
      by_name.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    for name in difflib.get_close_matches(parts[-1], list(by_name), n=2, cutoff=0.75):
      close.extend(by_name[name])
  hint = f" (did you mean {' or '.join(repr(k) for k in close[:3])}?)" if close else ""
  return f"unknown config key {key!r}{hint}"
