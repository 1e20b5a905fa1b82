"""jaxrlvr's GRPO step against TRL's GRPOTrainer on the same workload, interleaved, in one command.

    pip install -e '.[peers]'       # TRL at the locked version
    python benchmarks/peer_grpo.py [--model=smollm2-135m] [--steps=6] [--eval_size=0] [--trl_threads=2] \
        [--trl_bf16=False] [--trl_gradient_checkpointing=False]

The workload is the model preset's GRPO config (smollm2-135m: 4 questions x 4 samples, at most 64 new tokens,
temperature 1.0, AdamW at 1e-5 after clipping the gradient norm at 1, the Dr.GRPO loss with clip 0.2, no KL, one
optimizer step a batch), run by both systems:
  1. Same weights: jaxrlvr builds the policy (smollm2-135m: the GGUF file dequantised to float32) and exports it
     (`export.export_hf`); TRL loads that directory.
  2. Same model: both compute the logits of a few training prompts first; a system whose logits differ from
     jaxrlvr's by more than --parity_tol (1e-4) of the largest logit is reported and not timed (a peer that computes
     another model measures nothing). The "parity" column is that relative difference.
  3. Same prompts: the questions jaxrlvr's run draws, in its order, are TRL's dataset (not shuffled), with the same
     chat-templated text; the prompt token ids of both are checked equal, and the questions of every step too.
  4. Same reward: both score with jaxrlvr's reward pool of the config (literal numbers for smollm2-135m).
  5. Interleaved: each system runs in its own process (its own thread setting) and takes one step when told:
     jaxrlvr, TRL, jaxrlvr, TRL ... Each step reports its seconds split into generation, reward, scoring (a
     separate pass for old log-probs; neither runs one at one optimizer step a batch) and the rest (the update),
     its generated tokens and the process's peak RSS. For jaxrlvr, the update's FLOPs at the batch's shapes (counted
     as benchmarks/update_split.py counts them) as a rate and as a share of a 2048^2 float32 matmul in its process.
  6. With --eval_size > 0, both answer that many held-out questions greedily before the first step and after the
     last, scored by jaxrlvr's evaluator (`evaluate.evaluate_with_samples`, the run's reward) with a 95% interval.
  7. Same arithmetic: TRL computes in float32 without activation checkpointing, as jaxrlvr's preset does
     (`model.compute_dtype="float32"`, `model.remat=False`). TRL's own defaults differ: bf16 autocast and gradient
     checkpointing (GRPOConfig), which --trl_bf16 and --trl_gradient_checkpointing turn back on; the output states
     which ran. On a CPU without bfloat16 matmul kernels (AVX2 only) TRL's bf16 autocast falls back to a slow
     reference matmul: its step took ~350 s there against ~30 s in float32.
jaxrlvr's first step: its trainer compiles the first update in a background thread from its construction on
(jaxrlvr/compile_ahead.py), and here that overlaps the parity check and TRL's start-up too, so the "first s" column
can show less than a run's own first step; the main command's is measured in docs/benchmarks.md.
Differences that remain, listed in the output: the sampling random numbers, and the weight decay of the
normalisation weights (the HF Trainer exempts them, optax's adamw does not; 1e-7 a step at lr 1e-5, decay 0.01).
"""
import argparse
import collections
import contextlib
import importlib.util
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import workers  # pylint: disable=g-import-not-at-top,wrong-import-position  (this directory: benchmarks/workers.py)

SYSTEMS = ("jaxrlvr", "trl")
_PHASES = ("generation", "reward", "scoring", "update")


def load_config(model: str, steps: int, eval_size: int):
  from configs import grpo  # pylint: disable=g-import-not-at-top
  config = grpo.get_config(f"model={model}" if model != "tiny" else "smoke")
  with config.unlocked():
    config.total_steps = steps
    config.data.eval_size = max(eval_size, 1)
    config.eval.k = 1
    if os.environ.get("JAXRLVR_WARM_START_CACHE"):
      config.warm_start.cache_dir = os.environ["JAXRLVR_WARM_START_CACHE"]
  return config


