"""Pictures from a trained model: sample image codes for a prompt, decode them, keep what CLIP likes best.

- ``generate``: ``generate_images`` (the paper's 128 draws per prompt, the best 4 by CLIP, as one grid),
  ``draw_images`` (no ranking) and ``prompt_sheet`` (grids below their prompts).
- ``inference``: ``load_for_inference``, a checkpoint with the VQGAN and CLIP it goes with (the toy world's shipped
  ones for a toy run), and ``draw_prompts``, what the inference notebook and the demo show.
"""

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
