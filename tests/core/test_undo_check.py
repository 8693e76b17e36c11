"""check_undo (undolog_core.testing): correct compensations pass; each kind of broken one is caught on its own step."""

from __future__ import annotations

import asyncio

import pytest

from undolog_core.testing import RunKind, ScenarioError, check_undo

# The plugin's fixture, imported the way pytest's `pytest11` entry point would load it (the shared venv is not
# reinstalled with the new entry point; test_plugin_entry_point checks the entry point itself).
from undolog_core.testing.pytest_plugin import undo_check  # noqa: F401

from ..support import undo_world as w
from ..support.undo_world import (
    aadd_credit,
    add_bonus,
    add_credit,
    change_email,
    close_account,
    send_note,
    update_profile,
)


@pytest.fixture(autouse=True)
def world_file(tmp_path, monkeypatch):
    monkeypatch.setenv("UNDO_WORLD", str(tmp_path / "world.json"))
    w.reset()
    from undolog_core._saga import Saga

    monkeypatch.setattr(Saga, "backoff_seconds", 0.001)  # a broken compensation's retries, quickly


def check(scenario, undolog, **kw):
    w.register(undolog)
    return check_undo(scenario, snapshot=w.snapshot, reset=w.reset, undolog=undolog, **kw)


def test_correct_scenario_every_step_restored_idempotent_and_tolerant(undolog):
    report = check(w.correct_scenario, undolog)
    assert report.ok, report.explain()
    assert [(s.index, s.tool, s.compensation) for s in report.steps] == [
        (1, "change_email", "restore_email"), (2, "add_credit", "remove_credit"), (3, "change_email", "restore_email"),
    ]
    assert all(s.restored and s.idempotent and s.tolerates_never_happened for s in report.steps)
    assert all(report.fault_points[k].restored for k in (1, 2, 3))
    assert report.runs == 1 + 3 + 3
    assert w.snapshot() == w.START["accounts"]  # the harness leaves the world at its starting point
    # Each run used its own session; the harness's sessions are rolled back or halted, none left writable.
    sessions = undolog.sessions.list(limit=50)
    assert len(sessions) == 7 and len({s.session_id for s in sessions}) == 7
    assert {s.state for s in sessions} <= {"rolled_back", "halted"}
    text = report.explain()
    for head in ("step", "tool", "compensation", "restored", "idempotent", "never-happened"):
        assert head in text
    assert "OK: 3 step(s)" in text


def test_a_compensation_that_forgets_a_field_is_pinned_on_its_step_and_the_diff_names_the_field(undolog):
    def scenario(ul, run):
        with ul.session(session_id=f"p-{run.id}") as s:
            s.call_sync(change_email, user_id="u1", email="ana@new.example")
            s.call_sync(update_profile, user_id="u2", email="b@x.example", name="Robert")
            s.call_sync(add_credit, user_id="u1", amount=3)

    report = check(scenario, undolog)
    assert not report.ok
    first, broken, last = report.steps
    assert first.restored and last.restored  # pinned on its own step, not on the steps around it
    assert broken.restored is False and broken.tool == "update_profile"
    assert [(d.path, d.expected, d.actual) for d in broken.diff] == [("['u2']['name']", "Bo", "Robert")]
    assert report.fault_points[1].restored and not report.fault_points[2].restored
    assert "['u2']['name']: expected 'Bo', got 'Robert'" in report.explain()
    assert "NO" in report.explain()


def test_a_non_idempotent_compensation_decrements_the_counter_twice(undolog):
    def scenario(ul, run):
        with ul.session(session_id=f"b-{run.id}") as s:
            s.call_sync(add_bonus, user_id="u1", amount=4)

    report = check(scenario, undolog)
    (step,) = report.steps
    assert step.restored and step.tolerates_never_happened
    assert step.idempotent is False
    assert [(d.path, d.expected, d.actual) for d in step.idempotency_diff] == [("['u1']['credit']", 10, 6)]
    assert not report.ok


def test_a_compensation_raising_on_never_happened(undolog):
    def scenario(ul, run):
        with ul.session(session_id=f"n-{run.id}") as s:
            s.call_sync(send_note, user_id="u1", text="hello")

    report = check(scenario, undolog)
    (step,) = report.steps
    assert step.restored is True  # with a result to work from, it does undo the note
    assert step.tolerates_never_happened is False
    assert any("never happened" in e and "TypeError" in e for e in step.errors), step.errors
    assert not report.ok