def _peak_rss_gb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _timed(times: dict, key: str, fn, when=lambda: True):
  """`fn`, adding the seconds of each call (for which `when()` holds) to times[key]."""
  def wrapper(*args, **kwargs):
    if not when():
      return fn(*args, **kwargs)
    t = time.perf_counter()
    try:
      return fn(*args, **kwargs)
    finally:
      times[key] = times.get(key, 0.0) + time.perf_counter() - t
  return wrapper


def _commands(reply):
  """The protocol of a worker: one command a line on stdin ("step", "eval", "quit"); one JSON line back each."""
  for line in sys.stdin:
    command = line.strip()
    if command == "quit":
      reply({"quit": True})
      return
    yield command


# ------------------------------------------------------------------------------------------------------ jaxrlvr
def jaxrlvr_worker(spec: dict, reply) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  from jaxrlvr import checkpointing, main as main_lib, run_setup, train  # pylint: disable=g-import-not-at-top

  config = load_config(spec["model"], spec["steps"], spec["eval_size"])
  main_lib.use_compilation_cache(config.get("compilation_cache_dir", ""))
  config, mesh = run_setup.prepare(config)
  workdir = spec["workdir"] + "/jaxrlvr"
  trainer = train.Trainer(config, workdir, mesh, checkpointing.Checkpointer(workdir, keep=1))
  trainer.open_writer(0)
  times = {}
  # The update's FLOPs at the batch's shapes, counted as update_split.py does (this script's directory is on
  # sys.path, the workers' too), and this process's matmul throughput, taken after each step, while the other
  # system's worker waits for its turn (at start-up both load their models at once).
  import update_split  # pylint: disable=g-import-not-at-top
  shapes = trainer.shapes

  def update_flops(packed_share: float) -> float:
    """Forward and backward FLOPs of the update as it ran: each prompt once a group, and the answers packed into
    `packed_share` of the rows where they were (train.pack_completions)."""
    packed = None
    if packed_share < 1:
      packed = (round(packed_share * shapes.host_rows), config.train.pack_max_prompts)
    body, head = update_split.forward_flops(run_setup.model_config(config), trainer.state.params, shapes.host_rows,
                                            shapes.prompt_len + shapes.completion_len, shapes.completion_len,
                                            trainer.prompt_group, packed)
    return 3 * (body + head)

  flops = {"matmul_flops_per_s": 0.0}

  trainer.reward_pool.score = _timed(times, "reward", trainer.reward_pool.score)
  trainer._score = _timed(times, "scoring", trainer._score)  # pylint: disable=protected-access
  if trainer._score_shared is not None:  # pylint: disable=protected-access
    trainer._score_shared = _timed(times, "scoring", trainer._score_shared)  # pylint: disable=protected-access
  rng = jax.random.key(config.seed)
  step = 0
  for command in _commands(reply):
    if command == "eval":
      metrics = trainer.evaluate(step)
      reply({"accuracy": metrics["eval/accuracy"], "questions": len(trainer.data.eval_examples)})
      continue
    times.clear()
    t = time.perf_counter()
    plan = trainer.plan(step)
    rng, key = jax.random.split(rng)
    t_sample = time.perf_counter()
    sampled, info = trainer.sample(plan, step, key)
    sample_s = time.perf_counter() - t_sample
    groups = trainer.compose(plan, sampled, step)
    trainer.update(plan, sampled, groups, info, collections.Counter())
    step_s = time.perf_counter() - t
    flops["packed_rows"] = info["update/packed_rows"]
    flops["update_flops"] = update_flops(info["update/packed_rows"])
    step += 1
    reward_s, scoring_s = times.get("reward", 0.0), times.get("scoring", 0.0)
    flops["matmul_flops_per_s"] = max(flops["matmul_flops_per_s"], update_split.matmul_peak())
    reply({"step_s": step_s, "generation": sample_s - reward_s, "reward": reward_s, "scoring": scoring_s,
           "update": step_s - sample_s - scoring_s, "tokens": sum(len(r.tokens) for g in sampled for r in g.rollouts),
           "qids": sorted(r.qid for r in plan.requests), "rss_gb": _peak_rss_gb(), **flops})


