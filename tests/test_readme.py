"""Every fenced shell command of README.md and docs/*.md goes through its parser, so they cannot drift from the code
(docs/pods.md is left out: it documents the pods' topology compiles, whose flags and extra are checked with them).

Nothing is run: for `python -m jaxrlvr.<module>` and `python benchmarks/X.py` the flags must be ones the module
defines (absl's `DEFINE_*` or argparse's `add_argument`, read from its source), `--config=FILE[:arg]` must load, and
every `--config.a.b=value` must name a key of that config and convert to its type; a comparison's preset and arms
must exist. `pip install` lines name files and extras that exist; launchers exist, and the command they launch is
checked the same way. A README command of any other form fails the test, so a new kind is added here on purpose.
The configs' import of jaxrlvr.models (jax, flax) is the only cost: a few seconds, no compile.
"""
import ast
import importlib
import os
import re
import shlex
import sys

import pytest

from test_benchmarks import _REPO

_README = os.path.join(_REPO, "README.md")
_DOCS = sorted(os.path.join(_REPO, "docs", name) for name in os.listdir(os.path.join(_REPO, "docs"))
               if name.endswith(".md") and name != "pods.md")
# The module a `python -m` command runs, and the source files whose flags it parses.
_MODULE_SOURCES = {
    "jaxrlvr.main": ["jaxrlvr/main.py"],
    "jaxrlvr.compare": ["jaxrlvr/compare/runner.py", "jaxrlvr/compare/__main__.py"],
    "jaxrlvr.compare.hf_check": ["jaxrlvr/compare/hf_check.py"],
    "jaxrlvr.compare.calibrate": ["jaxrlvr/compare/calibrate.py"],
    "jaxrlvr.compare.sft_control": ["jaxrlvr/compare/sft_control.py"],
    "jaxrlvr.plan": ["jaxrlvr/plan/report.py", "jaxrlvr/plan/__main__.py"],
    "jaxrlvr.export": ["jaxrlvr/export.py"],
    "jaxrlvr.models.convert": ["jaxrlvr/models/convert.py"],
}
_ABSL_BUILTIN = {"help", "helpfull", "helpshort", "helpxml", "flagfile", "undefok", "verbosity", "v", "logtostderr",
                 "alsologtostderr", "log_dir", "stderrthreshold", "showprefixforinfo"}
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


def readme_commands(path: str = _README) -> list[str]:
  """The commands of the file's ```bash / ```sh / ```shell blocks, one a line, continuation lines joined."""
  text = open(path).read()
  commands = []
  for block in re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", text, flags=re.M | re.S):
    for line in block.replace("\\\n", " ").splitlines():
      if shlex.split(line, comments=True):
        commands.append(line.strip())
  return commands


def _defined_flags(sources: list[str]) -> set[str]:
  """Flag names the files define, by absl's DEFINE_* or argparse's add_argument, and those of the sibling modules
  they import (benchmarks/sampler.py adds sampler_long_tail's)."""
  names = set()
  for source in sources:
    path = os.path.join(_REPO, source)
    if not os.path.exists(path):
      continue
    text = open(path).read()
    names |= set(re.findall(r"DEFINE_\w+\(\s*[\"'](\w+)[\"']", text))
    names |= set(re.findall(r"add_argument\(\s*[\"']--([\w-]+)[\"']", text))
    for sibling in re.findall(r"^import (\w+)$", text, flags=re.M):
      if os.path.exists(os.path.join(os.path.dirname(path), f"{sibling}.py")):
        names |= _defined_flags([os.path.join(os.path.dirname(source), f"{sibling}.py")])
  return names


def _options(args: list[str]) -> list[tuple[str, str | None]]:
  """(--name, value or None) in order; a bare token is the value of the option before it (`--repeats 5`)."""
  options = []
  for arg in args:
    if arg == "...":  # a placeholder for the rest of a command
      continue
    if arg.startswith("-"):
      name, sep, value = arg.partition("=")
      options.append((name, value if sep else None))
    else:
      assert options and options[-1][1] is None, f"a positional argument {arg!r} where none is taken"
      options[-1] = (options[-1][0], arg)
  return options


def load_config(spec: str):
  """`configs/exgrpo.py:model=smollm2-135m` loaded as `--config` loads it (its config arg after the colon)."""
  path, _, arg = spec.partition(":")
  assert os.path.exists(os.path.join(_REPO, path)), f"no config file {path}"
  if _REPO not in sys.path:  # the config files import `configs.base`, as from the repository root
    sys.path.insert(0, _REPO)
  module = importlib.import_module(path[:-len(".py")].replace("/", "."))
  return module.get_config(arg or None)


def check_override(config, key: str, value: str) -> None:
  """`--config.KEY=VALUE`: KEY names a leaf of the locked config, and VALUE converts to its type."""
  node = config
  for part in key.split("."):
    assert hasattr(node, "keys") and part in node.keys(), f"--config.{key}: no key {part!r} in the config"
    node = node[part]
  if isinstance(node, bool):
    assert value.lower() in ("true", "false", "1", "0"), f"--config.{key}={value}: not a bool"
  elif isinstance(node, (int, float)):
    type(node)(float(value) if isinstance(node, float) else int(value))
  elif isinstance(node, (tuple, list)):
    assert isinstance(ast.literal_eval(value), (tuple, list)), f"--config.{key}={value}: not a sequence"


