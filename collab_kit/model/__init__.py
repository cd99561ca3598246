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
        "sampling": ["generate_image_codes", "PAPER_TOP_K", "PAPER_TOP_P", "TOY_TOP_K"],
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
