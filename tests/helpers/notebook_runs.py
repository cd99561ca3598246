"""What the notebook tests share: where the notebooks are, their parameters cell, their printed text, and the kernel
papermill runs them in (this environment's)."""

import ast
import os
import sys
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def parameter_names(notebook) -> set:
    """Names assigned in the cell tagged ``parameters``."""
    [cell] = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    return {
        target.id
        for node in ast.parse(cell.source).body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }


@pytest.fixture
def python3_kernel(monkeypatch):
    """Make papermill's ``python3`` kernel the one of this interpreter's environment, not a user-wide one."""
    from jupyter_client.kernelspec import KernelSpecManager

    monkeypatch.setenv(
        "JUPYTER_PATH",
        os.pathsep.join(
            [os.path.join(sys.prefix, "share", "jupyter"), *filter(None, [os.environ.get("JUPYTER_PATH")])]
        ),
    )
    spec = KernelSpecManager().get_kernel_spec("python3")
    if os.path.dirname(spec.argv[0]) != os.path.dirname(sys.executable):
        pytest.fail(
            f"the 'python3' kernel runs {spec.argv[0]}, not this environment's Python ({sys.executable}): "
            f"run `{sys.executable} -m ipykernel install --sys-prefix --name python3`"
        )
    return "python3"


def cell_texts(notebook) -> str:
    texts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            texts.append(
                output.get("text", "")
                if output.output_type == "stream"
                else output.get("data", {}).get("text/plain", "")
            )
    return "\n".join(texts)
