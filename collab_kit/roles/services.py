"""A run's services, started from Python: the authentication server, the monitor, volunteers on this machine.

    from collab_kit import get_preset, services
    from collab_kit.auth.server_settings import AuthServerSettings

    auth = services.start_auth_server(AuthServerSettings(organization="my-org", run_id="my_run"))
    config = get_preset("small", swarm=dict(run_id="my_run", host="0.0.0.0", auth_server=auth.url))
    monitor = services.start_monitor(config)             # the run's first peer; waits until it is reachable
    print(services.join_command(config, monitor.addresses, auth_server=auth.url))
    ...
    services.stop_all()                                  # also done when the interpreter exits

Each service is the real ``collab-kit`` command (``auth-server``, ``monitor``, ``join``) in a subprocess of its
own process group (collab_kit.roles.processes.PeerProcess), started with ``--events``: the start functions wait for
its "ready" event with a deadline and return a :class:`Service` holding its URL or join addresses. Subprocesses,
not threads, because a service must outlive the cell that started it, because hivemind allows one Optimizer
(and one set of averagers) per process, so that the notebook's own volunteer can train beside the monitor, and
because stopping a process group ends everything a service started, libp2p daemons included.

Every service started here is stopped when the interpreter exits (a notebook kernel that is shut down or
restarted), so nothing is left running; a kernel killed outright (out of memory, SIGKILL) cannot do that: stop
what it left with ``kill -- -PGID``, the process group each service logs and reports as ``pgid``.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Sequence

from collab_kit.auth.client import login
from collab_kit.auth.server_settings import AuthServerSettings
from collab_kit.config import PRESETS, RunConfig, command_line_literal, get_preset
from collab_kit.errors import CollabKitError
from collab_kit.roles.monitor_settings import MonitorSettings
from collab_kit.roles.processes import PeerFailed, PeerProcess, group_is_empty
from collab_kit.swarm.dht import join_command as swarm_join_command
from collab_kit.swarm.run_card import published_data

logger = logging.getLogger(__name__)

# swarm fields that have an option of their own on the command line; the others travel as --set swarm.FIELD=...
_SWARM_OPTIONS = ("run_id", "host", "port", "initial_peers", "client_mode")
# what a service's log says when it failed, and what to do about it (the first match is given as the hint)
_HINTS = (
    (
        ("address already in use", "could not listen"),
        "the port is taken, by another program or by a service started earlier (stop it first: "
        "collab_kit.roles.services.stop_all()); pick another port, or 0 for any free one",
    ),
    (("(401)",), "the Hub does not accept this Hugging Face token: log in again with a valid user access token"),
    (
        ("(403)",),
        "this Hugging Face user may not join: make them a member of the organization or add them to the "
        "auth server's allowlist",
    ),
    (
        ("could not reach the run's authentication server",),
        "is the auth server running, and is swarm.auth_server its URL?",
    ),
    (
        ("no hugging face token", "log in to hugging face"),
        "log in to Hugging Face first: set HF_TOKEN, run `hf auth login`, or collab_kit.auth.client.login() in a "
        "notebook",
    ),
)

_running: dict[int, Service] = {}  # pid -> every service started here and not stopped yet
_running_lock = threading.Lock()
_log_dir: str | None = None


class ServiceError(CollabKitError, RuntimeError):
    """A service did not start, or stopped early; the message holds the end of its log and what to do."""


class Service:
    """A ``collab-kit`` command running in the background: the auth server, the monitor or a volunteer.

    Made by :func:`start_auth_server`, :func:`start_monitor` and :func:`start_volunteer_process` once the
    command reported that it is ready. Use it as a context manager to stop it at the end of a block.

    :param kind: ``"auth server"``, ``"monitor"`` or ``"volunteer"``
    :param process: the running command (started with ``--events``)
    :param ready: its "ready" event
    """

    def __init__(self, kind: str, process: PeerProcess, ready: dict):
        self.kind, self.process, self.ready = kind, process, ready

    @property
    def name(self) -> str:
        return self.process.name

    @property
    def log_path(self) -> str:
        """Every line the command printed."""
        return self.process.log_path

    @property
    def pid(self) -> int:
        return self.process.process.pid

    @property
    def pgid(self) -> int:
        """The process group of the command and of everything it started (it leads a session of its own)."""
        return self.process.process.pid

    @property
    def url(self) -> str | None:
        """The auth server's URL as reached from this machine (a server on 0.0.0.0 is reached on 127.0.0.1)."""
        url = self.ready.get("url")
        if url is None:
            return None
        return url.replace("://0.0.0.0:", "://127.0.0.1:").replace("://[::]:", "://[::1]:")

    @property
    def addresses(self) -> list[str]:
        """A peer's join addresses (multiaddrs), what others pass as ``initial_peers``."""
        return list(self.ready.get("addresses", []))

    @property
    def running(self) -> bool:
        return self.process.process.poll() is None

    @property
    def stopped(self) -> bool:
        """True when the command and every process it started have ended."""
        return not self.running and group_is_empty(self.pgid)

    @property
    def events(self) -> list[dict]:
        """Every event the command reported so far, in order."""
        return list(self.process.events)

    def log_tail(self, lines: int = 20) -> str:
        return self.process.log_tail(lines)

    def wait_for(self, predicate: Callable[[dict], bool], timeout: float, what: str = "an event") -> dict:
        """The first event (earlier ones included) for which ``predicate`` is true.

        :raises ServiceError: the command ended first, or ``timeout`` seconds passed
        """
        try:
            return self.process.wait_for(predicate, timeout, what)
        except PeerFailed as e:
            raise ServiceError(f"{e}\n{_hint(self.log_tail(40))}".rstrip()) from None

    def wait_until_ready(self, timeout: float) -> dict:
        """Wait for the command's "ready" event (the start functions do, unless told not to); stop it if it does not
        come.

        :raises ServiceError: it ended first or was not ready in time; the message holds its own error, what to do,
          and the last lines of its log
        """
        if self.ready:
            return self.ready
        try:
            self.ready = self.process.wait_for(lambda e: e["type"] == "ready", timeout, what="that it is ready")
        except PeerFailed:
            tail = self.log_tail(40)
            self.stop(grace=5.0)
            code = self.process.process.poll()
            reason = f"it exited with code {code}" if code is not None else f"it was not ready within {timeout:g} s"
            # the command's own one-line error (collab-kit COMMAND: error: ...), else the last line that reports one
            command = self.process.args[0] if self.process.args else ""
            errors = [
                line.split("error:", 1)[1].strip()
                for line in tail.splitlines()
                if f"collab-kit {command}: error:" in line
            ]
            errors = errors or [line.strip() for line in tail.splitlines() if "error" in line.lower()]
            if errors:
                reason = f"{reason}: {errors[-1]}"
            message = [
                f"the {self.kind} did not start: {reason}",
                _hint(tail),
                f"The last lines of its log ({self.log_path}):",
                tail.rstrip(),
            ]
            raise ServiceError("\n".join(part for part in message if part)) from None
        logger.info(f"{self.name} is ready (pid {self.pid}, log {self.log_path})")
        return self.ready

    def stop(self, grace: float = 10.0) -> None:
        """End the command and everything it started: SIGTERM to its process group, SIGKILL after ``grace`` s.

        Safe to call twice.
        """
        with _running_lock:
            _running.pop(self.pid, None)
        self.process.kill(grace)

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.url or " ".join(self.addresses[:1]) or "-"
        return f"<{self.kind} {self.name} pid={self.pid} {'running' if self.running else 'ended'} at {where}>"


