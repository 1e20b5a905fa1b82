"""What the samplers' multi-host tests share: `rollout.generate` in 2 CPU processes of 4 devices each.

Each process builds the same random model from a ModelConfig, makes it a global array replicated over the 8-device
mesh (data=4, tensor=2, so 2 batch shards a process), and samples its own prompts with the given keyword arguments.
"""
import dataclasses
import json
import socket
import subprocess
import sys

import light_compile

_WORKER = r"""
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=sys.argv[2], num_processes=2, process_id=int(sys.argv[1]))
from flax import nnx
import numpy as np
from jaxrlvr import parallel, rollout
from jaxrlvr.models import ModelConfig, Transformer
mesh = parallel.make_mesh(data=4, fsdp=1, tensor=2)  # 8 devices, 4 per process
graphdef, state = nnx.split(Transformer(ModelConfig(**json.loads(sys.argv[4])), rngs=nnx.Rngs(0)))
replicated = parallel.replicated(mesh)  # the same weights in every process: global arrays from the local copies
state = jax.tree.map(lambda x: jax.make_array_from_process_local_data(replicated, np.asarray(x)), state)
model = nnx.merge(graphdef, state)
out = rollout.generate(model, json.loads(sys.argv[3]), rng=jax.random.key(0), mesh=mesh, **json.loads(sys.argv[5]))
print("TOKENS", json.dumps(out.tokens.tolist()))
"""


def sample_in_two_processes(tmp_path, config, prompts: list[list[list[int]]], **generate_kwargs) -> list[list]:
  """The tokens each of the two processes gets back for its own prompts (prompts[i]: process i's)."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    address = f"localhost:{s.getsockname()[1]}"
  script = tmp_path / "worker.py"
  script.write_text(_WORKER)
  # Compiled light (tests/light_compile.py): a few sampler calls of a tiny model are mostly compiling.
  env = light_compile.job_env(4)
  args = [json.dumps(dataclasses.asdict(config)), json.dumps(generate_kwargs)]
  procs = [subprocess.Popen([sys.executable, str(script), str(i), address, json.dumps(prompts[i]), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (_, stderr) in zip(procs, outs):
    assert p.returncode == 0, stderr[-3000:]
  return [json.loads(next(l for l in stdout.splitlines() if l.startswith("TOKENS"))[7:]) for stdout, _ in outs]
