"""Query strings redacted from uvicorn's logs: a key (``?api_key=``) or a resume token never
reaches a log line.

uvicorn's access log (``uvicorn.access``) and its WebSocket lines
(``uvicorn.error``: ``"WebSocket /v1/realtime?..." [accepted]``) quote each
request's path with its query string. :class:`QueryRedaction` keeps each
parameter's name and replaces its value, but for the few that carry no secret
(:data:`SHOWN`), in every argument and in the message of every record those
loggers emit. :func:`redact_uvicorn_logs` installs it (once; it survives
uvicorn's own logging configuration, which replaces handlers, not filters).
"""

from __future__ import annotations

import logging
import re
from typing import Any

UVICORN_LOGGERS = ("uvicorn.access", "uvicorn.error")
SHOWN = frozenset({"model", "intent", "last_seq"})  # parameters that carry no secret
REDACTED = "***"
_QUERY = re.compile(r"\?([^\s\"']*)")


def redact_query(text: str) -> str:
    """``text`` with every query string's values replaced, but :data:`SHOWN` ones."""
    def one(match: re.Match) -> str:
        pairs = []
        for pair in match.group(1).split("&"):
            name, eq, _ = pair.partition("=")
            pairs.append(pair if not eq or name in SHOWN else f"{name}={REDACTED}")
        return "?" + "&".join(pairs)

    return _QUERY.sub(one, text) if "?" in text else text


class QueryRedaction(logging.Filter):
    """Redacts query strings in a record's message and string arguments (never drops one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact_query(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact_query(a) if isinstance(a, str) else a
                                for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: redact_query(v) if isinstance(v, str) else v
                           for k, v in record.args.items()}
        return True


def redact_uvicorn_logs(loggers: Any = UVICORN_LOGGERS) -> None:
    """Install :class:`QueryRedaction` on uvicorn's loggers (idempotent)."""
    for name in loggers:
        logger = logging.getLogger(name)
        if not any(isinstance(f, QueryRedaction) for f in logger.filters):
            logger.addFilter(QueryRedaction())
