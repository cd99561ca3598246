"""Caption tokenizers: how a caption becomes the model's text tokens, chosen by one name (``config.data.tokenizer``).

- ``"bytes"``: UTF-8 bytes (``ByteCaptionTokenizer``), no download; the CPU presets.
- ``"toy"``: the words of the synthetic picture world (``ToyTokenizer``, collab_kit.data.synthetic); the toy preset.
- anything else: a Hugging Face tokenizer name or folder (``PretrainedCaptionTokenizer``; t5-small in the paper).

``caption_tokenizer`` makes the one a run configuration names; ``tokenizer_for_vocabulary`` guesses it for a model
whose configuration is unknown, from its text vocabulary's size.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.normalizers import Lowercase
from tokenizers.pre_tokenizers import WhitespaceSplit

from collab_kit.config import SettingProblem
from collab_kit.data.synthetic import world_words


class ByteCaptionTokenizer:
    """Captions as UTF-8 bytes: a tokenizer that needs no download, for the CPU presets.

    Ids: 0 = pad, 1 = end of caption, 2 = unused, 3 + byte for every byte. The paper preset uses
    t5-small's tokenizer instead (32,100 tokens), which must be downloaded.
    """

    pad_token_id, eos_token_id, offset = 0, 1, 3
    vocab_size = 256 + offset

    def encode(self, caption: str, length: int) -> list[int]:
        ids = [b + self.offset for b in caption.encode("utf-8")][: length - 1] + [self.eos_token_id]
        return ids + [self.pad_token_id] * (length - len(ids))

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i - self.offset for i in ids if i >= self.offset)
        return data.decode("utf-8", errors="replace")


class PretrainedCaptionTokenizer:
    """A Hugging Face tokenizer (t5-small in the paper) behind ``encode(caption, length)``, padded with
    ``pad_token_id``.

    The paper pads with eos (pad = eos = 1 for t5-small), so the model sees one token for "nothing more".
    """

    def __init__(self, name: str, pad_token_id: int | None = None):
        # lazy: transformers takes seconds to import, and the CPU presets never need it
        from transformers import AutoTokenizer

        self.name = name
        self.tokenizer = AutoTokenizer.from_pretrained(name)
        self.pad_token_id = pad_token_id if pad_token_id is not None else self.tokenizer.pad_token_id
        self.vocab_size = len(self.tokenizer)

    def encode(self, caption: str, length: int) -> list[int]:
        ids = list(self.tokenizer(caption, truncation=True, max_length=length)["input_ids"])
        return ids + [self.pad_token_id] * (length - len(ids))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i != self.pad_token_id], skip_special_tokens=True)


class ToyTokenizer:
    """Word-level tokenizer of the picture world's captions (``tokenizers``' WordLevel model;
    collab_kit.data.synthetic).

    Ids: 0 = pad, 1 = end of caption, 2 = unknown word, then the world's words in sorted order.
    ``encode(caption, length)`` / ``decode(ids)`` as ByteCaptionTokenizer.
    """

    pad_token, eos_token, unk_token = "[PAD]", "[EOS]", "[UNK]"
    pad_token_id, eos_token_id, unk_token_id = 0, 1, 2

    def __init__(self, words: Sequence[str] | None = None):
        words = sorted(set(words if words is not None else world_words()))
        vocab = {self.pad_token: 0, self.eos_token: 1, self.unk_token: 2}
        vocab.update({word: index + 3 for index, word in enumerate(words)})
        self.tokenizer = Tokenizer(WordLevel(vocab, unk_token=self.unk_token))
        self.tokenizer.normalizer = Lowercase()
        self.tokenizer.pre_tokenizer = WhitespaceSplit()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, caption: str, length: int) -> list[int]:
        ids = self.tokenizer.encode(caption).ids[: length - 1] + [self.eos_token_id]
        return ids + [self.pad_token_id] * (length - len(ids))

    def decode(self, ids: Sequence[int]) -> str:
        words = []
        for token in ids:
            if token == self.eos_token_id:
                break
            if token != self.pad_token_id:
                words.append(self.tokenizer.id_to_token(int(token)))
        return " ".join(words)

    def save(self, path: str) -> str:
        self.tokenizer.save(path)
        return path

    @classmethod
    def load(cls, path: str) -> ToyTokenizer:
        tokenizer = cls.__new__(cls)
        tokenizer.tokenizer = Tokenizer.from_file(path)
        return tokenizer


def caption_tokenizer(name: str, pad_token_id: int | None = None):
    """The caption tokenizer a configuration names (``config.data.tokenizer``).

    :param name: "bytes" (ByteCaptionTokenizer), "toy" (ToyTokenizer) or a Hugging Face
      tokenizer name or folder ("t5-small" in the paper; downloaded once)
    :param pad_token_id: the model's pad id, for Hugging Face tokenizers
    """
    if name == "bytes":
        return ByteCaptionTokenizer()
    if name == "toy":
        return ToyTokenizer()
    try:
        return PretrainedCaptionTokenizer(name, pad_token_id)
    except OSError as e:
        raise SettingProblem(
            f"data.tokenizer={name!r} could not be loaded ({e}); use 'bytes', 'toy' or a Hugging Face "
            f"tokenizer name or folder"
        ) from None


def tokenizer_for_vocabulary(text_vocab_size: int, pad_token_id: int | None = None):
    """The caption tokenizer of a model whose run configuration is unknown, guessed from its text vocabulary's size:
    UTF-8 bytes (259), the picture world's words, or t5-small's (32,100, downloaded once)."""
    if text_vocab_size == ByteCaptionTokenizer.vocab_size:
        return ByteCaptionTokenizer()
    if text_vocab_size == ToyTokenizer().vocab_size:
        return ToyTokenizer()
    return caption_tokenizer("t5-small", pad_token_id)
