"""Where the kit reaches inside hivemind: the one version it is tested with, and every private name it touches.

The kit builds on hivemind 1.1.12 and, to change what its public API cannot, overrides, copies, calls or reads
about fifty of its private names. Another version may rename any of them without notice, so ``import collab_kit``
refuses another version with one sentence (``require_tested_hivemind``), and ``SEAM`` lists each name with the
reason. tests/test_hivemind_seam.py checks the list against the code both ways: every private hivemind name the kit
overrides or uses is listed, and every listed name is still in hivemind and in the kit module that names it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from importlib import metadata

from collab_kit.errors import CollabKitError

TESTED_HIVEMIND = "1.1.12"
ANY_HIVEMIND_VARIABLE = "COLLAB_KIT_ANY_HIVEMIND"  # set to 1: import with another version, at the user's risk


class HivemindVersionError(CollabKitError, ImportError):
    """This Python has a hivemind other than the one the kit is tested with, or none."""


def installed_hivemind() -> str | None:
    """The version of hivemind this Python would import (None: not installed), read without importing it."""
    try:
        return metadata.version("hivemind")
    except metadata.PackageNotFoundError:
        return None


def hivemind_version_problem() -> str | None:
    """One sentence when the installed hivemind is not the tested one (None: it is, or the user accepts the risk)."""
    found = installed_hivemind()
    if found == TESTED_HIVEMIND or os.environ.get(ANY_HIVEMIND_VARIABLE) == "1":
        return None
    have = f"hivemind {found}" if found else "no hivemind"
    return (
        f"collab_kit works with hivemind {TESTED_HIVEMIND} only and this Python has {have}: run "
        f"`pip install hivemind=={TESTED_HIVEMIND}` in it, or set {ANY_HIVEMIND_VARIABLE}=1 to try yours at your "
        f"own risk."
    )


def require_tested_hivemind() -> None:
    """Stop unless the tested hivemind is installed: the ``collab-kit`` command prints the sentence alone and exits
    with 1, an import raises it (tests/test_hivemind_seam.py).

    :raises HivemindVersionError: with ``hivemind_version_problem``'s sentence
    """
    problem = hivemind_version_problem()
    if problem and os.path.basename(sys.argv[0]) == "collab-kit":
        raise SystemExit(f"collab-kit: {problem}")
    if problem:
        raise HivemindVersionError(problem)


@dataclass(frozen=True)
class SeamName:
    """One private hivemind name the kit touches.

    :param owner: where hivemind defines it: a module, or a module and a class (``hivemind.optim.optimizer.Optimizer``)
    :param name: the private name
    :param how: "overrides" (a kit class redefines it), "copies" (redefines it from hivemind's code, changed),
      "calls", "reads" or "replaces" (assigns its own object in its place)
    :param where: the kit modules that touch it
    :param why: what the public API cannot do
    """

    owner: str
    name: str
    how: str
    where: tuple[str, ...]
    why: str


_OPTIMIZER = "hivemind.optim.optimizer.Optimizer"
_TRACKER = "hivemind.optim.progress_tracker.ProgressTracker"
_AVERAGER = "hivemind.averaging.averager.DecentralizedAverager"
_STATE_AVERAGER = "hivemind.optim.state_averager.TrainingStateAverager"
_RUNNER = "hivemind.averaging.allreduce.AllReduceRunner"
_PARTITION = "hivemind.averaging.partition.TensorPartContainer"
_SERVICER = "hivemind.p2p.servicer.ServicerBase"
_AUTHORIZER = "hivemind.utils.auth.TokenAuthorizerBase"
_SW = "collab_kit.swarm."

SEAM: tuple[SeamName, ...] = (
    # the optimizer's step: when to average, what to load, what counts
    SeamName(
        _OPTIMIZER,
        "_make_progress_tracker",
        "copies",
        (_SW + "optimizer", _SW + "anchor"),
        "the tracker that publishes at most once per half refresh period, and the anchor's that trains nothing",
    ),
    SeamName(
        _OPTIMIZER,
        "_make_state_averager",
        "copies",
        (_SW + "optimizer",),
        "the state averager with the kit's mixins (direct state, fragments, bindings) in front",
    ),
    SeamName(
        _OPTIMIZER,
        "_maybe_schedule_gradient_averaging",
        "overrides",
        (_SW + "optimizer", _SW + "anchor", _SW + "local_updates"),
        "no matchmaking alone; the anchor's groups wait for the peers it expects; one round at a time",
    ),
    SeamName(
        _OPTIMIZER,
        "_maybe_schedule_state_averaging",
        "overrides",
        (_SW + "optimizer",),
        "no state averaging with nobody",
    ),
    SeamName(
        _OPTIMIZER,
        "_begin_averaging_gradients",
        "overrides",
        (_SW + "optimizer",),
        "a round's start reported to the volunteer's records",
    ),
    SeamName(
        _OPTIMIZER,
        "_average_gradients_and_load_into_optimizer",
        "overrides",
        (_SW + "optimizer", _SW + "anchor", _SW + "local_updates"),
        "what the round gave (peers, reduced only) recorded for the epoch's report",
    ),
    SeamName(
        _OPTIMIZER,
        "_check_and_accumulate_gradients",
        "overrides",
        (_SW + "anchor", _SW + "local_updates"),
        "the anchor accumulates nothing; the local-update mode steps its inner optimizer instead",
    ),
    SeamName(
        _OPTIMIZER,
        "_should_load_state_from_peers",
        "overrides",
        (_SW + "optimizer", _SW + "anchor", _SW + "local_updates"),
        "a download only when behind by more than the round in flight, with a reason, and backed off",
    ),
    SeamName(
        _OPTIMIZER,
        "_update_global_epoch",
        "overrides",
        (_SW + "local_updates",),
        "the outer step on pseudo-gradients at the end of a local-update round",
    ),
    SeamName(
        _OPTIMIZER,
        "_should_check_synchronization_on_update",
        "replaces",
        (_SW + "local_updates",),
        "set after an overlapped round, as hivemind's own epoch update sets it",
    ),
    # the swarm's progress
    SeamName(
        _TRACKER,
        "_progress_reporter",
        "copies",
        (_SW + "progress", _SW + "anchor"),
        "a DHT store per local step cost a volunteer's link 1.7 Mbit/s; the anchor withdraws its record",
    ),
    SeamName(_TRACKER, "_progress_fetcher", "calls", (_SW + "progress",), "run beside the copied reporter"),
    SeamName(
        _TRACKER,
        "_parse_swarm_progress_data",
        "overrides",
        (_SW + "progress",),
        "this peer's own record counted as it is now, not as the DHT last held it",
    ),
    SeamName(
        _TRACKER,
        "_get_local_progress",
        "overrides",
        (_SW + "anchor",),
        "the anchor's record says it trains at 0 samples/s",
    ),
    SeamName(
        _TRACKER,
        "_local_public_key",
        "reads",
        (_SW + "progress", _SW + "anchor"),
        "the subkey of this peer's own progress record",
    ),
    # averagers and their rounds
    SeamName(
        _SERVICER,
        "_rpc_handlers",
        "replaces",
        (_SW + "averagers",),
        "cleared so each composed averager class collects its own RPC handlers",
    ),
    SeamName(_SERVICER, "_stub_type", "replaces", (_SW + "averagers",), "cleared for the same reason"),
    SeamName(
        _SERVICER,
        "_get_handle_name",
        "calls",
        (_SW + "direct_state",),
        "the handler names of the state download by parts, under the averager's prefix",
    ),
    SeamName(
        _AVERAGER,
        "_aggregate_with_group",
        "overrides",
        (_SW + "averagers",),
        "each round's group and outcome reported to the epoch's record",
    ),
    SeamName(
        _AVERAGER,
        "_run_allreduce_inplace_",
        "copies",
        (_SW + "runners", _SW + "fragments"),
        "the kit's runner and member modes built where hivemind builds its own; one fragment a round",
    ),
    SeamName(
        _AVERAGER,
        "_load_state_from_peers",
        "overrides",
        (_SW + "direct_state", _SW + "kept_tasks"),
        "state downloaded from the run's anchors, in parts from several sharers; its task held until it ends",
    ),
    *(
        SeamName(
            _AVERAGER,
            name,
            "overrides",
            (_SW + "kept_tasks",),
            "hivemind runs each call down the averager's pipe as a task nobody holds: held until it ends",
        )
        for name in ("_step", "_get_group_bits", "_set_group_bits", "_trigger_declare_load_state")
    ),
    SeamName(
        _AVERAGER,
        "_get_current_state_from_host_process",
        "overrides",
        (_SW + "direct_state",),
        "the state an anchor that only reduces serves on the volunteers' behalf",
    ),
    SeamName(
        _AVERAGER,
        "_shutdown",
        "overrides",
        (_SW + "averagers",),
        "the parts a round still owes are sent before the averager stops",
    ),
    SeamName(
        _AVERAGER,
        "_matchmaking",
        "reads",
        (_SW + "averagers", _SW + "direct_state"),
        "the group key and the leaders declared, to wait for the expected peers and find the sharers",
    ),
    SeamName(
        _AVERAGER,
        "_outer_pipe",
        "calls",
        (_SW + "averagers", _SW + "direct_state"),
        "settings sent to the averager's own process, as hivemind's public methods do",
    ),
    SeamName(
        _AVERAGER,
        "_running_groups",
        "reads",
        (_SW + "averagers", _SW + "runners"),
        "the round's runner handed over where hivemind registers it",
    ),
    SeamName(
        _AVERAGER,
        "_p2p",
        "reads",
        (_SW + "direct_state", _SW + "runners"),
        "the averager's p2p node, for the kit's handlers and runners",
    ),
    SeamName(_AVERAGER, "_averaging_alpha", "reads", (_SW + "runners",), "applied as hivemind's own runner does"),
    SeamName(_AVERAGER, "_state_updated", "calls", (_SW + "runners",), "set as hivemind's own runner does"),
    SeamName(
        _STATE_AVERAGER,
        "_apply_optimizer_parameters_",
        "overrides",
        (_SW + "fragments",),
        "only the fragment averaged this round goes back into the model",
    ),
    SeamName(
        _STATE_AVERAGER,
        "_averaged_parameters",
        "reads",
        (_SW + "anchor",),
        "the offloaded copy the optimizer steps on, set when the anchor resumes from a checkpoint",
    ),
    SeamName(
        "hivemind.optim.grad_averager.GradientAverager",
        "_grad_accumulators",
        "calls",
        (_SW + "local_updates",),
        "the pseudo-gradient written where the gradients are averaged from",
    ),
    SeamName(
        _RUNNER,
        "_accumulate_parts_streaming",
        "copies",
        (_SW + "runners",),
        "a 4-bit part's reply is its rounded average, the same for every member",
    ),
    SeamName(
        _RUNNER,
        "_generate_input_for_peer",
        "overrides",
        (_SW + "runners",),
        "a stand-in's and an anchor's weightless parts sent as one value each",
    ),
    SeamName(_RUNNER, "_ban_sender", "calls", (_SW + "runners",), "a sender of a malformed part, as hivemind bans"),
    SeamName(_PARTITION, "_input_parts_by_peer", "reads", (_SW + "runners",), "the parts this peer sends each peer"),
    SeamName(
        _PARTITION,
        "_inputs_consumed_by_peer",
        "replaces",
        (_SW + "runners",),
        "marked as hivemind's iterate_input_parts_for marks them",
    ),
    SeamName(
        "hivemind.compression.serialization",
        "_BASE_COMPRESSION_TYPES",
        "replaces",
        (_SW + "four_bit",),
        "the 4-bit codec registered under a tag hivemind's decoder table knows",
    ),
    # the p2p daemon and the DHT's process (collab_kit.swarm.p2p_fixes)
    SeamName(
        "hivemind.p2p.p2p_daemon.P2P",
        "_client",
        "calls",
        (_SW + "watchdog", _SW + "liveness"),
        "connect and disconnect one peer, which hivemind's P2P does not offer",
    ),
    SeamName(
        "hivemind.p2p.p2p_daemon_bindings.control.ControlClient",
        "_pending_calls",
        "replaces",
        (_SW + "p2p_fixes",),
        "answers to calls given up on are still read, so later answers stay in order",
    ),
    SeamName(
        "hivemind.dht.dht.DHT",
        "_inner_pipe",
        "replaces",
        (_SW + "p2p_fixes",),
        "the DHT's process survives a request whose sender is gone",
    ),
    # authentication
    SeamName(
        _AUTHORIZER,
        "_local_access_token",
        "replaces",
        ("collab_kit.auth.client",),
        "the token from the kit's authentication server, renewed before it expires",
    ),
    SeamName(
        _AUTHORIZER, "_local_private_key", "reads", ("collab_kit.auth.client",), "the key the access token is bound to"
    ),
    SeamName(
        "hivemind.utils.crypto.RSAPrivateKey",
        "_private_key",
        "replaces",
        ("collab_kit.auth.tokens",),
        "a saved key loaded as hivemind's __setstate__ loads one",
    ),
)
