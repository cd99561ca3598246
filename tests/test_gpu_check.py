"""benchmarks/gpu_check.py, the one command a GPU session runs, checks its own plumbing here on the CPU: every part
runs with tiny shapes (the same code as on a GPU, the device and the sizes aside) and nothing is written."""

import os
import subprocess
import sys

import pytest

from benchmarks import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_model_flops_count_the_parameters_and_the_axial_attention_scores():
    from collab_kit.config import get_preset

    config = get_preset("paper").model
    T, S = config.text_length, config.image_side
    # 63 axial layers (row or column: a group of S) and the conv layer (a band of 6 rows of S)
    assert gpu_check.attention_scores_per_sample(config) == 63 * (T * T + S * S * (T + S)) + (
        T * T + S * S * (T + 6 * S)
    )
    per_sample = gpu_check.model_flops_per_sample(config)
    assert 6 * 1.0e9 * config.sequence_length < per_sample < 6 * 1.3e9 * config.sequence_length
    assert gpu_check.peak_flops("NVIDIA H200") == gpu_check.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_check.peak_flops("Tesla T4") == 65e12 and gpu_check.peak_flops("a card nobody knows") is None


@pytest.mark.timeout(300)
def test_the_dry_run_runs_every_part_on_the_cpu_and_writes_nothing():
    results = os.path.join(ROOT, "benchmarks", "RESULTS.md")
    before = open(results).read()
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for name, _ in gpu_check.PARTS:
        assert f"- {name}\n" in run.stdout, name
    assert "failed:" not in run.stdout, run.stdout
    for row in (
        "tiny preset bf16: model FLOPs utilization",
        "tiny preset fp16: model FLOPs utilization",
        "largest micro-batch within 15 GiB",
        "2 volunteers of the tiny preset on cpu",
        "4 candidates of 16 codes with the KV cache",
    ):
        assert row in run.stdout, row
    assert open(results).read() == before
