"""Shared fixtures: every test gets a fresh database (a SQLite file, or a fresh PostgreSQL schema), copied from a
template migrated once per session (``tests/support/db_template.py``).

Which database is chosen by UNDOLOG_TEST_DB=sqlite|postgres; on postgres an unreachable server is an
error, never a skip.

What a run selects (deselected tests are reported as deselected, never skipped):

- ``install`` tests (the README's set-up followed on a fresh clone: pip installs into a new venv) run only with
  ``--kind install``; CI runs them in a step timed apart, as it times its own installs.
- ``perf``, ``fuzz`` and ``browser`` tests run only with ``--kind slow`` (``--kind all``: everything); CI runs
  them in a step of their own.
- On PostgreSQL only the tests whose outcome depends on the database run: ``storage`` (every test under
  ``tests/core``, ``tests/conformance`` and ``tests/faults`` carries it by directory), ``postgres_only``, and the
  ``pg_smoke`` subset of the desk and the gateway (PostgreSQL-only failures have appeared above storage).
  ``--pg-all`` runs everything on PostgreSQL.
- At collection, a test that opens a store directly and says nothing about databases fails the run. The rule,
  precisely: ``tests/support/store_rule.py``. In short: a test whose own code (or its module's helpers and
  fixtures) names ``sqlalchemy``, ``sqlite3``, ``psycopg`` or ``undolog_core.storage``, runs raw SQL
  (``exec_driver_sql``, ``raw_connection``, ``driver_connection``), calls ``open_storage`` or asks for
  ``pg_admin`` must be marked ``storage``, ``pg_smoke``, ``postgres_only``, ``sqlite_only`` or ``reads_store``
  (behaviour above storage that reads the store only to see what happened: SQLite run only).
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from undolog_core import UndoLog

TEST_DB = os.environ.get("UNDOLOG_TEST_DB", "sqlite").lower()
PG_URL = os.environ.get("UNDOLOG_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

if TEST_DB not in ("sqlite", "postgres"):
    raise RuntimeError(f"UNDOLOG_TEST_DB must be sqlite or postgres, got {TEST_DB!r}")

# Examples are drawn on machines shared with other test runs and xdist workers: a slow draw (41 s for one input
# under a load average of 16) is the machine, not the strategy, and no test may depend on timing.
settings.register_profile("undolog", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("undolog")


#: Directories whose every test pins the store's own behaviour: marked ``storage`` by where they live.
STORAGE_DIRS = ("core", "conformance", "faults")
#: Kinds of test kept out of the default run (CI runs them in their own step, ``--kind slow``).
SLOW_KINDS = ("perf", "fuzz", "browser")
#: What the PostgreSQL run keeps (without --pg-all).
PG_KINDS = ("storage", "pg_smoke", "postgres_only")
TESTS = Path(__file__).resolve().parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="also run the tests marked `long` (soak and repeated-chaos versions)")
    parser.addoption("--kind", choices=("default", "slow", "install", "all"), default="default",
                     help="default: all but perf/fuzz/browser tests; slow: only those; all: everything")
    parser.addoption("--pg-all", action="store_true", default=False,
                     help="on PostgreSQL run every test, not only storage, postgres_only and pg_smoke ones")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "long: a soak or chaos version that runs only with --long")


@functools.cache
def _mark_names(path: Path) -> tuple[frozenset[str], frozenset[str]]:
    """The marks a test module's ``pytestmark`` puts on all its tests, and every mark it names anywhere
    (``pytest.mark.X`` in decorators, ``pytest.param(..., marks=...)``, ``pytestmark``), read without importing it."""
    import ast

    from tests.support.source_facts import facts

    def marks(node: ast.AST) -> set[str]:
        return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}

    def read(tree: ast.Module) -> list[list[str]]:
        module_wide: set[str] = set()
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                    for t in stmt.targets):
                module_wide |= marks(stmt.value)
        return [sorted(module_wide), sorted(marks(tree))]

    # Parsed once per module text across the run's processes (tests/support/source_facts.py).
    module_wide, named = facts(path, "marks", read)
    return frozenset(module_wide), frozenset(named)


def _why_not_imported(path: Path, config: pytest.Config) -> str | None:
    """Why none of a test module's tests can be selected by this run (None: some may be)."""
    module_wide, named = _mark_names(path)
    kind = config.getoption("--kind")
    in_storage_dir = path.relative_to(TESTS).parts[0] in STORAGE_DIRS
    if kind in ("default", "slow") and "install" in module_wide:
        return "its tests are install tests (--kind install)"
    if kind == "install" and "install" not in named:
        return "none of its tests is an install test"
    if kind == "default" and module_wide & set(SLOW_KINDS):
        return "its tests are " + "/".join(sorted(module_wide & set(SLOW_KINDS))) + " tests (--kind slow)"
    if kind == "slow" and not named & set(SLOW_KINDS):
        return "none of its tests is a perf, fuzz or browser test"
    if (TEST_DB == "postgres" and not config.getoption("--pg-all") and not in_storage_dir
            and not named & set(PG_KINDS)):
        return "none of its tests is storage, pg_smoke or postgres_only (SQLite run only)"
    return None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Do not import a test module none of whose tests this run selects (read from its marks without importing it).

    Every xdist worker imports every module it collects: the framework modules (crewai, semantic_kernel,
    schemathesis) cost about 8 CPU seconds per worker, paid again by each worker of each database's run for tests
    that run elsewhere. Such modules are counted at the end of the run ("not imported") instead of deselected.
    """
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    path = collection_path.resolve()
    if not path.is_relative_to(TESTS) or _why_not_imported(path, config) is None:
        return None
    return True


#: How many pg_smoke tests this run ran and their seconds (set-up, call and tear-down summed): the PostgreSQL smoke
#: subset's budget is 60 s in CI, so its step prints what the subset took (a report, never a timed test).
_pg_smoke = {"tests": 0, "seconds": 0.0}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Under xdist this runs in the controller too, with each report's keywords (marker names) carried over.
    if TEST_DB == "postgres" and "pg_smoke" in report.keywords:
        _pg_smoke["tests"] += report.when == "setup"
        _pg_smoke["seconds"] += report.duration


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if _pg_smoke["tests"] and not hasattr(config, "workerinput"):
        terminalreporter.write_line(
            f"PostgreSQL smoke subset (pg_smoke): {_pg_smoke['tests']} tests took {_pg_smoke['seconds']:.1f} s "
            "summed (budget: 60 s in CI)")
    # Computed here again rather than gathered from collection: under xdist the workers collect, not this process.
    found = [(p, _why_not_imported(p, config)) for p in sorted(TESTS.rglob("test_*.py"))]
    skipped_modules = [f"{p.relative_to(TESTS.parent)}: {why}" for p, why in found if why]
    if skipped_modules:
        terminalreporter.write_line(
            f"{len(skipped_modules)} test modules not imported: none of their tests runs in this step "
            f"(UNDOLOG_TEST_DB={TEST_DB}, --kind {config.getoption('--kind')}; the rule: tests/conftest.py)")
        if config.getoption("verbose") > 0:
            for line in skipped_modules:
                terminalreporter.write_line(f"  {line}")


def _in_storage_dir(item: pytest.Item) -> bool:
    path = Path(str(item.path)).resolve()
    return path.is_relative_to(TESTS) and path.relative_to(TESTS).parts[0] in STORAGE_DIRS


def _unmarked_store_openers(items: list[pytest.Item]) -> list[str]:
    from tests.support.store_rule import needs_marker, why_it_opens_a_store

    found = []
    for item in items:
        if needs_marker(item):
            why = why_it_opens_a_store(item, TESTS / "conftest.py")
            if why:
                found.append(f"{item.nodeid}: {why}")
    return found


#: How many times its CI duration a known long test may take before pytest-timeout calls it hung.
LOAD_MARGIN = 8


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark, check, then deselect (not skip) what this run does not cover.

    Marks ``storage`` on every test under STORAGE_DIRS; fails the run when a test opens a store directly without
    a database marker (see the module docstring); deselects `long` tests without --long, `postgres_only` tests on
    the SQLite run, `sqlite_only` tests on the PostgreSQL run, perf/fuzz/browser tests outside ``--kind slow|all``
    and, on PostgreSQL, tests that are neither storage, postgres_only nor pg_smoke (unless --pg-all). A
    deselected test is reported as deselected, never as a skip that could hide a test from CI."""
    for item in items:
        if _in_storage_dir(item):
            item.add_marker(pytest.mark.storage)
    unmarked = _unmarked_store_openers(items)
    if unmarked:
        raise pytest.UsageError(
            f"{len(unmarked)} test(s) open a store directly but carry no database marker; mark each "
            "@pytest.mark.storage (or pg_smoke, postgres_only, sqlite_only, reads_store): the rule is in "
            "tests/support/store_rule.py\n  " + "\n  ".join(unmarked))
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    run_long = config.getoption("--long")
    kind = config.getoption("--kind")
    pg_all = config.getoption("--pg-all")
    for item in items:
        slow = any(item.get_closest_marker(m) for m in SLOW_KINDS)
        install = item.get_closest_marker("install") is not None
        if (item.get_closest_marker("long") and not run_long) or (
            item.get_closest_marker("postgres_only") and TEST_DB != "postgres"
        ) or (item.get_closest_marker("sqlite_only") and TEST_DB != "sqlite") or (
            (kind == "default" and (slow or install)) or (kind == "slow" and (install or not slow))
            or (kind == "install" and not install)
        ) or (TEST_DB == "postgres" and not pg_all and not any(item.get_closest_marker(m) for m in PG_KINDS)):
            dropped.append(item)
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    # Longest first: a 50 s test started last is the step's tail. The known long ones (tests/data/durations.json)
    # start first, dealt over the xdist workers; the rest keep pytest-randomly's order (tests/support/durations.py).
    from tests.support.durations import load, order_longest_first

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    known = load(TEST_DB)
    items[:] = order_longest_first(items, known, lambda item: item.nodeid, workers,
                                   str(config.getoption("dist", "no")))
    # pytest-timeout's 120 s (pyproject) catches a hang; a test that takes 30 s in CI took over 120 s on a machine
    # loaded four times as much, and was reported as hung. The known long tests without a timeout of their own get
    # LOAD_MARGIN times their CI duration.
    for item in items:
        seconds = known.get(item.nodeid)
        if seconds is not None and item.get_closest_marker("timeout") is None and seconds * LOAD_MARGIN > 120:
            item.add_marker(pytest.mark.timeout(round(seconds * LOAD_MARGIN)))


