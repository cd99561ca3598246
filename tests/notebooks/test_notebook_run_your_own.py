"""notebooks/run_your_own.ipynb and collab_kit.roles.services: a run's services started from Python, and stopped.

The notebook runs under papermill against the real services on 127.0.0.1: ``collab-kit auth-server`` in front of
the stand-in Hub (tests/helpers/hub_server.py), ``collab-kit monitor``, a background ``collab-kit join`` and the
notebook's
own in-process Volunteer. Afterwards no process a service started may be left.
"""

import json
import math
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest
from hub_server import StandInHub
from notebook_runs import cell_texts, parameter_names, python3_kernel  # noqa: F401 (a fixture)

from collab_kit import cli
from collab_kit.auth.ledger import JoinLedger
from collab_kit.auth.server_settings import AuthServerSettings
from collab_kit.config import get_preset
from collab_kit.roles import services
from collab_kit.roles.processes import group_is_empty
from collab_kit.roles.run_history import RunHistory

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "run_your_own.ipynb"
ORG = "my-org"
PARAMETERS = (
    "RUN_ID",
    "PRESET",
    "OPTIMIZER_SETTINGS",
    "HOST",
    "MONITOR_PORT",
    "WITH_AUTH",
    "ORGANIZATION",
    "ALLOWLIST",
    "HUB_ENDPOINT",
    "AUTH_HOST",
    "AUTH_PORT",
    "AUTH_PUBLIC_URL",
    "TOKEN_LIFETIME_MINUTES",
    "AUTH_DB",
    "MONITOR_DB",
    "CHECKPOINTS",
    "CHECKPOINT_EVERY",
    "POLL_EVERY",
    "LOG_DIR",
    "MAX_EPOCHS",
    "DATA_SHARDS",
    "SYNTHETIC_SAMPLES",
    "LOCAL_VOLUNTEERS",
    "NUM_THREADS",
    "SHOW_PROGRESS",
    "SUMMARY_PATH",
    "LOCAL_STEPS",
)


def _local_environment(monkeypatch, token=None):
    """What every process started from here inherits: requests to 127.0.0.1 go straight, and the user's token."""
    no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY", ""), "127.0.0.1", "localhost"]))
    monkeypatch.setenv("NO_PROXY", no_proxy)
    monkeypatch.setenv("no_proxy", no_proxy)
    if token is not None:
        monkeypatch.setenv("HF_TOKEN", token)


