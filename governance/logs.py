"""Logging filters named in settings.LOGGING."""

from __future__ import annotations

import logging


class NoClientErrorTracebacks(logging.Filter):
    """Django logs a refused request (403 PermissionDenied, say) with its traceback: a
    screenful per refusal that hides real errors. A 4xx keeps its one line; a 5xx keeps
    its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status_code", None)
        if isinstance(status, int) and 400 <= status < 500:
            record.exc_info = None
            record.exc_text = None
        return True
