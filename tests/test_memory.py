"""collab_kit.memory: parameter counts of the named shapes, against real models and published sizes."""
import pytest
import torch

from collab_kit.memory import CATALOGUE, ModelShape


def test_gpt2_shapes_count_what_transformers_builds():
    from transformers import GPT2Config, GPT2LMHeadModel

    for shape in (ModelShape(2, 64, 4, 256, 1000, 128), ModelShape(3, 96, 3, 384, 777, 32)):
        config = GPT2Config(n_layer=shape.layers, n_embd=shape.hidden, n_head=shape.heads, n_inner=shape.ffn,
                            vocab_size=shape.vocab, n_positions=shape.seq_len)
        with torch.device("meta"):
            model = GPT2LMHeadModel(config)
        assert shape.parameters() == sum(p.numel() for p in model.parameters())  # tied output counted once


@pytest.mark.parametrize("name, published", [
    ("gpt2-small", 124_439_808), ("gpt2-medium", 354_823_168), ("gpt2-large", 774_030_080),
    ("gpt2-xl", 1_557_611_200),  # the Hub checkpoints' exact counts
    ("gpt3-175b", 175.0e9), ("gpt3-13b", 13.0e9), ("gpt3-xl", 1.3e9), ("gpt-j-6b", 6.05e9),
    ("t5-3b", 2.85e9), ("t5-11b", 11.3e9), ("dalle-12b", 12.0e9), ("bert-large", 335e6),
])
def test_catalogue_sizes_match_the_published_ones(name, published):
    counted = CATALOGUE[name].parameters()
    if isinstance(published, int):
        assert counted == published
    else:  # papers round their sizes
        assert abs(counted - published) / published < 0.02, counted
