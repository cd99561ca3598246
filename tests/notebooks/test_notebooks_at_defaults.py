"""Every notebook at its own defaults, as a newcomer first meets it after `make demo`: offline, on a CPU.

Only the environment is the tests' (no Internet: HF_HUB_OFFLINE and HF_DATASETS_OFFLINE; a temporary HOME and HF_HOME)
and, where a default would train for long, the one size parameter is lowered (MAX_EPOCHS, STEPS). Each notebook runs
from a copy of the notebooks folder beside a ``demo_out`` holding what `make demo` leaves there (the run's monitor
database and a model of the toy world), and each must show what it promises, with no error and nothing on stderr
(a red box in a notebook) on a run where nothing is wrong.

Each executed notebook is then saved as HTML (nbconvert, as GitHub and Colab's saved copies show it: widgets without
their live state are blank) and opened in headless Chromium: no output may hold a traceback or stderr text, and every
widget must be followed in its cell by a line of text, so that a saved copy tells the story without the widgets.
"""

import os
import shutil
from pathlib import Path

import nbformat
import pytest
import torch
from bs4 import BeautifulSoup
from example_history import write_example_history
from headless_chromium import chromium, run_chromium  # noqa: F401 (chromium: a fixture)
from nbconvert import HTMLExporter
from notebook_runs import cell_texts, python3_kernel  # noqa: F401 (python3_kernel: a fixture)

from collab_kit.config import get_preset
from collab_kit.model.checkpoint import save_checkpoint
from collab_kit.model.transformer import TextToImageTransformer

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


@pytest.fixture(scope="module")
def after_make_demo(tmp_path_factory):
    """A folder as a fresh clone is after `make demo`: notebooks/ and demo_out/ (monitor.sqlite, model)."""
    root = tmp_path_factory.mktemp("clone")
    shutil.copytree(NOTEBOOKS, root / "notebooks")
    (root / "demo_out").mkdir()
    write_example_history(str(root / "demo_out" / "monitor.sqlite"))
    config = get_preset("toy")
    torch.manual_seed(0)
    save_checkpoint(
        TextToImageTransformer(config.model), config, str(root / "demo_out" / "model"), metadata=dict(epoch=60)
    )
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
    output = executed_path(folder, name)
    try:
        papermill.execute_notebook(
            str(path),
            str(output),
            parameters=size,
            kernel_name=kernel,
            cwd=str(folder / "notebooks"),
            progress_bar=False,
            start_timeout=120,
            execution_timeout=timeout,
        )
    except papermill.PapermillExecutionError as e:
        pytest.fail(f"{name} failed at its defaults: {e.ename}: {e.evalue}", pytrace=False)
    return nbformat.read(str(output), as_version=4)


def executed_path(folder: Path, name: str) -> Path:
    return folder / "notebooks" / f"{name}.out.ipynb"


def outputs_of(notebook):
    return [output for cell in notebook.cells for output in cell.get("outputs", [])]


def assert_quiet(notebook, name: str):
    """No error and nothing on stderr: what a reader would see in red."""
    for output in outputs_of(notebook):
        assert output.output_type != "error", (name, output.get("ename"), output.get("evalue"))
        if output.output_type == "stream":
            assert output.name != "stderr", (name, output.text[:2000])


WIDGET = "widget"
SHOWN_AS_TEXT = {"text/plain", "text/markdown", "text/html", "text/latex", "application/vnd.jupyter.stdout"}


def saved_outputs(dom: str) -> list:
    """Per code cell of a notebook's HTML as the browser holds it, its outputs in order as (kind, text).

    kind: ``"widget"`` for a widget view (blank without its live state), else the output's mime type as nbconvert
    marks it (``application/vnd.jupyter.stderr`` for stderr streams and errors alike).
    """
    cells = []
    for cell in BeautifulSoup(dom, "html.parser").select("div.jp-CodeCell"):
        outputs = []
        for child in cell.select("div.jp-OutputArea-child"):
            if child.select_one('script[type="application/vnd.jupyter.widget-view+json"]') is not None:
                outputs.append((WIDGET, ""))
                continue
            shown = child.select_one(".jp-OutputArea-output")
            kind = shown.get("data-mime-type", "") if shown is not None else ""
            for script in child.select("script, style"):
                script.decompose()
            outputs.append((kind, child.get_text(" ", strip=True)))
        cells.append(outputs)
    return cells


def saved_copy_problems(outputs: list) -> list:
    """What a reader of the saved copy would trip on: red text, tracebacks, a widget with no text after it."""
    problems = []
    for number, cell in enumerate(outputs, start=1):
        for index, (kind, text) in enumerate(cell):
            if kind == "application/vnd.jupyter.stderr":
                problems.append(f"code cell {number}: stderr or an error: {text[:300]!r}")
            elif "Traceback" in text:
                problems.append(f"code cell {number}: a traceback: {text[:300]!r}")
            if kind == WIDGET and not any(
                later in SHOWN_AS_TEXT and later_text for later, later_text in cell[index + 1 :]
            ):
                problems.append(
                    f"code cell {number}: a widget (output {index + 1}) with no text after it: a saved "
                    f"copy shows nothing of its result"
                )
    return problems


def assert_reads_well_saved(folder: Path, name: str, chromium_binary: str, workdir: Path):
    """Save the executed notebook as HTML, open it in headless Chromium and check what its DOM shows."""
    notebook = nbformat.read(str(executed_path(folder, name)), as_version=4)
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(notebook)
    page = workdir / f"{name}.html"
    page.write_text(body, encoding="utf-8")
    outputs = saved_outputs(run_chromium(chromium_binary, workdir, "--dump-dom", f"file://{page}"))
    assert sum(len(cell) for cell in outputs) == len(outputs_of(notebook)), "the page lost outputs"
    problems = saved_copy_problems(outputs)
    assert not problems, f"{name}.ipynb saved as HTML:\n" + "\n".join(problems)


