"""Settings for benchmarks.http_authorize only: the app's settings, plus two things.

1. ROOT_URLCONF is benchmarks.http_urls, which adds the constant-JSON floor view
   (/bench/floor) beside the app's URLs, so that view never exists in production.
2. The clock. The benchmark data set (benchmarks.authorize) lays grant windows
   around a fixed virtual instant AT so it never ages between runs; in-process
   benchmarks pass `at=AT`, but the API asks the clock (timezone.now()). So
   here the clock reads AT + (seconds since BENCH_CLOCK_ORIGIN): time still
   moves, and every worker reads the same instant. Without this every question
   would be answered "not started yet" and the mix would have no allows. A run
   starts where the last one's events end (BENCH_CLOCK_START, set by
   benchmarks.http_authorize), never back at AT: a clock that went back made the
   earlier runs' tokens, revoked "later", count as live (at most
   AGENT_TOKEN_MAX_LIVE per agent: the sixth run on a database was refused), and
   the log's times out of order. The grants' windows span AT - 1 day to AT + 6
   days, so thousands of runs keep the same mix.
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime

from django.utils import timezone

from benchmarks.authorize import AT
from governance.settings import *  # noqa: F403

ROOT_URLCONF = "benchmarks.http_urls"
# Counters of a benchmark run never share keys with anything else on that Redis.
RATE_LIMIT_KEY_PREFIX = "bench-http"

_ORIGIN = float(os.environ.get("BENCH_CLOCK_ORIGIN", "") or time.time())
_START = float(os.environ.get("BENCH_CLOCK_START", "") or AT.timestamp())
_SHIFT = _START - _ORIGIN


def _benchmark_now() -> datetime:
    return datetime.fromtimestamp(time.time() + _SHIFT, tz=UTC)


timezone.now = _benchmark_now
