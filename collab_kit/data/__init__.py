"""Training samples: from images and captions to the batches a peer trains on.

- ``codec``: one image's VQGAN codes <-> a few bytes (bit-packed, Brotli when smaller), decoding bounded for hostile
  records.
- ``tokenizers``: caption -> text tokens, chosen by ``config.data.tokenizer`` (bytes, the picture world's words, or a
  Hugging Face tokenizer).
- ``shards``: the parquet shard format; writing a shard whole or not at all; finding shards (folder, glob, Hub id).
- ``stream``: ``ShardStream``, each peer's shuffled order over the shards, unfit shards and samples skipped and
  counted; ``batches``.
- ``sources``: where image-caption pairs come from (folders, WebDataset, parquet, saved and Hub datasets).
- ``preprocess``: the maintainers' one pass, pairs -> the paper's filters -> VQGAN codes -> shards (-> the Hub).
- ``scene_scores``: what a toy picture shows (colour, shape, place, size), read from its pixels, scored against
  its caption.
- ``synthetic``: data made from nothing: the picture world (captioned shapes, ``color_match``) and codes without a
  VQGAN (``make_synthetic_shards``).
"""

from typing import TYPE_CHECKING

from collab_kit.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "codec": ["encode_codes", "decode_codes", "bits_per_code", "InvalidCodesError"],
        "tokenizers": [
            "caption_tokenizer",
            "tokenizer_for_vocabulary",
            "ByteCaptionTokenizer",
            "ToyTokenizer",
            "PretrainedCaptionTokenizer",
        ],
        "shards": ["write_shard", "shard_metadata", "list_shards", "is_hub_dataset", "SHARD_FORMAT"],
        "stream": ["ShardStream", "batches", "peer_stream", "peer_data_seed", "SkippedSamples", "shard_misfit"],
        "sources": ["read_pairs", "Pair", "SOURCE_FORMATS"],
        "preprocess": ["PreprocessReport", "PushError", "push_shards", "DROP_REASONS"],
        "synthetic": [
            "make_synthetic_shards",
            "make_synthetic_images",
            "write_captioned_images",
            "Scene",
            "scenes",
            "draw",
            "pictures",
            "dominant_color",
            "prompt_color",
            "color_match",
            "world_words",
        ],
    },
)

if TYPE_CHECKING:  # editors and type checkers follow these; at run time each loads on first use
    from collab_kit.data.codec import InvalidCodesError as InvalidCodesError
    from collab_kit.data.codec import bits_per_code as bits_per_code
    from collab_kit.data.codec import decode_codes as decode_codes
    from collab_kit.data.codec import encode_codes as encode_codes
    from collab_kit.data.preprocess import DROP_REASONS as DROP_REASONS
    from collab_kit.data.preprocess import PreprocessReport as PreprocessReport
    from collab_kit.data.preprocess import PushError as PushError
    from collab_kit.data.preprocess import push_shards as push_shards
    from collab_kit.data.shards import SHARD_FORMAT as SHARD_FORMAT
    from collab_kit.data.shards import is_hub_dataset as is_hub_dataset
    from collab_kit.data.shards import list_shards as list_shards
    from collab_kit.data.shards import shard_metadata as shard_metadata
    from collab_kit.data.shards import write_shard as write_shard
    from collab_kit.data.sources import SOURCE_FORMATS as SOURCE_FORMATS
    from collab_kit.data.sources import Pair as Pair
    from collab_kit.data.sources import read_pairs as read_pairs
    from collab_kit.data.stream import ShardStream as ShardStream
    from collab_kit.data.stream import SkippedSamples as SkippedSamples
    from collab_kit.data.stream import batches as batches
    from collab_kit.data.stream import peer_data_seed as peer_data_seed
    from collab_kit.data.stream import peer_stream as peer_stream
    from collab_kit.data.stream import shard_misfit as shard_misfit
    from collab_kit.data.synthetic import Scene as Scene
    from collab_kit.data.synthetic import color_match as color_match
    from collab_kit.data.synthetic import dominant_color as dominant_color
    from collab_kit.data.synthetic import draw as draw
    from collab_kit.data.synthetic import make_synthetic_images as make_synthetic_images
    from collab_kit.data.synthetic import make_synthetic_shards as make_synthetic_shards
    from collab_kit.data.synthetic import pictures as pictures
    from collab_kit.data.synthetic import prompt_color as prompt_color
    from collab_kit.data.synthetic import scenes as scenes
    from collab_kit.data.synthetic import world_words as world_words
    from collab_kit.data.synthetic import write_captioned_images as write_captioned_images
    from collab_kit.data.tokenizers import ByteCaptionTokenizer as ByteCaptionTokenizer
    from collab_kit.data.tokenizers import PretrainedCaptionTokenizer as PretrainedCaptionTokenizer
    from collab_kit.data.tokenizers import ToyTokenizer as ToyTokenizer
    from collab_kit.data.tokenizers import caption_tokenizer as caption_tokenizer
    from collab_kit.data.tokenizers import tokenizer_for_vocabulary as tokenizer_for_vocabulary
