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
- ``synthetic``: data made from nothing: the picture world (captioned shapes, ``color_match``) and codes without a
  VQGAN (``make_synthetic_shards``).
"""

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
