"""Images and captions -> the paper's filters -> VQGAN codes -> parquet shards, in a folder and on the Hub.

The paper never sends images to volunteers: every image is turned into VQGAN codes once, by the run's
maintainers, and the codes (Brotli-compressed, about 18x fewer bytes than the images) are what peers stream.
This module is that one pass:

    report = preprocess("laion_part/", "shards/", vqgan="user/vqgan-gumbel-f8", push_to_hub="user/laion-codes")
    print(report.summary())

or ``collab-kit preprocess laion_part/ --output shards/ --vqgan user/vqgan-gumbel-f8 --push-to-hub user/laion-codes``.

The pairs come from collab_kit.data.sources (a folder, a WebDataset, parquet files, a saved or Hub dataset).

The paper's filters, in this order; a pair is counted under the first one it fails (``PreprocessReport.dropped``):
no caption (``missing_caption``), a caption of fewer than 3 characters once stripped (``short_caption``), an NSFW
label other than ``UNLIKELY`` where there is a label (``nsfw``), no image (``missing_image``), an image whose header
does not open (``unreadable_image``), an aspect ratio above 2 (``aspect_ratio``: max(w, h) / min(w, h) > 2), and
last, when it is encoded, an image whose pixels do not decode (``unreadable_image`` again).

Each kept image is resized (its short side to the VQGAN's ``image_size``, bicubic) and center-cropped, encoded in
batches, and written with its caption, original size and source id to ``shard-00000.parquet``,
``shard-00001.parquet``, ... of ``rows_per_shard`` rows (the last one shorter) by
``collab_kit.data.shards.write_shard``.

Resumable and deterministic: the same input gives the same samples in the same shards, byte for byte. A second
run skips the shards already there (it re-reads the pairs and their image headers to know where each shard
ends, but encodes none of their images) and writes only the missing ones; no shard is written twice. Shards
record the VQGAN's codebook and grid: shards of another VQGAN in the output folder are an error.
"""

from __future__ import annotations

import collections
import concurrent.futures
import glob
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow.parquet as pq
import torch
from huggingface_hub import HfApi
from huggingface_hub.utils import validate_repo_id
from tqdm.auto import tqdm

from collab_kit.data.shards import SHARD_FORMAT, shard_metadata, write_shard
from collab_kit.data.sources import ImageLike, Pair, PairSource, image_header_size, open_image
from collab_kit.errors import CollabKitError
from collab_kit.model.vqgan import VQGAN, pil_to_tensor
from collab_kit.model.vqgan_files import load_vqgan
from collab_kit.units import format_bytes

logger = logging.getLogger(__name__)


MIN_CAPTION_LENGTH = 3  # the paper drops captions shorter than this
MAX_ASPECT_RATIO = 2.0  # ... images whose longer side is more than twice the shorter
SAFE_NSFW_LABEL = "UNLIKELY"  # ... and images whose NSFW label (LAION's) is anything else

# why a pair was dropped: the keys of PreprocessReport.dropped
MISSING_CAPTION, SHORT_CAPTION, NSFW = "missing_caption", "short_caption", "nsfw"
MISSING_IMAGE, UNREADABLE_IMAGE, ASPECT_RATIO = "missing_image", "unreadable_image", "aspect_ratio"
DROP_REASONS = (MISSING_CAPTION, SHORT_CAPTION, NSFW, MISSING_IMAGE, UNREADABLE_IMAGE, ASPECT_RATIO)

SHARD_NAME = "shard-{index:05d}.parquet"
SHARD_GLOB = "shard-*.parquet"


class PushError(CollabKitError, RuntimeError):
    """Uploading to the Hub failed (not logged in, no right to write, no network, ...).

    :param report: what had been written to the output folder (None if the failure came before any work)
    """

    def __init__(self, message: str, report: PreprocessReport | None = None):
        super().__init__(message)
        self.report = report


