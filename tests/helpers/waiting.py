"""Waiting in tests on something another process or thread does: a deadline, never a bare sleep."""

import time


def wait_until(predicate, timeout=20.0, what="the condition", every=0.2):
    """``predicate()``'s first truthy value, asked every ``every`` seconds; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"{what} did not happen within {timeout} s")
