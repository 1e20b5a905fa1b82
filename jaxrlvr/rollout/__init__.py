"""The rollout path: questions in, sampled and rewarded groups and the update batch out.

- `groups.py`: the loop's side. Prompts are formatted and tokenised once per question (`PromptBook`), the sampler
  runs on them (`sample_groups`; `prepare_sampling` compiles a call ahead), completions are decoded and rewarded,
  and the final groups become the padded, fixed-shape update batch (`build_batch`).
- `sampler.py`: `generate`, the one entry to sampling (`prepare` compiles what a call runs, ahead), and the static
  KV-cache sampler (a jitted prefill, then a jitted decode loop over a preallocated cache).
- `rollout/engine.py` (device) and `scheduler.py` (host): the continuous rollout engine (`rollout.engine="continuous"`),
  whose decode slots rows leave as they stop and queued rows enter.
- `decode.py`: the token draw both samplers share (temperature, top-k, top-p by inverse CDF) and `SampleOutput`.
- `bounded.py`: bounded memory, the prompts cut into sampler calls of a fixed shape; the prompt length buckets.
- `lowering.py`: a sampler call's phases compiled on abstract inputs, for the memory planner's XLA figures.
"""
from jaxrlvr.rollout.bounded import BATCH_AXES, MEMORY_LIMITS, bucket_length
from jaxrlvr.rollout.decode import SampleOutput, sample_logits
from jaxrlvr.rollout.groups import (PromptBook, SamplerSettings, ScoreAsRowsFinish, answer_entropy_batch, build_batch,
                                    decode, mean_entropies, pack_rows, prompts_shared,
                                    prepare_sampling, record_logprobs, sample_groups)
from jaxrlvr.rollout.lowering import lower_sampler_phases
from jaxrlvr.rollout.sampler import ENGINE_SETTINGS, ENGINES, generate, prepare
from jaxrlvr.rollout.scheduler import DECODE_WEIGHTS
