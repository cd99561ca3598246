"""Checkpoints: a model's weights (safetensors) and the run's configuration (JSON) in one folder.

The monitor writes this format and the inference notebook reads it, from a local folder or a
Hugging Face Hub model repository:

    folder/
        model.safetensors   the model's parameters (a tensor shared by several layers is stored once)
        config.json         {"run": RunConfig.to_dict(), "metadata": {...}} (epoch, loss, ...)
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from typing import Optional, Tuple

import safetensors.torch
import torch

from collab_kit.config import RunConfig
from collab_kit.model import TextToImageTransformer

logger = logging.getLogger(__name__)

WEIGHTS_NAME, CONFIG_NAME = "model.safetensors", "config.json"


def save_checkpoint(model: torch.nn.Module, config: RunConfig, folder: str, metadata: Optional[dict] = None) -> str:
    """Write the model and its configuration to ``folder`` (replaced as a whole, so a crash never leaves half).

    :param model: the model to save
    :param config: the run's configuration, saved beside the weights so the model can be rebuilt
    :param metadata: JSON-serializable facts about the checkpoint (global epoch, loss, ...)
    :returns: the folder
    """
    folder = os.path.abspath(folder)
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".checkpoint-", dir=parent)
    try:
        safetensors.torch.save_model(model, os.path.join(staging, WEIGHTS_NAME))
        with open(os.path.join(staging, CONFIG_NAME), "w") as f:
            json.dump(dict(run=config.to_dict(), metadata=metadata or {}), f, indent=2)
        if os.path.exists(folder):
            old = folder + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(folder, old)
            os.replace(staging, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info(f"saved a checkpoint to {folder}")
    return folder


def resolve_checkpoint(location: str, revision: Optional[str] = None) -> str:
    """A local folder holding a checkpoint: ``location`` itself, or a Hub repository downloaded to the cache.

    :param location: a local folder, or a Hub model repository id such as ``user/model``
    :param revision: the Hub revision (branch, tag or commit); ignored for local folders
    """
    if os.path.isdir(location):
        folder = location
    elif os.path.exists(location):
        raise ValueError(f"{location!r} is a file: pass the folder that holds {WEIGHTS_NAME} and {CONFIG_NAME}")
    elif location.count("/") == 1 and not location.startswith((".", "/")):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        try:
            folder = snapshot_download(location, revision=revision, allow_patterns=[WEIGHTS_NAME, CONFIG_NAME])
        except (RepositoryNotFoundError, RevisionNotFoundError) as e:
            raise FileNotFoundError(
                f"no checkpoint at {location!r}: there is no local folder of that name, and the Hub has no model "
                f"repository {location!r} at revision {revision or 'main'!r} (or it is private: log in with "
                f"`hf auth login`)") from e
    else:
        raise FileNotFoundError(f"no checkpoint at {location!r}: pass a local folder or a Hub repository id "
                                f"such as 'user/model'")
    missing = [name for name in (WEIGHTS_NAME, CONFIG_NAME) if not os.path.exists(os.path.join(folder, name))]
    if missing:
        raise FileNotFoundError(f"{location!r} is not a collab_kit checkpoint: {', '.join(missing)} missing")
    return folder


def load_checkpoint(location: str, revision: Optional[str] = None) -> Tuple[TextToImageTransformer, RunConfig, dict]:
    """Rebuild the model from a checkpoint folder or Hub repository; returns (model, config, metadata)."""
    folder = resolve_checkpoint(location, revision)
    with open(os.path.join(folder, CONFIG_NAME)) as f:
        saved = json.load(f)
    config = RunConfig.from_dict(saved["run"])
    model = TextToImageTransformer(config.model)
    try:
        missing, unexpected = safetensors.torch.load_model(model, os.path.join(folder, WEIGHTS_NAME), strict=False)
    except RuntimeError as e:  # tensors of other shapes than the configuration's
        raise ValueError(f"the checkpoint at {location!r} does not fit its own configuration: {e}") from None
    if missing or unexpected:
        raise ValueError(f"the checkpoint at {location!r} does not fit its own configuration "
                         f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")
    return model.eval(), config, saved.get("metadata", {})
