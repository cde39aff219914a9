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
from collections.abc import Callable, Sequence
from typing import NoReturn

from sandbox_runner.backends import REGISTRY
from sandbox_runner.egress import parse_destination
from sandbox_runner.spec import (
    DEFAULT_IMAGE,
    DEFAULT_TOOL,
    LIMIT_MAX,
    LIMIT_MIN,
    SCRIPT_PATH,
    FileTooLarge,
    RunSpec,
    read_file,
)

EXIT_USAGE = 64

_SIZE = re.compile(r"([0-9]+)([kmg]?)i?b?", re.IGNORECASE)
_WHOLE = re.compile(r"-?[0-9]+")  # int() also takes "+5", "1_000" and other scripts' digits

# Every argument is checked here, before governance is asked anything: a value no run
# can have is the caller's mistake (64), not a denial on record (77) nor a traceback.
# The lengths are what governance stores (agent, tool and task names; an approval id; the
# REST API's image, egress and command fields); the limits' bounds are any grant's.
TEXT_MAX = {"agent": 100, "task": 100, "tool": 100, "image": 300, "approval": 64}
EGRESS_MAX, EGRESS_ENTRY_MAX = 64, 300
COMMAND_MAX, COMMAND_ARG_MAX = 256, 4096
# A script or input is copied whole into the run's directory on the host's disk (and
# hashed): a bound, so `--input /dev/zero` is a usage error, not a disk filled.
FILE_MAX = 256 * 2**20


def memory_mb(text: str) -> int:
    """`512m`, `1g`, `262144k` or a plain number of MiB."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 256m or 1g")
    number, unit = int(match.group(1)), match.group(2).lower()
    if unit == "k" and number % 1024:
        # Limits are whole MiB: 1536k rounded down would run with less than asked.
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of MiB")
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


def _within(name: str, value: float, text: str, unit: str) -> None:
    least, most = LIMIT_MIN[name], LIMIT_MAX[name]
    if not least <= value <= most:
        raise argparse.ArgumentTypeError(f"{text!r} is not between {least:g} and {most}{unit}")


def _limit(name: str, unit: str = "") -> Callable[[str], float | int]:
    """The argument type of one limit: parsed as its kind, within any grant's bounds."""

    def parse(text: str) -> float | int:
        value: float | int
        if name == "cpus":
            value = cpus(text)
        elif name in ("memory_mb", "scratch_mb"):
            value = memory_mb(text)
        elif _WHOLE.fullmatch(text.strip()):
            value = int(text)
        else:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
        _within(name, value, text, " MiB" if name.endswith("_mb") else unit)
        return value

    parse.__name__ = name  # argparse names the type in some of its own messages
    return parse


