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

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:  # editors and type checkers follow these; at run time each loads on first use
    from collab_kit.memory.catalogue import CATALOGUE as CATALOGUE
    from collab_kit.memory.catalogue import ModelShape as ModelShape
    from collab_kit.memory.catalogue import known_models as known_models
    from collab_kit.memory.estimator import BNB_MIN_8BIT_SIZE as BNB_MIN_8BIT_SIZE
    from collab_kit.memory.estimator import OPTIMIZER_NAMES as OPTIMIZER_NAMES
    from collab_kit.memory.estimator import OPTIMIZERS as OPTIMIZERS
    from collab_kit.memory.estimator import PRECISIONS as PRECISIONS
    from collab_kit.memory.estimator import MemoryEstimate as MemoryEstimate
    from collab_kit.memory.estimator import compare as compare
    from collab_kit.memory.estimator import estimate as estimate
    from collab_kit.memory.estimator import optimizer_bytes_for as optimizer_bytes_for
    from collab_kit.memory.measured import gradient_bytes as gradient_bytes
    from collab_kit.memory.measured import optimizer_state_bytes as optimizer_state_bytes
    from collab_kit.memory.measured import parameter_bytes as parameter_bytes
    from collab_kit.memory.recommend import (
        MIN_MICRO_BATCH_WITHOUT_CHECKPOINTING as MIN_MICRO_BATCH_WITHOUT_CHECKPOINTING,
    )
    from collab_kit.memory.recommend import DeviceFit as DeviceFit
    from collab_kit.memory.recommend import Recommendation as Recommendation
    from collab_kit.memory.recommend import fit_to_device as fit_to_device
    from collab_kit.memory.recommend import recommend_for_plan as recommend_for_plan
    from collab_kit.memory.recommend import recommend_settings as recommend_settings
    from collab_kit.memory.widgets import MemoryCalculator as MemoryCalculator
    from collab_kit.memory.widgets import calculator_widget as calculator_widget
    from collab_kit.memory.widgets import figure_png as figure_png
    from collab_kit.memory.widgets import plot_estimates as plot_estimates
    from collab_kit.memory.widgets import summary as summary
__all__ = ["GiB", "MiB", "format_bytes", *_lazy_names]
