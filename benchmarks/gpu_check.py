"""The kit on a GPU: the paper's model in bf16 and fp16, memory against the estimate, two volunteers, generation.

    python -m benchmarks.gpu_check             # on a machine with a CUDA GPU, under 8 minutes: rows in RESULTS.md
    python -m benchmarks.gpu_check --dry-run   # its plumbing on the CPU, tiny shapes, in seconds (make test runs it)

On a machine without a GPU (and without --dry-run) it says so and records nothing; the rows a GPU wrote stay.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks import common

TITLE = "On a GPU: the paper's model, memory, two volunteers, generation"
HOW = """
`python -m benchmarks.gpu_check` on a machine with a CUDA GPU (the `device` tool's machine when a session is lent
one), under 8 minutes:

- the `paper` preset (1.1B parameters of compute, reversible layers) trains on the GPU through the kit's device path
  (`collab_kit.model.device`: autocast, fp16 loss scaling), forward and backward (the 8-bit LAMB step runs on the CPU,
  offloaded, in the background of the next steps); samples/s, and model FLOPs utilization: 6 x compute parameters x
  positions per sample, plus the attention scores as the axial layouts compute them (4 x hidden per score, x 3 for
  training), against the card's dense 16-bit peak. A missed target names the profile's top kernels;
- the largest micro-batch within 15 GiB (`torch.cuda.set_per_process_memory_fraction`, standing for a T4), beside the
  preflight's choice for that budget (`collab_kit.memory.recommend_for_plan`), and the peak memory per micro-batch;
- GPU memory measured / `collab_kit.memory.estimate` for the paper preset (reversible and not) and GPT-2 small,
  medium and large with 32-bit and 8-bit Adam, with and without checkpointing (benchmarks/memory_gpu.py);
- two volunteers of the `small` preset train on the GPU through `collab-kit join --device cuda` with a monitor on
  127.0.0.1: 5 global epochs, each averaged;
- generation with the paper preset (random weights): 128 candidates of 1024 codes with the KV cache, in seconds.

`--dry-run` runs every part on the CPU with tiny shapes (the tiny preset, one epoch; GPT-2 and the memory
measurements only as estimates) and writes nothing: what `make test` checks (tests/test_gpu_check.py), so that the one
run a GPU session allows does not fail on plumbing.

On the `device` tool's H200 the image lacks hivemind, bitsandbytes and their needs, and its NumPy is too new:
`python -m benchmarks.gpu_wheels` gets them here as wheels, and its docstring gives the command to run there and
how to record the rows that come back (`--record`).
"""

GiB = 2**30
T4_BUDGET = 15 * GiB
# dense 16-bit tensor-core peaks (FLOP/s), by a part of the name torch reports
PEAKS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("V100", 125e12),
    ("T4", 65e12),
    ("P100", 18.7e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
)
HOPPER = ("H100", "H200")


@dataclass
class Shapes:
    """What one run measures: the paper's or, in a dry run, tiny ones."""

    preset: str
    device: str
    micro_batches: tuple[int, ...]  # tried for throughput and peak memory
    steps: int
    gpt2_sizes: tuple[str, ...]
    swarm_preset: str
    swarm_epochs: int
    swarm_settings: tuple[str, ...]  # --set values of the run (every peer's)
    candidates: int
    budget_bytes: int


PAPER = Shapes("paper", "cuda", (8, 16, 32), 4, ("small", "medium", "large"), "small", 5, (), 128, T4_BUDGET)
DRY = Shapes("tiny", "cpu", (2, 4), 2, (), "tiny", 1, ("optimizer.target_batch_size=64",), 4, T4_BUDGET)


def peak_flops(name: str) -> float | None:
    for part, flops in PEAKS:
        if part in name:
            return flops
    return None