class MonitorService(Service):
    """The monitor (the run's first peer), with a way to wait until it has recorded what volunteers did."""

    @property
    def page_url(self) -> str | None:
        """The link of the run's live page as opened on this machine (None: started without ``dashboard_port``)."""
        for event in self.events:
            if event["type"] == "live_page":
                return event["url"].replace("://0.0.0.0:", "://127.0.0.1:").replace("://[::]:", "://[::1]:")
        return None

    def wait_for_poll(self, epoch: int = 0, contributors: int = 0, timeout: float = 60.0) -> dict:
        """Wait for a poll that saw global ``epoch`` (or later) and at least ``contributors`` in the leaderboard.

        :returns: the poll's event (epoch, alive_peers, loss, samples_per_second, records, contributors)
        :raises ServiceError: no such poll within ``timeout`` seconds, or the monitor ended
        """
        return self.wait_for(
            lambda e: e["type"] == "poll" and e["epoch"] >= epoch and e["contributors"] >= contributors,
            timeout,
            what=f"a poll at epoch >= {epoch} with >= {contributors} contributors",
        )


def running_services() -> list[Service]:
    """The services started in this interpreter and not stopped yet."""
    with _running_lock:
        return list(_running.values())


def stop_all(grace: float = 10.0) -> list[Service]:
    """Stop every service started in this interpreter, all at once (each takes seconds to leave); returns them."""
    stopped = running_services()[::-1]

    def stop(service: Service):
        try:
            service.stop(grace)
        except Exception:  # at exit, one failure must not leave the others running
            logger.warning(f"could not stop {service.name} (process group {service.pgid})", exc_info=True)

    threads = [threading.Thread(target=stop, args=(service,), name=f"stop-{service.name}") for service in stopped]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return stopped


