"""``collab-kit auth-server`` as the tests start it: a real process on 127.0.0.1 against the stand-in Hub
(hub_server.py), whose listening line gives its URL (tests/auth/test_auth_server.py, tests/roles/test_auth_swarm.py)."""

import os
import queue
import re
import subprocess
import sys
import threading
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ORG = "training-transformers-together"
LISTENING = re.compile(r"^auth server for run (\S+) \((.*)\) listening on (http://127\.0\.0\.1:(\d+))$")


class AuthServerProcess:
    """``collab-kit auth-server --host 127.0.0.1 --port 0 ARGS...`` in a subprocess; ``url`` once it listens."""

    def __init__(self, *args: str, hub_endpoint: str, timeout: float = 60):
        environment = {
            key: value
            for key, value in os.environ.items()
            if key not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_ENDPOINT")
        }
        no_proxy = ",".join(filter(None, [environment.get("NO_PROXY", ""), "127.0.0.1", "localhost"]))
        environment.update(NO_PROXY=no_proxy, no_proxy=no_proxy)
        self.output, self._lines = [], queue.Queue()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "collab_kit.cli",
                "auth-server",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--hub-endpoint",
                hub_endpoint,
                *args,
            ],
            cwd=REPO_ROOT,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise AssertionError(f"no listening line within {timeout} s; output:\n{''.join(self.output)}") from None
            if line is None:
                raise AssertionError(
                    f"the auth server exited with {self.process.wait()}; output:\n{''.join(self.output)}"
                )
            match = LISTENING.match(line.strip())
            if match:
                self.line, self.url, self.port = line.strip(), match.group(3), int(match.group(4))
                return

    def _read(self):
        for line in self.process.stdout:
            self.output.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_for_line(self, text: str, timeout: float = 10) -> str:
        """The first line the server printed since it started listening that holds ``text`` (its log reaches this
        process through a pipe and a reader thread: a line logged before an answer may come after it).

        :raises AssertionError: no such line within ``timeout`` seconds
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"the server printed no line with {text!r} within {timeout} s; output:\n{''.join(self.output)}"
                ) from None
            if line is None:
                raise AssertionError(f"the server exited; output:\n{''.join(self.output)}")
            if text in line:
                return line

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
