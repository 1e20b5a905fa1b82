"""The memory planner: the per-device bytes of one RL step at a real model size, without allocating anything.

    python -m jaxrlvr.plan --config=configs/exgrpo.py:model=qwen2.5-math-7b --mesh=1,8,1 [--xla]

- `shapes.py`: the sizes: the accelerators, a step's workload on a mesh, each parameter's per-device shape.
- `memory.py`: the arithmetic: resident state and the footprint of each compiled phase (update, scoring pass, a
  sampler call's prefill and decode), and whether it fits an accelerator; `replay_host.py`: the host replay buffer.
- `xla.py`: the same phases compiled with abstract inputs on local devices, for XLA's own figures (`--xla`).
- `report.py`: the printed plan and the command line.
The rows, shapes and sampler bounds it plans for are those a run derives from the config (jaxrlvr/run_setup.py).
"""
from jaxrlvr.plan.memory import (CPU_COMPILE_ONLY_FLAGS, CPU_MEMORY_FLAGS, PHASE_FUNCTIONS, USABLE_FRACTION, fits,
                                 phase_terms, plan_memory)
from jaxrlvr.plan.replay_host import replay_estimate
from jaxrlvr.plan.report import format_plan, format_xla, parse_mesh, plans_by_backend
from jaxrlvr.plan.shapes import (ACCELERATORS, BACKENDS, GB, Accelerator, Workload, param_table, shard_shape, spec_mesh,
                                 workload)