@atexit.register
def _stop_at_exit() -> None:
    # one by one: Python 3.12 and later start no new thread once the interpreter is shutting down
    for service in running_services()[::-1]:
        try:
            service.stop()
        except Exception:
            logger.warning(f"could not stop {service.name} (process group {service.pgid})", exc_info=True)


# ---------------------------------------------------------------------------------------------
# the command lines


def config_arguments(config: RunConfig) -> list[str]:
    """``collab-kit`` options that rebuild ``config``: its preset, run id, host, port, and ``--set`` for every field
    that differs from the preset's (so a subprocess trains exactly the model and optimizer of this config).

    :raises ValueError: the config was not made from a preset (get_preset), or holds a value the command line
      cannot carry
    """
    if config.preset not in PRESETS:
        raise ValueError(
            f"config.preset={config.preset!r}: start services from a config made with "
            f"get_preset(one of {', '.join(PRESETS)}, ...)"
        )
    swarm = config.swarm
    arguments = ["--preset", config.preset, "--run-id", swarm.run_id, "--port", str(swarm.port)]
    if swarm.host is not None:
        arguments += ["--host", swarm.host]
    base = get_preset(config.preset)
    for section in ("model", "optimizer", "swarm", "data"):
        ours, theirs = getattr(config, section), getattr(base, section)
        for field in dataclasses.fields(ours):
            if section == "swarm" and field.name in _SWARM_OPTIONS:
                continue
            value = getattr(ours, field.name)
            if value != getattr(theirs, field.name):
                arguments += ["--set", f"{section}.{field.name}={command_line_literal(section, field.name, value)}"]
    if swarm.initial_peers:
        arguments += ["--initial-peers", *swarm.initial_peers]
    return arguments


def join_command(config: RunConfig, addresses: Sequence[str], auth_server: str | None = None) -> str:
    """The command a volunteer runs to join this run through ``addresses`` (what to share with volunteers): the same
    line every peer prints (``collab_kit.swarm.dht.join_command``), with the run's data (``config.data.shards``).

    :param auth_server: the auth server's URL as volunteers reach it (default: ``config.swarm.auth_server``)
    """
    if auth_server:
        config = dataclasses.replace(config, swarm=dataclasses.replace(config.swarm, auth_server=auth_server))
    return swarm_join_command(config, addresses, data=published_data(config.data.shards))


def monitor_arguments(settings) -> list[str]:
    """``collab-kit monitor`` options of a MonitorSettings."""
    arguments = [
        "--db",
        settings.db_path or "",
        "--checkpoints",
        settings.checkpoint_dir,
        "--checkpoint-every",
        str(settings.checkpoint_every),
        "--keep",
        str(settings.keep_last),
        "--poll-every",
        repr(float(settings.poll_every)),
        "--backoff",
        repr(float(settings.backoff_initial)),
        "--backoff-max",
        repr(float(settings.backoff_max)),
        "--download-timeout",
        repr(float(settings.download_timeout)),
    ]
    for option, value in (
        ("--push-to", settings.push_to),
        ("--wandb-project", settings.wandb_project),
        ("--address-file", settings.address_file),
    ):
        if value:
            arguments += [option, value]
    if settings.dashboard_port is not None:
        arguments += ["--dashboard-port", str(settings.dashboard_port), "--dashboard-host", settings.dashboard_host]
    return arguments


