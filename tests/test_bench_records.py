"""How benchmarks/RESULTS.md takes new figures: a whole benchmark's run replaces its rows from this machine; a run of
some of its parts (``--only``) replaces only the figures it measured."""

from benchmarks import common


def row(benchmark, name, machine=None, value=1.0):
    made = common.make_row(benchmark, name, value, ">= 0", str(value), "")
    if machine is not None:
        made["machine"] = machine
    return made


def test_a_partial_run_replaces_only_the_figures_it_measured_and_a_whole_run_all_of_its_own():
    old = [
        row("local_updates", "toy figure", value=1.0),
        row("local_updates", "small figure", value=1.0),
        row("local_updates", "small figure", machine="an H200", value=3.0),
        row("four_bit", "bytes", value=1.0),
    ]
    new = [row("local_updates", "small figure", value=2.0)]
    known = ["local_updates", "four_bit"]
    partial = common.merge_rows(old, new, ["local_updates"], known, partial=True)
    assert sorted((r["name"], r["machine"] == "an H200", r["value"]) for r in partial) == [
        ("bytes", False, 1.0),
        ("small figure", False, 2.0),
        ("small figure", True, 3.0),
        ("toy figure", False, 1.0),
    ]
    whole = common.merge_rows(old, new, ["local_updates"], known)
    assert sorted((r["name"], r["value"]) for r in whole) == [
        ("bytes", 1.0),
        ("small figure", 2.0),
        ("small figure", 3.0),
    ]
