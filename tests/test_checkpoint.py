"""Checkpoints: a local round trip, atomic replacement, and clear errors."""
import json

import pytest
import torch

from collab_kit.checkpoint import CONFIG_NAME, load_checkpoint, save_checkpoint
from collab_kit.config import get_preset
from collab_kit.model import TextToImageTransformer


def test_a_checkpoint_round_trips_through_a_local_folder(tmp_path):
    config = get_preset("tiny", swarm=dict(run_id="ckpt"))
    torch.manual_seed(1)
    model = TextToImageTransformer(config.model)
    folder = save_checkpoint(model, config, str(tmp_path / "ckpt"), metadata=dict(epoch=7, loss=3.5))
    loaded, loaded_config, metadata = load_checkpoint(folder)
    assert loaded_config == config and metadata == dict(epoch=7, loss=3.5)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    text = torch.randint(3, 259, (1, config.model.text_length))
    codes = torch.randint(0, config.model.codebook_size, (1, config.model.image_length))
    assert torch.allclose(model.eval()(text, codes).loss, loaded(text, codes).loss)

    # saving again replaces the folder as a whole
    torch.manual_seed(2)
    save_checkpoint(TextToImageTransformer(config.model), config, folder, metadata=dict(epoch=8))
    assert load_checkpoint(folder)[2] == dict(epoch=8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging folder left behind


def test_bad_locations_say_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(str(tmp_path / "nowhere" / "deeper"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="model.safetensors, config.json missing"):
        load_checkpoint(str(tmp_path / "empty"))
    config = get_preset("tiny")
    folder = save_checkpoint(TextToImageTransformer(config.model), config, str(tmp_path / "ckpt"))
    saved = json.loads((tmp_path / "ckpt" / CONFIG_NAME).read_text())
    saved["run"]["model"]["hidden_size"] = 64  # weights of width 32, a config of width 64
    (tmp_path / "ckpt" / CONFIG_NAME).write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="does not fit its own configuration"):
        load_checkpoint(folder)
