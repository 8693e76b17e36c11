"""A test-only reverse proxy that adds ``Authorization: Bearer <key>`` to every request it forwards.

The conformance runner sends no Authorization header, and the gateway has no unauthenticated mode (nor gets one):
this proxy stands in front of it for the suite. Everything else passes unchanged both ways (Host and Origin
included, so the gateway's own checks of them are what the suite sees), responses streamed as they come (SSE).

Run: ``python bearer_proxy.py --target http://127.0.0.1:PORT/mcp --key KEY`` (prints ``proxy: http://...`` once
listening on a free port).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import httpx
import uvicorn

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "content-length"}


def build(target: str, key: str) -> Any:
    client = httpx.AsyncClient(timeout=httpx.Timeout(None))
    base = httpx.URL(target)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k.decode("latin-1").lower() not in HOP_BY_HOP | {"authorization"}]
        headers.append(("authorization", f"Bearer {key}"))
        url = base.copy_with(query=scope.get("query_string") or None)
        request = client.build_request(scope["method"], url, headers=headers, content=body)
        response = await client.send(request, stream=True)
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k.encode("latin-1"), v.encode("latin-1"))
                                    for k, v in response.headers.multi_items() if k.lower() not in HOP_BY_HOP]})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()

    return app


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--key", required=True)
    ns = parser.parse_args()
    config = uvicorn.Config(build(ns.target, ns.key), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    serving = asyncio.ensure_future(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    print(f"proxy: http://127.0.0.1:{port}/mcp", file=sys.stderr, flush=True)
    await serving


if __name__ == "__main__":
    asyncio.run(main())