async def test_async_tools_and_compensations_in_an_async_scenario(undolog):
    async def scenario(ul, run):
        async with ul.session(session_id=f"a-{run.id}") as s:
            await s.call(aadd_credit, user_id="u1", amount=2)
            await asyncio.sleep(0)
            await s.call(aadd_credit, user_id="u2", amount=7)

    # check_undo is sync; called from this running loop, it runs the scenario on a loop of its own.
    report = check(scenario, undolog)
    assert report.ok, report.explain()
    assert [s.tool for s in report.steps] == ["aadd_credit", "aadd_credit"]


def test_an_irreversible_call_ends_the_checked_part(undolog):
    def scenario(ul, run):
        with ul.session(session_id=f"i-{run.id}") as s:
            s.call_sync(add_credit, user_id="u1", amount=1)
            s.call_sync(close_account, user_id="u1")
            s.call_sync(add_credit, user_id="u2", amount=1)

    report = check(scenario, undolog)
    assert report.ok, report.explain()
    assert [s.tool for s in report.steps] == ["add_credit"]
    assert report.stopped_before and "close_account" in report.stopped_before
    assert "the checked part ends before IRREVERSIBLE close_account" in report.explain()
    assert undolog.approvals.pending() == []  # it was stopped before its gate: no request was raised


def test_a_scenario_whose_steps_change_between_runs_is_refused(undolog):
    runs: list[RunKind] = []

    def scenario(ul, run):
        runs.append(run.kind)
        with ul.session(session_id=f"d-{run.id}") as s:
            s.call_sync(add_credit, user_id="u1", amount=1)
            if len(runs) > 1:
                s.call_sync(change_email, user_id="u1", email="x@y.example")
            s.call_sync(add_credit, user_id="u1", amount=1)

    with pytest.raises(ScenarioError, match="not deterministic: COMPENSABLE step 2 was change_email"):
        check(scenario, undolog)


def test_the_session_and_policy_rollbacks_are_off_while_checking(undolog):
    """A failing tool would roll its session back by the default policy, and a `with` block left by the harness's
    stop would too: every compensation would run before the harness could look at the first one."""
    states: list[str] = []

    def scenario(ul, run):
        with ul.session(session_id=f"r-{run.id}") as s:  # on_failure="rollback", the default
            s.call_sync(change_email, user_id="u1", email="ana@new.example")
            try:
                s.call_sync(w.add_credit_then_fail, user_id="u1", amount=2)
            except RuntimeError:
                states.append(ul.sessions.get(s.id).state)
            s.call_sync(add_credit, user_id="u2", amount=1)

    report = check(scenario, undolog, never_happened=False)
    assert report.ok, report.explain()
    assert [s.tool for s in report.steps] == ["change_email", "add_credit_then_fail", "add_credit"]
    assert set(states) == {"active"}  # recorded as failed, never rolled back by the policy during the check
    assert undolog.driver.failure_rollbacks  # switched back on after the check
    with undolog.session() as s, pytest.raises(RuntimeError):
        s.call_sync(w.add_credit_then_fail, user_id="u1", amount=2)
    assert undolog.sessions.get(s.id).state == "rolled_back"  # and the policy works again


def test_a_step_whose_session_was_rolled_back_behind_the_harness_is_not_restored(undolog):
    def scenario(ul, run):
        with ul.session(session_id=f"x-{run.id}") as s:
            s.call_sync(add_credit, user_id="u1", amount=2)
            if run.kind is not RunKind.LEARN:
                ul.rollback(s.id)  # the scenario undoes itself: nothing is left for the harness to prove

    report = check(scenario, undolog, idempotency=False, never_happened=False)
    (step,) = report.steps
    assert step.restored is False and "did not run in the harness's rollback" in step.errors[0]
    assert not report.ok


def test_fixture_fails_the_test_with_the_table(undolog, undo_check):  # noqa: F811
    w.register(undolog)
    ok = undo_check(w.correct_scenario, snapshot=w.snapshot, reset=w.reset, never_happened=False)
    assert ok.ok
    with pytest.raises(pytest.fail.Exception) as failed:
        undo_check(w.broken_scenario, snapshot=w.snapshot, reset=w.reset, never_happened=False)
    assert "update_profile" in str(failed.value) and "['u2']['name']" in str(failed.value)
    report = undo_check(w.broken_scenario, snapshot=w.snapshot, reset=w.reset, expect_ok=False,
                        never_happened=False)
    assert not report.ok


PATHS = {"snapshot": "tests.support.undo_world:snapshot", "reset": "tests.support.undo_world:reset"}


