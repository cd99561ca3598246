"""Headless Chromium for tests that look at a page as a reader's browser shows it (Debian's package; `make test`
installs it where missing)."""

import os
import shutil
import signal
import subprocess
import tempfile

import pytest

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
]


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
    if path is None:
        pytest.fail(
            "Chromium is missing: `make test` installs Debian's chromium where missing "
            "(or run `apt-get install chromium` as root)",
            pytrace=False,
        )
    return path


def run_chromium(binary: str, workdir, *args: str, timeout: float = 90) -> str:
    """Run headless Chromium once and return its stdout; it and its helper processes always end."""
    profile = tempfile.mkdtemp(prefix="chromium_profile_", dir=workdir)
    process = subprocess.Popen(
        [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"chromium did not finish within {timeout} s: {' '.join(args)}", pytrace=False)
    finally:
        # its zygote and renderers are in the session it leads: end whatever is left of it
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    assert process.returncode == 0, f"chromium exited with {process.returncode}: {stderr[-2000:]}"
    return stdout
