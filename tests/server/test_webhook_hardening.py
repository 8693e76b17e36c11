"""Webhooks against slow and hostile receivers and targets (issue 11, findings 4 and 5).

A trickling receiver (a byte every 0.1 s, forever) next to a healthy one; malformed URLs; targets on
private addresses, including a name that resolves to a public address at registration and to loopback
when the delivery is sent (DNS rebinding); signatures over the delivery id that never raise.
"""

from __future__ import annotations

import ipaddress
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from undolog_core.testing import internals
from undolog_core.webhooks import sign, verify_signature
from undolog_server.state import ServerSettings
from undolog_server.storage import webhook_deliveries
from undolog_server.webhooks import address_allowed

from ..support.receiver import Receiver
from .conftest import Desk, make_desk, problem

QUICK = dict(background=True, sweep_interval=0.05, webhook_interval=0.02, webhook_backoff_base=0.05,
             webhook_backoff_max=0.1)


class Trickler:
    """A loopback HTTP server that answers ``200`` and then one header byte every ``every`` seconds, for as
    long as the client stays (at most ``limit`` seconds): a per-read timeout never fires on it.

    Counts connections open at once, and any delivery id that arrives while another request with the same
    id is still open (a delivery sent twice while in flight)."""

    def __init__(self, every: float = 0.1, limit: float = 20.0) -> None:
        self.every, self.limit = every, limit
        self.lock = threading.Lock()
        self.open_now = 0
        self.max_open = 0
        self.open_ids: Counter[str] = Counter()
        self.overlaps: list[str] = []
        self.attempts: Counter[str] = Counter()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._serve, daemon=True)
        self._accept.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _handle(self, conn: socket.socket) -> None:
        delivery = ""
        try:
            raw = b""
            while b"\r\n\r\n" not in raw:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                raw += chunk
            for line in raw.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n"):
                if line.lower().startswith("undolog-delivery:"):
                    delivery = line.split(":", 1)[1].strip()
            # The attempt is counted as soon as its request is read: on a loaded machine this thread may start
            # after the sender's deadline, and an attempt counted only after the pause below could be counted
            # after the test reads the counts (CI saw 1 attempt of 2 that way).
            with self.lock:
                self.attempts[delivery] += 1
            # Open (for the overlap check) a moment late, so the handler of a connection the client has just closed
            # has surely noticed it (it waits in select) before this one counts: only real overlaps are seen.
            time.sleep(0.1)
            with self.lock:
                if self.open_ids[delivery]:
                    self.overlaps.append(delivery)
                self.open_ids[delivery] += 1
                self.open_now += 1
                self.max_open = max(self.max_open, self.open_now)
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                end = time.monotonic() + self.limit
                while time.monotonic() < end and not self._stop.is_set():
                    # Readable means the client closed (or sent more): stop as soon as it hangs up.
                    if select.select([conn], [], [], self.every)[0] and not conn.recv(1024):
                        break
                    conn.sendall(b"a")
            except OSError:
                pass
            finally:
                with self.lock:
                    self.open_now -= 1
                    self.open_ids[delivery] -= 1
        finally:
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        self.sock.close()
        self._accept.join(timeout=5)
        for t in self._threads:
            t.join(timeout=5)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture
def trickler() -> Iterator[Trickler]:
    t = Trickler()
    yield t
    t.stop()


