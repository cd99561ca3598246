"""notebooks/memory_calculator.ipynb run through papermill: its summary equals collab_kit.memory.estimate called
here."""

import json
from pathlib import Path

import nbformat
from notebook_runs import cell_texts, parameter_names, python3_kernel  # noqa: F401 (python3_kernel: a fixture)

from collab_kit import memory

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "memory_calculator.ipynb"
PARAMETERS = (
    "MODEL",
    "OPTIMIZER",
    "PRECISION",
    "MICRO_BATCH",
    "SEQ_LEN",
    "CHECKPOINTING",
    "OFFLOAD",
    "SHARED_GROUPS",
    "GPU_MEMORY_GIB",
    "INTERACTIVE",
    "SUMMARY_PATH",
)


def test_the_notebook_estimates_compares_and_recommends(tmp_path, python3_kernel):
    import papermill

    summary_path, output_path = tmp_path / "summary.json", tmp_path / "memory.out.ipynb"
    settings = dict(
        optimizer="8bit",
        precision="mixed",
        micro_batch=2,
        seq_len=512,
        checkpointing=False,
        offload=True,
        shared_groups=6,
    )
    parameters = dict(
        MODEL="gpt2-medium",
        OPTIMIZER="8bit",
        PRECISION="mixed",
        MICRO_BATCH=2,
        SEQ_LEN=512,
        CHECKPOINTING=False,
        OFFLOAD=True,
        SHARED_GROUPS=6,
        GPU_MEMORY_GIB=8,
        INTERACTIVE=True,
        SUMMARY_PATH=str(summary_path),
    )
    assert set(parameters) == set(PARAMETERS) <= parameter_names(nbformat.read(str(NOTEBOOK), as_version=4))
    papermill.execute_notebook(
        str(NOTEBOOK),
        str(output_path),
        parameters=parameters,
        kernel_name=python3_kernel,
        cwd=str(tmp_path),
        progress_bar=False,
        start_timeout=120,
        execution_timeout=120,
    )

    summary = json.loads(summary_path.read_text())
    chosen = memory.estimate("gpt2-medium", **settings)
    assert summary["chosen"] == json.loads(json.dumps(chosen.to_dict()))
    assert summary["gpu_memory_bytes"] == 8 * memory.GiB and summary["fits"] == (chosen.gpu_bytes <= 8 * memory.GiB)
    expected = memory.compare("gpt2-medium", micro_batch=2, seq_len=512, shared_groups=6, precision="mixed")
    assert list(summary["comparison"]) == list(expected)
    for label, item in expected.items():
        assert summary["comparison"][label] == json.loads(json.dumps(item.to_dict())), label
    advice = memory.recommend_settings(
        "gpt2-medium", 8 * memory.GiB, optimizer="8bit", seq_len=512, offload=True, precision="mixed", shared_groups=6
    )
    assert summary["recommendation"] == dict(
        micro_batch=advice.micro_batch,
        checkpointing=advice.checkpointing,
        fits=advice.fits,
        reason=advice.reason,
        gpu_bytes=advice.estimate.gpu_bytes,
    )

    # what the reader sees: the table, the chart, the advice and the calculator's panel
    executed = nbformat.read(str(output_path), as_version=4)
    outputs = [output for cell in executed.cells for output in cell.get("outputs", [])]
    assert any("image/png" in output.get("data", {}) for output in outputs)
    assert any("application/vnd.jupyter.widget-view+json" in output.get("data", {}) for output in outputs)
    assert not [output for output in outputs if output.output_type == "error"]
    text = cell_texts(executed)
    assert chosen.table() in text and "PCIe per step" in text and advice.reason in text
    assert "summary written to" in text
    # the widget's panel is blank in a saved copy: a line of text after it says where it starts
    assert f"The panel starts at your settings: {memory.format_bytes(chosen.gpu_bytes)} on the GPU" in text
