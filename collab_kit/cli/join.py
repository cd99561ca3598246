"""``collab-kit join``: train with a swarm as a volunteer."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from collab_kit.cli.common import CommandError, add_swarm_options, build_config, handle_stop_signals
from collab_kit.roles.processes import emit_event

if TYPE_CHECKING:  # for the annotation only: the command loads the volunteer when it runs
    from collab_kit.roles.volunteer import Volunteer


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``collab-kit join`` to the command line."""
    join = commands.add_parser("join", help="train with a swarm as a volunteer")
    add_swarm_options(join)
    join.add_argument(
        "--client-mode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="connect out only, accept no incoming connections (default: asked of the swarm's peers, "
        "which try to dial this one back)",
    )
    join.add_argument(
        "--data",
        help="parquet shards: a folder, a glob, a Hub dataset id (user/name), or 'synthetic' "
        "(default: the run's data, as its organizer named it)",
    )
    join.add_argument(
        "--device", default="auto", help="where the model trains: auto (the GPU when there is one), cpu, cuda or cuda:N"
    )
    join.add_argument(
        "--precision",
        default="auto",
        choices=("auto", "fp32", "bf16", "fp16"),
        help="auto: bf16 on Ampere and newer GPUs, fp16 with loss scaling on older ones (T4, P100, "
        "V100), fp32 on the CPU",
    )
    join.add_argument("--epochs", type=int, help="train this many global epochs from the swarm's current one")
    join.add_argument("--max-epochs", type=int, help="stop when the swarm reaches this global epoch")
    join.add_argument("--max-steps", type=int, help="stop after this many local steps")
    join.add_argument("--threads", type=int, help="CPU threads for torch")
    join.add_argument(
        "--max-load",
        type=float,
        default=1.0,
        metavar="SHARE",
        help="the share of its time this peer computes, more than 0 and at most 1 (default: 1): 0.5 "
        "pauses after each step as long as the step took, leaving the machine half free",
    )
    join.add_argument(
        "--wait-for-peers",
        type=int,
        default=1,
        metavar="N",
        help="start training once N peers (this one included) are ready (default: 1)",
    )
    join.add_argument("--no-progress", action="store_true", help="no progress bar")
    join.add_argument("--verbose", action="store_true", help="log every stage of the global steps")
    join.add_argument("--save-params", metavar="PATH", help="save the final parameters here (torch.save)")
    join.add_argument(
        "--save-checkpoint",
        metavar="FOLDER",
        help="save the final model and its configuration here (a checkpoint generate_images reads)",
    )
    join.set_defaults(handler=run)


def run(args: argparse.Namespace, make_volunteer: Callable[..., Volunteer] | None = None) -> int:
    """Join, train until a limit, report.

    :param make_volunteer: builds the volunteer from the configuration, as ``Volunteer.from_config`` (the default)
      does; a script that trains with parts of its own (a test peer) passes its own
    """
    # lazy: the libraries the command needs (torch, hivemind) load when it runs: `collab-kit --help` answers at once
    import torch

    from collab_kit.roles.volunteer import Volunteer
    from collab_kit.swarm.dht import join_addresses

    if not 0.0 < args.max_load <= 1.0:  # before the swarm is joined
        raise CommandError(
            f"--max-load {args.max_load:g}: give the share of its time this peer computes, more than 0 "
            f"and at most 1 (1: all of it)"
        )
    config = build_config(args)
    if args.epochs is None and args.max_epochs is None and args.max_steps is None:
        # the whole schedule: its global batches, which in local-update mode come H / F to an epoch (a round)
        args.max_epochs = -(-config.optimizer.total_steps // config.optimizer.epoch_batches)
    # a swarm out of reach, a refused token, a setting to change: CollabKitErrors, one line from main()
    # a micro-batch or reversible layers set on the command line are kept; otherwise a GPU takes what fits it
    fit_settings = not any(
        setting.split("=", 1)[0].strip() in ("optimizer.batch_size_per_step", "model.reversible")
        for setting in args.set or []
    )
    volunteer = (make_volunteer or Volunteer.from_config)(
        config,
        num_threads=args.threads,
        verbose=args.verbose,
        device=args.device,
        precision=args.precision,
        fit_settings=fit_settings,
    )
    with volunteer:
        handle_stop_signals(volunteer.request_stop)
        if volunteer.reachability is not None:
            print(f"reachability: {volunteer.reachability.explain()}", flush=True)
        print(volunteer.join_line, flush=True)
        print(f"data: {volunteer.data_description}", flush=True)
        if volunteer.device_note is not None:
            print(f"device: {volunteer.device_note}", flush=True)
        print(f"device: {volunteer.plan.describe()}", flush=True)
        if config.optimizer.local_updates:
            optimizer_config = config.optimizer
            in_turn = (
                f", a 1/{optimizer_config.fragments} fragment of the model at a time"
                if optimizer_config.fragments > 1
                else ""
            )
            print(
                f"local-update mode: this peer takes its own steps and averages with the swarm once every "
                f"{optimizer_config.local_steps} global batches "
                f"({optimizer_config.local_steps * optimizer_config.target_batch_size} samples of the swarm's)"
                f"{in_turn}",
                flush=True,
            )
        if args.events:
            emit_event(
                "ready",
                peer_id=str(volunteer.dht.peer_id),
                addresses=join_addresses(volunteer.dht),
                device=str(volunteer.plan.device),
                precision=volunteer.plan.precision,
            )
        on_epoch = (lambda record: emit_event("epoch", **record.to_dict())) if args.events else None
        on_restore = (lambda record: emit_event("restore", **record.to_dict())) if args.events else None
        on_lone = (lambda warning: emit_event("lone", **warning.to_dict())) if args.events else None
        on_link = (lambda state: emit_event("link", state=state, epoch=volunteer.local_epoch)) if args.events else None
        if args.events:  # the moment a gradient all-reduce is under way (tests kill peers in the middle of one)

            def on_averaging_start(epoch: int, stage: str):
                emit_event("averaging", epoch=epoch, stage=stage)

            volunteer.optimizer.on_averaging_start = on_averaging_start
        history = volunteer.train(
            epochs=args.epochs,
            max_epochs=args.max_epochs,
            max_steps=args.max_steps,
            progress=not args.no_progress,
            on_epoch=on_epoch,
            wait_for_peers=args.wait_for_peers,
            on_restore=on_restore,
            on_lone=on_lone,
            on_link=on_link,
            max_load=args.max_load,
        )
        if args.save_params:
            torch.save(volunteer.parameters_snapshot(), args.save_params)
        if args.save_checkpoint:
            volunteer.save_checkpoint(args.save_checkpoint)
        if args.events:
            emit_event(
                "done",
                start_epoch=history.start_epoch,
                final_epoch=history.final_epoch,
                local_steps=history.local_steps,
                averaged_rounds=history.averaged_rounds,
                bytes_sent=history.bytes_sent,
                bytes_served=history.bytes_served,
                interrupted=history.interrupted,
                skipped_steps=history.skipped_steps,
                link_outages=history.link_outages,
                overflow_steps=history.overflow_steps,
                device=history.device,
                precision=history.precision,
                compute_seconds=round(history.compute_seconds, 3),
                overlapped_steps=history.overlapped_steps,
            )
    print(f"join: {history.summary()}", flush=True)
    return 130 if history.interrupted else 0
