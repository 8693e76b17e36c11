"""The Slack integration's tables and their SQL (see :mod:`undolog_server.slack` for what they mean).

- ``undolog_slack_channels``: per approver group (``*``: requests no group claims), the channel its requests are
  posted to, the channel an undecided request is re-posted to after ``escalate_after_seconds``, and the argument
  names never shown in Slack.
- ``undolog_slack_users``: (``team_id``, ``user_id``), Slack's immutable ids, to the API key that person decides
  with.
- ``undolog_slack_posts``: one row per (request, channel): the message(s) posted there (``ts``; more than one when a
  duplicate slipped through), the state last shown, whether an update is due; leased while being sent.
- ``undolog_slack_seen``: the signatures of interactivity requests accepted within the replay window.

Created by the desk's migration ``s0003_slack``.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from . import CoreStore, UTCDateTime, metadata, utcnow

slack_channels = sa.Table(
    "undolog_slack_channels",
    metadata,
    sa.Column("group_name", sa.String(100), primary_key=True),
    sa.Column("channel", sa.String(100), nullable=False),
    sa.Column("escalation_channel", sa.String(100), nullable=True),
    sa.Column("escalate_after_seconds", sa.Integer, nullable=True),
    sa.Column("sensitive", sa.JSON, nullable=False),
    sa.Column("updated_at", UTCDateTime, nullable=False),
)

slack_users = sa.Table(
    "undolog_slack_users",
    metadata,
    sa.Column("team_id", sa.String(32), primary_key=True),
    sa.Column("user_id", sa.String(32), primary_key=True),
    sa.Column("key_id", sa.String(32), nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("created_by", sa.String(200), nullable=True),
)

slack_posts = sa.Table(
    "undolog_slack_posts",
    metadata,
    sa.Column("post_id", sa.String(40), primary_key=True),
    sa.Column("approval_request_id", sa.String(64), nullable=False),
    sa.Column("channel", sa.String(100), nullable=False),
    sa.Column("purpose", sa.String(20), nullable=False),
    sa.Column("ts", sa.JSON, nullable=False),
    sa.Column("shown_state", sa.String(20), nullable=True),
    sa.Column("dirty", sa.Boolean, nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("next_attempt_at", sa.Float, nullable=False),
    sa.Column("locked_until", sa.Float, nullable=True),
    sa.Column("last_error", sa.Text, nullable=True),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.UniqueConstraint("approval_request_id", "channel", name="uq_undolog_slack_posts_request_channel"),
    sa.Index("ix_undolog_slack_posts_due", "next_attempt_at"),
)

slack_seen = sa.Table(
    "undolog_slack_seen",
    metadata,
    sa.Column("signature_hash", sa.String(64), primary_key=True),
    sa.Column("seen_at", sa.Float, nullable=False),
    sa.Index("ix_undolog_slack_seen_at", "seen_at"),
)


def _insert_new(conn: Any, table: sa.Table, rows: list[dict[str, Any]]) -> int:
    """Insert the rows that collide with no unique key; returns how many were inserted.

    Counted by ``RETURNING``: psycopg reports a rowcount of -1 for ``INSERT ... ON CONFLICT DO NOTHING`` here, so a
    rowcount would read a replay (or a second fan-out) as new.
    """
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
    key = list(table.primary_key.columns)[0]
    inserted = 0
    for row in rows:
        stmt = insert(table).values(**row).on_conflict_do_nothing().returning(key)
        inserted += conn.execute(stmt).first() is not None
    return inserted


@dataclass(frozen=True)
class SlackChannel:
    """Where an approver group's requests go in Slack.

    Attributes:
        group: The approver group (``*``: requests routed to no group).
        channel: The channel id requests are posted to.
        escalation_channel: Where an undecided request is re-posted after ``escalate_after_seconds``.
        escalate_after_seconds: Seconds after the request was raised.
        sensitive: Argument names (top-level keys or JSON Pointers) shown as hidden.
    """

    group: str
    channel: str
    escalation_channel: str | None = None
    escalate_after_seconds: int | None = None
    sensitive: tuple[str, ...] = ()


@dataclass(frozen=True)
class SlackPost:
    """One (request, channel) post as stored."""

    post_id: str
    approval_request_id: str
    channel: str
    purpose: str
    ts: tuple[str, ...]
    shown_state: str | None
    dirty: bool
    attempts: int


def _post(r: Any) -> SlackPost:
    return SlackPost(r["post_id"], r["approval_request_id"], r["channel"], r["purpose"], tuple(r["ts"] or ()),
                     r["shown_state"], bool(r["dirty"]), int(r["attempts"]))


class SlackStore:
    """The SQL of the Slack integration, on the core store's transactions.

    Example:
        >>> SlackStore(undolog.store).put_channel(SlackChannel("finance", "C0FIN"))
    """

    def __init__(self, core: CoreStore) -> None:
        self.core = core

    # ---- channels ---------------------------------------------------------------------------------

    def channels(self) -> list[SlackChannel]:
        with self.core.read() as conn:
            rows = conn.execute(sa.select(slack_channels).order_by(slack_channels.c.group_name)).mappings().all()
        return [SlackChannel(r["group_name"], r["channel"], r["escalation_channel"], r["escalate_after_seconds"],
                             tuple(r["sensitive"] or ())) for r in rows]

    def put_channel(self, ch: SlackChannel) -> None:
        values = {"channel": ch.channel, "escalation_channel": ch.escalation_channel,
                  "escalate_after_seconds": ch.escalate_after_seconds, "sensitive": list(ch.sensitive),
                  "updated_at": utcnow()}
        with self.core.tx() as conn:
            res = conn.execute(slack_channels.update().where(slack_channels.c.group_name == ch.group).values(**values))
            if not res.rowcount:
                conn.execute(slack_channels.insert().values(group_name=ch.group, **values))

    def delete_channel(self, group: str) -> bool:
        with self.core.tx() as conn:
            return bool(conn.execute(slack_channels.delete().where(slack_channels.c.group_name == group)).rowcount)

    # ---- users ------------------------------------------------------------------------------------

    def users(self) -> list[dict[str, Any]]:
        with self.core.read() as conn:
            rows = conn.execute(sa.select(slack_users).order_by(slack_users.c.team_id, slack_users.c.user_id))
            return [dict(r) for r in rows.mappings()]

    def user_key(self, team_id: str, user_id: str) -> str | None:
        """The key id a Slack user decides with, or None (unmapped)."""
        with self.core.read() as conn:
            return conn.execute(sa.select(slack_users.c.key_id).where(
                slack_users.c.team_id == team_id, slack_users.c.user_id == user_id)).scalar_one_or_none()

    def put_user(self, team_id: str, user_id: str, key_id: str, created_by: str | None) -> str | None:
        """Map a Slack user to a key; returns the key it was mapped to before (None: a new mapping)."""
        with self.core.tx() as conn:
            before = conn.execute(sa.select(slack_users.c.key_id).where(
                slack_users.c.team_id == team_id, slack_users.c.user_id == user_id)).scalar_one_or_none()
            if before is None:
                conn.execute(slack_users.insert().values(team_id=team_id, user_id=user_id, key_id=key_id,
                                                         created_at=utcnow(), created_by=created_by))
            else:
                conn.execute(slack_users.update().where(slack_users.c.team_id == team_id,
                                                        slack_users.c.user_id == user_id)
                             .values(key_id=key_id, created_at=utcnow(), created_by=created_by))
        return before

    def delete_user(self, team_id: str, user_id: str) -> str | None:
        """Remove a mapping; returns the key it mapped to (None: there was none)."""
        with self.core.tx() as conn:
            before = conn.execute(sa.select(slack_users.c.key_id).where(
                slack_users.c.team_id == team_id, slack_users.c.user_id == user_id)).scalar_one_or_none()
            if before is not None:
                conn.execute(slack_users.delete().where(slack_users.c.team_id == team_id,
                                                        slack_users.c.user_id == user_id))
        return before

    # ---- replay window ----------------------------------------------------------------------------

    def first_sight(self, signature: str, window: float, now: float | None = None) -> bool:
        """Remember a request signature for the replay window; False when it was seen within it (a replay).

        Older signatures are forgotten on the way: a request that old is refused by its timestamp anyway.
        """
        now = time.time() if now is None else now
        digest = hashlib.sha256(signature.encode()).hexdigest()
        with self.core.tx() as conn:
            conn.execute(slack_seen.delete().where(slack_seen.c.seen_at < now - 2 * window))
            return _insert_new(conn, slack_seen, [{"signature_hash": digest, "seen_at": now}]) == 1

    # ---- posts ------------------------------------------------------------------------------------

    def enqueue_in(self, conn: Any, approval_request_id: str, channels: Sequence[str], purpose: str) -> int:
        """One post per channel for a request, in the caller's transaction (the outbox claim); repeats ignored."""
        now = utcnow()
        rows: list[dict[str, Any]] = [{"post_id": "sp_" + uuid.uuid4().hex[:20], "approval_request_id": approval_request_id,
                 "channel": ch, "purpose": purpose, "ts": [], "shown_state": None, "dirty": False, "attempts": 0,
                 "next_attempt_at": time.time(), "locked_until": None, "last_error": None, "created_at": now}
                for ch in dict.fromkeys(channels)]
        return _insert_new(conn, slack_posts, rows)

    def enqueue(self, approval_request_id: str, channels: Sequence[str], purpose: str) -> int:
        """:meth:`enqueue_in` in a transaction of its own (an escalation)."""
        with self.core.tx() as conn:
            return self.enqueue_in(conn, approval_request_id, channels, purpose)

    def mark_dirty_in(self, conn: Any, approval_request_id: str, unless_shown: str | None = None) -> int:
        """Every post of a request needs its message updated (the request was decided, timed out, expired).

        ``unless_shown``: the state the event reports; a message already showing it is left alone (a decision
        taken in Slack updates its messages at once, and its outbox event arrives afterwards).
        """
        p = slack_posts
        q = p.update().where(p.c.approval_request_id == approval_request_id)
        if unless_shown is not None:
            q = q.where(sa.or_(p.c.shown_state.is_(None), p.c.shown_state != unless_shown))
        return max(0, int(conn.execute(q.values(dirty=True, next_attempt_at=time.time())).rowcount or 0))

    def mark_dirty(self, approval_request_id: str, unless_shown: str | None = None) -> int:
        """:meth:`mark_dirty_in` in a transaction of its own."""
        with self.core.tx() as conn:
            return self.mark_dirty_in(conn, approval_request_id, unless_shown)

    def posts(self, approval_request_id: str | None = None) -> list[SlackPost]:
        q = sa.select(slack_posts).order_by(slack_posts.c.created_at, slack_posts.c.post_id)
        if approval_request_id is not None:
            q = q.where(slack_posts.c.approval_request_id == approval_request_id)
        with self.core.read() as conn:
            return [_post(r) for r in conn.execute(q).mappings()]

    def posted_requests(self, approval_request_ids: Sequence[str]) -> set[tuple[str, str]]:
        """The (request, purpose) pairs that have a post row."""
        if not approval_request_ids:
            return set()
        with self.core.read() as conn:
            return {(r[0], r[1]) for r in conn.execute(sa.select(slack_posts.c.approval_request_id, slack_posts.c.purpose)
                                                       .where(slack_posts.c.approval_request_id.in_(list(approval_request_ids))))}

    def claim_due(self, limit: int, lease_until: float, now: float | None = None) -> list[SlackPost]:
        """Lease due posts (never posted, or an update due) and count the attempt before it is made.

        The attempt is counted at the claim, so after a crash mid-send the next claimer knows a message may
        already be in the channel and looks for it before posting again.
        """
        p = slack_posts
        now = time.time() if now is None else now
        with self.core.tx() as conn:
            q = (sa.select(p).where(
                p.c.next_attempt_at <= now,
                sa.or_(p.c.locked_until.is_(None), p.c.locked_until < now),
                sa.or_(p.c.shown_state.is_(None), p.c.dirty.is_(True)),
            ).order_by(p.c.next_attempt_at).limit(limit))
            if self.core.is_postgres:
                q = q.with_for_update(skip_locked=True)
            rows: list[dict[str, Any]] = [dict(r) for r in conn.execute(q).mappings()]
            for r in rows:
                conn.execute(p.update().where(p.c.post_id == r["post_id"])
                             .values(locked_until=lease_until, attempts=int(r["attempts"]) + 1))
        return [_post(r) for r in rows]

    def record_posted(self, post_id: str, ts: Sequence[str], state: str) -> None:
        """The message(s) are in the channel, showing ``state``."""
        with self.core.tx() as conn:
            conn.execute(slack_posts.update().where(slack_posts.c.post_id == post_id).values(
                ts=list(dict.fromkeys(ts)), shown_state=state, locked_until=None, last_error=None))

    def record_updated(self, post_id: str, state: str, *, still_dirty: bool = False) -> None:
        """The messages were updated to show ``state`` (decided: no further update is due)."""
        with self.core.tx() as conn:
            conn.execute(slack_posts.update().where(slack_posts.c.post_id == post_id).values(
                shown_state=state, dirty=still_dirty, locked_until=None, last_error=None))

    def record_retry(self, post_id: str, next_attempt_at: float, error: str) -> None:
        with self.core.tx() as conn:
            conn.execute(slack_posts.update().where(slack_posts.c.post_id == post_id).values(
                next_attempt_at=next_attempt_at, locked_until=None, last_error=error[:2000]))

    def record_given_up(self, post_id: str, error: str) -> None:
        """Stop trying (the channel is gone, the bot was removed): the post is left as it is, error recorded."""
        with self.core.tx() as conn:
            conn.execute(slack_posts.update().where(slack_posts.c.post_id == post_id).values(
                shown_state="failed", dirty=False, locked_until=None, last_error=error[:2000]))
