"""ast.parse one thread at a time, inside the schemathesis process.

CPython 3.11's AST constructor keeps its recursion depth in per-interpreter state,
so two threads inside ast.parse at once (schemathesis' --workers are threads;
hypothesis parses lambdas to describe them) can fail with "SystemError: AST
constructor recursion depth mismatch" (python/cpython#106905). That is the fuzzer's
own error, not a finding about the API, and it once failed CI. fuzz.hooks installs
this before any worker starts.
"""

from __future__ import annotations

import ast
import functools
import threading
from typing import Any

_LOCK = threading.Lock()


def serialized(parse: Any) -> Any:
    if getattr(parse, "__serialized__", False):
        return parse

    @functools.wraps(parse)
    def serial_parse(*args: Any, **kwargs: Any) -> Any:
        with _LOCK:
            return parse(*args, **kwargs)

    serial_parse.__serialized__ = True  # type: ignore[attr-defined]
    return serial_parse


def install() -> None:
    ast.parse = serialized(ast.parse)
