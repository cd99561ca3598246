"""The documentation: the README stays a front page, every ``collab_kit.`` name, file and test that it, docs/ and the
docstrings give still exists, and the site (mkdocs.yml) builds with no warning."""

import ast
import importlib
import json
import pathlib
import re
import subprocess
import sys
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAME = re.compile(r"(?<![\w/.])collab_kit(?:\.[A-Za-z_][A-Za-z0-9_]*)+(?![\w/])")
MAX_README_LINES, MAX_WORDS = 200, 25
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def long_sentences(markdown: str) -> list[str]:
    """Prose sentences of more than MAX_WORDS words, outside code blocks, headings and tables."""
    paragraphs, current, in_code = [], [], False
    for line in markdown.splitlines() + [""]:
        stripped = line.strip()
        if stripped.startswith("```"):
            in_code = not in_code
            continue
        item = re.match(r"([-*]|\d+\.)\s+", stripped)
        if in_code or not stripped or stripped.startswith(("#", "|")) or item:
            paragraphs.append(" ".join(current))
            current = [stripped[item.end() :]] if item and not in_code else []
        else:
            current.append(stripped)
    sentences = [s for p in paragraphs for s in re.split(r"(?<=[.?!])\s+", p)]
    return [s for s in sentences if len(s.split()) > MAX_WORDS]


def test_the_readme_is_a_front_page_of_short_sentences():
    assert long_sentences("Short one. " + "word " * 26 + "end.\n\n- a list item\n") == ["word " * 26 + "end."]
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= MAX_README_LINES, "move the details into docs/"
    assert long_sentences(readme) == [], f"split these into sentences of {MAX_WORDS} words or fewer"


def names_in(text: str, where: str) -> list[tuple[str, str]]:
    """The dotted names in ``text``, file names left out (``collab_kit/x.py``, ``collab_kit.x.py``)."""
    return [(m.group(0), where) for m in NAME.finditer(text) if not m.group(0).endswith((".py", ".md"))]


def documented_names() -> list[tuple[str, str]]:
    found = names_in((ROOT / "README.md").read_text(), "README.md")
    for page in sorted((ROOT / "docs").rglob("*.md")):
        found += names_in(page.read_text(), str(page.relative_to(ROOT)))
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        found += names_in(text, str(notebook.relative_to(ROOT)))
    for module in sorted((ROOT / "collab_kit").rglob("*.py")):
        where, source = str(module.relative_to(ROOT)), module.read_text()
        docs = [ast.get_docstring(n, clean=False) for n in ast.walk(ast.parse(source)) if isinstance(n, DOCUMENTED)]
        with module.open("rb") as f:
            comments = [t.string for t in tokenize.tokenize(f.readline) if t.type == tokenize.COMMENT]
        found += names_in("\n".join(filter(None, docs + comments)), where)
    return found


def resolves(name: str) -> bool:
    """Import the longest importable module prefix of ``name``, then look up the rest as attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                found = getattr(found, attribute)
        except AttributeError:
            return False
        return True
    return False


def test_every_collab_kit_name_in_the_docs_docstrings_and_notebooks_resolves():
    assert not resolves("collab_kit.no_such_module.thing") and resolves("collab_kit.roles.volunteer.Volunteer.train")
    assert [n for n, _ in names_in("`collab_kit/swarm/optimizer.py`, collab_kit.config.py, a/collab_kit.x", "")] == []
    found = documented_names()
    assert len({name for name, _ in found}) > 50, "the scan found too few names: is the pattern still right?"
    unresolved = sorted({(where, name) for name, where in found if not resolves(name)})
    assert unresolved == [], "names that no longer exist:\n" + "\n".join(f"{w}: {n}" for w, n in unresolved)


def test_the_site_builds_strictly(tmp_path):
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    result = subprocess.run(build, cwd=ROOT, capture_output=True, text=True, timeout=600)
    output = (result.stdout + result.stderr).splitlines()
    assert result.returncode == 0, "\n".join(output[-40:])
    assert not [line for line in output if line.startswith("WARNING")], "\n".join(output[-40:])


# a repository path as the docs and docstrings write it, and the test it may name (`path.py::test_name`, the name
# possibly on the next line of a docstring)
PATH = re.compile(r"(?<![\w/.-])((?:collab_kit|tests|benchmarks|notebooks|docs)/[\w/.-]*\w)(?:::\s*(\w+))?")


def missing_paths(text: str) -> list[str]:
    """The paths (and ``path::test`` names) in ``text`` that the repository does not have."""
    missing = []
    for match in PATH.finditer(text):
        path, test = ROOT / match.group(1), match.group(2)
        if text[match.end(1) : match.end(1) + 1] == "*":  # a glob: `tests/notebooks/test_notebook_*.py`
            continue
        if not path.exists():
            missing.append(match.group(1))
        elif test and path.suffix == ".py" and not re.search(rf"\bdef {test}\b", path.read_text()):
            missing.append(f"{match.group(1)}::{test}")
    return missing


def test_every_file_and_test_the_docs_and_docstrings_name_exists():
    assert missing_paths("see tests/test_docs.py::no_such_test, docs/gone.md and tests/test_*.py") == [
        "tests/test_docs.py::no_such_test",
        "docs/gone.md",
    ]
    sources = [ROOT / "README.md", ROOT / "notebooks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    sources += sorted((ROOT / "collab_kit").rglob("*.py"))
    missing = {f"{path.relative_to(ROOT)}: {name}" for path in sources for name in missing_paths(path.read_text())}
    assert sorted(missing) == [], "moved or gone:\n" + "\n".join(sorted(missing))


def test_the_readmes_module_map_names_every_subpackage():
    readme = (ROOT / "README.md").read_text()
    assert "\n## How it fits together\n" in readme, "the README's module map is gone"
    section = readme.split("\n## How it fits together\n", 1)[1].split("\n## ", 1)[0]
    subpackages = sorted(path.parent.name for path in (ROOT / "collab_kit").glob("*/__init__.py"))
    missing = [name for name in subpackages if f"{name}/" not in section]
    assert len(subpackages) >= 10 and missing == [], f"the module map does not name {missing}"
