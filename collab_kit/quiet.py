"""Silences the kit applies only around the calls that need them, never to the user's whole process.

A notebook shows every logged warning as a red box, so a run where nothing is wrong must log none; but a filter
left on a library's logger, or a warnings filter set at import, would also hide what that library says later about
the user's own work. So each silence here holds for one call.
"""

import contextlib
import logging
import sys
from collections.abc import Iterator
from types import ModuleType


class _DropMessages(logging.Filter):
    def __init__(self, fragment: str):
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


@contextlib.contextmanager
def without_log_messages(logger_name: str, fragment: str) -> Iterator[None]:
    """Drop the records of ``logger_name`` whose message contains ``fragment``, inside the ``with`` block only."""
    logger, dropped = logging.getLogger(logger_name), _DropMessages(fragment)
    logger.addFilter(dropped)
    try:
        yield
    finally:
        logger.removeFilter(dropped)


@contextlib.contextmanager
def without_torch_compile() -> Iterator[None]:
    """``torch.compile`` raises inside the ``with`` block, so that what a library compiles at import stays plain Python
    (bitsandbytes falls back to the function itself when compiling fails)."""
    import torch  # lazy: this module is below every layer that imports torch, and `collab-kit --help` loads no torch

    compile_function = torch.compile

    def refuse(*args, **kwargs):
        raise RuntimeError("torch.compile is off while bitsandbytes is imported")

    torch.compile = refuse
    try:
        yield
    finally:
        torch.compile = compile_function


@contextlib.contextmanager
def without_module(module_name: str) -> Iterator[None]:
    """Importing ``module_name`` raises ImportError inside the ``with`` block; outside it, the module is as it was."""
    missing = object()
    before = sys.modules.get(module_name, missing)
    sys.modules[module_name] = None  # the import system's mark for "not importable"
    try:
        yield
    finally:
        if before is missing:
            sys.modules.pop(module_name, None)
        else:
            sys.modules[module_name] = before


def import_bitsandbytes() -> ModuleType:
    """bitsandbytes, imported without its warning that the optional CPU kernels of 4-bit layers are missing (the kit
    uses its 8-bit optimizers only; the warning comes once, at the first import), and without compiling the default
    backend's fallbacks.

    Those fallbacks serve devices that have no kernels of their own; the 8-bit and 32-bit optimizer steps run the CPU
    and CUDA backends' kernels. Wrapping them in ``torch.compile`` at import loads TorchDynamo and Inductor: about 2.5 s
    of every peer process's start on these machines, for nothing it runs.

    Nor may it fetch those kernels from the Hub: where the ``kernels`` package is installed (transformers >= 5.25
    requires it), bitsandbytes downloads them at import on CPUs with AVX-512 BF16, and offline it logs a warning.
    Shown by
    ``tests/swarm/test_optim.py::test_importing_the_kit_prints_nothing_of_bitsandbytes_unused_4bit_kernels``."""
    with (
        without_log_messages("bitsandbytes.backends.cpu.ops", "gemm_4bit"),
        without_torch_compile(),
        without_module("kernels"),
    ):
        # lazy: imported inside the silence, which only a function can scope
        import bitsandbytes

    return bitsandbytes
