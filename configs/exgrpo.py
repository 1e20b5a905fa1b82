"""ExGRPO (Zhan et al. 2025, "Learning to Reason from Experience"): on-policy GRPO plus a bucketed replay buffer of
correct answers, a retired set, lowest-entropy answer selection and the mixed-policy objective with f(w)=w/(w+beta).

    python -m jaxrlvr.main --config=configs/exgrpo.py --workdir=/tmp/exgrpo

2-core CPU: 3 min 45 s measured from a cold warm-start cache (the 1,200-step warm start is most of it, cached for
later runs; `python benchmarks/main_command.py` reruns it). Held-out greedy accuracy (400 questions, seed 0) went 39.0% -> 58.3% at step 50 and 56.5% at step 200 (+17.5
points), while the greedy answers learned to show their work (mean length 7.1 -> 15.3 tokens); the README's results
have the per-level figures and the 3-seed comparison.

`:smoke` (`--config=configs/exgrpo.py:smoke`: the main command end to end, 4 steps of 4 questions x 4 samples from
the model at random initialisation, no warm start, so nothing is solved or replayed): 40-51 s on 2 cores shared with
other jobs from cold caches (JAX's compilation cache and the warm-start cache empty; 42-50 CPU-s), where the 600-step
warm start it trained before made it 211 s.
Paper scale (the released run_exgrpo.sh: 128 questions x 8, response 8192, 700 steps, lr 1e-6):

    python -m jaxrlvr.main --config=configs/exgrpo.py:model=qwen2.5-math-7b --workdir=DIR \\
        --config.model.path=/ckpt/Qwen2.5-Math-7B --config.data.source=parquet:/data/openr1.parquet \\
        --config.data.eval_source=parquet:/data/valid.parquet

Where the paper and its released code differ (the defaults follow the released code unless it has a bug):
- Bucket weights: `replay.bucket_scale="count"` (code: N(k; K/2, sigma) in counts, sharply peaked) or
  `"accuracy"` (paper text: N(k/K; 0.5, sigma) in accuracy units, nearly uniform at sigma=1); `replay.bucket_sigma`.
- Clipping once replay is on: `loss.mixed_clip=False` (code: fresh tokens unclipped in the mixed phase) or `True`
  (paper eq. 4 keeps CLIP for fresh tokens). Replayed tokens are always shaped (`loss.shaping_beta=0.1`; 0 turns
  shaping off and treats them like fresh tokens, the no-shaping ablation: -A * w, unclipped in the mixed phase unless
  mixed_clip) and never clipped. The phase a batch is
  trained in is the one it was planned in: the step whose solve rate turns replay on is still clipped.
- Loss normalisation: `loss.aggregation="dr_grpo"` (sum / (N x L) over the global batch; invariant to micro-batching)
  or `"exgrpo_reference"`, what the released code computes: each data-parallel rank divides every micro-batch's
  token sum by the response width and by the gradient-accumulation divisor, and the ranks' gradients are averaged,
  i.e. (global sum) / (W x R x D) with R the mesh's batch shards (data x fsdp; verl's FSDP ranks). Two details the
  code leaves to its padding and batching, as switches: `loss.reference_width="max_len"` (W = L: verl pads every
  response to the length cap) or `"padded"` (the batch's padded completion width); `loss.reference_divisor=1` (the
  script's ppo_mini_batch_size // ppo_micro_batch_size = 64 // 64, which the code divides by even when dynamic
  batching makes the real micro-batch count differ; both scale alike with the world size), a fixed D, or 0 (D =
  `train.num_microbatches`).
- Entropy bonus: `loss.entropy_coef` (0.001 in the code's table at paper scale; absent from eq. 4). Under
  `exgrpo_reference` it is the code's: a token mean of each rank's micro-batch, / D, summed over micro-batches and
  averaged over ranks (objectives.reference_entropy_term), not the policy loss's normaliser.
- Gradient: clip to `optim.grad_clip=1.0` and skip the update when the pre-clip norm exceeds
  `optim.skip_grad_norm=500` or is not finite (code only).
- KL: off (`loss.kl_coef=0`), as in the script; the paper does not mention one.
- Training length: `total_steps=700` (paper) where the script runs 701.
- Delayed start: `replay.start_solve_rate=0.35` on the batch solve rate, one-way (both); 0 starts at once (the
  Llama setting the paper describes but the repository does not hold). Before the start the code stores no answer
  and moves no bucket (`replay.store_before_start=False`; the batch that starts replay is the first one stored);
  True fills the buffer from step 0. Retirement applies from step 0 either way.
- A stored answer's pi_past: `replay.behaviour_logprobs="trainer"` (code: the trainer's recomputed old log-probs of
  the batch it was born in) or `"sampler"` (the sampler's, as the paper's "log-probs of the policy that generated
  it"). At paper scale (bfloat16 decoding) the two differ by the sampler/trainer mismatch; both are stored in
  float16.
- Answer selection: the lowest mean per-token entropy under the current policy among the question's stored answers.
  The released selection masks the padding instead of the answer and takes the mask from the wrong row; we do it
  right (there is no switch for the bug).
- Missing recorded log-probs: the released code silently falls back to the current policy (ratio 1); here it is an
  error.

Multi-host (P processes): each host keeps its own buffer over its own questions and replays floor(rho B / P) of its
B / P questions a step, so a step replays P x floor(rho B / P) questions (equal to rho B when P divides it); the
delayed start is decided on the global batch solve rate, for all hosts at once (jaxrlvr/multihost.py).
"""
from configs import base
from jaxrlvr import config_lib


def get_config(arg: str | None = None):
  args = config_lib.parse_arg(arg, model="tiny", smoke=False)
  config = base.get_base_config(args)
  config.method = "exgrpo"
  config.replay.name = "exgrpo"
  config.replay.rho = 0.5  # share of each batch's questions drawn from the buffer
  config.replay.bucket_sigma = 1.0
  config.replay.bucket_scale = "count"
  config.replay.start_solve_rate = 0.35  # replay turns on (for good) once the batch solve rate exceeds this
  config.replay.store_before_start = False  # released code: nothing stored before replay turns on
  config.replay.behaviour_logprobs = "trainer"  # pi_past of a stored answer: the trainer's recomputed log-probs
  config.replay.max_tokens = 0  # memory cap in stored tokens; 0: none
  config.loss.shaping_beta = 0.1  # f(w) = w / (w + beta) on replayed tokens (ExGRPO's alone; other methods clip)
  if args.smoke:
    # Replay from the first step: a run whose answers are right (tests/test_train_replay.py's coin) replays at once.
    # The smoke model itself, at random initialisation, solves none, so its buffer stays empty.
    config.replay.start_solve_rate = 0.0
  return config_lib.finalize(config)
