"""The run's DHT keys are the ones hivemind writes under, and the averager classes the kit composes keep hivemind's
RPC names, except where a round computes something else (CenteredClip)."""
import pytest
from hivemind.averaging import DecentralizedAverager
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager

from collab_kit.config import SwarmConfig, get_preset
from collab_kit.model.transformer import initial_model
from collab_kit.swarm import keys
from collab_kit.swarm.averagers import (ANCHOR_ROLE, ClientModeMatchmakingMixin, DownloadRecorderMixin,
                                        ForkedTorchThreadsMixin, RoundReportMixin, compose_averager,
                                        recording_state_averager_class, round_report_averager_class)
from collab_kit.swarm.bindings import AuthorizedAveragerMixin, authorized_averager_class
from collab_kit.swarm.dht import start_dht
from collab_kit.swarm.optimizer import make_optimizer
from collab_kit.swarm.robust import CenteredClipAveragerMixin, CenteredClipGradientAverager, with_centered_clip


@pytest.fixture
def optimizer():
    """A lone peer's collaborative optimizer on a real DHT (127.0.0.1), as the volunteer builds it."""
    dht = start_dht(SwarmConfig(host="127.0.0.1"))
    preset = get_preset("tiny")
    built = make_optimizer(initial_model(preset.model, "keys_run"), dht, "keys_run", preset.optimizer)
    yield built
    built.shutdown()
    dht.shutdown()


def test_the_keys_the_monitor_reads_are_those_hivemind_writes(optimizer):
    # the monitor reads the progress and downloads the state with no optimizer of its own: by these names only
    assert optimizer.tracker.training_progress_key == keys.progress_key("keys_run") == "keys_run_progress"
    assert optimizer.state_averager.prefix == keys.state_averager_prefix("keys_run")
    assert optimizer.grad_averager.prefix == keys.grad_averager_prefix("keys_run")
    names = [keys.progress_key("r"), keys.grad_averager_prefix("r"), keys.state_averager_prefix("r"),
             keys.metrics_key("r"), keys.presence_key("r"), keys.peer_tokens_key("r")]
    assert len(set(names)) == len(names) and all(name.startswith("r_") for name in names)


def test_composed_averagers_keep_hivemind_rpc_names_unless_the_round_computes_otherwise():
    state = recording_state_averager_class()
    assert state.__name__ == "TrainingStateAverager" and state.__qualname__ == "RecordingTrainingStateAverager"
    assert state.__mro__[1:5] == (ForkedTorchThreadsMixin, ClientModeMatchmakingMixin, TrainingStateAverager,
                                  DownloadRecorderMixin)
    gradients = round_report_averager_class(GradientAverager, ANCHOR_ROLE)
    assert gradients.__name__ == "GradientAverager" and gradients.round_role == ANCHOR_ROLE
    assert issubclass(gradients, RoundReportMixin)
    # CenteredClip changes what a round computes: a peer that takes the plain mean must not join its rounds
    robust = with_centered_clip(gradients)
    assert robust.__name__ == "CenteredClipGradientAverager" == CenteredClipGradientAverager.__name__
    assert issubclass(robust, CenteredClipAveragerMixin) and issubclass(robust, RoundReportMixin)
    # the authorization gate only guards: its averagers still average with the run's others
    gated = authorized_averager_class(robust, peer_gate=None)
    assert gated.__name__ == "CenteredClipGradientAverager" and issubclass(gated, AuthorizedAveragerMixin)
    assert compose_averager(DecentralizedAverager, AuthorizedAveragerMixin).__name__ == "DecentralizedAverager"


def test_each_composed_class_collects_its_own_rpc_handlers_under_its_rpc_name():
    # hivemind caches a class's handlers in class attributes: a composed class must not take its base's cache
    GradientAverager._collect_rpc_handlers()  # the base's cache filled first, as by an averager built before
    gated = authorized_averager_class(GradientAverager, peer_gate=None)
    assert "_rpc_handlers" in vars(gated) and vars(gated)["_rpc_handlers"] is None
    gated._collect_rpc_handlers()
    assert gated._rpc_handlers is not GradientAverager._rpc_handlers
    assert {handler.method_name for handler in gated._rpc_handlers} >= {"rpc_join_group", "rpc_aggregate_part",
                                                                         "rpc_download_state"}
    # the name other peers call it by is GradientAverager's, and the call reaches the gate first
    assert gated._get_handle_name("run_grad_averager", "rpc_join_group") == \
        GradientAverager._get_handle_name("run_grad_averager", "rpc_join_group")
    assert gated.rpc_join_group is AuthorizedAveragerMixin.rpc_join_group