@dataclass
class Db:
    """A test's own database: a SQLite file or a PostgreSQL schema, empty until :meth:`open` (or
    :meth:`materialize`) copies the session's migrated template into it.

    Only the first open of a database that is not there yet is served from the template; an open with
    ``migrate=False``, a database some other code created first (the migration tests' older revisions, the CLI's
    ``db upgrade``), and a test marked ``real_migrations`` see exactly what they saw before.
    """

    kind: str
    url: str
    schema: str | None
    opened: list[UndoLog] = field(default_factory=list)
    #: The session's templates (None: every open runs the real migrations).
    templates: Any = None
    #: Which template: "core" (what ``UndoLog.open`` makes) or "server" (the desk's tables too).
    flavour: str = "core"

    def materialize(self) -> bool:
        """Copy the migrated template here unless a database is already there; True when copied."""
        if self.templates is None:
            return False
        if self.kind == "sqlite":
            return bool(self.templates.copy_to(Path(self.url.split("///", 1)[1]), self.flavour))
        assert self.schema is not None
        return bool(self.templates.clone_to(self.schema, self.flavour))

    def open(self, **kw: Any) -> UndoLog:
        if kw.get("migrate", True):
            self.materialize()
        u = UndoLog.open(self.url, schema=self.schema, **kw)
        self.opened.append(u)
        return u

    @property
    def env(self) -> dict[str, str]:
        env = {"UNDOLOG_DATABASE_URL": self.url}
        if self.schema:
            env["UNDOLOG_SCHEMA"] = self.schema
        return env


