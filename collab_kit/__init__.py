"""collab_kit: train transformers together over the Internet, after "Training Transformers Together".

The names most people need are here; each lives in the module named after its concept
(see README.md, "How it fits together"). Heavy modules (torch, hivemind) load on first use.
"""
import logging

from collab_kit.config import (DataConfig, ModelConfig, OptimizerConfig, RunConfig, SettingFileMissing, SettingProblem,
                               SwarmConfig, get_preset)

__version__ = "0.1.0"


class _Unused4bitKernelsFilter(logging.Filter):
    """bitsandbytes warns at import that its optional CPU kernels for 4-bit layers are missing: the kit uses its
    8-bit optimizers only, so on a run where nothing is wrong this would be a notebook's one red box."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "gemm_4bit" not in record.getMessage()


# before any module of the kit imports bitsandbytes (the warning comes at its import)
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_Unused4bitKernelsFilter())

_LAZY = {
    "Volunteer": "collab_kit.volunteer",
    "TextToImageTransformer": "collab_kit.model",
    "make_optimizer": "collab_kit.optim",
    "start_dht": "collab_kit.swarm",
    "run_demo": "collab_kit.demo",
    "make_synthetic_shards": "collab_kit.data",
    "run_coordinator": "collab_kit.monitor",
    "Monitor": "collab_kit.monitor",
    "MonitorSettings": "collab_kit.monitor",
    "generate_images": "collab_kit.generate",
    "load_for_inference": "collab_kit.inference",
    "save_checkpoint": "collab_kit.checkpoint",
    "load_checkpoint": "collab_kit.checkpoint",
    "load_latest_checkpoint": "collab_kit.checkpoint",
    "load_vqgan": "collab_kit.vqgan",
    "ClipRanker": "collab_kit.clip_rank",
    "login": "collab_kit.auth",
    "run_preflight": "collab_kit.preflight",
    "LiveView": "collab_kit.live_view",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'collab_kit' has no attribute {name!r}")


__all__ = ["ModelConfig", "OptimizerConfig", "RunConfig", "SwarmConfig", "DataConfig", "get_preset", "SettingProblem",
           "SettingFileMissing", *_LAZY]
