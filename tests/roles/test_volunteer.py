"""The volunteer's step loop, its recovery from non-finite steps and its metrics, in this process: a real DHT on
127.0.0.1 and a real collaborative optimizer, a lone peer, the parts given to ``Volunteer`` (its seams) instead of
built from the configuration. Each test takes seconds; what needs other peers is tests/roles/test_faults.py."""

import math
import time

import pytest
import torch

from collab_kit.config import get_preset
from collab_kit.data.stream import peer_stream
from collab_kit.model.device import DeviceFacts, GpuFacts
from collab_kit.model.transformer import TextToImageTransformer, initial_model
from collab_kit.roles.volunteer import NonFiniteTrainingError, Volunteer
from collab_kit.swarm.local_updates import AppliedRound
from collab_kit.swarm.membership import SwarmMembership
from collab_kit.swarm.metrics import read_metrics
from collab_kit.swarm.optimizer import make_optimizer

RUN_ID = "unit_volunteer"
TARGET_BATCH = 64  # 8 local steps of 8 samples per global epoch


class FaultyTransformer(TextToImageTransformer):
    """The run's model, whose training steps listed in ``nan_loss_at`` give a nan loss, and whose step
    ``nan_parameters_at`` fills an embedding with nan first."""

    nan_loss_at: tuple = ()
    nan_parameters_at = None

    def forward(self, *args, **kwargs):
        if not self.training:
            return super().forward(*args, **kwargs)
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == self.nan_parameters_at:
            with torch.no_grad():
                self.text_embedding.weight.fill_(float("nan"))
        output = super().forward(*args, **kwargs)
        if self.steps in self.nan_loss_at:
            output.loss = output.loss * float("nan")
        return output


@pytest.fixture
def volunteer_with(tiny_shards):
    """Build a lone volunteer from parts: ``volunteer_with(model_class=..., **class_attributes)``; closed at
    teardown."""
    built = []

    def build(model_class=TextToImageTransformer, optimizer_settings=(), **attributes) -> Volunteer:
        config = get_preset(
            "tiny",
            swarm=dict(host="127.0.0.1", run_id=RUN_ID),
            optimizer=dict(target_batch_size=TARGET_BATCH, **dict(optimizer_settings)),
        )
        membership = SwarmMembership(config)
        config = membership.config
        model = initial_model(config.model, RUN_ID, model_class=model_class)
        for name, value in attributes.items():
            setattr(model, name, value)
        optimizer = make_optimizer(model, membership.dht, RUN_ID, config.optimizer, client_mode=False)
        volunteer = Volunteer(config, membership, model, peer_stream(config, tiny_shards, data_seed=0), optimizer)
        built.append(volunteer)
        return volunteer

    yield build
    for volunteer in built:
        volunteer.close()


def test_the_step_loop_trains_alone_and_records_each_epoch(volunteer_with):
    volunteer = volunteer_with()
    before = {name: param.detach().clone() for name, param in volunteer.model.named_parameters()}
    history = volunteer.train(max_epochs=2, progress=False)
    assert (history.start_epoch, history.final_epoch, volunteer.local_epoch) == (0, 2, 2)
    steps_per_epoch = TARGET_BATCH // volunteer.config.optimizer.batch_size_per_step
    assert history.local_steps == 2 * steps_per_epoch
    assert [record.epoch for record in history.epochs] == [0, 1]
    for record in history.epochs:
        assert record.local_steps == steps_per_epoch and record.samples == TARGET_BATCH
        assert not record.averaged and record.group_size == 1 and math.isfinite(record.loss)
    assert history.skipped_steps == 0 and history.restores == [] and history.averaged_rounds == 0
    after = volunteer.parameters_snapshot()
    assert any(not torch.equal(before[name], after[name]) for name in before), "two global steps changed nothing"


