"""GPU memory of GPT-2 training steps, measured against collab_kit.memory.estimator.estimate (needs a CUDA GPU).

    python benchmarks/memory_gpu.py --out results.json                  # GPT-2 small, medium, large
    python benchmarks/memory_gpu.py --models small --micro-batch 8 --steps 2

For each GPT-2 size (built from GPT2Config with random weights: nothing is downloaded), with
torch.optim.Adam ("32bit") and bitsandbytes' Adam8bit ("8bit"), without and with gradient
checkpointing, a few training steps run at ``--seq-len`` tokens under bf16 autocast (fp32 parameters:
the estimate's "mixed" precision). Of the last step, measured with torch.cuda's allocator statistics:

- weights, gradients, optimizer state: the bytes of the tensors (collab_kit.memory.measured.parameter_bytes,
  gradient_bytes, optimizer_state_bytes), which the estimate should match exactly;
- activations: the peak of forward + backward minus the memory allocated before the forward pass
  (the gradients already exist then: they are zeroed, not freed, between steps);
- peak: torch.cuda.max_memory_allocated over forward + backward, against ``estimate().gpu_bytes``,
  and over the whole step, optimizer step included.

Ratios are measured / estimated. Not part of ``make bench`` (benchmarks/run_all.py): it needs a GPU.
On a machine without one it says so and exits with status 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script from a checkout: import the kit from it
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

SIZES = {"small": "gpt2-small", "medium": "gpt2-medium", "large": "gpt2-large", "xl": "gpt2-xl"}


def gpt2_config(size: str, attention: str = "sdpa", **fields) -> dict:
    """GPT2Config fields of a GPT-2 size (the catalogue's shape), e.g. ``GPT2Config(**gpt2_config("small"))``.

    :param fields: more GPT2Config fields, e.g. ``resid_pdrop=0.0``
    """
    from collab_kit.memory.catalogue import CATALOGUE

    shape = CATALOGUE[SIZES[size]]
    return dict(
        n_layer=shape.layers,
        n_embd=shape.hidden,
        n_head=shape.heads,
        n_inner=shape.ffn,
        vocab_size=shape.vocab,
        n_positions=shape.seq_len,
        use_cache=False,
        attn_implementation=attention,
        **fields,
    )


def build_model(size: str, checkpointing: bool, attention: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(**gpt2_config(size, attention))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT2LMHeadModel(config)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def make_optimizer(name: str, model):
    if name == "8bit":
        import bitsandbytes as bnb

        return bnb.optim.Adam8bit(model.parameters(), lr=1e-5)
    return torch.optim.Adam(model.parameters(), lr=1e-5)


def measure_one(
    size: str,
    optimizer_name: str,
    checkpointing: bool,
    micro_batch: int,
    seq_len: int,
    steps: int,
    attention: str = "sdpa",
) -> dict:
    """Train ``steps`` steps; the figures of the last one, the estimate and their ratios."""
    from collab_kit import memory

    row = dict(
        model=SIZES[size],
        optimizer=optimizer_name,
        checkpointing=checkpointing,
        micro_batch=micro_batch,
        seq_len=seq_len,
        attention=attention,
    )
    # from the shape's dimensions, before anything is built: an estimate counted from the built model's own
    # tensors would equal the measured weights and gradients by construction
    estimate = memory.estimate(
        SIZES[size],
        optimizer=optimizer_name,
        checkpointing=checkpointing,
        micro_batch=micro_batch,
        seq_len=seq_len,
        precision="mixed",
        attention=attention,
    )
    model = optimizer = None
    try:
        model = build_model(size, checkpointing, attention)
        optimizer = make_optimizer(optimizer_name, model)
        tokens = torch.randint(0, model.config.vocab_size, (micro_batch, seq_len), device="cuda")
        start = time.perf_counter()
        for _ in range(steps):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            del loss
            torch.cuda.synchronize()
            forward_backward_peak = torch.cuda.max_memory_allocated()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)  # keep the gradients allocated: `before` then includes them
            torch.cuda.synchronize()
            step_peak = torch.cuda.max_memory_allocated()
        row["seconds_per_step"] = (time.perf_counter() - start) / steps
        measured = dict(
            weights=memory.parameter_bytes(model),
            gradients=memory.gradient_bytes(model),
            optimizer=memory.optimizer_state_bytes(optimizer),
            activations=forward_backward_peak - before,
            forward_backward_peak=forward_backward_peak,
            step_peak=step_peak,
        )
    except torch.cuda.OutOfMemoryError as e:
        row["error"] = f"out of memory: {str(e).splitlines()[0]}"
        measured = None
    finally:
        del model, optimizer
        gc.collect()
        torch.cuda.empty_cache()
    row["estimated"] = dict(
        weights=estimate.weights_bytes,
        gradients=estimate.gradients_bytes,
        optimizer=estimate.optimizer_bytes,
        activations=estimate.activations_bytes,
        weight_copies=estimate.weight_copies_bytes,
        gpu=estimate.gpu_bytes,
    )
    if measured is not None:
        row["measured"] = measured
        row["exact"] = {
            part: measured[part] == row["estimated"][part] for part in ("weights", "gradients", "optimizer")
        }
        row["ratio_activations"] = measured["activations"] / estimate.activations_bytes
        row["ratio_peak"] = measured["forward_backward_peak"] / estimate.gpu_bytes
    return row


def measure(
    sizes=("small", "medium", "large"),
    micro_batch: int = 4,
    seq_len: int = 1024,
    steps: int = 3,
    optimizers=("32bit", "8bit"),
    attention: str = "sdpa",
) -> list[dict]:
    """Every size x optimizer x checkpointing; a JSON-able list of rows."""
    rows = []
    for size in sizes:
        for optimizer_name in optimizers:
            for checkpointing in (False, True):
                row = measure_one(size, optimizer_name, checkpointing, micro_batch, seq_len, steps, attention)
                print(format_row(row), flush=True)
                rows.append(row)
    return rows


def format_row(row: dict) -> str:
    gib = 2**30
    setting = (
        f"{row['model']:<12} {row['optimizer']:>5} {'ckpt' if row['checkpointing'] else '    '} "
        f"b={row['micro_batch']} s={row['seq_len']}"
    )
    if "measured" not in row:
        return f"{setting}  {row.get('error')} (estimated {row['estimated']['gpu'] / gib:.2f} GiB)"
    m, e = row["measured"], row["estimated"]
    exact = "exact" if all(row["exact"].values()) else f"NOT exact {row['exact']}"
    return (
        f"{setting}  activations {m['activations'] / gib:6.2f} / {e['activations'] / gib:6.2f} GiB "
        f"(x{row['ratio_activations']:.2f})  peak {m['forward_backward_peak'] / gib:6.2f} / {e['gpu'] / gib:6.2f} "
        f"GiB (x{row['ratio_peak']:.2f})  step peak {m['step_peak'] / gib:6.2f} GiB  states {exact}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["small", "medium", "large"], choices=list(SIZES))
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3, help="steps per setting; the last one is measured")
    parser.add_argument("--optimizers", nargs="+", default=["32bit", "8bit"], choices=["32bit", "8bit"])
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--out", help="write the rows to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "benchmarks/memory_gpu.py measures GPU memory and needs a CUDA GPU; none is available here "
            f"(torch {torch.__version__}): skipped."
        )
        return 0
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step allocates the optimizer state and gradients")
    import bitsandbytes
    import transformers

    rows = measure(args.models, args.micro_batch, args.seq_len, args.steps, args.optimizers, args.attention)
    result = dict(
        machine=f"{torch.cuda.get_device_name(0)}, {platform.machine()}",
        versions=dict(
            torch=torch.__version__, transformers=transformers.__version__, bitsandbytes=bitsandbytes.__version__
        ),
        rows=rows,
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
