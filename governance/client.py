"""A small client for the governance REST API, for agents and sandbox runners.

Standard library only (urllib.request, json), and nothing from Django, so an
agent can vendor this one file:

    gov = GovernanceClient("https://governance.example", token)

    @gov.guarded(tool="repo", action="delete", scope=lambda path: f"repo:acme/{path}")
    def delete_file(path: str) -> None:
        ...

    delete_file("api/old.py")   # authorizes, runs only on allow, reports the outcome

Fail closed. Only a 200 whose body says decision == "allow" lets a call run.
A timeout, a refused connection, a redirect, a 401, a 429, a 5xx, a body that
is not JSON or not a decision: each becomes a *denial* with its own reason
(`unreachable`, `error`, `unauthenticated`, `rate_limited`, ...), never an
exception that a careless caller could swallow on the way to running the tool
anyway, and never an allow. The timeout bounds the whole call (connect, send
and every read), so a server dripping its answer cannot hold a call open.

`async def` tools are awaited inside the check (the question is asked in a
thread, off the event loop); generator functions are refused when decorated
(also under decorators made with functools.wraps), since their body would run
after the check, outside it. A generator a call returns anyway (under a decorator
that hides what it wraps, or the lazy rest of a function that did some work) is
handed back followed: its outcome is reported when it ends (succeeded, failed),
or as aborted when it is closed or dropped first, never before it ran.

An approval is bound on the server to the hash of the arguments as sent, so what is
sent must stand for one call only. Arguments JSON carries exactly (text without a lone
surrogate, int, finite float, bool, None, list, tuple and dict keyed by text, each of
exactly that type; a tuple goes as a list, as *args arrive) are sent as they are.
Any others are still sent, so an allowed (or denied) call of a tool taking any object
works as before, but in a form that can stand for more than one value (inf as "inf",
a lone surrogate escaped, {1: "x"} as {"1": "x"}, an object as its repr), under one
key, {"$inexact": {...}}, that exact arguments never take (a call with an argument
of its own named "$inexact" is wrapped too): no approval asked for one form matches
the other. And no approval is ever used with them: `with_approval` (and
authorize(..., approval=...)) is a denial, `invalid_request`, with nothing sent, and a
call answered approval_required comes back a denial too (`invalid_request`, the
approval named in its message), since a person asked to approve it would approve
what can never run. Pass such a call's arguments as plain JSON values instead.
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
import hashlib
import http.client
import inspect
import io
import ipaddress
import json
import logging
import math
import re
import socket
import threading
import time
import types
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, TypeVar
from urllib.parse import quote

log = logging.getLogger(__name__)

API_PREFIX = "/api/v1"
# A decision is a few hundred bytes; anything far larger is not one.
MAX_BODY_BYTES = 1 << 20
VERDICTS = ("allow", "deny", "approval_required")
# What the service's decision body (DecisionOut) always carries.
DECISION_FIELDS = (
    "decision",
    "reason",
    "message",
    "decision_id",
    "grant",
    "approval",
    "expires_at",
    "break_glass",
)

F = TypeVar("F", bound=Callable[..., Any])


# --- Answers and errors ------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """The answer to one authorize() question. `allowed` only for decision == "allow"."""

    decision: str
    reason: str
    message: str
    decision_id: str | None = None
    grant: int | None = None
    approval: str | None = None
    expires_at: str | None = None
    break_glass: bool = False
    status: int | None = None  # the HTTP status; None when no answer arrived
    retry_after: int | None = None  # seconds, from a 429's (or any answer's) Retry-After

    @property
    def allowed(self) -> bool:
        return self.decision == "allow"

    def raise_unless_allowed(self) -> Decision:
        """Return self on allow; otherwise raise AccessDenied or ApprovalRequired."""
        if self.allowed:
            return self
        if self.decision == "approval_required" and self.approval:
            raise ApprovalRequired(self)
        raise AccessDenied(self)


MAX_TIMEOUT = 3600  # seconds


# The one key arguments with no exact JSON form are sent under (see _arguments).
INEXACT = "$inexact"
# The types whose values JSON carries exactly (a tuple as a list, as *args arrive).
_EXACT = frozenset({str, int, float, bool, type(None), list, tuple, dict})


def _text(value: str, inexact: list[str]) -> str:
    """Text JSON carries: a lone surrogate (a file name read from a disk that is not
    UTF-8: `os.listdir` gives `\\udcff`) written as its escape, not sent as is (the
    server refuses it as not text), and noted in `inexact` (the escape is also text)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        inexact.append("text with a lone surrogate (sent escaped)")
        return value.encode("utf-8", "backslashreplace").decode("ascii")
    return value


