"""Presets carry the paper's numbers; a wrong value fails at once, naming the field."""

import pytest

from collab_kit.config import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    RunConfig,
    SettingProblem,
    SwarmConfig,
    get_preset,
)


def test_paper_preset_has_the_papers_values():
    config = get_preset("paper")
    model, opt = config.model, config.optimizer
    assert (model.hidden_size, model.num_layers, model.num_heads, model.head_size) == (1024, 64, 16, 64)
    assert (model.text_length, model.image_side, model.image_length, model.codebook_size) == (256, 32, 1024, 8192)
    assert model.text_vocab_size == 32100
    assert opt.learning_rate == 2.5e-3 and opt.betas == (0.9, 0.96) and opt.eps == 1e-6
    assert opt.weight_decay == 0.045 and opt.max_grad_norm == 4.0
    assert opt.total_steps == 31250 and opt.warmup_steps == 3125
    assert opt.target_batch_size == 4096 and opt.compression_threshold == 2**16
    assert opt.offload_optimizer and opt.delay_optimizer_step
    assert opt.averaging_timeout == 180.0 and 15.0 <= opt.matchmaking_time <= 20.0


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_cpu_presets_are_small(name):
    config = get_preset(name)
    assert config.model.hidden_size <= 256 and config.model.sequence_length <= 128
    assert config.optimizer.target_batch_size % config.optimizer.batch_size_per_step == 0


ELSEWHERE = "/ip4/10.77.0.10/tcp/31337/p2p/12D3KooWBmwXN3rsVfnLsZKbXeBrSLfczHxZHwVjPrbKwpLfYm3t"
HERE = ELSEWHERE.replace("10.77.0.10", "127.0.0.1")


@pytest.mark.parametrize("name", ["tiny", "small", "toy", "paper"])
def test_a_peer_listens_where_its_swarm_can_reach_it(name):
    """Whatever the preset: every interface for a first peer or a swarm elsewhere, loopback for a swarm on this
    machine, and what the user says when they say it."""
    assert get_preset(name).swarm.host is None
    listen = lambda **swarm: get_preset(name, swarm=swarm).swarm.listen_host  # noqa: E731
    assert listen() == "0.0.0.0"
    assert listen(initial_peers=[ELSEWHERE]) == "0.0.0.0"
    assert listen(initial_peers=[HERE]) == "127.0.0.1"
    assert listen(initial_peers=[HERE, ELSEWHERE]) == "0.0.0.0"
    assert listen(initial_peers=[ELSEWHERE], host="127.0.0.1") == "127.0.0.1"
    assert listen(host="192.168.1.2") == "192.168.1.2"


def test_overrides_change_one_field_and_are_validated():
    config = get_preset("tiny", optimizer=dict(target_batch_size=128), swarm=dict(run_id="other"))
    assert config.optimizer.target_batch_size == 128 and config.swarm.run_id == "other"
    assert config.optimizer.learning_rate == get_preset("tiny").optimizer.learning_rate
    with pytest.raises(ValueError, match="optimizer.target_batch_size"):
        get_preset("tiny", optimizer=dict(target_batch_size=0))
    with pytest.raises(ValueError, match="no field"):
        get_preset("tiny", optimizer=dict(target_batch=128))
    with pytest.raises(ValueError, match="choose one of"):
        get_preset("huge")


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: ModelConfig(hidden_size=100, num_heads=16), "model.hidden_size"),
        (lambda: ModelConfig(num_layers=-1), "model.num_layers"),
        (lambda: ModelConfig(pad_token_id=40000), "model.pad_token_id"),
        (lambda: ModelConfig(attention_pattern=("row", "diagonal")), "model.attention_pattern"),
        (lambda: ModelConfig(conv_kernel_size=4), "model.conv_kernel_size"),
        (lambda: ModelConfig(hidden_size=24, num_heads=4), "model.hidden_size"),  # head size 6: no 2D rotary
        (lambda: OptimizerConfig(learning_rate=0), "optimizer.learning_rate"),
        (lambda: OptimizerConfig(betas=(0.9, 1.2)), "optimizer.betas"),
        (lambda: OptimizerConfig(warmup_fraction=1.0), "optimizer.warmup_fraction"),
        (lambda: OptimizerConfig(offload_optimizer=False, delay_optimizer_step=True), "optimizer.delay_optimizer_step"),
        (lambda: OptimizerConfig(state_compression="zip"), "optimizer.state_compression"),
        (lambda: SwarmConfig(port=70000), "swarm.port"),
        (lambda: SwarmConfig(run_id="my run!"), "swarm.run_id"),
        (lambda: DataConfig(shuffle_buffer=0), "data.shuffle_buffer"),
    ],
)
def test_a_wrong_value_names_its_field(build, field):
    with pytest.raises(ValueError) as error:
        build()
    assert str(error.value).startswith(field + "=")
    assert "allowed" in str(error.value)


