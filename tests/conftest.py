"""Shared test setup: an offline Hugging Face cache, a tiny dataset, and peers that always die.

Peers are real processes on 127.0.0.1 (collab_kit.roles.processes.PeerProcess); the ``start_peer``
fixture kills every one it started, with its p2p daemons, however the test ends.
"""

import atexit
import os
import shutil
import sys
import tempfile

# before anything imports huggingface_hub or datasets: never reach for the network, never touch ~/.cache
_HF_HOME = tempfile.mkdtemp(prefix="collab_kit_test_hf_")
atexit.register(shutil.rmtree, _HF_HOME, ignore_errors=True)  # each run's cache goes with it, not left in /tmp
os.environ.update(
    HF_HUB_OFFLINE="1",
    HF_DATASETS_OFFLINE="1",
    HF_HOME=_HF_HOME,
    HF_HUB_DISABLE_TELEMETRY="1",
    TOKENIZERS_PARALLELISM="false",
)
# Side by side (pytest-xdist), each worker's share of the cores is its torch threads, here and in every process it
# starts (kernels, monitors, the demo drawing its samples): two workers whose processes each spun two threads on
# two cores ran them up to 3x slower than one thread each. Before torch is imported; a count set outside stays.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import pytest  # noqa: E402

from collab_kit.config import get_preset  # noqa: E402
from collab_kit.data.synthetic import make_synthetic_shards  # noqa: E402
from collab_kit.roles.processes import PeerProcess  # noqa: E402

# the suite's helper modules (stand-in services, scripted peers, waits) live in tests/helpers/ and import by name
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))
pytest_plugins = ["hub_server", "file_times"]  # the stand-in Hub on 127.0.0.1 (`hub_server`); --file-times


def _shards_for(tmp_path_factory, preset: str, num_samples: int) -> str:
    config = get_preset(preset)
    folder = tmp_path_factory.mktemp(f"{preset}_shards")
    make_synthetic_shards(
        str(folder),
        num_samples=num_samples,
        image_side=config.model.image_side,
        codebook_size=config.model.codebook_size,
        num_shards=2,
    )
    return str(folder)


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory) -> str:
    """A folder of parquet shards for the tiny preset."""
    return _shards_for(tmp_path_factory, "tiny", 512)


@pytest.fixture(scope="session")
def small_shards(tmp_path_factory) -> str:
    """A folder of parquet shards for the small preset."""
    return _shards_for(tmp_path_factory, "small", 1024)


@pytest.fixture
def start_peer(tmp_path):
    """Start ``collab-kit ARGS...`` as a subprocess; every peer started is killed at teardown."""
    started = []

    def start(name: str, *args: str) -> PeerProcess:
        peer = PeerProcess(name, list(args), str(tmp_path / f"{name}.log"))
        started.append(peer)
        return peer

    yield start
    for peer in reversed(started):
        peer.kill()


@pytest.fixture
def first_peer(start_peer, tmp_path):
    """A running first peer (coordinator) for the tiny preset, with the run's ``settings`` (``--set`` options: the
    volunteers' must be the same) and naming ``data`` as the run's; returns (peer, its join addresses).

    Its database goes to the test's folder; it saves no checkpoints (tests/roles/test_monitor.py tests those).
    """

    def launch(run_id: str, *settings: str, data: str | None = None):
        peer = start_peer(
            "first-peer",
            "monitor",
            "--preset",
            "tiny",
            "--run-id",
            run_id,
            "--host",
            "127.0.0.1",
            "--events",
            "--poll-every",
            "2",
            "--db",
            str(tmp_path / "monitor.sqlite"),
            "--checkpoint-every",
            "0",
            *(["--data", data] if data else []),
            *settings,
        )
        ready = peer.wait_for(lambda e: e["type"] == "ready", timeout=60, what="its address")
        return peer, ready["addresses"]

    return launch