def test_a_background_rounds_epoch_is_reported_with_its_own_outcome(volunteer_with):
    volunteer = volunteer_with(optimizer_settings=dict(local_steps=4, overlap_rounds=True))
    optimizer = volunteer.optimizer
    # round 2 applied in a group of two with an anchor, then round 3 ended at once, alone: the optimizer's last
    # figures are round 3's when epoch 2 is reported
    optimizer.applied_in_background[2] = AppliedRound(group_size=2, anchors=1, problem=None, averaged=True)
    optimizer.last_round_epoch, optimizer.last_group_size, optimizer.last_round_problem = 3, 1, "no group"
    record = volunteer._background_epoch_record(2, [3.0, 2.0], 1.5)
    assert (record.epoch, record.group_size, record.anchors, record.averaged, record.problem) == (2, 2, 1, True, None)
    assert record.loss == 2.5 and record.local_steps == 2 and 2 not in optimizer.applied_in_background
    # a round left for a download of the swarm's state was never applied: its epoch is its own, not averaged
    dropped = volunteer._background_epoch_record(4, [2.0], 1.0)
    assert (dropped.epoch, dropped.averaged, dropped.group_size) == (4, False, 1)
    assert "left for the swarm's state" in dropped.problem


def test_a_volunteer_at_a_quarter_load_pauses_three_times_as_long_as_it_computes(volunteer_with):
    volunteer = volunteer_with()
    started = time.perf_counter()
    history = volunteer.train(max_epochs=1, progress=False, max_load=0.25)
    elapsed = time.perf_counter() - started
    assert history.final_epoch == 1 and history.compute_seconds > 0
    assert history.paused_seconds == pytest.approx(3 * history.compute_seconds, rel=1e-6)
    assert elapsed >= history.compute_seconds + history.paused_seconds  # the pauses were waited, not only counted
    with pytest.raises(ValueError, match="max_load=0 is not allowed"):
        volunteer.train(max_steps=1, progress=False, max_load=0)
    at_full_load = volunteer.train(max_steps=2, progress=False)
    assert at_full_load.compute_seconds > 0 and at_full_load.paused_seconds == 0


def test_a_step_with_a_nan_loss_is_dropped_and_training_goes_on(volunteer_with):
    volunteer = volunteer_with(FaultyTransformer, nan_loss_at=(3,))
    restores = []
    history = volunteer.train(max_epochs=1, progress=False, on_restore=restores.append)
    assert history.skipped_steps == 1 and history.final_epoch == 1
    # the bad step is not counted as a step taken: its gradients never reached the optimizer
    assert history.local_steps >= TARGET_BATCH // volunteer.config.optimizer.batch_size_per_step
    assert [(r.reason, r.loaded, r.local_step) for r in restores] == [("non_finite", False, 2)]
    assert "the loss is nan" in restores[0].problem
    assert math.isfinite(history.epochs[0].loss)
    assert all(torch.isfinite(param).all() for param in volunteer.model.parameters())


def test_nan_parameters_that_no_peer_can_replace_stop_training_and_say_what_to_do(volunteer_with):
    volunteer = volunteer_with(FaultyTransformer, nan_parameters_at=2)
    with pytest.raises(NonFiniteTrainingError) as error:
        volunteer.train(max_epochs=3, progress=False)
    message = str(error.value)
    assert "text_embedding.weight" in message and "restart from a checkpoint" in message
    assert "optimizer.learning_rate" in message


def test_a_loss_that_stays_nan_stops_after_the_allowed_streak(volunteer_with):
    volunteer = volunteer_with(FaultyTransformer, nan_loss_at=tuple(range(1, 100)))
    restores = []
    with pytest.raises(NonFiniteTrainingError, match="for 6 local steps in a row"):
        volunteer.train(max_epochs=1, progress=False, on_restore=restores.append)
    assert len(restores) == volunteer.max_non_finite_steps
    assert volunteer.optimizer.local_epoch == 0  # no nan gradient was ever applied


