"""The base of every wire message and the bounded scalar types they share (``messages.py`` and
``control.py`` build on it; the protocol is documented in ``messages.py``)."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

MAX_PATH_LEN = 4096  # Linux's PATH_MAX

CallId = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Count = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Version = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Seconds = Annotated[float, Meta(ge=0.0, le=1e9)]


class _Message(
    msgspec.Struct,
    tag_field="t",
    tag=True,
    forbid_unknown_fields=True,
    omit_defaults=True,
    kw_only=True,
    gc=False,
):
    """Base of every message (not itself on the wire)."""


__all__ = ["_Message", "CallId", "Count", "Version", "Seconds", "MAX_PATH_LEN"]
