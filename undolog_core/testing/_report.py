"""What ``check_undo`` found: one report per COMPENSABLE step and per fault point, the diffs, and ``explain()``."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

_MISSING = object()


@dataclass(frozen=True)
class Difference:
    """One place where the world differs from the snapshot it should equal.

    ``path`` names the key or row (``accounts['u1'].email``, ``outbox[2]``); ``expected`` is the value in the
    snapshot the compensation should restore, ``actual`` what the world holds now (``<absent>`` for a key that
    is not there).
    """

    path: str
    expected: Any
    actual: Any

    def __str__(self) -> str:
        return f"{self.path or '<whole snapshot>'}: expected {_show(self.expected)}, got {_show(self.actual)}"


def _show(value: Any) -> str:
    if value is _MISSING:
        return "<absent>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def diff(expected: Any, actual: Any, path: str = "") -> list[Difference]:
    """The differences between two JSON-able values, by key (dicts) and by position (lists).

    Example:
        >>> [str(d) for d in diff({"u1": {"email": "a@x"}}, {"u1": {"email": "b@x"}})]
        ["['u1']['email']: expected 'a@x', got 'b@x'"]
    """
    if isinstance(expected, dict) and isinstance(actual, dict):
        out: list[Difference] = []
        for key in list(expected) + [k for k in actual if k not in expected]:
            sub = f"{path}[{key!r}]"
            if key not in actual:
                out.append(Difference(sub, expected[key], _MISSING))
            elif key not in expected:
                out.append(Difference(sub, _MISSING, actual[key]))
            else:
                out.extend(diff(expected[key], actual[key], sub))
        return out
    if isinstance(expected, list | tuple) and isinstance(actual, list | tuple):
        out = []
        for i in range(max(len(expected), len(actual))):
            sub = f"{path}[{i}]"
            if i >= len(actual):
                out.append(Difference(sub, expected[i], _MISSING))
            elif i >= len(expected):
                out.append(Difference(sub, _MISSING, actual[i]))
            else:
                out.extend(diff(expected[i], actual[i], sub))
        return out
    if expected == actual and type(expected) is type(actual):
        return []
    if isinstance(expected, int | float) and isinstance(actual, int | float) and not isinstance(
        expected, bool
    ) and not isinstance(actual, bool) and expected == actual:
        return []  # 1 and 1.0 are the same number in JSON
    return [Difference(path, expected, actual)]


@dataclass
class StepReport:
    """One COMPENSABLE call of the scenario and what the check found about its compensation.

    Attributes:
        index: 1 for the scenario's first COMPENSABLE call.
        tool, compensation: the tool's name and its compensation's name.
        restored: after this step's own compensation (the first one a rollback right after the step runs), the
            world equals the snapshot taken just before the step (None: not checked).
        diff: where it does not (empty when restored).
        idempotent: running the compensation a second time with the same ``undo-{id}`` key after the rollback
            left the world as it was (None: not checked, the rollback did not succeed).
        tolerates_never_happened: with the process "crashed" after the pre-write and before the tool ran,
            ``recover()`` compensated it and the world equals the snapshot taken before the step.
        errors: what went wrong, in words (a compensation that raised, a refused rollback...).
    """

    index: int
    tool: str
    compensation: str
    restored: bool | None = None
    diff: list[Difference] = field(default_factory=list)
    idempotent: bool | None = None
    idempotency_diff: list[Difference] = field(default_factory=list)
    tolerates_never_happened: bool | None = None
    never_happened_diff: list[Difference] = field(default_factory=list)
    crash_restored: bool | None = None
    crash_tolerates_never_happened: bool | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(v is not False for v in (self.restored, self.idempotent, self.tolerates_never_happened,
                                             self.crash_restored, self.crash_tolerates_never_happened))

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        for key in ("diff", "idempotency_diff", "never_happened_diff"):
            out[key] = [{"path": d.path, "expected": None if d.expected is _MISSING else d.expected,
                         "actual": None if d.actual is _MISSING else d.actual} for d in getattr(self, key)]
        out["ok"] = self.ok
        return out


@dataclass
class FaultPointReport:
    """The scenario stopped right after step ``index``, then rolled back whole by the harness.

    ``restored``: after the whole rollback the world equals the scenario's starting snapshot.
    """

    index: int
    restored: bool | None = None
    diff: list[Difference] = field(default_factory=list)
    rollback_steps: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "restored": self.restored, "diff": [str(d) for d in self.diff],
                "rollback_steps": self.rollback_steps, "errors": self.errors}


@dataclass
class UndoReport:
    """The whole check: ``steps`` (one per COMPENSABLE call, in order) and ``fault_points[k]`` (stopped after
    step k, rolled back whole).

    Example:
        >>> report = check_undo(scenario, snapshot=snap, reset=reset, undolog=ul)   # doctest: +SKIP
        >>> assert report.ok, report.explain()
    """

    steps: list[StepReport] = field(default_factory=list)
    fault_points: dict[int, FaultPointReport] = field(default_factory=dict)
    stopped_before: str | None = None
    scenario_error: str | None = None
    runs: int = 0
    crash: bool = False

    @property
    def ok(self) -> bool:
        """Every step restored, idempotent and tolerant of "never happened", and every fault point restored; and
        the check proved something: the scenario made at least one COMPENSABLE call and did not end with an error
        of its own (a scenario that blew up, or whose tools are not COMPENSABLE, never passes as "nothing to
        check")."""
        return (bool(self.steps) and self.scenario_error is None and all(s.ok for s in self.steps)
                and all(f.restored is not False for f in self.fault_points.values()))

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "steps": [s.to_dict() for s in self.steps],
                "fault_points": {str(k): f.to_dict() for k, f in self.fault_points.items()},
                "stopped_before": self.stopped_before, "scenario_error": self.scenario_error, "runs": self.runs,
                "crash": self.crash}

    # -- explain -----------------------------------------------------------------------------------

    def _rows(self) -> list[list[str]]:
        def mark(v: bool | None) -> str:
            return "-" if v is None else ("yes" if v else "NO")

        rows = []
        for s in self.steps:
            fp = self.fault_points.get(s.index)
            row = [str(s.index), s.tool, s.compensation, mark(s.restored), mark(s.idempotent),
                   mark(s.tolerates_never_happened), mark(fp.restored if fp else None)]
            if self.crash:
                row += [mark(s.crash_restored), mark(s.crash_tolerates_never_happened)]
            rows.append(row)
        return rows

    def _headers(self) -> list[str]:
        heads = ["step", "tool", "compensation", "restored", "idempotent", "never-happened", "to start"]
        if self.crash:
            heads += ["crash restored", "crash never-happened"]
        return heads

    def _details(self) -> list[str]:
        lines: list[str] = []
        for s in self.steps:
            for title, diffs in (("not restored", s.diff), ("not idempotent", s.idempotency_diff),
                                 ("never happened", s.never_happened_diff)):
                if diffs:
                    lines.append(f"step {s.index} {s.tool} ({s.compensation}), {title}:")
                    lines.extend(f"    {d}" for d in diffs)
            lines.extend(f"step {s.index} {s.tool}: {e}" for e in s.errors)
        shown: list[str] | None = None
        for k, f in self.fault_points.items():
            if f.diff:
                text = [f"    {d}" for d in f.diff]
                if text == shown:  # a broken step spoils every later rollback the same way: say it once
                    lines.append(f"stopped after step {k}, rolled back whole: the same difference")
                else:
                    lines.append(f"stopped after step {k}, rolled back whole, the world differs from the start:")
                    lines.extend(text)
                shown = text
            lines.extend(f"stopped after step {k}: {e}" for e in f.errors)
        if self.stopped_before:
            lines.append(f"the checked part ends before {self.stopped_before}")
        if self.scenario_error:
            lines.append(f"the scenario ended with an error: {self.scenario_error} (catch it in the scenario if "
                         "it is expected)")
        if not self.steps:
            lines.append("the scenario made no COMPENSABLE call: nothing was checked")
        lines.append(f"{'OK' if self.ok else 'FAILED'}: {len(self.steps)} step(s), {self.runs} run(s)")
        return lines

    def explain(self, *, color: bool = False, width: int = 120) -> str:
        """The table (step, tool, compensation, restored, idempotent, never-happened) and the diffs, as text.

        Rendered with Rich when it is installed, as a plain table otherwise.
        """
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:  # pragma: no cover - Rich comes with the CLI's dependencies
            return self._plain()
        table = Table(title="undo check")
        for h in self._headers():
            table.add_column(h, no_wrap=h in ("step",))
        for row in self._rows():
            table.add_row(*[(f"[red]{c}[/red]" if c == "NO" else c) for c in row])
        buf = io.StringIO()
        console = Console(file=buf, width=width, force_terminal=color, color_system="auto" if color else None)
        console.print(table)
        for line in self._details():
            # Not folded at the console's width: a line of the notes stays one line (to read, grep or copy).
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        return buf.getvalue()

    def _plain(self) -> str:
        rows = [self._headers(), *self._rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        out = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        return "\n".join(out + self._details()) + "\n"

    def __str__(self) -> str:
        return self.explain()
