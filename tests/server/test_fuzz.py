"""Schema-driven fuzzing of the whole API (schemathesis) against a live server: no 5xx, ever.

Each operation is fuzzed with an admin and an agent key (so most requests get past auth)
on a database holding a pending request and a session, so generated ids sometimes hit.
Every error must also be problem+json.
"""

from __future__ import annotations

from typing import Any

import hypothesis
import pytest
import schemathesis
from hypothesis import strategies as st

from .conftest import Desk

# Schema-driven fuzzing (its own step in CI).
pytestmark = pytest.mark.fuzz


def test_no_server_errors_anywhere(desk: Desk) -> None:
    desk.pending()
    schema = schemathesis.openapi.from_url(desk.url + "/openapi.json")
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 30
    headers = {who: {"Authorization": f"Bearer {desk.token(who)}"} for who in ("admin", "agent")}

    calls = [0]
    modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    for op, mode in ((op, mode) for op in operations for mode in modes):

        @hypothesis.settings(
            max_examples=8,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(hypothesis.HealthCheck),
        )
        @hypothesis.given(case=op.as_strategy(generation_mode=mode), who=st.sampled_from(["admin", "agent"]))
        def run(case: Any, who: str) -> None:
            response = case.call(headers=headers[who], timeout=30)
            calls[0] += 1
            ctype = response.headers.get("content-type") or response.headers.get("Content-Type") or ""
            ctype = ctype[0] if isinstance(ctype, list) else ctype
            if response.status_code >= 500 or (response.status_code >= 400 and "problem+json" not in ctype):
                failures.append(
                    f"{case.method} {case.formatted_path} body={case.body!r} query={case.query!r} -> "
                    f"{response.status_code} {ctype} {response.text[:300]}"
                )

        try:
            run()
        except hypothesis.errors.Unsatisfiable:
            # An operation without parameters has no invalid variant to generate.
            assert mode is schemathesis.GenerationMode.NEGATIVE
    assert not failures, "\n".join(failures[:20])
    assert calls[0] >= len(operations) * 8
