"""The tool proxy: upstream HTTP tools declared in TOML, guarded by the engine.

A tool server that knows nothing of UndoLog sits behind ``POST
/v1/sessions/{session_id}/tools/{tool}:invoke``. Its declaration becomes a registered
contract (tier, argument schema, reason, risk tags), so it gets a fingerprint and revisions
like any decorated tool, and its compensation endpoint becomes a registered compensation
that rollback calls with ``Idempotency-Key: undo-{undo_id}``.

Example config::

    [tools.refund]
    tier = "compensable"
    url = "http://127.0.0.1:9000/refund"
    compensation_url = "http://127.0.0.1:9000/refund/cancel"
    risk_tags = ["billing"]
    timeout = 10
    [tools.refund.args_schema]
    type = "object"
    required = ["user_id", "amount"]
    properties = { user_id = { type = "string" }, amount = { type = "number" } }

This module holds the tools (their declarations, the upstream client, their registration) and imports nothing of
the server's other modules, so ``state`` can hold them; the route is in ``proxy_api``.
"""

from __future__ import annotations

import functools
import json
import ssl
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from undolog_core import errors, limits

TIERS = ("safe", "compensable", "irreversible")

#: The most of an upstream answer read (bytes); the rest is never read and the stored body says so.
MAX_RESPONSE_BYTES = 1 << 20

#: Header names whose values are credentials: their values stay out of the contract (only their names go in).
_SECRET_HEADER_WORDS = ("authorization", "cookie", "token", "secret", "key", "password", "signature", "auth")

#: Errors after which the upstream may have acted: the request was sent and the answer lost. An approved
#: IRREVERSIBLE call that meets one is recorded ``unknown`` and its session halted, never failed and rolled back.
#: (A connect error or connect timeout means nothing was sent: that is a plain failure.)
OUTCOME_UNKNOWN_ERRORS: tuple[type[BaseException], ...] = (
    httpx.ReadTimeout, httpx.WriteTimeout, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError,
)


class AnswerLost(Exception):
    """An upstream call was sent and its answer lost (one of :data:`OUTCOME_UNKNOWN_ERRORS`, its ``__cause__``).

    Closing our end does not stop the upstream: after a read timeout it may still be working on the request and
    finish it at any time, and plain HTTP has no cancel the upstream vouches for. So the request may still land
    (``original_gone`` False) and nothing will ever tell this process when it cannot (``told_when_gone`` False):
    a probe's "did not happen" is only "not yet", and the call driver settles an IRREVERSIBLE call ``unknown``
    (session halted for a person) rather than approved again, which would let the retry run it twice.

    Example:
        >>> AnswerLost("close_account: ReadTimeout").original_gone
        False
    """

    original_gone = False
    told_when_gone = False


def is_secret_header(name: str) -> bool:
    """Whether a header's value is a credential (kept out of the contract fingerprint)."""
    lowered = name.lower()
    return any(word in lowered for word in _SECRET_HEADER_WORDS)


