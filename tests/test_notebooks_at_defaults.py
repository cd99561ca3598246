"""Every notebook at its own defaults, as a newcomer first meets it after `make demo`: offline, on a CPU.

Only the environment is the tests' (no Internet: HF_HUB_OFFLINE and HF_DATASETS_OFFLINE; a temporary HOME and HF_HOME)
and, where a default would train for long, the one size parameter is lowered (MAX_EPOCHS, STEPS). Each notebook runs
from a copy of the notebooks folder beside a ``demo_out`` holding what `make demo` leaves there (the run's monitor
database and a model of the toy world), and each must show what it promises, with no error and nothing on stderr
(a red box in a notebook) on a run where nothing is wrong.
"""
import os
import shutil
from pathlib import Path

import nbformat
import pytest
import torch
from example_history import write_example_history
from test_notebooks import cell_texts, python3_kernel  # noqa: F401 (python3_kernel: a fixture)

from collab_kit.checkpoint import save_checkpoint
from collab_kit.config import get_preset
from collab_kit.model import TextToImageTransformer

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.fixture(scope="module")
def after_make_demo(tmp_path_factory):
    """A folder as a fresh clone is after `make demo`: notebooks/ and demo_out/ (monitor.sqlite, model)."""
    root = tmp_path_factory.mktemp("clone")
    shutil.copytree(NOTEBOOKS, root / "notebooks")
    (root / "demo_out").mkdir()
    write_example_history(str(root / "demo_out" / "monitor.sqlite"))
    config = get_preset("toy")
    torch.manual_seed(0)
    save_checkpoint(TextToImageTransformer(config.model), config, str(root / "demo_out" / "model"),
                    metadata=dict(epoch=60))
    return root


@pytest.fixture
def offline_home(tmp_path, monkeypatch):
    """A home of its own for the kernel (the tutorial makes its C4-like shards under ~/.cache)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def run_at_defaults(folder: Path, name: str, kernel: str, timeout: float, **size) -> nbformat.NotebookNode:
    """Execute notebooks/NAME.ipynb in place (its cwd: notebooks/) with only ``size`` changed; the executed notebook.

    :raises AssertionError: a cell failed, with its error
    """
    import papermill

    path = folder / "notebooks" / f"{name}.ipynb"
    output = folder / "notebooks" / f"{name}.out.ipynb"
    try:
        papermill.execute_notebook(str(path), str(output), parameters=size, kernel_name=kernel,
                                   cwd=str(folder / "notebooks"), progress_bar=False, start_timeout=120,
                                   execution_timeout=timeout)
    except papermill.PapermillExecutionError as e:
        pytest.fail(f"{name} failed at its defaults: {e.ename}: {e.evalue}", pytrace=False)
    return nbformat.read(str(output), as_version=4)


def outputs_of(notebook):
    return [output for cell in notebook.cells for output in cell.get("outputs", [])]


def assert_quiet(notebook, name: str):
    """No error and nothing on stderr: what a reader would see in red."""
    for output in outputs_of(notebook):
        assert output.output_type != "error", (name, output.get("ename"), output.get("evalue"))
        if output.output_type == "stream":
            assert output.name != "stderr", (name, output.text[:2000])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_memory_calculator_at_its_defaults(after_make_demo, python3_kernel):
    notebook = run_at_defaults(after_make_demo, "memory_calculator", python3_kernel, 240)
    assert_quiet(notebook, "memory_calculator")
    text = cell_texts(notebook)
    assert "On a GPU of 16 GiB this" in text and "The panel starts at your settings" in text
    assert any("image/png" in output.get("data", {}) for output in outputs_of(notebook))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dashboard_at_its_defaults_reads_make_demos_run(after_make_demo, python3_kernel):
    notebook = run_at_defaults(after_make_demo, "dashboard", python3_kernel, 240)
    assert_quiet(notebook, "dashboard")
    text = cell_texts(notebook)
    assert "dashboard written to dashboard.html" in text and "epoch 23, 5 alive peers" in text
    html = "".join(output.get("data", {}).get("text/html", "") for output in outputs_of(notebook))
    assert "alice" in html  # the leaderboard of make demo's run
    assert (after_make_demo / "notebooks" / "dashboard.html").is_file()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_inference_at_its_defaults_draws_from_make_demos_model(after_make_demo, python3_kernel):
    notebook = run_at_defaults(after_make_demo, "inference", python3_kernel, 360)
    assert_quiet(notebook, "inference")
    text = cell_texts(notebook)
    assert "drew 32 pictures for each of 4 prompts" in text
    assert any("image/png" in output.get("data", {}) for output in outputs_of(notebook))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tutorial_at_its_defaults_offline_on_a_cpu(after_make_demo, python3_kernel, offline_home):
    notebook = run_at_defaults(after_make_demo, "tutorial_gpt2_8bit", python3_kernel, 540, STEPS=2)
    assert_quiet(notebook, "tutorial_gpt2_8bit")
    text = cell_texts(notebook)
    assert "the model: a tiny GPT-2 from scratch" in text and "no GPU here" in text
    assert "C4-like local shards in" in text and "the Hub could not be reached" in text
    assert "2 steps" in text
    assert list((offline_home / ".cache" / "collab_kit" / "c4_like").glob("c4-train.*.json.gz"))
