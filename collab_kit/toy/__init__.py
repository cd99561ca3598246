"""The toy world's models and dataset: what lets the whole pipeline run offline on the picture world.

The pictures and captions themselves are collab_kit.data.synthetic; here is what is trained on them and shipped, so
nothing trains at demo time:

- ``vqgan``: the toy VQGAN (8x8 codes of 512 for 64x64 pictures): training, evaluation, ``load_toy_vqgan``.
- ``clip``: the toy CLIP that ranks drawings: training, evaluation, ``load_toy_clip``.
- ``dataset``: ``prepare_toy_dataset``, the world's pictures through ``collab_kit.data.preprocess``, cached.
- ``assets/``: the trained weights of both, with the figures their training measured.
"""

from typing import TYPE_CHECKING

from collab_kit.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "vqgan": [
            "load_toy_vqgan",
            "train_toy_vqgan",
            "evaluate_toy_vqgan",
            "toy_vqgan_metrics",
            "TOY_VQGAN_DIR",
            "ToyVQGANMissing",
        ],
        "clip": ["load_toy_clip", "train_toy_clip", "evaluate_toy_clip", "toy_clip_metrics", "TOY_CLIP_DIR"],
        "dataset": ["prepare_toy_dataset", "default_cache_dir"],
    },
)

if TYPE_CHECKING:  # editors and type checkers follow these; at run time each loads on first use
    from collab_kit.toy.clip import TOY_CLIP_DIR as TOY_CLIP_DIR
    from collab_kit.toy.clip import evaluate_toy_clip as evaluate_toy_clip
    from collab_kit.toy.clip import load_toy_clip as load_toy_clip
    from collab_kit.toy.clip import toy_clip_metrics as toy_clip_metrics
    from collab_kit.toy.clip import train_toy_clip as train_toy_clip
    from collab_kit.toy.dataset import default_cache_dir as default_cache_dir
    from collab_kit.toy.dataset import prepare_toy_dataset as prepare_toy_dataset
    from collab_kit.toy.vqgan import TOY_VQGAN_DIR as TOY_VQGAN_DIR
    from collab_kit.toy.vqgan import ToyVQGANMissing as ToyVQGANMissing
    from collab_kit.toy.vqgan import evaluate_toy_vqgan as evaluate_toy_vqgan
    from collab_kit.toy.vqgan import load_toy_vqgan as load_toy_vqgan
    from collab_kit.toy.vqgan import toy_vqgan_metrics as toy_vqgan_metrics
    from collab_kit.toy.vqgan import train_toy_vqgan as train_toy_vqgan
