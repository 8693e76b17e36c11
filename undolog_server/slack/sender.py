"""The Slack sender: the outbox consumer queuing a request's posts, and the loop posting, updating and escalating them.

The webhook fan-out hands every outbox event to :meth:`SlackSender.consumer` inside the drain's transaction: an
``approval.requested`` event queues one post per channel its approver groups route to, a decision, timeout or expiry
marks the request's posts for an update. :meth:`SlackSender.tick` (the sweeper's) sends what is due with
``slack_sdk``'s Web API client: at least once, ``ratelimited`` answers retried after their ``Retry-After``, each
message carrying the request id in its ``metadata`` so that a retry after a crash looks for the message first
(``conversations.history``) and a duplicate is updated with the original.

Example:
    >>> sender = SlackSender(state, config, client, slack_store(state))
    >>> sender.tick()
    {'escalated': 0, 'sent': 0}
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from undolog_core.records import OutboxEvent

from .. import forms
from ..slack_blocks import arg_leaves, escape, fold, plain
from ..storage.slack import SlackChannel, SlackPost, SlackStore
from ..views import groups_for
from .config import SlackConfig

if TYPE_CHECKING:
    from ..state import ServerState

__all__ = ["METADATA_EVENT", "SlackSender", "slack_store"]

log = logging.getLogger("undolog.server.slack")

#: ``metadata.event_type`` of the messages the desk posts (the request id is in ``event_payload``).
METADATA_EVENT = "undolog_approval_request"


def slack_store(state: Any) -> SlackStore:
    """The Slack tables, on the desk store's handle: they live on the core's store (one pool, one migration run)."""
    return SlackStore(state.store.core)


@dataclass
class SlackSender:
    """What the desk sends to Slack: routing a request to channels, queuing its posts, posting, updating, escalating.

    Args:
        state: The desk's state.
        config: The workspace's configuration.
        client: The ``slack_sdk.WebClient`` it posts with.
        store: The Slack tables (:func:`slack_store`).

    Example:
        >>> SlackSender(state, config, client, slack_store(state)).run_due()
        0
    """

    state: ServerState
    config: SlackConfig
    client: Any
    store: SlackStore

    # ---- routing ----------------------------------------------------------------------------------

    def route(self, tool_name: str, risk_tags: Sequence[str],
              channels: Sequence[SlackChannel] | None = None) -> list[SlackChannel]:
        """The channel configurations of the approver groups a request is routed to (``*`` when none is)."""
        channels = self.store.channels() if channels is None else channels
        by_group = {c.group: c for c in channels}
        names = groups_for(self.state.store.groups(), tool_name, risk_tags)
        chosen = [by_group[g] for g in names if g in by_group]
        if not chosen and "*" in by_group:
            chosen = [by_group["*"]]
        return chosen

    def consumer(self) -> Callable[[Any, OutboxEvent], None]:
        """The outbox consumer (see :class:`undolog_server.webhooks.WebhookDispatcher`): what is read before the
        drain (channels, groups), and the handler run for each event inside the drain's transaction."""
        channels = self.store.channels()
        groups = self.state.store.groups()

        def handle(conn: Any, event: OutboxEvent) -> None:
            data = event.payload or {}
            rid = data.get("approval_request_id")
            if not isinstance(rid, str):
                return
            if event.event_type == "approval.requested":
                by_group = {c.group: c for c in channels}
                names = groups_for(groups, str(data.get("tool_name")), event.risk_tags)
                chosen = [by_group[g].channel for g in names if g in by_group]
                if not chosen and "*" in by_group:
                    chosen = [by_group["*"].channel]
                if chosen:
                    self.store.enqueue_in(conn, rid, chosen, "request")
            elif event.event_type in ("approval.decided", "approval.timed_out", "approval.expired"):
                state = data.get("state") or data.get("outcome") or (
                    "expired" if event.event_type == "approval.expired" else None)
                self.store.mark_dirty_in(conn, rid, unless_shown=str(state) if state else None)

        return handle

    # ---- the loop ---------------------------------------------------------------------------------

    def tick(self, now: float | None = None) -> dict[str, int]:
        """Escalate what is due, then send the due posts and updates (the sweeper calls this every sweep)."""
        return {"escalated": self.escalate(now), "sent": self.run_due(now)}

    def escalate(self, now: float | None = None) -> int:
        """Re-post undecided requests to their group's escalation channel once their escalation time passed.

        The time is the channel's own ``escalate_after_seconds`` when set, else the notification policy's for the
        request's risk tags (the earliest of the policies that match, ``*`` included): the same clock the desk's
        webhook escalation runs on.
        """
        channels = [c for c in self.store.channels() if c.escalation_channel]
        if not channels:
            return 0
        policies = [p for p in self.state.store.policies() if p.escalate_after_seconds]
        now_dt = datetime.fromtimestamp(time.time() if now is None else now, UTC)
        pending = self.state.views.pending_approvals()
        done = self.store.posted_requests([a["approval_request_id"] for a in pending])
        sent = 0
        for a in pending:
            if (a["approval_request_id"], "escalation") in done:
                continue
            age = (now_dt - a["created_at"]).total_seconds()
            by_policy = min((p.escalate_after_seconds or 0 for p in policies
                             if p.risk_tag == "*" or p.risk_tag in a["risk_tags"]), default=None)
            due = []
            for c in self.route(a["tool_name"], a["risk_tags"], channels):
                after = c.escalate_after_seconds if c.escalate_after_seconds else by_policy
                if c.escalation_channel and after is not None and age >= after:
                    due.append(c.escalation_channel)
            if due:
                sent += self.store.enqueue(a["approval_request_id"], due, "escalation")
        return sent

    def run_due(self, now: float | None = None, limit: int = 20) -> int:
        """Send every due post and update once; returns how many were attempted."""
        now = time.time() if now is None else now
        posts = self.store.claim_due(limit, now + 60, now)
        for p in posts:
            try:
                if p.shown_state is None:
                    self._post(p)
                else:
                    self._update(p)
            except Exception as exc:  # noqa: BLE001 - one failing post must not stop the others
                self._failed(p, exc)
        return len(posts)

    def _failed(self, p: SlackPost, exc: Exception) -> None:
        from slack_sdk.errors import SlackApiError

        if isinstance(exc, SlackApiError) and exc.response is not None and exc.response.status_code == 429:
            # Slack's rate limit: retry exactly when it says, and do not count it as a failure.
            retry_after = _retry_after(exc.response.headers)
            log.info("Slack rate-limited post %s: retrying in %s s", p.post_id, retry_after)
            self.store.record_retry(p.post_id, time.time() + retry_after, "ratelimited")
            return
        error = exc.response.get("error") if isinstance(exc, SlackApiError) and exc.response is not None else None
        why = f"{type(exc).__name__}: {error or exc}"
        if p.attempts + 1 >= self.config.max_attempts or error in _FINAL_ERRORS:
            log.error("Slack post %s given up: %s", p.post_id, why)
            self.store.record_given_up(p.post_id, why)
            return
        delay = min(2.0 ** p.attempts, 300.0) * random.uniform(0.8, 1.2)
        log.warning("Slack post %s failed (%s); retrying in %.0f s", p.post_id, why, delay)
        self.store.record_retry(p.post_id, time.time() + delay, why)

    def _post(self, p: SlackPost) -> None:
        rec = self.state.undolog.approvals.get(p.approval_request_id)
        state = str(rec.state.value)
        if p.attempts > 0:
            # An earlier attempt may have posted and died before recording it: look before posting again.
            found = self._find(p.channel, p.approval_request_id)
            if found:
                self.store.record_posted(p.post_id, found, "pending")
                if state != "pending":
                    self.store.mark_dirty(p.approval_request_id)
                return
        if state != "pending":
            # Decided before it was ever posted: nothing to ask anyone.
            self.store.record_updated(p.post_id, state)
            return
        blocks, text = self.message(p.approval_request_id, p.channel, purpose=p.purpose)
        resp = self.client.chat_postMessage(
            channel=p.channel, text=text, blocks=blocks, unfurl_links=False, unfurl_media=False,
            metadata={"event_type": METADATA_EVENT, "event_payload": {"approval_request_id": p.approval_request_id}},
        )
        self.store.record_posted(p.post_id, [str(resp["ts"])], "pending")

    def _update(self, p: SlackPost) -> None:
        rec = self.state.undolog.approvals.get(p.approval_request_id)
        state = str(rec.state.value)
        if state == "pending":
            self.store.record_updated(p.post_id, state)
            return
        # The duplicates too: a post that slipped through twice is updated like the original.
        tss = list(dict.fromkeys([*p.ts, *self._find(p.channel, p.approval_request_id)]))
        blocks, text = self.message(p.approval_request_id, p.channel, purpose=p.purpose)
        for ts in tss:
            self.client.chat_update(channel=p.channel, ts=ts, text=text, blocks=blocks)
        self.store.record_posted(p.post_id, tss, state)
        self.store.record_updated(p.post_id, state)

    def _find(self, channel: str, approval_request_id: str) -> list[str]:
        """The ts of every message in ``channel`` carrying this request's id in its metadata (newest 1,000)."""
        found: list[str] = []
        cursor: str | None = None
        for _ in range(5):
            kwargs: dict[str, Any] = {"channel": channel, "limit": 200, "include_all_metadata": True}
            if cursor:
                kwargs["cursor"] = cursor
            resp = self.client.conversations_history(**kwargs)
            for m in resp.get("messages") or []:
                meta = m.get("metadata") or {}
                if (meta.get("event_type") == METADATA_EVENT
                        and (meta.get("event_payload") or {}).get("approval_request_id") == approval_request_id):
                    found.append(str(m["ts"]))
            cursor = ((resp.get("response_metadata") or {}).get("next_cursor")) or None
            if not cursor:
                break
        return sorted(found)

    # ---- the message ------------------------------------------------------------------------------

    def message(self, approval_request_id: str, channel: str, *, purpose: str = "request") -> tuple[list[dict[str, Any]], str]:
        """The Block Kit blocks and the notification text of a request's message as it stands now."""
        st = self.state
        rec = st.undolog.approvals.get(approval_request_id)
        state = str(rec.state.value)
        sensitive = self._sensitive(channel)
        tool = escape(rec.tool_name)
        pending = state == "pending"
        title = ("Approval needed" if purpose == "request" else "Still undecided (escalated)") if pending else \
            f"Approval request {state.replace('_', ' ')}"
        blocks: list[dict[str, Any]] = [
            {"type": "header", "text": plain(f"{title}: {rec.tool_name}")},
        ]
        fields = [f"*Tool*\n`{tool}`", f"*Risk tags*\n{escape(', '.join(rec.risk_tags)) or '—'}"]
        deadline = int(rec.timeout_at.timestamp())
        fields.append(f"*Deadline*\n<!date^{deadline}^{{date_short_pretty}} {{time}}|{rec.timeout_at.isoformat()}>")
        fields.append(f"*Session*\n`{escape(fold(rec.session_id, 80))}`")
        blocks.append({"type": "section", "fields": [{"type": "mrkdwn", "text": f} for f in fields]})
        if rec.reason:
            blocks.append({"type": "section", "text": {"type": "mrkdwn",
                                                       "text": "*Reason*\n" + escape(fold(rec.reason, 1500))}})
        blocks.append({"type": "section", "text": {"type": "mrkdwn",
                                                   "text": "*Arguments*\n" + self._args_text(rec.proposed_args, sensitive)}})
        if rec.approved_args is not None and rec.approved_args != rec.proposed_args:
            blocks.append({"type": "section", "text": {"type": "mrkdwn",
                                                       "text": "*Approved with edits*\n" + self._args_text(rec.approved_args, sensitive)}})
        recent = st.views.effects(rec.session_id, limit=st.settings.context_calls, newest_first=True)
        recent = [e for e in recent if e.get("effect_id") != rec.effect_id]
        if recent:
            lines = [f"• `{escape(e['tool_name'])}` {escape(str(e.get('state', '')).replace('_', ' '))}" for e in recent[:8]]
            blocks.append({"type": "context", "elements": [{"type": "mrkdwn",
                                                            "text": "*Recent calls*\n" + "\n".join(lines)}]})
        plan = st.views.undo_plan(rec.session_id)
        if plan:
            steps = ", ".join(f"`{escape(u['tool_name'])}`" for u in plan[:10]) + (" …" if len(plan) > 10 else "")
            n = len(plan)
            these = "this 1 step is" if n == 1 else f"these {n} steps are"
            undo = f"If this session fails after this, {these} undone: {steps}; this one (`{tool}`) cannot be."
        else:
            undo = f"Nothing before it can be undone, and this one (`{tool}`) cannot be."
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": undo}]})
        if pending:
            value = json.dumps({"r": rec.approval_request_id, "d": rec.action_digest}, separators=(",", ":"))
            blocks.append({"type": "actions", "block_id": "undolog_decide", "elements": [
                {"type": "button", "action_id": "undolog_approve", "style": "primary", "value": value,
                 "text": {"type": "plain_text", "text": "Approve"}},
                {"type": "button", "action_id": "undolog_reject", "style": "danger", "value": value,
                 "text": {"type": "plain_text", "text": "Reject"},
                 "confirm": {"title": {"type": "plain_text", "text": "Reject this call?"},
                             "text": {"type": "plain_text", "text": "The call will not run and the session halts."},
                             "confirm": {"type": "plain_text", "text": "Reject"},
                             "deny": {"type": "plain_text", "text": "Cancel"}, "style": "danger"}},
                {"type": "button", "action_id": "undolog_edit", "value": value,
                 "text": {"type": "plain_text", "text": "Edit"}},
            ]})
        else:
            who = f" by {escape(rec.decided_by)}" if rec.decided_by else ""
            why = f": “{escape(fold(rec.decision_reason, 500))}”" if rec.decision_reason else ""
            outcome = {"approved": "Approved", "rejected": "Rejected", "timed_out": "Timed out without a decision",
                       "expired": "Expired", "auto_approved": "Approved automatically at the deadline",
                       "cancelled": "Cancelled", "responded": "Answered"}.get(state, state)
            if state == "approved" and rec.approved_args is not None and rec.approved_args != rec.proposed_args:
                outcome = "Approved with edits"
            blocks.append({"type": "section", "block_id": "undolog_outcome",
                           "text": {"type": "mrkdwn", "text": f"*{outcome}*{who}{why}"}})
        # The desk's one public address (`--public-url`, as the email links use) unless Slack is given its own.
        desk_url = self.config.desk_url or getattr(self.state.settings, "public_url", None)
        if desk_url:
            link = f"{desk_url.rstrip('/')}/ui/approvals/{urllib.parse.quote(rec.approval_request_id, safe='')}"
            blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": f"<{escape(link)}|Open on the desk>"}]})
        text = f"{title}: {escape(rec.tool_name)}"
        return blocks, text

    def _sensitive(self, channel: str) -> set[str]:
        """The argument names hidden in ``channel``: what the configuration of the group(s) posting there marks
        sensitive (an escalation channel hides what its group hides)."""
        hidden: set[str] = set()
        for c in self.store.channels():
            if channel in (c.channel, c.escalation_channel):
                hidden.update(c.sensitive)
        return hidden

    def _args_text(self, args: Mapping[str, Any], sensitive: set[str]) -> str:
        if not args:
            return "_none_"
        lines = []
        for path, value in arg_leaves(args):
            name = ".".join(path)
            if path[0] in sensitive or forms.pointer(path) in sensitive or name in sensitive:
                shown = "_hidden (sensitive)_"
            else:
                text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)
                shown = "`" + escape(fold(text, self.config.fold)).replace("`", "ˋ") + "`"
            lines.append(f"• *{escape(fold(name, 120))}*: {shown}")
        return fold("\n".join(lines), 2900)

    def kick(self) -> None:
        """Send what is due now, off the request's thread (a decision's message update)."""
        if not self.config.update_now:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.run_in_executor(None, self._run_quietly)

    def _run_quietly(self) -> None:
        try:
            self.run_due()
        except Exception:  # noqa: BLE001 - the sweeper sends it anyway
            log.warning("sending Slack updates after a decision failed; the sweeper retries", exc_info=True)


_FINAL_ERRORS = {"channel_not_found", "not_in_channel", "is_archived", "invalid_auth", "account_inactive",
                 "token_revoked", "no_permission", "missing_scope", "message_not_found", "cant_update_message"}


def _retry_after(headers: Any) -> float:
    raw: Any = None
    if isinstance(headers, Mapping):
        for k, v in headers.items():
            if str(k).lower() == "retry-after":
                raw = v[0] if isinstance(v, list) and v else v
    try:
        return max(1.0, float(raw))
    except (TypeError, ValueError):
        return 30.0
