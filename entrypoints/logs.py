"""Logging of the ``enginecore`` processes: level and format, set up by the entry points only.

``--log-level`` (debug/info/warning/error; the server shows INFO by default, as uvicorn and vLLM
do) and ``--log-format`` (``text``: one readable line; ``json``: one JSON object per line with
``timestamp``, ``level``, ``logger``, ``message`` and the record's structured fields, e.g.
``request_id``, ``state``, ``previous``, ``running``). The library only logs; this module owns
the handlers.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime",
                                                                      "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        obj = {
            "timestamp": datetime.fromtimestamp(record.created, timezone.utc)
                                 .isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                obj[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=False)


def configure(level: str = "info", fmt: str = "text") -> None:
    """Replace the root logger's handlers with one stderr handler of ``fmt`` at ``level``."""
    if level not in LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}")
    if fmt not in FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # transitions logs every trigger at INFO; our Lifecycle logs the same transition already.
    logging.getLogger("transitions").setLevel(logging.WARNING)


def add_log_args(p, default_level: str = "info") -> None:
    p.add_argument("--log-level", choices=LEVELS, default=default_level,
                   help=f"log level (default: {default_level})")
    p.add_argument("--log-format", choices=FORMATS, default="text",
                   help="text, or json: one JSON object per line")


def log_argv(level: str, fmt: str) -> list[str]:
    """The same settings for a child process (the HTTP frontends)."""
    return ["--log-level", level, "--log-format", fmt]


__all__ = ["configure", "add_log_args", "log_argv", "JsonFormatter", "LEVELS", "FORMATS"]
