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

import threading
import time
from typing import Any

from django.conf import settings

WINDOW_SECONDS = 60

_SCRIPT = """
local n = redis.call('INCR', KEYS[1])
if n == 1 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return {n, redis.call('TTL', KEYS[1])}
"""


class LimiterUnavailable(Exception):
    pass


class RateLimited(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"retry after {retry_after}s")
        self.retry_after = retry_after


_lock = threading.Lock()
_memory: dict[str, tuple[int, float]] = {}
_redis_client: Any = None
_redis_script: Any = None


def _redis() -> Any:
    global _redis_client, _redis_script
    if _redis_client is None:
        import redis

        _redis_client = redis.Redis.from_url(
            settings.REDIS_URL, socket_timeout=0.5, socket_connect_timeout=0.5
        )
        _redis_script = _redis_client.register_script(_SCRIPT)
    return _redis_script


def _count(key: str) -> tuple[int, int]:
    if settings.REDIS_URL:
        try:
            count, ttl = _redis()(keys=[key], args=[WINDOW_SECONDS])
        except Exception as exc:  # connection refused, timeout, auth, ...
            raise LimiterUnavailable(str(exc)) from exc
        return int(count), max(int(ttl), 1)
    now = time.monotonic()
    with _lock:
        count, ends = _memory.get(key, (0, now + WINDOW_SECONDS))
        if ends <= now:
            count, ends = 0, now + WINDOW_SECONDS
        count += 1
        _memory[key] = (count, ends)
        if len(_memory) > 100_000:  # forget finished windows
            for stale in [k for k, (_, e) in _memory.items() if e <= now]:
                del _memory[stale]
    return count, max(int(ends - now) + 1, 1)


def check(bucket: str, token_id: int) -> None:
    """Count one request; raise RateLimited past the limit."""
    limit = settings.RATE_LIMITS[bucket]
    window = int(time.time()) // WINDOW_SECONDS
    count, ttl = _count(f"rl:{bucket}:{token_id}:{window}")
    if count > limit:
        raise RateLimited(ttl)


def reset_memory() -> None:
    """Tests only: forget in-process counters."""
    with _lock:
        _memory.clear()
