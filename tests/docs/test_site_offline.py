"""The built docs site, opened in headless Chromium with every request outside it refused, draws its diagrams.

``test_docs.py::test_the_built_site_loads_nothing_from_elsewhere`` reads the HTML; this test is the browser's
view of the same promise: the state diagrams of ``reference/states.md`` are drawn by the Mermaid the site serves
(mkdocs-material would otherwise fetch it from a CDN when the page is viewed), and nothing leaves the site.
"""

from __future__ import annotations

import functools
import http.server
import threading
import time
from pathlib import Path

import pytest

from tests.docs.test_docs import site  # noqa: F401 - the built site, a fixture of that module
from tests.server.test_dashboard import CHROMIUM, CHROMIUM_ARGS


@pytest.mark.browser
def test_state_diagrams_are_drawn_with_the_network_cut_off(site: Path) -> None:  # noqa: F811 - the fixture
    from playwright.sync_api import sync_playwright

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}/"
    outside: list[str] = []
    errors: list[str] = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)

            def route(r: object) -> None:
                url = r.request.url  # type: ignore[attr-defined]
                if url.startswith(base):
                    r.continue_()  # type: ignore[attr-defined]
                else:
                    outside.append(url)
                    r.abort()  # type: ignore[attr-defined]

            page.route("**/*", route)
            page.goto(base + "reference/states/")
            # The theme swaps each <pre class="mermaid"> for a <div class="mermaid"> holding the drawing (in a
            # closed shadow root) once Mermaid has drawn it.
            for _ in range(600):
                drawn = page.evaluate("[...document.querySelectorAll('div.mermaid')].length")
                if drawn >= 4:
                    break
                time.sleep(0.1)
            assert page.evaluate("typeof mermaid") == "object"
            assert drawn == page.evaluate("document.querySelectorAll('.mermaid').length") >= 4
            browser.close()
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert not outside, f"the page asked for {outside}"
    assert not errors, errors