def _wait(pred: Any, timeout: float) -> None:
    """Poll until ``pred()`` holds; a bounded "it finishes", not a timing assertion."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def _log(desk: Desk, target_id: str) -> list[dict[str, Any]]:
    r = desk.client("admin").get(f"/v1/webhooks/{target_id}/deliveries")
    assert r.status_code == 200, r.text
    return list(r.json())


def test_a_trickling_receiver_is_cut_at_the_deadline_and_never_starves_a_healthy_one(
    db: Any, receiver: Receiver, trickler: Trickler
) -> None:
    # The deadline (1.5 s; 0.6 s before) is also the healthy receiver's: on a loaded machine an answer could take
    # longer than 0.6 s, be cut and sent again (twice: failed), and the 8 slow attempts, 2 at a time, could all end
    # (4 deadlines) before the healthy target had its 4 events. Each slow attempt still ends at it, not 20 s later.
    settings = ServerSettings(**{**QUICK, "webhook_backoff_base": 0.2, "webhook_backoff_max": 0.2},
                              webhook_timeout=1.5, webhook_max_attempts=2, webhook_per_target=2,
                              webhook_max_inflight=3, webhook_allow_private=True)
    d = make_desk(db, settings=settings)
    try:
        admin = d.client("admin")
        slow = admin.post("/v1/webhooks", json={"name": "slow", "url": f"{trickler.url}/slow",
                                                "event_types": ["approval.requested"]}).json()
        healthy = admin.post("/v1/webhooks", json={"name": "ok", "url": f"{receiver.url}/ok",
                                                   "event_types": ["approval.requested"]}).json()
        receiver.secrets["/ok"] = healthy["secret"]
        n = 4
        for i in range(n):
            d.pending(user_id=f"u{i}")
        # The trickler may hold 2 of the 3 slots, never the third: the healthy target gets all its events
        # while the slow one still has attempts to go (4 deliveries x 2 attempts, 2 at a time).
        receiver.wait(lambda: len(receiver.events("/ok")) == n, timeout=15)
        with trickler.lock:
            assert sum(trickler.attempts.values()) < 2 * n, trickler.attempts
        assert all(g.signature_ok for g in receiver.events("/ok"))

        # Every slow attempt ends at the deadline (a per-read timeout would let each trickle for 20 s) and
        # the delivery is given up after its 2 attempts, each one a separate, non-overlapping send.
        _wait(lambda: [x["status"] for x in _log(d, slow["target_id"])] == ["failed"] * n, timeout=30)
        log = _log(d, slow["target_id"])
        assert all(x["attempts"] == 2 and x["last_error"] == "no response" for x in log), log
        # The sender gives an attempt up at its deadline, which can come before the receiving thread has read the
        # request on a loaded machine: the count is waited for (bounded), then compared exactly, so an attempt
        # never sent, or sent a third time, still fails.
        expected = {x["delivery_id"]: 2 for x in log}

        def counted() -> bool:
            with trickler.lock:
                return sum(trickler.attempts.values()) >= sum(expected.values())

        _wait(counted, timeout=10)
        with trickler.lock:
            assert trickler.attempts == expected
            assert trickler.overlaps == []  # never sent again while still in flight
            assert trickler.max_open <= 2  # the per-target ceiling
        assert all(x["status"] == "delivered" for x in _log(d, healthy["target_id"]))
    finally:
        d.close()


def test_the_lease_must_outlast_the_deadline() -> None:
    with pytest.raises(ValueError, match="webhook_lease"):
        ServerSettings(webhook_timeout=30, webhook_lease=35)
    assert ServerSettings().webhook_lease > ServerSettings().webhook_timeout


MALFORMED = [
    "http://[::1/",
    "http://[::1]:80:80/",
    "http://example.com:99999/",
    "http://example.com:abc/",
    "http:///nohost",
    "http://user:pw@example.com/",
    "http://exa mple.com/",
    "http://bücher.example/",
]

PRIVATE = [
    "http://127.0.0.1:8080/x",
    "http://localhost/x",
    "http://[::1]/x",
    "http://[::ffff:127.0.0.1]/x",
    "http://2130706433/x",  # 127.0.0.1 written as one number
    "http://10.1.2.3/x",
    "http://192.168.0.10/x",
    "http://169.254.169.254/latest/meta-data",
    "http://[fe80::1]/x",
    "http://0.0.0.0/x",
    "http://224.0.0.1/x",
    "http://100.64.0.1/x",
]


def test_malformed_and_private_urls_are_refused_at_registration(desk: Desk) -> None:
    admin = desk.client("admin")
    for url in MALFORMED:
        body = problem(admin.post("/v1/webhooks", json={"name": "w", "url": url}), 422, "invalid_webhook_url")
        assert body["detail"].startswith("invalid webhook url"), (url, body)
    assert admin.post("/v1/webhooks", json={"name": "w", "url": "ftp://example.com/"}).status_code == 422
    for url in PRIVATE:
        body = problem(admin.post("/v1/webhooks", json={"name": "w", "url": url}), 422, "webhook_target_refused")
        assert "webhook_allow_private" in body["detail"], (url, body)
    assert admin.get("/v1/webhooks").json() == []


def test_public_targets_are_accepted_and_private_ones_with_the_opt_in(db: Any) -> None:
    d = make_desk(db, settings=ServerSettings(background=False, webhook_allow_private=True))
    try:
        r = d.client("admin").post("/v1/webhooks", json={"name": "lo", "url": "http://127.0.0.1:9/x"})
        assert r.status_code == 201, r.text
        r = d.client("admin").post("/v1/webhooks", json={"name": "pub", "url": "https://93.184.215.14/x"})
        assert r.status_code == 201, r.text
    finally:
        d.close()


def test_a_name_rebound_to_loopback_after_registration_is_refused_at_send_time(
    db: Any, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A DNS answer the attacker controls: public while the admin registers the target, loopback later.
    real = socket.getaddrinfo
    answers = {"n": 0}

    def rebinding(host: Any, port: Any, *a: Any, **kw: Any) -> Any:
        if host == "hooks.rebind.test":
            answers["n"] += 1
            addr = "93.184.215.14" if answers["n"] == 1 else "127.0.0.1"
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (addr, int(port)))]
        return real(host, port, *a, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    d = make_desk(db, settings=ServerSettings(**QUICK, webhook_timeout=2.0, webhook_max_attempts=2))
    try:
        port = receiver.url.rsplit(":", 1)[1]
        r = d.client("admin").post("/v1/webhooks", json={"name": "rb", "url": f"http://hooks.rebind.test:{port}/rb"})
        assert r.status_code == 201, r.text
        target = r.json()
        d.pending()
        _wait(lambda: [x["status"] for x in _log(d, target["target_id"])] == ["failed"], timeout=15)
        log = _log(d, target["target_id"])
        assert log[0]["last_error"] == "target address not allowed" and log[0]["last_status_code"] is None
        assert receiver.got == []  # nothing ever reached the loopback receiver
    finally:
        d.close()


#: IPv6 forms that carry an IPv4 address a gateway or the host translates to: NAT64 (64:ff9b::/96, and the local-use
#: 64:ff9b:1::/48), 6to4 (2002::/16) and the deprecated IPv4-compatible ::/96. Python's ``is_global`` says yes to all of
#: them, so 10.0.0.1 written as NAT64 reached the VPC's private hosts through an IPv6-only subnet's NAT gateway.
EMBEDDED = [
    "http://[64:ff9b::a00:1]/x",  # NAT64 of 10.0.0.1
    "http://[64:ff9b::a9fe:a9fe]/x",  # NAT64 of 169.254.169.254, cloud metadata
    "http://[64:ff9b::7f00:1]/x",  # NAT64 of 127.0.0.1
    "http://[64:ff9b:1::5db8:d70e]/x",  # local-use NAT64 (RFC 8215): never global, whatever it embeds
    "http://[2002:a00:1::]/x",  # 6to4 of 10.0.0.1
    "http://[2002:7f00:1::1]/x",  # 6to4 of 127.0.0.1
    "http://[::a00:1]/x",  # IPv4-compatible 10.0.0.1
    "http://[::7f00:1]/x",  # IPv4-compatible 127.0.0.1
]


def test_private_ipv4_written_in_an_ipv6_translation_prefix_is_refused(desk: Desk) -> None:
    # No background loop and no event here: nothing is ever sent, to any of these addresses.
    admin = desk.client("admin")
    for url in EMBEDDED:
        body = problem(admin.post("/v1/webhooks", json={"name": "w", "url": url}), 422, "webhook_target_refused")
        assert "webhook_allow_private" in body["detail"], (url, body)
        # The check every send makes after resolving a name is the same one.
        assert not address_allowed(ipaddress.ip_address(url.split("[")[1].split("]")[0]))
    # Port 0 is no port a request can be sent to: a target there would fail forever.
    problem(admin.post("/v1/webhooks", json={"name": "w", "url": "http://93.184.215.14:0/x"}), 422,
            "invalid_webhook_url")
    assert admin.get("/v1/webhooks").json() == []
    # NAT64 and 6to4 forms of a public IPv4 address are still public.
    assert address_allowed(ipaddress.ip_address("64:ff9b::5db8:d70e"))
    assert address_allowed(ipaddress.ip_address("2002:5db8:d70e::1"))


@pytest.mark.reads_store
def test_a_malformed_url_already_stored_fails_its_delivery_instead_of_hanging(
    db: Any, caplog: pytest.LogCaptureFixture
) -> None:
    d = make_desk(db, settings=ServerSettings(**QUICK, webhook_timeout=1.0, webhook_max_attempts=5))
    try:
        # Registered before URLs were validated (or written straight into the table).
        target = d.store.create_target("legacy", "http://[::1/")
        d.pending()
        _wait(lambda: [x["status"] for x in _log(d, target.target_id)] == ["failed"], timeout=15)
        log = _log(d, target.target_id)
        assert log[0]["last_error"] == "invalid target url" and log[0]["attempts"] == 5  # not retried
        with internals(d.undolog).read() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(webhook_deliveries)
                                .where(webhook_deliveries.c.status == "pending")).scalar_one() == 0
    finally:
        d.close()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_verify_signature_returns_false_on_hostile_headers() -> None:
    body, key = b'{"id":"evt_1"}', "s3cret-s3cret-s3cret"
    good = sign(key, 1_767_052_800, body, delivery_id="dl_1")
    at = {"now": 1_767_052_801}
    assert verify_signature(key, good, body, delivery_id="dl_1", **at)
    for header in [
        "t=1767052800,v2=é",
        "t=1767052800,v2=\u00ff" * 3,
        "t=1767052800,v2=" + "ü" * 64,
        "t=١٧٦٧٠٥٢٨٠٠,v2=00",
        "t=,v2=",
        "t=1767052800",
        "v2=abc",
        "t=" + "9" * 5000 + ",v2=00",
        "",
        ",,,",
        "t=1767052800,v1=" + good.split("=")[-1],  # the old scheme, which did not sign the delivery id
    ]:
        assert verify_signature(key, header, body, delivery_id="dl_1", **at) is False, header
    assert verify_signature(key, None, body, delivery_id="dl_1", **at) is False  # type: ignore[arg-type]
    assert verify_signature(key, good, body, delivery_id=None, **at) is False  # type: ignore[arg-type]


def test_the_delivery_id_is_covered_by_the_signature() -> None:
    body, key = b'{"id":"evt_1"}', "s3cret-s3cret-s3cret"
    header = sign(key, 1_767_052_800, body, delivery_id="dl_1")
    assert verify_signature(key, header, body, delivery_id="dl_1", now=1_767_052_800)
    # A replay under a fresh delivery id (to slip past the receiver's deduplication) does not verify.
    assert not verify_signature(key, header, body, delivery_id="dl_2", now=1_767_052_800)


def test_the_desk_signs_audit_checkpoints_on_a_schedule(db: Any, tmp_path: Any, receiver: Receiver) -> None:
    import json

    from undolog_core._checkpoints import generate_keypair

    key, pub = generate_keypair(tmp_path / "audit.key")
    out = tmp_path / "checkpoints"
    settings = ServerSettings(**QUICK, audit_checkpoint_key=str(key), audit_checkpoint_dir=str(out),
                              audit_checkpoint_interval=0.2, webhook_allow_private=True)
    d = make_desk(db, settings=settings)
    try:
        admin = d.client("admin")
        offsite = admin.post("/v1/webhooks", json={"name": "offsite", "url": f"{receiver.url}/offsite",
                                                   "event_types": ["audit.checkpoint"]}).json()
        receiver.secrets["/offsite"] = offsite["secret"]
        everything = admin.post("/v1/webhooks", json={"name": "all", "url": f"{receiver.url}/all"}).json()
        receiver.secrets["/all"] = everything["secret"]
        rid, _ = d.pending()
        assert d.client("approver").post(f"/v1/approvals/{rid}:approve", json={}).status_code == 200
        # A checkpoint that covers the decision (request = event 1, approve = event 2) appears by itself...
        _wait(lambda: any('"position": 2' in p.read_text() for p in out.glob("*.json")), timeout=15)
        report = d.undolog.verify_audit(checkpoints=out, public_key=pub)
        assert report.ok and report.checkpoints_checked >= 1, report
        # ...and a copy reaches the target that asked for them by name (not the "*" one), signed, in the
        # form `audit verify --checkpoints` reads from a directory the receiver keeps.
        receiver.wait(lambda: any(g.body["data"]["checkpoint"]["position"] == 2 for g in receiver.events("/offsite")))
        copies = tmp_path / "offsite"
        copies.mkdir()
        for i, g in enumerate(receiver.events("/offsite")):
            assert g.event_type == "audit.checkpoint" and g.signature_ok
            (copies / f"{i}.json").write_text(json.dumps(g.body["data"]))
        assert d.undolog.verify_audit(checkpoints=copies, public_key=pub).ok
        assert not [g for g in receiver.events("/all") if g.event_type == "audit.checkpoint"]
    finally:
        d.close()
    with pytest.raises(ValueError, match="audit_checkpoint_dir"):
        ServerSettings(audit_checkpoint_key=str(key))


def test_a_desk_with_an_unreadable_checkpoint_key_fails_at_start(db: Any, tmp_path: Any) -> None:
    """The key is read when the desk starts (``UndoLog.check_checkpoint_key``), not at the first interval: a key
    that cannot be read would otherwise mean no checkpoints at all, found out hours later."""
    from undolog_core import UndoLog
    from undolog_core.errors import CheckpointInvalid

    not_a_key = tmp_path / "audit.key"
    not_a_key.write_text("not a PEM key")
    settings = ServerSettings(**QUICK, audit_checkpoint_key=str(not_a_key), audit_checkpoint_dir=str(tmp_path / "c"),
                              audit_checkpoint_interval=0.2)
    with pytest.raises(CheckpointInvalid, match="cannot read the private key"):
        make_desk(db, settings=settings)
    with pytest.raises(CheckpointInvalid, match="cannot read the private key"):
        UndoLog.check_checkpoint_key(tmp_path / "missing.key")
