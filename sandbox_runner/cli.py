"""`python -m sandbox_runner run ...` and `python -m sandbox_runner reap`.

Thin: parse arguments, build a RunSpec, pick the authorizer, call the runner.
Exit statuses are documented in sandbox_runner.runner (and the README).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from sandbox_runner.backends import REGISTRY
from sandbox_runner.spec import DEFAULT_IMAGE, DEFAULT_TOOL, SCRIPT_PATH, RunSpec, read_file

EXIT_USAGE = 64

_SIZE = re.compile(r"([0-9]+)([kmg]?)i?b?", re.IGNORECASE)


def memory_mb(text: str) -> int:
    """`512m`, `1g`, `262144k` or a plain number of MiB."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 256m or 1g")
    number, unit = int(match.group(1)), match.group(2).lower()
    mb = {"k": number // 1024, "m": number, "g": number * 1024, "": number}[unit]
    if mb <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is less than 1 MiB")
    return mb


def cpus(text: str) -> float:
    """A finite number: `nan`, `inf` and `1e400` parse as floats but count no CPUs."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on a bad argument; this CLI's usage error is EXIT_USAGE (64),
    as the README's exit codes say, for the subcommands' errors too."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"sandbox_runner: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m sandbox_runner")
    sub = parser.add_subparsers(dest="verb", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="authorize, then run a script or command in a sandbox")
    run.add_argument("--agent", required=True)
    run.add_argument("--task")
    run.add_argument("--tool", default=DEFAULT_TOOL)
    run.add_argument(
        "--backend",
        default=os.environ.get("SANDBOX_BACKEND") or "docker",
        choices=list(REGISTRY),
        help="default: SANDBOX_BACKEND, else docker (governance's SANDBOX_BACKENDS may refuse it)",
    )
    run.add_argument("--image", default=DEFAULT_IMAGE)
    run.add_argument("--input", help="file mounted read-only at /sandbox/input")
    run.add_argument("--timeout", type=int, help="wall-clock seconds")
    run.add_argument("--memory", type=memory_mb, help="e.g. 256m")
    run.add_argument("--cpus", type=cpus)
    run.add_argument("--pids", type=int)
    run.add_argument("--scratch", type=memory_mb, help="size of /workspace, e.g. 64m")
    run.add_argument("--egress", nargs="+", action="extend", metavar="HOST:PORT")
    run.add_argument("--api", help="governance URL (or GOVERNANCE_URL); token in GOVERNANCE_TOKEN")
    run.add_argument("--script", help="file run as `python3 /sandbox/script`")
    run.add_argument(
        "--approval",
        metavar="ID",
        help="an approved approval for exactly this run (after exit 75: approval_required)",
    )
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    reap = sub.add_parser("reap", help="kill sandboxes past their deadline or whose grant died")
    reap.add_argument("--api", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.verb == "reap":
        return _reap()
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if bool(args.script) == bool(command):
        print("sandbox_runner: give exactly one of --script FILE or -- COMMAND", file=sys.stderr)
        return EXIT_USAGE
    try:
        spec = RunSpec(
            agent=args.agent,
            task=args.task,
            tool=args.tool,
            backend=args.backend,
            image=args.image,
            command=tuple(command) if command else ("python3", SCRIPT_PATH),
            script=read_file(args.script) if args.script else None,
            input=read_file(args.input) if args.input else None,
            limits={
                "memory_mb": args.memory,
                "cpus": args.cpus,
                "pids": args.pids,
                "wall_seconds": args.timeout,
                "scratch_mb": args.scratch,
            },
            egress=tuple(args.egress) if args.egress else None,
            approval=args.approval,
        )
    except (OSError, ValueError) as exc:  # unreadable file; an image the backend cannot run
        print(f"sandbox_runner: {exc}", file=sys.stderr)
        return EXIT_USAGE
    authorizer = _authorizer(args.api)
    if authorizer is None:
        return EXIT_USAGE
    from sandbox_runner.runner import execute

    outcome = execute(spec, authorizer, stdout=sys.stdout.buffer, stderr=sys.stderr.buffer)
    return outcome.exit_code


def _authorizer(api: str | None):  # type: ignore[no-untyped-def]
    from sandbox_runner.authorizers import DatabaseAuthorizer, HttpAuthorizer

    url = api or os.environ.get("GOVERNANCE_URL")
    if url:
        token = os.environ.get("GOVERNANCE_TOKEN", "")
        if not token:
            print("sandbox_runner: --api needs GOVERNANCE_TOKEN", file=sys.stderr)
            return None
        try:
            return HttpAuthorizer(url, token)
        except ValueError as exc:  # not http(s), or plain http off this machine
            print(f"sandbox_runner: --api: {exc}", file=sys.stderr)
            return None
    return DatabaseAuthorizer()


def _reap() -> int:
    """In-process (Django): governance decides which runs must die and records them."""
    from sandbox_runner.authorizers import DatabaseAuthorizer

    DatabaseAuthorizer()  # sets Django up
    from governance.tasks import sandbox_reap

    summary = sandbox_reap()
    for item in summary.get("orphans", []) + summary.get("reaped", []):
        print(f"reaped {item}")
    if "skipped" in summary:
        print(f"containers: skipped ({summary['skipped']})")
    return 0
