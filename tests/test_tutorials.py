"""Every tutorial notebook runs end to end with SMALL=1 (what CI checks), without an error cell."""

import os

import pytest

from helpers import SHARED, needs_shared

TUTORIALS = os.path.join(os.path.dirname(__file__), "..", "tutorials")
NOTEBOOKS = [
    "01_tokenization.ipynb",
    "02_pretraining.ipynb",
    pytest.param("03_finetuning.ipynb", marks=needs_shared),
    pytest.param("04_embeddings.ipynb", marks=needs_shared),
    pytest.param("05_distillation.ipynb", marks=needs_shared),
]


def run_notebook(name, work, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("KBERT_TUTORIAL_SMALL", "1")
    monkeypatch.setenv("KBERT_TUTORIAL_WORK", str(work))
    monkeypatch.setenv("KBERT_SHARED_DATA", os.path.abspath(SHARED))
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
    book = nbformat.read(os.path.join(TUTORIALS, name), as_version=4)
    NotebookClient(book, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": os.path.abspath(TUTORIALS)}}).execute()
    return book


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_tutorial_runs_end_to_end(name, tmp_path, monkeypatch):
    book = run_notebook(name, tmp_path / "work", monkeypatch)
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    images = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    expected_figures = {"01": 1, "02": 2, "03": 1, "04": 2, "05": 2}[name[:2]]
    assert len(images) >= expected_figures, f"{name}: {len(images)} figures"
    import glob

    assert not glob.glob(os.path.join(TUTORIALS, "hs_err_pid*.log"))  # no JVM crash report in the tree


@pytest.mark.slow
def test_the_pretraining_tutorial_runs_on_jax_where_tensorflow_is_not_installed(tmp_path, monkeypatch):
    """A GPU host or TPU VM with `pip install -e ".[jax]"`: tutorial 02 (records, pretraining, the curves from
    TensorBoard logs, the memory planner) runs on Keras' JAX backend with TensorFlow unimportable in the
    kernel (a `tensorflow` package that raises ImportError, first on the kernel's path)."""
    blocker = tmp_path / "no-tensorflow" / "tensorflow"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('No module named tensorflow')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(blocker.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    book = run_notebook("02_pretraining.ipynb", tmp_path / "work", monkeypatch)
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors[0].get("evalue")
    # (no error with TensorFlow unimportable: Keras ran on JAX, its TensorFlow backend could not have loaded)
    images = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) >= 2


def test_the_readme_command_that_runs_a_notebook_is_installed():
    """tutorials/README.md's run command named `jupyter nbconvert`, which no extra installed; its command
    must come with `pip install -e ".[test]"`."""
    import shutil
    import subprocess

    readme = open(os.path.join(TUTORIALS, "README.md"), encoding="utf-8").read()
    line = next(l.strip() for l in readme.splitlines() if l.strip().startswith("jupyter ") and ".ipynb" in l)
    program, sub = line.split()[:2]
    assert shutil.which(program), f"{program} is not installed"
    run = subprocess.run([program, sub, "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-1000:]