def attention_scores_per_sample(config) -> int:
    """The attention scores one sample computes in one forward pass, layer by layer as the axial layouts compute
    them (collab_kit.model.attention.Layout.attend): the caption's T^2, every image position against the caption, and
    against its own group (a row or a column of S, or a band of (k // 2 + 1) x S rows for conv)."""
    from collab_kit.model.transformer import TextToImageTransformer

    T, S = config.text_length, config.image_side
    with torch.device("meta"):
        plan = TextToImageTransformer(config).plan
    total = 0
    for _, kind in plan:
        group = {"row": S, "column": S, "conv": (config.conv_kernel_size // 2 + 1) * S, "full": T + S * S}[kind]
        total += T * T + S * S * (T + group) if kind != "full" else (T + S * S) ** 2
    return total


def model_flops_per_sample(config) -> float:
    """Training FLOPs of one sample: 6 x compute parameters x positions, plus 12 x hidden x attention scores."""
    from collab_kit.model.transformer import TextToImageTransformer, count_compute_parameters

    with torch.device("meta"):
        compute = count_compute_parameters(TextToImageTransformer(config))
    return 6 * compute * config.sequence_length + 12 * config.hidden_size * attention_scores_per_sample(config)


def _batch(config, micro_batch: int, device) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(micro_batch)
    return dict(
        text_tokens=torch.randint(1, config.text_vocab_size, (micro_batch, config.text_length), generator=generator).to(
            device
        ),
        image_codes=torch.randint(0, config.codebook_size, (micro_batch, config.image_length), generator=generator).to(
            device
        ),
    )


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def train_steps(config, plan, micro_batch: int, steps: int) -> dict[str, float]:
    """Forward and backward through the kit's device path (autocast, loss scaling): seconds per step of the last
    ``steps - 1`` (the first warms up) and the peak memory of one step."""
    from collab_kit.model.device import LossScaler
    from collab_kit.model.transformer import TextToImageTransformer

    torch.manual_seed(0)
    model = TextToImageTransformer(config).to(plan.device).train()
    scaler = LossScaler(plan, model.parameters())
    batch = _batch(config, micro_batch, plan.device)
    try:
        seconds, peak = [], 0
        for step in range(steps):
            if plan.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            _synchronize(plan.device)
            start = time.perf_counter()
            with plan.autocast():
                loss = model(**batch).loss
            scaler.backward_and_unscale(loss)
            model.zero_grad(set_to_none=False)
            _synchronize(plan.device)
            if step or steps == 1:  # the first of several warms up
                seconds.append(time.perf_counter() - start)
            if plan.device.type == "cuda":
                peak = max(peak, torch.cuda.max_memory_allocated())
        return dict(
            seconds=sum(seconds) / len(seconds),
            peak=peak,
            samples_per_second=micro_batch / (sum(seconds) / len(seconds)),
            loss=float(loss.detach()),
        )
    finally:
        del model, scaler
        _free(plan.device)


def _free(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def top_kernels(config, plan, micro_batch: int, count: int = 5) -> str:
    """The CUDA kernels one training step spends most time in (what limits a missed utilization target)."""
    from torch.profiler import ProfilerActivity, profile

    from collab_kit.model.device import LossScaler
    from collab_kit.model.transformer import TextToImageTransformer

    model = TextToImageTransformer(config).to(plan.device).train()
    scaler, batch = LossScaler(plan, model.parameters()), _batch(config, micro_batch, plan.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if plan.device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        with plan.autocast():
            loss = model(**batch).loss
        scaler.backward_and_unscale(loss)
        _synchronize(plan.device)
    # by each event's own time: the autograd wrappers that enclose the kernels would otherwise come first
    key = "self_device_time_total" if plan.device.type == "cuda" else "self_cpu_time_total"
    events = sorted(profiler.key_averages(), key=lambda event: getattr(event, key, 0), reverse=True)[:count]
    del model
    _free(plan.device)
    return "; ".join(event.key[:60] for event in events)


def throughput_rows(shapes: Shapes, rows: list[dict]) -> None:
    """The paper preset in bf16 and fp16: samples/s and model FLOPs utilization at the largest micro-batch tried."""
    from collab_kit.config import get_preset
    from collab_kit.model.device import choose_device

    config = get_preset(shapes.preset).model
    per_sample = model_flops_per_sample(config)
    for precision in ("bf16", "fp16"):
        plan = choose_device(shapes.device, precision)
        best = None
        for micro_batch in shapes.micro_batches:
            try:
                measured = train_steps(config, plan, micro_batch, shapes.steps)
            except torch.cuda.OutOfMemoryError:
                _free(plan.device)
                break
            best = (micro_batch, measured)
            print(
                f"  {precision} micro-batch {micro_batch}: {measured['samples_per_second']:.1f} samples/s, peak "
                f"{measured['peak'] / GiB:.2f} GiB",
                flush=True,
            )
        if best is None:
            rows.append(
                common.make_row(
                    __spec__.name,
                    f"{shapes.preset} preset {precision}: utilization",
                    None,
                    ">= 0.40",
                    "no micro-batch fit",
                    details="out of memory at the smallest micro-batch",
                )
            )
            continue
        micro_batch, measured = best
        peak = peak_flops(plan.name)
        utilization = measured["samples_per_second"] * per_sample / peak if peak else None
        hopper = any(part in plan.name for part in HOPPER)
        details = (
            f"{plan.describe()}; micro-batch {micro_batch}, reversible layers: "
            f"{measured['samples_per_second']:.1f} samples/s, {per_sample / 1e12:.2f} TFLOP per sample, "
            f"peak {measured['peak'] / GiB:.2f} GiB per step"
        )
        if utilization is not None and hopper and utilization < 0.40:
            details += f"; top kernels: {top_kernels(config, plan, micro_batch)}"
        display = f"{utilization:.1%}" if utilization is not None else f"{measured['samples_per_second']:.1f}/s"
        rows.append(
            common.make_row(
                __spec__.name,
                f"{shapes.preset} preset {precision}: model FLOPs utilization",
                utilization,
                ">= 0.40" if hopper else ">= 0.0",
                display,
                details=details,
                note="no known 16-bit peak for this device"
                if peak is None
                else ""
                if hopper
                else "the 40% target is set for H100/H200",
            )
        )


def largest_within(config, plan, budget_bytes: int, limit: int = 128) -> int:
    """The largest micro-batch whose training step fits ``budget_bytes`` of the GPU (0: not one)."""
    if plan.device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, budget_bytes / torch.cuda.get_device_properties(plan.device).total_memory), plan.device
        )
    low, high = 0, limit
    try:
        while low < high:
            middle = (low + high + 1) // 2
            try:
                train_steps(config, plan, middle, 1)
                low = middle
            except torch.cuda.OutOfMemoryError:
                _free(plan.device)
                high = middle - 1
        return low
    finally:
        if plan.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, plan.device)


def budget_rows(shapes: Shapes, rows: list[dict]) -> None:
    """The largest micro-batch within 15 GiB, beside the preflight's choice for that budget."""
    import dataclasses

    from collab_kit import memory
    from collab_kit.config import get_preset
    from collab_kit.model.device import choose_device

    run = get_preset(shapes.preset)
    plan = choose_device(shapes.device, "fp16")  # a T4 trains in fp16
    # what the preflight and `collab-kit join` choose for a card of that memory (collab_kit.memory.fit_to_device)
    chosen = memory.recommend_for_plan(
        run, dataclasses.replace(plan, memory_bytes=shapes.budget_bytes), shapes.budget_bytes
    )
    largest = largest_within(run.model, plan, shapes.budget_bytes, limit=8 if plan.device.type == "cpu" else 128)
    rows.append(
        common.make_row(
            __spec__.name,
            f"{shapes.preset} preset: largest micro-batch within 15 GiB (fp16, reversible)",
            largest,
            ">= 1",
            str(largest),
            details=f"the preflight chooses micro-batch {chosen.micro_batch} for that budget ({chosen.reason})",
        )
    )


def paper_memory_rows(shapes: Shapes, rows: list[dict]) -> None:
    """Peak GPU memory of a training step of the paper preset / the estimate (weights, gradients and activations on
    the GPU; the offloaded optimizer's state on the CPU), reversible and not."""
    from collab_kit import memory
    from collab_kit.config import get_preset
    from collab_kit.model.device import choose_device

    plan = choose_device(shapes.device, "bf16")
    micro_batch = shapes.micro_batches[0]
    for reversible in (True, False):
        run = get_preset(shapes.preset, model=dict(reversible=reversible))
        estimate = memory.estimate(
            run, optimizer="8bit", offload=True, checkpointing=reversible, micro_batch=micro_batch, precision="mixed"
        )
        if plan.device.type != "cuda":
            print(
                f"  dry run: the paper memory estimate, reversible={reversible}: "
                f"{estimate.gpu_bytes / GiB:.3f} GiB (measured on a GPU only)",
                flush=True,
            )
            continue
        try:
            measured = train_steps(run.model, plan, micro_batch, 2)["peak"]
        except torch.cuda.OutOfMemoryError:
            _free(plan.device)
            measured = None
        ratio = measured / estimate.gpu_bytes if measured else None
        layers = "reversible" if reversible else "standard"
        rows.append(
            common.make_row(
                __spec__.name,
                f"{shapes.preset} preset memory measured / estimated ({layers} layers, micro-batch {micro_batch})",
                None if ratio is None else abs(ratio - 1),
                "<= 0.10",
                f"{ratio:.3f}x" if ratio else "out of memory",
                note="the distance from 1",
                details=f"peak {measured / GiB if measured else float('nan'):.2f} GiB, estimated "
                f"{estimate.gpu_bytes / GiB:.2f} GiB",
            )
        )


def gpt2_memory_rows(shapes: Shapes, rows: list[dict]) -> None:
    """GPT-2's memory against the estimate, through benchmarks/memory_gpu.py."""
    if not shapes.gpt2_sizes:
        from collab_kit import memory

        estimate = memory.estimate("gpt2-small", optimizer="8bit", checkpointing=True, micro_batch=1, seq_len=128)
        print(f"  dry run: gpt2-small estimate {estimate.gpu_bytes / GiB:.3f} GiB (measured on a GPU only)")
        return
    from benchmarks import memory_gpu

    for row in memory_gpu.measure(shapes.gpt2_sizes, micro_batch=4, seq_len=1024, steps=2):
        name = (
            f"{row['model']} memory measured / estimated ({row['optimizer']} Adam"
            f"{', checkpointing' if row['checkpointing'] else ''})"
        )
        ratio = row.get("ratio_peak")
        rows.append(
            common.make_row(
                __spec__.name,
                name,
                None if ratio is None else abs(ratio - 1),
                "<= 0.10",
                f"{ratio:.3f}x" if ratio else row.get("error", "-"),
                note="the distance from 1",
                details=memory_gpu.format_row(row),
            )
        )


def swarm_rows(shapes: Shapes, rows: list[dict], workdir: str) -> None:
    """Two volunteers through ``collab-kit join --device`` with a monitor on 127.0.0.1: every epoch averaged."""
    from collab_kit.config import get_preset
    from collab_kit.data.synthetic import make_synthetic_shards
    from collab_kit.roles.processes import PeerProcess

    config = get_preset(shapes.swarm_preset)
    shards = os.path.join(workdir, "shards")
    make_synthetic_shards(shards, 1024, config.model.image_side, config.model.codebook_size)
    common_args = [
        "--preset",
        shapes.swarm_preset,
        "--run-id",
        "gpu_check",
        "--host",
        "127.0.0.1",
        *[arg for setting in shapes.swarm_settings for arg in ("--set", setting)],
    ]
    peers = []
    try:
        monitor = PeerProcess(
            "monitor",
            [
                "monitor",
                *common_args,
                "--data",
                shards,
                "--events",
                "--db",
                "",
                "--checkpoint-every",
                "0",
                "--poll-every",
                "1",
            ],
            os.path.join(workdir, "monitor.log"),
        )
        peers.append(monitor)
        addresses = monitor.wait_for(lambda e: e["type"] == "ready", timeout=120, what="its address")["addresses"]
        for index in range(2):
            peers.append(
                PeerProcess(
                    f"volunteer-{index}",
                    [
                        "join",
                        *common_args,
                        "--initial-peers",
                        *addresses,
                        "--device",
                        shapes.device,
                        "--events",
                        "--no-progress",
                        "--max-epochs",
                        str(shapes.swarm_epochs),
                        "--wait-for-peers",
                        "2",
                    ],
                    os.path.join(workdir, f"volunteer-{index}.log"),
                )
            )
        dones, averaged, devices, alone = [], [], [], []
        for peer in peers[1:]:
            ready = peer.wait_for(lambda e: e["type"] == "ready", timeout=120, what="its start")
            devices.append(f"{ready['device']} {ready['precision']}")
            dones.append(peer.wait_for(lambda e: e["type"] == "done", timeout=240, what="the end of training"))
            averaged.append(sum(e["averaged"] for e in peer.events if e["type"] == "epoch"))
            alone.append([e["epoch"] for e in peer.events if e["type"] == "epoch" and not e["averaged"]])
    finally:
        for peer in reversed(peers):
            peer.kill()
    epochs = min(done["final_epoch"] for done in dones)
    share = min(averaged) / max(1, epochs)
    rows.append(
        common.make_row(
            __spec__.name,
            f"2 volunteers of the {shapes.swarm_preset} preset on {shapes.device}: epochs averaged",
            share,
            ">= 1.0",
            f"{min(averaged)}/{epochs}",
            details=f"devices {', '.join(devices)}; averaged rounds {averaged}; epochs not averaged {alone}; "
            f"fp16 overflows skipped "
            f"{[done.get('overflow_steps', 0) for done in dones]}",
        )
    )


def generation_rows(shapes: Shapes, rows: list[dict]) -> None:
    """Candidates of the paper preset's 1024 codes, with the KV cache (random weights), in seconds."""
    from collab_kit.config import get_preset
    from collab_kit.model.device import choose_device
    from collab_kit.model.sampling import generate_image_codes
    from collab_kit.model.transformer import TextToImageTransformer

    config = get_preset(shapes.preset).model
    plan = choose_device(shapes.device, "auto")
    torch.manual_seed(0)
    model = TextToImageTransformer(config).to(plan.device).eval()
    captions = torch.randint(1, config.text_vocab_size, (shapes.candidates, config.text_length), device=plan.device)
    _synchronize(plan.device)
    start = time.perf_counter()
    with plan.autocast():
        codes = generate_image_codes(model, captions, top_k=256)
    _synchronize(plan.device)
    seconds = time.perf_counter() - start
    del model
    _free(plan.device)
    rows.append(
        common.make_row(
            __spec__.name,
            f"{shapes.preset} preset: {shapes.candidates} candidates of {config.image_length} codes with the KV cache",
            seconds,
            ">= 0",
            f"{seconds:.1f} s",
            details=f"{plan.describe()}, top-k 256, codes {tuple(codes.shape)}",
        )
    )


# the figures a session most needs first: a run cut short by the device's time limit keeps those
PARTS: tuple[tuple[str, Callable], ...] = (
    ("throughput", throughput_rows),
    ("two volunteers", None),
    ("15 GiB", budget_rows),
    ("generation", generation_rows),
    ("paper memory", paper_memory_rows),
    ("GPT-2 memory", gpt2_memory_rows),
)


def measure(shapes: Shapes, out: str | None = None) -> list[dict]:
    """Every part, in order; a part that fails is an error row, the others still run. With ``out``, the rows so far
    are written there as JSON after each part, so a run stopped midway keeps what it measured (``--record``)."""
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="collab_kit_gpu_check_") as workdir:
        for name, part in PARTS:
            started = time.perf_counter()
            print(f"- {name}", flush=True)
            try:
                if part is None:
                    swarm_rows(shapes, rows, workdir)
                else:
                    part(shapes, rows)
            except Exception as e:  # one part's failure must not cost the figures of the others
                rows.append(common.error_row(__spec__.name, e) | dict(name=f"{name} (failed)"))
                print(f"  failed: {type(e).__name__}: {e}", flush=True)
            print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)
            if out:
                with open(out, "w") as f:
                    json.dump(rows, f, indent=1)
    return rows


