"""JSON-lines logging: one object per line, so log shippers need no parsing rules.

Structured fields go in ``extra={"fields": {...}}``; they land at the top level of the line.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_RESERVED = {"ts", "level", "logger", "msg"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            line.update({k: v for k, v in extra.items() if k not in _RESERVED})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, separators=(",", ":"))


def configure(level: str = "INFO") -> None:
    """Routes every logger (aiohttp's included) to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # The server logs its own line per request; aiohttp's access log would repeat it unstructured.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