def auth_server_arguments(settings) -> list[str]:
    """``collab-kit auth-server`` options of an AuthServerSettings.

    :raises ValueError: a setting changed from its default that the command line has no option for
    """

    defaults = {field.name: field.default for field in dataclasses.fields(AuthServerSettings)}
    fixed = [
        name
        for name in ("hub_timeout", "max_body_bytes", "accepted_auth_types", "max_pending_hub_checks")
        if getattr(settings, name) != defaults[name]
    ]
    if fixed:
        raise ValueError(
            f"collab-kit auth-server has no option for {', '.join(fixed)}: leave them at their defaults "
            f"here, or serve collab_kit.auth.server.create_app(settings) yourself"
        )
    minutes = settings.token_lifetime / datetime.timedelta(minutes=1)
    arguments = [
        "--db",
        settings.database_path,
        "--key",
        settings.key_path,
        "--run-id",
        settings.run_id,
        "--token-lifetime",
        repr(minutes),
        "--rate-limit",
        str(settings.joins_per_minute),
        "--hub-endpoint",
        settings.hub_endpoint,
    ]
    if settings.organization:
        arguments += ["--organization", settings.organization]
    for name in settings.allowlist:
        arguments += ["--allow", name]
    for address in settings.coordinator_addresses:
        arguments += ["--coordinator", address]
    return arguments


# ---------------------------------------------------------------------------------------------
# starting


def _default_log_path(name: str) -> str:
    global _log_dir
    if _log_dir is None:
        _log_dir = tempfile.mkdtemp(prefix="collab_kit_services_")
    return os.path.join(_log_dir, f"{name}.log")


