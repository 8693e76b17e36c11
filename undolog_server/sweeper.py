"""Background loops of one server process: the sweeper and the webhook sender.

Each server runs its own loops. Work is shared through the database: the core's
``expire_due`` and ``recover`` claim rows with ``FOR UPDATE SKIP LOCKED`` on PostgreSQL,
and the webhook fan-out and delivery leases here do the same, so two servers never
handle one timeout or send one delivery twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import httpx

from undolog_core import RecoveryReport
from undolog_core.errors import UndoLogError

from .webhooks import WebhookDispatcher

if TYPE_CHECKING:
    from .state import ServerState

log = logging.getLogger("undolog.server.sweeper")


class Sweeper:
    """Expires due approvals, runs recovery, escalates and fans out outbox events.

    Args:
        state: The server state.
    """

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.webhooks = WebhookDispatcher(state)
        if state.slack is not None:
            self.webhooks.consumers.append(state.slack.consumer)
        self._last_recover = 0.0
        self._tasks: list[asyncio.Task[Any]] = []
        self._stop = asyncio.Event()

    def tick(self, *, force_recover: bool = False) -> dict[str, int]:
        """Run one sweep synchronously (what the loop does every ``sweep_interval``).

        Returns:
            Counts of what this tick did.
        """
        undolog = self.state.undolog
        counts = {"expired": 0, "lapsed": 0, "recovered": 0, "escalated": 0, "events": 0}
        counts["expired"] = len(undolog.approvals.expire_due() or ())
        # Approvals whose call was not re-issued within the policy's approved_ttl_seconds become `expired`.
        counts["lapsed"] = len(undolog.approvals.lapse_due() or ())
        now = time.monotonic()
        if force_recover or now - self._last_recover >= self.state.settings.recover_interval:
            self._last_recover = now
            report = undolog.recover()
            counts["recovered"] = _count(report)
        counts["escalated"] = self.webhooks.escalate()
        # Fan out after expiring, so a timeout's event leaves in the same tick.
        counts["events"] = self.webhooks.fan_out()
        if self.state.slack is not None:
            try:
                counts.update({f"slack_{k}": v for k, v in self.state.slack.tick().items()})
            except Exception:
                # Slack down or misconfigured must not stop expiry, recovery and webhooks.
                log.exception("Slack pass failed; retrying next sweep")
        for k, v in counts.items():
            self.state.stats[k] = self.state.stats.get(k, 0) + v
        return counts

    async def start(self) -> None:
        """Start the loops on the running event loop."""
        self._stop.clear()
        self._tasks = [
            asyncio.create_task(self._sweep_loop(), name="undolog-sweeper"),
            asyncio.create_task(self._webhook_loop(), name="undolog-webhooks"),
        ]
        self._tasks += [asyncio.create_task(loop(self._stop), name="undolog-loop")
                        for loop in self.state.background_loops]
        if self.state.settings.audit_checkpoint_key and self.state.settings.audit_checkpoint_dir:
            self._tasks.append(asyncio.create_task(self._checkpoint_loop(), name="undolog-audit-checkpoints"))

    async def stop(self) -> None:
        """Stop the loops, letting an in-flight sweep finish."""
        self._stop.set()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)
        except TimeoutError:
            pass

    async def _sweep_loop(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.to_thread(self.tick)
            except Exception:
                # A failing sweep (database restarting, say) must not end the loop.
                log.exception("sweep failed; retrying next interval")
            await self._sleep(self.state.settings.sweep_interval)

    def checkpoint(self) -> str:
        """Sign the audit chain head into the checkpoint directory now, and send it to the targets
        subscribed to ``audit.checkpoint``; returns the file written.

        Raises:
            AuditChainBroken: The chain is broken or was rewritten since the last checkpoint (nothing signed).
        """
        s = self.state.settings
        assert s.audit_checkpoint_key and s.audit_checkpoint_dir
        path = self.state.undolog.checkpoint_audit(key=s.audit_checkpoint_key, out=s.audit_checkpoint_dir)
        # A second copy away from this host, for the targets that asked for it.
        self.webhooks.announce_checkpoint(path)
        return path

    async def _checkpoint_loop(self) -> None:
        while not self._stop.is_set():
            try:
                path = await asyncio.to_thread(self.checkpoint)
                log.info("audit checkpoint written: %s", path)
                self.state.stats["audit_checkpoints"] = self.state.stats.get("audit_checkpoints", 0) + 1
            except UndoLogError as exc:
                # A broken chain is the alarm this exists for: say it loudly, every interval, and sign nothing.
                log.error("audit checkpoint refused: %s", exc.message)
            except Exception:
                log.exception("audit checkpoint failed; retrying next interval")
            await self._sleep(self.state.settings.audit_checkpoint_interval)

    async def _webhook_loop(self) -> None:
        inflight: set[asyncio.Task[None]] = set()
        async with httpx.AsyncClient(follow_redirects=False) as client:
            try:
                while not self._stop.is_set():
                    started: list[asyncio.Task[None]] = []
                    try:
                        started = await self.webhooks.start_due(client, inflight)
                    except Exception:
                        log.exception("webhook delivery pass failed; retrying")
                    if not started:
                        await self._sleep(self.state.settings.webhook_interval)
            finally:
                # Sends still in flight get their timeout to finish; an unfinished one keeps its lease
                # and is sent again by whichever server claims it after the lease runs out.
                if inflight:
                    await asyncio.wait(set(inflight), timeout=self.state.settings.webhook_timeout)
                for t in list(inflight):
                    t.cancel()


def _count(report: RecoveryReport | None) -> int:
    """How many effects and rollbacks a recovery run took care of."""
    if report is None:
        return 0
    return len(report.reconciled) + len(report.rollbacks_resumed)