def test_each_epoch_publishes_this_peers_metrics(volunteer_with):
    volunteer = volunteer_with()
    history = volunteer.train(max_epochs=2, progress=False)
    deadline, records = time.monotonic() + 20, []
    while time.monotonic() < deadline:  # the last epoch's record is stored in the background
        records = [record for _, record in read_metrics(volunteer.dht, RUN_ID)]
        if records and records[0].epoch == 2:
            break
        time.sleep(0.2)
    assert len(records) == 1, records
    (record,) = records
    assert record.epoch == 2 and record.mini_steps == history.epochs[-1].local_steps
    assert record.loss == pytest.approx(history.epochs[-1].loss)
    assert record.samples_per_second > 0 and record.averaged_with == 0


def test_a_volunteer_trains_where_its_device_plan_says(tiny_shards):
    """Built with an explicit device (the CPU here; cuda in benchmarks/gpu_check.py) and bf16: the model's
    parameters, the batch and the gradients are there at the step, the matrix products in bf16, the gradients fp32."""
    config = get_preset(
        "tiny", swarm=dict(host="127.0.0.1", run_id="unit_device"), optimizer=dict(target_batch_size=TARGET_BATCH)
    )
    with Volunteer.from_config(
        config, data_shards=tiny_shards, device="cpu", precision="bf16", num_threads=1
    ) as volunteer:
        seen = dict(batch=set(), products=set(), grads=set())
        model = volunteer.model
        model.register_forward_pre_hook(
            lambda module, args, kwargs: seen["batch"].update(
                (str(value.device), value.dtype) for value in kwargs.values()
            ),
            with_kwargs=True,
        )
        linear = next(module for module in model.modules() if isinstance(module, torch.nn.Linear))
        linear.register_forward_hook(lambda module, inputs, output: seen["products"].add(output.dtype))
        for param in model.parameters():
            param.register_hook(lambda grad: seen["grads"].add((str(grad.device), grad.dtype)))
        history = volunteer.train(max_steps=3, progress=False)
        assert {str(param.device) for param in model.parameters()} == {"cpu"}
    assert seen["batch"] == {("cpu", torch.long)} and seen["products"] == {torch.bfloat16}
    assert seen["grads"] == {("cpu", torch.float32)}
    assert (history.device, history.precision, history.local_steps) == ("cpu", "bf16", 3)


def test_a_gpu_too_small_for_the_model_is_given_up_for_the_cpu_in_one_sentence(tiny_shards, caplog):
    """``--device auto`` on a card that cannot hold one sample (a 64 KiB GPU, given as the machine's facts): the
    volunteer trains on the CPU with the preset's micro-batch, and says why."""
    config = get_preset(
        "tiny", swarm=dict(host="127.0.0.1", run_id="unit_small_gpu"), optimizer=dict(target_batch_size=TARGET_BATCH)
    )
    small_gpu = DeviceFacts(cuda_build="12.4", gpus=(GpuFacts("Tiny GPU", 2**16, (7, 5)),))
    with caplog.at_level("WARNING", logger="collab_kit.roles.volunteer"):
        with Volunteer.from_config(config, data_shards=tiny_shards, device_facts=small_gpu, num_threads=1) as volunteer:
            history = volunteer.train(max_steps=1, progress=False)
    assert (volunteer.plan.device.type, volunteer.plan.precision) == ("cpu", "fp32")
    assert volunteer.device_note.startswith(
        "the Tiny GPU's 64.00 KiB cannot hold this model"
    ) and volunteer.device_note.endswith("training on the CPU"), volunteer.device_note
    assert volunteer.device_note in caplog.text and "\n" not in volunteer.device_note
    assert volunteer.config.optimizer.batch_size_per_step == config.optimizer.batch_size_per_step
    assert config.model.reversible and not volunteer.config.model.reversible  # the RAM holds the tiny activations
    assert (history.device, history.local_steps) == ("cpu", 1)
