"""The learners' tutorial: fine-tune GPT-2 on streamed C4 text with an 8-bit optimizer, and see what it saves.

- ``text_stream``: C4-like text (a Hub dataset streamed, or local shards made when the Hub cannot be reached),
  tokenized with GPT-2's BPE and packed into blocks.
- ``finetuning``: loading GPT-2 (Hub name or config), 32-bit or 8-bit Adam, the training loop, and the measured
  optimizer memory beside collab_kit.memory's estimate, as a table and a chart.
"""

from collab_kit.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "text_stream": [
            "stream_texts",
            "block_batches",
            "pack_blocks",
            "gpt2_tokenizer",
            "make_text_shards",
            "GPT2_CONTEXT",
        ],
        "finetuning": [
            "finetune",
            "load_gpt2",
            "make_adam",
            "compare_optimizer_memory",
            "memory_table",
            "plot_memory_comparison",
            "plot_losses",
            "TrainResult",
        ],
    },
)
