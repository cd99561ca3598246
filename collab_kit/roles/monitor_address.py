"""Where the monitor can be dialled, kept across restarts: its peer identity and port, and its join addresses' file.

Every join line the monitor printed stays valid after a crash: the same key file (beside the database) and the same
port (noted in a file beside it) when it starts again with the same command.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket

import hivemind

from collab_kit.config import RunConfig
from collab_kit.roles.monitor_settings import MonitorSettings

logger = logging.getLogger(__name__)


def write_address_file(path: str, addresses: list[str]) -> None:
    """Write the join addresses, one a line, atomically (a reader never sees half a file)."""
    tmp_path = path + ".tmp"
    with open(tmp_path, "w") as f:
        f.write("\n".join(addresses) + "\n")
    os.replace(tmp_path, path)


def port_is_free(host: str, port: int) -> bool:
    """Whether this machine can listen on ``host``:``port`` now (a port left by a process that died is free)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def lasting_address(config: RunConfig, settings: MonitorSettings) -> RunConfig:
    """``config`` with the monitor's peer identity and port kept across restarts: its key file beside the database
    (created at the first start; unless swarm.identity_path names one) and the port it listened on last (unless --port
    names one, and while it is free). Every join line the monitor printed then stays valid after a crash.

    Shown by tests/roles/test_monitor.py::test_a_monitor_keeps_its_identity_and_port_beside_its_database and behind NAT
    by tests/netlab/test_network_lab.py::
    test_a_monitor_killed_and_started_again_with_the_same_command_loses_nothing.
    """
    swarm, changes = config.swarm, {}
    if swarm.identity_path is None and settings.identity_file:
        os.makedirs(os.path.dirname(os.path.abspath(settings.identity_file)), exist_ok=True)
        changes["identity_path"] = settings.identity_file
    if swarm.port == 0 and settings.port_file and os.path.isfile(settings.port_file):
        with open(settings.port_file) as f:
            noted = f.read().strip()
        if noted.isdigit() and port_is_free(swarm.listen_host, int(noted)):
            changes["port"] = int(noted)
        elif noted.isdigit():
            logger.warning(
                f"port {noted}, where this monitor listened before, is taken by another program: it listens "
                f"on another port, so the join lines it printed before no longer work (pass --port to "
                f"choose one)"
            )
    return dataclasses.replace(config, swarm=dataclasses.replace(swarm, **changes)) if changes else config


def note_port(path: str, dht: hivemind.DHT) -> None:
    """Write the TCP port ``dht`` listens on to ``path`` (atomically), for ``lasting_address`` after a restart."""
    ports = {
        address.split("/tcp/", 1)[1].split("/", 1)[0]
        for address in map(str, dht.get_visible_maddrs())
        if "/tcp/" in address
    }
    if len(ports) != 1:
        return  # announced addresses with ports of their own (a router's forward): nothing to note
    with open(path + ".tmp", "w") as f:
        f.write(ports.pop() + "\n")
    os.replace(path + ".tmp", path)