def _pg_admin() -> Any:
    import sqlalchemy as sa

    return sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT", pool_size=1)


@pytest.fixture(scope="session")
def pg_admin() -> Iterator[Any]:
    if TEST_DB != "postgres":
        yield None
        return
    eng = _pg_admin()
    with eng.connect() as c:  # fails loudly when PostgreSQL is down
        c.exec_driver_sql("SELECT 1")
    yield eng
    eng.dispose()


@pytest.fixture(scope="session")
def db_templates(pg_admin: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The session's migrated templates (built on first use, by the real migrations; see tests/support/db_template.py)."""
    from tests.support.db_template import PostgresTemplates, SQLiteTemplates

    if TEST_DB == "postgres":
        pg = PostgresTemplates(PG_URL, pg_admin)
        yield pg
        pg.dispose()
    else:
        yield SQLiteTemplates(tmp_path_factory.mktemp("db-templates"))


#: Test directories whose databases get the desk's tables too (the desk would create them on its start).
_SERVER_FLAVOUR_DIRS = ("server", "mcp")


@pytest.fixture
def db(request: pytest.FixtureRequest, tmp_path: Path, pg_admin: Any, db_templates: Any) -> Iterator[Db]:
    templates = None if request.node.get_closest_marker("real_migrations") else db_templates
    flavour = "server" if request.node.path.parent.name in _SERVER_FLAVOUR_DIRS else "core"
    if TEST_DB == "postgres":
        schema = "t_" + uuid.uuid4().hex[:16]
        d = Db("postgres", PG_URL, schema, templates=templates, flavour=flavour)
    else:
        d = Db("sqlite", f"sqlite:///{tmp_path / 'undolog.db'}", None, templates=templates, flavour=flavour)
    yield d
    for u in d.opened:
        try:
            u.close()
        except Exception:
            pass
    if TEST_DB == "postgres":
        with pg_admin.connect() as c:
            c.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{d.schema}" CASCADE')


@pytest.fixture
def undolog(db: Db) -> UndoLog:
    return db.open()


def pytest_sessionstart(session: pytest.Session) -> None:
    # UNDOLOG_TEST_CPU_REPORT=DIR: CPU seconds per test (tests/support/cpu_report.py), to find what makes CI slow.
    folder = os.environ.get("UNDOLOG_TEST_CPU_REPORT")
    if folder:
        from tests.support.cpu_report import CpuReport

        session.config.pluginmanager.register(CpuReport(Path(folder)), "undolog-cpu-report")
