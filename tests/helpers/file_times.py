"""Where the suite's time goes: wall time against CPU time, per test file (tests/README.md's table); and the order
the files run in, longest first.

    python -m pytest --file-times=times.json        # then: python tests/helpers/file_times.py times.json
    python tests/helpers/file_times.py times.json --weights tests/helpers/file_weights.json    # keep a run's file
    times for the order

A test's wall time is its setup, call and teardown; its CPU time is that of the process that ran it and of the
children it waited for (the peers, kernels and services it started), from ``resource.getrusage``: a file whose CPU
time is far below its wall time mostly waits. Under pytest-xdist the workers measure and the controller writes.
"""

import json
import os
import resource
import sys
from collections import defaultdict

import pytest


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_addoption(parser):
    parser.addoption(
        "--file-times",
        metavar="PATH",
        help="write each test's wall and CPU seconds to PATH (JSON) and print the slowest files",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[CPU_AT_START] = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown" and CPU_AT_START in item.stash:
        # the report travels from an xdist worker to the controller with its user properties
        report.user_properties.append(("cpu_seconds", _cpu_seconds() - item.stash[CPU_AT_START]))


class FileTimes:
    """Collects the reports (in the controller under xdist) and writes them at the end."""

    def __init__(self, path: str):
        self.path, self.rows = path, {}

    def pytest_runtest_logreport(self, report):
        row = self.rows.setdefault(
            report.nodeid, dict(test=report.nodeid, file=report.nodeid.split("::")[0], wall=0.0, cpu=0.0)
        )
        row["wall"] += report.duration
        row["cpu"] += dict(report.user_properties).get("cpu_seconds", 0.0)

    def pytest_terminal_summary(self, terminalreporter):
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump(list(self.rows.values()), f)
        terminalreporter.write_sep("=", "where the time went (wall and CPU per file; --file-times)")
        terminalreporter.write_line(table(self.path, top=12))


CPU_AT_START = pytest.StashKey[float]()


WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_weights.json")


def file_weights(path: str = WEIGHTS) -> dict:
    """Each test file's wall seconds in a measured run (``--weights`` writes them), for the order files run in."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def pytest_collection_modifyitems(session, config, items):
    """Run the files that took longest first, the rest in their own order after them: the workers of ``make test``
    (which keeps this order, ``--no-loadscope-reorder``) then end together, with no long file left to one of them at
    the end. Every worker sorts the same collection with the same weights, as xdist requires."""
    weights = file_weights()
    position = {item: index for index, item in enumerate(items)}
    items.sort(key=lambda item: (-weights.get(item.nodeid.split("::")[0], 0.0), position[item]))


def pytest_configure(config):
    path = config.getoption("--file-times", default=None)
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(FileTimes(os.path.abspath(path)), "collab_kit_file_times")


def table(path: str, top: int = 25) -> str:
    """The files that took longest, as a markdown table: tests, wall and CPU minutes, CPU / wall."""
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)
    files = defaultdict(lambda: [0, 0.0, 0.0])
    for row in rows:
        entry = files[row["file"]]
        entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + row["wall"], entry[2] + row["cpu"]
    lines = ["| file | tests | wall (s) | CPU (s) | CPU / wall |", "| --- | ---: | ---: | ---: | ---: |"]
    ordered = sorted(files.items(), key=lambda item: -item[1][1])
    for name, (count, wall, cpu) in ordered[:top]:
        lines.append(f"| `{name}` | {count} | {wall:.0f} | {cpu:.0f} | {cpu / max(wall, 1e-9):.2f} |")
    rest = ordered[top:]
    if rest:
        lines.append(
            f"| {len(rest)} other files | {sum(v[0] for _, v in rest)} | {sum(v[1] for _, v in rest):.0f} "
            f"| {sum(v[2] for _, v in rest):.0f} | |"
        )
    total_wall, total_cpu = sum(v[1] for v in files.values()), sum(v[2] for v in files.values())
    lines.append(
        f"| all | {len(rows)} | {total_wall:.0f} | {total_cpu:.0f} | {total_cpu / max(total_wall, 1e-9):.2f} |"
    )
    return "\n".join(lines)


def write_weights(times_path: str, weights_path: str) -> None:
    """Keep each file's wall seconds of the run in ``times_path`` (``--file-times``) as the order's weights."""
    with open(times_path, encoding="utf-8") as f:
        rows = json.load(f)
    walls = defaultdict(float)
    for row in rows:
        walls[row["file"]] += row["wall"]
    with open(weights_path, "w", encoding="utf-8") as f:
        json.dump({name: round(wall) for name, wall in sorted(walls.items(), key=lambda item: -item[1])}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[2] == "--weights":
        write_weights(sys.argv[1], sys.argv[3])
    else:
        print(table(sys.argv[1]))
