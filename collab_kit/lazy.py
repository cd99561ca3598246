"""Names a package offers at its top without importing the modules behind them until one is used.

The kit's subpackages re-export their public names, but importing a subpackage must stay cheap: a training peer that
reads shards should not wait for the VQGAN's libraries because ``collab_kit.data`` also offers ``preprocess``, and
``collab-kit --help`` should not wait for torch. Each ``__init__`` therefore lists what it offers and where it lives,
and :func:`lazy_exports` imports the module on the first use of one of its names.
"""

import importlib
import os
import sys
from collections.abc import Callable, Iterable


def lazy_exports(package: str, exports: dict[str, Iterable[str]]) -> tuple[Callable[[str], object], list[str]]:
    """A module ``__getattr__`` for ``package`` and the names for its ``__all__``.

    :param package: the package's ``__name__``
    :param exports: module path relative to ``package`` (``"shards"``, ``"widgets.dashboard"``) -> the names of it
      that the package offers; the name ``"*module*"`` offers the module itself, under its last component
    """
    where: dict[str, tuple[str, str]] = {}
    folder = os.path.dirname(sys.modules[package].__file__)
    for module, names in exports.items():
        for name in names:
            if name == "*module*":
                where[module.rsplit(".", 1)[-1]] = (module, "")
                continue
            # importing a submodule sets the package's attribute of that name to the module, over any name offered
            if os.path.exists(os.path.join(folder, f"{name}.py")) or os.path.isdir(os.path.join(folder, name)):
                raise ValueError(f"{package} cannot offer {name!r} from {module!r}: a submodule has that name")
            where[name] = (module, name)

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module_path, attribute = where[name]
        module = importlib.import_module(f"{package}.{module_path}")
        value = getattr(module, attribute) if attribute else module
        setattr(sys.modules[package], name, value)  # found directly from now on
        return value

    return __getattr__, sorted(where)
