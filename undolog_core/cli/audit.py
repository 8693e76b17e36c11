"""``undolog audit verify|keygen|checkpoint``: the hash-chained audit trail and its signed checkpoints."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from ._output import _print_json
from ._root import JsonOpt, _fail, _open

audit_app = typer.Typer(help="The hash-chained audit trail.", no_args_is_help=True)


@audit_app.command("verify")
def audit_verify(
    ctx: typer.Context,
    checkpoints: Annotated[
        Path | None,
        typer.Option("--checkpoints", help="Directory of signed checkpoints the chain must match (see 'checkpoint')."),
    ] = None,
    public_key: Annotated[
        Path | None,
        typer.Option("--public-key", envvar="UNDOLOG_AUDIT_PUBLIC_KEY",
                     help="Ed25519 public key (PEM) that signed the checkpoints ('audit keygen' wrote <key>.pub)."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Recompute the audit hash chain (and match it against signed checkpoints); exit 1 when tampered with."""
    if checkpoints is not None and public_key is None:
        # Never taken from the checkpoint directory: whoever can write there could swap both.
        _fail("invalid_input", "--checkpoints needs the public key that signed them: --public-key FILE")
    u = _open(ctx)
    report = u.verify_audit(checkpoints=checkpoints, public_key=public_key)
    if as_json:
        _print_json(asdict(report))
    elif report.ok:
        signed = f", matching {report.checkpoints_checked} signed checkpoint(s)" if checkpoints is not None else ""
        typer.echo(f"audit chain intact: {report.events_checked} event(s) checked{signed}")
    if not report.ok:
        typer.echo(
            f"audit chain BROKEN at event {report.first_bad_event_id}: {report.problem} "
            f"({report.events_checked} event(s) checked)",
            err=True,
        )
        raise typer.Exit(1)


@audit_app.command("keygen")
def audit_keygen(
    key: Annotated[Path, typer.Option("--key", help="Where to write the private key; the public key goes to <key>.pub.")],
    force: Annotated[bool, typer.Option("--force", help="Replace existing key files.")] = False,
) -> None:
    """Write a new Ed25519 key pair for signed audit checkpoints (keep the private key off the database host)."""
    from .._checkpoints import generate_keypair

    private, public = generate_keypair(key, overwrite=force)
    typer.echo(f"private key: {private} (mode 0600; only the checkpointing process may read it)")
    typer.echo(f"public key:  {public} (give it to whoever runs 'undolog audit verify --checkpoints')")


@audit_app.command("checkpoint")
def audit_checkpoint(
    ctx: typer.Context,
    key: Annotated[Path, typer.Option("--key", envvar="UNDOLOG_AUDIT_KEY", help="Ed25519 private key (PEM).")],
    out: Annotated[Path, typer.Option("--out", help="Directory (outside the database) to write the checkpoint into.")],
    as_json: JsonOpt = False,
) -> None:
    """Verify the chain, then sign its head and write the signed checkpoint into --out (run it on a schedule)."""
    from .._checkpoints import load_private_key, write_checkpoint

    private = load_private_key(key)  # before opening the database: a bad key is the first thing to report
    u = _open(ctx)
    path = write_checkpoint(u.store, private, out)
    doc = json.loads(path.read_text(encoding="utf-8"))["checkpoint"]
    if as_json:
        _print_json({"file": str(path), **doc})
    else:
        typer.echo(f"signed the chain head at event {doc['position']} ({doc['hash'][:16]}…) into {path}")
