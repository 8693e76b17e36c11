"""What every router shares: the role requirements, path and paging parameters, the response models' base."""

from __future__ import annotations

from typing import Any

from fastapi import Path, Query
from pydantic import BaseModel, ConfigDict

from undolog_core.limits import MAX_ID_LENGTH

from ..auth import require
from ..storage import ROLES

# The role requirements a route declares (``key: ApiKey = Depends(ADMIN)``).
AGENT = require("agent")
APPROVER = require("approver", "admin")
ADMIN = require("admin")
ANY = require(*ROLES)
AGENT_OR_ADMIN = require("agent", "admin")


def id_path() -> Any:
    """A fresh path-parameter declaration (FastAPI binds one FieldInfo to one parameter)."""
    return Path(min_length=1, max_length=MAX_ID_LENGTH)


def page_limit() -> Any:
    """A page size for a listing: every list endpoint is paged, never unbounded."""
    return Query(100, ge=1, le=1000)


def page_offset() -> Any:
    """A listing's offset, bounded so a page request cannot ask the database to skip without end."""
    return Query(0, ge=0, le=1_000_000)


class OutModel(BaseModel):
    """A response model read from rows and records by attribute as well as by key."""

    model_config = ConfigDict(from_attributes=True)
