"""collab_kit.hivemind_seam: the list of private hivemind names the kit touches is checked against the code both
ways, and another hivemind version is refused at import with one sentence."""

import ast
import importlib
import inspect
import os
import pathlib
import pkgutil
import subprocess
import sys
import typing

import hivemind
import pytest
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p.servicer import ServicerBase

import collab_kit
from collab_kit.hivemind_seam import ANY_HIVEMIND_VARIABLE, SEAM, TESTED_HIVEMIND

PACKAGE = pathlib.Path(collab_kit.__file__).parent
HIVEMIND = pathlib.Path(hivemind.__file__).parent
# the kit's own private names that hivemind happens to use too (a thread's target, a lock, ...): not the seam
KIT_OWN = {"_lock", "_run", "_namespace", "_result", "_stub", "_unpack"}
LISTED = {entry.name for entry in SEAM}
IMPORT = "import collab_kit; print('imported')"
SENTENCE = (
    f"collab_kit works with hivemind {TESTED_HIVEMIND} only and this Python has hivemind 1.2.0: run "
    f"`pip install hivemind=={TESTED_HIVEMIND}` in it, or set {ANY_HIVEMIND_VARIABLE}=1 to try yours at your "
    f"own risk."
)


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def names_defined(tree: ast.AST) -> set:
    """Private names a source defines: functions, classes, attributes and module-level variables assigned."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            found.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
    return {name for name in found if private(name)}


def sources(root: pathlib.Path):
    for path in sorted(root.rglob("*.py")):
        yield path, ast.parse(path.read_text())


def kit_modules():
    for info in pkgutil.walk_packages([str(PACKAGE)], "collab_kit."):
        if not info.name.endswith("__main__"):  # the command line parses its arguments when imported
            yield importlib.import_module(info.name)


def test_every_private_hivemind_name_the_kit_uses_is_listed():
    hivemind_names = set().union(*(names_defined(tree) for _, tree in sources(HIVEMIND)))
    used = {}
    for path, tree in sources(PACKAGE):
        for node in ast.walk(tree):
            name = (
                node.attr
                if isinstance(node, ast.Attribute)
                else node.name
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                else None
            )
            if name in hivemind_names and name not in KIT_OWN:
                used.setdefault(name, set()).add(str(path.relative_to(PACKAGE.parent)))
    unlisted = {name: sorted(paths) for name, paths in used.items() if name not in LISTED}
    assert not unlisted, f"private hivemind names used but not in collab_kit.hivemind_seam.SEAM: {unlisted}"


def test_every_private_hivemind_name_a_kit_class_overrides_is_listed():
    """Classes built on hivemind's and the mixins put in front of them (collab_kit.swarm.averagers.compose_averager)
    are read as Python has them, which also finds what a class body sets through a namespace dict."""
    hivemind_methods = {}
    for info in pkgutil.walk_packages(hivemind.__path__, "hivemind."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional part (the Mixture-of-Experts server's extras)
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            hivemind_methods.update((name, cls) for name in vars(cls) if private(name))
    overridden = set()
    for module in kit_modules():
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if not cls.__module__.startswith("collab_kit"):
                continue
            bases = [base for base in cls.__mro__ if base.__module__.startswith("hivemind")]
            if bases or cls.__name__.endswith("Mixin"):
                overridden |= {
                    (name, cls.__qualname__)
                    for name in vars(cls)
                    if private(name)
                    and name not in KIT_OWN
                    and not name.startswith("_abc")
                    and (any(name in vars(base) for base in bases) or name in hivemind_methods)
                }
    unlisted = sorted((name, where) for name, where in overridden if name not in LISTED)
    assert not unlisted, f"private hivemind names overridden but not in collab_kit.hivemind_seam.SEAM: {unlisted}"


@pytest.mark.parametrize("entry", SEAM, ids=[entry.name for entry in SEAM])
def test_each_listed_name_is_still_in_hivemind_and_in_the_kit_modules_it_names(entry):
    module_name, _, class_name = entry.owner.rpartition(".")
    try:
        owner = getattr(importlib.import_module(module_name), class_name)
    except ImportError:  # the owner is a module
        owner = importlib.import_module(entry.owner)
    assert entry.name in inspect.getsource(owner), f"hivemind {TESTED_HIVEMIND}'s {entry.owner} has no {entry.name}"
    assert entry.how in ("overrides", "copies", "calls", "reads", "replaces"), entry
    for where in entry.where:
        source = inspect.getsource(importlib.import_module(where))
        assert entry.name in source, f"{where} no longer touches {entry.name}: update collab_kit.hivemind_seam"


def import_with_hivemind_version(tmp_path, version: str, command=(sys.executable, "-c", IMPORT), **env):
    """Run ``command`` (``import collab_kit`` in a fresh interpreter) where hivemind ``version``'s metadata is found
    first; returns the subprocess.CompletedProcess."""
    info = tmp_path / f"hivemind-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: hivemind\nVersion: {version}\n")
    environment = {key: value for key, value in os.environ.items() if key != ANY_HIVEMIND_VARIABLE}
    environment.update(PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]), **env)
    return subprocess.run(list(command), capture_output=True, text=True, env=environment, timeout=120)


def test_another_hivemind_version_is_refused_with_one_sentence(tmp_path):
    result = import_with_hivemind_version(tmp_path, "1.2.0")
    assert result.returncode == 1 and "imported" not in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"collab_kit.hivemind_seam.HivemindVersionError: {SENTENCE}", last


def test_the_command_line_says_the_sentence_alone(tmp_path):
    command = os.path.join(os.path.dirname(sys.executable), "collab-kit")
    result = import_with_hivemind_version(tmp_path, "1.2.0", command=(command, "--help"))
    assert result.returncode == 1 and not result.stdout
    assert result.stderr.splitlines() == [f"collab-kit: {SENTENCE}"], result.stderr[-2000:]


def test_the_user_may_try_another_hivemind_version_at_their_own_risk(tmp_path):
    result = import_with_hivemind_version(tmp_path, "1.2.0", **{ANY_HIVEMIND_VARIABLE: "1"})
    assert result.returncode == 0 and result.stdout.strip() == "imported", result.stderr[-2000:]


def stream_kind(function) -> tuple:
    """(streamed request, streamed answer) as hivemind's servicer reads an ``rpc_`` handler's type hints."""
    hints = typing.get_type_hints(function)
    request = inspect.getfullargspec(function).args[1]
    return tuple(ServicerBase._strip_iterator_hint(hints[name])[1] for name in (request, "return"))


def test_the_kits_rpc_handlers_stream_where_hiveminds_do():
    # hivemind knows a stream only by typing.AsyncIterator (collections.abc's is read as one message): a handler
    # hinted otherwise answers every peer with "Invalid Protobuf message type"
    hivemind_handlers = {
        name: function for name, function in inspect.getmembers(DecentralizedAverager) if name.startswith("rpc_")
    }
    checked = 0
    for module in pkgutil.iter_modules([str(PACKAGE / "swarm")]):
        for _, cls in inspect.getmembers(importlib.import_module(f"collab_kit.swarm.{module.name}"), inspect.isclass):
            for name, function in vars(cls).items():
                if name in hivemind_handlers and cls.__module__.startswith("collab_kit"):
                    assert stream_kind(function) == stream_kind(hivemind_handlers[name]), f"{cls.__name__}.{name}"
                    checked += 1
    assert checked >= 8
