"""How much memory training a model takes, and the settings that make it fit a GPU.

    from collab_kit import memory
    memory.estimate("gpt2-large", optimizer="8bit", checkpointing=True, micro_batch=4)
    memory.recommend_settings("paper", 16 * memory.GiB)

- ``catalogue``: models known by name (BERT, T5, GPT-2, GPT-3, GPT-J, DALL-E) as dimensions.
- ``architecture``: what a model is made of (tensors, dimensions), whatever it was given as.
- ``estimator``: ``estimate`` and ``compare``: weights, gradients, optimizer state (exact) and activations
  (a per-layer formula) of a named shape, a preset, a config or any torch module.
- ``recommend``: ``recommend_settings``, the largest micro-batch that fits, with or without checkpointing;
  ``fit_to_device``, a peer's device plan with those settings (the CPU when its GPU cannot hold the model).
- ``measured``: the bytes torch and bitsandbytes really allocated, to check the estimate against.
- ``widgets``: the stacked bar chart and the notebook's interactive calculator.
"""

from collab_kit.lazy import lazy_exports
from collab_kit.units import GiB, MiB, format_bytes

__getattr__, _lazy_names = lazy_exports(
    __name__,
    {
        "catalogue": ["CATALOGUE", "ModelShape", "known_models"],
        "estimator": [
            "estimate",
            "compare",
            "MemoryEstimate",
            "optimizer_bytes_for",
            "OPTIMIZERS",
            "OPTIMIZER_NAMES",
            "PRECISIONS",
            "BNB_MIN_8BIT_SIZE",
        ],
        "recommend": [
            "recommend_settings",
            "Recommendation",
            "MIN_MICRO_BATCH_WITHOUT_CHECKPOINTING",
            "fit_to_device",
            "DeviceFit",
            "recommend_for_plan",
        ],
        "measured": ["parameter_bytes", "gradient_bytes", "optimizer_state_bytes"],
        "widgets": ["plot_estimates", "figure_png", "calculator_widget", "MemoryCalculator", "summary"],
    },
)
__all__ = ["GiB", "MiB", "format_bytes", *_lazy_names]
