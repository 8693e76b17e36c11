"""How the ``undolog`` commands show things: JSON, Rich tables that fit the terminal, progress, and user data made
inert for the terminal (arguments and reasons come from agents and models).
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import os
import re
from typing import TYPE_CHECKING, Any

import typer

from .._saga import RollbackStep

if TYPE_CHECKING:  # imported where used: every process that imports the CLI (each gateway an MCP client starts,
    # each command) would pay for Rich (about 35 ms) to show nothing with it
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table
    from rich.text import Text

#: Below this many steps a rollback or recovery finishes too fast for a progress bar to help.
PROGRESS_MIN_STEPS = 5

#: How narrow a wrapping column may get before the table drops optional columns instead.
FLEX_WIDTH = 14

#: Width used when stdout is not a terminal (pipes, CI logs, tests): wide enough that 32-character ids
#: never wrap, because a wrapped id cannot be copied back into the next command.
PIPE_WIDTH = 200


def _console(stderr: bool = False) -> Console:
    """A Rich console bound to the current stdout/stderr (CliRunner swaps them per invocation)."""
    from rich.console import Console

    c = Console(stderr=stderr, highlight=False)
    if not c.is_terminal and "COLUMNS" not in os.environ:
        c = Console(stderr=stderr, highlight=False, width=PIPE_WIDTH)
    return c


def _jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)


def _print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=True, default=_jsonable, ensure_ascii=False))


def _when(value: dt.datetime | None) -> str:
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def _compact(value: Any, limit: int | None = 60) -> str:
    text = json.dumps(value, sort_keys=True, default=_jsonable, ensure_ascii=False)
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


# What a terminal would act on rather than show: C0 controls but tab and newline (ESC starts ANSI and OSC sequences,
# CR overwrites a line), DEL, C1 controls (0x9b is a one-byte CSI), and the bidirectional overrides that reorder
# what a person reads.
_TERMINAL_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _inert(text: str) -> str:
    """``text`` with every terminal control shown as an escape (``\\x1b``), never sent to the terminal: agent- and
    model-supplied fields (arguments, reasons, errors) reach the operator's terminal through this."""
    return _TERMINAL_CONTROLS.sub(
        lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", text)


def _txt(value: Any) -> Text:
    """User data as literal text: arguments and reasons may contain ``[...]``, which Rich would take as markup, and
    terminal controls (ANSI escapes), which Rich passes through: both shown, neither acted on."""
    from rich.text import Text

    return Text("-" if value is None or value == "" else _inert(str(value)))


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds <= 0:
        return "due"
    d, rem = divmod(seconds, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    parts = [f"{d}d" if d else "", f"{h}h" if h else "", f"{m}m" if m else "", f"{s}s" if s and not d else ""]
    return "in " + " ".join(p for p in parts if p)


_STATE_STYLES = {
    "active": "green", "completed": "green", "committed": "green", "compensated": "cyan", "approved": "green",
    "auto_approved": "yellow", "responded": "cyan", "awaiting_approval": "yellow", "pending": "yellow",
    "halted": "bold red",
    "rolling_back": "yellow",
    "rolled_back": "cyan", "rejected": "red", "timed_out": "red", "cancelled": "dim", "expired": "dim", "failed": "red",
    "unknown": "bold red", "dead_letter": "bold red", "compensation_failed": "bold red",
}


def _state(value: str | None) -> Text:
    from rich.text import Text

    return Text(value or "-", style=_STATE_STYLES.get(value or "", ""))


class _Table:
    """A Rich table that drops optional columns on a narrow terminal instead of squashing every column.

    Ids are never wrapped (a wrapped id cannot be copied into the next command), so on an 80-column
    terminal something has to give: columns with a ``drop`` rank go first, highest rank first.
    """

    def __init__(self, title: str) -> None:
        self.title = title
        self.cols: list[tuple[str, int, dict[str, Any]]] = []
        self.rows: list[tuple[Any, ...]] = []

    def col(self, header: str, *, drop: int = 0, **kw: Any) -> None:
        """Add a column.

        Args:
            header: The column header.
            drop: 0 keeps the column always; otherwise the column's rank for dropping (higher goes first).
            **kw: Passed to :meth:`rich.table.Table.add_column`; text wraps by default rather than being cut.
        """
        kw.setdefault("overflow", "fold")
        self.cols.append((header, drop, kw))

    def row(self, *cells: Any) -> None:
        self.rows.append(cells)

    def render(self, console: Console) -> Table:
        """The table with as many columns as fit the console, dropping ranked columns first."""
        droppable = sorted((i for i, c in enumerate(self.cols) if c[1]), key=lambda i: -self.cols[i][1])
        from rich.table import Table

        dropped: set[int] = set()
        while droppable and self._needed(console, dropped) > console.width:
            dropped.add(droppable.pop(0))
        table = Table(title=self.title)
        for i, (header, _, kw) in enumerate(self.cols):
            if i not in dropped:
                table.add_column(header, **kw)
        for cells in self.rows:
            table.add_row(*(c for i, c in enumerate(cells) if i not in dropped))
        return table

    def _needed(self, console: Console, dropped: set[int]) -> int:
        # A column that may wrap is content with FLEX_WIDTH characters a line; an unwrapped one (ids)
        # needs its full width. 3 characters of padding and border a column, plus the closing border.
        total = 1
        for i, (header, _, kw) in enumerate(self.cols):
            if i in dropped:
                continue
            natural = max([console.measure(header).maximum]
                          + [console.measure(cells[i]).maximum for cells in self.rows if i < len(cells)])
            total += 3 + (natural if kw.get("no_wrap") else min(natural, FLEX_WIDTH))
        return total


def _show(table: _Table, console: Console | None = None) -> None:
    con = console or _console()
    con.print(table.render(con))


def _kv(rows: list[tuple[str, Any]]) -> Table:
    from rich.table import Table
    from rich.text import Text

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for k, v in rows:
        grid.add_row(k, v if isinstance(v, Text) else _txt(v))
    return grid


class _Progress:
    """Progress of a rollback or recovery: a Rich bar on a terminal, one line per step otherwise.

    Used as the ``progress(done, total, step)`` callback of the saga and of recovery. Short runs show
    nothing; on a pipe (CI logs) a line per step is more useful than a bar that cannot redraw.
    """

    def __init__(self, what: str, *, enabled: bool = True) -> None:
        self._what = what
        self._enabled = enabled
        self._console = _console(stderr=True)
        self._bar: Progress | None = None
        self._task: Any = None

    def start(self, total: int) -> None:
        """Show the bar before the first step, when the number of steps is known up front.

        Args:
            total: How many steps the run will take.
        """
        if not self._enabled or total < PROGRESS_MIN_STEPS or not self._console.is_terminal or self._bar:
            return
        from rich.markup import escape
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        # The current step goes last, where Rich may cut it; the bar and the count always stay visible.
        self._bar = Progress(TextColumn("{task.description}"), BarColumn(bar_width=30), MofNCompleteColumn(),
                             TimeElapsedColumn(), TextColumn("{task.fields[step]}"), console=self._console)
        self._bar.start()
        self._task = self._bar.add_task(escape(self._what), total=total, step="")

    def __call__(self, done: int, total: int, step: Any) -> None:
        if not self._enabled or total < PROGRESS_MIN_STEPS:
            return
        text = _describe_step(step)
        if self._console.is_terminal:
            from rich.markup import escape

            self.start(total)
            assert self._bar is not None
            self._bar.update(self._task, completed=done, total=total, step=escape(_short_step(step)))
        else:
            self._console.print(f"[{done}/{total}] {text}", markup=False, highlight=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _short_step(step: Any) -> str:
    if isinstance(step, RollbackStep):
        return f"{step.tool_name}: {step.outcome}"
    return str(step)


def _describe_step(step: Any) -> str:
    if isinstance(step, RollbackStep):
        text = f"{step.compensation_name} of {step.tool_name} ({step.effect_id}): {step.outcome}"
        return text + (f" - {step.error}" if step.error else "")
    return str(step)