def run(quick: bool = False) -> list[dict]:
    """What ``make bench`` runs: the GPU figures where there is a GPU, nothing (and a word) where there is none."""
    if not torch.cuda.is_available():
        print("  no CUDA GPU here: skipped (python -m benchmarks.gpu_check on a machine with one; its rows stay)")
        return []
    return measure(PAPER)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="every part on the CPU with tiny shapes, in seconds; nothing is written"
    )
    parser.add_argument("--out", help="also write the rows to this JSON file, after each part")
    parser.add_argument(
        "--record", metavar="JSON", help="record in RESULTS.md the rows a GPU run wrote with --out (measures nothing)"
    )
    args = parser.parse_args(argv)
    if args.record:
        with open(args.record) as f:
            rows = json.load(f)
        common.record(rows, [sys.modules[__name__]])
        print(common.format_table(rows))
        print(f"wrote {os.path.relpath(common.RESULTS_MD)}")
        return 0
    if args.dry_run:
        rows = measure(DRY, args.out)
    elif not torch.cuda.is_available():
        print(
            "benchmarks/gpu_check.py needs a CUDA GPU and none is available here: nothing measured (--dry-run "
            "checks its plumbing on the CPU)"
        )
        return 0
    else:
        rows = measure(PAPER, args.out)
    print(common.format_table(rows))
    failed = [row for row in rows if row["value"] is None and row["display"] == "error"]
    if not args.dry_run:
        common.record(rows, [sys.modules[__name__]])
        print(f"wrote {os.path.relpath(common.RESULTS_MD)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
