"""Benchmark: the scheduled jobs at a size, and how long each holds the audit chain lock.

Run (PostgreSQL only; the database is dropped and filled again on every run, since
the jobs change it):

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/gov_bench_jobs \\
        .venv/bin/python -m benchmarks.jobs [--agents 100 --tools 20]

Every decision of every agent waits for the chain lock (an advisory lock taken by
the first audit append of a transaction and held until its COMMIT), so a job that
holds it long stalls the whole fleet's /authorize. For each job this prints its wall
time, the ORM queries it ran, how many transactions took the lock and the longest
time one held it (first append to COMMIT), beside two baselines measured in the same
run: one audited decision's wall time (access_check: its event is one statement
that takes the lock and commits, so its hold is inside that time), and the plain
read of the grants in force that the campaign and the jobs walk.

Data: benchmarks.authorize's matrix (--agents x --tools pairs, 2 grants' worth of
actions each: 100 x 20 = 4,000 grants), three approvers to draw reviewers from.
The jobs run at the matrix's fixed instant (benchmarks.authorize.AT) and, for the
ones that end things, ten years later, when every grant has ended.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from benchmarks import authorize as matrix


class LockClock:
    """Per transaction: from its first audit append's statement (audit._append_one:
    governance_audit_append() takes the lock in the server; the event's masking, JSON
    and MAC are made before it) to its COMMIT or ROLLBACK."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.holds: list[float] = []
        self.queries = 0

    def install(self) -> None:
        from django.db import connections

        from governance import audit

        conn = connections["default"]
        write = audit._append_one

        def timed_write(mac: str, row: Any, seen_seq: Any) -> Any:
            if self.started is None and conn.in_atomic_block:  # not a standalone event
                self.started = time.perf_counter()
            return write(mac, row, seen_seq)

        def counted(execute: Any, sql: Any, params: Any, many: Any, context: Any) -> Any:
            self.queries += 1
            return execute(sql, params, many, context)

        audit._append_one = timed_write  # type: ignore[assignment]
        conn.execute_wrappers.append(counted)
        cls = type(conn)
        for name in ("_commit", "_rollback"):
            end = getattr(cls, name)
            setattr(cls, name, self._ending(end))

    def _ending(self, end: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def ended(conn: Any) -> Any:
            result = end(conn)
            if self.started is not None:
                self.holds.append(time.perf_counter() - self.started)
                self.started = None
            return result

        return ended

    def measure(self, name: str, call: Callable[[], Any]) -> dict[str, Any]:
        self.holds.clear()
        self.queries, self.started = 0, None
        t0 = time.perf_counter()
        out = call()
        total = time.perf_counter() - t0
        return {
            "name": name,
            "ms": total * 1000,
            "queries": self.queries,
            "locked": len(self.holds),
            "hold_ms": max(self.holds, default=0.0) * 1000,
            "result": out,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=100)
    parser.add_argument("--tools", type=int, default=20)
    parser.add_argument("--skip-ending", action="store_true", help="no expiry or due-rule jobs")
    opts = parser.parse_args(argv)
    url = os.environ.get("DATABASE_URL")
    if not url:
        sys.exit("set DATABASE_URL=postgresql://postgres@127.0.0.1:5432/gov_bench_jobs")
    matrix.ensure_database(url, reset=True)
    matrix.setup_django()
    matrix.ensure_data(opts.agents, opts.tools)

    from django.contrib.auth.models import Group, User

    from governance import audit, roles, selectors
    from governance.services import access, hygiene, reviews, usage

    for i in range(3):
        user = User.objects.create_user(f"bench-reviewer-{i}")
        user.groups.add(Group.objects.get_or_create(name=roles.APPROVERS)[0])
    actor, at = audit.Actor.system("bench:jobs"), matrix.AT
    later = at + timedelta(days=3650)
    clock = LockClock()
    clock.install()
    one = matrix.request_mix(opts.agents, opts.tools, 50, 50, 1)
    rows = [
        clock.measure(
            "baseline: one audited decision",
            lambda r=r: (
                access.access_check(
                    agent=r.agent, tool=r.tool, action=r.action, scope=r.scope, at=at
                ).decision
            ),
        )
        for r in one
    ]
    decision = sorted(rows, key=lambda row: row["ms"])[len(rows) // 2]  # the median
    floor = clock.measure(
        "baseline: read the grants in force", lambda: len(list(selectors.grants_in_force(at)))
    )
    jobs: list[tuple[str, Callable[[], Any]]] = [
        ("usage_fold", lambda: usage.usage_fold(at=at)),
        (
            "review_campaign_open_scheduled",
            lambda: reviews.review_campaign_open_scheduled(actor=actor, at=at).items.count(),
        ),
        ("grants_flag_unused", lambda: hygiene.grants_flag_unused(actor=actor, at=at)),
    ]
    if not opts.skip_ending:
        jobs += [
            (
                "review_items_apply_due_rule (+10y)",
                lambda: reviews.review_items_apply_due_rule(actor=actor, at=later),
            ),
            ("expire_due (+10y)", lambda: hygiene.expire_due(actor=actor, at=later)["grants"]),
        ]
    results = [decision, floor] + [clock.measure(name, call) for name, call in jobs]
    print(
        f"{opts.agents * opts.tools * 2:,} grants; {os.cpu_count()} CPUs "
        f"(load {os.getloadavg()[0]:.2f}); one audited decision takes "
        f"{decision['ms']:.2f} ms (median of {len(rows)})\n"
    )
    print(
        "| job | wall ms | ÷ grants read | ORM queries | txns locking | longest hold ms "
        "| hold ÷ one decision | result |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in results:
        print(
            f"| {row['name']} | {row['ms']:,.1f} | {row['ms'] / floor['ms']:,.2f} | "
            f"{row['queries']:,} | {row['locked']:,} | {row['hold_ms']:,.1f} | "
            f"{row['hold_ms'] / decision['ms']:,.1f} | {row['result']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