@pytest.mark.long
def test_crash_mode_real_sigkills_in_a_child_then_recover_here(undolog):
    """Four children (two steps, two faults each): the long version of the test below."""
    report = check(w.two_step_scenario, undolog, crash=True,
                   crash_paths={"scenario": "tests.support.undo_world:two_step_scenario", **PATHS})
    assert report.ok, report.explain()
    assert report.crash and all(s.crash_restored and s.crash_tolerates_never_happened for s in report.steps)
    assert report.runs == 1 + 2 + 2 + 4
    assert "crash" in report.explain()
    # Every child died by SIGKILL and left its sessions to this process's recover() and rollbacks.
    crashed = [s for s in undolog.sessions.list(limit=50) if s.session_id.endswith("-crash")]
    assert len(crashed) == 4 and {s.state for s in crashed} == {"rolled_back"}


def test_crash_mode_catches_a_compensation_raising_on_never_happened(undolog):
    """Two children, SIGKILLed: right after the step (recovered and rolled back here: restored), and after its
    pre-write (recover() here cannot compensate it: the compensation raises on "never happened")."""
    report = check(w.note_scenario, undolog, crash=True, never_happened=False,
                   crash_paths={"scenario": "tests.support.undo_world:note_scenario", **PATHS})
    (step,) = report.steps
    assert step.crash_restored is True and step.crash_tolerates_never_happened is False
    assert step.tolerates_never_happened is None  # the in-process variant was not asked for
    assert not report.ok and "TypeError" in " ".join(step.errors)


def test_the_readme_quickstart_compensation_passes_check_undo(undolog):
    """The README quickstart's `unsend` (the compensation of `send_email`), taken from the README as written and
    checked: restored after each step, idempotent under its undo key, tolerant of a call that never happened."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = re.search(r"## Quickstart.*?```python\n(.*?)```", text, re.S).group(1)  # type: ignore[union-attr]
    definitions = code[: code.index("async def main")]  # the tools and the compensation, not the demo run
    scope = {"__name__": "readme_quickstart"}
    exec(compile(definitions, "README.md", "exec"), scope)  # noqa: S102 - the README's own example
    sent = scope["SENT"]
    undolog.register(scope["send_email"], scope["unsend"])

    async def scenario(ul, run):
        async with ul.session(session_id=f"quick-{run.id}") as s:
            await s.call(scope["send_email"], to="ana@example.com")
            await s.call(scope["send_email"], to="bo@example.com")

    report = check_undo(scenario, snapshot=lambda: sorted(sent), reset=sent.clear, undolog=undolog)
    assert report.ok, report.explain()
    assert [s.compensation for s in report.steps] == ["unsend", "unsend"]


def test_the_readme_example_passes_check_undo(db, tmp_path, monkeypatch):
    """The docs' "Checking a compensation" example (docs/how-to/compensations.md), run as it is written (on
    this test's database)."""
    import re

    section = _docs_page()
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    opened = 'UndoLog.open("sqlite:///undolog.db")'
    assert opened in code
    code = code.replace(opened, "__open__()")
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "readme_example", "__open__": db.open}
    exec(compile(code, "docs/how-to/compensations.md", "exec"), scope)  # noqa: S102 - the docs' own example
    report = scope["report"]
    assert report.ok and [s.tool for s in report.steps] == ["change_email", "change_email"]
    assert all(s.restored and s.idempotent and s.tolerates_never_happened for s in report.steps)


def test_cli_check_undo_exit_codes_table_and_json(db, undolog):
    import json

    from typer.testing import CliRunner

    from undolog_core.cli import app

    base = ["--db", db.url] + (["--schema", db.schema] if db.schema else [])
    world = ["--snapshot", "tests.support.undo_world:snapshot", "--reset", "tests.support.undo_world:reset"]
    clean = {"UNDOLOG_APP": None, "UNDOLOG_DATABASE_URL": None, "UNDOLOG_SCHEMA": None, "COLUMNS": "160"}
    runner = CliRunner()
    good = runner.invoke(app, [*base, "check-undo", "tests.support.undo_world:two_step_scenario", *world,
                               "--no-never-happened"], env=clean, catch_exceptions=False)
    assert good.exit_code == 0, good.output
    assert "restore_email" in good.stdout and "OK: 2 step(s)" in good.stdout
    bad = runner.invoke(app, [*base, "check-undo", "tests.support.undo_world:broken_scenario", *world, "--json"],
                        env=clean, catch_exceptions=False)
    assert bad.exit_code == 1, bad.output
    data = json.loads(bad.stdout)
    assert data["ok"] is False and [s["restored"] for s in data["steps"]] == [True, False]
    assert data["steps"][1]["diff"] == [{"path": "['u2']['name']", "expected": "Bo", "actual": "Robert"}]
    typo = runner.invoke(app, [*base, "check-undo", "tests.support.undo_world:no_such_scenario", *world], env=clean)
    assert typo.exit_code == 2 and typo.stderr.startswith("error[invalid_input]: ")
    assert "no_such_scenario" in typo.stderr


