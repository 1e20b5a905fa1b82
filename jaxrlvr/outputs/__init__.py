"""What a run writes into its workdir, and reading it back.

- `writer.py`: `MetricWriter`, the loop's one writer: DIR/metrics.jsonl, TensorBoard events, the progress bar, and at
  every evaluation a log line, DIR/summary.png and DIR/samples.jsonl.
- `records.py`: a run's files read back (`load_run`, `RunData`), DIR/questions.jsonl written (`append_questions`)
  and the figures computed from it (revisits, groups with signal, replay concentration); the interval over seeds.
- `summary.py`: DIR/summary.png drawn (matplotlib, imported only where it is drawn).

The comparison (jaxrlvr/compare) reads runs through this package; the loop imports nothing of the comparison.
"""
from jaxrlvr.outputs.records import (ACCURACY_KEY, QUESTIONS_FILE, SFT_FILE, STEP_TIME_KEY, TOKENS_KEY, MechanismStats,
                                     RunData, VisitStats, append_questions, confidence_interval, cumulative_tokens,
                                     load_run, mechanism_stats, read_rows, smooth, visit_stats)
from jaxrlvr.outputs.writer import SAMPLES_FILE, SUMMARY_FILE, MetricWriter, eval_line, read_jsonl, to_python
