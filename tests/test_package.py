"""The package's shape: every subpackage imports alone, importing the kit leaves the user's process as it was, lazy
imports say why, modules stay readable, and the layers hold (``lint-imports``, which ``make test`` runs first)."""

import ast
import importlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

import collab_kit

PACKAGE = pathlib.Path(collab_kit.__file__).parent
SUBPACKAGES = sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py"))
TOP_MODULES = sorted(path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__")


def python(code: str, timeout: float = 180) -> str:
    """Run ``code`` in a fresh interpreter (nothing imported yet) and return what it printed."""
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONWARNINGS="default"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_the_tree_has_the_concepts_the_readme_names():
    assert SUBPACKAGES == [
        "auth",
        "cli",
        "data",
        "images",
        "memory",
        "model",
        "roles",
        "swarm",
        "toy",
        "tutorial",
        "widgets",
    ]
    for name in SUBPACKAGES:
        docstring = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
        assert docstring, f"collab_kit/{name}/__init__.py says nothing of its files"
        modules = [path.stem for path in (PACKAGE / name).glob("*.py") if not path.stem.startswith("__")]
        missing = [module for module in modules if f"``{module}``" not in docstring]
        assert not missing, f"collab_kit/{name}/__init__.py does not say what {missing} do"


@pytest.mark.parametrize("name", SUBPACKAGES + TOP_MODULES)
def test_each_part_imports_alone_and_offers_what_it_lists(name):
    # a fresh interpreter: an import cycle or a name listed but not defined shows here, whatever was imported before
    out = python(
        f"import importlib, json\n"
        f"module = importlib.import_module('collab_kit.{name}')\n"
        f"offered = getattr(module, '__all__', [])\n"
        f"print(json.dumps([n for n in offered if getattr(module, n, None) is None]))"
    )
    assert json.loads(out.splitlines()[-1]) == []


def test_a_preset_is_built_without_torch_or_hivemind():
    out = python(
        "import sys, collab_kit\n"
        "config = collab_kit.get_preset('tiny', optimizer=dict(target_batch_size=64))\n"
        "print(config.optimizer.target_batch_size, 'hivemind' in sys.modules, 'torch' in sys.modules)"
    )
    assert out.split() == ["64", "False", "False"]


def test_the_command_line_answers_help_without_torch_or_hivemind():
    out = python(
        "import contextlib, io, sys\n"
        "from collab_kit.cli import make_parser\n"
        "with contextlib.redirect_stdout(io.StringIO()) as text, contextlib.suppress(SystemExit):\n"
        "    make_parser().parse_args(['join', '--help'])\n"
        "print('--initial-peers' in text.getvalue(), 'hivemind' in sys.modules, 'torch' in sys.modules)"
    )
    assert out.split() == ["True", "False", "False"]


def third_party_modules() -> list:
    """Every module outside the kit and the standard library that the kit imports (at the top or in a function)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
    return sorted(name for name in names if name.split(".")[0] not in sys.stdlib_module_names | {"collab_kit"})


def test_importing_every_module_changes_no_filter_and_no_random_state_of_the_process():
    # the libraries first: what their own imports set up (urllib3's warnings filters, hivemind's loggers) is not the
    # kit's doing; then every module of the kit, which must leave the process as it found it
    code = f"""
import contextlib, importlib, logging, pkgutil, random, sys, warnings
for name in {third_party_modules()!r}:
    with contextlib.suppress(ImportError):  # optional ones (wandb) may be missing
        importlib.import_module(name)
import numpy, torch
def state():
    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)]
    filters = {{logger.name: len(logger.filters) for logger in loggers if isinstance(logger, logging.Logger)}}
    return (list(warnings.filters), filters, torch.get_rng_state().sum().item(), int(numpy.random.get_state()[1].sum()),
            random.getstate()[1][:4])
before = state()
import collab_kit
for info in pkgutil.walk_packages(collab_kit.__path__, "collab_kit."):
    if not info.name.endswith("__main__"):
        importlib.import_module(info.name)
after = state()
new_loggers = set(after[1]) - set(before[1])
print(before[0] == after[0], all(after[1][name] == count for name, count in before[1].items()),
      all(after[1][name] == 0 for name in new_loggers), before[2:] == after[2:])
