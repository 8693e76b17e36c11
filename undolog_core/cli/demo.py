"""``undolog demo``: the support-agent demo (its modules live in ``examples/``, not installed)."""

from __future__ import annotations

import enum
import inspect
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import ConfigurationError
from ._root import CliInputError


class Framework(enum.StrEnum):
    langgraph = "langgraph"
    crewai = "crewai"
    semantic_kernel = "semantic-kernel"


_DEMOS = {
    Framework.langgraph: ("examples.support_agent.demo", "langgraph"),
    Framework.crewai: ("examples.crewai_support_crew.demo", "crewai"),
    Framework.semantic_kernel: ("examples.semantic_kernel_support.demo", "semantic-kernel"),
}


def _examples_root() -> Path | None:
    """The folder that holds ``examples/`` (the demos are not an installed package).

    ``$UNDOLOG_EXAMPLES`` (the ``examples`` folder itself) wins; then the current directory; then the
    checkout this CLI runs from (an editable install: ``undolog_core`` sits next to ``examples``).
    """
    candidates = []
    if env := os.environ.get("UNDOLOG_EXAMPLES"):
        candidates.append(Path(env).expanduser().resolve().parent)
    candidates += [Path.cwd(), Path(__file__).resolve().parents[2]]  # undolog_core/cli/demo.py: the checkout
    for root in candidates:
        if (root / "examples" / "__init__.py").is_file():
            return root
    return None


def _import_demo(module_name: str) -> Any:
    import importlib

    root = _examples_root()
    if root is not None and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(module_name)


def demo(
    framework: Annotated[Framework, typer.Option("--framework", help="Which agent framework runs the demo.")]
    = Framework.langgraph,
    reject: Annotated[bool, typer.Option("--reject", help="Reject the account deletion instead of approving it.")]
    = False,
    interactive: Annotated[
        bool, typer.Option("--interactive", help="Ask you to decide the approval (langgraph only).")
    ] = False,
    model: Annotated[
        str | None, typer.Option("--model", help="A real chat model instead of the scripted one (langgraph only).")
    ] = None,
    demo_db: Annotated[
        str | None, typer.Option("--demo-db", metavar="PATH", help="Keep the demo's SQLite database at PATH.")
    ] = None,
    old_demo_db: Annotated[
        str | None, typer.Option("--db", metavar="PATH", hidden=True, help="Deprecated spelling of --demo-db.")
    ] = None,
) -> None:
    """Run the support-agent demo: a refund, a deletion that waits for approval, and a rollback.

    \f
    The demo modules live in ``examples/`` (found by :func:`_examples_root`, not installed) and pull in
    their framework; they are imported only here so the rest of the CLI works without those extras.
    """
    module_name, extra = _DEMOS[framework]
    if old_demo_db is not None:
        # `demo --db PATH` predates the global `--db URL` that may now follow any command; it keeps working.
        typer.echo("note: `undolog demo --db PATH` is deprecated, use `--demo-db PATH`", err=True)
        if demo_db is not None and demo_db != old_demo_db:
            raise CliInputError("give the demo's database once: --demo-db PATH (--db is its deprecated spelling)")
        demo_db = old_demo_db
    if framework is not Framework.langgraph and (interactive or model):
        raise CliInputError(f"--interactive and --model apply to the langgraph demo only, not {framework.value}")
    try:
        module = _import_demo(module_name)
    except ImportError as exc:
        where = "" if _examples_root() else (
            "; the demos live in the repository's examples/ folder: run from the checkout or set "
            "UNDOLOG_EXAMPLES=/path/to/examples"
        )
        raise ConfigurationError(
            f"the {framework.value} demo cannot be loaded ({exc}); install it with: pip install "
            f"'undolog[{extra}]'{where}"
        ) from None
    run = module.main
    if framework is Framework.langgraph:
        code = run(reject=reject, interactive=interactive, model=model, db_path=demo_db)
    else:
        kwargs: dict[str, Any] = {"reject": reject}
        if demo_db is not None:
            if "database_url" not in inspect.signature(run).parameters:
                raise CliInputError(f"the {framework.value} demo does not take --demo-db")
            kwargs["database_url"] = demo_db if "://" in demo_db else f"sqlite:///{Path(demo_db).resolve()}"
        code = run(**kwargs)
    raise typer.Exit(int(code or 0))