def test_plugin_is_registered_as_a_pytest11_entry_point():
    import importlib
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    meta = tomllib.loads((root / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["pytest11"] == {"undolog": "undolog_core.testing.pytest_plugin"}
    plugin = importlib.import_module(meta["project"]["entry-points"]["pytest11"]["undolog"])
    assert plugin.undo_check is undo_check
    # Importable without pytest: only the plugin module imports it.
    from undolog_core.testing import _check, _crash, _report

    assert all("pytest" not in vars(m) for m in (_check, _crash, _report))


@pytest.mark.long
def test_plugin_entry_point_gives_the_fixture(tmp_path):
    """A pytest run with the plugin module loaded (what the entry point does once the package is installed) has
    the `undo_check` fixture and fails a test with the table."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "test_uses_fixture.py").write_text(
        "import pytest\n"
        "from undolog_core import UndoLog\n"
        "from tests.support import undo_world as w\n\n"
        "@pytest.fixture\n"
        "def undolog(tmp_path, monkeypatch):\n"
        "    monkeypatch.setenv('UNDO_WORLD', str(tmp_path / 'w.json'))\n"
        "    u = UndoLog.open(f'sqlite:///{tmp_path}/u.db')\n"
        "    yield u\n"
        "    u.close()\n\n"
        "def test_good(undo_check):\n"
        "    undo_check(w.two_step_scenario, snapshot=w.snapshot, reset=w.reset, never_happened=False)\n\n"
        "def test_broken(undo_check):\n"
        "    undo_check(w.broken_scenario, snapshot=w.snapshot, reset=w.reset, never_happened=False)\n"
    )
    from importlib.metadata import entry_points

    # Installed with the entry point, pytest loads the plugin by itself (what this proves); an environment still
    # holding an older install loads it by name instead (`-p` on top of the entry point is refused by pytest).
    installed = any(e.value == "undolog_core.testing.pytest_plugin" for e in entry_points(group="pytest11"))
    load = [] if installed else ["-p", "undolog_core.testing.pytest_plugin"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *load,
         "--rootdir", str(tmp_path), "-c", "/dev/null", str(tmp_path / "test_uses_fixture.py")],
        cwd=root, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(root)},
    )
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout + proc.stderr
    assert "check_undo: a compensation does not undo its step" in proc.stdout
    assert "restore_profile_forgets_name" in proc.stdout and "['u2']['name']" in proc.stdout


def test_a_scenario_reusing_its_session_id_is_told_to_use_run_id(undolog):
    def scenario(ul):
        with ul.session(session_id="always-the-same") as s:
            s.call_sync(add_credit, user_id="u1", amount=1)

    with pytest.raises(ScenarioError, match="put run.id in it") as refused:
        check(scenario, undolog)
    assert "ended with SessionClosed: session 'always-the-same' is rolled_back" in str(refused.value)


def test_the_stop_is_recognised_inside_a_task_group(undolog):
    async def scenario(ul, run):
        async with ul.session(session_id=f"tg-{run.id}") as s:
            async def work():
                await s.call(aadd_credit, user_id="u1", amount=2)
                await s.call(aadd_credit, user_id="u2", amount=3)

            async with asyncio.TaskGroup() as tg:  # gathers the harness's stop into a BaseExceptionGroup
                tg.create_task(work())

    report = check(scenario, undolog, never_happened=False)
    assert report.ok, report.explain()
    assert report.scenario_error is None and len(report.steps) == 2


# -- a demanding user: what the check does with scenarios, snapshots and resets that misbehave ------------------


def _quiet(undolog, before_sessions=()):
    """What a check must leave behind, whatever way it ended: no fault hook, the failure rollbacks back on, the
    check's lock free, nothing in flight in this process, and no harness session with an effect still pending
    (which a later recover() would compensate against a world the harness has reset)."""
    from undolog_core import _faults
    from undolog_core.testing import _check

    assert _faults._hook is None and _faults._armed is None
    assert undolog.driver.failure_rollbacks is True
    assert _check._ONE_AT_A_TIME.acquire(blocking=False)
    _check._ONE_AT_A_TIME.release()
    assert undolog.leases.inflight == set()
    for s in undolog.sessions.list(limit=200):
        if s.session_id in before_sessions:
            continue
        states = {e["state"] for e in undolog.sessions.effects(s.session_id)}
        assert "pending" not in states, (s.session_id, s.state, states)
        # Rolled back, or halted by the recovery of a call it stopped; a session the scenario opened but made no
        # call in before the stop holds nothing to undo.
        assert s.state in ("rolled_back", "halted") or not states, (s.session_id, s.state, states)
    assert undolog.recover().reconciled == []  # nothing of the harness's is left for a recovery to compensate
    assert w.snapshot() == w.START["accounts"]


def test_a_check_leaves_the_process_and_the_other_sessions_as_it_found_them(undolog):
    """Another session's rows (a committed call, and a call whose owner died after its pre-write) are not touched
    by the check; the process ends with no hook, nothing in flight, the policy rollbacks on."""
    from undolog_core import _faults
    from undolog_core._faults import FaultPoint

    w.register(undolog)
    with undolog.session(session_id="bystander") as s:
        s.call_sync(add_credit, user_id="u1", amount=1)

        def die_after_prewrite(point, session_id, tool, effect_id):
            if point is FaultPoint.AFTER_PREWRITE:
                undolog.leases.abandon(effect_id)
                raise KeyboardInterrupt("crashed")

        _faults.set_hook(die_after_prewrite)
        try:
            with pytest.raises(KeyboardInterrupt):
                s.call_sync(change_email, user_id="u1", email="z@z.example")
        finally:
            _faults.set_hook(None)
    before = (undolog.sessions.get("bystander").state, undolog.sessions.effects("bystander"))
    assert [e["state"] for e in before[1]] == ["committed", "pending"]
    w.reset()

    report = check(w.correct_scenario, undolog)
    assert report.ok, report.explain()
    assert (undolog.sessions.get("bystander").state, undolog.sessions.effects("bystander")) == before
    from undolog_core import _faults as f

    assert f._hook is None and undolog.driver.failure_rollbacks and undolog.leases.inflight == set()


def test_a_stop_before_a_prewrite_leaves_nothing_in_flight(undolog):
    """The harness's stop at a call's pre-write: nothing was written, so nothing stays counted as running here
    (a leaked id would keep the lease renewer busy for the life of the process)."""
    report = check(w.two_step_scenario, undolog, never_happened=False)
    assert report.ok, report.explain()
    assert undolog.leases.inflight == set()


def test_a_scenario_that_changes_between_runs_leaves_nothing_pending(undolog):
    """Refused at a later run's pre-write of a different tool: that run's sessions are wound up (the effect the
    check pre-wrote is compensated, the session rolled back) before the error is raised."""
    runs: list[int] = []

    def scenario(ul, run):
        runs.append(run.index)
        with ul.session(session_id=f"d-{run.id}") as s:
            s.call_sync(add_credit, user_id="u1", amount=1)
            s.call_sync(change_email if len(runs) > 1 else add_credit, user_id="u1", **(
                {"email": "x@y.example"} if len(runs) > 1 else {"amount": 1}))

    with pytest.raises(ScenarioError, match="not deterministic"):
        check(scenario, undolog)
    _quiet(undolog)


def test_a_scenario_raising_its_own_exception_is_not_ok(undolog):
    """A scenario that blew up did not run what it was meant to: the steps it made are checked, and the report
    is not ok (the error is in the table's notes), so a typo never passes as 'nothing to check'."""
    def scenario(ul, run):
        with ul.session(session_id=f"e-{run.id}") as s:
            s.call_sync(add_credit, user_id="u1", amount=1)
            raise ValueError("the scenario's own bug")

    report = check(scenario, undolog)
    (step,) = report.steps
    assert step.restored and step.idempotent and step.tolerates_never_happened
    assert report.scenario_error == "ValueError: the scenario's own bug"
    assert not report.ok
    assert "the scenario ended with an error: ValueError: the scenario's own bug" in report.explain()
    _quiet(undolog)

    def typo(ul, run):
        raise NameError("name 'add_credt' is not defined")

    report = check(typo, undolog)
    assert report.steps == [] and not report.ok
    assert "FAILED" in report.explain()
    _quiet(undolog)


def test_a_snapshot_that_is_not_json_able_is_refused_clearly(undolog):
    def snapshot():
        return {"accounts": w.snapshot(), "tags": {"vip"}}

    with pytest.raises(ScenarioError, match=r"snapshot\(\) taken at the start is not JSON-able: a set"):
        check_undo(w.two_step_scenario, snapshot=snapshot, reset=w.reset, undolog=undolog)
    _quiet(undolog)


def test_a_snapshot_failing_mid_run_is_raised_not_reported_as_a_diff(undolog):
    """The snapshot before step 2 is taken inside the scenario (at the harness's hook): its error must reach the
    caller as it is, not end the scenario quietly and come back as a bogus difference."""
    def snapshot():
        accounts = w.snapshot()
        if accounts["u1"]["email"] != "ana@example.com":
            return {"accounts": accounts, "since": {"changed"}}  # not JSON-able once step 1 ran
        return {"accounts": accounts}

    with pytest.raises(ScenarioError, match=r"snapshot\(\) taken before step 2 is not JSON-able"):
        check_undo(w.two_step_scenario, snapshot=snapshot, reset=w.reset, undolog=undolog)
    _quiet(undolog)

    calls = [0]

    def flaky():
        calls[0] += 1
        if calls[0] == 3:
            raise ConnectionError("the CRM is down")
        return w.snapshot()

    with pytest.raises(ConnectionError, match="the CRM is down"):
        check_undo(w.two_step_scenario, snapshot=flaky, reset=w.reset, undolog=undolog)
    _quiet(undolog)


def test_a_reset_that_fails_is_raised_clearly_and_not_masked(undolog):
    calls = [0]

    def reset():
        calls[0] += 1
        if calls[0] >= 3:
            raise RuntimeError("cannot reach the CRM")
        w.reset()

    with pytest.raises(ScenarioError, match=r"reset\(\) raised RuntimeError: cannot reach the CRM") as failed:
        check_undo(w.two_step_scenario, snapshot=w.snapshot, reset=reset, undolog=undolog)
    assert isinstance(failed.value.__cause__, RuntimeError)
    w.reset()
    _quiet(undolog)

    # Only the final reset fails: the check itself was fine, and the caller is told the world was not reset.
    def last_reset_fails():
        calls[0] += 1
        if calls[0] == 1 + 1 + 2 + 2 + 1:  # learn, 2 x restore, 2 x never happened, then the final one
            raise RuntimeError("gone at the end")
        w.reset()

    calls[0] = 1
    with pytest.raises(ScenarioError, match=r"reset\(\) raised RuntimeError: gone at the end"):
        check_undo(w.two_step_scenario, snapshot=w.snapshot, reset=last_reset_fails, undolog=undolog)
    w.reset()
    _quiet(undolog)


def test_check_undo_twice_in_a_row_and_from_two_threads(db, undolog):
    import threading

    first = check(w.two_step_scenario, undolog)
    second = check(w.two_step_scenario, undolog)
    assert first.ok and second.ok
    ids = {s.session_id for s in undolog.sessions.list(limit=100)}
    assert len(ids) == 2 * first.runs  # every run of both checks had sessions of its own

    other = db.open()
    w.register(other)
    reports: list = []
    errors: list = []

    def go(u):
        try:
            reports.append(check(w.two_step_scenario, u))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(u,)) for u in (undolog, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert errors == [] and len(reports) == 2 and all(r.ok for r in reports), [r.explain() for r in reports]
    _quiet(undolog)
    _quiet(other)


def test_a_scenario_with_two_sessions(undolog):
    def scenario(ul, run):
        with ul.session(session_id=f"a-{run.id}") as a, ul.session(session_id=f"b-{run.id}") as b:
            a.call_sync(change_email, user_id="u1", email="ana@new.example")
            b.call_sync(update_profile, user_id="u2", email="b@x.example", name="Robert")
            a.call_sync(add_credit, user_id="u1", amount=3)

    report = check(scenario, undolog)
    first, broken, last = report.steps
    assert first.ok and last.restored and last.idempotent and last.tolerates_never_happened
    assert broken.restored is False and [d.path for d in broken.diff] == ["['u2']['name']"]
    assert report.fault_points[1].restored and not report.fault_points[3].restored
    # Stopped after step 3: the sessions are rolled back as a rollback in production does, one session at a
    # time, the one with the newest step first: a's steps 3 and 1, then b's step 2.
    assert [r.split(" of ")[1].split(":")[0] for r in report.fault_points[3].rollback_steps] == [
        "add_credit", "change_email", "update_profile"]
    # Stopped after step 2: b (step 2) first, so step 2's own compensation is the first one, then a's step 1.
    assert [r.split(" of ")[1].split(":")[0] for r in report.fault_points[2].rollback_steps] == [
        "update_profile", "change_email"]
    _quiet(undolog)


@pytest.mark.parametrize("form", ["sync(undolog)", "sync(undolog, run)", "async(undolog)", "async(undolog, run)"])
def test_every_scenario_signature(undolog, form):
    seen: list = []

    def sync1(ul):
        with ul.session() as s:  # a fresh session id per run, made by UndoLog
            s.call_sync(add_credit, user_id="u1", amount=1)

    def sync2(ul, run):
        seen.append(run.id)
        with ul.session(session_id=f"s-{run.id}") as s:
            s.call_sync(add_credit, user_id="u1", amount=1)

    async def async1(ul):
        async with ul.session() as s:
            await s.call(aadd_credit, user_id="u1", amount=1)

    async def async2(ul, run):
        seen.append(run.id)
        async with ul.session(session_id=f"s-{run.id}") as s:
            await s.call(aadd_credit, user_id="u1", amount=1)

    fn = {"sync(undolog)": sync1, "sync(undolog, run)": sync2, "async(undolog)": async1,
          "async(undolog, run)": async2}[form]
    report = check(fn, undolog)
    assert report.ok, report.explain()
    assert len(report.steps) == 1
    if seen:
        assert len(seen) == len(set(seen)) == report.runs  # run.id is unique per run
    _quiet(undolog)


def test_explain_without_rich_is_a_plain_table(undolog, monkeypatch):
    import sys

    report = check(w.broken_scenario, undolog, never_happened=False)
    monkeypatch.setitem(sys.modules, "rich.console", None)  # `from rich.console import ...` raises ImportError
    text = report.explain()
    assert "┃" not in text and "│" not in text
    lines = text.splitlines()
    assert lines[0].split() == ["step", "tool", "compensation", "restored", "idempotent", "never-happened",
                                "to", "start"]
    assert lines[1].split() == ["1", "change_email", "restore_email", "yes", "yes", "-", "yes"]
    assert lines[2].split() == ["2", "update_profile", "restore_profile_forgets_name", "NO", "yes", "-", "NO"]
    assert "    ['u2']['name']: expected 'Bo', got 'Robert'" in lines
    assert lines[-1] == "FAILED: 2 step(s), 3 run(s)"


def _docs_page() -> str:
    """docs/how-to/compensations.md, where the README's "Check your compensations" moved."""
    from pathlib import Path

    return (Path(__file__).resolve().parents[2] / "docs" / "how-to" / "compensations.md").read_text()


def test_the_readme_table_is_what_explain_prints(undolog):
    """The table in "Checking a compensation" (docs) is explain()'s output for `undo_world.readme_scenario`, as it is
    printed today (ids aside: effect ids and undo ids differ from run to run and between the databases)."""
    import re

    block = re.search(r"```text\n(.*?)```", _docs_page(), re.S).group(1)  # type: ignore[union-attr]
    report = check(w.readme_scenario, undolog)

    def norm(text: str) -> list[str]:
        text = re.sub(r"\b[0-9a-f]{32}\b", "<effect>", text)
        text = re.sub(r"undo-\d+", "undo-<n>", text)
        return [line.rstrip() for line in text.strip("\n").splitlines()]

    assert norm(report.explain(width=120)) == norm(block)


def test_every_compensation_in_the_readme_is_checked_in_ci():
    """Every compensation the README or the docs define or name is one that a check_undo test runs, here or in
    tests/adapters/test_undo_check_frameworks.py: a new compensation example in the docs without a check fails
    this test. Compensations shown only as a name or a stub (`...`) are the support example's, checked through
    each framework, or are listed here with the reason they hold no state to restore."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme = "\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").rglob("*.md"))])
    named = set(re.findall(r'@compensation\("(\w+)"\)', readme))
    named |= set(re.findall(r'CompensationDescriptor\.new\("(\w+)"\)', readme))
    named |= set(re.findall(r'compensation="(\w+)"', readme))
    named |= set(re.findall(r"compensations=\[(\w+)\]", readme))
    named |= set(re.findall(r'"compensation": (\w+)\}', readme))
    checked = {
        # "Check your compensations": run from the README itself (test_the_readme_example_passes_check_undo).
        "restore_email": "tests/core/test_undo_check.py::test_the_readme_example_passes_check_undo",
        # The support example's recall, stubbed in "Classifying a tool" and passed to every adapter in the
        # framework sections: its real body is in the examples, checked through LangGraph, CrewAI and SK.
        "cancel_refund_email": "tests/adapters/test_undo_check_frameworks.py",
        # The README quickstart's recall of a sent email, run from the README itself.
        "unsend": "tests/core/test_undo_check.py::test_the_readme_quickstart_compensation_passes_check_undo",
        # docs/tutorials/first-agent.md defines a recall of the same name over an in-memory outbox: tests/docs runs
        # that tutorial (its rollback empties what the session queued); it is not run under check_undo.
        # The CrewAI section's plain-function compensation of a third-party tool, run from the README.
        "release_callback": "tests/adapters/test_undo_check_frameworks.py::test_the_readme_crewai_release_callback",
    }
    # Named in a declaration whose body is `...` (LangGraph's injected-arguments and retry sections): the README
    # defines no such compensation, so there is nothing of it to run.
    # docs/how-to/recovery.md's probe example names `cancel_refund` the same way.
    declared_only = {"remove_note", "release_seat", "cancel_refund"}
    for name in declared_only:
        assert f'@compensation("{name}")' not in readme and f"def {name}(" not in readme, name
    named -= declared_only
    assert named == set(checked), named ^ set(checked)
    for where in checked.values():
        path, _, test = where.partition("::")
        assert (root / path).exists()
        assert not test or f"def {test}(" in (root / path).read_text(), where


def test_cli_check_undo_bad_paths_are_input_errors_not_tracebacks(db, undolog, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from undolog_core.cli import app

    (tmp_path / "broken_mod.py").write_text("import json\nraise RuntimeError('this module is broken')\n")
    (tmp_path / "bad_syntax.py").write_text("def scenario(:\n")
    monkeypatch.chdir(tmp_path)
    base = ["--db", db.url] + (["--schema", db.schema] if db.schema else [])
    world = ["--snapshot", "tests.support.undo_world:snapshot", "--reset", "tests.support.undo_world:reset"]
    clean = {"UNDOLOG_APP": None, "UNDOLOG_DATABASE_URL": None, "UNDOLOG_SCHEMA": None}
    runner = CliRunner()
    for spec, says in (("no_such_module:scenario", "cannot import 'no_such_module'"),
                       ("broken_mod:scenario", "RuntimeError: this module is broken"),
                       ("bad_syntax:scenario", "SyntaxError"),
                       ("tests.support.undo_world", "must look like module:function"),
                       ("tests.support.undo_world:START", "is not callable")):
        out = runner.invoke(app, [*base, "check-undo", spec, *world], env=clean)
        assert out.exit_code == 2, (spec, out.output, out.exception)
        assert out.stderr.startswith("error[invalid_input]: ") and says in out.stderr, (spec, out.stderr)
    # A scenario the check refuses (here: not JSON-able snapshot) is the check's error, exit 2, no traceback.
    (tmp_path / "odd.py").write_text("def snap():\n    return {1, 2}\n\ndef reset():\n    pass\n")
    out = runner.invoke(app, [*base, "check-undo", "tests.support.undo_world:two_step_scenario",
                              "--snapshot", "odd:snap", "--reset", "odd:reset"], env=clean)
    assert out.exit_code == 2 and out.stderr.startswith("error[undo_check_scenario]: snapshot() taken at the start")


def test_crash_mode_refusing_a_child_leaves_nothing_pending(undolog):
    """The crash child's run differs from the first run (a different step 2): the check is refused, and the dead
    child's sessions (its pre-written step 2 pending, its owner gone) are recovered and rolled back first."""
    with pytest.raises(ScenarioError, match="not deterministic: COMPENSABLE step 2 was change_email"):
        check(w.changes_in_the_crash_child, undolog, crash=True, never_happened=False, idempotency=False,
              crash_paths={"scenario": "tests.support.undo_world:changes_in_the_crash_child", **PATHS})
    _quiet(undolog)


def test_the_stop_is_a_base_exception_raised_before_the_next_pre_write(undolog):
    """Stopped after step k: the scenario's `except Exception` does not catch the stop, and step k+1 left no row
    (the stop comes before its pre-write)."""
    from undolog_core.testing import InjectedStop

    assert issubclass(InjectedStop, BaseException) and not issubclass(InjectedStop, Exception)
    caught: list[str] = []
    sessions: dict[RunKind, list[str]] = {}

    def scenario(ul, run):
        with ul.session(session_id=f"st-{run.id}") as s:
            sessions.setdefault(run.kind, []).append(s.id)
            s.call_sync(add_credit, user_id="u1", amount=1)
            try:
                s.call_sync(change_email, user_id="u1", email="x@y.example")
            except Exception as exc:  # noqa: BLE001 - what a framework's error handling does
                caught.append(repr(exc))

    report = check(scenario, undolog, never_happened=False, idempotency=False)
    assert report.ok, report.explain()
    assert caught == []
    stopped_after_1 = sessions[RunKind.RESTORE][0]
    assert [e["tool_name"] for e in undolog.sessions.effects(stopped_after_1)] == ["add_credit"]
