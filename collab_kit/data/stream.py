"""The stream of training batches: every peer reads the shards in its own shuffled order and skips what is unfit.

Peers contribute different samples because each one's order comes from its identity (``peer_data_seed``). A sample
or shard that cannot be used (wrong grid, codes out of the codebook, a hostile record) is skipped and counted in
``SkippedSamples``, never fed to the model.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Iterator

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from huggingface_hub import HfFileSystem

from collab_kit.config import RunConfig, SettingProblem
from collab_kit.data.codec import decode_codes
from collab_kit.data.shards import SHARD_FORMAT, list_shards
from collab_kit.data.tokenizers import ByteCaptionTokenizer, caption_tokenizer

logger = logging.getLogger(__name__)


def peer_data_seed(peer_id: bytes, seed: int = 0) -> int:
    """The order in which one peer reads the data: derived from its identity, so peers read different samples.

    :param peer_id: the peer's identity (``dht.peer_id.to_bytes()``)
    :param seed: the run's data seed (``config.data.seed``), shifting every peer's order at once
    """
    return (zlib.crc32(peer_id) + seed) % 2**32


class SkippedSamples:
    """What a stream skipped: samples by reason, and shards by reason (each shard named once in the log).

    Samples are counted each time a pass meets them; a shard that does not fit is counted once.
    """

    REASONS = (
        "invalid codes",
        "wrong number of codes",
        "codes outside the codebook",
        "empty caption",
        "invalid caption",
    )

    def __init__(self, log_every: int = 1000):
        self.counts: dict[str, int] = dict.fromkeys(self.REASONS, 0)
        self.shards: dict[str, str] = {}  # path -> why it was skipped whole
        self.log_every = log_every

    def add(self, reason: str, source: str, detail: str) -> None:
        self.counts[reason] += 1
        count = self.counts[reason]
        if count == 1 or count % self.log_every == 0:
            logger.warning(f"skipped sample {source} ({reason}: {detail}); {count} skipped for this reason so far")

    def shard_skipped(self, path: str, reason: str, detail: str) -> None:
        """A shard that cannot be read, or whose columns or metadata do not fit the model: skipped whole."""
        if path not in self.shards:
            self.shards[path] = reason
            logger.error(f"skipping shard {path}: {reason} ({detail})")

    def shard_failed(self, path: str, error: Exception) -> None:
        self.shard_skipped(path, "unreadable", f"{type(error).__name__}: {error}")

    @property
    def unreadable_shards(self) -> list[str]:
        """Every shard skipped whole, whatever the reason."""
        return list(self.shards)

    @property
    def shard_counts(self) -> dict[str, int]:
        """Shards skipped whole, by reason."""
        counts: dict[str, int] = {}
        for reason in self.shards.values():
            counts[reason] = counts.get(reason, 0) + 1
        return counts

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def shard_misfit(
    schema: pa.Schema, image_length: int | None = None, codebook_size: int | None = None
) -> tuple[str, str] | None:
    """Why a shard cannot feed the model, read from its schema alone (None: it fits).

    :returns: (reason, detail): "wrong columns" (no caption or codes column, or one of the wrong type), "newer
      format", "unreadable metadata", "other codebook" (codes from a larger codebook than the model's), "other image
      size" (a code grid of another size)
    """
    fields = {field.name: field.type for field in schema}
    missing = [name for name in ("caption", "codes") if name not in fields]
    if missing:
        return "wrong columns", (
            f"no {' or '.join(missing)} column (it has {', '.join(fields) or 'none'}); "
            f"shards are made by `collab-kit preprocess`"
        )
    caption, codes = fields["caption"], fields["codes"]
    if not (pa.types.is_string(caption) or pa.types.is_large_string(caption)):
        return "wrong columns", f"its captions are {caption}, not strings"
    if not (pa.types.is_binary(codes) or pa.types.is_large_binary(codes) or pa.types.is_fixed_size_binary(codes)):
        return "wrong columns", f"its codes are {codes}, not binary records of collab_kit's codec"
    source_id = fields.get("source_id")
    if source_id is not None and not (
        pa.types.is_string(source_id) or pa.types.is_large_string(source_id) or pa.types.is_integer(source_id)
    ):
        return "wrong columns", f"its source ids are {source_id}, not strings"
    raw = (schema.metadata or {}).get(b"collab_kit")
    if not raw:
        return None  # shards of another tool: each sample's codes are checked as they are read
    try:
        metadata = json.loads(raw)
        if not isinstance(metadata, dict):
            raise ValueError(f"a {type(metadata).__name__}, not an object")
        recorded_format, recorded_codebook, side = (
            metadata.get(key) for key in ("format", "codebook_size", "image_side")
        )
        for key, value in (("format", recorded_format), ("codebook_size", recorded_codebook), ("image_side", side)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{key} is {value!r}, not a count")
    except ValueError as e:
        return "unreadable metadata", f"its collab_kit metadata is not what write_shard records: {e}"
    if recorded_format is not None and recorded_format > SHARD_FORMAT:
        return "newer format", (
            f"written in shard format {recorded_format}, this collab_kit reads up to {SHARD_FORMAT}: upgrade collab_kit"
        )
    if codebook_size is not None and recorded_codebook is not None and recorded_codebook > codebook_size:
        return "other codebook", (
            f"its codes come from a codebook of {recorded_codebook}, the model's holds {codebook_size}"
        )
    if image_length is not None and side is not None and side * side != image_length:
        return "other image size", f"its images are {side}x{side} codes, the model takes {image_length} codes"
    return None


# what _shard_rows yields, declared: datasets would otherwise infer it from the first rows
_ROW_FEATURES = datasets.Features(
    dict(caption=datasets.Value("string"), codes=datasets.Value("binary"), source=datasets.Value("string"))
)


def _shard_rows(
    shards: list[str], skipped: SkippedSamples, image_length: int | None = None, codebook_size: int | None = None
) -> Iterator[dict]:
    """The rows of each shard in ``shards`` that fits the model (a generator for IterableDataset.from_generator):
    caption (str, or None when the shard holds none), codes (bytes or None) and source."""
    for path in shards:
        if path in skipped.shards:
            continue  # said once, skipped in every pass
        try:
            if path.startswith("hf://"):
                source = HfFileSystem().open(path[len("hf://") :], "rb")
            else:
                source = path
            parquet = pq.ParquetFile(source)
            misfit = shard_misfit(parquet.schema_arrow, image_length, codebook_size)
            if misfit is not None:
                skipped.shard_skipped(path, *misfit)
                continue
            columns = ["caption", "codes"] + (["source_id"] if "source_id" in parquet.schema_arrow.names else [])
            name = os.path.basename(path)
            for batch in parquet.iter_batches(batch_size=256, columns=columns):
                # captions as bytes: one that is not UTF-8 is one bad sample, not a shard that stops reading
                captions = batch.column("caption").cast(pa.large_binary()).to_pylist()
                codes = batch.column("codes").to_pylist()
                ids = batch.column("source_id").to_pylist() if "source_id" in columns else [None] * batch.num_rows
                for row, (caption, record, source_id) in enumerate(zip(captions, codes, ids)):
                    source = f"{name}:{source_id if source_id is not None else row}"
                    if caption is not None:
                        try:
                            caption = caption.decode("utf-8")
                        except UnicodeDecodeError as e:
                            skipped.add("invalid caption", source, f"not UTF-8 ({e.reason})")
                            continue
                    yield dict(caption=caption, codes=record, source=source)
        except Exception as e:  # a damaged or vanished shard must not end training: the others go on
            skipped.shard_failed(path, e)


class ShardStream(torch.utils.data.IterableDataset):
    """An endless stream of training samples from parquet shards, shuffled, with bad samples skipped.

    The shards are read with a ``datasets`` streaming ``IterableDataset``: each pass visits the
    shards in a new order and mixes rows through a shuffle buffer; the order depends on ``seed``
    (each peer derives its own from its identity) and on the pass, so passes are repeatable. Rows
    are read as they are needed, from local files or over HTTP from a Hub dataset repository.

    Shards come from whoever published the dataset, so nothing in them may stop training. Before a shard is read,
    its schema is checked (``shard_misfit``: columns and their types, the codebook and grid it records): a shard
    that does not fit is skipped whole, named once in the log and counted in ``stream.skipped.shards``; so is one
    that cannot be read. Each sample is then decoded on its own: invalid codes (decompression bombs included:
    ``decode_codes`` never expands a record past the largest legal size), a wrong number of codes, codes outside
    the codebook, an empty caption or one the tokenizer cannot take are skipped and counted by reason in
    ``stream.skipped.counts``.

    :param shards: a folder of parquet shards, a glob, or a Hub dataset id ``user/name``
    :param text_length: captions are tokenized, cut and padded to this many tokens
    :param image_length: the number of codes every sample must hold
    :param tokenizer: turns captions into ids: ``encode(caption, length)`` (default: ByteCaptionTokenizer)
    :param codebook_size: codes must lie in [0, codebook_size) (default: not checked beyond int16)
    :param shuffle_buffer: rows held for shuffling; 1 disables shuffling within shards
    :param seed: the order's seed
    :param log_every: log a skipped reason on its first occurrence and then every this many
    """

    def __init__(
        self,
        shards: str,
        text_length: int,
        image_length: int,
        tokenizer=None,
        shuffle_buffer: int = 1024,
        seed: int = 0,
        codebook_size: int | None = None,
        log_every: int = 1000,
    ):
        super().__init__()
        self.paths = list_shards(shards)
        self.text_length, self.image_length, self.codebook_size = text_length, image_length, codebook_size
        self.tokenizer = tokenizer if tokenizer is not None else ByteCaptionTokenizer()
        self.shuffle_buffer, self.seed = shuffle_buffer, seed
        self.skipped = SkippedSamples(log_every)
        self.passes = 0  # passes started over the shards
        self._rows = None  # the datasets pipeline, built at the first pass

    def _dataset(self):
        # datasets waits 5 s for its reader threads at the end of each shuffled pass; ours has none
        datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0.0
        rows = datasets.IterableDataset.from_generator(
            _shard_rows,
            features=_ROW_FEATURES,
            gen_kwargs=dict(
                shards=self.paths,
                skipped=self.skipped,
                image_length=self.image_length,
                codebook_size=self.codebook_size,
            ),
        )
        # seeds above 2**32 are folded: numpy's generators take 32-bit seeds here
        return rows.shuffle(seed=self.seed % 2**32, buffer_size=self.shuffle_buffer)

    def _sample(self, row: dict) -> dict[str, torch.Tensor] | None:
        """A training sample, or None (counted) if the row is unusable."""
        caption, source = row["caption"], row["source"]
        if not isinstance(caption, str) or not caption.strip():
            self.skipped.add("empty caption", source, "no text")
            return None
        try:
            codes = decode_codes(row["codes"] or b"")
        except Exception as e:  # InvalidCodesError is all the codec raises; anything else is one bad sample too
            self.skipped.add("invalid codes", source, str(e))
            return None
        if codes.size != self.image_length:
            self.skipped.add(
                "wrong number of codes", source, f"{codes.size} codes, the model takes {self.image_length}"
            )
            return None
        if self.codebook_size is not None and codes.size and codes.max() >= self.codebook_size:
            self.skipped.add(
                "codes outside the codebook", source, f"code {codes.max()} in a codebook of {self.codebook_size}"
            )
            return None
        try:
            tokens = torch.tensor(self.tokenizer.encode(caption, self.text_length), dtype=torch.long)
            if tokens.shape != (self.text_length,):
                raise ValueError(f"the tokenizer gave {tuple(tokens.shape)} ids where {self.text_length} were asked")
        except Exception as e:  # whatever a tokenizer raises on odd text, it is this sample's problem only
            self.skipped.add("invalid caption", source, f"{type(e).__name__}: {e}")
            return None
        return dict(text_tokens=tokens, image_codes=torch.from_numpy(codes))

    def one_pass(self) -> Iterator[dict[str, torch.Tensor]]:
        """The usable samples of the next pass over every shard, each once, in this pass's order."""
        if self._rows is None:
            self._rows = self._dataset()
        self._rows.set_epoch(self.passes)
        self.passes += 1
        usable = 0
        for row in self._rows:
            sample = self._sample(row)
            if sample is not None:
                usable += 1
                yield sample
        logger.debug(f"finished pass {self.passes} over {len(self.paths)} shards ({usable} samples)")
        if usable == 0:
            raise RuntimeError(
                f"no usable sample in {len(self.paths)} shard(s): skipped samples {self.skipped.counts}, "
                f"skipped shards {self.skipped.shards}; check that the shards were made for this "
                f"model (image codes, codebook)"
            )

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield from self.one_pass()