def _make_parent(path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def _hint(log: str) -> str:
    lowered = log.lower()
    for markers, hint in _HINTS:
        if any(marker in lowered for marker in markers):
            return f"What to do: {hint}."
    return ""


def _start(
    kind: str,
    name: str,
    arguments: list[str],
    log_path: str | None,
    env: dict[str, str],
    timeout: float,
    service_class=Service,
    wait: bool = True,
) -> Service:
    """Start ``collab-kit ARGUMENTS --events`` and (with ``wait``) wait for its "ready" event."""
    log_path = log_path or _default_log_path(name)
    _make_parent(log_path)
    process = PeerProcess(name, [*arguments, "--events"], log_path, env=env)
    service = service_class(kind, process, ready={})
    with _running_lock:
        _running[service.pid] = service  # from now on, an exit of the interpreter stops it
    if wait:
        service.wait_until_ready(timeout)
    return service


def _token_environment(config: RunConfig, hf_token: str | None) -> dict[str, str]:
    """HF_TOKEN for a peer of an authorized run: the given token, or this user's login
    (collab_kit.auth.client.login)."""
    if not config.swarm.auth_server:
        return {}
    if not hf_token:
        hf_token = login()
    if not hf_token:
        raise ServiceError(
            "log in to Hugging Face first (the form above), then run this again: a peer of an "
            "authorized run needs a Hugging Face user token"
        )
    return {"HF_TOKEN": hf_token}


def start_auth_server(
    settings, host: str = "127.0.0.1", port: int = 8555, log_path: str | None = None, timeout: float = 60.0
) -> Service:
    """Start the run's authentication server (``collab-kit auth-server``) and wait until it listens.

    It lets in the Hugging Face users that ``settings`` allow: a volunteer's peer sends its Hugging Face user
    token, the server asks the Hub whose token it is and signs an access token for the peer's key (see
    collab_kit.auth.server). ``service.url`` is its address from this machine: the peers' ``swarm.auth_server``.

    :param settings: a collab_kit.auth.server_settings.AuthServerSettings (who may join, the run id, its database, the
      Hub)
    :param host: the address to listen on: 127.0.0.1 behind an HTTPS reverse proxy on this machine, 0.0.0.0 to be
      reached directly (tokens then travel unencrypted: on a network you trust only)
    :param port: the port to listen on; 0 for any free one
    :param log_path: where its output goes (default: a file in a temporary folder, ``service.log_path``)
    :param timeout: seconds to wait for it to listen
    :raises ServiceError: it did not start (the message holds the end of its log and what to do)
    """
    arguments = ["auth-server", *auth_server_arguments(settings), "--host", host, "--port", str(port)]
    _make_parent(settings.database_path)
    # the server's one job is asking the Hub: an offline setting meant for this process must not reach it
    environment = {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}
    return _start("auth server", "auth-server", arguments, log_path, environment, timeout)


def start_monitor(
    config: RunConfig, settings=None, hf_token: str | None = None, log_path: str | None = None, timeout: float = 180.0
) -> MonitorService:
    """Start the run's monitor (``collab-kit monitor``), the first peer volunteers join through; wait for its addresses.

    It trains nothing: it records the swarm's loss, alive peers, throughput and the contributors' leaderboard in
    ``settings.db_path`` (what collab_kit.widgets.dashboard draws) and saves checkpoints (collab_kit.roles.monitor).

    :param config: the run's configuration, the volunteers' own (get_preset(...)): its swarm section says where
      the monitor listens and, with ``auth_server``, makes the run authorized
    :param settings: a collab_kit.roles.monitor_settings.MonitorSettings (default: MonitorSettings())
    :param hf_token: the Hugging Face token the monitor joins an authorized run with (default: this user's login)
    :param log_path: where its output goes (default: a file in a temporary folder)
    :param timeout: seconds to wait until it is reachable (it loads torch and hivemind, and builds the model)
    :raises ServiceError: it did not start (a refused token, a port in use...; the message says what to do)
    """

    if config.swarm.client_mode:
        raise ValueError(
            "swarm.client_mode: the monitor is the peer volunteers join through, it must accept "
            "connections; set client_mode=False"
        )
    settings = settings or MonitorSettings()
    if settings.db_path:
        _make_parent(settings.db_path)
    arguments = ["monitor", *config_arguments(config), *monitor_arguments(settings)]
    return _start(
        "monitor",
        "monitor",
        arguments,
        log_path,
        _token_environment(config, hf_token),
        timeout,
        service_class=MonitorService,
    )


def start_volunteer_process(
    config: RunConfig,
    data_shards: str | None = None,
    max_epochs: int | None = None,
    wait_for_peers: int = 1,
    threads: int | None = None,
    hf_token: str | None = None,
    name: str = "volunteer",
    log_path: str | None = None,
    timeout: float = 180.0,
    save_checkpoint: str | None = None,
    wait: bool = True,
) -> Service:
    """Start a volunteer on this machine (``collab-kit join``) and wait until it is in the swarm.

    Its events (``service.events``) report each global epoch ("epoch") and the end of training ("done"):
    ``service.wait_for(lambda e: e["type"] == "done", timeout)``.

    :param config: the run's configuration with ``swarm.initial_peers`` (the monitor's addresses)
    :param data_shards: its parquet shards (default: ``config.data.shards``)
    :param max_epochs: stop when the swarm reaches this global epoch (default: the schedule's end)
    :param wait_for_peers: start training once this many peers (this one included) are ready
    :param threads: torch CPU threads (default: torch's choice)
    :param hf_token: its Hugging Face token in an authorized run (default: this user's login)
    :param name: its name in messages and in its log's name
    :param save_checkpoint: a folder where it saves the model when training ends (a checkpoint generate_images reads)
    :param wait: wait until it is in the swarm (False: return at once; ``service.wait_until_ready(timeout)`` later,
      so that several volunteers start together)
    :raises ServiceError: it did not join (the message says why)
    """
    arguments = ["join", *config_arguments(config), "--wait-for-peers", str(wait_for_peers), "--no-progress"]
    if config.swarm.client_mode:
        arguments.append("--client-mode")
    if data_shards:
        arguments += ["--data", data_shards]
    if max_epochs is not None:
        arguments += ["--max-epochs", str(max_epochs)]
    if threads is not None:
        arguments += ["--threads", str(threads)]
    if save_checkpoint:
        arguments += ["--save-checkpoint", save_checkpoint]
    return _start("volunteer", name, arguments, log_path, _token_environment(config, hf_token), timeout, wait=wait)
