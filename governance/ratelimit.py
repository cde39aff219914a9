"""Per-token rate limits, counted atomically.

With REDIS_URL: a fixed-window counter incremented and given its expiry in
one Lua script, so concurrent requests across any number of web processes
can never both slip under the limit (DRF's throttles read, then write).
Without it (embedded mode): the same counter in this process's memory.

If the counter cannot be reached, `check` raises LimiterUnavailable; the
caller decides: grant requests and approvals fail closed, decisions go on
(a limiter outage must never turn a decision into an allow, and the decision
itself is already default-deny).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from typing import Any

from django.conf import settings

log = logging.getLogger(__name__)

WINDOW_SECONDS = 60
# After the counter could not be reached, say so at once for this long instead
# of making every request (decisions included) wait out another connect timeout.
DOWN_BACKOFF_SECONDS = 1.0

# The expiry is set whenever the key has none, not only when INCR returned 1,
# so a key can never be left counting forever.
_SCRIPT = """
local n = redis.call('INCR', KEYS[1])
if redis.call('TTL', KEYS[1]) < 0 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return n
"""


class LimiterUnavailable(Exception):
    pass


class RateLimited(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"retry after {retry_after}s")
        self.retry_after = retry_after


_lock = threading.Lock()
_memory: dict[str, tuple[int, int]] = {}  # key -> (count, window)
_down_until: dict[str, float] = {}
# One Redis connection per thread and URL, used directly: redis-py's pool and
# Script wrapper cost about three times the round trip itself, on every
# /authorize. Per URL because settings can change (tests, reconfiguration), and
# a connection made for the first URL would quietly keep counting somewhere else.
_local = threading.local()
_SHA = hashlib.sha1(_SCRIPT.encode()).hexdigest()  # noqa: S324 - Redis names scripts by SHA-1


def _connection(url: str) -> Any:
    connections = _local.__dict__.setdefault("connections", {})
    conn = connections.get(url)
    if conn is None:
        import redis

        # from_url reads the URL as the client would (rediss://, password, db).
        pool = redis.ConnectionPool.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        conn = connections[url] = pool.connection_class(**pool.connection_kwargs)
    return conn


def _evalsha(conn: Any, key: str) -> int:
    from redis.exceptions import NoScriptError

    try:
        conn.send_command("EVALSHA", _SHA, 1, key, WINDOW_SECONDS)
        return int(conn.read_response())
    except NoScriptError:  # a restarted or flushed Redis: load the script, then count
        conn.send_command("SCRIPT", "LOAD", _SCRIPT)
        conn.read_response()
        conn.send_command("EVALSHA", _SHA, 1, key, WINDOW_SECONDS)
        return int(conn.read_response())


def _count_redis(url: str, key: str) -> int:
    if _down_until.get(url, 0.0) > time.monotonic():
        raise LimiterUnavailable("the rate limiter was unreachable a moment ago")
    from redis.exceptions import ConnectionError as RedisConnectionError

    conn = _connection(url)
    try:
        try:
            return _evalsha(conn, key)
        except RedisConnectionError:
            # The server closed a connection that sat idle (a restart): one new one.
            # A count sent just before the break may count twice: stricter, not looser.
            conn.disconnect()
            return _evalsha(conn, key)
    except Exception as exc:  # connection refused, timeout, auth, OOM, ...
        conn.disconnect()  # whatever was half-read is dropped with it
        _down_until[url] = time.monotonic() + DOWN_BACKOFF_SECONDS
        log.warning("rate limiter unreachable: %s", exc)
        raise LimiterUnavailable(str(exc)) from exc


def _count_memory(key: str, window: int) -> int:
    with _lock:
        count = _memory.get(key, (0, window))[0] + 1
        _memory[key] = (count, window)
        if len(_memory) > 10_000:  # forget finished windows
            for stale in [k for k, (_, w) in _memory.items() if w < window]:
                del _memory[stale]
    return count


def check(bucket: str, token_id: int, *, now: float | None = None) -> None:
    """Count one request; raise RateLimited past the limit.

    `now` (epoch seconds) picks the window; Retry-After is the time until that
    window ends, when the count starts again from zero.
    """
    limit = settings.RATE_LIMITS[bucket]
    now = time.time() if now is None else now
    window = int(now // WINDOW_SECONDS)
    # A prefix lets deployments (or test runs) share one Redis without sharing counts.
    prefix = getattr(settings, "RATE_LIMIT_KEY_PREFIX", "rl")
    key = f"{prefix}:{bucket}:{token_id}:{window}"
    url = settings.REDIS_URL
    count = _count_redis(url, key) if url else _count_memory(key, window)
    if count > limit:
        raise RateLimited(max(math.ceil((window + 1) * WINDOW_SECONDS - now), 1))


def reset_memory() -> None:
    """Tests only: forget in-process counters and any remembered outage."""
    with _lock:
        _memory.clear()
        _down_until.clear()
