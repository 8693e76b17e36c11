"""The public facade."""

from __future__ import annotations

import os
import sqlite3
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ._approvals import ApprovalService
from ._audit import AuditReport, verify
from ._driver import CallDriver
from ._engine import Engine
from ._leases import Leases
from ._outbox import OutboxService
from ._owners import SessionOwners
from ._policy import PolicyService
from ._recovery import Recovery, RecoveryReport
from ._registry import Registry
from ._saga import RollbackReport, Saga
from ._session import Session, SessionService
from ._session_record import check_id
from ._sessions_table import DEFAULT_MAX_SESSIONS
from ._tools import RetryPolicy, ToolSpec, ToolTier, make_declaration
from .errors import ConfigurationError, DatabaseOpenFailed, DatabaseUnavailable, InvalidDeclaration
from .storage import DATABASE_ERRORS, Storage, database_error_detail, open_storage, safe_url, sqlite_file
from .storage.base import new_id
from .storage.effects import Resolution
from .storage.schema import OnFailure, SessionState


class UndoLog:
    """One UndoLog per process and database.

    Its services for app authors are ``approvals``, ``sessions``, ``policy``, ``registry`` and ``outbox``; the
    packages built on the core use ``driver`` and ``undolog_core.integration`` besides. ``engine`` and ``leases``
    are the core's own wiring, in no contract, as are ``store`` (but its ``url``, ``schema``, ``dialect`` and
    ``max_connections``) and ``saga`` (but its ``undo_plan``): the core's own tests reach them.

    Example:
        >>> undolog = UndoLog.open("sqlite:///undolog.db")
        >>> undolog.register(search_knowledge_base, send_refund_email, cancel_refund_email)
        >>> async with undolog.session(agent_id="support-bot") as s:
        ...     await s.call(send_refund_email, user_id="u1", amount=25)
    """

    def __init__(
        self,
        store: Storage,
        *,
        fast_commit_mark: bool = False,
        lease_seconds: float = 30.0,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        if lease_seconds <= 0:
            raise ConfigurationError("lease_seconds must be positive")
        if not isinstance(store, Storage):
            raise ConfigurationError(
                f"UndoLog works on a Storage (undolog_core.storage.open_storage), not a {type(store).__name__}"
            )
        self.store = store
        self.fast_commit_mark = fast_commit_mark
        self.lease_seconds = float(lease_seconds)
        self.leases = Leases(store, self.lease_seconds)
        # The services get what they use, not this facade: the storage, each other, and small hooks that keep the
        # engine's in-memory session caches in step with the states they write (bound late: the engine comes after).
        self.registry = Registry(store.registry, note_state=self._note_state)
        self.policy = PolicyService(store.policy)
        self.approvals = ApprovalService(store, self.registry, note_state=self._note_state)
        self.engine = Engine(store, self.registry, self.policy, self.approvals, self.leases,
                             fast_commit_mark=fast_commit_mark, max_sessions=max_sessions)
        self.saga = Saga(store, self.registry, self.leases, self.approvals, flush_marks=self.engine.flush_marks,
                         note_state=self.engine.note_state, persist=self.engine.persist)
        self.driver = CallDriver(self.engine, self.saga, self.registry.spec_for)
        self.sessions = SessionService(
            store,
            flush_marks=self.engine.flush_marks,
            current_pins=self.engine.current_pins,
            note_state=self.engine.note_state,
            note_pins=self._note_pins,
            persist=self.engine.persist,
        )
        self.outbox = OutboxService(store.outbox)
        self.owners = SessionOwners(store, self.leases)
        self._recovery = Recovery(store, self.registry, self.saga, self.leases, flush_marks=self.engine.flush_marks,
                                  note_state=self.engine.note_state)
        # A call whose outcome its caller cannot tell (a lost connection mid-call) is settled at once, as recovery
        # would settle it after a crash.
        self.driver.in_doubt = self._recovery.settle_in_doubt
        # A call that finished after it was taken over is recorded by the engine; its probe is then asked (and its
        # answer audited) to inform the person who resolves it.
        self.engine.on_late_finish = self._recovery.probe_late_finish

    @classmethod
    def open(
        cls,
        url: str | None = None,
        *,
        schema: str | None = None,
        fast_commit_mark: bool = False,
        lease_seconds: float = 30.0,
        migrate: bool = True,
        pool_size: int = 5,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> UndoLog:
        """Open (and migrate) the store.

        Args:
            url: ``sqlite:///path.db`` or ``postgresql+psycopg://user@host/db``; default ``$UNDOLOG_DATABASE_URL``,
                else ``./undolog.db``.
            schema: PostgreSQL schema to use (default ``$UNDOLOG_SCHEMA``, else the search path).
            fast_commit_mark: do not fsync the commit mark after a tool ran; recovery reconciles a lost mark
                through the tool's probe (without a probe, the effect is compensated).
            lease_seconds: how long an in-flight call's lease lasts; renewed at a third of it.
            pool_size: connections per pool; ``undolog.store.max_connections`` is the most UndoLog ever holds,
                however many threads call it.
            max_sessions: how many sessions' records this process keeps in memory (default 10,000), however many
                sessions it serves (a LangGraph thread's session never ends). Past it the oldest are evicted once
                everything they hold is in the store (their call counts, a deferred start; see ``Engine.trim``), and
                read again when used; an adapter's own per-thread maps keep to the same bound.
        """
        store = None
        try:
            store = open_storage(url, schema=schema, pool_size=pool_size)
            if migrate:
                store.migrate()
        except _OPEN_ERRORS as exc:
            where = safe_url(store.url if store is not None else str(url or os.environ.get("UNDOLOG_DATABASE_URL")
                                                                      or "sqlite:///undolog.db"))
            if store is not None:
                store.dispose()
            raise DatabaseOpenFailed(where, database_error_detail(exc), _open_hint(where, exc)) from exc
        return cls(store, fast_commit_mark=fast_commit_mark, lease_seconds=lease_seconds, max_sessions=max_sessions)

    def _note_state(self, session_id: str, state: str) -> None:
        self.engine.note_state(session_id, state)

    def _note_pins(self, session_id: str, pins: Mapping[str, int]) -> None:
        sc = self.engine.cached(session_id)
        if sc is not None:
            sc.pins = dict(pins)

    def close(self) -> None:
        try:
            self.engine.flush_counts()
        finally:
            self.engine.stop()
            self.store.dispose()

    def __enter__(self) -> UndoLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- registration ---------------------------------------------------------------------------

    def register(self, *objs: Any, registered_by: str | None = None) -> list[ToolSpec]:
        """Register ``@undolog_tool`` functions and ``@compensation`` functions. A changed contract is a new revision."""
        return self.registry.register(objs, registered_by=registered_by)

    def register_tool(
        self,
        fn: Callable[..., Any] | None,
        *,
        name: str | None = None,
        tier: ToolTier | str | None = None,
        risk_level: str | None = None,
        compensation: Any = None,
        reason: str | None = None,
        risk_tags: Iterable[str] = (),
        composite_of: Iterable[Any] = (),
        probe: Callable[..., Any] | None = None,
        args_schema: Any = None,
        registered_by: str | None = None,
        binding: Mapping[str, Any] | None = None,
        compensation_needs_result: bool = False,
        retry: RetryPolicy | int | None = None,
    ) -> ToolSpec:
        """Register a third-party callable (or a schema-only tool, ``fn=None``) with a tier given here.

        Example:
            >>> undolog.register_tool(vendor.delete_user, name="delete_user", tier="irreversible",
            ...                       reason="Removes the account", risk_tags=["pii"])
        """
        if fn is None and name is None:
            raise InvalidDeclaration("register_tool needs a function or a name")
        decl = make_declaration(tier=tier, risk_level=risk_level, compensation=compensation, reason=reason,
                               risk_tags=risk_tags, composite_of=composite_of, probe=probe, retry=retry)
        kw: dict[str, Any] = {"name": name, "args_schema": args_schema}
        if binding is not None:
            kw["binding"] = binding
        if compensation_needs_result:
            kw["compensation_needs_result"] = True
        spec = self.registry.register([(fn, decl, kw)], registered_by=registered_by)[0]
        comp = spec.compensation
        if comp is not None and comp.name not in self.registry.compensations:
            # Not an error here (the app may register it next), but a rollback reaching this tool's calls stops
            # there if it never is: said now, not at the first rollback.
            warnings.warn(f"{spec.name} names the compensation {comp.name!r}, which is not registered in this process: "
                          f"register it (undolog.register(fn) or register_compensation(fn, name={comp.name!r})) before "
                          "the first rollback", UserWarning, stacklevel=2)
        return spec

    def register_compensation(self, fn: Callable[..., Any], *, name: str | None = None, version: int = 1) -> None:
        self.registry.add_compensation(fn, name=name, version=version if name else None)

    def tool_spec(self, name: str) -> ToolSpec:
        return self.registry.spec_for(name)

    # -- sessions -------------------------------------------------------------------------------

    def session(
        self,
        *,
        agent_id: str | None = None,
        session_id: str | None = None,
        created_by: str | None = None,
        on_failure: OnFailure | str = OnFailure.ROLLBACK,
    ) -> Session:
        """Start a session, or resume one by id (one read).

        ``on_failure="rollback"`` (default) rolls the session back when a COMPENSABLE call fails;
        ``"continue"`` records the failure and lets the caller decide.
        """
        on_failure = OnFailure.coerce(on_failure).value
        if session_id is not None:
            check_id("session_id", session_id)
        if session_id is None:  # a new id: its row is written with its first logged call where the store can
            return Session(self, self.engine.defer_start(new_id(), agent_id=agent_id, created_by=created_by,
                                                         on_failure=on_failure))
        sc = self.engine.cached(session_id)
        if sc is None or not sc.persisted:
            sc = self.engine.ensure_session(session_id, agent_id=agent_id, created_by=created_by,
                                            on_failure=on_failure)
        return Session(self, sc)

    def rollback(self, session_id: str, *, actor: str = "undolog", progress: Any = None,
                 wait: float = 30.0) -> RollbackReport:
        """Roll a session back (sync). See :meth:`arollback` for async compensations in a running loop.

        A session served by a live process (the MCP gateway: ``owners.hold``) is rolled back there, where the
        connections that did the work live: the request is filed for it and this waits up to ``wait`` seconds for
        its report (``RollbackStillRunning`` after that; it goes on there). When that process is gone, the rollback
        runs here and its report says ``ran_without_live_upstream``.

        Example:
            >>> undolog.rollback("ticket-1042", actor="ana", wait=60).complete
            True
        """
        owner, gone = self.owners.live_owner(session_id)
        if owner is not None and self.sessions.get(session_id).state == SessionState.ROLLED_BACK:
            owner, gone = None, False  # nothing to run, anywhere: said at once, without asking the owner
        if owner is not None:
            report = self.owners.delegate(session_id, owner, actor=actor, reason="requested", wait=wait,
                                          gone=lambda: self.owners.live_owner(session_id)[0] is None)
            if report is not None:
                return report
            gone = True
        report = self.saga.rollback_sync(session_id, actor=actor, reason="requested", progress=progress)
        report.ran_without_live_upstream = gone
        return report

    async def arollback(self, session_id: str, *, actor: str = "undolog") -> RollbackReport:
        return await self.saga.rollback(session_id, actor=actor, reason="requested")

    def recover(self, progress: Any = None, *, sessions: Iterable[str] | None = None,
                take_over: Iterable[str] = ()) -> RecoveryReport:
        """Reconcile effects left in flight by crashed processes (docs: "Recovering after a crash").

        ``sessions`` limits it to those sessions (everything in flight by default). ``take_over`` names effects to
        reconcile although their owner still runs on this host (a person's decision: a process stopped for good);
        a call of such a process that finishes afterwards is recorded as a late finish, the effect ``unknown``.

        Example:
            >>> undolog.recover(take_over=["3f2a..."]).reconciled
            [{'effect_id': '3f2a...', 'tool_name': 'send_refund_email', 'outcome': 'compensated'}]
        """
        return self._recovery.recover(progress=progress, sessions=None if sessions is None else set(sessions),
                                      take_over=set(take_over))

    def record_audit(
        self, *, subject: str, action: str, actor: str, payload: Mapping[str, Any],
        approval_request_id: str | None = None,
    ) -> int:
        """Append one event to the audit trail (hash-chained like every decision, checked by :meth:`verify_audit`).

        For what an integration decides or refuses outside the core's own operations: the desk records who mapped a
        Slack user to a key, and every interactivity request it refused (another workspace, an unmapped user).

        Args:
            subject: What the event is about (``slack:T123/U456``, ``approval:<id>``).
            action: What happened (``slack_user_mapped``, ``slack_refused``...).
            actor: Who did it (a key's identity, ``slack:T123/U456``).
            payload: JSON-able details.
            approval_request_id: The request the event belongs to, if any (it then shows in the request's events).

        Returns:
            The event's id.

        Example:
            >>> undolog.record_audit(subject="slack:T1/U2", action="slack_user_mapped", actor="admin (key ab12)",
            ...                      payload={"key_id": "cd34"})
            42
        """
        return int(self.store.audit.append_event(subject=subject, action=action, actor=actor, payload=dict(payload),
                                           approval_request_id=approval_request_id))

    def resolve_effect(self, effect_id: str, *, outcome: str, reason: str, actor: str,
                       principal: str | None = None) -> Resolution:
        """A person settles an ``unknown`` effect (a call that finished after it was taken over, or whose outcome
        nobody could tell): ``outcome`` is ``committed`` (it happened and stands), ``compensated`` (it is undone)
        or ``not_happened``. Every decision is an immutable audit event (``effect.resolved``) with ``actor`` and
        ``reason``. The session stays as it is (halted until a person resumes or rolls it back). ``principal``:
        the decider's principal reference (the desk's ``key:<id>``); the one that created the session is refused.

        Example:
            >>> undolog.resolve_effect("3f2a...", outcome="committed", reason="the refund is in the ledger",
            ...                        actor="ana").state
            'committed'
            >>> undolog.sessions.resume(session_id, actor="ana")
        """
        return self._recovery.resolve(effect_id, outcome, actor=actor, reason=reason, principal=principal)

    def verify_audit(
        self, *, checkpoints: str | os.PathLike[str] | None = None, public_key: str | os.PathLike[str] | None = None
    ) -> AuditReport:
        """Recompute the audit hash chain, and check it against signed checkpoints when given.

        Args:
            checkpoints: A directory of signed checkpoints (``undolog audit checkpoint``); every one must be
                signed by ``public_key`` and match the chain.
            public_key: The Ed25519 public key (PEM) that signed them; required with ``checkpoints``.

        Example:
            >>> undolog.verify_audit(checkpoints="/var/lib/undolog/checkpoints", public_key="audit.key.pub").ok
            True
        """
        if checkpoints is None:
            return verify(self.store)
        if public_key is None:
            raise ConfigurationError("verifying against checkpoints needs the public key that signed them")
        from pathlib import Path

        from ._checkpoints import load_public_key, verify_with_checkpoints

        return verify_with_checkpoints(self.store, Path(checkpoints), load_public_key(Path(public_key)))

    @staticmethod
    def check_checkpoint_key(key: str | os.PathLike[str]) -> None:
        """Read the Ed25519 private key that :meth:`checkpoint_audit` would sign with, and nothing else: a service
        that signs checkpoints on a timer calls it at start, so a key it cannot read fails there, not at the first
        interval.

        Raises:
            CheckpointInvalid: The file cannot be read, or is not an Ed25519 private key (the message says which).

        Example:
            >>> UndoLog.check_checkpoint_key("/etc/undolog/audit.key")
        """
        from pathlib import Path

        from ._checkpoints import load_private_key

        load_private_key(Path(key))

    def checkpoint_audit(self, *, key: str | os.PathLike[str], out: str | os.PathLike[str]) -> str:
        """Sign the verified chain head with the Ed25519 private key in ``key`` and write it into ``out``.

        Returns:
            The checkpoint file written.

        Raises:
            AuditChainBroken: The chain (or its agreement with the checkpoints already in ``out``) is broken.

        Example:
            >>> undolog.checkpoint_audit(key="/etc/undolog/audit.key", out="/var/lib/undolog/checkpoints")
            '/var/lib/undolog/checkpoints/checkpoint-000000000042-20261130T120000Z-4242.json'
        """
        from pathlib import Path

        from ._checkpoints import load_private_key, write_checkpoint

        return str(write_checkpoint(self.store, load_private_key(Path(key)), Path(out)))



# What opening or migrating a store raises when the database will not open (a driver's or SQLAlchemy's error).
_OPEN_ERRORS: tuple[type[BaseException], ...] = (*DATABASE_ERRORS, sqlite3.Error, OSError, DatabaseUnavailable)


def _open_hint(url: str, exc: BaseException) -> str:
    """What to do about a database that would not open, from what the driver said."""
    text = str(getattr(exc, "orig", None) or exc).lower()
    path = sqlite_file(url)
    if path is not None:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            return f"the folder {folder} does not exist: create it, or pass another sqlite:/// path"
        return f"check that {path} is a SQLite database this process can read and write"
    if "password" in text or "authentication" in text:
        return "the server refused the credentials: check the user and password in the URL"
    if "does not exist" in text:
        return "the server has no such database (or schema): create it, or pass the right name in the URL"
    if "connection refused" in text or "could not connect" in text or "timeout" in text or "resolve" in text:
        return "no database server answered there: start it, or fix the host and port in the URL"
    return "check the URL, that the database is running and reachable, and its credentials"
