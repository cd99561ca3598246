"""Checkpoints: a local round trip, atomic replacement, and clear errors."""

import json

import pytest
import torch

from collab_kit.config import get_preset
from collab_kit.model.checkpoint import CONFIG_NAME, load_checkpoint, save_checkpoint
from collab_kit.model.transformer import TextToImageTransformer


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


def test_a_checkpoint_loads_from_a_hub_repository(tmp_path, hub_server):
    """The real huggingface_hub client, in a fresh process, downloads the checkpoint from the stand-in Hub."""
    config = get_preset("tiny", swarm=dict(run_id="hub-run"))
    torch.manual_seed(3)
    model = TextToImageTransformer(config.model)
    folder = save_checkpoint(model, config, str(tmp_path / "ckpt"), metadata=dict(epoch=11))
    (tmp_path / "ckpt" / "README.md").write_text("not asked for: allow_patterns must leave it on the Hub\n")
    commit = hub_server.add_repo("someone/tiny-run", folder)

    loaded_path = tmp_path / "loaded.pt"
    stdout = hub_server.run_python(f"""
        import json, os, torch
        from collab_kit.model.checkpoint import load_checkpoint, resolve_checkpoint
        model, config, metadata = load_checkpoint("someone/tiny-run")
        torch.save({{name: tensor.clone() for name, tensor in model.state_dict().items()}}, {str(loaded_path)!r})
        files = sorted(os.listdir(resolve_checkpoint("someone/tiny-run")))
        print(json.dumps(dict(run_id=config.swarm.run_id, metadata=metadata, files=files)))
    """)
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report == dict(run_id="hub-run", metadata=dict(epoch=11), files=["config.json", "model.safetensors"])
    loaded = torch.load(loaded_path, weights_only=True)
    expected = model.state_dict()
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name

    # it went through the Hub API: the commit, the file list, each file's metadata, then the bytes
    seen = hub_server.requests
    assert "GET /api/models/someone/tiny-run/revision/main" in seen
    assert any(r.startswith(f"GET /api/models/someone/tiny-run/tree/{commit}") for r in seen)
    for name in ("config.json", "model.safetensors"):
        assert f"HEAD /someone/tiny-run/resolve/{commit}/{name}" in seen
    assert f"GET /someone/tiny-run/resolve/{commit}/config.json" in seen
    assert any(r.startswith("GET cdn:/lfs/") for r in seen)  # the weights came as LFS, from the "CDN"
    assert not any("README.md" in r for r in seen)


def test_a_missing_hub_repository_says_so(tmp_path, hub_server):
    (tmp_path / "not_a_checkpoint").mkdir()
    (tmp_path / "not_a_checkpoint" / "README.md").write_text("no weights here\n")
    hub_server.add_repo("someone/readme-only", str(tmp_path / "not_a_checkpoint"))
    stdout = hub_server.run_python("""
        import json
        from collab_kit.model.checkpoint import load_checkpoint
        for location in ("someone/no-such-run", "someone/readme-only"):
            try:
                load_checkpoint(location)
                print(json.dumps(dict(type=None, message="")))
            except Exception as e:
                print(json.dumps(dict(type=type(e).__name__, message=str(e))))
    """)
    missing, readme_only = (json.loads(line) for line in stdout.strip().splitlines()[-2:])
    # the error names the repository and says neither a folder nor a Hub repository has that name
    assert missing["type"] == "FileNotFoundError" and "someone/no-such-run" in missing["message"]
    assert "no local folder of that name, and the Hub has no model repository" in missing["message"]
    assert "GET /api/models/someone/no-such-run/revision/main" in hub_server.requests
    # a repository that exists but holds no checkpoint is named as such
    assert readme_only["type"] == "FileNotFoundError"
    assert "is not a collab_kit checkpoint: model.safetensors, config.json missing" in readme_only["message"]


def test_an_uncached_hub_repository_offline_says_so():
    # the tests run with HF_HUB_OFFLINE=1 (conftest.py): nothing is cached, so nothing can be loaded
    with pytest.raises(Exception, match="HF_HUB_OFFLINE"):
        load_checkpoint("someone/never-downloaded")
