"""What a model is made of, whatever it was given as: the parameter tensors and the dimensions its activations
depend on, from a catalogue name, a ModelShape, a kit preset or config (the real model, built on the meta device) or
any torch module (counted tensor by tensor). collab_kit.memory.estimator turns it into bytes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from collab_kit.config import PRESETS, ModelConfig, RunConfig, get_preset
from collab_kit.memory.catalogue import CATALOGUE, ModelShape, known_models
from collab_kit.model.transformer import TextToImageTransformer

# ---------------------------------------------------------------------------------------------
# what a model is made of, whatever it was given as


@dataclass
class Architecture:
    """The parameter tensors of a model and the dimensions its activations depend on (None: unknown)."""

    label: str
    tensors: list[tuple[tuple[int, ...], str | None]]  # trainable: (shape, block it belongs to or None)
    frozen: int = 0  # parameters without gradients
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    attention_width: int | None = None
    ffn: int | None = None
    vocab: int | None = None
    seq_len: int | None = None  # the default sequence length
    max_seq_len: int | None = None  # learned positions: no longer sequence possible
    fixed_seq_len: bool = False  # the kit's model: the sequence is its caption and image, nothing else
    logits_per_sample: int | None = None  # overrides seq_len * vocab (the kit's two vocabularies)
    cross_attention_layers: int = 0  # decoder layers of an encoder-decoder model attend twice
    activation: str = "gelu"  # a key of FEED_FORWARD_TENSORS
    dropout: bool = True  # dropout masks (1 byte per element) are kept for backward
    reversible: bool = False  # activations are rebuilt in backward whatever `checkpointing` says
    shareable: bool = False  # shared_groups can be applied (a ModelShape)
    shape: ModelShape | None = None

    @property
    def knows_activations(self) -> bool:
        return None not in (self.layers, self.hidden, self.heads, self.ffn, self.seq_len)


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _from_shape(shape: ModelShape, label: str, shared_groups: int | None) -> Architecture:
    return Architecture(
        label=label,
        tensors=shape._tensors(shared_groups),
        layers=shape.layers,
        hidden=shape.hidden,
        heads=shape.heads,
        attention_width=shape.attention_width,
        ffn=shape.ffn,
        vocab=shape.vocab,
        seq_len=shape.seq_len,
        max_seq_len=shape.seq_len if shape.learned_positions else None,
        cross_attention_layers=shape.layers // 2 if shape.kind == "encoder-decoder" else 0,
        activation=shape.activation,
        shareable=True,
        shape=shape,
    )


_BLOCK = re.compile(r"^(.*?\.\d+)\.")  # "transformer.h.3.attn.c_attn.weight" -> "transformer.h.3"


def _from_module(module: torch.nn.Module, label: str) -> Architecture:
    """Every distinct parameter of ``module``; a parameter under a numbered child (``h.3.``) belongs to that block."""
    tensors, frozen = [], 0
    for name, param in module.named_parameters():  # tied or shared tensors are listed once
        if param.requires_grad:
            match = _BLOCK.match(name)
            tensors.append((tuple(param.shape), match.group(1) if match else None))
        else:
            frozen += param.numel()
    arch = Architecture(label=label, tensors=tensors, frozen=frozen)
    config = getattr(module, "config", None)
    if isinstance(module, TextToImageTransformer):
        _describe_kit(arch, module.config)
    elif config is not None and all(
        hasattr(config, k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
    ):
        # a transformers model (GPT-2, BERT, ...): its config names the dimensions
        h = config.hidden_size
        positions = getattr(config, "max_position_embeddings", None)
        arch.layers, arch.hidden, arch.heads = config.num_hidden_layers, h, config.num_attention_heads
        arch.attention_width, arch.vocab = h, config.vocab_size
        arch.ffn = getattr(config, "n_inner", None) or getattr(config, "intermediate_size", None) or 4 * h
        arch.seq_len = arch.max_seq_len = positions
        name = getattr(config, "activation_function", None) or getattr(config, "hidden_act", None)
        arch.activation = name if name in ("gelu_new", "relu") else "gelu"
        arch.dropout = any(
            (getattr(config, k, 0) or 0) > 0 for k in ("resid_pdrop", "hidden_dropout_prob", "dropout", "dropout_rate")
        )
    return arch


def _describe_kit(arch: Architecture, config) -> None:
    """The dimensions of the kit's TextToImageTransformer (collab_kit.model.transformer) for ``config`` (a
    ModelConfig)."""
    arch.layers, arch.hidden, arch.heads = config.num_layers, config.hidden_size, config.num_heads
    arch.attention_width, arch.ffn = config.hidden_size, config.ffn_multiplier * config.hidden_size
    arch.seq_len, arch.fixed_seq_len = config.sequence_length, True
    arch.vocab = config.text_vocab_size + config.codebook_size
    # caption positions predict caption tokens, image positions predict codes
    # (collab_kit.model.transformer.TextToImageTransformer.forward)
    arch.logits_per_sample = (
        config.text_length - 1
    ) * config.text_vocab_size + config.image_length * config.codebook_size
    arch.activation, arch.dropout, arch.reversible = "geglu", False, config.reversible


_KIT_CACHE: dict[str, Architecture] = {}


def _from_kit_config(config, label: str) -> Architecture:
    """Build the kit's model on the meta device (no memory, even for the paper preset) and count its tensors."""
    key = repr(config)
    if key not in _KIT_CACHE:
        with torch.device("meta"):
            model = TextToImageTransformer(config)
        _KIT_CACHE[key] = _from_module(model, label)
    return dataclasses.replace(_KIT_CACHE[key], label=label)


def resolve_model(model, shared_groups: int | None) -> tuple[Architecture, dict]:
    """``model`` as an Architecture, plus defaults it implies (a RunConfig's offload and min_8bit_size)."""
    defaults: dict = {}
    label = None
    if isinstance(model, RunConfig):
        defaults = dict(
            offload=model.optimizer.offload_optimizer,
            min_8bit_size=model.optimizer.min_8bit_size,
            local_updates=model.optimizer.local_updates,
            overlap_rounds=model.optimizer.overlap_rounds,
            error_feedback=model.optimizer.pseudo_gradient_bits == 4,
        )
        label, model = f"{model.preset} preset", model.model
    if isinstance(model, str):
        if model in CATALOGUE:
            arch = _from_shape(CATALOGUE[model], model, shared_groups)
        elif model in PRESETS:
            arch = _from_kit_config(get_preset(model).model, f"{model} preset")
        else:
            raise ValueError(
                f"unknown model {model!r}: choose one of {', '.join(known_models())}, "
                f"or pass a ModelShape, a RunConfig or a torch module"
            )
    elif isinstance(model, ModelShape):
        arch = _from_shape(model, "custom shape", shared_groups)
    elif isinstance(model, ModelConfig):
        arch = _from_kit_config(model, label or "custom ModelConfig")
    elif isinstance(model, torch.nn.Module):
        arch = _from_module(model, type(model).__name__)
    else:
        raise TypeError(
            f"model={model!r}: expected a name ({', '.join(known_models())}), a ModelShape, "
            f"a ModelConfig, a RunConfig or a torch.nn.Module"
        )
    if shared_groups is not None and not arch.shareable:
        raise ValueError(
            f"shared_groups applies to catalogue names and ModelShapes; {arch.label} already has "
            f"the parameters it has (the kit's model shares layers when its ModelConfig sets "
            f"share_layer_groups=True)"
        )
    return arch, defaults
