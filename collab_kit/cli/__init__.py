"""``collab-kit``: the command line, one module per command.

- ``app``: the parser (each command module adds its own subcommand) and ``main``, the console script.
- ``common``: the run configuration from ``--preset`` / ``--set`` / the swarm options, clean stops on signals, and
  ``CommandError``.
- ``demo``, ``join``, ``monitor``, ``anchor``, ``reachability``, ``dashboard``, ``auth_server``, ``model_info``,
  ``preprocess``, ``toy``: one command each, ``register(commands)`` and ``run(args)``.
"""

from collab_kit.cli.app import main, make_parser
from collab_kit.cli.common import CommandError, build_config

__all__ = ["main", "make_parser", "build_config", "CommandError"]
