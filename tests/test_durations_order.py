"""The long-tests-first order (tests/support/durations.py): what CI's scheduler is handed."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.durations import from_junit, load, order_longest_first, worksteal_slices


def test_without_xdist_the_long_tests_go_first_longest_first_and_the_rest_keep_their_order() -> None:
    items = ["a", "b", "long30", "c", "long50", "short"]
    seconds = {"long30": 30.0, "long50": 50.0, "short": 1.0}
    assert order_longest_first(items, seconds, str) == ["long50", "long30", "a", "b", "c", "short"]


def test_no_known_long_test_leaves_the_order_alone() -> None:
    items = ["c", "a", "b"]
    assert order_longest_first(items, {}, str, workers=4, dist="worksteal") == items


def test_worksteal_slices_match_what_xdist_hands_each_worker() -> None:
    assert worksteal_slices(10, 4) == [2, 2, 3, 3]
    assert sum(worksteal_slices(1308, 4)) == 1308


def test_under_worksteal_each_worker_slice_starts_with_its_share_of_the_long_tests() -> None:
    rest = [f"t{i}" for i in range(30)]
    long = {f"L{i}": s for i, s in enumerate([58.0, 50.0, 46.0, 40.0, 35.0, 33.0, 30.0, 27.0])}
    items = rest[:10] + list(long) + rest[10:]
    ordered = order_longest_first(items, long, str, workers=4, dist="worksteal")
    assert sorted(ordered) == sorted(items)
    start = 0
    loads = []
    for size in worksteal_slices(len(items), 4):
        chunk = ordered[start:start + size]
        start += size
        heads = [i for i in chunk if i in long]
        # The slice's long tests come first (longest first), its short ones after them.
        assert chunk[:len(heads)] == heads and heads == sorted(heads, key=lambda i: -long[i])
        loads.append(sum(long[i] for i in heads))
    assert loads == [58.0 + 27.0, 50.0 + 30.0, 46.0 + 33.0, 40.0 + 35.0]
    # The short tests keep their random order across the slices.
    assert [i for i in ordered if i not in long] == rest


def test_more_long_tests_than_a_slice_holds_still_places_every_test() -> None:
    long = {f"L{i}": 10.0 + i for i in range(7)}
    ordered = order_longest_first([*long, "x"], long, str, workers=4, dist="worksteal")
    assert sorted(ordered) == sorted([*long, "x"])


def test_the_helper_reads_junit_reports_into_node_ids(tmp_path: Path) -> None:
    report = tmp_path / "junit-postgres-default.xml"
    report.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.faults.test_fault_harness" name="test_fault_harness[3]" time="51.2"/>'
        '<testcase classname="tests.test_cli" name="test_quick" time="0.4"/>'
        '</testsuite></testsuites>', encoding="utf-8")
    found = from_junit([report])
    assert found == {"sqlite": {}, "postgres": {"tests/faults/test_fault_harness.py::test_fault_harness[3]": 51.2}}
    (tmp_path / "d.json").write_text(json.dumps(found), encoding="utf-8")
    assert load("postgres", tmp_path / "d.json") == found["postgres"]


def test_the_checked_in_file_names_only_tests_that_exist() -> None:
    root = Path(__file__).resolve().parent.parent
    for backend in ("sqlite", "postgres"):
        for nodeid in load(backend):
            path, _, name = nodeid.partition("::")
            assert (root / path).is_file(), nodeid
            assert f"def {name.split('[')[0].split('::')[-1]}(" in (root / path).read_text(encoding="utf-8"), nodeid
