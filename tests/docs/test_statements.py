"""What the docs say about the command line, the desk's options, the environment and the error codes is what ships.

The docs moved out of a long README; their command lines, option names, defaults, environment variables and error
codes were written by hand. These tests read them from the pages and check each against the code: every
``undolog ...`` command a page shows (in a shell block or inline) names a real command of the Typer app and only
options that command (or the app, for global options) takes; the desk's option table gives each option's real
environment variable and default; every ``UNDOLOG_*`` variable a page names is read by the code; every
``error[code]`` and every code with an HTTP status on the error page is a code the code raises, with that status.
"""

from __future__ import annotations

import re
import shlex
from functools import cache
from typing import Any

import pytest

from tests.docs.test_docs import DOCS, PAGES, ROOT, blocks

ALL = [*PAGES, "README.md"]


def _text(page: str) -> str:
    return (ROOT / page if page == "README.md" else DOCS / page).read_text()


@cache
def _root() -> Any:
    import typer

    from undolog_core.cli import app

    return typer.main.get_command(app)


def _opts(cmd: Any) -> set[str]:
    out: set[str] = set()
    for p in cmd.params:
        out.update(p.opts)
        out.update(p.secondary_opts)
    return out | {"--help"}


def _commands(page: str) -> list[tuple[int, str]]:
    """Every ``undolog ...`` command line of a page: (line, the command), from shell blocks and inline code."""
    found: list[tuple[int, str]] = []
    text = _text(page)
    for b in blocks(page):
        if b.lang not in ("bash", ""):
            continue
        for i, line in enumerate(b.code.splitlines()):
            line = line.split("  #")[0].split(" # ")[0]
            for part in re.split(r"\$\(|&&|\|\||;|\|(?= )", line):
                part = part.strip().rstrip(")").strip()
                if part.startswith("undolog ") or part == "undolog":
                    found.append((b.line + 1 + i, part))
    for m in re.finditer(r"`(undolog(?: [^`]*)?)`", text):
        found.append((text[: m.start()].count("\n") + 1, m.group(1)))
    return found


def _alternatives(words: list[str]) -> list[list[str]]:
    """``approve|reject|modify`` in a command stands for each of them."""
    out: list[list[str]] = [[]]
    for w in words:
        choices = w.split("|") if "|" in w and not w.startswith(("'", '"', "{")) else [w]
        out = [[*o, c] for o in out for c in choices]
    return out


def _check(command: str) -> list[str]:
    """What is wrong with one command line (empty when it names a real command and only its options)."""
    try:
        words = shlex.split(command)[1:]
    except ValueError:
        words = command.split()[1:]
    problems = []
    for alt in _alternatives(words):
        root = _root()
        cmd, path, globals_ = root, ["undolog"], _opts(root)
        i = 0
        while i < len(alt):
            w = alt[i]
            if w in ("--", "...", "…") or w.startswith(("<", "[")):
                break
            if w.startswith("-"):
                name = w.split("=")[0]
                # "--secure-cookies/--no-secure-cookies" names a flag and its negation
                for n in name.split("/"):
                    if n.startswith("--") and n not in _opts(cmd) and n not in globals_:
                        problems.append(f"{' '.join(path)} has no option {n}")
                param = next((p for p in [*cmd.params, *root.params] if name in p.opts), None)
                if param is not None and not param.is_flag and "=" not in w:
                    i += 1  # its value
            elif hasattr(cmd, "commands") and cmd.commands:
                if w not in cmd.commands:
                    problems.append(f"{' '.join(path)} has no command {w!r} (it has {sorted(cmd.commands)})")
                    break
                cmd = cmd.commands[w]
                path.append(w)
            i += 1
    return problems


@pytest.mark.parametrize("page", ALL)
def test_every_command_line_names_real_commands_and_options(page: str) -> None:
    commands = _commands(page)
    wrong = [f"{page}:{line}: `{cmd}`: {p}" for line, cmd in commands for p in _check(cmd)]
    assert not wrong, "\n".join(wrong)


def test_the_checker_catches_a_wrong_command_and_a_wrong_option() -> None:
    assert _check("undolog approvals approve ID --as ana") == []
    assert _check("undolog --db sqlite:///x.db sessions list --state halted") == []
    assert _check("undolog approvals aprove ID") != []
    assert _check("undolog serve --port 8000 --no-such-flag") != []
    assert _check("undolog approvals approve|reject|modify") == []


def test_the_docs_show_command_lines() -> None:
    assert sum(len(_commands(p)) for p in ALL) > 100


# --- the desk's options table -----------------------------------------------------------------------------


