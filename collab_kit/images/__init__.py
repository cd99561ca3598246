"""Pictures from a trained model: sample image codes for a prompt, decode them, keep what CLIP likes best.

- ``generate``: ``generate_images`` (the paper's 128 draws per prompt, the best 4 by CLIP, as one grid),
  ``draw_images`` (no ranking) and ``prompt_sheet`` (grids below their prompts).
- ``inference``: ``load_for_inference``, a checkpoint with the VQGAN and CLIP it goes with (the toy world's shipped
  ones for a toy run), and ``draw_prompts``, what the inference notebook and the demo show.
"""

from typing import TYPE_CHECKING

from collab_kit.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "generate": [
            "generate_images",
            "draw_images",
            "prompt_sheet",
            "image_grid",
            "encode_prompt",
            "check_vqgan_fits",
        ],
        "inference": ["load_for_inference", "draw_prompts", "InferencePieces", "InferenceResult", "resolve_device"],
    },
)

if TYPE_CHECKING:  # editors and type checkers follow these; at run time each loads on first use
    from collab_kit.images.generate import check_vqgan_fits as check_vqgan_fits
    from collab_kit.images.generate import draw_images as draw_images
    from collab_kit.images.generate import encode_prompt as encode_prompt
    from collab_kit.images.generate import generate_images as generate_images
    from collab_kit.images.generate import image_grid as image_grid
    from collab_kit.images.generate import prompt_sheet as prompt_sheet
    from collab_kit.images.inference import InferencePieces as InferencePieces
    from collab_kit.images.inference import InferenceResult as InferenceResult
    from collab_kit.images.inference import draw_prompts as draw_prompts
    from collab_kit.images.inference import load_for_inference as load_for_inference
    from collab_kit.images.inference import resolve_device as resolve_device
