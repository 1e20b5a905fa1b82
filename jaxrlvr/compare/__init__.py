"""The method comparison: every arm x seed trained at an equal rollout budget, then the tables and figures.

    python -m jaxrlvr.compare --preset=paper_shaped --outdir=DIR

- `runner.py`: the command line; runs the main job (and the control) per arm and seed as subprocesses, resumes
  killed runs, then writes DIR/results.md, results.csv, runs.csv and the plots.
- `arms.py`: what a comparison runs: the regimes (`PRESETS`) and the arms (`ARMS`: a method config and overrides).
- `stats.py`: the paired differences to the baseline with 95% intervals, the mechanism figures, results.md.
- `plots.py`: the comparison's figures.
- `sft_control.py`: the supervised control arm (`python -m jaxrlvr.compare.sft_control`).
- `calibrate.py`: a testbed's calibration figures from a comparison's GRPO runs (the gain, the step-0 accuracy on the
  in-between levels, the first-visit groups all right or all wrong; `python -m jaxrlvr.compare.calibrate --outdir=DIR`).
- `hf_check.py`: a finished run's export re-scored by transformers' own `generate`
  (`python -m jaxrlvr.compare.hf_check --workdir=DIR`).
A run's own files are read through `jaxrlvr.outputs`.
"""
from jaxrlvr.compare.arms import (ARMS, BASELINE, METHODS, PRESETS, Arm, CompareError, Preset, apply_override,
                                  arm_config, config_arg, method_config, resolve_arm, resolve_arms)
from jaxrlvr.compare.runner import (RunSpec, check_workdir, finished_step, make_specs, run_all, run_env, run_one,
                                    sft_command, train_command)
from jaxrlvr.compare.stats import (Summary, area_under_curve, budget_step, holm, paired_t, reading, summarize,
                                   write_results)
