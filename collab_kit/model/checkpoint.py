"""Checkpoints: a model's weights (safetensors) and the run's configuration (JSON) in one folder.

The monitor writes this format and the inference notebook reads it, from a local folder or a
Hugging Face Hub model repository:

    folder/
        model.safetensors   the model's parameters (a tensor shared by several layers is stored once)
        config.json         {"run": RunConfig.to_dict(), "metadata": {...}} (epoch, loss, ...)

The monitor keeps a series of them, one folder per global epoch, and only the last few:

    checkpoints/
        epoch-000040/       model.safetensors, config.json
        epoch-000050/

``load_latest_checkpoint(checkpoints)`` (and ``load_checkpoint`` given such a parent folder) loads the newest
one that is whole: a checkpoint that does not load (a truncated file, a garbled configuration) is skipped
with a warning naming it, and the one before is tried.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile

import safetensors.torch
import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

from collab_kit.config import RunConfig
from collab_kit.model.transformer import TextToImageTransformer

logger = logging.getLogger(__name__)

WEIGHTS_NAME, CONFIG_NAME = "model.safetensors", "config.json"
SERIES_PATTERN = re.compile(r"^epoch-(\d+)$")  # the folders of a series of checkpoints (checkpoint_name)
STAGING_PREFIX = ".checkpoint-"  # save_checkpoint's staging folders; one left behind means a crash mid-save


def save_checkpoint(model: torch.nn.Module, config: RunConfig, folder: str, metadata: dict | None = None) -> str:
    """Write the model and its configuration to ``folder`` (replaced as a whole, so a crash never leaves half).

    :param model: the model to save
    :param config: the run's configuration, saved beside the weights so the model can be rebuilt
    :param metadata: JSON-serializable facts about the checkpoint (global epoch, loss, ...)
    :returns: the folder
    """
    folder = os.path.abspath(folder)
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=parent)
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


def resolve_checkpoint(location: str, revision: str | None = None) -> str:
    """A local folder holding a checkpoint: ``location`` itself, or a Hub repository downloaded to the cache.

    :param location: a local folder, or a Hub model repository id such as ``user/model``
    :param revision: the Hub revision (branch, tag or commit); ignored for local folders
    """
    if os.path.isdir(location):
        folder = location
    elif os.path.exists(location):
        raise ValueError(f"{location!r} is a file: pass the folder that holds {WEIGHTS_NAME} and {CONFIG_NAME}")
    elif location.count("/") == 1 and not location.startswith((".", "/")):
        try:
            folder = snapshot_download(location, revision=revision, allow_patterns=[WEIGHTS_NAME, CONFIG_NAME])
        except (RepositoryNotFoundError, RevisionNotFoundError) as e:
            raise FileNotFoundError(
                f"no checkpoint at {location!r}: there is no local folder of that name, and the Hub has no model "
                f"repository {location!r} at revision {revision or 'main'!r} (or it is private: log in with "
                f"`hf auth login`)"
            ) from e
    else:
        raise FileNotFoundError(
            f"no checkpoint at {location!r}: pass a local folder or a Hub repository id such as 'user/model'"
        )
    missing = [name for name in (WEIGHTS_NAME, CONFIG_NAME) if not os.path.exists(os.path.join(folder, name))]
    if missing:
        raise FileNotFoundError(f"{location!r} is not a collab_kit checkpoint: {', '.join(missing)} missing")
    return folder


def load_checkpoint(location: str, revision: str | None = None) -> tuple[TextToImageTransformer, RunConfig, dict]:
    """Rebuild the model from a checkpoint folder or Hub repository; returns (model, config, metadata).

    :param location: a checkpoint folder, a Hub repository id, or a folder of ``epoch-NNNNNN`` checkpoints (the
      monitor's): then the newest one that loads (see ``load_latest_checkpoint``)
    """
    if (
        os.path.isdir(location)
        and not os.path.exists(os.path.join(location, WEIGHTS_NAME))
        and list_checkpoints(location)
    ):
        model, config, metadata, _ = load_latest_checkpoint(location)
        return model, config, metadata
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
        raise ValueError(
            f"the checkpoint at {location!r} does not fit its own configuration "
            f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
        )
    return model.eval(), config, saved.get("metadata", {})


# ---------------------------------------------------------------------------------------------
# a series of checkpoints: one folder per global epoch, the last few kept


def checkpoint_name(epoch: int) -> str:
    """The folder name of the checkpoint of global epoch ``epoch`` (zero-padded: names sort as epochs do)."""
    return f"epoch-{epoch:06d}"


def list_checkpoints(folder: str) -> list[tuple[int, str]]:
    """The checkpoints of a series, ``[(epoch, path), ...]``, oldest first (an empty list for a missing folder)."""
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        match = SERIES_PATTERN.match(name)
        if match and os.path.isdir(os.path.join(folder, name)):
            found.append((int(match.group(1)), os.path.join(folder, name)))
    return sorted(found)


def rotate_checkpoints(folder: str, keep: int) -> list[str]:
    """Remove all but the newest ``keep`` checkpoints of a series; returns the removed paths.

    Also removes staging folders a crash left behind (``save_checkpoint`` renames a staging folder into
    place, so one that is still there was never a checkpoint).
    """
    if keep < 1:
        raise ValueError(f"keep={keep}: keep at least the newest checkpoint")
    removed = [path for _, path in list_checkpoints(folder)[:-keep]]
    if os.path.isdir(folder):
        # save_checkpoint's leftovers: staging folders, and a replaced folder's ".old" copy
        removed += [
            os.path.join(folder, name)
            for name in os.listdir(folder)
            if name.startswith(STAGING_PREFIX) or (name.endswith(".old") and SERIES_PATTERN.match(name[: -len(".old")]))
        ]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def load_latest_checkpoint(folder: str) -> tuple[TextToImageTransformer, RunConfig, dict, str]:
    """Load the newest checkpoint of a series that loads whole; returns (model, config, metadata, its path).

    A checkpoint that fails to load (a truncated or missing weights file, a missing or garbled
    configuration, weights that do not fit it) is skipped with a warning that names it and says why,
    and the one before it is tried.

    :param folder: the folder of ``epoch-NNNNNN`` checkpoints (the monitor's ``--checkpoints``)
    :raises FileNotFoundError: the folder holds no checkpoint, or none of them loads (the message lists why)
    """
    series = list_checkpoints(folder)
    if not series:
        raise FileNotFoundError(
            f"no checkpoint in {folder!r}: expected folders named like {checkpoint_name(0)!r} "
            f"(the monitor writes them there with `collab-kit monitor --checkpoints {folder}`)"
        )
    problems = []
    for _epoch, path in reversed(series):
        try:
            model, config, metadata = load_checkpoint(path)
        except Exception as e:  # safetensors, json and the config's checks each raise their own kind
            problem = f"{type(e).__name__}: {e}".splitlines()[0]
            problems.append(f"{os.path.basename(path)} ({problem})")
            logger.warning(f"skipping the checkpoint {path}: it does not load ({problem}); trying the one before")
            continue
        if problems:
            logger.warning(f"loaded {path}, the newest checkpoint that loads (skipped: {', '.join(problems)})")
        return model, config, metadata, path
    raise FileNotFoundError(f"none of the {len(series)} checkpoints in {folder!r} loads: {'; '.join(problems)}")