def test_the_notebook_defines_its_parameters():
    missing = set(PARAMETERS) - parameter_names(nbformat.read(str(NOTEBOOK), as_version=4))
    assert not missing, f"the parameters cell no longer defines {sorted(missing)}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_your_own_notebook_starts_a_run_trains_in_it_and_stops_everything(
    tmp_path, tiny_shards, python3_kernel, monkeypatch
):
    import papermill

    # in local-update mode (the synchronous notebook runs in test_notebooks_at_defaults, the synchronous authorized
    # run in tests/roles/test_auth_swarm.py): 3 rounds of 2 global batches, about 128 local steps per peer in each
    run_id, max_epochs, local_steps = "test_run_your_own", 3, 2
    summary_path, output_path = tmp_path / "summary.json", tmp_path / "run_your_own.out.ipynb"
    with StandInHub(str(tmp_path / "hub")) as hub:
        _local_environment(monkeypatch, token=hub.add_user_token("alice", orgs=[ORG]))
        # half the tiny preset's target batch: rounds of two global batches, long enough for the two training
        # peers to meet in each
        parameters = dict(
            RUN_ID=run_id,
            PRESET="tiny",
            OPTIMIZER_SETTINGS=dict(target_batch_size=1024),
            LOCAL_STEPS=local_steps,
            HOST="127.0.0.1",
            MONITOR_PORT=0,
            WITH_AUTH=True,
            ORGANIZATION=ORG,
            ALLOWLIST=[],
            HUB_ENDPOINT=hub.endpoint,
            AUTH_HOST="127.0.0.1",
            AUTH_PORT=0,
            AUTH_PUBLIC_URL="",
            TOKEN_LIFETIME_MINUTES=60,
            AUTH_DB=str(tmp_path / "run" / "auth.sqlite3"),
            MONITOR_DB=str(tmp_path / "run" / "monitor.sqlite"),
            CHECKPOINTS=str(tmp_path / "run" / "checkpoints"),
            CHECKPOINT_EVERY=0,
            POLL_EVERY=1.0,
            LOG_DIR=str(tmp_path / "run" / "logs"),
            MAX_EPOCHS=max_epochs,
            DATA_SHARDS=tiny_shards,
            SYNTHETIC_SAMPLES=0,
            LOCAL_VOLUNTEERS=1,
            NUM_THREADS=1,
            SHOW_PROGRESS=False,
            SUMMARY_PATH=str(summary_path),
        )
        assert set(parameters) == set(PARAMETERS)
        try:
            papermill.execute_notebook(
                str(NOTEBOOK),
                str(output_path),
                parameters=parameters,
                kernel_name=python3_kernel,
                cwd=str(tmp_path),
                progress_bar=False,
                start_timeout=120,
                execution_timeout=240,
            )
        except Exception as e:
            logs = "\n".join(
                f"--- {log.name}:\n{log.read_text()[-3000:]}"
                for log in sorted((tmp_path / "run" / "logs").glob("*.log"))
            )
            pytest.fail(f"the notebook failed ({type(e).__name__}): {e}\n{logs}", pytrace=False)

    summary = json.loads(summary_path.read_text())
    # nothing a service started is left: the auth server, the monitor and the background volunteer, each with the
    # processes of its own (hivemind's DHT, libp2p daemons)
    assert {service["name"] for service in summary["services"]} == {"auth-server", "monitor", "volunteer-1"}, summary
    assert summary["services_stopped"], summary
    assert summary["live_page"].startswith("http://127.0.0.1:"), summary  # the link it printed for the live page
    left = [service for service in summary["services"] if not group_is_empty(service["pgid"])]
    assert not left, f"processes of these services outlived the notebook: {left}"

    # this notebook's peer trained to the end, together with the background volunteer
    assert summary["final_epoch"] >= max_epochs and summary["epochs_trained"] >= 1, summary
    assert math.isfinite(summary["loss_first"]) and math.isfinite(summary["loss_last"]), summary
    assert summary["loss_last"] < summary["loss_first"], summary  # each epoch's loss: a mean of 50+ local steps
    assert summary["averaged_rounds"] >= 1, f"the notebook's peer never averaged with the other volunteer: {summary}"
    assert summary["local_steps"] == local_steps and summary["bytes_sent"] > 0, summary
    # the monitor credited the work to the stand-in Hub's user, whose binding it verified
    assert summary["username"] == "alice" and summary["leaderboard"] == ["alice"], summary
    with RunHistory(str(tmp_path / "run" / "monitor.sqlite"), read_only=True) as history:
        [contributor] = history.leaderboard()
        assert contributor.name == "alice" and contributor.samples > 0, contributor
        assert max(point.epoch for point in history.series()) >= max_epochs
    # the three peers (the monitor, the background volunteer, the notebook's) each joined through the auth server
    ledger = JoinLedger(str(tmp_path / "run" / "auth.sqlite3"))
    try:
        assert ledger.user_stats("alice").joins >= 3
    finally:
        ledger.close()

    text = cell_texts(nbformat.read(str(output_path), as_version=4))
    assert "To join this run: HF_TOKEN=hf_... collab-kit join --preset tiny --run-id test_run_your_own" in text
    assert "--set swarm.auth_server=http://127.0.0.1:" in text and "/ip4/127.0.0.1/tcp/" in text
    assert f"--set optimizer.local_steps={local_steps}" in text  # whoever pastes the line trains in the same mode
    assert "alice" in text and "volunteer-1: epochs 0->" in text


# ---------------------------------------------------------------------------------------------
# collab_kit.roles.services


def test_config_arguments_rebuild_the_same_config():
    config = get_preset(
        "tiny",
        optimizer=dict(target_batch_size=512, learning_rate=3e-3),
        model=dict(hidden_size=48),
        data=dict(tokenizer="toy"),
        swarm=dict(
            run_id="same_run",
            host="0.0.0.0",
            port=31337,
            auth_server="http://127.0.0.1:9",
            announce_maddrs=("/ip4/203.0.113.5/tcp/31337",),
        ),
    )
    for command in ("join", "monitor"):
        args = cli.make_parser().parse_args([command, *services.config_arguments(config)])
        assert cli.build_config(args) == config, command
    with pytest.raises(ValueError, match="get_preset"):
        config.preset = "custom"
        services.config_arguments(config)


def test_join_command_carries_what_every_peer_must_share():
    # the micro-batch and checkpointing are what the preflight chose for this machine: a friend's machine chooses its
    # own
    config = get_preset(
        "small",
        optimizer=dict(target_batch_size=1024, batch_size_per_step=1),
        model=dict(reversible=False),
        swarm=dict(run_id="shared"),
    )
    line = services.join_command(config, ["/ip4/203.0.113.5/tcp/31337/p2p/12D3KooWabc"], "https://auth.example.org")
    assert line == (
        "HF_TOKEN=hf_... collab-kit join --preset small --run-id shared "
        "--set optimizer.target_batch_size=1024 --set swarm.auth_server=https://auth.example.org "
        "--initial-peers /ip4/203.0.113.5/tcp/31337/p2p/12D3KooWabc"
    )