def test_desk_option_table_matches_undolog_serve() -> None:
    serve = _root().commands["serve"]
    by_opt = {o: p for p in serve.params for o in [*p.opts, *p.secondary_opts]}
    text = _text("how-to/desk.md")
    rows = re.findall(r"^\|\s*(`--[^|]*?)\s*\|([^|]*)\|(.*)\|\s*$", text, re.M)
    assert len(rows) >= 12, rows
    for opts, env, meaning in rows:
        names = re.findall(r"--[a-z-]+", opts)
        for name in names:
            assert name in by_opt, f"desk.md: `undolog serve` has no option {name}"
        param = by_opt[names[0]]
        envvar = param.envvar if isinstance(param.envvar, str) else (param.envvar or [None])[0]
        shown_env = env.strip().strip("`") or None
        assert shown_env == envvar, f"desk.md: {names[0]} reads {envvar!r}, the table says {shown_env!r}"
        clause = re.search(r"\(default([^)]*)\)", meaning)
        m = re.search(r"\d[\d.]*", clause.group(1).split("=")[-1]) if clause else None
        default = getattr(param.default, "value", param.default)
        if m and names[0] not in ("--host", "--db"):
            assert default is not None and float(m.group(0)) == float(default), (
                f"desk.md: {names[0]} defaults to {default!r}, the table says {m.group(0)}")


# --- environment variables --------------------------------------------------------------------------------


def test_every_environment_variable_the_docs_name_is_read_by_the_code() -> None:
    from tools.docs_reference import environment_variables

    known = set(environment_variables())
    for page in ALL:
        # A `${NAME}` is the reader's own variable, substituted into a config file (gateway.toml's `database`).
        text = re.sub(r"\$\{[A-Z0-9_]+\}", "", _text(page))
        for name in set(re.findall(r"\bUNDOLOG_[A-Z0-9_]*[A-Z0-9]\b", text)):
            if name.startswith("UNDOLOG_TEST_"):
                continue  # the test suite's own switches, for contributors
            assert name in known, f"{page} names {name}, which no module of UndoLog reads"


# --- error codes ------------------------------------------------------------------------------------------


@cache
def _codes_in_code() -> set[str]:
    """Every quoted snake_case literal of the shipped packages: the codes that can reach a caller are among them."""
    found: set[str] = set()
    for pkg in ("undolog_core", "undolog_server", "undolog_mcp", "undolog_adapters"):
        for path in (ROOT / pkg).rglob("*.py"):
            found.update(re.findall(r"""["']([a-z]+(?:_[a-z0-9]+)+)["']""", path.read_text()))
    from tools.docs_reference import error_classes

    found.update(c.code for c in error_classes())  # type: ignore[attr-defined]
    return found


def test_every_error_code_the_docs_name_exists() -> None:
    for page in ALL:
        for code in set(re.findall(r"error\[([a-z_]+)\]", _text(page))) - {"code"}:
            assert code in _codes_in_code(), f"{page}: error[{code}] is not a code UndoLog raises"
    section = _text("reference/errors.md").split("## HTTP answers", 1)[1]
    for code in re.findall(r"`([a-z]+(?:_[a-z]+)+)`", section):
        if code in ("application_problem",):
            continue
        assert code in _codes_in_code(), f"reference/errors.md names `{code}`, which UndoLog never answers"


def test_the_statuses_the_error_page_gives_core_codes_are_the_desks() -> None:
    from undolog_server.problems import ERROR_STATUS

    section = _text("reference/errors.md").split("## HTTP answers", 1)[1]
    pairs = re.findall(r"`([a-z_]+)` (\d{3})\b", section)
    assert len(pairs) >= 6, pairs
    for code, status in pairs:
        if code in ERROR_STATUS:
            assert ERROR_STATUS[code] == int(status), f"errors.md: {code} is {ERROR_STATUS[code]}, the page says {status}"


# --- the API summary of "How it works" --------------------------------------------------------------------


