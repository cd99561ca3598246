"""Silences the kit applies only around the calls that need them, never to the user's whole process.

A notebook shows every logged warning as a red box, so a run where nothing is wrong must log none; but a filter
left on a library's logger, or a warnings filter set at import, would also hide what that library says later about
the user's own work. So each silence here holds for one call.
"""
import contextlib
import logging
from types import ModuleType
from typing import Iterator


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


def import_bitsandbytes() -> ModuleType:
    """bitsandbytes, imported without its warning that the optional CPU kernels of 4-bit layers are missing: the kit
    uses its 8-bit optimizers only (the warning comes once, at the first import)."""
    with without_log_messages("bitsandbytes.backends.cpu.ops", "gemm_4bit"):
        # lazy: imported inside the silence, which only a function can scope
        import bitsandbytes

    return bitsandbytes
