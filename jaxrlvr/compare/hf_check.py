"""The run's export, evaluated by transformers: does DIR/hf answer the held-out questions as the run said it does?

    python -m jaxrlvr.compare.hf_check --workdir=DIR [--hf=DIR/hf] [--batch=50]

Reads DIR/config.json for the held-out set, the prompt template and the reward settings, loads the export with
`transformers.AutoModelForCausalLM` (float32, PyTorch), answers every evaluated question greedily with transformers'
own `generate` (stopping at the export's generation_config eos ids, as the run's sampler did, and at most
`rollout.max_new_tokens` tokens), scores the answers with the run's reward and prints the accuracy, per
`data_source`, the share with a `\\boxed{}` and the mean length, beside the last `eval/*` figures in DIR/metrics.jsonl.
The two should agree up to the few questions where float32 rounding differs between the two libraries and flips a
greedy token; `tests/test_smollm2.py` checks it on a short run.
"""
import argparse
import collections
import json
import os
import sys

import numpy as np

from jaxrlvr import config_lib
from jaxrlvr import data as data_lib
from jaxrlvr import export
from jaxrlvr import rewards


def last_eval(workdir: str) -> tuple[int | None, dict[str, float]]:
  """(step, the eval/* metrics) of the last evaluation logged in DIR/metrics.jsonl; (None, {}) without one."""
  path = os.path.join(workdir, "metrics.jsonl")
  step, found = None, {}
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      for line in f:
        record = json.loads(line)
        evals = {k: v for k, v in record.items() if k.startswith("eval/")}
        if evals:
          step, found = record.get("step"), evals
  return step, found


def generate_with_transformers(hf_dir: str, prompts: list[str], tokenizer, *, max_new_tokens: int,
                               batch: int) -> tuple[list[str], list[int]]:
  """Greedy completions (text up to and including the stop, special tokens dropped) and their token counts."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
  return greedy_with_transformers(model, prompts, tokenizer, max_new_tokens=max_new_tokens, batch=batch)


def greedy_with_transformers(model, prompts: list[str], tokenizer, *, max_new_tokens: int,
                             batch: int) -> tuple[list[str], list[int]]:
  """`generate_with_transformers` with a loaded transformers model (put in eval mode)."""
  import torch  # pylint: disable=g-import-not-at-top

  model.eval()
  stops = model.generation_config.eos_token_id
  stops = set([stops] if isinstance(stops, int) else (stops or []))
  pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
  completions, lengths = [], []
  for start in range(0, len(prompts), batch):
    ids = tokenizer(prompts[start:start + batch], add_special_tokens=False)["input_ids"]
    width = max(len(p) for p in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)  # left-padded, as the run's sampler pads
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, p in enumerate(ids):
      input_ids[row, width - len(p):] = torch.tensor(p)
      mask[row, width - len(p):] = 1
    with torch.no_grad():
      out = model.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                           pad_token_id=pad_id)
    for row in out[:, width:].tolist():
      n = next((i + 1 for i, token in enumerate(row) if token in stops), len(row))
      completions.append(tokenizer.decode(row[:n], skip_special_tokens=True))
      lengths.append(n)
  return completions, lengths


def check(workdir: str, hf_dir: str | None = None, *, batch: int = 50) -> dict[str, float]:
  """The metrics of the module docstring for transformers' answers, named as the run names them (eval/...)."""
  config = export.read_run_config(workdir)
  hf_dir = hf_dir or os.path.join(workdir, export.FINAL_DIR)
  if not os.path.isfile(os.path.join(hf_dir, "config.json")):
    raise export.ExportError(f"--hf={hf_dir} has no config.json: export the run first (python -m jaxrlvr.export "
                             f"--workdir={workdir})")
  tokenizer = data_lib.load_tokenizer(hf_dir)
  _, eval_set = data_lib.sources_from_config(config)
  examples = [eval_set[q] for q in range(min(len(eval_set), config.data.eval_size or len(eval_set)))]
  prompts = [data_lib.format_prompt(e, template=config.tokenizer.template, tokenizer=tokenizer) for e in examples]
  completions, lengths = generate_with_transformers(hf_dir, prompts, tokenizer,
                                                    max_new_tokens=config.rollout.max_new_tokens, batch=batch)
  with rewards.MathRewardPool.from_config(config) as pool:
    correct, _ = pool.score(completions, [e.answer for e in examples])
  metrics = {"eval/accuracy": float(np.mean(correct)), "eval/boxed": float(np.mean(["\\boxed{" in c
                                                                                     for c in completions])),
             "eval/response_length": float(np.mean(lengths))}
  by_source = collections.defaultdict(list)
  for example, verdict in zip(examples, correct):
    by_source[example.data_source].append(verdict)
  for source, verdicts in sorted(by_source.items()):
    metrics[f"eval/{source}/accuracy"] = float(np.mean(verdicts))
  return metrics


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxrlvr.compare.hf_check", description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="the run directory (python -m jaxrlvr.main --workdir)")
  parser.add_argument("--hf", default=None, help="the export to check (default: WORKDIR/hf)")
  parser.add_argument("--batch", type=int, default=50, help="questions per transformers generate call")
  args = parser.parse_args(argv)
  try:
    ours = check(args.workdir, args.hf, batch=args.batch)
  except config_lib.ConfigError as e:
    print(f"jaxrlvr.compare.hf_check: {e}", file=sys.stderr)
    return 2
  step, logged = last_eval(args.workdir)
  print(f"{'metric':<32}{'transformers':>14}{f'run (step {step})':>18}")
  for key, value in ours.items():
    run_value = logged.get(key)
    print(f"{key:<32}{value:14.3f}{'-' if run_value is None else f'{run_value:.3f}':>18}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