def batches(stream: ShardStream, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Stack consecutive samples of ``stream`` into batches of ``batch_size``."""
    pending: list[dict[str, torch.Tensor]] = []
    for sample in stream:
        pending.append(sample)
        if len(pending) == batch_size:
            yield {key: torch.stack([s[key] for s in pending]) for key in pending[0]}
            pending = []


def peer_stream(config: RunConfig, data_shards: str | None = None, data_seed: int = 0) -> ShardStream:
    """The stream of samples a peer trains on: the run's shards in this peer's order, tokenized as the run says.

    :raises SettingProblem: no data named, or the caption tokenizer has more tokens than the model reads
    """
    if not (data_shards or config.data.shards):
        raise SettingProblem(
            "no data to stream: set data.shards (--data) to a folder of parquet shards, a glob or a Hub dataset id"
        )
    tokenizer = caption_tokenizer(config.data.tokenizer, config.model.pad_token_id)
    if tokenizer.vocab_size > config.model.text_vocab_size:
        raise SettingProblem(
            f"the caption tokenizer {config.data.tokenizer!r} has {tokenizer.vocab_size} tokens but "
            f"the model reads {config.model.text_vocab_size}: set model.text_vocab_size"
        )
    return ShardStream(
        data_shards or config.data.shards,
        config.model.text_length,
        config.model.image_length,
        tokenizer=tokenizer,
        shuffle_buffer=config.data.shuffle_buffer,
        seed=data_seed,
        codebook_size=config.model.codebook_size,
    )