def test_a_round_must_fit_within_its_timeout():
    # the tiny preset's 20 s rounds with a 3 s progress period: the anchor would wait 30 s for late peers
    with pytest.raises(ValueError, match=r"optimizer.averaging_timeout=20.0 is not allowed: .* above 32 s"):
        get_preset("tiny", optimizer=dict(progress_refresh_period=3.0))
    longer = get_preset("tiny", optimizer=dict(progress_refresh_period=3.0, averaging_timeout=40.0))
    assert longer.optimizer.chunk_timeout == 30
    for name in ("tiny", "small", "toy", "paper"):
        get_preset(name)


def test_a_malformed_initial_peer_is_refused_by_the_swarm_config():
    with pytest.raises(ValueError, match="not a valid multiaddr"):
        SwarmConfig(initial_peers=["127.0.0.1:31337"])


def test_config_round_trips_through_a_dict():
    config = get_preset("small")
    again = RunConfig.from_dict(config.to_dict())
    assert again == config
    with pytest.raises(ValueError, match="unknown keys"):
        RunConfig.from_dict(dict(config.to_dict(), extra=1))


def test_overlapped_rounds_are_a_setting_of_the_local_update_mode_and_read_true_as_a_shell_user_writes_it():
    from collab_kit.config import parse_overrides

    assert parse_overrides(["optimizer.overlap_rounds=true"]) == {"optimizer": {"overlap_rounds": True}}
    assert parse_overrides(["optimizer.overlap_rounds=False"]) == {"optimizer": {"overlap_rounds": False}}
    assert get_preset("tiny", optimizer=dict(local_steps=4, overlap_rounds=True)).optimizer.overlap_rounds
    with pytest.raises(SettingProblem, match="local_steps set to H > 0 too"):
        get_preset("tiny", optimizer=dict(overlap_rounds=True))


def test_4_bit_pseudo_gradients_are_a_setting_of_the_local_update_mode_that_the_whole_run_shares():
    from collab_kit.config import PER_PEER_SETTINGS, parse_overrides

    assert parse_overrides(["optimizer.pseudo_gradient_bits=4"]) == {"optimizer": {"pseudo_gradient_bits": 4}}
    assert get_preset("tiny", optimizer=dict(local_steps=4, pseudo_gradient_bits=4)).optimizer.pseudo_gradient_bits == 4
    with pytest.raises(SettingProblem, match="local_steps set to H > 0 too"):
        get_preset("tiny", optimizer=dict(pseudo_gradient_bits=4))
    with pytest.raises(SettingProblem, match="choose 8 or 4"):
        get_preset("tiny", optimizer=dict(local_steps=4, pseudo_gradient_bits=2))
    # a reducer rounds the average of the parts it would send in 4 bits itself (collab_kit.swarm.runners): every
    # peer of the run must send the same way
    assert ("optimizer", "pseudo_gradient_bits") not in PER_PEER_SETTINGS