def _type_name(value: Any) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def _sendable(value: Any, inexact: list[str]) -> Any:
    """An argument as JSON can carry it: as it is where it can be, else its repr (a set,
    an object, inf and nan, which strict JSON has no word for), text with lone
    surrogates escaped (_text). A key that is not text is named as json.dumps names
    it (1 -> "1", True -> "true"), or by its repr. Each of those, and a subclass sent
    as its base (an IntEnum as its int, a namedtuple as a list), can stand for more
    than one value: each is noted in `inexact`."""
    if type(value) not in _EXACT:
        inexact.append(f"a {_type_name(value)}")
    if isinstance(value, str):
        return _text(value, inexact)
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        inexact.append(f"the float {value!r} (sent as text)")
        return repr(value)
    if isinstance(value, Mapping):
        return {_key(k, inexact): _sendable(v, inexact) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_sendable(v, inexact) for v in value]
    return _text(repr(value), [])  # already noted: not one of _EXACT


def _key(key: Any, inexact: list[str]) -> str:
    if type(key) is str:
        return _text(key, inexact)
    inexact.append(f"a dict key of type {_type_name(key)} (sent as text)")
    if isinstance(key, str):
        return _text(key, [])
    if (
        key is None
        or isinstance(key, bool | int)
        or (isinstance(key, float) and math.isfinite(key))
    ):
        return json.dumps(key)
    return _text(repr(key), [])


