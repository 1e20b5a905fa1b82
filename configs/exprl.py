"""ExpRL: a dense-reward stage before sparse-reward RL. A judge reads the question, a hidden reference solution and
the policy's answer, and returns a score 1-5 mapped to (k-1)/4.

    python -m jaxrlvr.main --config=configs/exprl.py:reward=process --workdir=/tmp/exprl \\
        --config.exprl.judge.base_url=http://127.0.0.1:8000 --config.exprl.judge.model_name=Qwen/Qwen3-32B

The judge is any OpenAI-compatible chat-completions endpoint (a vLLM or SGLang server; `exprl.judge.kind="http"`) or
a checkpoint run by this package's sampler (`kind="model"`, `exprl.judge.path=HF_DIR`; empty: a frozen copy of the
starting policy). The reference solution is the dataset's `data.solution_field` (`solution` in jsonl; the synthetic
task supplies its worked solutions).
- `:reward=outcome`: one score per rollout, GRPO advantages r - group mean; PPO clip 0.2 / 0.28 (the paper's
  clip-high for ExpRL-Outcome), up to `train.num_minibatches` optimizer steps per batch.
- `:reward=process`: the answer is cut at `exprl.delimiter` ("###", which belongs to the earlier segment), the judge
  scores each prefix (the answer up to and including segment t: `exprl.process_judging="prefix"`, the paper; `"step"`
  grades segment t alone with the earlier ones as context), fully on-policy (one optimizer step per batch, as the
  paper's process runs), and segment advantages are `exprl.norm="end"` (s_t - s_T), `"delta"` (s_t - s_{t-1}, first
  s_1 - s_T) or `"group"` (s_t - mean of the group's segment scores; `exprl.group_mean` picks the mean where the
  paper leaves it open); each token gets its segment's advantage. An answer of one segment (no delimiter) has
  advantage 0 under "end" and "delta" (s_1 - s_T with T = 1), so it trains nothing there; "group" gives it s_1 minus
  the group mean, as the outcome variant would.
A score that cannot be parsed removes the rollout from the loss (`judge/removed_rollouts`); a length-clipped answer
scores 0. On the embedded CPU default (`:smoke`) the judge is the tiny policy itself: it cannot follow a judge
prompt, so every rollout is a parse failure and removed -- that run checks the plumbing, not learning.

Stage II, sparse-reward RL from this stage's policy: every run ends by writing its final policy to WORKDIR/hf, a
transformers directory (jaxrlvr/export.py), and `model.path` starts GRPO or ExGRPO from it (no warm start then):
    python -m jaxrlvr.main --config=configs/exgrpo.py --workdir=/tmp/exgrpo-primed --config.model.path=/tmp/exprl/hf
The tokenizer comes from the same directory (WORKDIR/hf holds it). At paper scale give the data as for stage I:
    python -m jaxrlvr.main --config=configs/exgrpo.py:model=qwen2.5-math-7b --workdir=DIR2 \\
        --config.model.path=DIR/hf --config.data.source=parquet:/data/openr1.parquet
`python -m jaxrlvr.export --workdir=/tmp/exprl --step=N` exports an earlier checkpoint.
"""
import ml_collections

from configs import base
from jaxrlvr import config_lib


def get_config(arg: str | None = None):
  args = config_lib.parse_arg(arg, model="tiny", smoke=False, reward="outcome")
  config = base.get_base_config(args)
  config.method = "exprl"
  config.replay.name = "none"
  config.exprl = ml_collections.ConfigDict()
  config.exprl.reward = args.reward
  config.exprl.norm = "end"
  config.exprl.group_mean = "segments"
  config.exprl.delimiter = "###"
  config.exprl.scale_by_std = False
  # Process variant: what the judge grades for segment t. "prefix" (the paper: the answer up to and including
  # segment t, whose scores s_t EndNorm and DeltaNorm difference) or "step" (segment t alone, earlier ones as context).
  config.exprl.process_judging = "prefix"
  if args.reward == "outcome":
    config.loss.clip_high = 0.28  # the paper's upper clip for ExpRL-Outcome (0.26 for its sparse-reward GRPO runs)
  else:
    config.train.num_minibatches = 1  # ExpRL-Process trains fully on-policy: one optimizer step per batch
  judge = config.exprl.judge = ml_collections.ConfigDict()
  judge.kind = "http"
  judge.base_url = "http://127.0.0.1:8000"
  judge.model_name = ""
  judge.timeout_s = 120.0
  judge.max_retries = 3  # tries after the first, with exponential backoff (1, 2, 4 s); then on_failure
  # A request that failed every try: "skip" removes its rollout from the loss (counted in judge/request_failures),
  # "error" stops the run with the judge's URL (exit 2).
  judge.on_failure = "skip"
  judge.max_concurrency = 32
  judge.max_tokens = 1024
  judge.api_key_env = ""
  judge.path = ""  # kind=model: HF checkpoint of the judge; empty: a frozen copy of the starting policy
  judge.max_new_tokens = 512
  judge.batch_size = 8
  judge.max_prompt_tokens = 0
  if args.smoke or args.model == "tiny":
    judge.kind = "model"
    judge.max_new_tokens = 8
    judge.batch_size = 64
  if args.smoke:
    # A call's rows are padded to batch_size with copies, and the judge prompts are ~950 tokens for the embedded
    # tokenizer: a smoke step's 4 x 4 rollouts in one call of 16, not 64 (a quarter of the judge's time).
    judge.batch_size = config.rollout.batch_size * config.rollout.group_size
  if args.reward not in ("outcome", "process"):
    raise config_lib.ConfigError(f"config arg reward={args.reward!r}: expected outcome or process")
  return config_lib.finalize(config)
