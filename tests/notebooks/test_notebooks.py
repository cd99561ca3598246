"""The notebooks, run the way a volunteer runs them: papermill executes every cell in a real kernel.

A notebook is tested with tiny parameters against real peers on 127.0.0.1; what it reports (a JSON
summary written to SUMMARY_PATH, and its cell outputs) is checked, not just that it ran.
"""

import html
import io
import json
import math
import shlex
import threading
import time
from pathlib import Path

import nbformat
import pytest
from notebook_runs import NOTEBOOKS, cell_texts, parameter_names, python3_kernel  # noqa: F401 (a fixture)

JOIN = NOTEBOOKS / "join.ipynb"
DASHBOARD = NOTEBOOKS / "dashboard.ipynb"

# the parameters each notebook's test passes: the committed notebook must still define every one of them
JOIN_PARAMETERS = (
    "INITIAL_PEERS",
    "RUN_ID",
    "AUTH_SERVER",
    "PRESET",
    "MAX_EPOCHS",
    "MAX_STEPS",
    "DATA_SHARDS",
    "SYNTHETIC_SAMPLES",
    "LOCAL_SWARM",
    "NUM_THREADS",
    "WAIT_FOR_PEERS",
    "OPTIMIZER_SETTINGS",
    "SUMMARY_PATH",
)
DASHBOARD_PARAMETERS = ("DB_PATH", "LOSS_X", "PAGE_PATH", "TITLE")
# the tiny model steps in milliseconds: a larger target batch makes a global epoch last long enough for
# the two peers' progress reports to meet in the DHT before either takes a step alone (as in
# test_swarm_training.py)
TARGET_BATCH_SIZE = 2048


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_committed_notebook_is_clean_and_parameterized(path):
    notebook = nbformat.read(str(path), as_version=4)
    nbformat.validate(notebook)
    assert notebook.metadata["kernelspec"]["name"] == "python3"
    dirty = [
        index
        for index, cell in enumerate(notebook.cells)
        if cell.cell_type == "code" and (cell.outputs != [] or cell.execution_count is not None)
    ]
    assert not dirty, f"{path.name}: code cells {dirty} hold outputs or execution counts; clear them before committing"
    tagged = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1 and tagged[0].cell_type == "code", (
        f"{path.name}: needs exactly one code cell tagged 'parameters' (papermill injects test values after it)"
    )
    expected = {JOIN: JOIN_PARAMETERS, DASHBOARD: DASHBOARD_PARAMETERS}.get(path, ())
    missing = set(expected) - parameter_names(notebook)
    assert not missing, f"the parameters cell of {path.name} no longer defines {sorted(missing)}"


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_every_notebook_has_a_test_that_runs_it(path):
    """A notebook nobody runs rots: some test file must name it and execute it through papermill."""
    runners = [
        test
        for test in Path(__file__).parents[1].rglob("test_*.py")
        if f'"{path.name}"' in (text := test.read_text()) and "execute_notebook(" in text
    ]
    assert runners, (
        f"no test runs notebooks/{path.name}: add one that executes it with papermill and checks what "
        f"it shows (see tests/notebooks/test_notebooks.py)"
    )


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_join_notebook_trains_together_with_another_peer(first_peer, start_peer, tiny_shards, tmp_path, python3_kernel):
    import papermill

    run_id, max_epochs = "test_join_notebook", 3
    _, addresses = first_peer(run_id, data=tiny_shards)  # the run names its data: the notebook, naming none, streams it
    # the other volunteer waits until the notebook's peer is ready too, so that both start at epoch 0
    other = start_peer(
        "volunteer",
        "join",
        "--preset",
        "tiny",
        "--run-id",
        run_id,
        "--host",
        "127.0.0.1",
        "--initial-peers",
        *addresses,
        "--data",
        tiny_shards,
        "--max-epochs",
        str(max_epochs),
        "--threads",
        "1",
        "--wait-for-peers",
        "2",
        "--set",
        f"optimizer.target_batch_size={TARGET_BATCH_SIZE}",
        "--events",
        "--no-progress",
    )
    other.wait_for(lambda e: e["type"] == "ready", timeout=90, what="that it joined the swarm")

    summary_path, output_path = tmp_path / "summary.json", tmp_path / "join.out.ipynb"
    parameters = dict(
        INITIAL_PEERS=addresses,
        RUN_ID=run_id,
        AUTH_SERVER="",
        PRESET="tiny",
        MAX_EPOCHS=max_epochs,
        MAX_STEPS=None,
        DATA_SHARDS="",
        SYNTHETIC_SAMPLES=512,
        LOCAL_SWARM=True,
        NUM_THREADS=1,
        WAIT_FOR_PEERS=2,
        OPTIMIZER_SETTINGS=dict(target_batch_size=TARGET_BATCH_SIZE),
        SUMMARY_PATH=str(summary_path),
    )
    assert set(parameters) == set(JOIN_PARAMETERS)
    try:
        papermill.execute_notebook(
            str(JOIN),
            str(output_path),
            parameters=parameters,
            kernel_name=python3_kernel,
            cwd=str(tmp_path),
            progress_bar=False,
            start_timeout=120,
            execution_timeout=240,
        )
    except Exception as e:
        pytest.fail(
            f"the notebook failed ({type(e).__name__}): {e}\nthe other volunteer's last lines:\n{other.log_tail()}",
            pytrace=False,
        )

    summary = json.loads(summary_path.read_text())
    epochs = summary["epochs"]
    assert summary["final_epoch"] >= max_epochs and not summary["interrupted"], summary
    assert epochs and all(math.isfinite(e["loss"]) for e in epochs), epochs
    assert summary["averaged_rounds"] >= 1, f"the notebook's peer never averaged with the other volunteer: {epochs}"
    assert any(e["averaged"] and e["group_size"] >= 2 for e in epochs), epochs

    # the other side saw the same: it averaged with the notebook's peer (the only other trainer) and ended well
    assert other.wait_exit(timeout=90) == 0, other.log_tail()
    done = other.wait_for(lambda e: e["type"] == "done", timeout=1, what="done")
    assert done["final_epoch"] >= max_epochs and done["averaged_rounds"] >= 1, done

    # the preflight ran for real on this machine, found nothing to stop for, and chose the settings the peer used
    checks = {finding["check"]: finding["status"] for finding in summary["preflight"]}
    assert {"gpu", "memory", "disk", "bitsandbytes", "swarm", "reachability"} <= set(checks), checks
    assert "problem" not in checks.values() and checks["swarm"] == "ok", summary["preflight"]
    assert summary["micro_batch"] >= 1 and not summary["client_mode"]  # LOCAL_SWARM: peers on 127.0.0.1 dial it
    assert (summary["device"], summary["precision"]) == ("cpu", "fp32")  # DEVICE = "auto" on a machine with no GPU
    assert summary["contributed_samples"] == sum(e["samples"] for e in epochs) > 0

    # what a volunteer sees: the preflight, the join line, the live view, the loss plot and the summary
    executed = nbformat.read(str(output_path), as_version=4)
    text = cell_texts(executed)
    assert "ready to train" in text and "chosen for this machine: micro-batch" in text
    assert "To join this swarm:" in text and "/ip4/127.0.0.1/tcp/" in text
    assert f"training on the run's data {tiny_shards!r}" in text
    assert f"you contributed {summary['contributed_samples']} samples" in text
    assert f"epochs {summary['start_epoch']}->{summary['final_epoch']}: loss" in text
    pictures = [
        index
        for index, cell in enumerate(executed.cells)
        for output in cell.get("outputs", [])
        if "image/png" in output.get("data", {})
    ]
    assert len(set(pictures)) >= 2, "the live view and the loss plot should both be drawn"