def _check_python(args: list[str]) -> None:
  if args[:2] == ["-m", "pytest"]:
    markers = open(os.path.join(_REPO, "pytest.ini")).read()
    for name, value in _options(args[2:]):
      if name == "-m":
        for marker in re.findall(r"\w+", value.replace("not", " ")):
          assert re.search(rf"^\s+{marker}:", markers, flags=re.M), f"no pytest marker {marker!r}"
    return
  if args[0] == "-m":
    module, rest = args[1], args[2:]
    assert module in _MODULE_SOURCES, f"python -m {module}: add its sources to _MODULE_SOURCES"
    sources = _MODULE_SOURCES[module]
  else:
    script, rest = args[0], args[1:]
    assert script.startswith("benchmarks/") and os.path.exists(os.path.join(_REPO, script)), f"no script {script}"
    module, sources = script, [script]
  defined = _defined_flags(sources) | _ABSL_BUILTIN
  options = _options(rest)
  config = None
  for name, value in options:
    flag = name.lstrip("-")
    if flag.startswith("config."):
      continue
    assert flag in defined, f"{module}: no flag --{flag}"
    if flag == "config":
      config = load_config(value)
  for name, value in options:
    if name.startswith("--config."):
      assert config is not None, f"{module}: {name} without --config"
      check_override(config, name[len("--config."):], value)
  if module == "jaxrlvr.compare":
    from jaxrlvr.compare import arms
    values = dict(options)
    assert values.get("--preset", "") in ("", *arms.PRESETS), f"no comparison preset {values['--preset']}"
    for arm in filter(None, (values.get("--arms") or "").split(",")):
      arms.resolve_arm(arm)  # a named variant, or a method config's name


def _extras() -> set[str]:
  setup = open(os.path.join(_REPO, "setup.py")).read()
  block = setup[setup.index("extras_require"):]
  return set(re.findall(r"^\s+\"([\w-]+)\":", block, flags=re.M))


def check_command(command: str) -> None:
  args = shlex.split(command, comments=True)
  while args and _ASSIGNMENT.fullmatch(args[0]):  # environment assignments before the command
    args = args[1:]
  head = args[0]
  if head == "pip":
    assert args[1] == "install", command
    for name, value in _options(args[2:]):
      if name == "-c":
        assert os.path.exists(os.path.join(_REPO, value)), f"no constraints file {value}"
      if name == "-e":
        extras = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", value)
        assert extras, f"pip install -e {value}: install the repository root"
        missing = set(filter(None, (extras.group(1) or "").split(","))) - _extras()
        assert not missing, f"no extras {sorted(missing)} in setup.py"
    return
  if head == "python":
    _check_python(args[1:])
    return
  if head == "sbatch":
    head, args = args[1], args[1:]
  assert head.startswith("launch/") and os.access(os.path.join(_REPO, head), os.R_OK), f"unknown command: {command}"
  launched = args[args.index("--") + 1:] if "--" in args else args[1:]
  check_command(shlex.join(launched))


def test_the_readme_has_its_commands():
  commands = readme_commands()
  assert any(c.startswith("python -m jaxrlvr.main --config=configs/exgrpo.py ") for c in commands), commands
  assert any(c.startswith("python -m pytest") for c in commands), commands
  assert any(c.startswith("pip install") for c in commands), commands


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_parses(command):
  check_command(command)


@pytest.mark.parametrize("command", sorted({c for path in _DOCS for c in readme_commands(path)} - set(readme_commands())))
def test_docs_command_parses(command):
  check_command(command)


@pytest.mark.parametrize("bad", [
    "python -m jaxrlvr.main --config=configs/exgrpo.py --workdir=DIR --config.optim.no_such_key=1",
    "python -m jaxrlvr.main --config=configs/exgrpo.py --no_such_flag=1",
    "python -m jaxrlvr.main --config=configs/no_such_method.py --workdir=DIR",
    "python -m jaxrlvr.main --config=configs/exgrpo.py:no_such_arg=1 --workdir=DIR",
    "python -m jaxrlvr.main --config=configs/grpo.py --workdir=DIR --config.optim.lr=fast",
    "python benchmarks/sampler.py --no_such_option",
    "python -m jaxrlvr.compare --preset=no_such_regime --outdir=DIR",
    "python -m jaxrlvr.compare --preset=fresh --arms=grpo,no_such_arm --outdir=DIR",
    "pip install -e '.[no_such_extra]'",
    "launch/no_such_launcher.sh 2 -- python -m jaxrlvr.main --config=configs/exgrpo.py:smoke --workdir=DIR",
    "curl https://example.com",
])
def test_a_drifted_command_fails_the_check(bad):
  with pytest.raises(Exception):
    check_command(bad)
