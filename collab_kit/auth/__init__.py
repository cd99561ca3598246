"""Who may join a run: access tokens signed by the run's authentication server for members of a Hugging Face org.

- ``tokens``: the access token and the binding of a peer id to it: issue, sign, read, check (no network).
- ``client``: a volunteer's side: the Hugging Face login, asking the server for a token (``HubAuthorizer``, which
  hivemind's DHT carries on every message), refreshing it.
- ``server``: ``collab-kit auth-server``: checks a Hugging Face user token with the Hub, signs access tokens, keeps a
  ledger of joins (``ledger``), and stands up to slow and abusive clients (``guards``); ``server_settings``: what it is
  set to.

What peers do with their tokens in the swarm (bindings in the DHT, the averagers' gate) is collab_kit.swarm.bindings.
"""

from typing import TYPE_CHECKING

from collab_kit.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "tokens": ["issue_token", "token_problem", "binding_problem", "MalformedToken"],
        "client": ["login", "HubAuthorizer", "AuthorizationError", "request_access"],
        "server_settings": ["AuthServerSettings"],
        "ledger": ["JoinLedger"],
        "server": ["create_app", "serve"],
    },
)

if TYPE_CHECKING:  # editors and type checkers follow these; at run time each loads on first use
    from collab_kit.auth.client import AuthorizationError as AuthorizationError
    from collab_kit.auth.client import HubAuthorizer as HubAuthorizer
    from collab_kit.auth.client import login as login
    from collab_kit.auth.client import request_access as request_access
    from collab_kit.auth.ledger import JoinLedger as JoinLedger
    from collab_kit.auth.server import create_app as create_app
    from collab_kit.auth.server import serve as serve
    from collab_kit.auth.server_settings import AuthServerSettings as AuthServerSettings
    from collab_kit.auth.tokens import MalformedToken as MalformedToken
    from collab_kit.auth.tokens import binding_problem as binding_problem
    from collab_kit.auth.tokens import issue_token as issue_token
    from collab_kit.auth.tokens import token_problem as token_problem