def run_and_read_saved(
    folder: Path, name: str, kernel: str, timeout: float, chromium_binary: str, workdir: Path, **size
) -> nbformat.NotebookNode:
    """``run_at_defaults``, then what a reader sees: nothing red live, and a saved copy that reads well."""
    notebook = run_at_defaults(folder, name, kernel, timeout, **size)
    assert_quiet(notebook, name)
    assert_reads_well_saved(folder, name, chromium_binary, workdir)
    return notebook


def test_the_saved_copy_check_sees_a_lone_widget_and_red_text():
    """The checker itself: a widget at the end of its cell and a stderr stream are what it must report."""
    notebook = nbformat.v4.new_notebook()
    widget = nbformat.v4.new_output(
        "display_data",
        data={
            "application/vnd.jupyter.widget-view+json": {"model_id": "0", "version_major": 2, "version_minor": 0},
            "text/plain": "progress",
        },
    )
    # as nbclient saves it: without the widgets' state, nbconvert would show the text/plain fallback instead
    notebook.metadata["widgets"] = {
        "application/vnd.jupyter.widget-state+json": {
            "state": {
                "0": {
                    "model_module": "@jupyter-widgets/controls",
                    "model_module_version": "2.0.0",
                    "model_name": "HTMLModel",
                    "state": {},
                }
            },
            "version_major": 2,
            "version_minor": 0,
        }
    }
    notebook.cells = [
        nbformat.v4.new_code_cell(
            "a", outputs=[widget, nbformat.v4.new_output("stream", name="stdout", text="done\n")]
        ),
        nbformat.v4.new_code_cell("b", outputs=[nbformat.v4.new_output("stream", name="stdout", text="hi\n"), widget]),
        nbformat.v4.new_code_cell("c", outputs=[nbformat.v4.new_output("stream", name="stderr", text="oops\n")]),
    ]
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(notebook)
    problems = saved_copy_problems(saved_outputs(body))
    assert len(problems) == 2 and "code cell 2: a widget" in problems[0] and "oops" in problems[1], problems


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_memory_calculator_at_its_defaults(after_make_demo, python3_kernel, chromium, tmp_path):
    notebook = run_and_read_saved(after_make_demo, "memory_calculator", python3_kernel, 240, chromium, tmp_path)
    text = cell_texts(notebook)
    assert "On a GPU of 16 GiB this" in text and "The panel starts at your settings" in text
    assert any("image/png" in output.get("data", {}) for output in outputs_of(notebook))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dashboard_at_its_defaults_reads_make_demos_run(after_make_demo, python3_kernel, chromium, tmp_path):
    notebook = run_and_read_saved(after_make_demo, "dashboard", python3_kernel, 240, chromium, tmp_path)
    text = cell_texts(notebook)
    assert "dashboard written to dashboard.html" in text and "epoch 23, 5 alive peers" in text
    html = "".join(output.get("data", {}).get("text/html", "") for output in outputs_of(notebook))
    assert "alice" in html  # the leaderboard of make demo's run
    assert (after_make_demo / "notebooks" / "dashboard.html").is_file()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_inference_at_its_defaults_draws_from_make_demos_model(after_make_demo, python3_kernel, chromium, tmp_path):
    notebook = run_and_read_saved(after_make_demo, "inference", python3_kernel, 360, chromium, tmp_path)
    text = cell_texts(notebook)
    assert "drew 32 pictures for each of 4 prompts" in text
    assert any("image/png" in output.get("data", {}) for output in outputs_of(notebook))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tutorial_at_its_defaults_offline_on_a_cpu(after_make_demo, python3_kernel, offline_home, chromium, tmp_path):
    notebook = run_and_read_saved(
        after_make_demo, "tutorial_gpt2_8bit", python3_kernel, 540, chromium, tmp_path, STEPS=2
    )
    text = cell_texts(notebook)
    assert "the model: a tiny GPT-2 from scratch" in text and "no GPU here" in text
    assert "C4-like local shards in" in text and "the Hub could not be reached" in text
    assert "2 steps" in text
    assert list((offline_home / ".cache" / "collab_kit" / "c4_like").glob("c4-train.*.json.gz"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_join_at_its_defaults_starts_a_swarm_of_its_own(after_make_demo, python3_kernel, chromium, tmp_path):
    notebook = run_and_read_saved(after_make_demo, "join", python3_kernel, 540, chromium, tmp_path, MAX_EPOCHS=1)
    text = cell_texts(notebook)
    assert "starting a new swarm" in text and "To join this swarm: collab-kit join --preset small --run-id" in text
    assert "No global epoch finished" not in text and "epoch 0: loss" in text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_your_own_at_its_defaults_is_an_open_run(after_make_demo, python3_kernel, chromium, tmp_path):
    notebook = run_and_read_saved(
        after_make_demo, "run_your_own", python3_kernel, 540, chromium, tmp_path, MAX_EPOCHS=1
    )
    text = cell_texts(notebook)
    assert "an open run: no login needed" in text
    assert "To join this run: collab-kit join --preset small --run-id my_run" in text
    assert "STILL RUNNING" not in text
    for process_line in ("monitor: stopped", "volunteer-1: stopped"):
        assert process_line in text
    assert os.path.isdir(after_make_demo / "notebooks" / "my_run")
