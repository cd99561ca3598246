"""The kit's base error: a problem the user can fix, whose message says what to do.

Every error the kit raises for bad input, a missing file, an unreachable swarm or a refused token derives from
:class:`CollabKitError`, beside the built-in type callers already catch (``ValueError``, ``RuntimeError``, ...).
The command line prints such an error as one line without a traceback; anything else is a bug, shown in full.
"""


class CollabKitError(Exception):
    """A problem the user can fix: the message names the setting, file or command to change.

    A notebook shows it as that one sentence, not as a traceback (IPython prints what ``_render_traceback_`` gives
    instead of the stack), and the notebook stops there as at any error.
    """

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]
