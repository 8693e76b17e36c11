"""Signed audit checkpoints: the chain head, signed with an Ed25519 key that lives outside the database.

The hash chain alone proves nothing against someone who can write the database: they can edit an event
with the triggers disabled and recompute every later hash. A checkpoint pins the head (position and
hash) with a signature only the holder of the private key can make, and is kept outside the database
(a directory, a bucket with object lock, another machine). ``verify`` with the checkpoints then refuses
any chain whose event at a signed position does not have the signed hash, so a rewrite of anything up
to the last exported checkpoint is detected even by someone with full database access; events after it
are protected only by the chain until the next checkpoint.

Checkpoint file (one JSON document)::

    {"checkpoint": {"format": "undolog-audit-checkpoint/2", "position": 42, "hash": "<hex>",
                    "heads": [[1, 42, "<hex>"], [2, 40, "<hex>"]],
                    "created_at": "<ISO 8601, UTC>", "store": "<database URL without password[#schema]>",
                    "key_id": "<hex SHA-256 of the raw public key, first 16 bytes>"},
     "signature": "<base64 Ed25519 signature of the canonical JSON of 'checkpoint'>"}

``heads`` pins every chain's head (chain, last event id, last hash; the audit trail has several chains so that
concurrent writers do not queue on one row); ``position`` is the highest of them and ``hash`` their fold
(``_audit.fold_heads``). Files of format ``/1``, written when there was one chain, pin ``position``/``hash`` of
chain 1, where those events still are, and keep verifying (the other chains read as signed empty).

A checkpoint covers everything below it: its heads are read holding every head row's lock (no append half
done), so ``verify`` refuses any event at or below ``position`` above its chain's signed head (an id in a
sequence gap, a chain empty at signing) and any event in a chain the checkpoint does not name.

Canonical JSON: keys sorted, separators ``,`` and ``:``, UTF-8. ``cryptography`` is imported only here and
only when a key is used (the ``audit`` extra).

Example:
    >>> generate_keypair(Path("/etc/undolog/audit.key"))          # once; keep the private key off the database host
    >>> write_checkpoint(undolog.store, load_private_key(Path("/etc/undolog/audit.key")), Path("/var/lib/undolog/checkpoints"))
    >>> undolog.verify_audit(checkpoints=load_checkpoints(Path("/var/lib/undolog/checkpoints"),
    ...                                                   load_public_key(Path("/etc/undolog/audit.key.pub"))))
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ._audit import AuditReport, SignedHead, fold_heads, verify
from .errors import AuditChainBroken, CheckpointInvalid, ConfigurationError
from .storage import safe_url
from .storage.audit import GENESIS_HASH
from .storage.schema import AUDIT_CHAINS

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

    from .storage import Storage

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_FORMAT_V1",
    "AUDIT_EXTRA_HINT",
    "AuditChainBroken",
    "Checkpoint",
    "CheckpointInvalid",
    "generate_keypair",
    "load_checkpoints",
    "load_private_key",
    "load_public_key",
    "make_checkpoint",
    "verify_with_checkpoints",
    "write_checkpoint",
]

CHECKPOINT_FORMAT = "undolog-audit-checkpoint/2"
#: The single-chain format, still read.
CHECKPOINT_FORMAT_V1 = "undolog-audit-checkpoint/1"
AUDIT_EXTRA_HINT = "signed audit checkpoints need the audit extra: pip install 'undolog[audit]'"


@dataclass(frozen=True)
class Checkpoint:
    """The signed heads of every chain, as written to a file.

    Attributes:
        position: The highest event id of the heads (0 for an empty trail).
        hash: The fold of the heads (``_audit.fold_heads``).
        created_at: When it was signed (UTC, ISO 8601).
        store: Which database it was taken from (URL without password, ``#schema`` on PostgreSQL).
        key_id: Fingerprint of the public key that verifies it.
        signature: Base64 Ed25519 signature over :meth:`signed_bytes`.
        source: The file it was read from (empty before it is written).
        heads: Every chain's head: (chain, last event id, last hash).
        format: The file format (``CHECKPOINT_FORMAT``, or ``CHECKPOINT_FORMAT_V1`` for an older file).
    """

    position: int
    hash: str
    created_at: str
    store: str
    key_id: str
    signature: str = ""
    source: str = ""
    heads: tuple[tuple[int, int, str], ...] = ()
    format: str = CHECKPOINT_FORMAT

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "format": self.format,
            "position": self.position,
            "hash": self.hash,
            "created_at": self.created_at,
            "store": self.store,
            "key_id": self.key_id,
        }
        if self.format != CHECKPOINT_FORMAT_V1:
            body["heads"] = [list(h) for h in self.heads]
        return body

    def signed_bytes(self) -> bytes:
        """The exact bytes signed: canonical JSON of :meth:`body`."""
        return json.dumps(self.body(), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()

    def to_json(self) -> str:
        return json.dumps({"checkpoint": self.body(), "signature": self.signature}, indent=2, sort_keys=True) + "\n"

    def signed_heads(self) -> list[SignedHead]:
        """What ``verify`` compares: one signed head per chain (a ``/1`` file: chain 1's)."""
        source = self.source or f"checkpoint at event {self.position}"
        if self.format == CHECKPOINT_FORMAT_V1:
            # Signed when chain 1 was the only chain: the others were empty then, and are read as signed so.
            return [SignedHead(self.position, self.hash, source, chain=1)] + [
                SignedHead(0, GENESIS_HASH, source, chain=n) for n in range(2, AUDIT_CHAINS + 1)]
        return [SignedHead(pos, h, source, chain=chain) for chain, pos, h in self.heads]


def _crypto() -> Any:
    """The Ed25519 and serialization modules, or a clear error naming the extra."""
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise ConfigurationError(AUDIT_EXTRA_HINT) from None
    return ed25519, serialization


def key_id(public_key: Ed25519PublicKey) -> str:
    """Fingerprint of a public key: hex SHA-256 of its 32 raw bytes, first 16 bytes."""
    _, serialization = _crypto()
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:32]


def generate_keypair(private_path: Path, *, overwrite: bool = False) -> tuple[Path, Path]:
    """Write a new Ed25519 key pair: the private key (PEM, PKCS#8, mode 0600) and ``<file>.pub`` (PEM).

    Args:
        private_path: Where the private key goes; the public key goes next to it with ``.pub`` appended.
        overwrite: Replace existing files (off: refuse, a lost private key cannot be recovered).

    Returns:
        (private key path, public key path).

    Raises:
        ConfigurationError: A file exists already, or the ``audit`` extra is missing.
    """
    ed25519, serialization = _crypto()
    public_path = private_path.with_name(private_path.name + ".pub")
    for p in (private_path, public_path):
        if p.exists() and not overwrite:
            raise ConfigurationError(f"{p} exists already; refusing to overwrite a key (pass --force to replace it)")
    key = ed25519.Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    private_path.parent.mkdir(parents=True, exist_ok=True)
    # Created 0600 from the start: never readable by others, not even for a moment.
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(private_pem)
    public_path.write_bytes(public_pem)
    return private_path, public_path


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """Read an Ed25519 private key (PEM, unencrypted PKCS#8) written by :func:`generate_keypair`."""
    ed25519, serialization = _crypto()
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointInvalid(f"cannot read the private key {path}: {exc}") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise CheckpointInvalid(f"{path} is not an Ed25519 private key")
    return cast("Ed25519PrivateKey", key)


def load_public_key(path: Path) -> Ed25519PublicKey:
    """Read an Ed25519 public key (PEM); a private key file is accepted too (its public half is used)."""
    ed25519, serialization = _crypto()
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CheckpointInvalid(f"cannot read the public key {path}: {exc}") from None
    try:
        key: Any = serialization.load_pem_public_key(data)
    except ValueError:
        try:
            key = serialization.load_pem_private_key(data, password=None).public_key()
        except (ValueError, TypeError) as exc:
            raise CheckpointInvalid(f"{path} is not a PEM Ed25519 key: {exc}") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise CheckpointInvalid(f"{path} is not an Ed25519 public key")
    return cast("Ed25519PublicKey", key)


def store_identity(storage: Storage) -> str:
    """Which database a checkpoint was taken from: URL without password, ``#schema`` on PostgreSQL."""
    schema = getattr(storage, "schema", None)
    return safe_url(str(getattr(storage, "url", ""))) + (f"#{schema}" if schema else "")


def make_checkpoint(
    storage: Storage, key: Ed25519PrivateKey, *, previous: Sequence[SignedHead] = (), now: dt.datetime | None = None
) -> Checkpoint:
    """Verify the chain (against earlier signed heads too) and sign its head.

    Raises:
        AuditChainBroken: The chain is not intact, or differs from an earlier checkpoint: nothing is signed.
    """
    # Every head read under its lock: a cut with no append half done (see ``store.audit.locked_heads``). The chain is
    # then verified as it stands (appends may have gone on since) and must hold those heads, under the rule the
    # checkpoint will be held to: nothing at or below its position outside a chain's signed range.
    heads = tuple((h.chain, h.last_event_id, h.last_hash) for h in storage.audit.locked_heads())
    pending = [SignedHead(p, h, "the heads being signed", chain=c) for c, p, h in heads]
    report = verify(storage, checkpoints=[*previous, *pending])
    if not report.ok:
        raise AuditChainBroken(
            f"audit chain broken at event {report.first_bad_event_id}: {report.problem}; not signing its head"
        )
    position, last_hash = max((p for _, p, _ in heads), default=0), fold_heads(heads)
    created = (now or dt.datetime.now(dt.UTC)).astimezone(dt.UTC).isoformat(timespec="seconds")
    unsigned = Checkpoint(position, last_hash, created, store_identity(storage), key_id(key.public_key()),
                          heads=heads)
    signature = base64.b64encode(key.sign(unsigned.signed_bytes())).decode("ascii")
    return dataclasses.replace(unsigned, signature=signature)


def write_checkpoint(
    storage: Storage, key: Ed25519PrivateKey, out_dir: Path, *, now: dt.datetime | None = None
) -> Path:
    """Sign the chain head and write it to ``out_dir`` as ``checkpoint-<position>-<timestamp>.json``.

    The newest checkpoint already in ``out_dir`` is checked first, so a chain rewritten since then is
    refused instead of signed again. The file is written to a temporary name and renamed, so a reader
    never sees half of one.

    Returns:
        The file written.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The newest checkpoint is enough: it was signed only after the chain matched every earlier one, and a
    # chain that is intact and matches it has, up to it, exactly the events it had then.
    names = sorted(out_dir.glob("checkpoint-*.json"))
    previous = read_checkpoint(names[-1], key.public_key()).signed_heads() if names else []
    cp = make_checkpoint(storage, key, previous=previous, now=now)
    stamp = cp.created_at.replace(":", "").replace("-", "").replace("+0000", "Z")
    name = f"checkpoint-{cp.position:012d}-{stamp}-{os.getpid()}.json"
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=_WRITING, suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(cp.to_json())
            fh.flush()
            os.fsync(fh.fileno())
        target = _keep_beside(Path(tmp), out_dir, name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _keep_beside(tmp: Path, out_dir: Path, name: str) -> Path:
    """Give the whole file ``tmp`` its name without replacing a checkpoint already there: two signed in the same
    second at the same position by one process have the same name, and the second used to overwrite the first (a
    signed checkpoint lost; CI caught it as 14 checkpoints of 15). The second is kept as ``<name>-2.json`` (and so
    on); both sign the same heads, so which of them the next checkpoint reads first does not matter."""
    stem = name.removesuffix(".json")
    for n in range(1, 1000):
        target = out_dir / (name if n == 1 else f"{stem}-{n}.json")
        try:
            os.link(tmp, target)  # fails if the name is taken: never replaces
        except FileExistsError:
            continue
        except OSError:  # a file system without hard links: the rename, after a look
            if target.exists():
                continue
            os.replace(tmp, target)
            return target
        tmp.unlink()
        return target
    raise FileExistsError(f"{out_dir}: 999 checkpoints named {name}; remove the duplicates")


#: The name prefix of a checkpoint file still being written (renamed to ``checkpoint-*.json`` once whole).
_WRITING = ".tmp-"


def read_checkpoint(path: Path, public_key: Ed25519PublicKey) -> Checkpoint:
    """Read one checkpoint file and check its signature with ``public_key``.

    Raises:
        CheckpointInvalid: Unreadable, malformed, another format, or not signed by this key.
    """
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        body, signature = doc["checkpoint"], doc["signature"]
        fmt = body.get("format")
        if fmt not in (CHECKPOINT_FORMAT, CHECKPOINT_FORMAT_V1):
            raise ValueError(f"unknown format {fmt!r}")
        heads: tuple[tuple[int, int, str], ...] = ()
        if fmt == CHECKPOINT_FORMAT:
            heads = tuple((int(c), int(p), str(h)) for c, p, h in body["heads"])
        cp = Checkpoint(
            position=int(body["position"]),
            hash=str(body["hash"]),
            created_at=str(body["created_at"]),
            store=str(body["store"]),
            key_id=str(body["key_id"]),
            signature=str(signature),
            source=str(path),
            heads=heads,
            format=str(fmt),
        )
        raw_signature = base64.b64decode(cp.signature, validate=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointInvalid(f"checkpoint {path} is unreadable: {exc}") from None
    from cryptography.exceptions import InvalidSignature

    try:
        public_key.verify(raw_signature, cp.signed_bytes())
    except InvalidSignature:
        raise CheckpointInvalid(f"checkpoint {path} is not signed by this key (or was edited)") from None
    return cp


def load_checkpoints(directory: Path, public_key: Ed25519PublicKey) -> list[Checkpoint]:
    """Every ``*.json`` checkpoint in ``directory``, each signature checked, by position.

    Raises:
        CheckpointInvalid: The directory is missing, or any file in it fails its signature (a forged or
            edited checkpoint is itself a sign of tampering, so it is never skipped silently).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointInvalid(f"no checkpoint directory {directory}")
    # Not a checkpoint being written (write_checkpoint's temporary file, renamed once whole): read half-written, it
    # failed the verification of a store that was intact. pathlib's glob matches names starting with a dot.
    files = sorted(p for p in directory.glob("*.json") if not p.name.startswith(_WRITING))
    return sorted((read_checkpoint(p, public_key) for p in files), key=lambda c: c.position)


def verify_with_checkpoints(storage: Storage, directory: Path, public_key: Ed25519PublicKey) -> AuditReport:
    """Verify the chain and every signed head in ``directory``; a bad checkpoint file fails the report.

    Example:
        >>> verify_with_checkpoints(undolog.store, Path("checkpoints"), load_public_key(Path("audit.key.pub"))).ok
        True
    """
    try:
        checkpoints = load_checkpoints(directory, public_key)
    except CheckpointInvalid as exc:
        return AuditReport(False, 0, None, exc.message)
    report = verify(storage, checkpoints=[h for c in checkpoints for h in c.signed_heads()])
    # Counted in files, not in the chains each of them pins.
    return dataclasses.replace(report, checkpoints_checked=len(checkpoints)) if report.ok else report