class UpstreamError(Exception):
    """The upstream tool answered with an error or not at all."""

    def __init__(self, message: str, status_code: int | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body


@dataclass(frozen=True)
class ProxyTool:
    """One upstream tool as declared in the proxy config."""

    name: str
    tier: str
    url: str
    method: str = "POST"
    args_schema: dict[str, Any] | None = None
    reason: str | None = None
    risk_tags: tuple[str, ...] = ()
    compensation_url: str | None = None
    compensation_name: str | None = None
    probe_url: str | None = None
    timeout: float = 10.0
    headers: dict[str, str] = field(default_factory=dict)
    max_response_bytes: int = MAX_RESPONSE_BYTES

    def endpoint(self) -> dict[str, Any]:
        """Where the tool runs, as its contract records it: the URLs, the method and the non-secret headers.

        A change to any of them is a new revision of the tool, which cancels its pending approvals: a person
        approved a call to *this* upstream. Secret headers count by name only, so rotating a token is not a change.
        """
        return {
            "url": self.url,
            "method": self.method,
            "compensation_url": self.compensation_url,
            "probe_url": self.probe_url,
            "headers": {k.lower(): v for k, v in sorted(self.headers.items()) if not is_secret_header(k)},
            "secret_headers": sorted(k.lower() for k in self.headers if is_secret_header(k)),
        }


@dataclass
class Upstream:
    """An upstream answer, its body read up to a limit (``truncated`` when there was more)."""

    status_code: int
    headers: httpx.Headers
    content: bytes
    truncated: bool = False

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300


@functools.cache
def _tls() -> ssl.SSLContext:
    """The one TLS context of every upstream call (httpx's default: certifi's CAs, or ``SSL_CERT_FILE``).

    Building it parses the whole CA bundle: about 20 ms of CPU with the GIL held. Built per call (as a new
    ``httpx.Client`` does), that was most of the desk's CPU under the load test and stalled every other thread;
    an ``SSLContext`` is safe to share between threads. Each call still gets its own client and connection (no
    cookie jar or kept-alive connection shared between calls: a reused connection that the upstream closed at
    the wrong moment would make an approved IRREVERSIBLE call's outcome look unknown).
    """
    return httpx.create_ssl_context()


#: The call's ownership epoch, sent beside ``Idempotency-Key`` (a fencing token, ``CallContext.epoch``): an upstream
#: that keeps the highest epoch it has seen per key may refuse a write whose epoch is below it.
EPOCH_HEADER = "UndoLog-Epoch"


def _post(url: str, payload: Any, *, idempotency_key: str | None, timeout: float, headers: Mapping[str, str],
          method: str = "POST", max_bytes: int = MAX_RESPONSE_BYTES, epoch: int | None = None) -> Upstream:
    h = dict(headers)
    if idempotency_key:
        h["Idempotency-Key"] = idempotency_key
    if epoch is not None:
        h[EPOCH_HEADER] = str(epoch)
    with httpx.Client(timeout=timeout, follow_redirects=False, verify=_tls()) as client, \
            client.stream(method, url, json=payload, headers=h) as resp:
        chunks: list[bytes] = []
        size = 0
        truncated = False
        for chunk in resp.iter_bytes():
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                truncated = True  # the upstream did its work: keep what fits, note the rest, read no more
                break
        content = b"".join(chunks)[:max_bytes]
        return Upstream(resp.status_code, resp.headers, content, truncated)


def _body(resp: Upstream) -> Any:
    """The upstream's body as a value that can always be stored and served (see ``limits.safe_result``)."""
    if resp.truncated:
        return {limits.TRUNCATED: {"reason": f"the upstream answered more than {len(resp.content)} bytes",
                                   "preview": resp.content[: limits.PREVIEW_CHARS].decode("utf-8", "replace")}}
    try:
        value: Any = json.loads(resp.content)
    except RecursionError:
        return {limits.TRUNCATED: f"the upstream's JSON is nested deeper than {limits.MAX_JSON_DEPTH} levels"}
    except ValueError:
        value = resp.content.decode("utf-8", "replace")
    return limits.safe_result(value)


class ProxyTools:
    """The proxied tools of one server.

    Args:
        tools: Declarations by name.
    """

    def __init__(self, tools: Mapping[str, ProxyTool]) -> None:
        self.tools = dict(tools)

    @classmethod
    def load(cls, source: str | Path | Mapping[str, Any]) -> ProxyTools:
        """Parse a proxy config (a TOML file path or an already parsed mapping).

        Raises:
            errors.ConfigurationError: A tool lacks a URL, has an unknown tier, or a
                COMPENSABLE tool has no compensation endpoint.
        """
        if isinstance(source, Mapping):
            data = dict(source)
        else:
            with open(source, "rb") as fh:
                data = tomllib.load(fh)
        defaults = dict(data.get("defaults", {}))
        tools: dict[str, ProxyTool] = {}
        for name, raw in (data.get("tools") or {}).items():
            cfg = {**defaults, **raw}
            tier = str(cfg.get("tier", "")).lower()
            if tier not in TIERS:
                raise errors.ConfigurationError(f"proxy tool {name!r}: tier must be one of {', '.join(TIERS)}")
            if not cfg.get("url"):
                raise errors.ConfigurationError(f"proxy tool {name!r}: url is required")
            if tier == "compensable" and not cfg.get("compensation_url"):
                raise errors.ConfigurationError(
                    f"proxy tool {name!r} is compensable: it needs a compensation_url that undoes it"
                )
            tools[name] = ProxyTool(
                name=name,
                tier=tier,
                url=str(cfg["url"]),
                method=str(cfg.get("method", "POST")).upper(),
                args_schema=cfg.get("args_schema"),
                reason=cfg.get("reason"),
                risk_tags=tuple(cfg.get("risk_tags", ())),
                compensation_url=cfg.get("compensation_url"),
                compensation_name=cfg.get("compensation") or (f"{name}.compensate" if tier == "compensable" else None),
                probe_url=cfg.get("probe_url"),
                timeout=float(cfg.get("timeout", 10.0)),
                max_response_bytes=int(cfg.get("max_response_bytes", MAX_RESPONSE_BYTES)),
                headers={str(k): str(v) for k, v in (cfg.get("headers") or {}).items()},
            )
        return cls(tools)

    def register(self, undolog: Any) -> None:
        """Register every proxied tool and its compensation with ``undolog``."""
        for tool in self.tools.values():
            if tool.tier == "compensable":
                undolog.register_compensation(_compensator(tool), name=tool.compensation_name)
            kwargs: dict[str, Any] = {
                "name": tool.name,
                "tier": tool.tier,
                "reason": tool.reason,
                "risk_tags": list(tool.risk_tags),
                "args_schema": tool.args_schema or {"type": "object", "additionalProperties": True},
                # Part of the contract (the fingerprint): a changed upstream is a new revision.
                "binding": {"proxy": tool.endpoint()},
            }
            if tool.compensation_name:
                kwargs["compensation"] = tool.compensation_name
            if tool.probe_url:
                kwargs["probe"] = _prober(tool)
            undolog.register_tool(_forwarder(tool), **kwargs)

    def call(self, tool: ProxyTool, args: Mapping[str, Any], idempotency_key: str | None, *,
             epoch: int | None = None) -> Upstream:
        """Forward one call upstream; its answer is read up to ``tool.max_response_bytes``. ``epoch``: the call's
        ownership epoch, sent as the :data:`EPOCH_HEADER` header beside ``Idempotency-Key``."""
        return _post(tool.url, dict(args), idempotency_key=idempotency_key, timeout=tool.timeout,
                     headers=tool.headers, method=tool.method, max_bytes=tool.max_response_bytes, epoch=epoch)


def _forwarder(tool: ProxyTool) -> Any:
    def forward(**kwargs: Any) -> Any:
        from undolog_core import current_call

        ctx = current_call()
        resp = _post(tool.url, kwargs, idempotency_key=ctx.idempotency_key if ctx else None,
                     timeout=tool.timeout, headers=tool.headers, method=tool.method, max_bytes=tool.max_response_bytes,
                     epoch=ctx.epoch if ctx else None)
        if not resp.is_success:
            raise UpstreamError(f"{tool.name} upstream answered {resp.status_code}", resp.status_code, _body(resp))
        return {"status_code": resp.status_code, "body": _body(resp)}

    forward.__name__ = f"proxy_{tool.name}"
    forward.__doc__ = tool.reason or f"Proxied tool {tool.name} at {tool.url}"
    return forward


def _compensator(tool: ProxyTool) -> Any:
    def compensate(ctx: Any) -> None:
        result = ctx.result
        if isinstance(result, dict) and "body" in result and "status_code" in result:
            result = result["body"]
        resp = _post(
            tool.compensation_url or "",
            {"tool": tool.name, "args": ctx.args, "result": result},
            idempotency_key=ctx.idempotency_key,
            timeout=tool.timeout,
            headers=tool.headers,
        )
        if not resp.is_success:
            raise UpstreamError(
                f"compensation of {tool.name} answered {resp.status_code}", resp.status_code, _body(resp)
            )

    compensate.__name__ = f"compensate_{tool.name}"
    return compensate


def _prober(tool: ProxyTool) -> Any:
    """Recovery's question to the upstream: did this call happen?

    The probe endpoint gets ``{"tool", "args", "idempotency_key"}`` (the key the call was sent
    with) and answers 404 or ``{"happened": false}`` when it did not, ``{"happened": true,
    "result": ...}`` when it did; any other answer cannot tell.
    """

    def probe(ctx: Any) -> Any:
        # The probe carries the claim's epoch (header): an upstream fencing by epoch learns of the take-over.
        resp = _post(tool.probe_url or "", {"tool": tool.name, "args": ctx.args, "idempotency_key": ctx.idempotency_key},
                     idempotency_key=None, timeout=tool.timeout, headers=tool.headers, epoch=ctx.epoch)
        if resp.status_code == 404:
            return False
        if not resp.is_success:
            raise UpstreamError(f"probe of {tool.name} answered {resp.status_code}", resp.status_code)
        body = _body(resp)
        happened = body.get("happened") if isinstance(body, dict) else None
        if happened is False:
            return False
        if happened is True:
            result = body.get("result")
            return {"status_code": 200, "body": result, "media_type": "application/json"} if result is not None else True
        # Anything else ({"status": "ok"}, "yes", 1) is no answer: the probe cannot tell (the core's None), never
        # read by its truth as "it happened" or "it did not".
        return None

    return probe