def test_auth_server_arguments_give_the_same_settings(tmp_path):
    import datetime

    settings = AuthServerSettings(
        organization=ORG,
        allowlist=("bob", "carol"),
        run_id="r1",
        database_path=str(tmp_path / "a.sqlite3"),
        joins_per_minute=3,
        token_lifetime=datetime.timedelta(minutes=2.5),
        hub_endpoint="http://127.0.0.1:9",
    )
    args = cli.make_parser().parse_args(["auth-server", *services.auth_server_arguments(settings)])
    assert (
        args.organization,
        args.allow,
        args.run_id,
        args.db,
        args.key,
        args.token_lifetime,
        args.rate_limit,
        args.hub_endpoint,
    ) == (ORG, ["bob", "carol"], "r1", settings.database_path, settings.key_path, 2.5, 3, "http://127.0.0.1:9")
    with pytest.raises(ValueError, match="hub_timeout"):
        services.auth_server_arguments(AuthServerSettings(organization=ORG, hub_timeout=1.0))


def test_an_auth_server_on_a_taken_port_fails_with_what_to_do(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = AuthServerSettings(
            organization=ORG, database_path=str(tmp_path / "auth.sqlite3"), hub_endpoint="http://127.0.0.1:9"
        )
        with pytest.raises(services.ServiceError) as error:
            services.start_auth_server(settings, port=port, log_path=str(tmp_path / "auth.log"))
    message = str(error.value)
    assert "exited with code" in message and "address already in use" in message and str(port) in message
    assert "pick another port, or 0" in message and "auth.log" in message
    assert not services.running_services()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_monitor_with_a_token_the_hub_does_not_know_fails_with_what_to_do(tmp_path, monkeypatch):
    _local_environment(monkeypatch)
    with StandInHub(str(tmp_path / "hub")) as hub:
        hub.add_user_token("alice", orgs=[ORG])
        settings = AuthServerSettings(
            organization=ORG, run_id="refused", database_path=str(tmp_path / "a.sqlite3"), hub_endpoint=hub.endpoint
        )
        with services.start_auth_server(settings, port=0, log_path=str(tmp_path / "auth.log")) as auth:
            assert auth.running and auth.url.startswith("http://127.0.0.1:")
            config = get_preset("tiny", swarm=dict(run_id="refused", host="127.0.0.1", auth_server=auth.url))
            with pytest.raises(services.ServiceError) as error:
                services.start_monitor(config, hf_token="hf_not_a_token", log_path=str(tmp_path / "monitor.log"))
            assert [service.name for service in services.running_services()] == ["auth-server"]
        assert auth.stopped and not services.running_services()
    message = str(error.value)
    assert "the monitor did not start" in message and "(401)" in message and "log in again" in message, message


def test_services_stop_when_the_interpreter_exits(tmp_path):
    """A notebook kernel that is shut down or restarted leaves no service running (atexit)."""
    code = textwrap.dedent(f"""
        from collab_kit.roles import services
        from collab_kit.auth.server_settings import AuthServerSettings

        settings = AuthServerSettings(organization="{ORG}", database_path={str(tmp_path / "a.sqlite3")!r},
                                      hub_endpoint="http://127.0.0.1:9")
        server = services.start_auth_server(settings, port=0, log_path={str(tmp_path / "auth.log")!r})
        print(server.pgid, flush=True)
    """)  # and exits without stopping it
    finished = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr
    pgid = int(finished.stdout.split()[-1])
    assert group_is_empty(pgid), f"the auth server (process group {pgid}) outlived the interpreter that started it"


@pytest.mark.timeout(180)
def test_an_authorized_run_nobody_may_join_stops_with_one_sentence_naming_the_notebooks_settings(
    tmp_path, python3_kernel
):
    import papermill

    output_path = tmp_path / "out.ipynb"
    with pytest.raises(papermill.PapermillExecutionError):
        papermill.execute_notebook(
            str(NOTEBOOK),
            str(output_path),
            parameters=dict(WITH_AUTH=True),
            kernel_name=python3_kernel,
            cwd=str(tmp_path),
            progress_bar=False,
            start_timeout=120,
            execution_timeout=120,
        )
    errors = [
        output
        for cell in nbformat.read(str(output_path), as_version=4).cells
        for output in cell.get("outputs", [])
        if output.output_type == "error"
    ]
    [error] = errors
    assert error.ename == "SettingProblem" and len(error.traceback) == 1  # the sentence, no stack
    assert "ORGANIZATION" in error.evalue and "ALLOWLIST" in error.evalue and "WITH_AUTH = False" in error.evalue
    assert "--organization" not in error.evalue
