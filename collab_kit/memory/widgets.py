"""Pictures of the estimate: a stacked bar chart of where the memory goes, and the notebook's interactive calculator."""

from __future__ import annotations

import html
import io
from collections.abc import Mapping

from collab_kit.memory.architecture import resolve_model
from collab_kit.memory.catalogue import known_models
from collab_kit.memory.estimator import OPTIMIZERS, MemoryEstimate, compare, estimate, normalize_precision
from collab_kit.memory.recommend import Recommendation, recommend_settings
from collab_kit.units import GiB

# ---------------------------------------------------------------------------------------------
# pictures: a stacked bar chart and the interactive calculator

PART_COLOURS = {"weights": "#4c72b0", "gradients": "#55a868", "optimizer state": "#c44e52", "activations": "#dd8452"}


def plot_estimates(
    estimates: Mapping[str, MemoryEstimate], gpu_memory_bytes: int | None = None, ax=None, title: str | None = None
):
    """Stacked bars of what each estimate puts on the GPU (GiB), a line at the GPU's memory; returns the axes.

    Offloaded optimizer state is written above its bar (it is in CPU memory, not in the bar).

    :param estimates: label -> estimate, one bar each (e.g. ``compare(...)``)
    :param gpu_memory_bytes: draw the GPU's memory as a horizontal line
    :param ax: matplotlib axes to draw into (default: a new pyplot figure)
    """
    if not estimates:
        raise ValueError("plot_estimates needs at least one estimate")
    if ax is None:
        # lazy: matplotlib takes a second to import; only a plot needs it
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(1.8 * len(estimates) + 3, 4.5))
    labels = list(estimates)
    bottoms = [0.0] * len(labels)
    for part, colour in PART_COLOURS.items():
        heights = [estimates[label].parts()[part] / GiB for label in labels]
        ax.bar(labels, heights, bottom=bottoms, color=colour, label=part)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for index, label in enumerate(labels):
        item = estimates[label]
        text = f"{item.gpu_bytes / GiB:.1f}"
        if item.offload:
            text += f"\n(+{item.cpu_bytes / GiB:.1f} in RAM)"
        ax.annotate(
            text,
            (index, bottoms[index]),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 2),
            textcoords="offset points",
        )
    if gpu_memory_bytes:
        ax.axhline(
            gpu_memory_bytes / GiB,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"GPU memory ({gpu_memory_bytes / GiB:.0f} GiB)",
        )
    ax.set_ylabel("GPU memory (GiB)")
    ax.set_ylim(0, max(max(bottoms), (gpu_memory_bytes or 0) / GiB) * 1.2)
    first = next(iter(estimates.values()))
    ax.set_title(
        title
        or f"{first.model}, micro-batch {first.micro_batch}" + (f" x {first.seq_len} tokens" if first.seq_len else "")
    )
    ax.tick_params(axis="x", labelrotation=15, labelsize=8)
    ax.legend(fontsize=8, loc="upper right")
    return ax


def figure_png(estimates: Mapping[str, MemoryEstimate], gpu_memory_bytes: int | None = None, **kwargs) -> bytes:
    """``plot_estimates`` rendered to PNG bytes, without pyplot (for widgets and pages)."""
    # lazy: matplotlib takes a second to import; only a plot needs it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(1.8 * len(estimates) + 3, 4.5))
    FigureCanvasAgg(figure)
    plot_estimates(estimates, gpu_memory_bytes, ax=figure.add_subplot(), **kwargs)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=80)
    return buffer.getvalue()


