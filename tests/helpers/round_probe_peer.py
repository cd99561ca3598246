"""A volunteer that reports what each of its local-update rounds did, for tests/swarm/test_local_updates.py.

Run as ``python tests/helpers/round_probe_peer.py --out FOLDER [--step-period S] [--nan-at-epoch E] join OPTIONS...``:
the same
peer as ``collab-kit join OPTIONS...`` (in local-update mode: ``--set optimizer.local_steps=H``), which also

- after each round prints ``@event {"type": "round", "epoch": E, "weight": ..., "group_size": ..., "global": DIGESTS,
  "momentum": DIGESTS, "model": DIGESTS, "resync": ...}`` (DIGESTS: one per tensor), E being the epoch the round ended
  (the global parameters, the outer momentum
  and the model's parameters after the round, ``"file"``: NAME-R.pt or null, ``"resync"``: whether the peer loads
  the swarm's state next instead of going on from its own), and saves its own pseudo-gradient, its
  weight (samples), the average the round gave back and the global parameters after it in ``FOLDER/NAME-R.pt``, R
  being the peer's epoch when the round began: E - 1, or less for a late joiner that was behind (its update goes to
  the swarm's epoch);
- after each download of the swarm's state prints ``@event {"type": "loaded", "epoch": ..., "downloaded": ...,
  "global": DIGESTS, "momentum": DIGESTS}`` ("downloaded": the epoch of the state a peer gave,
  which hivemind moves a peer
  one epoch behind past);
- with ``--step-period S``, takes one local step every S seconds at most (a slower machine, of a known speed);
  with ``--slowness K``, each step lasts at least K times its own work (K times slower than a peer without it, however
  busy the machine);
- with ``--join-when PATH``, joins only once PATH exists: a late joiner whose process has started (and imported
  torch and hivemind) before, so that it joins at the moment the test chooses, however busy the machine;
- with ``--hold-at-epoch E --hold-until PATH``, takes no local step from epoch E on until PATH exists: the rounds
  after E wait for what the test awaits (a late joiner's download), however long a busy machine makes it; with
  overlapped rounds, the held peer takes the outer step of its round in flight once its average is in, as its next
  step would, so that the state it shares is of epoch E, not of the epoch before; a held peer reports its progress
  (no new samples) as it waits, so that the swarm's epoch does not end on the pace it had before the hold;
- in local-update mode with overlapped rounds, after each round's outer step taken once its average arrived prints
  ``@event {"type": "applied", "epoch": E, "file": NAME-applied-E.pt, ...}`` and saves there the progress the inner
  steps made while the round averaged, the model's and the global parameters after the step, the average, and this
  peer's weight and pseudo-gradient in the round (the event also carries the weight and the digests of the global
  parameters and the outer momentum after the step);
- with ``--nan-at-epoch E``, fills its model's token embedding with nan at the end of round E, after its last inner
  step (an inner step that blew up): its pseudo-gradient of that round is not finite.

Nothing of this is in collab_kit: the probes wrap the optimizer's methods in this process only.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import sys
import time

SCRIPT = os.path.abspath(__file__)


def digest(tensors) -> list[str]:
    """A short digest of each tensor's exact values (a state downloaded in parts takes each tensor from one sharer)."""
    return [
        hashlib.sha256(tensor.detach().cpu().contiguous().float().numpy().tobytes()).hexdigest()[:12]
        for tensor in tensors
    ]