@pytest.mark.timeout(300)
def test_the_join_notebook_refuses_shards_of_another_codebook_before_a_step(
    first_peer, tiny_shards, tmp_path, python3_kernel
):
    """DATA_SHARDS made for another codebook than the run's model reads: the cell that joins stops with one sentence
    that names DATA_SHARDS, and no cell after it (the training) runs."""
    import papermill

    from collab_kit.config import get_preset
    from collab_kit.data.synthetic import make_synthetic_shards

    run_id, tiny = "test_join_notebook_codebook", get_preset("tiny")
    _, addresses = first_peer(run_id, data=tiny_shards)
    other = tmp_path / "other_codebook"
    make_synthetic_shards(str(other), 64, tiny.model.image_side, tiny.model.codebook_size // 2, num_shards=1)
    output_path = tmp_path / "join.out.ipynb"
    parameters = dict(
        INITIAL_PEERS=addresses,
        RUN_ID=run_id,
        AUTH_SERVER="",
        PRESET="tiny",
        MAX_EPOCHS=3,
        MAX_STEPS=None,
        DATA_SHARDS=str(other),
        SYNTHETIC_SAMPLES=512,
        LOCAL_SWARM=True,
        NUM_THREADS=1,
        WAIT_FOR_PEERS=1,
        OPTIMIZER_SETTINGS=dict(target_batch_size=TARGET_BATCH_SIZE),
        SUMMARY_PATH=str(tmp_path / "summary.json"),
    )
    with pytest.raises(papermill.PapermillExecutionError):
        papermill.execute_notebook(
            str(JOIN),
            str(output_path),
            parameters=parameters,
            kernel_name=python3_kernel,
            cwd=str(tmp_path),
            progress_bar=False,
            start_timeout=120,
            execution_timeout=180,
        )
    cells = nbformat.read(str(output_path), as_version=4).cells
    [(index, error)] = [
        (index, output)
        for index, cell in enumerate(cells)
        for output in cell.get("outputs", [])
        if output.output_type == "error"
    ]
    assert error.ename == "DataMismatch" and len(error.traceback) == 1, error  # the sentence alone
    assert "DATA_SHARDS" in error.evalue and "codebook of 16" in error.evalue, error.evalue
    assert "Volunteer.from_config" in cells[index].source
    assert not [cell for cell in cells[index + 1 :] if cell.cell_type == "code" and cell.get("outputs")]
    assert not (tmp_path / "summary.json").exists()  # no step, no summary


class PrintedText(io.TextIOBase):
    """What a running notebook prints, as papermill streams it out of the kernel (its ``stdout_file``)."""

    def __init__(self):
        super().__init__()
        self._text, self._changed = "", threading.Condition()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._changed:
            self._text += text
            self._changed.notify_all()
        return len(text)

    def wait_for_line(self, prefix: str, timeout: float, running: threading.Thread) -> str:
        """The first printed line holding ``prefix``, from ``prefix`` on; fails after ``timeout`` s or if the
        notebook ended without it."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self._text.splitlines():
                    if prefix in line:
                        return line[line.index(prefix) :]
                left = deadline - time.monotonic()
                if left <= 0 or not running.is_alive():
                    pytest.fail(
                        f"the notebook printed no {prefix!r} line; it printed:\n{self._text[-3000:]}", pytrace=False
                    )
                self._changed.wait(timeout=min(left, 1.0))  # wakes at each write; once a second to see the end


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("local_steps, target_batch_size", [(0, 3072), (2, 1536)], ids=["synchronous", "local_updates"])
def test_a_friend_pastes_the_join_line_the_notebook_printed_and_averages_with_it(
    start_peer, tiny_shards, tmp_path, python3_kernel, local_steps, target_batch_size
):
    """join.ipynb starts a swarm of its own and prints its join line; what a friend pastes into a terminal (only how
    long they stay and the test's event output added) joins the same run with the same preset, settings and data
    (the synthetic shapes the notebook chose, which the friend's peer makes too), and the two peers average; in both
    modes (``LOCAL_STEPS``: the local-update mode, which the line must carry too)."""
    import papermill

    # a target batch the tiny preset does not have, so that the line must carry it (a larger one than the other
    # test's); a round of the local-update mode holds as many samples as a synchronous epoch here
    run_id, max_epochs = f"test_pasted_join_line_{local_steps}", 3
    summary_path, output_path = tmp_path / "summary.json", tmp_path / "join.out.ipynb"
    parameters = dict(
        INITIAL_PEERS=[],
        RUN_ID=run_id,
        AUTH_SERVER="",
        PRESET="tiny",
        MAX_EPOCHS=max_epochs,
        MAX_STEPS=None,
        DATA_SHARDS="",
        SYNTHETIC_SAMPLES=512,
        LOCAL_SWARM=True,
        NUM_THREADS=1,
        WAIT_FOR_PEERS=2,
        OPTIMIZER_SETTINGS=dict(target_batch_size=target_batch_size),
        LOCAL_STEPS=local_steps,
        SUMMARY_PATH=str(summary_path),
    )
    printed, failure = PrintedText(), []

    def run_notebook():
        try:
            papermill.execute_notebook(
                str(JOIN),
                str(output_path),
                parameters=parameters,
                kernel_name=python3_kernel,
                cwd=str(tmp_path),
                progress_bar=False,
                start_timeout=120,
                execution_timeout=240,
                stdout_file=printed,
            )
        except Exception as e:  # reported by the test's thread below
            failure.append(e)

    notebook = threading.Thread(target=run_notebook, name="join.ipynb", daemon=True)
    notebook.start()
    line = printed.wait_for_line("To join this swarm: ", timeout=240, running=notebook)
    pasted = shlex.split(line.removeprefix("To join this swarm: "))
    assert pasted[:2] == ["collab-kit", "join"], line
    assert "--preset tiny" in line and f"--set optimizer.target_batch_size={target_batch_size}" in line, line
    assert "/ip4/127.0.0.1/tcp/" in line, line
    assert (f"--set optimizer.local_steps={local_steps}" in line) == (local_steps > 0), line
    assert "--data synthetic" in line and "--host" not in line, line
    # the friend's own choices: how long to stay, and to start when the notebook's peer does
    friend = start_peer(
        "friend",
        *pasted[1:],
        "--max-epochs",
        str(max_epochs),
        "--threads",
        "1",
        "--wait-for-peers",
        "2",
        "--events",
        "--no-progress",
    )
    friend.wait_for(lambda e: e["type"] == "ready", timeout=90, what="that the pasted line joined the swarm")
    notebook.join(timeout=300)
    assert not notebook.is_alive(), "the notebook did not finish within 300 s"
    if failure:
        pytest.fail(
            f"the notebook failed ({type(failure[0]).__name__}): {failure[0]}\n"
            f"the friend's last lines:\n{friend.log_tail()}",
            pytrace=False,
        )

    summary = json.loads(summary_path.read_text())
    assert summary["averaged_rounds"] >= 1 and any(e["group_size"] >= 2 for e in summary["epochs"]), summary
    assert friend.wait_exit(timeout=90) == 0, friend.log_tail()
    done = friend.wait_for(lambda e: e["type"] == "done", timeout=1, what="done")
    assert done["final_epoch"] >= max_epochs and done["averaged_rounds"] >= 1, done
    # the same run, preset and settings: the friend's peer prints the same line up to the addresses
    friend_lines = [text for text in Path(friend.log_path).read_text().splitlines() if "To join this swarm: " in text]
    assert friend_lines, friend.log_tail()
    shared = line.split(" --initial-peers ")[0]
    assert friend_lines[0][friend_lines[0].index("To join this swarm: ") :].split(" --initial-peers ")[0] == shared


@pytest.mark.timeout(300)
def test_dashboard_notebook_draws_the_monitors_database(tmp_path, python3_kernel):
    import papermill
    from example_history import NAMES, write_example_history

    db_path, page_path, output_path = tmp_path / "run.sqlite", tmp_path / "page.html", tmp_path / "dashboard.out.ipynb"
    write_example_history(str(db_path))  # a run as the monitor records it: 24 polls, 5 contributors
    parameters = dict(DB_PATH=str(db_path), LOSS_X="epoch", PAGE_PATH=str(page_path), TITLE="notebook test")
    assert set(parameters) == set(DASHBOARD_PARAMETERS)
    papermill.execute_notebook(
        str(DASHBOARD),
        str(output_path),
        parameters=parameters,
        kernel_name=python3_kernel,
        cwd=str(tmp_path),
        progress_bar=False,
        start_timeout=120,
        execution_timeout=120,
    )

    executed = nbformat.read(str(output_path), as_version=4)
    outputs = [output for cell in executed.cells for output in cell.get("outputs", [])]
    assert "epoch 23, 5 alive peers, 91.3 samples/s" in cell_texts(executed)
    assert any("image/png" in output.get("data", {}) for output in outputs), "no plot was displayed"
    tables = "\n".join(output.get("data", {}).get("text/html", "") for output in outputs)
    assert "alice" in tables and "&lt;script&gt;" in tables and "<script>" not in tables, "the leaderboard is missing"
    page = page_path.read_text()
    assert "<title>notebook test</title>" in page and page.count("data:image/png;base64,") == 3
    assert all(html.escape(name) in page for name in NAMES)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "notebook, parameters, ename, setting",
    [
        (
            DASHBOARD,
            dict(DB_PATH="no-such-run.sqlite"),
            "SettingFileMissing",
            "no monitor database at 'no-such-run.sqlite'",
        ),
        (DASHBOARD, dict(DB_PATH=""), "SettingFileMissing", "DB_PATH in the dashboard notebook"),
        (NOTEBOOKS / "inference.ipynb", dict(CHECKPOINT="no-such-model"), "SettingFileMissing", "Pass CHECKPOINT ="),
    ],
    ids=["dashboard-missing-file", "dashboard-nothing-found", "inference-missing-checkpoint"],
)
def test_a_setting_that_names_nothing_stops_the_notebook_with_one_sentence(
    notebook, parameters, ename, setting, tmp_path, python3_kernel
):
    """Where a setting points at nothing, the notebook stops with the sentence that names the setting, no stack."""
    import papermill

    output_path = tmp_path / "out.ipynb"
    with pytest.raises(papermill.PapermillExecutionError):
        papermill.execute_notebook(
            str(notebook),
            str(output_path),
            parameters=parameters,
            kernel_name=python3_kernel,
            cwd=str(tmp_path),
            progress_bar=False,
            start_timeout=120,
            execution_timeout=120,
        )
    [error] = [
        output
        for cell in nbformat.read(str(output_path), as_version=4).cells
        for output in cell.get("outputs", [])
        if output.output_type == "error"
    ]
    assert error.ename == ename and len(error.traceback) == 1, error  # the sentence alone
    assert setting in error.evalue, error.evalue
