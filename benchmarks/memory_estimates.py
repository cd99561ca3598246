"""collab_kit.memory.estimator.estimate against the bytes of real GPT-2 training steps on the CPU (target: states exact,
activations within 10 %).

GPT-2 small, medium and large (random weights, nothing downloaded) at 1024 tokens under bf16 autocast
(the estimate's "mixed" precision): the weights, gradients and optimizer state after one real step
(32-bit Adam, bitsandbytes' 8-bit Adam), and the activations of a forward pass with and without gradient
checkpointing, as autograd keeps them.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import time
import weakref
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import common
from benchmarks.memory_gpu import SIZES, gpt2_config, make_optimizer

TITLE = "Memory estimates: measured / estimated (GPT-2 small, medium, large on the CPU)"
HOW = """
This CPU benchmark checks the byte formulas of `collab_kit.memory.estimator.estimate`; what a GPU adds on top
(allocator rounding and fragmentation, CUDA workspaces, which fused kernels run, the CUDA context) is
measured by `benchmarks/memory_gpu.py` on a GPU (`python benchmarks/memory_gpu.py --out gpu.json`).
Each GPT-2 size is built from its `collab_kit.memory.catalogue.CATALOGUE` shape with
`collab_kit.tutorial.finetuning.load_gpt2(dict of GPT2Config fields, device="cpu")` (seed 0, random weights,
dropout 0 as in `tests/memory/test_memory.py`: on a CPU dropout keeps fp32 masks where CUDA keeps bytes;
torch's SDPA attention), fed 1024 random tokens per sample under `torch.autocast("cpu", torch.bfloat16)`
with fp32 parameters, and compared with `estimate(model, micro_batch=b, seq_len=1024,
precision="mixed", checkpointing=...)`. Each setting is measured once: bytes are deterministic.

- Weights, gradients, optimizer state: after one real step (forward and backward of one sample with
  checkpointing, then `optimizer.step()` with `torch.optim.Adam` and, on the same gradients, bitsandbytes'
  `Adam8bit`), the bytes of the tensors (`collab_kit.memory.measured.parameter_bytes`, `gradient_bytes`,
  `optimizer_state_bytes`) must equal those of `estimate("gpt2-small" | ...)`, the catalogue shape counted from its
  dimensions (an estimate of the built model's own tensors would match by construction). That step runs in fp32:
  parameters and gradients are
  fp32 under autocast too, and this CPU (no bf16 instructions) runs bf16 products three times slower.
- Activations, without checkpointing: every storage alive at the end of the forward pass (still inside
  autocast) that the forward created, parameters excluded, each storage once: what autograd saves for
  backward (`torch.autograd.graph.saved_tensors_hooks`, as `tests/memory/test_memory.py` counts it), autocast's
  cached 16-bit weight copies and the returned logits (tensors a `TorchDispatchMode` saw created, still
  alive); plus the fp32 gradient of the log-probabilities that backward starts from (its bytes, taken by a
  hook on the log-softmax's backward), which the estimate also counts.
- With gradient checkpointing (`use_reentrant=False`, as `load_gpt2` sets it): the same count at the end of
  the forward pass (each checkpointed block keeps only its input, but autocast's cache still holds every
  block's weight copies until the autocast context exits), plus the log-probabilities' gradient, plus the
  storages one block saves when it is recomputed: its forward run once more under autocast with the inputs
  the checkpoint kept, inside the hooks (the largest one-layer recompute; GPT-2's blocks are all alike). The
  block's own weight copies (casts of a parameter, `aten._to_copy`) are left out of that part: they are
  the same bytes autocast's cache held at the end of the forward pass, gone by then, and counted there once.
- Each activations figure shows measured / estimated without and with checkpointing; the target is within
  10 % (the value is the larger of the two deviations). The parts are counted at different moments (the end
  of the forward pass, the start of backward, one block's recompute) and added, as the estimate adds them:
  an upper bound of the peak, not the peak itself; short-lived buffers of backward are not counted.
"""

# (size, micro-batch): every size at micro-batch 1, GPT-2 small at 2 as well; one real step per size
SETTINGS = (("small", 1), ("small", 2), ("medium", 1), ("large", 1))
QUICK_SETTINGS = (("small", 1),)
SEQ_LEN = 1024
QUICK_SEQ_LEN = 128
TARGET = 0.10  # activations within 10 % of the estimate


class _CreatedTensors(TorchDispatchMode):
    """Remembers (weakly) every tensor an operation returns, and which are casts of a parameter (autocast's
    16-bit weight copies): which of them are still alive can be asked later."""

    def __init__(self, parameters: set):
        super().__init__()
        self.parameters = parameters  # data pointers of the parameters' storages
        self.created: list[tuple[weakref.ref, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        is_copy = (
            func is torch.ops.aten._to_copy.default
            and torch.is_tensor(args[0])
            and args[0].untyped_storage().data_ptr() in self.parameters
        )
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if torch.is_tensor(value):
                self.created.append((weakref.ref(value), is_copy))
        return out

    def alive(self, copies_only: bool = False) -> list[torch.Tensor]:
        found = ((ref(), is_copy) for ref, is_copy in self.created if is_copy or not copies_only)
        return [tensor for tensor, _ in found if tensor is not None]


def _storages(tensors, excluded: set) -> dict[int, int]:
    """data pointer -> bytes of each distinct storage of ``tensors`` not in ``excluded`` (empty ones left out)."""
    found = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in excluded:
            found[storage.data_ptr()] = storage.nbytes()
    return found


def _saving_hook(into: list[torch.Tensor]):
    """Saved-tensor hooks that list every tensor autograd saves (the list must be cleared after use)."""

    def pack(tensor):
        into.append(tensor)
        # the same storage without the autograd history: a saved output returned as is would keep its own
        # graph node alive from that node's saved variables, a reference cycle that keeps the whole graph
        return tensor.detach()

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


def _find_node(root, name: str):
    """The first autograd node called ``name`` (e.g. LogSoftmaxBackward0) reachable from ``root``."""
    todo, seen = [root], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() == name:
            return node
        todo += [child for child, _ in node.next_functions]
    raise RuntimeError(f"no {name} in the loss's graph: transformers computes its loss differently now")


def _autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def measure_activations(model, tokens: torch.Tensor) -> dict[str, int]:
    """Bytes of the activations of a forward pass of ``model`` (a GPT2LMHeadModel) on ``tokens`` under bf16
    autocast, part by part (see HOW): saved, live, copies, logits_gradient, recompute (and its weight copies
    recompute_copies, not in the total), total."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    checkpointing = model.is_activation_checkpointing
    last_block = model.transformer.h[-1]
    block_call = {}
    handle = last_block.register_forward_pre_hook(
        lambda module, args, kwargs: block_call.update(args=args, kwargs=kwargs), with_kwargs=True
    )
    saved: list[torch.Tensor] = []
    created = _CreatedTensors(parameters)
    try:
        with _saving_hook(saved), _autocast():
            with created:
                output = model(input_ids=tokens, labels=tokens)
            # still inside autocast: its cache of 16-bit weight copies is alive, as in a training step
            saved_bytes = _storages(saved, parameters)
            live = {**_storages(created.alive(), parameters), **saved_bytes}
            copies = _storages(created.alive(copies_only=True), parameters)
    finally:
        handle.remove()
    del created
    recompute = recompute_copies = {}
    if checkpointing:  # one block's forward again, with what its checkpoint kept, as backward recomputes it;
        # autocast's cache is gone by then (its storages may be reused): only what the forward saved is shared
        replayed: list[torch.Tensor] = []
        replay = _CreatedTensors(parameters)
        last_block.gradient_checkpointing = False
        try:
            with _saving_hook(replayed), _autocast():
                with replay:
                    last_block(*block_call["args"], **block_call["kwargs"])
                recompute_copies = _storages(replay.alive(copies_only=True), parameters)
        finally:
            last_block.gradient_checkpointing = True
        # the block's weight copies are counted once, in autocast's cache at the end of the forward pass
        recompute = {
            ptr: n
            for ptr, n in _storages(replayed, parameters).items()
            if ptr not in saved_bytes and ptr not in recompute_copies
        }
        replayed.clear()  # the graph keeps the hook, and the hook this list
        del replay
    saved.clear()  # the graph keeps the hook, and the hook this list
    # the gradient backward starts from: what reaches the log-softmax of the loss (fp32, one value per logit)
    logits_gradient = []
    node = _find_node(output.loss.grad_fn, "LogSoftmaxBackward0")
    hook = node.register_prehook(
        lambda grads: logits_gradient.append(sum(g.untyped_storage().nbytes() for g in grads if g is not None))
    )
    torch.autograd.grad(output.loss, output.logits)
    hook.remove()
    result = dict(
        saved=sum(saved_bytes.values()),
        live=sum(live.values()),
        copies=sum(copies.values()),
        logits_gradient=logits_gradient[0],
        recompute=sum(recompute.values()),
        recompute_copies=sum(recompute_copies.values()),
    )
    result["total"] = result["live"] + result["logits_gradient"] + result["recompute"]
    del output
    block_call.clear()
    return result


def _release_memory() -> None:
    """Free what Python no longer references and hand glibc's free pages back to the system: without it, the
    freed activations of GPT-2 large stay in the process (fragmented) and its memory grows towards 20 GB."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def measure_size(size: str, micro_batches: Sequence[int], seq_len: int) -> list[dict]:
    """One GPT-2 size: the activations at each micro-batch without and with checkpointing, then the states
    after one real step."""
    from collab_kit import memory
    from collab_kit.tutorial.finetuning import load_gpt2

    start = time.perf_counter()
    fields = gpt2_config(size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = load_gpt2(fields, gradient_checkpointing=False, device="cpu")
    generator = torch.Generator().manual_seed(0)
    rows = []
    for checkpointing in (False, True):
        if checkpointing:  # as collab_kit.tutorial.finetuning.load_gpt2 turns it on
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        for micro_batch in micro_batches:
            tokens = torch.randint(0, model.config.vocab_size, (micro_batch, seq_len), generator=generator)
            activations = measure_activations(model, tokens)
            estimate = memory.estimate(
                model,
                micro_batch=micro_batch,
                seq_len=seq_len,
                precision="mixed",
                checkpointing=checkpointing,
                attention="sdpa",
            )
            rows.append(
                dict(
                    model=SIZES[size],
                    micro_batch=micro_batch,
                    seq_len=seq_len,
                    checkpointing=checkpointing,
                    measured=activations,
                    ratio=activations["total"] / estimate.activations_bytes,
                    estimated=dict(activations=estimate.activations_bytes, copies=estimate.weight_copies_bytes),
                )
            )
            print(f"  {format_row(rows[-1])} ({time.perf_counter() - start:.0f} s)", flush=True)
            _release_memory()
    # one real step, with checkpointing and in fp32 (autocast's parameters and gradients are fp32 too, so their
    # bytes are the same; on this CPU without bf16 instructions, an fp32 step takes a third of the time)
    tokens = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=generator)
    model(input_ids=tokens, labels=tokens).loss.backward()
    _release_memory()
    rows[0]["states"] = measure_states(model, SIZES[size], seq_len)
    print(
        f"  {SIZES[size]} after a step: {format_states(rows[0]['states'])} ({time.perf_counter() - start:.0f} s)",
        flush=True,
    )
    del model
    _release_memory()
    return rows


def measure_states(model, shape_name: str, seq_len: int) -> dict[str, dict]:
    """Weights, gradients and optimizer state after a step of each optimizer on the gradients ``model`` holds,
    against the estimate of the catalogue shape ``shape_name`` (from its dimensions, not from ``model``'s
    tensors: an estimate counted from the same tensors would equal the measurement by construction)."""
    from collab_kit import memory

    states = {}
    for name in ("32bit", "8bit"):
        optimizer = make_optimizer(name, model)
        optimizer.step()
        estimate = memory.estimate(shape_name, optimizer=name, seq_len=seq_len)
        states[name] = dict(
            measured=dict(
                weights=memory.parameter_bytes(model),
                gradients=memory.gradient_bytes(model),
                optimizer=memory.optimizer_state_bytes(optimizer),
            ),
            estimated=dict(
                weights=estimate.weights_bytes, gradients=estimate.gradients_bytes, optimizer=estimate.optimizer_bytes
            ),
        )
        del optimizer  # its state goes before the next one is built
        _release_memory()
    model.zero_grad(set_to_none=True)
    return states


def format_states(states: dict[str, dict]) -> str:
    return "; ".join(
        f"{name} Adam measured/estimated "
        + ", ".join(f"{part} {state['measured'][part] / state['estimated'][part]:.3f}" for part in state["measured"])
        for name, state in states.items()
    )


def format_row(row: dict) -> str:
    m = row["measured"]
    how = "checkpointing" if row["checkpointing"] else "no checkpointing"
    text = (
        f"{row['model']} b={row['micro_batch']} {how}: activations {common.fmt_bytes(m['total'])} measured "
        f"(saved {common.fmt_bytes(m['saved'])}, alive at the end of forward {common.fmt_bytes(m['live'])}, "
        f"log-prob gradient {common.fmt_bytes(m['logits_gradient'])}"
        + (
            f", one block's recompute {common.fmt_bytes(m['recompute'])} + its weight copies "
            f"{common.fmt_bytes(m['recompute_copies'])}"
            if row["checkpointing"]
            else ""
        )
        + f") / {common.fmt_bytes(row['estimated']['activations'])} estimated = {row['ratio']:.3f}; weight copies "
        f"{common.fmt_bytes(m['copies'])} / {common.fmt_bytes(row['estimated']['copies'])}"
    )
    return text


def measure(settings=SETTINGS, seq_len: int = SEQ_LEN) -> list[dict]:
    sizes: dict[str, list[int]] = {}
    for size, micro_batch in settings:
        sizes.setdefault(size, []).append(micro_batch)
    return [row for size, batches in sizes.items() for row in measure_size(size, batches, seq_len)]


def run(quick: bool = False) -> list[dict]:
    rows = measure(QUICK_SETTINGS, QUICK_SEQ_LEN) if quick else measure()
    results = []
    # weights, gradients, optimizer state: one figure, every part of every size and optimizer must be exact
    parts = [
        (row["model"], name, part, state["measured"][part], state["estimated"][part])
        for row in rows
        for name, state in row.get("states", {}).items()
        for part in state["measured"]
    ]
    worst = max(abs(measured / estimated - 1) for *_, measured, estimated in parts)
    exact = sum(measured == estimated for *_, measured, estimated in parts)
    per_model = "; ".join(
        f"{row['model']}: weights {common.fmt_bytes(row['states']['32bit']['measured']['weights'])}, 32-bit Adam "
        f"state {common.fmt_bytes(row['states']['32bit']['measured']['optimizer'])}, 8-bit Adam state "
        f"{common.fmt_bytes(row['states']['8bit']['measured']['optimizer'])}"
        for row in rows
        if "states" in row
    )
    results.append(
        common.make_row(
            __spec__.name,
            "memory estimate: weights, gradients, optimizer state after a step, measured / estimated, "
            "deviation from 1 (GPT-2 S/M/L, 32-bit and 8-bit Adam)",
            worst,
            "<= 0",
            "exact" if exact == len(parts) else f"off by {worst:.2%}",
            f"{exact} of {len(parts)} byte counts equal the estimate's ({per_model}).",
            note=f"{exact}/{len(parts)} exact",
        )
    )
    # activations: one figure per size and micro-batch, the worse of without and with checkpointing
    for model, micro_batch in dict.fromkeys((row["model"], row["micro_batch"]) for row in rows):
        pair = {
            row["checkpointing"]: row for row in rows if row["model"] == model and row["micro_batch"] == micro_batch
        }
        deviation = max(abs(row["ratio"] - 1) for row in pair.values())
        details = " ".join(
            f"{'With' if checkpointing else 'Without'} checkpointing: {common.fmt_bytes(row['measured']['total'])} "
            f"measured / {common.fmt_bytes(row['estimated']['activations'])} estimated "
            f"({common.fmt_bytes(row['measured']['saved'])} saved for backward, "
            f"{common.fmt_bytes(row['measured']['live'])} alive at the end of the forward pass with autocast's "
            f"cached weight copies ({common.fmt_bytes(row['measured']['copies'])}, estimated "
            f"{common.fmt_bytes(row['estimated']['copies'])}) and the logits, "
            f"{common.fmt_bytes(row['measured']['logits_gradient'])} "
            f"log-probabilities' gradient"
            + (
                f", {common.fmt_bytes(row['measured']['recompute'])} more while one block is recomputed"
                if checkpointing
                else ""
            )
            + ")."
            for checkpointing, row in sorted(pair.items())
        )
        seq = pair[False]["seq_len"]
        results.append(
            common.make_row(
                __spec__.name,
                f"memory estimate: activations, measured / estimated without / with checkpointing, "
                f"deviation from 1 ({model}, {seq} tokens, micro-batch {micro_batch}, bf16 autocast)",
                deviation,
                f"<= {TARGET}",
                f"{pair[False]['ratio']:.3f} / {pair[True]['ratio']:.3f}",
                details,
                note="ratios without / with checkpointing",
            )
        )
    return results


if __name__ == "__main__":
    common.main(sys.modules[__name__])