def _text(name: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError("must not be empty")
        if len(text) > TEXT_MAX[name]:
            raise argparse.ArgumentTypeError(f"longer than {TEXT_MAX[name]} characters")
        if not text.isprintable():
            raise argparse.ArgumentTypeError(f"{text!r:.80} has control characters")
        return text

    parse.__name__ = name
    return parse


def egress_entry(text: str) -> str:
    """`host:port` or `[v6]:port`, as the proxy and governance read it (kept as given)."""
    if len(text) > EGRESS_ENTRY_MAX:
        raise argparse.ArgumentTypeError(f"longer than {EGRESS_ENTRY_MAX} characters")
    try:
        parse_destination(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (want HOST:PORT or [IPv6]:PORT)") from None
    return text


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on a bad argument; this CLI's usage error is EXIT_USAGE (64),
    as the README's exit codes say, for the subcommands' errors too. One line, naming
    the argument and what is wrong with it (no usage dump to look through)."""

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())  # argparse's own may span lines
        self.exit(EXIT_USAGE, f"sandbox_runner: {message} (see: {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m sandbox_runner")
    sub = parser.add_subparsers(dest="verb", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="authorize, then run a script or command in a sandbox")
    run.add_argument("--agent", required=True, type=_text("agent"))
    run.add_argument("--task", type=_text("task"))
    run.add_argument("--tool", default=DEFAULT_TOOL, type=_text("tool"))
    run.add_argument(
        "--backend",
        default=None,  # SANDBOX_BACKEND, checked in main() (argparse checks no default)
        choices=list(REGISTRY),
        help="default: SANDBOX_BACKEND, else docker (governance's SANDBOX_BACKENDS may refuse it)",
    )
    run.add_argument("--image", default=DEFAULT_IMAGE, type=_text("image"))
    run.add_argument("--input", help="file mounted read-only at /sandbox/input")
    run.add_argument("--timeout", type=_limit("wall_seconds", " s"), help="wall-clock seconds")
    run.add_argument("--memory", type=_limit("memory_mb"), help="e.g. 256m")
    run.add_argument("--cpus", type=_limit("cpus"))
    run.add_argument("--pids", type=_limit("pids"))
    run.add_argument("--scratch", type=_limit("scratch_mb"), help="size of /workspace, e.g. 64m")
    run.add_argument("--egress", nargs="+", action="extend", metavar="HOST:PORT", type=egress_entry)
    run.add_argument("--api", help="governance URL (or GOVERNANCE_URL); token in GOVERNANCE_TOKEN")
    run.add_argument("--script", help="file run as `python3 /sandbox/script`")
    run.add_argument(
        "--approval",
        metavar="ID",
        type=_text("approval"),
        help="an approved approval for exactly this run (after exit 75: approval_required)",
    )
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    reap = sub.add_parser("reap", help="kill sandboxes past their deadline or whose grant died")
    reap.add_argument("--api", help=argparse.SUPPRESS)
    return parser


def chosen_backend(given: str | None) -> str:
    """--backend, else SANDBOX_BACKEND, else docker. The variable is as strict as the
    option (main() refuses a name no backend has: set but empty, or misspelt, is a
    usage error, not docker by default nor a refusal that reads like the deployment's);
    argparse checks no default, so it is read here."""
    return given if given is not None else os.environ.get("SANDBOX_BACKEND", "docker")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.verb == "reap":
        return _reap()
    args.backend = chosen_backend(args.backend)
    if args.backend not in REGISTRY:
        print(
            f"sandbox_runner: SANDBOX_BACKEND={args.backend!r} is not one of {', '.join(REGISTRY)}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if bool(args.script) == bool(command):
        print("sandbox_runner: give exactly one of --script FILE or -- COMMAND", file=sys.stderr)
        return EXIT_USAGE
    if problem := _too_much(command, args.egress or []):
        print(f"sandbox_runner: {problem}", file=sys.stderr)
        return EXIT_USAGE
    files: dict[str, bytes | None] = {}
    for option in ("script", "input"):
        path = getattr(args, option)
        try:
            files[option] = read_file(path, FILE_MAX) if path else None
        except OSError as exc:  # missing, unreadable, a directory
            print(f"sandbox_runner: --{option}: {exc.strerror or exc}: {path!r}", file=sys.stderr)
            return EXIT_USAGE
        except FileTooLarge:
            print(
                f"sandbox_runner: --{option}: {path!r} is larger than {FILE_MAX // 2**20} MiB",
                file=sys.stderr,
            )
            return EXIT_USAGE
    try:
        spec = RunSpec(
            agent=args.agent,
            task=args.task,
            tool=args.tool,
            backend=args.backend,
            image=args.image,
            command=tuple(command) if command else ("python3", SCRIPT_PATH),
            script=files["script"],
            input=files["input"],
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
    except ValueError as exc:  # an image the backend cannot run
        print(f"sandbox_runner: {exc}", file=sys.stderr)
        return EXIT_USAGE
    authorizer = _authorizer(args.api)
    if authorizer is None:
        return EXIT_USAGE
    from sandbox_runner.runner import execute

    outcome = execute(spec, authorizer, stdout=sys.stdout.buffer, stderr=sys.stderr.buffer)
    return outcome.exit_code


def _too_much(command: Sequence[str], egress: Sequence[str]) -> str | None:
    """What governance would refuse to take (the REST API's bounds), before asking it."""
    if len(command) > COMMAND_MAX:
        return f"the command has {len(command)} words; at most {COMMAND_MAX}"
    if any(len(word) > COMMAND_ARG_MAX for word in command):
        return f"a word of the command is longer than {COMMAND_ARG_MAX} characters"
    if len(egress) > EGRESS_MAX:
        return f"--egress names {len(egress)} destinations; at most {EGRESS_MAX}"
    return None


def _authorizer(api: str | None):  # type: ignore[no-untyped-def]
    from sandbox_runner.authorizers import DatabaseAuthorizer, HttpAuthorizer

    if api == "":  # given, but empty: not "in-process" (that is leaving --api out)
        print("sandbox_runner: --api: must not be empty", file=sys.stderr)
        return None
    url = api or os.environ.get("GOVERNANCE_URL")
    if url:
        token = os.environ.get("GOVERNANCE_TOKEN", "")
        if not token:
            print("sandbox_runner: --api needs GOVERNANCE_TOKEN", file=sys.stderr)
            return None
        try:
            return HttpAuthorizer(url, token)
        except ValueError as exc:  # not a URL, not http(s), or plain http off this machine
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
