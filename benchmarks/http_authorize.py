"""Benchmark: POST /api/v1/authorize over HTTP, beside DRF's own floor.

Run (PostgreSQL only; the data set is benchmarks.authorize's, generated once):

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/gov_bench \\
        .venv/bin/python -m benchmarks.http_authorize [--seconds 8 --callers 1,4,16]

What runs:

  server  gunicorn, 2 workers, gthread (--threads per worker), on 127.0.0.1 and a free
          port, settings benchmarks.http_settings: the app plus /bench/floor.
          Audit writes are on: every /authorize answer goes through access_check(),
          whose audit event commits (fsync) before the response is sent.
  floor   /bench/floor, a DRF APIView with the API's own bearer-token authentication,
          IsAgent permission and JSON renderer, answering a constant small JSON.
          It is what the framework costs before any of our work (middleware, routing,
          token lookup, rendering): the most /authorize could reach.
  client  this process: N threads, each owning one keep-alive TCP connection (raw
          sockets, requests encoded before the clock starts), sending a seeded mix
          of /authorize bodies for a fixed time, then stopping new sends and waiting
          for the one in flight, so responses == requests sent, exactly.
  mix     benchmarks.authorize.request_mix() (allowed, and no_grant, scope_mismatch,
          grant_revoked, grant_expired denials) restricted to --tokens agents, each
          holding a bearer token issued by services.agents.token_issue for this run
          (revoked again at the end). The agent is the token's: the body names tool,
          action and scope.

Phases: for each caller count, the floor and then /authorize, --seconds each, after a
short warm-up of both. After every /authorize phase the new access.* audit events are
counted in PostgreSQL and must equal the 200/503 responses.

Why gthread, not sync: gunicorn's sync worker closes the connection after every
response (no keep-alive), so a keep-alive client cannot be measured against it.
gthread keeps the 2 processes, holds idle keep-alive connections in a poller and
serves --threads requests at a time per process. 2 threads (the default) let one
request run Python while the other waits on PostgreSQL or Redis; on this 2-CPU
machine 1, 4 and 8 threads measured worse at 16 callers (1: requests queue behind a
worker waiting on its commit; 4 and 8: more threads fight for the GIL, and one
holding the audit chain lock waits for the GIL, so every other appender waits too).

The rate limiter: with --limiter redis (the default; REDIS_URL=redis://127.0.0.1:6379/13)
every /authorize pays the production limiter's round trip to Redis; with --limiter
memory it is the in-process counter. The limit is raised
(RATE_LIMIT_AUTHORIZE_PER_MINUTE) so nothing is throttled: a 429 would be an error here.

The clock: see benchmarks.http_settings (the server's clock reads the data set's
virtual instant, so the mix has its allows).

Everything runs on one machine: the client's threads, both gunicorn workers and
PostgreSQL share its CPUs; the CPU split and the load average are printed per phase.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.authorize import (
    AT,
    chain_bad_links,
    ensure_data,
    ensure_database,
    percentiles,
    request_mix,
)

HOST = "127.0.0.1"
AUTHORIZE_PATH = "/api/v1/authorize"
FLOOR_PATH = "/bench/floor"
# --breakdown: the floor plus /authorize's pieces one at a time (benchmarks.http_urls).
LIMITED_PATH = "/bench/limited"
DECIDED_PATH = "/bench/decided"
TARGET_RATIO = 0.60  # of the floor's throughput, at the highest caller count
TARGET_P99_MS = 25.0
REDIS_BENCH_URL = "redis://127.0.0.1:6379/13"
RATE_LIMIT_FOR_BENCH = 100_000_000  # per token per minute: never reached


# --- The client -----------------------------------------------------------------


class Connection:
    """One keep-alive HTTP/1.1 connection on a raw socket.

    Reads exactly one response per request (status line, headers, a body of
    Content-Length bytes), so nothing is ever left unread or counted twice.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = self._open()
        self.buffer = b""

    def _open(self) -> socket.socket:
        sock = socket.create_connection((HOST, self.port), timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def reopen(self) -> None:
        self.close()
        self.sock = self._open()
        self.buffer = b""

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def round_trip(self, request: bytes) -> tuple[int, bytes, bool]:
        """Send one request; return (status, body, server closed the connection)."""
        sock = self.sock
        sock.sendall(request)
        buf = self.buffer
        end = buf.find(b"\r\n\r\n")
        while end < 0:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("connection closed before the response headers")
            buf += chunk
            end = buf.find(b"\r\n\r\n")
        head = buf[:end].lower()
        status = int(head[9:12])
        at = head.find(b"\r\ncontent-length:")
        if at < 0:
            raise ConnectionError("response without Content-Length")
        stop = head.find(b"\r\n", at + 2)
        length = int(head[at + 17 : stop if stop >= 0 else len(head)])
        total = end + 4 + length
        while len(buf) < total:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("connection closed inside the response body")
            buf += chunk
        body = buf[end + 4 : total]
        self.buffer = buf[total:]
        return status, body, b"\r\nconnection: close" in head


def encode(path: str, token: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nAccept: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


@dataclass
class CallerResult:
    sent: int = 0
    received: int = 0
    last_ns: int = 0
    reconnects: int = 0
    failures: list[str] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    latencies: array = field(default_factory=lambda: array("q"))


@dataclass
class Phase:
    label: str
    callers: int
    seconds: float
    sent: int
    received: int
    elapsed_s: float
    p50_ms: float
    p99_ms: float
    statuses: Counter[int]
    reasons: Counter[str]
    reconnects: int
    failures: list[str]
    cpu: dict[str, float]
    load: tuple[float, float, float]

    @property
    def rate(self) -> float:
        return self.received / self.elapsed_s if self.elapsed_s else 0.0


def _caller(
    port: int,
    requests: list[bytes],
    offset: int,
    parse: bool,
    barrier: threading.Barrier,
    clock_box: list[int],
    result: CallerResult,
) -> None:
    clock = time.perf_counter_ns
    record = result.latencies.append
    n = len(requests)
    k = offset
    conn = Connection(port)
    try:
        barrier.wait()
        deadline = clock_box[1]
        while True:
            t0 = clock()
            if t0 >= deadline:  # no new request after the deadline
                break
            request = requests[k % n]
            k += 1
            result.sent += 1
            try:
                status, body, closed = conn.round_trip(request)
            except OSError as exc:  # a lost request: reported, and it fails the run
                result.failures.append(f"{type(exc).__name__}: {exc}")
                conn.reopen()
                result.reconnects += 1
                continue
            t1 = clock()
            record(t1 - t0)
            result.received += 1
            result.last_ns = t1
            result.statuses[status] += 1
            if parse:
                answer = json.loads(body)
                result.reasons[answer.get("reason") or f"http {status}"] += 1
            if closed:
                conn.reopen()
                result.reconnects += 1
    finally:
        conn.close()


def run_phase(
    label: str,
    port: int,
    requests: list[bytes],
    callers: int,
    seconds: float,
    *,
    parse: bool,
    seed: int,
    server_pids: list[int],
) -> Phase:
    """`callers` threads, one keep-alive connection each, for `seconds`."""
    rng = random.Random(seed)
    results = [CallerResult() for _ in range(callers)]
    clock_box = [0, 0]  # start, deadline: set once every caller is connected

    def start() -> None:
        clock_box[0] = time.perf_counter_ns()
        clock_box[1] = clock_box[0] + int(seconds * 1e9)

    barrier = threading.Barrier(callers, action=start)
    threads = [
        threading.Thread(
            target=_caller,
            args=(port, requests, rng.randrange(len(requests)), parse, barrier, clock_box, r),
            daemon=True,
        )
        for r in results
    ]
    cpu_before = cpu_snapshot(server_pids)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu = cpu_delta(cpu_before, cpu_snapshot(server_pids))
    latencies = array("q")
    statuses: Counter[int] = Counter()
    reasons: Counter[str] = Counter()
    for r in results:
        latencies.extend(r.latencies)
        statuses.update(r.statuses)
        reasons.update(r.reasons)
    p50_us, p99_us = percentiles(latencies)
    last = max((r.last_ns for r in results), default=clock_box[0])
    return Phase(
        label=label,
        callers=callers,
        seconds=seconds,
        sent=sum(r.sent for r in results),
        received=sum(r.received for r in results),
        elapsed_s=(last - clock_box[0]) / 1e9,
        p50_ms=p50_us / 1000,
        p99_ms=p99_us / 1000,
        statuses=statuses,
        reasons=reasons,
        reconnects=sum(r.reconnects for r in results),
        failures=[f for r in results for f in r.failures],
        cpu=cpu,
        load=os.getloadavg(),
    )


# --- Who used the CPUs ---------------------------------------------------------------


def _proc_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime + stime


def _postgres_ticks() -> int:
    """CPU of every PostgreSQL process (backends of other databases included)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if stat[stat.find("(") + 1 : stat.rfind(")")] == "postgres":
                fields = stat.rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
    return total


def cpu_snapshot(server_pids: list[int]) -> dict[str, float]:
    cpu_line = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(x) for x in cpu_line]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return {
        "wall": time.monotonic(),
        "busy": sum(ticks) - idle,
        "client": _proc_ticks(os.getpid()),
        "server": sum(_proc_ticks(pid) for pid in server_pids),
        "postgres": _postgres_ticks(),
    }


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU used between two snapshots, in cores (1.0 = one core busy all the time)."""
    hz = os.sysconf("SC_CLK_TCK")
    wall = after["wall"] - before["wall"]
    keys = ("busy", "client", "server", "postgres")
    cores = {k: (after[k] - before[k]) / hz / wall for k in keys}
    cores["other"] = max(cores["busy"] - cores["client"] - cores["server"] - cores["postgres"], 0)
    return cores


def idle_check(seconds: float = 2.0) -> dict[str, float]:
    """What the machine does before we start: anything busy here competes with us."""
    before = cpu_snapshot([])
    time.sleep(seconds)
    return cpu_delta(before, cpu_snapshot([]))


# --- The server ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def start_server(port: int, env: dict[str, str], threads: int, log_path: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "gunicorn",
        "governance.wsgi:application",
        "--bind",
        f"{HOST}:{port}",
        "--workers",
        "2",
        "--worker-class",
        "gthread",
        "--threads",
        str(threads),
        "--keep-alive",
        "30",
        "--log-level",
        "warning",
    ]
    log = log_path.open("wb")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def worker_pids(master: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == master:
                pids.append(int(entry.name))
    return sorted(pids)


def wait_ready(server: subprocess.Popen, port: int, probe: bytes, log_path: Path) -> list[int]:
    """Until both workers answer the probe (a floor request) with 200."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"gunicorn exited ({server.returncode}):\n{log_path.read_text()}")
        workers = worker_pids(server.pid)
        if len(workers) == 2:
            try:
                conn = Connection(port)
                try:
                    status, body, _ = conn.round_trip(probe)
                finally:
                    conn.close()
                if status != 200:
                    sys.exit(f"probe answered {status}: {body[:300]!r}")
                return workers
            except OSError:
                pass
        time.sleep(0.2)
    sys.exit(f"gunicorn did not come up:\n{log_path.read_text()}")


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.terminate()  # graceful: the master stops its workers
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


# --- Main --------------------------------------------------------------------------


def limiter_url(choice: str) -> str | None:
    if choice == "memory":
        return None
    import redis

    try:
        redis.Redis.from_url(REDIS_BENCH_URL, socket_connect_timeout=1).ping()
    except Exception as exc:
        sys.exit(f"--limiter redis: {REDIS_BENCH_URL} is not reachable ({exc}); use memory")
    return REDIS_BENCH_URL


def access_events_after(seq: int) -> tuple[int, int]:
    """(access.* events, all events) with seq > `seq`."""
    from governance.models import AuditEvent

    new = AuditEvent.objects.filter(seq__gt=seq)
    return new.filter(event_type__startswith="access.").count(), new.count()


def head_seq() -> int:
    from governance.models import AuditEvent

    return AuditEvent.objects.order_by("-seq").values_list("seq", flat=True).first() or 0


def clock_start(url: str) -> float:
    """AT, or a second past the newest event of the runs before (benchmarks.http_settings:
    the clock never goes back between runs)."""
    import psycopg

    from benchmarks.authorize import _pg_params

    with psycopg.connect(**_pg_params(url), autocommit=True) as conn:
        found = conn.execute("SELECT to_regclass('governance_auditevent')").fetchone()
        newest = None
        if found and found[0]:
            newest = conn.execute("SELECT max(created_at) FROM governance_auditevent").fetchone()[0]
    return max(AT.timestamp(), newest.timestamp() + 1 if newest else 0.0)


def issue_tokens(agent_names: list[str]) -> dict[str, tuple[Any, str]]:
    from django.contrib.auth.models import User
    from django.utils import timezone

    from governance.audit import Actor
    from governance.models import Agent
    from governance.services.agents import token_issue

    issuer = User.objects.get(username="bench-requester")
    actor = Actor.system("benchmark")
    tokens = {}
    for agent in Agent.objects.filter(name__in=agent_names).order_by("name"):
        tokens[agent.name] = token_issue(
            created_by=issuer, actor=actor, at=timezone.now(), agent=agent, days=1
        )
    return tokens


def revoke_tokens(tokens: dict[str, tuple[Any, str]]) -> None:
    from django.utils import timezone

    from governance.audit import Actor
    from governance.services.agents import token_revoke

    for token, _plaintext in tokens.values():
        token_revoke(token=token, actor=Actor.system("benchmark"), at=timezone.now())


def _fmt_row(callers: int, floor: Phase, auth: Phase) -> str:
    return (
        f"{callers:>7} | {floor.rate:>8,.0f} {floor.p50_ms:>7.2f} {floor.p99_ms:>7.2f} | "
        f"{auth.rate:>8,.0f} {auth.p50_ms:>7.2f} {auth.p99_ms:>7.2f} | "
        f"{auth.rate / floor.rate if floor.rate else 0:>6.0%}"
    )


_STAGES = (
    ("floor", "floor: DRF, bearer token, constant JSON"),
    ("limited", "+ the rate limiter's check"),
    ("decided", "+ body parsed, authorize() (no audit event)"),
    ("authorize", "+ access_check's audit event: /authorize"),
    ("async*", "/authorize, synchronous_commit=off (diagnostic only)"),
)


def _breakdown(phases: dict[tuple[str, int], Phase], top: int) -> str:
    """/authorize's pieces added to the floor one at a time, at `top` callers: rate,
    share of the floor's rate, and the CPU each request took (server and PostgreSQL
    processes, and the whole machine's, in ms of one core per request)."""
    floor = phases[("floor", top)]
    lines = [
        f"breakdown at {top} callers (CPU: ms of one core per request)",
        f"{'':48} {'req/s':>8} {'of floor':>8} {'p99 ms':>7} {'gunicorn':>8} "
        f"{'postgres':>8} {'machine':>8}",
    ]
    for key, text in _STAGES:
        phase = phases.get((key, top))
        if phase is None or not phase.rate:
            continue
        per = 1000.0 / phase.rate  # core-seconds/s over requests/s, in ms
        lines.append(
            f"{text:48} {phase.rate:>8,.0f} {phase.rate / floor.rate:>8.0%} "
            f"{phase.p99_ms:>7.2f} {phase.cpu['server'] * per:>8.3f} "
            f"{phase.cpu['postgres'] * per:>8.3f} {phase.cpu['busy'] * per:>8.3f}"
        )
    return "\n".join(lines)


def _describe(phase: Phase) -> str:
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(phase.statuses.items()))
    cpu = phase.cpu
    text = (
        f"  {phase.label:9} {phase.callers:>2} callers: sent {phase.sent}, responses "
        f"{phase.received} ({statuses}) in {phase.elapsed_s:.2f}s; "
        f"reconnects {phase.reconnects}\n            CPU cores busy {cpu['busy']:.2f} of "
        f"{os.cpu_count()}: client {cpu['client']:.2f}, gunicorn {cpu['server']:.2f}, "
        f"postgres {cpu['postgres']:.2f}, other {cpu['other']:.2f}; load {phase.load[0]:.2f}"
    )
    if phase.reasons:
        total = sum(phase.reasons.values())
        allow = phase.reasons.get("allowed", 0)
        reasons = dict(phase.reasons.most_common())
        text += f"\n            reasons: {reasons} ({allow / total:.0%} allow)"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--tools", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=8.0, help="per measured phase")
    parser.add_argument("--warmup", type=float, default=1.5, help="seconds per endpoint")
    parser.add_argument("--callers", default="1,4,16", help="concurrent callers per phase")
    parser.add_argument("--tokens", type=int, default=64, help="agents with a bearer token")
    parser.add_argument("--threads", type=int, default=2, help="gthread threads per worker")
    parser.add_argument("--limiter", choices=["redis", "memory"], default="redis")
    parser.add_argument("--slices", type=int, default=2000, help="(agent, tool) pairs in the mix")
    parser.add_argument("--requests", type=int, default=100_000, help="mix before filtering")
    parser.add_argument("--seed", type=int, default=20300115)
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="at the highest caller count, also time the floor plus the rate limiter, and "
        "plus the decision (no audit event): what each piece of /authorize costs",
    )
    parser.add_argument(
        "--async-commit-diagnostic",
        action="store_true",
        help="at the highest caller count, time /authorize once more with "
        "synchronous_commit=off (a diagnostic of what the fsync costs; never a valid setting)",
    )
    opts = parser.parse_args(argv)
    callers_list = [int(x) for x in opts.callers.split(",")]
    t_start = time.monotonic()

    url = os.environ.get("DATABASE_URL")
    if not url:
        sys.exit("set DATABASE_URL=postgresql://postgres@127.0.0.1:5432/gov_bench")
    redis_url = limiter_url(opts.limiter)
    ensure_database(url, reset=False)
    # This process and the server read the same shifted clock (benchmarks.http_settings),
    # starting where the last run's events end.
    os.environ["BENCH_CLOCK_START"] = f"{clock_start(url):.6f}"
    origin = f"{time.time():.6f}"
    os.environ["BENCH_CLOCK_ORIGIN"] = origin
    os.environ["DJANGO_SETTINGS_MODULE"] = "benchmarks.http_settings"
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    import django

    django.setup()
    ensure_data(opts.agents, opts.tools)

    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SHOW server_version")
        pg_version = cur.fetchone()[0]

    # The mix of benchmarks.authorize, for the agents that hold a token this run.
    full = request_mix(opts.agents, opts.tools, opts.slices, opts.requests, opts.seed)
    sample: list[str] = []
    for r in full:
        if r.agent not in sample:
            sample.append(r.agent)
            if len(sample) == opts.tokens:
                break
    mix = [r for r in full if r.agent in set(sample)]
    run_start_seq = head_seq()
    tokens = issue_tokens(sample)
    bodies = [
        (tokens[r.agent][1], {"tool": r.tool, "action": r.action, "scope": r.scope}) for r in mix
    ]
    authorize_requests = [encode(AUTHORIZE_PATH, token, body) for token, body in bodies]
    floor_requests = [encode(FLOOR_PATH, token, body) for token, body in bodies]
    stage_requests = {
        "limited": [encode(LIMITED_PATH, token, body) for token, body in bodies],
        "decided": [encode(DECIDED_PATH, token, body) for token, body in bodies],
    }

    import gunicorn
    import rest_framework

    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "benchmarks.http_settings",
        "BENCH_CLOCK_ORIGIN": origin,
        "RATE_LIMIT_AUTHORIZE_PER_MINUTE": str(RATE_LIMIT_FOR_BENCH),
        "LOG_LEVEL": "WARNING",
    }
    env.pop("REDIS_URL", None)
    if redis_url:
        env["REDIS_URL"] = redis_url
    quiet = idle_check()
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="http-authorize-"))
    log_path = workdir / "gunicorn.log"
    server = start_server(port, env, opts.threads, log_path)
    phases: dict[tuple[str, int], Phase] = {}
    checks: list[str] = []
    audit_ok = exact_ok = True
    try:
        pids = wait_ready(server, port, floor_requests[0], log_path)
        print(
            f"PostgreSQL {pg_version}; {os.cpu_count()} CPUs; python {sys.version.split()[0]}, "
            f"gunicorn {gunicorn.__version__}, DRF {rest_framework.__version__}\n"
            f"before the run: {quiet['busy']:.2f} CPU cores busy (postgres {quiet['postgres']:.2f},"
            f" other {quiet['other']:.2f}), load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
            + (
                "  WARNING: the machine is not idle; the numbers below share it"
                if quiet["busy"] > 0.25
                else ""
            )
            + "\n"
            f"server: gunicorn 2 workers x gthread {opts.threads} threads on {HOST}:{port}, "
            f"keep-alive; audit writes on; rate limiter: "
            + (
                f"Redis {redis_url} (the real limiter's round trip on every /authorize)"
                if redis_url
                else "in-process memory (REDIS_URL unset)"
            )
            + f", limit {RATE_LIMIT_FOR_BENCH:,}/min per token\n"
            f"client: this process, 1 thread + 1 keep-alive connection per caller, raw sockets; "
            f"same CPUs as the server\n"
            f"mix: {len(mix)} /authorize bodies over {len({(r.agent, r.tool) for r in mix})} "
            f"(agent, tool) slices of {len(sample)} agents with tokens (from "
            f"benchmarks.authorize.request_mix, seed {opts.seed}); data set "
            f"{opts.agents}x{opts.tools} pairs; server clock from "
            f"{datetime.fromtimestamp(float(os.environ['BENCH_CLOCK_START']), UTC).isoformat()} "
            f"(AT={AT.isoformat()}); "
            f"{opts.seconds:g}s per phase"
        )
        # Warm-up: every thread of both workers opens its connection and prepares
        # its statements. Its audit events are before any phase's count starts.
        for label, reqs in (("floor", floor_requests), ("authorize", authorize_requests)):
            run_phase(
                label,
                port,
                reqs,
                4,
                opts.warmup,
                parse=False,
                seed=opts.seed,
                server_pids=pids,
            )
        print()
        for n, callers in enumerate(callers_list):
            for label, reqs in (("floor", floor_requests), ("authorize", authorize_requests)):
                before = head_seq()
                phase = run_phase(
                    label,
                    port,
                    reqs,
                    callers,
                    opts.seconds,
                    parse=label == "authorize",
                    seed=opts.seed + 1 + n,
                    server_pids=pids,
                )
                phases[(label, callers)] = phase
                print(_describe(phase), flush=True)
                if phase.failures or phase.sent != phase.received:
                    exact_ok = False
                    checks.append(
                        f"{label} @{callers}: {phase.sent} sent, {phase.received} responses, "
                        f"{len(phase.failures)} failures: {phase.failures[:3]}"
                    )
                if label == "authorize":
                    decided = phase.statuses[200] + phase.statuses[503]
                    access, every = access_events_after(before)
                    ok = access == decided == every
                    audit_ok &= ok
                    line = (
                        f"audit @{callers:>2} callers: {access} new access.* events "
                        f"({every} events in all) for {decided} responses 200/503 "
                        f"({phase.received} responses in all): {'OK' if ok else 'MISMATCH'}"
                    )
                    checks.append(line)
                    print("            " + line, flush=True)
        top = max(callers_list)
        if opts.breakdown:
            for label in ("limited", "decided"):
                phase = run_phase(
                    label,
                    port,
                    stage_requests[label],
                    top,
                    opts.seconds,
                    parse=label == "decided",
                    seed=opts.seed + 1 + callers_list.index(top),
                    server_pids=pids,
                )
                phases[(label, top)] = phase
                print(_describe(phase), flush=True)
        if opts.async_commit_diagnostic:
            stop_server(server)
            # libpq reads PGOPTIONS: every server connection commits without waiting
            # for the WAL flush. Only here, only to show what the fsync costs.
            server = start_server(
                port, {**env, "PGOPTIONS": "-c synchronous_commit=off"}, opts.threads, log_path
            )
            pids = wait_ready(server, port, floor_requests[0], log_path)
            run_phase(
                "warm-up",
                port,
                authorize_requests,
                4,
                opts.warmup,
                parse=False,
                seed=opts.seed,
                server_pids=pids,
            )
            before = head_seq()
            phase = run_phase(
                "async*",
                port,
                authorize_requests,
                top,
                opts.seconds,
                parse=True,
                seed=opts.seed + 1 + callers_list.index(top),
                server_pids=pids,
            )
            phases[("async*", top)] = phase
            print(_describe(phase), flush=True)
            access, every = access_events_after(before)
            decided = phase.statuses[200] + phase.statuses[503]
            ok = access == decided == every
            audit_ok &= ok
            checks.append(
                f"audit @{top:>2} callers, synchronous_commit=off: {access} new access.* events "
                f"for {decided} responses 200/503: {'OK' if ok else 'MISMATCH'}"
            )
    finally:
        stop_server(server)
        revoke_tokens(tokens)

    # Concurrent appends from both workers' threads must leave one unbroken chain.
    bad = chain_bad_links(after=run_start_seq)
    chain_ok = bad == 0
    checks.append(
        f"audit chain re-verified over this run's {head_seq() - run_start_seq} events: "
        + ("OK" if chain_ok else f"{bad} BAD links")
    )
    print()
    header = (
        f"{'callers':>7} | {'floor':>8} {'p50':>7} {'p99':>7} | {'authorize':>8} {'p50':>7} "
        f"{'p99':>7} | {'ratio':>6}"
    )
    print(f"{'':7} | {'req/s':>8} {'ms':>7} {'ms':>7} | {'req/s':>8} {'ms':>7} {'ms':>7} |")
    print(header)
    print("-" * len(header))
    for callers in callers_list:
        print(_fmt_row(callers, phases[("floor", callers)], phases[("authorize", callers)]))
    print()
    if opts.breakdown or opts.async_commit_diagnostic:
        print(_breakdown(phases, top))
        print()
    for line in checks:
        print(line)
    floor, auth = phases[("floor", top)], phases[("authorize", top)]
    ratio = auth.rate / floor.rate if floor.rate else 0.0
    print(
        f"target: /authorize >= {TARGET_RATIO:.0%} of the floor's throughput at {top} callers: "
        f"{ratio:.0%} ({auth.rate:,.0f} / {floor.rate:,.0f} req/s): "
        f"{'MET' if ratio >= TARGET_RATIO else 'MISSED'}"
    )
    print(
        f"target: /authorize p99 <= {TARGET_P99_MS:g} ms at {top} callers: {auth.p99_ms:.2f} ms: "
        f"{'MET' if auth.p99_ms <= TARGET_P99_MS else 'MISSED'}"
    )
    print(
        f"check: responses == requests sent in every phase, no lost request: "
        f"{'OK' if exact_ok else 'FAILED'}"
    )
    print(
        f"target: audit events == responses in every /authorize phase: "
        f"{'MET' if audit_ok else 'MISSED'}"
    )
    print(
        f"contention: client, 2 gunicorn workers and PostgreSQL share {os.cpu_count()} CPUs; "
        f"load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"total run {time.monotonic() - t_start:.0f}s"
    )
    return 0 if audit_ok and exact_ok and chain_ok else 1


if __name__ == "__main__":
    sys.exit(main())