# ---------------------------------------------------------------------------------------------------------- TRL
def trl_worker(spec: dict, reply) -> None:
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  import trl  # pylint: disable=g-import-not-at-top
  import datasets  # pylint: disable=g-import-not-at-top
  from jaxrlvr import data as data_lib  # pylint: disable=g-import-not-at-top
  from jaxrlvr import evaluate as evaluate_lib, rewards, run_setup  # pylint: disable=g-import-not-at-top
  from jaxrlvr.compare import hf_check  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(spec["trl_threads"])
  config = load_config(spec["model"], spec["steps"], spec["eval_size"])
  data = run_setup.load_data(config, check_prompts=False)
  tokenizer = data_lib.load_tokenizer(spec["hf_dir"])  # as jaxrlvr loads an export (AutoTokenizer may not)
  model = transformers.AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32)
  pool = rewards.MathRewardPool.from_config(config)
  times, tokens = {}, []

  def reward(completions, answer, completion_ids, **kwargs):
    del kwargs
    tokens.extend(len(c) for c in completion_ids)
    return [float(x) for x in _timed(times, "reward", pool.score)(completions, answer)[0]]

  rows = [{"prompt": p, "answer": a, "qid": q} for p, a, q in zip(spec["prompts"], spec["answers"], spec["qids"])]
  o, loss, r = config.optim, config.loss, config.rollout
  args = trl.GRPOConfig(
      output_dir=spec["workdir"] + "/trl", max_steps=spec["steps"],
      per_device_train_batch_size=r.batch_size * r.group_size, gradient_accumulation_steps=1, num_generations=r.group_size, max_completion_length=r.max_new_tokens,
      temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, loss_type="dr_grpo", beta=0.0, scale_rewards="none",
      epsilon=loss.clip_low, epsilon_high=loss.clip_high, num_iterations=1, learning_rate=o.lr, adam_beta1=o.b1,
      adam_beta2=o.b2, weight_decay=o.weight_decay, max_grad_norm=o.grad_clip, warmup_steps=o.warmup_steps,
      lr_scheduler_type="constant" if o.schedule == "constant" else o.schedule, shuffle_dataset=False, seed=config.seed,
      logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
      bf16=spec["trl_bf16"], gradient_checkpointing=spec["trl_gradient_checkpointing"])
  trainer = trl.GRPOTrainer(model=model, args=args, reward_funcs=reward, processing_class=tokenizer,
                            train_dataset=datasets.Dataset.from_list(rows))
  model.generate = _timed(times, "generation", model.generate)
  # A separate scoring pass runs without gradients; the update's own forward pass does not count as one.
  trainer._get_per_token_logps_and_entropies = _timed(  # pylint: disable=protected-access
      times, "scoring", trainer._get_per_token_logps_and_entropies,  # pylint: disable=protected-access
      when=lambda: not torch.is_grad_enabled())
  commands = _commands(reply)

  def evaluate():
    def generate_fn(prompts, temperature, n):
      del temperature, n  # greedy only
      completions, lengths = hf_check.greedy_with_transformers(model, prompts, tokenizer,
                                                                max_new_tokens=r.max_new_tokens, batch=50)
      return completions, lengths
    metrics, _ = evaluate_lib.evaluate_with_samples(generate_fn, data.eval_examples, k=1,
                                                    template=config.tokenizer.template, tokenizer=tokenizer,
                                                    reward_fn=lambda c, a: pool.score(c, a)[0])
    model.train()
    reply({"accuracy": metrics["eval/accuracy"], "questions": len(data.eval_examples)})

  def next_step():
    """Answers commands until the next "step"; False once there is none."""
    for command in commands:
      if command == "step":
        return True
      evaluate()
    return False

  class Interleave(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
      if not next_step():
        raise RuntimeError("peer_grpo: the TRL worker was told to stop mid-run")
      times.clear()
      tokens.clear()
      self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
      step_s = time.perf_counter() - self.start
      split = {k: times.get(k, 0.0) for k in ("generation", "reward", "scoring")}
      reply({"step_s": step_s, **split, "update": step_s - sum(split.values()), "tokens": sum(tokens),
             "qids": sorted(step_qids.pop(0)), "rss_gb": _peak_rss_gb()})

  # The questions of each step, in the order TRL's sampler serves them: B prompts a step, each K times.
  step_qids = [spec["qids"][i * r.batch_size:(i + 1) * r.batch_size] for i in range(spec["steps"])]
  trainer.add_callback(Interleave())
  trainer.train()
  for _ in commands:
    evaluate()


# ------------------------------------------------------------------------------------------------------- driver
def prepare(flags, workdir: str) -> dict:
  """Exports the starting weights, checks both systems compute the same model, and writes the workers' spec."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from jaxrlvr import data as data_lib, export, run_setup  # pylint: disable=g-import-not-at-top

  config = load_config(flags.model, flags.steps, flags.eval_size)
  config, mesh = run_setup.prepare(config)
  data = run_setup.load_data(config)
  model, model_config = run_setup.build_policy(config, mesh, data.book)
  hf_dir = export.export_hf(model, model_config, data.tokenizer, os.path.join(workdir, "start"))
  questions = run_setup.question_iterator(config, data.train_set)
  qids = [q for _ in range(flags.steps) for q in questions.next(config.rollout.batch_size)]
  prompts = [data_lib.format_prompt(data.book.example(q), template=config.tokenizer.template,
                                    tokenizer=data.tokenizer) for q in qids]
  hf_tokenizer = data_lib.load_tokenizer(hf_dir)
  for q, p in zip(qids, prompts):
    if hf_tokenizer(p)["input_ids"] != data.book.prompt_ids(q):  # TRL tokenises its text prompts so
      raise SystemExit(f"peer_grpo: question {q}: TRL's tokenisation of its prompt differs from jaxrlvr's")

  hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  largest_diff = largest_logit = 0.0
  for q in qids[:4]:
    ids = np.asarray([data.book.prompt_ids(q)], np.int32)
    ours = np.asarray(jax.device_get(model(jax.numpy.asarray(ids), attention_mask=jax.numpy.ones_like(ids))))
    with torch.no_grad():
      theirs = hf_model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    largest_diff = max(largest_diff, float(np.max(np.abs(ours - theirs))))
    largest_logit = max(largest_logit, float(np.max(np.abs(ours))))
  # Relative to the largest logit: two float32 implementations of SmolLM2's 30 layers differ by ~1e-4 on logits
  # of ~20 by rounding alone, while a peer computing another model (Tunix 0.1.7 ignoring rope_theta) is off by ~6.
  parity = {"jaxrlvr": 0.0, "trl": largest_diff / max(largest_logit, 1.0)}
  return {"model": flags.model, "steps": flags.steps, "eval_size": flags.eval_size, "trl_threads": flags.trl_threads,
          "trl_bf16": flags.trl_bf16, "trl_gradient_checkpointing": flags.trl_gradient_checkpointing,
          "workdir": workdir, "hf_dir": hf_dir, "qids": qids, "prompts": prompts, "parity": parity,
          "answers": [data.book.example(q).answer for q in qids]}


class Worker:
  """One system's worker process: send a command, read its one JSON line back. A worker that dies raises
  workers.WorkerDied, naming it, its exit status and the likely cause (a TRL worker at the machine's memory limit
  is killed by the kernel with signal 9). `command` replaces the worker's command line (the tests' seam)."""

  def __init__(self, system: str, spec_path: str, log_path: str, command: list[str] | None = None):
    self.system = system
    self.log = open(log_path, "w", encoding="utf-8")
    command = command or [sys.executable, os.path.abspath(__file__), f"--worker={system}", f"--spec={spec_path}"]
    self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
    self.steps = 0  # answered

  def ask(self, command: str) -> dict:
    try:
      self.proc.stdin.write(command + "\n")
      self.proc.stdin.flush()
      line = self.proc.stdout.readline()
    except BrokenPipeError:  # it died before reading the command
      line = ""
    if not line:
      asked = f"step {self.steps + 1}" if command == "step" else repr(command)
      raise workers.died(f"{self.system} worker (asked for {asked})", self._exit_code(), self.log.name)
    self.steps += command == "step"
    return json.loads(line)

  def _exit_code(self) -> int | None:
    """The exit code of a worker whose output has ended (None if it is still running after a few seconds)."""
    try:
      return self.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      return None

  def close(self) -> None:
    if self.proc.poll() is None:
      with contextlib.suppress(workers.WorkerDied):
        self.ask("quit")
    with contextlib.suppress(OSError):  # unsent bytes for a dead worker: BrokenPipeError
      self.proc.stdin.close()
    try:
      self.proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()
    self.proc.stdout.close()
    self.log.close()


def interleave(peers: dict[str, Worker], steps: int, eval_size: int) -> tuple[dict, dict]:
  """Runs the workers' steps in turn (and their evaluations before and after, with `eval_size`), closing them at
  the end; returns (each system's step replies, its evaluations)."""
  results = {s: [] for s in SYSTEMS}
  evals = {}
  try:
    if eval_size:
      evals = {s: [w.ask("eval")] for s, w in peers.items()}
    for step in range(steps):
      for system, worker in peers.items():  # A, B, A, B ...: the machine's drift hits both alike
        results[system].append(worker.ask("step"))
        print(f"peer_grpo: step {step + 1} {system}: {results[system][-1]['step_s']:.2f} s", file=sys.stderr)
    qids = {s: [r["qids"] for r in results[s]] for s in peers}
    if len({json.dumps(v) for v in qids.values()}) > 1:
      raise SystemExit(f"peer_grpo: the systems trained on different questions: {qids}")
    if eval_size:
      for s, w in peers.items():
        evals[s].append(w.ask("eval"))
  finally:
    for worker in peers.values():
      worker.close()
  return results, evals


def _interval(p: float, n: int) -> float:
  return 1.96 * math.sqrt(max(p * (1 - p), 1e-12) / max(n, 1))


def report(spec: dict, results: dict, evals: dict) -> list[str]:
  arithmetic = "bf16 autocast" if spec["trl_bf16"] else "float32"
  checkpointing = "with" if spec["trl_gradient_checkpointing"] else "without"
  lines = [f"peer_grpo: {spec['model']}, {spec['steps']} steps, TRL with {spec['trl_threads']} torch threads, "
           f"{arithmetic}, {checkpointing} gradient checkpointing"]
  header = (f"{'system':<10}{'parity':>10}{'steady s':>10}{'first s':>9}" +
            "".join(f"{p:>12}" for p in _PHASES) + f"{'tok/s gen':>11}{'peak GB':>9}")
  lines.append(header)
  for system, steps in results.items():
    if not steps:
      lines.append(f"{system:<10}{spec['parity'][system]:>10.1e}  not timed: its logits differ from jaxrlvr's by "
                   f"more than the tolerance")
      continue
    steady = steps[1:] or steps
    median = lambda key: statistics.median(s[key] for s in steady)  # pylint: disable=cell-var-from-loop
    tok_s = sum(s["tokens"] for s in steady) / max(sum(s["generation"] for s in steady), 1e-9)
    lines.append(f"{system:<10}{spec['parity'][system]:>10.1e}{median('step_s'):>10.2f}{steps[0]['step_s']:>9.2f}" +
                 "".join(f"{median(p):>12.2f}" for p in _PHASES) + f"{tok_s:>11.1f}{steps[-1]['rss_gb']:>9.2f}")
  for system, steps in results.items():
    if steps and "update_flops" in steps[-1]:
      steady = steps[1:] or steps
      rate = statistics.median(s["update_flops"] / s["update"] for s in steady)
      work = statistics.median(s["update_flops"] for s in steady)
      peak = steps[-1]["matmul_flops_per_s"]
      lines.append(f"{system}'s update: {work / 1e9:.0f} GFLOP (median step) at {rate / 1e9:.0f} GFLOP/s, "
                   f"{rate / peak:.0%} of its process's 2048^2 float32 matmul ({peak / 1e9:.0f} GFLOP/s, the best "
                   "after any step)")
      shares = [s["packed_rows"] for s in steady]
      lines.append(f"{system}'s update rows after packing the answers (train.pack_completions): "
                   f"{statistics.mean(shares):.0%} of the batch's on average, {sum(x < 1 for x in shares)} of "
                   f"{len(shares)} steady steps packed")
  timed = [s for s in results if results[s]]
  if set(timed) >= {"jaxrlvr", "trl"}:
    ratio = (statistics.median(s["step_s"] for s in results["jaxrlvr"][1:] or results["jaxrlvr"]) /
             statistics.median(s["step_s"] for s in results["trl"][1:] or results["trl"]))
    lines.append(f"steady step jaxrlvr / trl: {ratio:.2f}")
  for system, (before, after) in evals.items():
    n = after["questions"]
    lines.append(f"{system}: held-out greedy accuracy {before['accuracy']:.3f} at step 0, {after['accuracy']:.3f} "
                 f"+- {_interval(after['accuracy'], n):.3f} after {spec['steps']} steps ({n} questions)")
  lines.append("tunix: not run by this harness (Tunix 0.1.7's llama attention ignores rope_theta, so on SmolLM2 it "
               "computes another model; its parity would fail)")
  import torch, transformers, trl, jax  # pylint: disable=g-import-not-at-top,multiple-imports
  lines.append(f"versions: jax {jax.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
               f"trl {trl.__version__}; steady = median of steps 2..N; phases are medians, so they need not sum")
  return lines


@workers.one_line_on_death("peer_grpo")
def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="smollm2-135m", help="model preset: smollm2-135m, or tiny (a smoke size)")
  parser.add_argument("--steps", type=int, default=6, help="RL steps of each system; the first is reported apart")
  parser.add_argument("--eval_size", type=int, default=0, help="held-out questions answered before and after")
  parser.add_argument("--trl_threads", type=int, default=os.cpu_count() or 1, help="torch threads of TRL's process")
  parser.add_argument("--parity_tol", type=float, default=1e-4,
                      help="largest logit difference, over the largest logit, for a peer to be timed")
  flag = lambda text: text.lower() in ("1", "true", "yes")
  parser.add_argument("--trl_bf16", type=flag, default=False,
                      help="TRL under bf16 autocast (its GRPOConfig default); default: float32, as jaxrlvr computes")
  parser.add_argument("--trl_gradient_checkpointing", type=flag, default=False,
                      help="TRL with gradient checkpointing (its GRPOConfig default); default: off, as jaxrlvr's preset")
  parser.add_argument("--workdir", default="", help="where the export and the workers' logs go (default: a temp dir)")
  parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
  parser.add_argument("--spec", help=argparse.SUPPRESS)
  flags = parser.parse_args()
  if flags.worker:
    with open(flags.spec, encoding="utf-8") as f:
      spec = json.load(f)
    from jaxrlvr import xla_cpu  # pylint: disable=g-import-not-at-top
    # Both workers as the main job runs (before JAX or torch start): freed memory stays in the process. Measured
    # alone on SmolLM2, TRL's step gains slightly from it too (11.5 s against 12.1 s), so each gets its better one.
    xla_cpu.setup_process()
    out = os.fdopen(os.dup(1), "w")  # the protocol's channel; the libraries' prints go to the log
    os.dup2(2, 1)
    reply = lambda message: (out.write(json.dumps(message) + "\n"), out.flush())
    (jaxrlvr_worker if flags.worker == "jaxrlvr" else trl_worker)(spec, reply)
    return 0
  if flags.steps < 2:
    parser.error("--steps must be at least 2: the first step is reported apart from the steady ones")
  if importlib.util.find_spec("trl") is None:
    print("peer_grpo: TRL is not installed: pip install -e '.[peers]'", file=sys.stderr)
    return 2
  workdir = flags.workdir or tempfile.mkdtemp(prefix="peer_grpo-")
  os.makedirs(workdir, exist_ok=True)
  spec = prepare(flags, workdir)
  spec_path = os.path.join(workdir, "spec.json")
  with open(spec_path, "w", encoding="utf-8") as f:
    json.dump(spec, f)
  systems = [s for s in SYSTEMS if spec["parity"][s] <= flags.parity_tol]
  results, evals = interleave({s: Worker(s, spec_path, os.path.join(workdir, f"{s}.log")) for s in systems},
                              flags.steps, flags.eval_size)
  print("\n".join(report(spec, results, evals)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