def test_the_api_summary_names_real_methods_and_keywords(tmp_path: Any) -> None:
    """The summary is not a program (placeholders), so each ``undolog.x.y(kw=...)`` it shows is checked instead."""
    import inspect

    from undolog_core import UndoLog

    [summary] = [b for b in blocks("explanation/how-it-works.md") if b.code.startswith("undolog.approvals.pending()")]
    assert summary.marker and "tests/docs/test_statements.py" in summary.marker[1]
    undolog = UndoLog.open(f"sqlite:///{tmp_path}/summary.db")
    try:
        session = undolog.session(agent_id="bot")
        roots = {"undolog": undolog, "s": session}
        calls = re.findall(r"\b(undolog(?:\.[a-z_]+)+|s\.[a-z_]+)\(([^()]*)\)", summary.code)
        # ".approve(id, ...)" continues the line's "undolog.approvals." chain
        for line in summary.code.splitlines():
            m = re.match(r"(undolog\.[a-z_]+)\.", line)
            if m:
                calls += [(f"{m.group(1)}.{name}", args) for name, args in re.findall(r";\s*\.([a-z_]+)\(([^()]*)\)", line)]
        assert len(calls) >= 15, calls
        for path, args in calls:
            root, *attrs = path.split(".")
            obj: Any = roots[root]
            for a in attrs:
                assert hasattr(obj, a), f"how-it-works.md: {path}: {type(obj).__name__} has no {a!r}"
                obj = getattr(obj, a)
            params = inspect.signature(obj).parameters
            takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
            for kw in re.findall(r"\b([a-z_]+)=", args):
                assert kw in params or takes_any, f"how-it-works.md: {path}() takes no {kw}="
    finally:
        undolog.close()


# --- the configuration page -------------------------------------------------------------------------------


def _table(page: str, heading: str) -> list[list[str]]:
    """The rows of the first table under ``heading``, as lists of stripped cells (header and rule left out)."""
    rows: list[list[str]] = []
    for line in _text(page).split(heading, 1)[1].splitlines():
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
        elif rows:
            break
    return rows[2:]


def _literal(cell: str) -> Any:
    import ast

    value = cell.split(",")[0].strip().strip("`")
    return ast.literal_eval(value.replace("false", "False").replace("true", "True"))


def test_configuration_page_open_arguments_and_defaults(tmp_path: Any) -> None:
    import inspect

    from undolog_core import UndoLog

    params = inspect.signature(UndoLog.open).parameters
    rows = _table("reference/configuration.md", "## `UndoLog.open`")
    assert len(rows) >= 6, rows
    for name, default, _ in rows:
        name = name.strip("`")
        assert name in params, f"configuration.md: UndoLog.open takes no {name}"
        if name not in ("url", "schema"):
            assert _literal(default) == params[name].default, f"configuration.md: {name} defaults to {params[name].default!r}"


def test_configuration_page_policy_defaults(tmp_path: Any) -> None:
    from undolog_core import UndoLog

    undolog = UndoLog.open(f"sqlite:///{tmp_path}/policy.db")
    try:
        policy = undolog.policy.get()
    finally:
        undolog.close()
    rows = _table("reference/configuration.md", "## The approval policy")
    assert len(rows) >= 4, rows
    for name, default, _ in rows:
        name = name.strip("`")
        assert hasattr(policy, name), f"configuration.md: the policy has no {name}"
        assert _literal(default) == getattr(policy, name), f"configuration.md: {name} defaults to {getattr(policy, name)!r}"


def test_configuration_page_environment_equivalents() -> None:
    """Each variable's equivalent option exists, and where the CLI binds the variable, it binds it to that option."""
    bound: dict[str, set[str]] = {}
    options: set[str] = set()

    def walk(cmd: Any) -> None:
        for p in cmd.params:
            options.update(p.opts)
            env = [p.envvar] if isinstance(p.envvar, str) else list(p.envvar or [])
            for e in env:
                bound.setdefault(e, set()).update(p.opts)
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)

    walk(_root())
    rows = _table("reference/configuration.md", "## Environment variables")
    assert len(rows) >= 15, rows
    for variable, _, equivalent in rows:
        names = re.findall(r"`(UNDOLOG_[A-Z_]+)`", variable)
        opts = re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", equivalent)
        for opt in opts:
            assert opt in options, f"configuration.md: no command takes {opt}"
        for name in names:
            if name in bound and opts:
                assert bound[name] & set(opts), f"configuration.md: {name} is bound to {sorted(bound[name])}, not {opts}"


#: Options the docs name that belong to other programs (pytest, npm, the MCP Inspector, the conformance runner).
OTHER_PROGRAMS = {"--long", "--cli", "--no-audit", "--no-fund", "--url", "--help"}


def test_every_option_the_docs_name_is_an_option_of_some_command() -> None:
    """A ``--flag`` named in prose (``--webhook-timeout``) is checked too, against every command of the app."""
    options: set[str] = set()

    def walk(cmd: Any) -> None:
        for p in cmd.params:
            options.update(p.opts)
            options.update(p.secondary_opts)
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)

    walk(_root())
    for page in ALL:
        for opt in set(re.findall(r"(?<![\w/-])(--[a-z][a-z0-9-]*)", _text(page))) - OTHER_PROGRAMS:
            assert opt in options, f"{page} names {opt}, which no `undolog` command takes"
