"""The learners' tutorial: fine-tune GPT-2 on streamed C4 text with an 8-bit optimizer, and see what it saves.

- ``text_stream``: C4-like text (a Hub dataset streamed, or local shards made when the Hub cannot be reached),
  tokenized with GPT-2's BPE and packed into blocks.
- ``finetuning``: loading GPT-2 (Hub name or config), 32-bit or 8-bit Adam, the training loop, and the measured
  optimizer memory beside collab_kit.memory's estimate, as a table and a chart.
"""

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:  # editors and type checkers follow these; at run time each loads on first use
    from collab_kit.tutorial.finetuning import TrainResult as TrainResult
    from collab_kit.tutorial.finetuning import compare_optimizer_memory as compare_optimizer_memory
    from collab_kit.tutorial.finetuning import finetune as finetune
    from collab_kit.tutorial.finetuning import load_gpt2 as load_gpt2
    from collab_kit.tutorial.finetuning import make_adam as make_adam
    from collab_kit.tutorial.finetuning import memory_table as memory_table
    from collab_kit.tutorial.finetuning import plot_losses as plot_losses
    from collab_kit.tutorial.finetuning import plot_memory_comparison as plot_memory_comparison
    from collab_kit.tutorial.text_stream import GPT2_CONTEXT as GPT2_CONTEXT
    from collab_kit.tutorial.text_stream import block_batches as block_batches
    from collab_kit.tutorial.text_stream import gpt2_tokenizer as gpt2_tokenizer
    from collab_kit.tutorial.text_stream import make_text_shards as make_text_shards
    from collab_kit.tutorial.text_stream import pack_blocks as pack_blocks
    from collab_kit.tutorial.text_stream import stream_texts as stream_texts
