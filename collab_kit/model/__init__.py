"""The networks: the text-to-image transformer, and the VQGAN and CLIP around it.

- ``transformer``: ``TextToImageTransformer``, a decoder-only transformer over ``[caption tokens; image codes]``
  (section 3.1 of the paper), with parameter counts and a seeded initialization every peer shares.
- ``device``: where a peer trains and in what precision, chosen from its machine's facts, and fp16's loss scaling.
- ``attention``: the sparse attention layouts (row, column, convolutional, full) and their masks.
- ``reversible``: reversible residual layers, which keep only each layer's input for the backward pass (and replay
  the forward's random state there).
- ``sampling``: drawing image codes one at a time (top-k, top-p) with a cache of keys and values.
- ``checkpoint``: saving and loading a model with its run configuration (folder, Hub), and rotating checkpoints.
- ``vqgan``: taming-transformers' VQGAN as the image codec (encode, decode); ``vqgan_files``: loading it from a
  folder, a file or the Hub, and saving it.
- ``clip_rank``: ranking drawn images by CLIP's similarity to the prompt.
"""

from typing import TYPE_CHECKING

from collab_kit.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "transformer": [
            "TextToImageTransformer",
            "count_parameters",
            "describe",
            "model_seed",
            "initial_model",
            "non_finite_parameters",
        ],
        "device": ["DevicePlan", "choose_device", "read_device_facts", "LossScaler"],
        "attention": ["Layout"],
        "sampling": ["generate_image_codes", "PAPER_TOP_K", "PAPER_TOP_P", "TOY_TEMPERATURE", "TOY_TOP_K"],
        "checkpoint": [
            "save_checkpoint",
            "load_checkpoint",
            "load_latest_checkpoint",
            "list_checkpoints",
            "rotate_checkpoints",
        ],
        "vqgan": ["VQGAN", "build_vqgan", "untrained_vqgan", "images_to_pil", "pil_to_tensor"],
        "vqgan_files": ["load_vqgan", "save_vqgan"],
        "clip_rank": ["ClipRanker", "DEFAULT_CLIP"],
    },
)

if TYPE_CHECKING:  # editors and type checkers follow these; at run time each loads on first use
    from collab_kit.model.attention import Layout as Layout
    from collab_kit.model.checkpoint import list_checkpoints as list_checkpoints
    from collab_kit.model.checkpoint import load_checkpoint as load_checkpoint
    from collab_kit.model.checkpoint import load_latest_checkpoint as load_latest_checkpoint
    from collab_kit.model.checkpoint import rotate_checkpoints as rotate_checkpoints
    from collab_kit.model.checkpoint import save_checkpoint as save_checkpoint
    from collab_kit.model.clip_rank import DEFAULT_CLIP as DEFAULT_CLIP
    from collab_kit.model.clip_rank import ClipRanker as ClipRanker
    from collab_kit.model.device import DevicePlan as DevicePlan
    from collab_kit.model.device import LossScaler as LossScaler
    from collab_kit.model.device import choose_device as choose_device
    from collab_kit.model.device import read_device_facts as read_device_facts
    from collab_kit.model.sampling import PAPER_TOP_K as PAPER_TOP_K
    from collab_kit.model.sampling import PAPER_TOP_P as PAPER_TOP_P
    from collab_kit.model.sampling import TOY_TEMPERATURE as TOY_TEMPERATURE
    from collab_kit.model.sampling import TOY_TOP_K as TOY_TOP_K
    from collab_kit.model.sampling import generate_image_codes as generate_image_codes
    from collab_kit.model.transformer import TextToImageTransformer as TextToImageTransformer
    from collab_kit.model.transformer import count_parameters as count_parameters
    from collab_kit.model.transformer import describe as describe
    from collab_kit.model.transformer import initial_model as initial_model
    from collab_kit.model.transformer import model_seed as model_seed
    from collab_kit.model.transformer import non_finite_parameters as non_finite_parameters
    from collab_kit.model.vqgan import VQGAN as VQGAN
    from collab_kit.model.vqgan import build_vqgan as build_vqgan
    from collab_kit.model.vqgan import images_to_pil as images_to_pil
    from collab_kit.model.vqgan import pil_to_tensor as pil_to_tensor
    from collab_kit.model.vqgan import untrained_vqgan as untrained_vqgan
    from collab_kit.model.vqgan_files import load_vqgan as load_vqgan
    from collab_kit.model.vqgan_files import save_vqgan as save_vqgan
