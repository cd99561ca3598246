"""collab_kit: train transformers together over the Internet, after "Training Transformers Together".

The names most people need are here; each lives in the subpackage of its concept (docs/architecture.md, "The
modules"):

- ``config``, ``errors``, ``units``, ``addresses``: the run's settings and presets, the base error, sizes, peer
  addresses (no torch, no hivemind); ``hivemind_seam``: the hivemind version the kit needs (checked first, at
  import) and the private hivemind names it touches.
- ``model/``: the transformer, its attention and sampling, checkpoints, the VQGAN and CLIP.
- ``data/``: codes, caption tokenizers, shards and the stream of batches, preprocessing, synthetic data.
- ``memory/``: how much memory training takes, and the settings that fit a GPU.
- ``auth/``: access tokens, the volunteer's login, the authentication server.
- ``toy/``: the toy world's VQGAN, CLIP and dataset.
- ``swarm/``: the DHT, the collaborative optimizer, its averagers and robust aggregation, metrics.
- ``images/``: pictures from a trained model.
- ``tutorial/``: the GPT-2 8-bit fine-tuning tutorial.
- ``roles/``: the volunteer, the monitor, local processes and a maintainer's services.
- ``widgets/``: pre-flight checks, the live view, the dashboard.
- ``demo``, ``cli/``: the local demo, the command line.
"""

from collab_kit.hivemind_seam import require_tested_hivemind

require_tested_hivemind()  # before anything of the kit's loads hivemind: another version gets one sentence

from typing import TYPE_CHECKING  # noqa: E402

from collab_kit.config import (  # noqa: E402
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    RunConfig,
    SettingFileMissing,
    SettingProblem,
    SwarmConfig,
    get_preset,
)
from collab_kit.errors import CollabKitError  # noqa: E402
from collab_kit.lazy import lazy_exports  # noqa: E402
from collab_kit.units import format_bytes  # noqa: E402

__version__ = "0.1.0"

# the heavy names (torch, hivemind, transformers) load on first use: `import collab_kit` stays fast
__getattr__, _lazy_names = lazy_exports(
    __name__,
    {
        "roles.volunteer": ["Volunteer"],
        "roles.monitor": ["Monitor"],
        "roles.monitor_settings": ["MonitorSettings"],
        "roles.services": ["*module*"],
        "model.transformer": ["TextToImageTransformer"],
        "model.checkpoint": ["save_checkpoint", "load_checkpoint", "load_latest_checkpoint"],
        "model.vqgan_files": ["load_vqgan"],
        "model.clip_rank": ["ClipRanker"],
        "swarm.optimizer": ["make_optimizer"],
        "swarm.dht": ["start_dht"],
        "data.synthetic": ["make_synthetic_shards"],
        "images.generate": ["generate_images"],
        "images.inference": ["load_for_inference"],
        "auth.client": ["login"],
        "widgets.preflight": ["run_preflight"],
        "widgets.live_view": ["LiveView"],
        "widgets.dashboard": ["*module*"],
        "demo": ["run_demo"],
    },
)

if TYPE_CHECKING:  # editors and type checkers follow these; at run time each loads on first use
    from collab_kit.auth.client import login as login
    from collab_kit.data.synthetic import make_synthetic_shards as make_synthetic_shards
    from collab_kit.demo import run_demo as run_demo
    from collab_kit.images.generate import generate_images as generate_images
    from collab_kit.images.inference import load_for_inference as load_for_inference
    from collab_kit.model.checkpoint import load_checkpoint as load_checkpoint
    from collab_kit.model.checkpoint import load_latest_checkpoint as load_latest_checkpoint
    from collab_kit.model.checkpoint import save_checkpoint as save_checkpoint
    from collab_kit.model.clip_rank import ClipRanker as ClipRanker
    from collab_kit.model.transformer import TextToImageTransformer as TextToImageTransformer
    from collab_kit.model.vqgan_files import load_vqgan as load_vqgan
    from collab_kit.roles import services as services
    from collab_kit.roles.monitor import Monitor as Monitor
    from collab_kit.roles.monitor_settings import MonitorSettings as MonitorSettings
    from collab_kit.roles.volunteer import Volunteer as Volunteer
    from collab_kit.swarm.dht import start_dht as start_dht
    from collab_kit.swarm.optimizer import make_optimizer as make_optimizer
    from collab_kit.widgets import dashboard as dashboard
    from collab_kit.widgets.live_view import LiveView as LiveView
    from collab_kit.widgets.preflight import run_preflight as run_preflight

__all__ = [
    "ModelConfig",
    "OptimizerConfig",
    "RunConfig",
    "SwarmConfig",
    "DataConfig",
    "get_preset",
    "SettingProblem",
    "SettingFileMissing",
    "CollabKitError",
    "format_bytes",
    *_lazy_names,
]