"""
    assert python(code).split() == ["True", "True", "True", "True"]


def test_the_initial_model_leaves_the_callers_random_state_as_it_was():
    import torch

    from collab_kit.config import get_preset
    from collab_kit.model.transformer import initial_model

    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    first = initial_model(get_preset("tiny").model, "run")
    assert torch.equal(torch.rand(3), expected)
    second = initial_model(get_preset("tiny").model, "run")
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))  # every peer's start


def in_function_imports_without_a_reason(path: pathlib.Path):
    """Imports inside functions with no comment on their line or just above their block of imports."""
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines))
    import_lines = {
        n
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for n in range(node.lineno, node.end_lineno + 1)
    }
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or "#" in lines[node.lineno - 1]:
                continue
            above = node.lineno - 1
            while above >= 1 and (above in import_lines or not lines[above - 1].strip()):
                above -= 1
            if not (above >= 1 and lines[above - 1].strip().startswith("#")):
                found.append(f"{path.name}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return sorted(set(found))


def test_every_import_inside_a_function_says_why_it_waits(tmp_path):
    found = [line for path in sorted(PACKAGE.rglob("*.py")) for line in in_function_imports_without_a_reason(path)]
    assert found == [], "an import inside a function, without a comment saying why it is not at the top:\n" + "\n".join(
        found
    )
    sample = tmp_path / "sample.py"  # the check finds one where there is one
    sample.write_text(
        "def f():\n    import json\n\n    return json\n\n\ndef g():\n    # lazy: slow\n    import csv\n\n"
        "    import json\n    return json, csv\n"
    )
    assert in_function_imports_without_a_reason(sample) == ["sample.py:2: import json"]


# 700 lines as ruff formats them: it gives each argument of a call too long for one line a line of its own, which
# made the kit's modules of at most 500 lines up to 698
def test_no_module_is_over_700_lines():
    long = {
        str(path.relative_to(PACKAGE.parent)): count
        for path in PACKAGE.rglob("*.py")
        if (count := len(path.read_text().splitlines())) > 700
    }
    assert long == {}, f"split these where they hold several concepts: {long}"


def test_the_names_the_readme_notebooks_and_benchmarks_import_from_the_top_still_come():
    root = PACKAGE.parent
    texts = [(root / "README.md").read_text()]
    texts += [path.read_text() for path in (root / "notebooks").glob("*.ipynb")]
    texts += [path.read_text() for path in (root / "benchmarks").glob("*.py")]
    names = set()
    for text in texts:
        for line in text.replace("\\n", "\n").splitlines():
            line = line.strip().strip('",')
            if line.startswith("from collab_kit import "):
                names.update(name.strip(" ()") for name in line[len("from collab_kit import ") :].split(","))
            names.update(
                part.split(".")[1].split("(")[0]
                for part in line.split()
                if part.startswith("collab_kit.") and part.split(".")[1][:1].isalpha()
            )
    names = sorted(name for name in names if name and name.isidentifier())
    assert {"Volunteer", "get_preset", "memory", "dashboard", "services", "generate_images"} <= set(names)
    out = python(
        f"import collab_kit, importlib\nmissing = []\n"
        f"for name in {names!r}:\n"
        f"    try:\n"
        f"        getattr(collab_kit, name)\n"
        f"    except AttributeError:\n"
        f"        try:\n"
        f"            importlib.import_module('collab_kit.' + name)\n"
        f"        except ImportError:\n"
        f"            missing.append(name)\n"
        f"print(missing)"
    )
    assert out.strip() == "[]"


def type_checking_names(init: pathlib.Path) -> set:
    """The names an ``__init__`` imports under ``if TYPE_CHECKING:`` (what an editor's "go to definition" follows)."""
    names = set()
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            names.update(alias.asname or alias.name for child in node.body for alias in child.names)
    return names


@pytest.mark.parametrize("init", sorted(PACKAGE.rglob("__init__.py")), ids=lambda path: path.parent.name)
def test_every_lazy_name_has_a_typed_import_an_editor_follows(init):
    module = importlib.import_module(".".join(init.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]))
    bound = set()  # what the __init__ defines itself, outside TYPE_CHECKING
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Assign):
            bound.update(target.id for target in node.targets if isinstance(target, ast.Name))
    lazy = set(module.__all__) - bound
    assert lazy == type_checking_names(init), f"{init}: the TYPE_CHECKING imports and the lazy exports differ"
