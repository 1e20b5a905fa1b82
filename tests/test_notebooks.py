"""The Colab notebooks run top to bottom in a real kernel (with the `SMOKE = True` they are committed with) and are
committed without outputs."""
import os

import nbformat
import pytest
from nbclient import NotebookClient

import light_compile

_COLABS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "colabs")
_NOTEBOOKS = ("quickstart.ipynb", "losses.ipynb")


def _read(name):
  return nbformat.read(os.path.join(_COLABS, name), as_version=4)


@pytest.mark.parametrize("name", _NOTEBOOKS)
def test_committed_without_outputs(name):
  nb = _read(name)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code, name
  for i, cell in enumerate(code):
    assert cell.outputs == [] and cell.execution_count is None, f"{name}: code cell {i} holds outputs"
  assert nb.metadata.kernelspec.name == "python3"


def test_quickstart_smoke_parameter_is_on():
  params = [c for c in _read("quickstart.ipynb").cells if "parameters" in c.metadata.get("tags", [])]
  assert len(params) == 1 and "SMOKE = True" in params[0].source


def _outputs(nb, kind):
  return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == kind]


@pytest.mark.slow
@pytest.mark.parametrize("name", _NOTEBOOKS)
def test_runs_top_to_bottom(name, tmp_path, monkeypatch, request):
  if name == "quickstart.ipynb":  # its smoke run names the test run's warm-start cache (tests/conftest.py)
    request.getfixturevalue("smoke_warm_start")
  # The kernel inherits this environment: one CPU device as on a Colab CPU runtime (compiled light:
  # tests/light_compile.py), the run's workdir under tmp_path, and the test run's shared warm-start cache
  # (JAXRLVR_WARM_START_CACHE, set by conftest.py).
  monkeypatch.setenv("XLA_FLAGS", light_compile.job_env()["XLA_FLAGS"])
  monkeypatch.setenv("TMPDIR", str(tmp_path))
  nb = _read(name)
  NotebookClient(nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": _COLABS}}).execute()
  assert not _outputs(nb, "error")
  images = [o for o in _outputs(nb, "display_data") if "image/png" in o.data]
  text = "".join(o.text for o in _outputs(nb, "stream") if o.name == "stdout")
  if name == "quickstart.ipynb":
    assert len(images) == 1, "the training curves"
    assert "matches the accuracy the run logged" in text
    assert "bucket k (k of K answers correct)" in text
    assert "removed the temporary workdir" in text
    assert not list(tmp_path.glob("jaxrlvr_quickstart_*")), "the notebook left its workdir behind"
  else:
    assert len(images) == 3, "f(w) vs clip, surrogate and gradients, aggregation weights"
    assert "checked at 400 ratios" in text and "dr_grpo: the same token weights" in text
