"""A VQGAN's files: loading taming-transformers checkpoints from a folder, a file or the Hub, and saving them.

``load_vqgan`` finds the checkpoint and its config (``last.ckpt`` + ``model.yaml``, or a Hub repository), reads the
tensors with a loader that executes nothing from the file (a pickle that needs more is refused, with how to trust
it), and builds the model of collab_kit.model.vqgan; ``save_vqgan`` writes a folder ``load_vqgan`` reads back.
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import safetensors.torch
import torch
import yaml
from huggingface_hub import hf_hub_download
from huggingface_hub.utils import EntryNotFoundError, LocalEntryNotFoundError

from collab_kit.model.vqgan import CHECKPOINT_NAME, CONFIG_NAME, IGNORED_PREFIXES, VQGAN, ConfigLike, build_vqgan

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# checkpoints


def _first_existing(folder: str, names: Sequence[str]) -> str | None:
    for name in names:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def _resolve(
    checkpoint: str, config: ConfigLike, filename: str, config_filename: str, revision: str | None
) -> tuple[str, ConfigLike]:
    """The local path of the weights and the config (given, found beside them, or None)."""
    if os.path.isdir(checkpoint):
        names = [filename, os.path.join("checkpoints", filename)]
        weights = _first_existing(checkpoint, names)
        if weights is None:
            raise FileNotFoundError(
                f"no VQGAN checkpoint in {checkpoint!r}: looked for {' and '.join(names)} "
                f"(pass filename= for another name)"
            )
        if config is None:
            config = _first_existing(checkpoint, [config_filename, os.path.join("configs", config_filename)])
        return weights, config
    if os.path.isfile(checkpoint):
        if config is None:  # beside the file, or taming's layout: checkpoints/last.ckpt + configs/model.yaml
            here = os.path.dirname(os.path.abspath(checkpoint))
            config = _first_existing(here, [config_filename, os.path.join("..", "configs", config_filename)])
        return checkpoint, config
    if checkpoint.count("/") == 1 and not checkpoint.startswith((".", "/", "~")):
        weights = hf_hub_download(checkpoint, filename, revision=revision)
        if config is None:
            try:
                config = hf_hub_download(checkpoint, config_filename, revision=revision)
            except EntryNotFoundError as e:
                if isinstance(e, LocalEntryNotFoundError):  # offline and not cached: not proof that it is absent
                    raise
                logger.info(f"{checkpoint} has no {config_filename}")
        return weights, config
    raise FileNotFoundError(
        f"no VQGAN checkpoint at {checkpoint!r}: pass a .ckpt / .pt / .safetensors file, "
        f"a folder holding {filename}, or a Hub repository id such as 'user/vqgan'"
    )


class _StandIn:
    """An inert placeholder for a class a checkpoint pickled beside its weights: none of its code runs."""

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


def _load_pickle_safely(path: str, map_location) -> object:
    """``torch.load(weights_only=True)``, with inert stand-ins for the classes a Lightning checkpoint names.

    Unpickling runs whatever code a checkpoint's author pickled, so only tensors, plain containers and
    numbers load by default. Lightning checkpoints also hold objects of its own (taming's name its
    ModelCheckpoint callback, for one) that neither the tokenizer needs nor this package can import:
    placeholders of our own take those names, and the weights load without running anything else.
    """
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        refusal = e
    serialization = torch.serialization
    if hasattr(serialization, "get_unsafe_globals_in_checkpoint"):  # torch >= 2.6
        names = serialization.get_unsafe_globals_in_checkpoint(path)
        stand_ins: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [  # the type safe_globals takes
            (type(name.rpartition(".")[2], (_StandIn,), {"__module__": name.rpartition(".")[0]}), name)
            for name in names
        ]
        try:
            with serialization.safe_globals(stand_ins):
                loaded = torch.load(path, map_location=map_location, weights_only=True)
            logger.info(f"{path}: placeholders stood in for {', '.join(names)} (not part of the weights)")
            return loaded
        except pickle.UnpicklingError as e:  # e.g. a dict subclass, which the safe loader cannot fill
            refusal = e
    raise ValueError(
        f"{path!r} holds objects that the safe loader refuses (Lightning checkpoints pickle callbacks and "
        f"hyper-parameters beside the weights). If you trust its source, load it once with "
        f"load_vqgan(..., trust_checkpoint=True) (the packages that pickled those objects must be importable) "
        f"and keep the result with save_vqgan, which writes tensors only. "
        f"The loader said: {_reason(refusal)}"
    ) from None


def _reason(error: Exception) -> str:
    """The line of torch's weights_only refusal that names what it refused (it begins with generic advice)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    specific = [line for line in lines if "GLOBAL" in line or "Can only" in line or "unsupported" in line.lower()]
    return (specific or lines or [type(error).__name__])[0]


def _read_state_dict(path: str, map_location, trust_checkpoint: bool) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        return safetensors.torch.load_file(path, device=str(map_location))
    if trust_checkpoint:
        loaded = torch.load(path, map_location=map_location, weights_only=False)
    else:
        loaded = _load_pickle_safely(path, map_location)
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]  # a Lightning checkpoint: weights beside global_step, optimizer states...
    if not isinstance(loaded, dict) or not all(isinstance(value, torch.Tensor) for value in loaded.values()):
        raise ValueError(f"{path!r} is not a VQGAN checkpoint: expected a state dict, or one under 'state_dict'")
    return loaded