def _arguments(arguments: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """A call's arguments as sent, and why they have no exact JSON form ("" if they do).

    Exact arguments are sent as they are, so one JSON value stands for one call. Any
    others are sent wrapped, {INEXACT: {...}}, a form no exact arguments take (a
    call whose own argument is named INEXACT is wrapped too), so that no approval
    asked for one ever matches the other."""
    sent: dict[str, Any] = {}
    why = ""
    for name, value in arguments.items():
        inexact: list[str] = []
        key = _key(name, inexact)
        sent[key] = _sendable(value, inexact)
        if inexact and not why:
            why = f"{key!r} holds {inexact[0]}"
    if not why and INEXACT in sent:
        why = f"an argument is named {INEXACT!r}"
    return ({INEXACT: sent} if why else sent), why


def _unapprovable(why: str) -> str:
    return (
        f"no approval can be used for these arguments: they have no exact JSON form ({why}), "
        "so what is sent for them could stand for another call; pass text, int, finite "
        "float, bool, None, list, tuple or dict keyed by text (each of exactly that type)"
    )


class GovernanceClientError(Exception):
    """A request other than a decision failed (grant request, outcome, poll)."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        status: int | None = None,
        fields: Mapping[str, Any] | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status
        self.fields = dict(fields or {})
        self.retry_after = retry_after


class AccessDenied(Exception):
    """The tool call must not run. Carries the decision that said so."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(f"access denied ({decision.reason}): {decision.message}")
        self.decision = decision
        self.reason = decision.reason
        self.message = decision.message
        self.decision_id = decision.decision_id


class ApprovalRequired(AccessDenied):
    """Destructive call: a human must approve it. Poll `approval_id`, then retry with it."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(decision)
        self.approval_id = decision.approval


def _deny(reason: str, message: str, status: int | None = None) -> Decision:
    return Decision(decision="deny", reason=reason, message=message, status=status)


def _name(exc: BaseException) -> str:
    """An exception as "Type: message", for a denial; only "Type" if str() fails too."""
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:
        return type(exc).__name__


# --- Transport ---------------------------------------------------------------------------


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an error: urllib would re-send a POST as a body-less GET."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


# A socket timeout bounds one read, not the call: a server sending a byte just
# before each read times out could hold a call (and its allow) for as long as it
# liked. So connect, send and every read share one deadline instead.


def _time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


class _DeadlineReader(io.RawIOBase):
    """The socket reader http.client reads an answer through, each read given only
    the time left."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline
        # The socket's own reader, so the socket stays open until this is closed.
        self._raw = sock.makefile("rb", buffering=0)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int | None:
        self._sock.settimeout(_time_left(self._deadline))
        return self._raw.readinto(b)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineResponse(http.client.HTTPResponse):
    def __init__(self, sock: socket.socket, *args: Any, deadline: float, **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        self.fp.close()  # http.client's own reader: nothing was read from it yet
        self.fp = io.BufferedReader(_DeadlineReader(sock, deadline))


class _DeadlineConnection(http.client.HTTPConnection):
    def __init__(self, *args: Any, deadline: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deadline = deadline
        self._create_connection = self._within_deadline
        self.response_class = functools.partial(_DeadlineResponse, deadline=deadline)  # type: ignore[assignment]

    def connect(self) -> None:
        self.timeout = _time_left(self.deadline)
        super().connect()

    def _within_deadline(
        self, address: tuple[str, int], timeout: Any = None, source: Any = None
    ) -> socket.socket:
        """The name looked up and each address tried within the call's deadline
        (socket.create_connection's lookup had none: a resolver that does not answer
        held a 1 s call for 10 s)."""
        host, port = address
        return connect_within(resolve_within(host, port, self.deadline), self.deadline, timeout)

    def send(self, data: Any) -> None:
        if self.sock is not None:
            self.sock.settimeout(_time_left(self.deadline))
        super().send(data)


class _DeadlineHTTPSConnection(_DeadlineConnection, http.client.HTTPSConnection):
    pass


class _Request(urllib.request.Request):
    deadline: float


class _DeadlineHTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req: _Request) -> http.client.HTTPResponse:  # type: ignore[override]
        return self.do_open(functools.partial(_DeadlineConnection, deadline=req.deadline), req)


class _DeadlineHTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req: _Request) -> http.client.HTTPResponse:  # type: ignore[override]
        connection = functools.partial(_DeadlineHTTPSConnection, deadline=req.deadline)
        return self.do_open(connection, req, context=self._context)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class _Answer:
    status: int | None  # None: no HTTP answer at all
    body: Any = None  # parsed JSON, or None
    problem: str = ""  # why there is no usable answer
    retry_after: int | None = None
    unsent: bool = False  # the request itself could not be formed: nothing was sent


def _retry_after(headers: Any) -> int | None:
    """Retry-After in seconds: a number of them, or an HTTP date (as a proxy may send)."""
    value = str(headers.get("Retry-After") or "").strip()
    if re.fullmatch(r"[0-9]{1,9}", value):
        return int(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return max(0, math.ceil((when - datetime.now(UTC)).total_seconds()))
    except Exception:  # ValueError, IndexError, OverflowError ("...99999999999:00:00 GMT")
        return None  # a header the client cannot read is no hint, never an exception


def resolve_within(host: str, port: int, deadline: float) -> list[Any]:
    """socket.getaddrinfo(host, port) for a stream socket, given up on at `deadline`
    (time.monotonic()): TimeoutError. The lookup itself cannot be interrupted (the
    resolver's own timeouts and retries add up to tens of seconds), so it runs in a
    daemon thread that is left to finish on its own; the caller does not wait for it."""
    answer: dict[str, Any] = {}

    def lookup() -> None:
        try:
            answer["found"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except Exception as exc:  # noqa: BLE001 - raised in the caller's thread below
            answer["error"] = exc

    thread = threading.Thread(target=lookup, name="resolve-within", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        raise TimeoutError("the deadline passed while the host's name was being looked up")
    if "error" in answer:
        raise answer["error"]
    return list(answer["found"])


def connect_within(found: list[Any], deadline: float, timeout: Any = None) -> socket.socket:
    """A socket connected to the first of `found` (getaddrinfo's answers) that takes the
    connection, each tried only for the time left before `deadline`; the socket's
    timeout is then `timeout`. The last error if none does."""
    error: OSError = OSError("the host's name has no address")
    for family, kind, proto, _name, where in found:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed while connecting")
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            sock.connect(where)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        sock.settimeout(timeout)
        return sock
    raise error


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class GovernanceClient:
    """Talks to one governance server with one bearer token (an agent's or a runner's)."""

    def __init__(self, base_url: str, token: str, timeout: float = 5.0) -> None:
        if not base_url.startswith(("http://", "https://")):
            # urllib would also open file: and ftp: URLs; a token must only go to a server.
            raise ValueError("base_url must be an http:// or https:// URL")
        if not base_url.isprintable() or " " in base_url:
            raise ValueError("base_url has spaces or control characters")
        try:
            parts = urllib.parse.urlsplit(base_url)
            parts.port  # noqa: B018 - raises ValueError for a port that is not one
        except ValueError as exc:  # bad brackets, a port above 65535 or not a number
            raise ValueError(f"base_url is not a URL: {exc}") from None
        if not parts.hostname:
            raise ValueError("base_url names no host")
        if "@" in parts.netloc:
            # The token is the credential; a user:password in the URL would be read as
            # part of the host (and shown in every error).
            raise ValueError("base_url must not carry a user or password (user@host)")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        if parts.netloc.lower() not in (host, f"{host}:{parts.port}"):
            # urlsplit and http.client split a netloc differently: `[::1]evil.example`
            # is host ::1 to the first (and passed the loopback check below) but a name
            # to look up to the second, which got the token in the clear.
            raise ValueError("base_url's host must be a name, an IPv4 or a [bracketed] IPv6")
        if parts.query or parts.fragment or ";" in parts.path:
            # The API's paths are appended to base_url: after a ?query, #fragment or
            # ;params they would not be paths at all.
            raise ValueError("base_url must not carry a ?query, #fragment or ;params")
        plain = base_url.startswith("http://")
        if plain and not _loopback(parts.hostname):
            # Whoever is on the path would read the token, and could answer "allow".
            raise ValueError(
                "plain http:// would send the token in the clear: use https://, or "
                "http:// only to this machine (127.0.0.1, ::1, localhost)"
            )
        # A token read from a file keeps its newline: strip it. Anything else that is not
        # printable ASCII would be refused by http.client in a message quoting the header.
        token = token.strip() if isinstance(token, str) else token
        if not isinstance(token, str) or not re.fullmatch(r"[!-~]+", token):
            raise ValueError("the token must be printable ASCII with no spaces")
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout <= MAX_TIMEOUT
        ):
            # Past the maximum the socket's deadline overflows (every call then came back
            # "unreachable"); nothing waits an hour for an authorization anyway.
            raise ValueError(f"timeout must be a positive number of seconds, at most {MAX_TIMEOUT}")
        root = base_url.rstrip("/")
        if root.endswith(API_PREFIX):
            root = root[: -len(API_PREFIX)]
        self.base_url = root
        self.timeout = timeout
        self._token = token
        # Plain http goes straight to this machine, never through an HTTP(S)_PROXY from
        # the environment (which would see the token); https keeps the environment's
        # proxy, which only tunnels (TLS end to end).
        handlers: list[Any] = [urllib.request.ProxyHandler({})] if plain else []
        self._opener = urllib.request.build_opener(
            *handlers, _NoRedirects, _DeadlineHTTPHandler, _DeadlineHTTPSHandler
        )

    def __repr__(self) -> str:  # never the token
        return f"GovernanceClient({self.base_url!r})"

    def _call(self, method: str, path: str, payload: Any = None) -> _Answer:
        """One request, done within self.timeout from now or not at all. Never raises:
        every failure comes back as an _Answer, whose problem never quotes the token."""
        answer = self._send(method, path, payload)
        if len(self._token) >= 8 and self._token in answer.problem:  # ours are 40+
            answer = replace(answer, problem=answer.problem.replace(self._token, "[token]"))
        return answer

    def _send(self, method: str, path: str, payload: Any) -> _Answer:
        deadline = time.monotonic() + self.timeout
        try:
            data = None if payload is None else json.dumps(payload).encode()
        except Exception as exc:  # not JSON, too deep (RecursionError), a repr that raises
            problem = f"the request cannot be sent as JSON: {_name(exc)}"
            return _Answer(None, problem=problem, unsent=True)
        request = _Request(  # noqa: S310 (scheme checked in __init__)
            self.base_url + API_PREFIX + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {self._token}",
                "Accept": "application/json",
                "Content-Type": "application/json",
                "User-Agent": "governance-client/1",
            },
        )
        request.deadline = deadline
        try:
            with self._opener.open(request, timeout=self.timeout) as response:
                status, raw = response.status, response.read(MAX_BODY_BYTES + 1)
                headers = response.headers
        except urllib.error.HTTPError as exc:  # an answer, with a 3xx/4xx/5xx status
            try:
                status, raw, headers = exc.code, exc.read(MAX_BODY_BYTES + 1), exc.headers
            except Exception as read_exc:
                return _Answer(exc.code, problem=f"unreadable answer: {read_exc}")
            finally:
                exc.close()
        except (TimeoutError, urllib.error.URLError, OSError, ValueError) as exc:
            # Refused, reset, timed out, name not found, bad URL: no answer.
            reason = getattr(exc, "reason", exc)
            return _Answer(None, problem=f"{type(reason).__name__}: {reason}")
        except Exception as exc:  # anything else the stack can raise (http.client, ssl)
            return _Answer(None, problem=f"{type(exc).__name__}: {exc}")
        retry_after = _retry_after(headers) if headers is not None else None
        if len(raw) > MAX_BODY_BYTES:
            return _Answer(status, problem="answer too large", retry_after=retry_after)
        if status < 300 and (headers is None or headers.get_content_type() != "application/json"):
            return _Answer(status, problem="answer is not JSON", retry_after=retry_after)
        try:
            # The service answers UTF-8 JSON: no byte-order mark, no UTF-16 or -32 (which
            # json.loads would guess from the bytes and accept).
            body = json.loads(raw.decode("utf-8"))
        except Exception:  # ValueError, and RecursionError for "[[[[..." nested deep
            return _Answer(status, problem="answer is not JSON", retry_after=retry_after)
        return _Answer(status, body=body, retry_after=retry_after)

    def _checked(self, answer: _Answer, *, expect: int) -> dict[str, Any]:
        """The body of a successful non-decision call, or GovernanceClientError."""
        if answer.unsent:
            raise GovernanceClientError("invalid_request", answer.problem)
        if answer.status is None:
            raise GovernanceClientError("unreachable", answer.problem)
        if answer.status == expect and isinstance(answer.body, dict):
            return answer.body
        error = answer.body.get("error") if isinstance(answer.body, dict) else None
        if isinstance(error, dict) and isinstance(error.get("code"), str):
            raise GovernanceClientError(
                error["code"],
                str(error.get("message", "")),
                status=answer.status,
                fields=error.get("fields") if isinstance(error.get("fields"), dict) else None,
                retry_after=answer.retry_after,
            )
        raise GovernanceClientError(
            "error",
            answer.problem or f"unexpected answer (HTTP {answer.status})",
            status=answer.status,
            retry_after=answer.retry_after,
        )

    # --- Decisions -----------------------------------------------------------------------

    def authorize(
        self,
        tool: str,
        action: str,
        scope: str,
        task: str | None = None,
        arguments: Mapping[str, Any] | None = None,
        approval: str | None = None,
    ) -> Decision:
        """Ask before a tool call. Never raises; anything but a clean allow is a denial.

        Arguments with no exact JSON form (see the module's docstring) are sent, but
        never with an approval: that is refused unsent, and an approval_required
        answer for them comes back a denial (`invalid_request`) naming the approval."""
        payload: dict[str, Any] = {"tool": tool, "action": action, "scope": scope}
        if task is not None:
            payload["task"] = task
        if approval is not None:
            payload["approval"] = approval
        inexact = ""
        if arguments is not None:
            try:
                # Round-trip now so what is hashed server-side is exactly what was sent;
                # values JSON cannot carry are sent as their repr, wrapped (_arguments).
                sendable, inexact = _arguments(dict(arguments))
                payload["arguments"] = json.loads(json.dumps(sendable, allow_nan=False))
            except Exception as exc:  # also RecursionError (nested deep), a repr that raises
                return _deny("invalid_request", f"arguments cannot be sent as JSON: {_name(exc)}")
        if inexact and approval is not None:
            # What is sent for them could stand for another call: an approval used
            # with them could run a call nobody approved. Nothing is sent.
            return _deny("invalid_request", _unapprovable(inexact))
        answer = None
        try:
            answer = self._call("POST", "/authorize", payload)
            decision = self._decision(answer)
            if answer.retry_after is not None:
                decision = replace(decision, retry_after=answer.retry_after)
            if inexact and decision.decision == "approval_required":
                # Waiting for a person to approve what no approval can be used for
                # would only waste their time: a denial now, the approval named.
                message = f"{decision.message} Approval {decision.approval} was asked for, but "
                message += _unapprovable(inexact)
                decision = replace(
                    decision, decision="deny", reason="invalid_request", message=message
                )
            return decision
        except Exception as exc:  # a shape nothing above foresaw is still only a denial
            status = answer.status if answer is not None else None
            return _deny("error", f"unusable answer: {_name(exc)}", status)

    @staticmethod
    def _decision(answer: _Answer) -> Decision:
        if answer.unsent:
            return _deny("invalid_request", answer.problem)
        if answer.status is None:
            return _deny("unreachable", f"The governance API did not answer: {answer.problem}")
        body = answer.body
        if answer.problem or not isinstance(body, dict):
            problem = answer.problem or "answer is not an object"
            return _deny("error", f"HTTP {answer.status}: {problem}", answer.status)
        if "decision" not in body:
            error = body.get("error")
            if isinstance(error, dict) and isinstance(error.get("code"), str):
                return _deny(error["code"], str(error.get("message", "")), answer.status)
            return _deny("error", f"HTTP {answer.status}: not a decision", answer.status)
        decision = _parse_decision(body, answer.status)
        if decision is None:
            return _deny("error", f"HTTP {answer.status}: malformed decision", answer.status)
        if answer.status != 200 and decision.decision != "deny":
            # Only a 200 can allow (or ask for approval); e.g. a 503 is always a denial.
            return _deny(
                "error", f"HTTP {answer.status} with a {decision.decision!r} body", answer.status
            )
        return decision

    def report_outcome(
        self,
        decision_id: str,
        outcome: str,
        result_digest: str | None = None,
        excerpt: str | None = None,
    ) -> dict[str, Any]:
        """Say what an allowed call did: "succeeded", "failed" or "aborted". Once per decision."""
        payload: dict[str, Any] = {"outcome": outcome}
        if result_digest is not None:
            payload["result_digest"] = result_digest
        if excerpt is not None:
            payload["excerpt"] = excerpt
        path = f"/decisions/{quote(decision_id, safe='')}/outcome"
        return self._checked(self._call("POST", path, payload), expect=201)

    # --- Grants and approvals ------------------------------------------------------------

    def request_grant(
        self,
        tool: str,
        actions: list[str],
        scope: str,
        duration_seconds: int,
        justification: str,
        task: str | None = None,
        fields: list[str] | None = None,
        egress: list[str] | None = None,
        delegable: bool = False,
    ) -> dict[str, Any]:
        """Ask for a grant for this token's agent. It starts pending; a human decides."""
        payload: dict[str, Any] = {
            "tool": tool,
            "actions": list(actions),
            "scope": scope,
            "duration_seconds": duration_seconds,
            "justification": justification,
            "delegable": delegable,
        }
        if task is not None:
            payload["task"] = task
        if fields is not None:
            payload["fields"] = list(fields)
        if egress is not None:
            payload["egress"] = list(egress)
        return self._checked(self._call("POST", "/grant-requests", payload), expect=201)

    def grant_request(self, grant_id: int) -> dict[str, Any]:
        """Poll a grant request this agent made."""
        return self._checked(self._call("GET", f"/grant-requests/{int(grant_id)}"), expect=200)

    def approval(self, approval_id: str) -> dict[str, Any]:
        """Poll an approval: its "status" goes pending -> approved | denied (| consumed)."""
        path = f"/approvals/{quote(approval_id, safe='')}"
        return self._checked(self._call("GET", path), expect=200)

    # --- The decorator -------------------------------------------------------------------

    def guarded(
        self,
        *,
        tool: str,
        action: str,
        scope: str | Callable[..., str],
        task: str | Callable[..., str | None] | None = None,
    ) -> Callable[[F], F]:
        """Wrap a tool function: authorize each call, run it only on allow, report it.

        `scope` (and `task`) may be a callable taking the same arguments as the
        function. The call's bound arguments are sent as `arguments` (they bind an
        approval to this exact call). Raises AccessDenied (ApprovalRequired for
        the confirmation gate) without running the function. After an approval,
        call `fn.with_approval(approval_id, *args, **kwargs)` with the same arguments,
        which must have an exact JSON form (see the module's docstring) or the call
        is refused (`invalid_request`) unsent.
        """

        def decorate(fn: F) -> F:
            try:
                inner = inspect.unwrap(fn)  # through decorators made with functools.wraps
            except ValueError:  # a __wrapped__ cycle
                inner = fn
            if any(
                inspect.isgeneratorfunction(f) or inspect.isasyncgenfunction(f) for f in (fn, inner)
            ):
                # Calling one only makes a generator: the body would run later, as it is
                # iterated, after the check and outside it, with "succeeded" already sent.
                raise TypeError(
                    f"guarded() cannot wrap the generator function {fn.__qualname__}: its "
                    "body would run outside the check; guard a function that does the work"
                )
            signature = inspect.signature(fn)

            def ask(approval: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
                """The decision id of an allow for this call; AccessDenied otherwise."""
                try:
                    call_scope = scope(*args, **kwargs) if callable(scope) else scope
                    call_task = task(*args, **kwargs) if callable(task) else task
                    bound = signature.bind(*args, **kwargs)
                    bound.apply_defaults()
                    arguments = {
                        k: v for k, v in bound.arguments.items() if k not in ("self", "cls")
                    }
                except Exception as exc:  # cannot even form the question: do not run
                    raise AccessDenied(
                        _deny("invalid_request", f"cannot describe the call: {_name(exc)}")
                    ) from exc
                decision = self.authorize(
                    tool, action, call_scope, task=call_task, arguments=arguments, approval=approval
                ).raise_unless_allowed()
                assert decision.decision_id  # _parse_decision requires it on allow
                return decision.decision_id

            async def settle(decision_id: str, pending: Any) -> Any:
                """Await the call's work, then report it: the report follows the body."""
                try:
                    result = await pending
                except BaseException as exc:
                    excerpt = type(exc).__name__
                    await asyncio.to_thread(
                        self._report_quietly, decision_id, "failed", excerpt=excerpt
                    )
                    raise
                digest = _digest(result)
                await asyncio.to_thread(
                    self._report_quietly, decision_id, "succeeded", result_digest=digest
                )
                return result

            async def arun(
                approval: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> Any:
                # The body runs when the coroutine is awaited, so the check and the
                # report go around the await; the HTTP calls block, so they run in a
                # thread and the event loop goes on meanwhile.
                decision_id = await asyncio.to_thread(ask, approval, args, kwargs)
                try:
                    pending = fn(*args, **kwargs)
                except BaseException as exc:
                    excerpt = type(exc).__name__
                    await asyncio.to_thread(
                        self._report_quietly, decision_id, "failed", excerpt=excerpt
                    )
                    raise
                return await settle(decision_id, pending)

            def followed(decision_id: str, result: Any) -> Any:
                """The returned generator, reported once when it ends: succeeded when run
                out, failed when it raises, aborted when closed or dropped before."""
                reported: list[str] = []

                def report(outcome: str, **kw: Any) -> None:
                    if not reported:
                        reported.append(outcome)
                        self._report_quietly(decision_id, outcome, **kw)

                def ended(exc: BaseException) -> tuple[str, str]:
                    if isinstance(exc, GeneratorExit):
                        return "aborted", "closed before its end"
                    return "failed", type(exc).__name__

                def follow() -> Any:
                    try:
                        value = yield from result
                    except BaseException as exc:
                        outcome, excerpt = ended(exc)
                        report(outcome, excerpt=excerpt)
                        raise
                    report("succeeded", result_digest=_digest(value))
                    return value

                async def afollow() -> Any:
                    try:
                        async for item in result:
                            yield item
                    except BaseException as exc:
                        outcome, excerpt = ended(exc)
                        await asyncio.to_thread(report, outcome, excerpt=excerpt)
                        raise
                    await asyncio.to_thread(report, "succeeded")

                wrapper = follow() if inspect.isgenerator(result) else afollow()
                # Dropped before its first step, its body never runs: report that too.
                dropped = "dropped before its end"
                weakref.finalize(wrapper, _off_the_loop, report, "aborted", dropped)
                return wrapper

            def run(approval: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                decision_id = ask(approval, args, kwargs)
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:
                    self._report_quietly(decision_id, "failed", excerpt=type(exc).__name__)
                    raise
                if inspect.iscoroutine(result):
                    # An async tool that does not look like one (an `async def` under
                    # another decorator, an object with `async def __call__`): nothing
                    # has run yet. The caller awaits this, and the report follows. (A
                    # Task or Future the tool started is returned as it is, reported now.)
                    return settle(decision_id, result)
                if inspect.isgenerator(result) or inspect.isasyncgen(result):
                    # A generator function no decorator owned up to (no __wrapped__),
                    # or a function that did some work and returned a lazy rest: either
                    # way part of the call runs as it is iterated. Its report follows
                    # its end, as an async tool's follows its await.
                    return followed(decision_id, result)
                self._report_quietly(decision_id, "succeeded", result_digest=_digest(result))
                return result

            def make() -> Any:
                """The wrapper (a new one each time: a method's instance gets its own)."""
                if inspect.iscoroutinefunction(fn):

                    @functools.wraps(fn)
                    async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                        return await arun(None, args, kwargs)

                    async def async_with_approval(
                        approval_id: str, *args: Any, **kwargs: Any
                    ) -> Any:
                        return await arun(approval_id, args, kwargs)

                    async_wrapper.with_approval = async_with_approval  # type: ignore[attr-defined]
                    return async_wrapper

                @functools.wraps(fn)
                def wrapper(*args: Any, **kwargs: Any) -> Any:
                    return run(None, args, kwargs)

                def with_approval(approval_id: str, *args: Any, **kwargs: Any) -> Any:
                    return run(approval_id, args, kwargs)

                wrapper.with_approval = with_approval  # type: ignore[attr-defined]
                return wrapper

            plain = make()
            if next(iter(signature.parameters), None) in ("self", "cls"):
                # A method: `obj.method.with_approval(id, ...)` must pass `obj` along,
                # which an attribute of a plain function cannot.
                return _GuardedMethod(plain, make)  # type: ignore[return-value]
            return plain  # type: ignore[no-any-return]

        return decorate

    def _report_quietly(self, decision_id: str, outcome: str, **kw: Any) -> None:
        # The call already ran: failing it now (and tempting a retry) would do it
        # twice. The decision itself is on the server's record; log and go on,
        # whatever goes wrong (a typed error, or an answer json cannot even parse).
        try:
            self.report_outcome(decision_id, outcome, **kw)
        except Exception as exc:
            log.warning("could not report the outcome of decision %s: %s", decision_id, _name(exc))


class _GuardedMethod:
    """A guarded method. Read from an instance it is a real bound method (its signature
    without `self`, equal to itself, picklable by name) whose `with_approval` passes the
    instance along too; read from the class, the plain wrapper."""

    def __init__(self, plain: Any, make: Callable[[], Any]) -> None:
        functools.update_wrapper(self, plain)
        self._plain, self._make = plain, make
        # One function per live instance (by identity), so `obj.m == obj.m`.
        self._bound: dict[int, tuple[Any, Any]] = {}

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self._plain
        held = self._bound.get(id(instance))
        if held is not None and held[0]() is instance:
            return types.MethodType(held[1], instance)
        function = self._make()
        unbound = function.with_approval
        try:
            ref = weakref.ref(instance)
        except TypeError:  # no weak references: a function per access, holding it
            ref = None

        def with_approval(approval_id: str, *args: Any, **kwargs: Any) -> Any:
            return unbound(approval_id, ref() if ref is not None else instance, *args, **kwargs)

        function.with_approval = with_approval
        if ref is not None:
            self._bound[id(instance)] = (ref, function)
            weakref.finalize(instance, self._bound.pop, id(instance), None)
        return types.MethodType(function, instance)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._plain(*args, **kwargs)


def _off_the_loop(report: Callable[..., None], outcome: str, excerpt: str) -> None:
    """A finalizer's report: made where it runs, unless that is an event loop's thread
    (an async generator dropped there), which a blocking HTTP call would freeze for up
    to the client's timeout; there it is made in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        report(outcome, excerpt=excerpt)
        return
    threading.Thread(
        target=report, args=(outcome,), kwargs={"excerpt": excerpt}, name="report-outcome"
    ).start()


_DIGEST_CHUNK = 1 << 20


def _digest(result: Any) -> str | None:
    """sha256 of the result: of its bytes for bytes, bytearray and memoryview, of its
    UTF-8 for str (read a chunk at a time: a 64 MiB result cost 367 MiB as a repr),
    else of repr(result). None when repr() raises: the call ran, and is reported."""
    try:
        if isinstance(result, bytes | bytearray | memoryview):
            return hashlib.sha256(result).hexdigest()
        if isinstance(result, str):
            hashed = hashlib.sha256()
            for start in range(0, len(result), _DIGEST_CHUNK):
                hashed.update(result[start : start + _DIGEST_CHUNK].encode("utf-8", "replace"))
            return hashed.hexdigest()
        return hashlib.sha256(repr(result).encode("utf-8", "replace")).hexdigest()
    except Exception:
        return None


def _parse_decision(body: Mapping[str, Any], status: int) -> Decision | None:
    """A Decision from a decision body, or None if any field has the wrong shape."""
    verdict, reason, message = body.get("decision"), body.get("reason"), body.get("message")
    decision_id, grant, approval = body.get("decision_id"), body.get("grant"), body.get("approval")
    expires_at, break_glass = body.get("expires_at"), body.get("break_glass", False)
    if verdict not in VERDICTS or not isinstance(reason, str) or not isinstance(message, str):
        return None
    if not (decision_id is None or isinstance(decision_id, str)):
        return None
    if not (grant is None or (isinstance(grant, int) and not isinstance(grant, bool))):
        return None
    if not (approval is None or isinstance(approval, str)):
        return None
    if not (expires_at is None or isinstance(expires_at, str)) or not isinstance(break_glass, bool):
        return None
    # Only a whole decision can allow or ask: a body missing any field the schema
    # requires (DecisionOut) is not one, whatever its verdict says.
    if verdict != "deny" and any(name not in body for name in DECISION_FIELDS):
        return None
    # An allow must be reportable, an approval request must be pollable.
    if verdict == "allow" and not decision_id:
        return None
    if verdict == "approval_required" and not approval:
        return None
    return Decision(
        decision=verdict,
        reason=reason,
        message=message,
        decision_id=decision_id,
        grant=grant,
        approval=approval,
        expires_at=expires_at,
        break_glass=break_glass,
        status=status,
    )