@dataclass
class PreprocessReport:
    """What one ``preprocess`` run did.

    ``kept`` and ``dropped`` describe the whole dataset (shards skipped because they were there already
    included), so a resumed run reports what a fresh one would; ``encoded``, ``shards_written`` and
    ``bytes_written`` are this run's work.
    """

    output: str
    kept: int = 0  # samples in the dataset's shards
    dropped: dict[str, int] = field(default_factory=dict)  # reason (DROP_REASONS) -> pairs dropped
    shards_written: list[str] = field(default_factory=list)  # paths written by this run
    shards_skipped: list[str] = field(default_factory=list)  # paths that were there already (not encoded again)
    bytes_written: int = 0  # the size of the shards this run wrote
    bytes_total: int = 0  # the size of all the dataset's shards
    encoded: int = 0  # images this run ran through the VQGAN
    pushed_to: str | None = None  # the Hub dataset the shards were uploaded to

    @property
    def pairs(self) -> int:
        """Pairs read from the source: kept + dropped."""
        return self.kept + sum(self.dropped.values())

    @property
    def shards(self) -> list[str]:
        """All the dataset's shards, in order."""
        return sorted(self.shards_written + self.shards_skipped)

    def drop(self, reason: str):
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def summary(self) -> str:
        """A few lines for people: counts, shards and where they went."""
        dropped = ", ".join(f"{reason} {self.dropped[reason]}" for reason in DROP_REASONS if self.dropped.get(reason))
        lines = [
            f"preprocess: kept {self.kept} of {self.pairs} pairs" + (f" (dropped: {dropped})" if dropped else ""),
            f"shards: {len(self.shards)} in {self.output} ({format_bytes(self.bytes_total)}): "
            f"{len(self.shards_written)} written ({self.encoded} images encoded, "
            f"{format_bytes(self.bytes_written)}), "
            f"{len(self.shards_skipped)} already there",
        ]
        if self.pushed_to:
            lines.append(f"pushed to the Hub dataset {self.pushed_to}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# filters


def drop_reason(caption: str | None, nsfw: str | None = None, size: tuple[int, int] | None = None) -> str | None:
    """Why the paper's filters drop a pair (one of ``DROP_REASONS``), or None if they keep it.

    :param caption: the caption; surrounding whitespace does not count towards its length
    :param nsfw: the NSFW label; None or empty means the pair has none (kept)
    :param size: the image's (width, height); None skips the aspect-ratio filter
    """
    if caption is None:
        return MISSING_CAPTION
    if len(str(caption).strip()) < MIN_CAPTION_LENGTH:
        return SHORT_CAPTION
    if _label(nsfw) is not None and _label(nsfw) != SAFE_NSFW_LABEL:
        return NSFW
    if size is not None:
        width, height = size
        if min(width, height) <= 0 or max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
            return ASPECT_RATIO
    return None


def _label(nsfw) -> str | None:
    if nsfw is None or (isinstance(nsfw, float) and math.isnan(nsfw)):
        return None
    label = str(nsfw).strip().upper()
    return label or None


def _center_crop(image: ImageLike, side: int) -> torch.Tensor | None:
    """The image as the VQGAN takes it, ``[3, side, side]`` in [0, 1], or None if it does not decode."""
    try:
        opened = open_image(image)
        try:
            return pil_to_tensor(opened, size=side)[0]
        finally:
            if opened is not image:
                opened.close()
    except Exception as e:  # a truncated or corrupt file, a decompression bomb, ...: this pair only
        logger.debug(f"cannot decode an image ({type(e).__name__}: {e})")
        return None


# ---------------------------------------------------------------------------------------------
# the pass


@dataclass
class _Candidate:
    """A pair that passed the filters that need no decoding."""

    source_id: str
    caption: str
    image: ImageLike
    size: tuple[int, int]


class _Lookahead:
    """An iterator that can show its next item without consuming it."""

    def __init__(self, items: Iterable):
        self._items, self._next, self._has_next = iter(items), None, False

    def peek(self):
        if not self._has_next:
            self._next, self._has_next = next(self._items, None), True
        return self._next

    def pop(self):
        item = self.peek()
        self._has_next = False
        return item


def _screen(pairs: Iterable[Pair], report: PreprocessReport, max_samples: int | None, bar) -> Iterator[_Candidate]:
    """The pairs that pass every filter but decoding; the others counted in ``report.dropped``."""
    for number, pair in enumerate(pairs):
        if max_samples is not None and number >= max_samples:
            return
        bar.update(1)
        reason, size = drop_reason(pair.caption, pair.nsfw), None
        if reason is None:
            if pair.image is None:
                reason = MISSING_IMAGE
            else:
                try:
                    size = image_header_size(pair.image)  # the header only
                except Exception as e:
                    logger.debug(f"{pair.source_id}: cannot open the image ({type(e).__name__}: {e})")
                    reason = UNREADABLE_IMAGE
                else:
                    reason = drop_reason(pair.caption, pair.nsfw, size)
        if reason is not None:
            report.drop(reason)
            continue
        yield _Candidate(pair.source_id, str(pair.caption).strip(), pair.image, size)


def shard_path(output: str, index: int) -> str:
    """The path of the ``index``-th shard in ``output``."""
    return os.path.join(output, SHARD_NAME.format(index=index))


def _existing_shards(output: str, codebook_size: int, image_side: int) -> dict[int, str]:
    """{index: path} of the shards already in ``output``, all checked to come from this VQGAN."""
    shards = {}
    for path in sorted(glob.glob(os.path.join(output, SHARD_GLOB))):
        stem = os.path.basename(path)[len("shard-") : -len(".parquet")]
        if not stem.isdigit():
            continue
        try:
            metadata = shard_metadata(path)
        except Exception as e:
            raise ValueError(
                f"{path} is not a readable parquet file ({type(e).__name__}: {e}): delete it and run again"
            ) from None
        found = (metadata.get("format"), metadata.get("codebook_size"), metadata.get("image_side"))
        if found != (SHARD_FORMAT, codebook_size, image_side):
            raise ValueError(
                f"{path} holds shards of another tokenizer or format (format {found[0]}, codebook "
                f"{found[1]}, grid {found[2]}x{found[2]}) than this VQGAN's (format {SHARD_FORMAT}, codebook "
                f"{codebook_size}, grid {image_side}x{image_side}): write to another --output folder, or delete "
                f"the old shards there"
            )
        shards[int(stem)] = path
    return shards


def _source_ids(path: str) -> list[str]:
    return pq.read_table(path, columns=["source_id"]).column(0).to_pylist()


def _skip_shard(stream: _Lookahead, path: str, ids: list[str], report: PreprocessReport, crop_side: int):
    """Consume the candidates that ``path`` (already written) holds; nothing is decoded but the ones it lacks.

    The pairs between its samples were dropped, when it was written, because their images did not decode:
    each is decoded again to make sure, since an image that decodes now means the input has changed (and the
    shards would no longer follow it).
    """
    expected = collections.deque(ids)
    while expected:
        candidate = stream.pop()
        if candidate is None:
            raise ValueError(
                f"{path} holds samples that the input no longer has (e.g. {expected[0]!r}): the input "
                f"changed since the shards were written; write to a new --output folder"
            )
        if candidate.source_id == expected[0]:
            expected.popleft()
        elif _center_crop(candidate.image, crop_side) is None:
            report.drop(UNREADABLE_IMAGE)
        else:
            raise ValueError(
                f"{path} was written from other input: {candidate.source_id!r} is not in it although "
                f"it comes before {expected[0]!r}; the input changed since the shards were written: "
                f"write to a new --output folder, or delete the shards from {os.path.basename(path)} on"
            )


def _encode_shard(
    stream: _Lookahead,
    vqgan,
    rows_per_shard: int,
    batch_size: int,
    stop_at: str | None,
    pool: concurrent.futures.Executor,
    report: PreprocessReport,
    device,
) -> tuple[list, list, list, list]:
    """Up to ``rows_per_shard`` samples, encoded in batches: (captions, codes, sizes, source ids)."""
    captions, codes, sizes, ids = [], [], [], []
    while len(ids) < rows_per_shard:
        chunk = []
        while len(chunk) < min(batch_size, rows_per_shard - len(ids)):
            candidate = stream.peek()
            if candidate is None or candidate.source_id == stop_at:  # the end, or the next shard (already there)
                break
            chunk.append(stream.pop())
        if not chunk:
            break
        crops = list(pool.map(lambda candidate: _center_crop(candidate.image, vqgan.image_size), chunk))
        decoded = [(candidate, crop) for candidate, crop in zip(chunk, crops) if crop is not None]
        for _ in range(len(chunk) - len(decoded)):
            report.drop(UNREADABLE_IMAGE)
        if not decoded:
            continue
        batch = torch.stack([crop for _, crop in decoded]).to(device)
        batch_codes = vqgan.encode(batch).cpu().numpy()
        report.encoded += len(decoded)
        for (candidate, _), image_codes in zip(decoded, batch_codes):
            captions.append(candidate.caption)
            codes.append(image_codes.astype(np.int64))
            sizes.append(candidate.size)
            ids.append(candidate.source_id)
    return captions, codes, sizes, ids


def preprocess(
    source,
    output: str,
    vqgan,
    *,
    rows_per_shard: int = 10_000,
    batch_size: int = 32,
    push_to_hub: str | None = None,
    private: bool | None = None,
    token: str | None = None,
    device=None,
    num_workers: int | None = None,
    progress: bool = True,
    on_shard_written: Callable[[str], None] | None = None,
    tokenizer: str | None = None,
) -> PreprocessReport:
    """Filter ``source``'s image-caption pairs, encode the images with ``vqgan`` and write parquet shards.

    See the module's docstring for the sources, the filters and how a second run resumes.

    :param source: a ``collab_kit.data.sources.PairSource`` (the location and how to read it), or just the location:
      a folder of images, a WebDataset .tar, parquet files, a saved dataset, a Hub dataset id or a ``datasets``
      dataset
    :param output: the folder of shards (created if missing); shards already there are kept and skipped
    :param vqgan: a ``collab_kit.model.vqgan.VQGAN``, or where to load one: a checkpoint file, a folder or a Hub repo id
      (``collab_kit.model.vqgan_files.load_vqgan``)
    :param rows_per_shard: samples per shard (the last shard holds the rest)
    :param batch_size: images per VQGAN forward pass
    :param push_to_hub: a Hub dataset repository ``user/name`` to upload the shards to (created if missing);
      by default the shards stay in ``output`` only
    :param private: make the repository private if it is created (default: the Hub's default)
    :param token: the Hub token (default: the one saved by ``hf auth login``)
    :param device: where the VQGAN runs (default: the given model's device; CUDA for a loaded one if available)
    :param num_workers: threads that decode and crop images (default: up to 8)
    :param progress: show a progress bar
    :param on_shard_written: called with each shard's path once it is written
    :param tokenizer: the caption tokenizer the captions are written for, recorded in each shard when only one can
      read them (the toy world's words: "toy"); None: any
    :returns: a ``PreprocessReport``; ``report.summary()`` says it in a few lines
    """
    source = source if isinstance(source, PairSource) else PairSource(source)
    if rows_per_shard < 1 or batch_size < 1:
        raise ValueError(f"rows_per_shard and batch_size must be at least 1, got {rows_per_shard} and {batch_size}")
    output = os.fspath(output)
    if os.path.exists(output) and not os.path.isdir(output):
        raise ValueError(f"--output {output!r} is a file: expected a folder for the shards")
    pairs, total = source.open()
    vqgan, device = _ready_vqgan(vqgan, device)
    existing = _existing_shards(output, vqgan.codebook_size, vqgan.grid_size)
    if push_to_hub:  # a typo in the name or a missing login is better found now than after hours of encoding
        _create_dataset_repo(push_to_hub, private, token)
    os.makedirs(output, exist_ok=True)

    report = PreprocessReport(output=output)
    if total is not None and source.max_samples is not None:
        total = min(total, source.max_samples)
    bar = tqdm(total=total, unit="pair", desc="preprocess", disable=not progress, dynamic_ncols=True)
    stream = _Lookahead(_screen(pairs, report, source.max_samples, bar))
    pool = concurrent.futures.ThreadPoolExecutor(
        num_workers or min(8, os.cpu_count() or 1), thread_name_prefix="preprocess-decode"
    )
    try:
        shards_seen = _write_shards(
            stream,
            existing,
            output,
            vqgan,
            rows_per_shard,
            batch_size,
            pool,
            report,
            device,
            bar,
            on_shard_written,
            tokenizer,
        )
    finally:
        pool.shutdown(wait=True)
        bar.close()
    stale = sorted(path for shard_index, path in existing.items() if shard_index >= shards_seen)
    if stale:
        logger.warning(
            f"{output} holds {len(stale)} shard(s) past the end of this input (from {stale[0]} on): "
            f"delete them if they are not part of this dataset"
        )
    report.bytes_total = sum(os.path.getsize(path) for path in report.shards)
    if report.kept == 0:
        dropped = ", ".join(f"{reason} {count}" for reason, count in report.dropped.items()) or "none"
        raise ValueError(
            f"no pair of {source.describe()} passed the filters ({report.pairs} read; dropped: "
            f"{dropped}): nothing to write"
        )
    logger.info(report.summary())
    if push_to_hub:
        try:
            push_shards(
                output,
                push_to_hub,
                private=private,
                token=token,
                commit_message=f"collab_kit preprocess: {len(report.shards)} shards, {report.kept} samples",
            )
        except Exception as e:
            raise PushError(
                f"uploading the shards to the Hub dataset {push_to_hub} failed ({_first_line(e)}); they "
                f"are in {output}: run again to retry the upload (the shards there are not encoded "
                f"again)",
                report,
            ) from e
        report.pushed_to = push_to_hub
    return report


def _ready_vqgan(vqgan, device) -> tuple[VQGAN, torch.device]:
    """The VQGAN in eval mode on its device: a built one (moved to ``device`` if given), or one loaded there."""
    if isinstance(vqgan, VQGAN):
        if device is not None:
            vqgan = vqgan.to(device)
        device = vqgan.codebook.device
    else:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        vqgan = load_vqgan(vqgan, map_location=device)
    return vqgan.eval(), device


def _write_shards(
    stream: _Lookahead,
    existing: dict[int, str],
    output: str,
    vqgan: VQGAN,
    rows_per_shard: int,
    batch_size: int,
    pool,
    report: PreprocessReport,
    device,
    bar,
    on_shard_written: Callable[[str], None] | None,
    tokenizer: str | None = None,
) -> int:
    """Shard after shard until the stream ends: a shard already written is skipped (its pairs read, not encoded), a
    missing one encoded and written. Returns how many shard places the input took."""
    index = 0
    while stream.peek() is not None:
        path = shard_path(output, index)
        if index in existing:
            ids = _source_ids(path)
            _skip_shard(stream, path, ids, report, vqgan.image_size)
            if len(ids) != rows_per_shard and stream.peek() is not None:
                logger.warning(
                    f"{path} holds {len(ids)} samples where rows_per_shard={rows_per_shard}: it was "
                    f"written with another --rows-per-shard (the shards still hold every sample once)"
                )
            report.shards_skipped.append(path)
            report.kept += len(ids)
        else:
            # a shard written earlier further on: this one must end where that one starts
            stop_at = _source_ids(existing[index + 1])[0] if index + 1 in existing else None
            captions, codes, sizes, ids = _encode_shard(
                stream, vqgan, rows_per_shard, batch_size, stop_at, pool, report, device
            )
            if not ids:
                index += 1
                continue
            write_shard(
                path,
                captions,
                codes,
                codebook_size=vqgan.codebook_size,
                image_side=vqgan.grid_size,
                sizes=sizes,
                source_ids=ids,
                tokenizer=tokenizer,
            )
            report.shards_written.append(path)
            report.bytes_written += os.path.getsize(path)
            report.kept += len(ids)
            if on_shard_written is not None:
                on_shard_written(path)
        bar.set_postfix(kept=report.kept, shards=index + 1, refresh=False)
        index += 1
    return index


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _create_dataset_repo(repo_id: str, private: bool | None, token: str | None):

    validate_repo_id(repo_id)  # a ValueError that names what is wrong with it
    try:
        HfApi(token=token).create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True)
    except Exception as e:
        raise PushError(
            f"cannot create or reach the Hub dataset {repo_id} ({_first_line(e)}): log in with "
            f"`hf auth login` (a token that may write), or leave out --push-to-hub"
        ) from e


def push_shards(
    folder: str,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = "collab_kit preprocess: shards",
) -> str:
    """Upload the shards of ``folder`` (``shard-*.parquet``) to the Hub dataset ``repo_id``; returns its URL.

    The repository is created if missing. Shards the repository holds already with the same content are not
    uploaded again, so a push that failed half-way is resumed by pushing again.

    :param folder: the folder ``preprocess`` wrote
    :param repo_id: ``user/name`` of a dataset repository
    :param private: make the repository private if it is created
    :param token: the Hub token (default: the one saved by ``hf auth login``)
    """

    if not glob.glob(os.path.join(folder, SHARD_GLOB)):
        raise FileNotFoundError(f"no shards ({SHARD_GLOB}) in {folder!r} to push")
    api = HfApi(token=token)
    url = api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True)
    api.upload_folder(
        repo_id=repo_id,
        repo_type="dataset",
        folder_path=folder,
        allow_patterns=[SHARD_GLOB],
        commit_message=commit_message,
    )
    logger.info(f"pushed the shards of {folder} to {url}")
    return str(url)