def main(argv: list[str]) -> int:
    import torch

    from collab_kit.cli import join
    from collab_kit.cli import main as collab_kit_main
    from collab_kit.model.transformer import TextToImageTransformer, initial_model
    from collab_kit.roles.processes import emit_event
    from collab_kit.roles.volunteer import Volunteer
    from collab_kit.swarm.optimizer import make_optimizer

    parser = argparse.ArgumentParser(prog="round_probe_peer.py")
    parser.add_argument("--out", required=True, help="folder for each round's pseudo-gradients")
    parser.add_argument("--name", default=str(os.getpid()), help="this peer's name in the files")
    parser.add_argument("--step-period", type=float, default=0.0, help="seconds per local step, at least")
    parser.add_argument("--slowness", type=float, default=1.0, help="each local step lasts this many times its work")
    parser.add_argument("--nan-at-epoch", type=int, default=None)
    parser.add_argument("--join-when", metavar="PATH", help="join only once PATH exists (its imports done by then)")
    parser.add_argument("--hold-at-epoch", type=int, default=None, help="from this epoch on, wait for --hold-until")
    parser.add_argument("--hold-until", metavar="PATH", help="the file that ends the hold")
    options, rest = parser.parse_known_args(argv)
    if not rest or rest[0] != "join":
        parser.error("expected: --out FOLDER [--name N] [--step-period S] [--nan-at-epoch E] join OPTIONS...")
    if (options.hold_at_epoch is None) != (options.hold_until is None):
        parser.error("--hold-at-epoch and --hold-until go together")
    os.makedirs(options.out, exist_ok=True)

    def global_state(optimizer):
        parameters = [p for group in optimizer.state_averager.optimizer.param_groups for p in group["params"]]
        momentum = [
            optimizer.state_averager.optimizer.state[p].get("momentum_buffer", torch.zeros(0)) for p in parameters
        ]
        return digest(parameters), digest(momentum)

    waiting = [0.0]  # seconds spent in rounds and state downloads so far: the network's, not a step's work
    epoch_now = [0]  # the peer's epoch after its last round or download
    made = []  # the optimizer, once made

    def hold_if_asked():
        """Wait here, before a local step, while the epoch is at least --hold-at-epoch and --hold-until is missing."""
        if options.hold_at_epoch is None or epoch_now[0] < options.hold_at_epoch:
            return
        began, deadline = time.monotonic(), time.monotonic() + 600
        next_report = began
        while not os.path.exists(options.hold_until):
            if time.monotonic() > deadline:
                raise SystemExit(f"{options.hold_until} did not appear in 600 s")
            optimizer = made[0] if made else None
            in_flight = getattr(optimizer, "_round_in_flight", None)
            if in_flight is not None and in_flight[0].done():
                optimizer._apply_round_in_flight()  # a late joiner downloads the held epoch's state, not the one before
            if optimizer is not None and time.monotonic() >= next_report:
                # hivemind's tracker counts a silent peer as still training at its last pace: a hold of seconds would
                # end the epoch at the next step, with the samples of one step. The held peer says it has done none.
                optimizer.tracker.report_local_progress(
                    optimizer.local_epoch, optimizer.grad_averager.local_samples_accumulated
                )
                next_report = time.monotonic() + 0.25
            time.sleep(0.05)
        waiting[0] += time.monotonic() - began  # the hold is no step's work

    def probing_make_optimizer(model, dht, run_id, config, **kwargs):
        optimizer = make_optimizer(model, dht, run_id, config, **kwargs)
        record, poisoned = {}, []
        sent_rounds = {}  # overlap: each round's (weight, pseudo-gradient) by its epoch, until its step is applied
        load_pseudo_gradient = optimizer._load_pseudo_gradient
        average = optimizer._average_gradients_and_load_into_optimizer
        update = optimizer._update_global_epoch
        load_state = optimizer.load_state_from_peers

        def probed_load_pseudo_gradient():
            if options.nan_at_epoch is not None and optimizer.local_epoch >= options.nan_at_epoch and not poisoned:
                poisoned.append(optimizer.local_epoch)
                emit_event("fault", epoch=optimizer.local_epoch)
                with torch.no_grad():
                    model.text_embedding.weight.fill_(float("nan"))
            load_pseudo_gradient()
            averager = optimizer.grad_averager
            record.update(
                epoch=optimizer.local_epoch,
                weight=averager.local_samples_accumulated,
                pseudo=[acc.clone() for acc in averager._grad_accumulators()],
            )
            if getattr(optimizer, "overlap", False):
                sent_rounds[record["epoch"]] = (record["weight"], record["pseudo"])

        def probed_average(control):
            average(control)
            parameters = [p for group in optimizer.state_averager.optimizer.param_groups for p in group["params"]]
            record["averaged"] = [p.grad.clone() for p in parameters]

        def probed_update(grad_scaler):
            record.clear()
            began = time.monotonic()
            update(grad_scaler)
            waiting[0] += time.monotonic() - began
            epoch_now[0] = optimizer.local_epoch
            saved = None
            if "epoch" in record:
                record["global"] = [
                    p.detach().clone()
                    for group in optimizer.state_averager.optimizer.param_groups
                    for p in group["params"]
                ]
                saved = f"{options.name}-{record['epoch']}.pt"
                torch.save(record, os.path.join(options.out, saved))
            global_digest, momentum_digest = global_state(optimizer)
            model_digest = digest(optimizer.state_averager.main_parameters)  # the model's, in the groups' order
            emit_event(
                "round",
                epoch=optimizer.local_epoch,
                weight=record.get("weight"),
                file=saved,
                group_size=optimizer.last_group_size,
                problem=optimizer.last_round_problem,
                resync=optimizer._resync_requested,
                **{"global": global_digest, "momentum": momentum_digest, "model": model_digest},
            )

        def probed_load_state(**kwargs):
            began = time.monotonic()
            loaded = load_state(**kwargs)
            waiting[0] += time.monotonic() - began
            epoch_now[0] = optimizer.local_epoch
            global_digest, momentum_digest = global_state(optimizer)
            emit_event(
                "loaded",
                epoch=optimizer.local_epoch,
                loaded=loaded,
                downloaded=optimizer.state_averager.last_downloaded_epoch,
                **{"global": global_digest, "momentum": momentum_digest},
            )
            return loaded

        def probed_apply_round_in_flight():
            # what an overlapped round's outer step kept of the inner progress made while the round averaged
            epoch = optimizer.epoch_in_flight
            before = [p.detach().clone() for p in optimizer.state_averager.main_parameters]
            progress = [b - sent for b, sent in zip(before, optimizer._sent_parameters)]
            apply_round_in_flight()
            after = [p.detach().clone() for p in optimizer.state_averager.main_parameters]
            global_after = [
                p.detach().clone() for group in optimizer.state_averager.optimizer.param_groups for p in group["params"]
            ]
            weight, pseudo = sent_rounds.pop(epoch, (None, None))
            saved = f"{options.name}-applied-{epoch}.pt"
            torch.save(
                dict(
                    epoch=epoch,
                    progress=progress,
                    model=after,
                    averaged=record.get("averaged"),
                    weight=weight,
                    pseudo=pseudo,
                    **{"global": global_after},
                ),
                os.path.join(options.out, saved),
            )
            global_digest, momentum_digest = global_state(optimizer)
            emit_event(
                "applied",
                epoch=epoch,
                file=saved,
                group_size=optimizer.last_group_size,
                problem=optimizer.last_round_problem,
                overlapped_steps=optimizer.overlapped_steps,
                weight=weight,
                resync=optimizer._resync_requested,
                **{"global": global_digest, "momentum": momentum_digest},
            )

        if hasattr(optimizer, "_apply_round_in_flight"):
            apply_round_in_flight = optimizer._apply_round_in_flight
            optimizer._apply_round_in_flight = probed_apply_round_in_flight
        optimizer._load_pseudo_gradient = probed_load_pseudo_gradient
        optimizer._average_gradients_and_load_into_optimizer = probed_average
        optimizer._update_global_epoch = probed_update
        optimizer.load_state_from_peers = probed_load_state
        made.append(optimizer)
        return optimizer

    class PacedTransformer(TextToImageTransformer):
        """The run's model, whose training steps start at most once every ``--step-period`` seconds, and each step
        lasts at least ``--slowness`` times its own work (a machine that slow, on a busy machine too)."""

        next_start, started, waited = 0.0, None, 0.0

        def forward(self, *args, **kwargs):
            if self.training:
                hold_if_asked()
                now = time.monotonic()
                if self.started is not None:  # the last step's work: from its start to now, less its round's wait
                    work = now - self.started - (waiting[0] - self.waited)
                    self.next_start = max(self.next_start, now + (options.slowness - 1) * work)
                if now < self.next_start:
                    time.sleep(self.next_start - now)
                self.started, self.waited = time.monotonic(), waiting[0]
                self.next_start = self.started + options.step_period
            return super().forward(*args, **kwargs)

    def make_volunteer(config, **kwargs):
        if options.join_when is not None:
            deadline = time.monotonic() + 600
            while not os.path.exists(options.join_when):
                if time.monotonic() > deadline:
                    raise SystemExit(f"{options.join_when} did not appear in 600 s")
                time.sleep(0.05)
        model = initial_model(config.model, config.swarm.run_id, model_class=PacedTransformer)
        return Volunteer.from_config(config, model=model, optimizer_factory=probing_make_optimizer, **kwargs)

    return collab_kit_main(rest, handlers={"join": functools.partial(join.run, make_volunteer=make_volunteer)})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