class MemoryCalculator:
    """The interactive calculator: dropdowns and sliders, the estimate table, a recommendation and a chart.

    Display it in a notebook (it shows ``panel``); ``estimate`` and ``recommendation`` follow the controls.
    """

    def __init__(
        self,
        model: str = "gpt2-large",
        optimizer: str = "8bit",
        micro_batch: int = 1,
        seq_len: int | None = None,
        checkpointing: bool = True,
        offload: bool = False,
        shared_groups: int | None = None,
        precision: str = "mixed",
        gpu_memory_gib: float = 16,
    ):
        # lazy: ipywidgets is needed by the widget only
        import ipywidgets as widgets

        if model not in known_models():
            raise ValueError(f"unknown model {model!r}: the calculator offers {', '.join(known_models())}")
        self.estimate: MemoryEstimate | None = None
        self.recommendation: Recommendation | None = None
        self.error: str | None = None
        style = {"description_width": "110px"}
        self.model = widgets.Dropdown(options=known_models(), value=model, description="model", style=style)
        self.optimizer = widgets.Dropdown(
            options=list(OPTIMIZERS), value=optimizer, description="optimizer", style=style
        )
        self.precision = widgets.Dropdown(
            options=["mixed", "fp32", "16bit"],
            value=normalize_precision(precision),
            description="precision",
            style=style,
        )
        self.micro_batch = widgets.IntSlider(value=micro_batch, min=1, max=64, description="micro-batch", style=style)
        self.seq_len = widgets.IntSlider(value=1, min=1, max=2, description="sequence", style=style)
        self.checkpointing = widgets.Checkbox(value=checkpointing, description="checkpointing")
        self.offload = widgets.Checkbox(value=offload, description="offload to CPU")
        self.shared_groups = widgets.IntSlider(
            value=shared_groups or 0, min=0, max=2, style=style, description="shared groups", tooltip="0: no sharing"
        )
        self.gpu_memory_gib = widgets.FloatSlider(
            value=gpu_memory_gib, min=2, max=80, step=1, style=style, description="GPU memory GiB"
        )
        self.text = widgets.HTML()
        self.chart = widgets.Image(format="png")
        self._fit_sliders(seq_len)
        controls = widgets.VBox(
            [
                self.model,
                self.optimizer,
                self.precision,
                self.micro_batch,
                self.seq_len,
                self.shared_groups,
                self.gpu_memory_gib,
                widgets.HBox([self.checkpointing, self.offload]),
            ]
        )
        self.panel = widgets.VBox([widgets.HBox([controls, self.chart]), self.text])
        self.model.observe(self._model_changed, names="value")
        for control in (
            self.optimizer,
            self.precision,
            self.micro_batch,
            self.seq_len,
            self.checkpointing,
            self.offload,
            self.shared_groups,
            self.gpu_memory_gib,
        ):
            control.observe(lambda change: self.update(), names="value")
        self.update()

    def _fit_sliders(self, seq_len: int | None = None) -> None:
        """Set the sequence and sharing sliders' ranges to the model's."""
        arch, _ = resolve_model(self.model.value, None)
        top = arch.max_seq_len or max(arch.seq_len or 1, 2 * (arch.seq_len or 1))
        self.seq_len.max = max(top, 2)
        self.seq_len.value = min(seq_len or arch.seq_len or 1, self.seq_len.max)
        self.seq_len.disabled = arch.fixed_seq_len
        self.shared_groups.disabled = not arch.shareable
        self.shared_groups.max = arch.layers or 1
        if not arch.shareable:
            self.shared_groups.value = 0

    def _model_changed(self, change) -> None:
        self._updating = True
        try:
            self._fit_sliders()
        finally:
            self._updating = False
        self.update()

    def update(self) -> None:
        """Recompute the estimate and the recommendation; redraw the table and the chart."""
        if getattr(self, "_updating", False):
            return

        settings = dict(
            optimizer=self.optimizer.value,
            precision=self.precision.value,
            seq_len=None if self.seq_len.disabled else self.seq_len.value,
            shared_groups=self.shared_groups.value or None,
        )
        gpu = int(self.gpu_memory_gib.value * GiB)
        try:
            self.estimate = estimate(
                self.model.value,
                micro_batch=self.micro_batch.value,
                checkpointing=self.checkpointing.value,
                offload=self.offload.value,
                **settings,
            )
            self.recommendation = recommend_settings(self.model.value, gpu, offload=self.offload.value, **settings)
            self.error = None
        except ValueError as e:
            self.error = str(e)
            self.text.value = f"<pre>{html.escape(self.error)}</pre>"
            return
        verdict = "fit" if self.estimate.gpu_bytes <= gpu else "do NOT fit"
        self.text.value = (
            f"<pre>{html.escape(self.estimate.table())}\n\n"
            f"These settings {verdict} in {self.gpu_memory_gib.value:.0f} GiB.\n"
            f"Recommended: {html.escape(self.recommendation.reason)}</pre>"
        )
        others = {k: v for k, v in settings.items() if k != "optimizer"}
        self.chart.value = figure_png(
            {
                "these settings": self.estimate,
                **compare(self.model.value, micro_batch=self.micro_batch.value, **others),
            },
            gpu,
        )

    def _repr_mimebundle_(self, **kwargs):
        return self.panel._repr_mimebundle_(**kwargs)


def calculator_widget(**settings) -> MemoryCalculator:
    """The interactive memory calculator for a notebook (ipywidgets); see ``MemoryCalculator`` for the settings."""
    return MemoryCalculator(**settings)


def summary(
    chosen: MemoryEstimate,
    comparison: Mapping[str, MemoryEstimate],
    recommendation: Recommendation,
    gpu_memory_bytes: int,
) -> dict:
    """What the memory calculator notebook found, as JSON-able values (its SUMMARY_PATH file)."""
    return dict(
        model=chosen.model,
        gpu_memory_bytes=int(gpu_memory_bytes),
        fits=chosen.gpu_bytes <= gpu_memory_bytes,
        chosen=chosen.to_dict(),
        comparison={label: item.to_dict() for label, item in comparison.items()},
        recommendation=dict(
            micro_batch=recommendation.micro_batch,
            checkpointing=recommendation.checkpointing,
            fits=recommendation.fits,
            reason=recommendation.reason,
            gpu_bytes=recommendation.estimate.gpu_bytes,
        ),
    )