def load_vqgan(
    checkpoint: str | os.PathLike,
    config: ConfigLike = None,
    *,
    filename: str = CHECKPOINT_NAME,
    config_filename: str = CONFIG_NAME,
    revision: str | None = None,
    map_location="cpu",
    trust_checkpoint: bool = False,
) -> VQGAN:
    """Load a trained VQGAN (taming's checkpoints included), in eval mode.

    The weights of the training losses (``loss.*``: discriminator, LPIPS) are skipped; any other missing or
    unexpected weight, or one of another shape than the config says, is a ``ValueError``. A Hub repository laid
    out as taming's downloads are takes ``filename="checkpoints/last.ckpt", config_filename="configs/model.yaml"``.

    :param checkpoint: a ``.ckpt`` / ``.pt`` / ``.safetensors`` file; a folder holding ``filename`` (directly or
      under ``checkpoints/``); or a Hugging Face Hub repository id ``user/name`` holding ``filename``
    :param config: the model's taming config (dict or YAML path). By default ``config_filename`` is read from
      the folder or repository (or beside the file, or in ``../configs/`` as taming lays its models out), and
      without one the paper's config is assumed
    :param filename: the checkpoint's name in a folder or repository (taming's ``last.ckpt`` by default)
    :param config_filename: the YAML config's name in a folder or repository (taming's ``model.yaml``)
    :param revision: the Hub revision (branch, tag or commit); ignored for local paths
    :param map_location: the device the model is loaded to (``"cpu"``, ``"cuda"``, a ``torch.device``)
    :param trust_checkpoint: unpickle arbitrary objects (``torch.load(weights_only=False)``): only for files
      from a source you trust, when the safe loader refuses one (it loads tensors, containers and numbers,
      with inert placeholders for other classes that a Lightning checkpoint names, e.g. its callbacks)
    """
    weights, config = _resolve(os.fspath(checkpoint), config, filename, config_filename, revision)
    if config is None:
        logger.warning(
            f"no {config_filename} found for {os.fspath(checkpoint)!r}: assuming the paper's "
            f"VQGAN config (f=8, 8192 codes); pass config= if it is another model"
        )
    model = build_vqgan(config)
    state_dict = {
        key: value
        for key, value in _read_state_dict(weights, map_location, trust_checkpoint).items()
        if not key.startswith(IGNORED_PREFIXES)
    }
    try:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
    except RuntimeError as e:  # tensors of other shapes than the config's
        raise ValueError(f"the checkpoint {weights!r} does not fit its config: {e}") from None
    if missing or unexpected:
        raise ValueError(
            f"the checkpoint {weights!r} does not fit its config: {len(missing)} missing "
            f"{_preview(missing)}, {len(unexpected)} unexpected {_preview(unexpected)}"
        )
    logger.info(f"loaded a VQGAN ({model.codebook_size} codes, f={model.downsampling_factor}) from {weights}")
    return model.to(map_location).eval()


def _preview(keys: Sequence[str], limit: int = 5) -> str:
    return f"{sorted(keys)[:limit]}{' ...' if len(keys) > limit else ''}"


def _write_atomically(path: str, write):
    """Call ``write(temporary_path)``, then move the result to ``path``: a crash never leaves half a file."""
    folder = os.path.dirname(path)
    handle, staging = tempfile.mkstemp(prefix=f".{os.path.basename(path)}-", dir=folder)
    os.close(handle)
    try:
        write(staging)
        os.replace(staging, path)
    finally:
        if os.path.exists(staging):
            os.remove(staging)


def save_vqgan(model: VQGAN, folder: str | os.PathLike) -> str:
    """Write ``model`` as a taming-style checkpoint that ``load_vqgan(folder)`` reads back.

    The weights go to ``folder/last.ckpt`` as ``{"state_dict": ...}`` (tensors only, so the safe loader
    reads it) and the config to ``folder/model.yaml`` under ``model:``. Each file is written under a
    temporary name and then renamed over the old one.

    :param model: the VQGAN to save
    :param folder: created if missing
    :returns: the folder
    """

    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    state_dict = {key: value.detach().cpu().contiguous() for key, value in model.state_dict().items()}
    # a crash between the two files leaves whole files of two saves: if they do not fit each other,
    # load_vqgan says so (missing / unexpected keys or shapes) rather than loading a mix
    _write_atomically(os.path.join(folder, CONFIG_NAME), lambda path: _dump_yaml(yaml, {"model": model.config}, path))
    _write_atomically(os.path.join(folder, CHECKPOINT_NAME), lambda path: torch.save({"state_dict": state_dict}, path))
    logger.info(f"saved a VQGAN to {folder}")
    return folder


def _dump_yaml(yaml, content: dict, path: str):
    with open(path, "w") as f:
        yaml.safe_dump(content, f, sort_keys=False)
