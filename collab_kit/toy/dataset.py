"""The toy dataset: the picture world's pictures (collab_kit.data.synthetic) through the real preprocessing path.

``prepare_toy_dataset`` draws the pictures, encodes them with the toy VQGAN (collab_kit.toy.vqgan) through
``collab_kit.data.preprocess``, and keeps the shards in a cache folder keyed by (samples, seed, world version, VQGAN),
so the demo makes them once and every later run reads them at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil

from collab_kit.data.preprocess import preprocess
from collab_kit.data.synthetic import WORLD_VERSION, make_synthetic_images
from collab_kit.toy.vqgan import load_toy_vqgan


def default_cache_dir() -> str:
    """Where made datasets are kept: ``$COLLAB_KIT_CACHE`` or ``~/.cache/collab_kit``."""
    return os.environ.get("COLLAB_KIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "collab_kit")


def prepare_toy_dataset(
    num_samples: int = 4096,
    seed: int = 0,
    cache_dir: str | None = None,
    vqgan=None,
    rows_per_shard: int = 1024,
    progress: bool = True,
) -> str:
    """Shards of ``num_samples`` toy pictures made by ``collab_kit.data.preprocess`` (VQGAN codes, Brotli, parquet).

    Made once per (samples, seed, world version, VQGAN) in the cache folder and reused; an interrupted run is resumed
    (preprocess skips finished shards). Returns the shards' folder.

    :param vqgan: the tokenizer (default: the shipped toy VQGAN, collab_kit.toy.vqgan.load_toy_vqgan)
    """
    if vqgan is None:
        vqgan = load_toy_vqgan()
    fingerprint = hashlib.sha256()
    for name, tensor in sorted(vqgan.state_dict().items()):
        fingerprint.update(name.encode())
        fingerprint.update(tensor.detach().cpu().numpy().tobytes())
    name = f"{num_samples}-seed{seed}-world{WORLD_VERSION}-vqgan{fingerprint.hexdigest()[:12]}"
    folder = os.path.join(cache_dir or default_cache_dir(), "toy", name)
    shards = os.path.join(folder, "shards")
    done_marker = os.path.join(folder, "complete")
    if os.path.exists(done_marker):
        return shards
    os.makedirs(folder, exist_ok=True)
    # two processes that want the same dataset (two notebooks, a demo and a test) make it once: the second waits for
    # the first, then finds it complete (tests/data/test_synthetic.py)
    with open(os.path.join(folder, "making.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(done_marker):
            return shards
        pictures_folder = os.path.join(folder, "pictures")
        if not os.path.exists(os.path.join(pictures_folder, "captions.jsonl")):
            make_synthetic_images(pictures_folder, num_samples, seed=seed)
        preprocess(
            pictures_folder,
            shards,
            vqgan,
            rows_per_shard=rows_per_shard,
            batch_size=256,
            progress=progress,
            tokenizer="toy",
        )
        with open(done_marker, "w") as f:
            f.write("preprocess finished\n")
        shutil.rmtree(pictures_folder, ignore_errors=True)  # the shards hold all a volunteer reads
    return shards
