"""The only writer of audit events: masking, the HMAC chain, checkpoints, verify.

Chain, with a gapless `seq`:
    row_mac_n = HMAC-SHA256(K_row, canonical(event_n without seq/prev_hash/hash))
    hash_n    = HMAC-SHA256(K_link, hash_{n-1} || ":" || seq_n || ":" || row_mac_n)
with K_row and K_link derived from AUDIT_HMAC_KEY. The client computes
row_mac; on PostgreSQL one call of governance_audit_append() (migration 0007)
takes the chain lock (an advisory transaction lock, held until COMMIT), reads
the head, computes the link with pgcrypto and inserts, all in one round trip,
so the critical section is that server-side work plus the COMMIT. SQLite's
write transactions already serialise writers; there Python computes the same
formula. Callers must already be inside the transaction that makes the
change: an event that cannot be written rolls the change back.

Checkpoints live outside the database (AUDIT_CHECKPOINT_DIR). Each one signs
(last seq, head hash, count, time, previous checkpoint's signature), so
deleting the newest K events, or the whole table, is caught by verify even
though the remaining chain is internally consistent. One is written a minute;
the nightly job compacts those older than AUDIT_CHECKPOINT_KEEP_DAYS to one a
day, joined by signed bridges (compact_checkpoints() says what that gives up),
and pages find the newest through a pointer file instead of listing them all.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import functools
import hashlib
import hmac
import itertools
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, transaction

from governance import db
from governance.codes import ActorType, EventType
from governance.text import is_text, is_utf8, printable, storable

log = logging.getLogger(__name__)

GENESIS = "0" * 64
# Arbitrary constant identifying "the audit chain" among advisory locks.
CHAIN_LOCK_KEY = 7_305_010_101
EVENT_TABLE = "governance_auditevent"
MAX_ARGUMENT_CHARS = 8_000


# --- Actors ------------------------------------------------------------------


@dataclass(frozen=True)
class Actor:
    """Who did it: every service takes one, so no event is anonymous.

    token_id: the bearer token the API let the request in with (api.views.actor_for),
    None for anyone else (the web UI's session, a command, a job). An event is never
    recorded under a token revoked since (append): not part of who it was."""

    type: str
    label: str
    token_id: int | None = field(default=None, compare=False)

    @classmethod
    def user(cls, user: Any, token_id: int | None = None) -> Actor:
        return cls(ActorType.USER, f"user:{user.get_username()}", token_id)

    @classmethod
    def agent(cls, agent: Any, token_id: int | None = None) -> Actor:
        return cls(ActorType.AGENT, f"agent:{agent.name}", token_id)

    @classmethod
    def system(cls, job: str) -> Actor:
        return cls(ActorType.SYSTEM, f"system:{job}")


# --- Masking -----------------------------------------------------------------

# A key is secret by its words, not by any substring: `db_pass`, `apiKey`, `X-Auth-Token`
# and `csrftoken` are; `bypass`, `compass` and `tokenizer` are not (masking those would
# hide from an approver exactly the part of a call that matters).
SECRET_KEY_WORDS = frozenset(
    "pass password passwd pwd passphrase passcode secret secrets token tokens auth "
    "authorization authorisation credential credentials creds cookie cookies session ssn "
    "cvv cvc otp totp pin pins".split()
)
SECRET_KEY_ENDINGS = (
    "password", "passwd", "passphrase", "passcode", "pincode", "secret", "token", "apikey",
    "privatekey", "privkey", "accesskey", "secretkey", "signingkey", "encryptionkey", "sshkey",
    "hmackey", "masterkey", "cardnumber",
    "credential", "credentials", "cookie", "sessionid",
)  # fmt: skip
_KEY_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")


def secret_key_name(key: str) -> bool:
    words = [w.lower() for w in _KEY_WORD.findall(key)]
    joined = "".join(words)
    # Plurals name the same secrets: `passwords`, `api_keys`, `privateKeys`.
    candidates = [*words, joined]
    candidates += [w[:-1] for w in candidates if len(w) > 3 and w.endswith("s")]
    if any(w in SECRET_KEY_WORDS for w in candidates):
        return True
    return any(w.endswith(SECRET_KEY_ENDINGS) for w in candidates)


SECRET_VALUES = re.compile(
    r"-----BEGIN [A-Z ]*PRIVATE KEY(?: BLOCK)?-----[\s\S]*?"
    r"(-----END [A-Z ]*PRIVATE KEY(?: BLOCK)?-----|$)"
    r"|\b(?i:bearer)\s+[^\s'\"]+"
    r"|\bsk-[A-Za-z0-9_-]{16,}"
    r"|\bgh[pousr]_[A-Za-z0-9]{20,}"
    r"|\bgithub_pat_[A-Za-z0-9_]{20,}"
    r"|\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"
    r"|\bglpat-[A-Za-z0-9_-]{20,}"
    # Vendors' tokens, prefixed (their random part alone may look like a name or hex).
    r"|\bshp(?:at|ss|ca|pa)_[a-fA-F0-9]{32}\b"
    r"|\bkey-[0-9a-z]{32}\b"
    r"|\bsbp_[a-f0-9]{40}\b"
    r"|\bdo[por]_v1_[a-f0-9]{64}\b"
    r"|\bnpm_[A-Za-z0-9]{36}\b"
    r"|\bpypi-[A-Za-z0-9_-]{50,}"
    r"|\bhf_[A-Za-z0-9]{30,}\b"
    r"|\b[rs]k_(?:live|test)_[A-Za-z0-9]{16,}"
    r"|\bAIza[0-9A-Za-z_-]{35}\b"
    r"|\bxox[abprs]-[A-Za-z0-9-]{10,}"
    r"|\b(?:agt|usr)_[0-9a-f]{8}_\S+"
    r"|\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"
)
# Any script: `jöhn.doe@exämple.com` is as personal as its ASCII spelling.
EMAIL = re.compile(r"(?<![\w.%+-])[\w.%+-]+@[\w-]+(?:\.[\w-]+)*\.[^\W\d_]{2,}")
# Payment card numbers in text: 13-19 digits starting as card numbers do (2-6), single
# spaces or dashes between groups, that pass the Luhn check (so millisecond timestamps,
# which start with 1, and most order numbers do not).
CARD = re.compile(r"(?<![0-9])[2-6](?:[ -]?[0-9]){12,18}(?![0-9])")
# Phone numbers in international form (+, country code, 7-14 more digits) and US
# social security numbers: obvious PII whatever the key.
PHONE = re.compile(r"(?<![0-9A-Za-z])\+[1-9](?:[ .()-]{0,2}[0-9]){7,14}(?![0-9])")
SSN = re.compile(r"(?<![0-9-])[0-9]{3}-[0-9]{2}-[0-9]{4}(?![0-9-])")
# Long mixed-alphabet strings look like keys; pure hex (digests) are kept.
HIGH_ENTROPY = re.compile(r"[A-Za-z0-9+/_=-]{32,}")
HEX = re.compile(r"[0-9a-fA-F]+")
_SEPARATORS = re.compile(r"[/_-]")


def _random_part(part: str) -> bool:
    """20+ letters and digits, both, not hex: `3ax6xnjp29jd6fds4gc373sgvjxteol0`, not
    `customers`, `2026` or a commit id."""
    return (
        len(part) >= 20
        and any(c.isdigit() for c in part)
        and any(c.isalpha() for c in part)
        and not HEX.fullmatch(part)
    )


# HTTP Basic credentials: base64 of `user:password` after the word Basic.
BASIC = re.compile(r"\b(?i:basic)\s+([A-Za-z0-9+/]{4,}={0,2})")
# `name=value` / `name: value` inside text (a command line, an env file, JSON in a
# string): the value goes when the name is a secret's (secret_key_name, so `bypass=1`
# stays). Quoted names and values too.
# Linear time: a name starts only where a run of name characters starts (the
# lookbehind), so a long run without `=` or `:` is scanned once, not once per position.
# `:` separates only as `name: value` (a space after it) or after a quoted name (JSON),
# so `secret:prod/db` and `https://` are not pairs.
KEY_VALUE = re.compile(
    # ...or a quoted one after a string prefix: b'password=x' (a bytes repr), u"...".
    r"""(?:(?<![A-Za-z0-9_.\-"'])|(?<=\b[bBrRuUfF])(?=["']))"""
    r"""(?P<key>-*["']?[A-Za-z_][A-Za-z0-9_.-]*["']?)"""
    r"""(?P<sep>\s*=\s*|:\s+|(?<=["']):\s*)"""
    r"""(?P<value>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|[^\s,;&}\]"'\[][^\s,;&}\]"']*)"""
)
# In text, a name is a secret's only when it ends in a secret noun (`--password`,
# `GITHUB_TOKEN`, `API_KEY`), not when a secret word is merely in it: `--secret-id`,
# `--auth-method`, `max_tokens` and `AUTH-1234` name things an approver must see.
TEXT_SECRET_LAST_WORDS = frozenset(
    "password passwd pwd passphrase passcode secret token credential credentials cookie "
    "authorization apikey creds pin pass".split()
)
TEXT_SECRET_LAST_TWO = frozenset(
    "apikey accesskey secretkey privatekey privkey signingkey accountkey sshkey hmackey "
    "masterkey".split()
)
# A last word that ends in one of these is a secret's name too: PGPASSWORD, apitoken.
TEXT_SECRET_SUFFIXES = ("password", "passwd", "passphrase", "token", "secret", "apikey")
# A password in a URL: scheme://user:password@host (the password may hold an `@`, and,
# written unencoded, a `/`: mysql://root:ab/cd@db, when no `@` comes before the slash).
# As a regex, (://[^/\s:@]*:)(?:[^/\s]*|[^\s@]*)@ (URL_PASSWORD: what _url_passwords()
# masks): the password runs to the last `@` before the next `/` or space, or else to the
# first `@` before the next space. The regex itself scanned to the end of the text from
# every `://` (quadratic: 100 kB of "http://a:" held a worker for 8 s), so it is only
# the reference the scan is tested against.
URL_PASSWORD = re.compile(r"(://[^/\s:@]*:)(?:[^/\s]*|[^\s@]*)@")
_URL_USER = re.compile(r"://[^/\s:@]*:")
_SPACE = re.compile(r"\s")
# An Authorization header written out. Its credential is masked, not the rest of the
# line (a command's target stays readable): the first word after the name, or, when
# that word is a scheme (`Token`, `GenieKey`, any word) and a credential follows it, the
# word after it; for schemes whose credential is a list of parameters (Digest, AWS4,
# Signature) everything after the scheme.
AUTH_HEADER = re.compile(
    r"(?<![A-Za-z0-9_-])((?i:proxy-)?(?i:authori[sz]ation)\s*:[ \t]*)([^\s\"']+)([^\r\n']*)"
)
_AUTH_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,39}")
_AUTH_PARAM_SCHEMES = frozenset("digest aws4-hmac-sha256 signature hmac oauth hawk mac".split())
_NEXT_WORD = re.compile(r"([ \t]+)([^\s\"']+)")
# Passwords in SQL, where a statement sets one: `ALTER USER app WITH PASSWORD '...'`,
# `CREATE USER 'app'@'%' IDENTIFIED BY '...'`, `SET PASSWORD FOR app = PASSWORD('...')`,
# `CONNECT TO scott IDENTIFIED BY tiger`. Found at the clause (rare words, so the scan
# stays linear), then masked when the statement so far names an account (USER, ROLE,
# CONNECT TO, SET PASSWORD: _sql_secret) or the clause starts its line (a statement over
# several lines, read line by line in review text); a quoted IDENTIFIED BY always is.
# So `grep -rn password 'src/'` keeps its path.
_SQL_QUOTED = r"""('(?:[^'\\]|\\.|'')*'|"(?:[^"\\]|\\.)*")"""
SQL_SECRETS = (
    re.compile(r"(?i)(\bpassword\s*(?:=\s*)?(?:\(\s*)?)" + _SQL_QUOTED),
    re.compile(r"(?i)(\bset\s+password\b[^;'\"\n]{0,100}?=\s*)" + _SQL_QUOTED),
    re.compile(r"(?i)(\bidentified\s+(?:with\s+\S+\s+)?by\s+)"
               r"(" + _SQL_QUOTED[1:-1] + r"|[^\s'\";,)(][^\s'\";,)]*)"),
)  # fmt: skip
_SQL_ACCOUNT = re.compile(r"(?i)\b(?:user|role|connect\s+to|set\s+password)\b")
_SQL_LINE_START = re.compile(r"(?i)(?:^|\n)[ \t]*(?:(?:with|encrypted|unencrypted)[ \t]+)*$")
# Command lines that carry a password without `=`: `--password hunter2`, `sshpass -p
# hunter2`, `mysql -phunter2`, `curl -u admin:hunter2`. Each starts at a fixed word and
# looks a bounded distance ahead, so a long string is scanned in linear time.
CLI_SECRETS = (
    re.compile(
        r"(?<![A-Za-z0-9_-])(--(?:[A-Za-z0-9]+-)*(?i:password|passwd|passphrase|token|secret"
        r"|api-key|apikey|access-key|secret-key|pass)\s+)([^\s'\"-][^\s'\"]*|'[^']*'|\"[^\"]*\")"
    ),
    re.compile(r"\b(sshpass\s+-p\s*)(\S+)"),
    re.compile(r"\b(mysql(?:dump|admin)?\b[^\n;|&]{0,200}?\s-p)([^\s-]\S*)"),
    re.compile(r"\b(curl\b[^\n;|&]{0,300}?\s(?:-u|--user)\s+[^\s:/@]+:)(\S+)"),
    # A password's name and its value joined by a bare `:` (`password:hunter2`,
    # `DB_PASSWD:x`), which KEY_VALUE leaves to resources (`secret:prod/db`): only for a
    # password's own nouns, and not before a path or a URL's `//`.
    re.compile(
        r"(?<![A-Za-z0-9_.\-\"'])((?:[A-Za-z0-9]+[_.-])*(?i:password|passwd|pwd|passphrase"
        r"|passcode):)([^\s/:,;&'\"][^\s,;&'\"]*)"
    ),
)


def _luhn(digits: str) -> bool:
    total = 0
    for i, c in enumerate(reversed(digits)):
        d = int(c) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


def _card(match: re.Match[str]) -> str:
    text = match.group(0)
    return "[card]" if _luhn(re.sub(r"[ -]", "", text)) else text


def _basic(match: re.Match[str]) -> str:
    try:
        decoded = base64.b64decode(match.group(1), validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return match.group(0)
    return "Basic [secret]" if ":" in decoded else match.group(0)


def _text_secret_name(name: str) -> bool:
    words = [w.lower() for w in _KEY_WORD.findall(name)]
    if not words:
        return False
    last = words[-1]
    return (
        last in TEXT_SECRET_LAST_WORDS
        or "".join(words[-2:]) in TEXT_SECRET_LAST_TWO
        or last.endswith(TEXT_SECRET_SUFFIXES)
    )


def _key_value(match: re.Match[str], depth: int = 0) -> str:
    value = match.group("value")
    if not _text_secret_name(match.group("key")):
        if depth >= _KEY_VALUE_DEPTH:
            return match.group(0)
        # Not a secret's name, but its value may hold a pair that is one, which this
        # match would otherwise step over: `error: PASSWORD=x`, `a=token=x`. A few
        # levels deep (each one scans the value once: linear, whatever the input).
        inner = KEY_VALUE.sub(lambda m: _key_value(m, depth + 1), value)
        return f"{match.group('key')}{match.group('sep')}{inner}"
    quote = value[0] if value[0] in "\"'" else ""
    return f"{match.group('key')}{match.group('sep')}{quote}[secret]{quote}"


_KEY_VALUE_DEPTH = 3


def _auth_header(match: re.Match[str]) -> str:
    head, first, rest = match.groups()
    if _AUTH_SCHEME.fullmatch(first):
        if first.lower() in _AUTH_PARAM_SCHEMES:
            return f"{head}{first} [secret]"
        following = _NEXT_WORD.match(rest)
        # A scheme word, then its credential (not a command's next flag or a URL).
        if following and not following.group(2).startswith("-") and "://" not in following[2]:
            return f"{head}{first}{following.group(1)}[secret]{rest[following.end() :]}"
    return f"{head}[secret]{rest}"


def _sql_secret(match: re.Match[str]) -> str:
    """SQL_SECRETS' value, masked when the clause is where a statement sets a password:
    the statement so far (back to a `;`, at most 300 characters) names an account, or
    the clause starts its line; a quoted IDENTIFIED BY is an account clause anywhere."""
    value = match.group(2)
    statement = match.string[max(0, match.start() - 300) : match.start()].rsplit(";", 1)[-1]
    clause = match.group(1)
    if (
        (clause[:1] in "iI" and value[:1] in "'\"")
        or _SQL_ACCOUNT.search(statement + clause)
        or _SQL_LINE_START.search(statement)
    ):
        return _cli_secret(match)
    return match.group(0)


def _cli_secret(match: re.Match[str]) -> str:
    value = match.group(2)
    quote = value[0] if value[0] in "\"'" else ""
    return f"{match.group(1)}{quote}[secret]{quote}"


def _url_passwords(value: str) -> str:
    """URL_PASSWORD.sub(r"\\1[secret]@", value) in one pass: the next `@`, `/` and space
    after each candidate are found by pointers that only move forward."""
    if "://" not in value:
        return value
    out: list[str] = []
    done = 0  # value[:done] is in out
    at = slash = space = -1
    for user in _URL_USER.finditer(value):
        start = user.end()  # the password's first character
        if user.start() < done:
            continue  # inside what an earlier match masked
        if at < start:
            at = value.find("@", start)
            if at < 0:
                break  # no `@` after here: nothing more to mask
        if space < start:
            found = _SPACE.search(value, start)
            space = found.start() if found else len(value)
        if slash < start:
            slash = value.find("/", start)
            slash = len(value) if slash < 0 else slash
        stop = min(slash, space)
        if at < stop:  # [^/\s]*@ : to the last `@` before the `/` or space
            end = value.rfind("@", start, stop)
        elif at < space:  # [^\s@]*@ : to the first `@`, a `/` in the password
            end = at
        else:
            continue
        out += [value[done:start], "[secret]"]
        done = end
    out.append(value[done:])
    return "".join(out)


def _mask_string(value: str, heuristics: bool = True) -> str:
    value = SECRET_VALUES.sub("[secret]", value)
    value = BASIC.sub(_basic, value)
    value = _url_passwords(value)
    value = AUTH_HEADER.sub(_auth_header, value)
    value = KEY_VALUE.sub(_key_value, value)
    for pattern in SQL_SECRETS:
        value = pattern.sub(_sql_secret, value)
    for pattern in CLI_SECRETS:
        value = pattern.sub(_cli_secret, value)
    value = EMAIL.sub("[email]", value)
    value = CARD.sub(_card, value)
    value = SSN.sub("[ssn]", value)
    if not heuristics:
        return value
    value = PHONE.sub("[phone]", value)

    def entropy(match: re.Match[str]) -> str:
        text = match.group(0)
        if HEX.fullmatch(text):
            return text
        has_digit = any(c.isdigit() for c in text)
        has_alpha = any(c.isalpha() for c in text)
        if not (has_digit and has_alpha):
            return text
        # With `/`, `_` or `-` in it, it is a path or a name (`/srv/exports/2026/nov`,
        # `customers_2026_q4`, a UUID) unless it mixes cases, as random keys do: what a
        # destructive call deletes must stay readable to the person approving it.
        separated = any(c in "/_-" for c in text)
        mixed = any(c.isupper() for c in text) and any(c.islower() for c in text)
        if mixed or not separated:
            return "[secret]"
        # One case, with separators: a path or a name, unless a part of it is a long
        # run of letters and digits that is not hex (a digest is evidence, kept).
        return "[secret]" if any(map(_random_part, _SEPARATORS.split(text))) else text

    return HIGH_ENTROPY.sub(entropy, value)


def mask_review_text(text: str) -> tuple[str, list[int]]:
    """Code or data a person reads to approve it (a sandbox run's script), masked line
    by line: no pattern reaches past its own line (a lone `-----BEGIN PRIVATE KEY-----`
    or an unclosed `password="` in a comment cannot hide the lines after it), and only
    explicit credential forms are masked, not the length and phone-number heuristics,
    which would hide the paths and numbers the reader must see. Returns the text and
    the 1-based numbers of the lines masking changed, so the reader is told where."""
    lines, changed = [], []
    raw = text.splitlines(keepends=True)
    key_body = _key_block_lines(raw)
    for number, line in enumerate(raw, start=1):
        masked = "[secret]\n" if number in key_body else _mask_string(line, heuristics=False)
        if masked != line:
            changed.append(number)
        lines.append(masked)
    return "".join(lines), changed


_KEY_BEGIN = re.compile(r"-----BEGIN (?P<label>[A-Z ]*PRIVATE KEY(?: BLOCK)?)-----")
_KEY_END = re.compile(r"-----END [A-Z ]*PRIVATE KEY(?: BLOCK)?-----")
_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_PGP_HEADER = re.compile(r"(?:Version|Comment|Hash|Charset|MessageID): [^\n]*")
_PGP_CHECKSUM = re.compile(r"=([A-Za-z0-9+/]{4})")


def _key_block_lines(lines: list[str]) -> set[int]:
    """The 1-based numbers of the body lines of each private key written out whole, so
    review text can mask them. A body counts only if it is provably a key, never a
    lookalike: base64 in lines of one width, decoding to a DER structure whose length
    is exactly the bytes given (or an OpenSSH key's magic, or PGP armor whose CRC-24
    checksum matches). A BEGIN line thus hides nothing that could run: code is not
    base64 that decodes to its own length, and base64 holds no space, quote, dot or
    parenthesis to call anything with."""
    found: set[int] = set()
    index = 0
    while index < len(lines):
        begin = _KEY_BEGIN.search(lines[index])
        end = None
        if begin:
            for j in range(index + 1, min(len(lines), index + 400)):
                if _KEY_END.search(lines[j]):
                    end = j
                    break
        body = [line.strip() for line in lines[index + 1 : end]] if end else []
        if begin and end and _is_key_body(begin.group("label"), body):
            found.update(range(index + 2, end + 1))  # the body; BEGIN and END mask alone
            index = end + 1
        else:
            index += 1
    return found


def _is_key_body(label: str, body: list[str]) -> bool:
    checksum = None
    if label.endswith("BLOCK"):  # PGP armor: headers, a blank line, base64, =CRC
        while body and _PGP_HEADER.fullmatch(body[0]):
            body = body[1:]
        if not body or body[0] != "" or len(body) < 3:
            return False
        match = _PGP_CHECKSUM.fullmatch(body[-1])
        if match is None:
            return False  # without its checksum, armor cannot be told from code
        checksum, body = match.group(1), body[1:-1]
    if not body or not all(_BASE64.fullmatch(line) for line in body):
        return False
    if len({len(line) for line in body[:-1]}) > 1 or len(body[-1]) > len(body[0]):
        return False  # one width (64, or OpenSSH's 70) but a shorter last line
    try:
        raw = base64.b64decode("".join(body), validate=True)
    except ValueError:
        return False
    if checksum is not None:
        return base64.b64encode(_crc24(raw).to_bytes(3, "big")).decode() == checksum
    if label == "OPENSSH PRIVATE KEY":
        return raw.startswith(b"openssh-key-v1\x00")
    return _der_length(raw) == len(raw)


def _der_length(raw: bytes) -> int | None:
    """The length a DER SEQUENCE at the start of `raw` says it has, header included."""
    if len(raw) < 2 or raw[0] != 0x30:
        return None
    if raw[1] < 0x80:
        return 2 + raw[1]
    size = raw[1] & 0x7F
    if not 1 <= size <= 3 or len(raw) < 2 + size:
        return None
    return 2 + size + int.from_bytes(raw[2 : 2 + size], "big")


def _crc24(data: bytes) -> int:
    """OpenPGP's armor checksum (RFC 4880, 6.1)."""
    crc = 0xB704CE
    for byte in data:
        crc ^= byte << 16
        for _ in range(8):
            crc <<= 1
            if crc & 0x1000000:
                crc ^= 0x1864CFB
    return crc & 0xFFFFFF


# What mask() leaves where it hid something.
_MASK_MARKER = re.compile(r"\[(?:masked|secret|email|card|ssn|phone|too deep)\]")


def hidden_values(masked: Any) -> int:
    """How many values mask() hid in `masked` (its output): what a person asked to
    approve a call cannot read, and must be told about."""
    return len(_MASK_MARKER.findall(json.dumps(masked, ensure_ascii=False, default=str)))


# A command as a list of arguments (a sandbox run's): the flags whose next argument is
# a password. The one-string forms are CLI_SECRETS'.
_SECRET_FLAG = re.compile(
    r"--(?:[A-Za-z0-9]+-)*(?i:password|passwd|passphrase|token|secret|api-key|apikey"
    r"|access-key|secret-key|pass)"
)


def _mask_argv(argv: list[str], masked: list[Any]) -> None:
    """Mask, in place, the arguments of `argv` that are passwords by their position
    (an element that is not a string is "" in `argv`: a number after `--password` goes)."""
    programs: set[str] = set()
    for i, arg in enumerate(argv):
        prev = argv[i - 1] if i else ""
        if _SECRET_FLAG.fullmatch(prev) and not arg.startswith("-"):
            masked[i] = "[secret]"
        elif prev == "-p" and "sshpass" in programs:
            masked[i] = "[secret]"
        elif prev in ("-u", "--user") and "curl" in programs and ":" in arg:
            masked[i] = arg.split(":", 1)[0] + ":[secret]"
        elif arg.startswith("-p") and len(arg) > 2 and programs & {"mysql", "mysqldump"}:
            masked[i] = "-p[secret]"
        programs.add(arg.rsplit("/", 1)[-1])


_NAME_KEYS = ("name", "Name", "key", "Key")
_VALUE_KEYS = ("value", "Value")


def _mask_named_value(value: Mapping[Any, Any], out: dict[str, Any]) -> None:
    """A pair spelled as an entry, `{"name": "DB_PASSWORD", "value": "x"}` (a Kubernetes
    env entry, a HAR header, an AWS tag): its value goes when its name is a secret's."""
    names = [value[k] for k in _NAME_KEYS if isinstance(value.get(k), str)]
    if any(secret_key_name(n) for n in names):
        for k in _VALUE_KEYS:
            if k in out:
                out[k] = "[masked]"


def mask(value: Any, depth: int = 0) -> Any:
    """Secrets and obvious PII out, structure kept, for storage and display."""
    if depth > 20:
        return "[too deep]"
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        alike: dict[str, int] = {}
        for k, v in value.items():
            name = str(k)
            # A key can be PII or a credential itself (an ACL keyed by e-mail address, a
            # map keyed by token): explicit forms only, so ordinary names stay readable.
            key = masked_key = _mask_string(name, heuristics=False)
            while key in out:  # two keys masked alike stay two entries (counted: linear)
                alike[masked_key] = alike.get(masked_key, 1) + 1
                key = f"{masked_key} #{alike[masked_key]}"
            out[key] = "[masked]" if secret_key_name(name) else mask(v, depth + 1)
        _mask_named_value(value, out)
        return out
    if isinstance(value, list | tuple):
        masked = [mask(v, depth + 1) for v in value]
        # Any list may be a command line; its other elements are not flags.
        _mask_argv([v if isinstance(v, str) else "" for v in value], masked)
        # A pair spelled as a list: ["Authorization", "Token x"] (a header list).
        if len(value) == 2 and isinstance(value[0], str) and secret_key_name(value[0]):
            masked[1] = "[masked]"
        return masked
    if isinstance(value, str):
        return _mask_string(value)
    if isinstance(value, int) and not isinstance(value, bool):
        # A card number sent as a JSON number is still a card number.
        digits = str(value)
        return "[card]" if CARD.fullmatch(digits) and _luhn(digits) else value
    if value is None or isinstance(value, bool | float):
        return value
    return _mask_string(str(value))


# What json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
# builds on every call, built once.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
_DIGEST_JSON = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)


def canonical_json(value: Any) -> str:
    """One byte string per value: sorted keys, no spaces, UTF-8."""
    return _CANONICAL.encode(value)


@functools.lru_cache(maxsize=16)
def _derive(secret: str, purpose: bytes) -> bytes:
    return hmac.new(secret.encode(), purpose, hashlib.sha256).digest()


def _derived_key(purpose: bytes) -> bytes:
    # A pure function of the key: a rotated AUDIT_HMAC_KEY derives afresh.
    return _derive(settings.AUDIT_HMAC_KEY, purpose)


def arguments_digest(arguments: Mapping[str, Any] | None) -> str:
    """Keyed hash of the full, unmasked arguments.

    Lets an auditor holding the key confirm "were the arguments exactly X?"
    without the log storing X, and binds approvals to exact arguments.
    Raises TypeError/ValueError on arguments that are not plain JSON.
    """
    if not arguments:  # most calls: the digest of {} under this key, computed once
        return _empty_digest(settings.AUDIT_HMAC_KEY)
    # Not canonical_json: NaN and the infinities are not JSON, and every number too big
    # for a double (1e400, 1e500) would read as the same Infinity, so one approval
    # would cover different calls. Refused (ValueError) instead.
    payload = _DIGEST_JSON.encode(dict(arguments))
    return hmac.digest(_derived_key(b"arguments"), payload.encode(), "sha256").hex()


@functools.lru_cache(maxsize=4)
def _empty_digest(secret: str) -> str:
    return hmac.digest(_derive(secret, b"arguments"), b"{}", "sha256").hex()


def storable_json(value: Any) -> str:
    """canonical_json() of what a caller sent, as text that can be stored: a lone
    surrogate (a non-UTF-8 byte in a file name or a command word, as Python reads it)
    is written as its escape, so the event of a refused question can still be written."""
    text = canonical_json(value)
    return text if text.isascii() or is_utf8(text) else canonical_json(storable(value))


def masked_arguments_json(arguments: Mapping[str, Any] | None) -> str:
    text = storable_json(mask(dict(arguments or {})))
    if len(text) > MAX_ARGUMENT_CHARS:
        text = canonical_json({"_truncated": True, "preview": text[:MAX_ARGUMENT_CHARS]})
    return text


# --- Writing -----------------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _text(value: Any, limit: int) -> str:
    """Make a caller-supplied value safe to store: no NULs, bounded length."""
    text = "" if value is None else str(value)
    if not text.isascii():
        text = printable(text)
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group(0)):02x}", text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


FIELDS = (
    "seq",
    "uid",
    "created_at",
    "event_type",
    "actor_type",
    "actor",
    "agent",
    "task",
    "tool",
    "action",
    "scope",
    "arguments",
    "arguments_hash",
    "decision",
    "reason",
    "grant_id",
    "approval_id",
    "break_glass",
    "data",
    "prev_hash",
    "hash",
)


def _iso(value: datetime) -> str:
    return value.astimezone(UTC).isoformat(timespec="microseconds")


# The link is split in two so that PostgreSQL can finish it under the chain
# lock without the client ever knowing the head:
#   row_mac = HMAC(K_row, canonical(every column but seq, prev_hash, hash))
#   hash    = HMAC(K_link, prev_hash || ":" || seq || ":" || row_mac)
# K_row and K_link are derived from AUDIT_HMAC_KEY; only K_link is sent to the
# database (as a bind parameter), and row_mac is not stored, so K_link alone
# cannot re-chain edited rows.
_ROW_EXCLUDED = frozenset(("seq", "prev_hash", "hash"))
_ROW_FIELDS = tuple(name for name in FIELDS if name not in _ROW_EXCLUDED)


def row_mac(row: Mapping[str, Any]) -> str:
    """The keyed digest of an event's content (everything but its place in the chain)."""
    body = {name: row[name] for name in _ROW_FIELDS}
    body["uid"] = str(body["uid"])
    body["created_at"] = _iso(body["created_at"])
    body["break_glass"] = bool(body["break_glass"])
    message = canonical_json(body).encode()
    return hmac.digest(_derived_key(b"audit-row"), message, "sha256").hex()


def link_hash(prev_hash: str, seq: int, mac: str) -> str:
    """What governance_audit_append() (migration 0007) computes on PostgreSQL."""
    message = f"{prev_hash}:{seq}:{mac}".encode()
    return hmac.digest(_derived_key(b"audit-link"), message, "sha256").hex()


def event_hash(prev_hash: str, row: Mapping[str, Any]) -> str:
    """The chain link. Covers every column but `hash` itself."""
    return link_hash(prev_hash, row["seq"], row_mac(row))


def legacy_event_hash(prev_hash: str, row: Mapping[str, Any]) -> str:
    """The link of events written before migration 0007 (one HMAC over
    canonical JSON of every column, raw key). Verify still accepts it so an
    existing log keeps verifying; both forms need AUDIT_HMAC_KEY, and their
    messages cannot collide (JSON object vs. "hex:digits:hex")."""
    body = {name: row[name] for name in FIELDS if name != "hash"}
    body["uid"] = str(body["uid"])
    body["created_at"] = _iso(body["created_at"])
    body["prev_hash"] = prev_hash
    body["break_glass"] = bool(body["break_glass"])
    message = canonical_json(body).encode()
    return hmac.digest(settings.AUDIT_HMAC_KEY.encode(), message, "sha256").hex()


@dataclass(frozen=True)
class Written:
    seq: int
    uid: uuid.UUID
    hash: str


_HEAD = f"SELECT seq, hash FROM {EVENT_TABLE} ORDER BY seq DESC LIMIT 1"
# One round trip: the lock (held until commit, so the next writer sees this
# transaction's row as the head), then the head, read by a statement of its
# own that starts only once the lock is granted, so it sees the previous
# holder's commit. Constants only: nothing is interpolated from input.
_LOCK_THEN_HEAD = f"SELECT pg_advisory_xact_lock({int(CHAIN_LOCK_KEY)}); {_HEAD}"


def head_seq() -> int:
    """The newest event's seq now (0 for an empty log): a check that reads state and
    then records what it found passes it to append(seen_seq=...), so a state change
    committing between the read and the event is not recorded as if it came after."""
    rows = db.execute(_HEAD)
    return rows[0][0] if rows else 0


def _lock_and_read_head() -> tuple[int, str]:
    """Take the chain lock (PostgreSQL), then read the head."""
    if connection.vendor == "postgresql":
        rows = db.execute_script(_LOCK_THEN_HEAD)
    else:
        rows = db.execute(_HEAD)
    return (rows[0][0], rows[0][1]) if rows else (0, GENESIS)


_INSERT = (
    f"INSERT INTO {EVENT_TABLE} ({', '.join(FIELDS)}) VALUES ({', '.join(['%s'] * len(FIELDS))})"
)
# PostgreSQL: lock, head, link and insert in one round trip (migration 0007).
# The arguments follow _ROW_FIELDS after the link key and row_mac.
_PG_TYPES = {
    "uid": "uuid",
    "created_at": "timestamptz",
    "grant_id": "bigint",
    "break_glass": "boolean",
}
_PG_APPEND = (
    "SELECT out_seq, out_hash FROM governance_audit_append(%s::bytea, %s::text, "
    + ", ".join(f"%s::{_PG_TYPES.get(name, 'text')}" for name in _ROW_FIELDS)
    + ", %s::bigint)"
)


class ChainBroken(Exception):
    """The log no longer holds what a checkpoint signed (or a checkpoint is unreadable):
    no new checkpoint is signed over it. `problem` is (bad seq, what is wrong)."""

    def __init__(self, problem: tuple[int, str]) -> None:
        super().__init__(f"seq {problem[0]}: {problem[1]}")
        self.problem = problem


class StateChanged(Exception):
    """A decision's event was refused: a state change committed after the decision read
    the state (migration 0013). Nothing was written; decide again. `seen_seq`: the
    newest event the refused decision's read could see."""

    def __init__(self, message: str, seen_seq: int | None = None) -> None:
        super().__init__(message)
        self.seen_seq = seen_seq


# Events that never make a decision read again (migration 0013's HARMLESS, which the
# database applies; this is its copy for changed_at()).
_NEUTRAL_PREFIXES = ("access.", "sandbox.")
_NEUTRAL_TYPES = (
    "grant.expired",
    "grant.request_expired",
    "approval.expired",
    "agent_token.expired",
    "audit.checkpoint",
    "audit.verify_failed",
    "audit.viewed",
    "report.exported",
    "trend.recorded",
    "grant.unused_flagged",
)


def changed_at(seen_seq: int) -> datetime | None:
    """When the newest state change after `seen_seq` happened (its event's time): a
    decision decided again after it is decided at that moment at the earliest, or a
    revoke recorded as "from T" would not apply to a question asked just before T and
    answered after the revoke committed."""
    from django.db.models import Max

    from governance.models import AuditEvent

    found = AuditEvent.objects.filter(seq__gt=seen_seq).exclude(event_type__in=_NEUTRAL_TYPES)
    for prefix in _NEUTRAL_PREFIXES:
        found = found.exclude(event_type__startswith=prefix)
    return found.aggregate(newest=Max("created_at"))["newest"]


# Event data written by people (or sent by a runner: its `error`), not by the code:
# masked like arguments are.
FREE_TEXT_KEYS = frozenset({"justification", "reason", "comment", "note", "message", "error"})


def masked_data(data: Mapping[str, Any]) -> dict[str, Any]:
    """The free-text values masked (people type secrets and addresses into them); the
    rest are names and ids the reader needs. Notifications send the same."""
    return {k: mask(v) if k in FREE_TEXT_KEYS else v for k, v in data.items()}


def append(
    *,
    event_type: str,
    actor: Actor,
    at: datetime,
    agent: str = "",
    task: str = "",
    tool: str = "",
    action: str = "",
    scope: str = "",
    arguments_json: str = "{}",
    arguments_hash: str = "",
    decision: str = "",
    reason: str = "",
    grant_id: int | None = None,
    approval_id: str = "",
    break_glass: bool = False,
    data: Mapping[str, Any] | None = None,
    standalone: bool = False,
    seen_seq: int | None = None,
) -> Written:
    """Append one event to the chain inside the caller's transaction.

    seen_seq (a decision's event, PostgreSQL): the newest event the decision's read
    could see; if a state change committed after it, nothing is written and
    StateChanged is raised.

    standalone=True (PostgreSQL, outside any transaction): the event is the
    whole change, written and committed by its one statement (a decision that
    changed nothing else).
    """
    if standalone:
        if connection.vendor != "postgresql" or connection.in_atomic_block:
            raise RuntimeError("a standalone event is one PostgreSQL statement, outside atomic()")
    elif not connection.in_atomic_block:
        # An event outside the change's transaction could survive a rollback
        # of the change, or the change could survive a failed event.
        raise RuntimeError("audit.append must run inside transaction.atomic()")
    if actor.token_id is not None:
        # Every change under a bearer token records its event here, in its transaction:
        # a token revoked after the request was let in gets the 401 of the door, and
        # the change is rolled back with nothing on record. Asked here, once for every
        # write (API, and any endpoint added later), after the change's row locks and
        # before the chain lock. Decisions are not refused here: their actor has no
        # token, and they answer a revoked token with a recorded deny (token_refusal).
        from governance.services import access  # services import this module

        access.require_live_token(actor.token_id)
    uid = uuid.uuid4()
    row: dict[str, Any] = {
        "uid": uid,
        "created_at": at,
        "event_type": event_type,
        "actor_type": actor.type,
        "actor": _text(actor.label, 200),
        "agent": _text(agent, 100),
        "task": _text(task, 100),
        "tool": _text(tool, 100),
        "action": _text(action, 64),
        "scope": _text(scope, 500),
        "arguments": arguments_json,
        "arguments_hash": arguments_hash,
        "decision": decision,
        "reason": reason,
        "grant_id": grant_id,
        "approval_id": approval_id,
        "break_glass": break_glass,
        "data": storable_json(masked_data(data)) if data else "{}",
    }
    held = getattr(_held, "rows", None)
    if held is not None and not standalone:
        # Inside deferred(): appended at the end of its block. The marker is a
        # no-op commit hook, which Django drops when a savepoint around it rolls back.
        def marker() -> None:
            return None

        transaction.on_commit(marker)
        held.append((row, marker))
        return Written(seq=0, uid=uid, hash="")
    if standalone and settings.AUDIT_GROUP_COMMIT:
        return _write_grouped(row, seen_seq)
    return _write(row, seen_seq)


def _append_one(mac: str, row: Mapping[str, Any], seen_seq: int | None) -> tuple[Any, ...]:
    """PostgreSQL: one event through governance_audit_append(); (seq, hash), seq None
    when the state changed after seen_seq."""
    params: list[Any] = [_derived_key(b"audit-link"), mac]
    params += [row[name] for name in _ROW_FIELDS]
    return db.query(_PG_APPEND, [*params, seen_seq], "is")[0]


def _write(row: dict[str, Any], seen_seq: int | None = None) -> Written:
    mac = row_mac(row)
    if connection.vendor == "postgresql":
        # The server takes the lock, reads the head, links and inserts; the
        # lock is then held only for the rest of this call and the COMMIT.
        seq, link = _append_one(mac, row, seen_seq)
        if seq is None:
            raise StateChanged("the state changed after the decision read it", seen_seq)
        return Written(seq=seq, uid=row["uid"], hash=link)
    last_seq, prev_hash = _lock_and_read_head()  # SQLite: the write transaction serialises
    row["seq"] = last_seq + 1
    row["prev_hash"] = prev_hash
    row["hash"] = link_hash(prev_hash, row["seq"], mac)
    values = [row[name] for name in FIELDS]
    values[FIELDS.index("uid")] = db.param_uuid(row["uid"])
    values[FIELDS.index("created_at")] = db.param_dt(row["created_at"])
    db.execute(_INSERT, values)
    return Written(seq=row["seq"], uid=row["uid"], hash=row["hash"])


# --- Group commit (PostgreSQL) -------------------------------------------------


class _Slot:
    """One event waiting to be appended, and its answer."""

    __slots__ = ("item", "done", "lead", "result")

    def __init__(self, item: dict[str, Any]) -> None:
        self.item = item
        self.done = threading.Event()
        self.lead = False  # woken to lead the next batch
        # (seq, hash); seq None: refused, the state changed. None: not written by the
        # batch (it failed): the event's own thread writes it alone.
        self.result: tuple[int | None, str | None] | None = None


_PG_APPEND_BATCH = (
    "SELECT out_seq, out_hash FROM governance_audit_append_batch(%s::bytea, %s::jsonb)"
)


class GroupCommit:
    """Standalone events (decisions that changed nothing else) that this process's
    threads submit while an append is in flight, appended by one statement: one
    chain lock, one COMMIT and one fsync for all of them (migration 0020). Each
    event is still durable before its thread answers.

    Leader and followers: a thread that finds no append in flight leads. It takes
    the waiting events, in arrival order (its own among them), appends them on its
    own connection (outside any transaction, so the statement commits itself) and
    wakes their threads; then the longest-waiting thread, if any, leads the next
    batch. A batch that fails writes nothing, and then every event in it is written
    alone by its own thread: one event's error, or one connection's, is never
    another's."""

    MAX_BATCH = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[_Slot] = []
        self._busy = False

    def write(self, item: dict[str, Any]) -> tuple[int | None, str | None] | None:
        slot = _Slot(item)
        with self._lock:
            self._waiting.append(slot)
            lead = not self._busy
            self._busy = True
        if not lead:
            slot.done.wait()
            if not slot.lead:
                return slot.result
        with self._lock:
            batch = self._waiting[: self.MAX_BATCH]
            del self._waiting[: self.MAX_BATCH]
        try:
            if len(batch) == 1:  # nothing queued: the single append's statement
                return _append_one(item["row_mac"], item, item["seen"])
            try:
                results = db.query(
                    _PG_APPEND_BATCH,
                    [_derived_key(b"audit-link"), json.dumps([s.item for s in batch])],
                    "is",
                )
            except Exception:
                log.warning(
                    "a grouped append of %d events failed; each is written alone",
                    len(batch),
                    exc_info=True,
                )
                return None
            for waiting, result in zip(batch, results, strict=True):
                waiting.result = result
            return slot.result
        finally:
            for waiting in batch:
                if waiting is not slot:
                    waiting.done.set()
            with self._lock:
                if self._waiting:
                    self._waiting[0].lead = True
                    self._waiting[0].done.set()
                else:
                    self._busy = False


_group = GroupCommit()


def _write_grouped(row: dict[str, Any], seen_seq: int | None) -> Written:
    """A standalone event through the process's group commit (PostgreSQL)."""
    if any(type(value) is str and "\x00" in value for value in row.values()):
        return _write(row, seen_seq)  # refused alone, as _write() refuses it
    item = {name: row[name] for name in _ROW_FIELDS}
    item.update(
        row_mac=row_mac(row),
        uid=str(row["uid"]),
        created_at=row["created_at"].isoformat(),
        seen=seen_seq,
    )
    result = _group.write(item)
    if result is None:
        return _write(row, seen_seq)
    seq, link = result
    if seq is None:
        raise StateChanged("the state changed after the decision read it", seen_seq)
    return Written(seq=seq, uid=row["uid"], hash=link or "")


_held = threading.local()


@contextmanager
def deferred() -> Iterator[None]:
    """One all-or-nothing transaction that runs many services (a matrix import, the
    demo data): their events are held and appended together, in order, at the end
    of the block. Every decision waits for the chain lock, so it is taken once, last,
    and held for the appends and the COMMIT only, not for the whole import; and no
    row lock is taken after it (tests/conftest.py). The events of a part rolled back
    to a savepoint inside the block are dropped with it. Inside the block append()
    returns the event's uid only (seq 0, no hash). Nested blocks join the outer one."""
    if getattr(_held, "rows", None) is not None:
        yield
        return
    rows: list[tuple[dict[str, Any], Any]] = []
    _held.rows = rows
    try:
        with transaction.atomic():
            yield
            _held.rows = None
            alive = {id(func) for _sids, func, _robust in connection.run_on_commit}
            for row, marker in rows:
                if id(marker) in alive:
                    _write(row)
    finally:
        _held.rows = None


# --- Verifying ---------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    ok: bool
    count: int
    head: str
    bad_seq: int | None = None
    problem: str = ""
    # Windows the checkpoint series did not cover (the job stopped): not proof of
    # tampering, but newest events deleted then would not show. Said on every verify.
    gaps: tuple[str, ...] = ()

    def render(self) -> str:
        if self.ok:
            return f"ok: {self.count} events, head {self.head}"
        return f"FAILED at seq {self.bad_seq}: {self.problem}"


# SQLite keeps the typed columns as the application spelled them: another spelling of
# the same value (the time at another offset, the uid in capitals, break_glass 2)
# reads back, and hashes, the same, yet SQL filters compare the spelling and miss
# the event. The stored spelling must be the one an append writes.
_SQLITE_STORED = "quote(uid) || ' ' || quote(created_at) || ' ' || quote(break_glass)"


def _stored(event: Mapping[str, Any]) -> str:
    """The _SQLITE_STORED text of an event as an append writes it."""
    return (
        f"'{db.param_uuid(event['uid'])}' '{db.param_dt(event['created_at'])}' "
        f"{int(event['break_glass'] is True)}"
    )


def _rows(after: int = 0) -> Iterator[dict[str, Any]]:
    from django.db.models import CharField
    from django.db.models.expressions import RawSQL

    from governance.models import AuditEvent

    found = AuditEvent.objects.filter(seq__gt=after).order_by("seq")
    sqlite = connection.vendor == "sqlite"
    if sqlite:
        stored = RawSQL(_SQLITE_STORED, (), output_field=CharField())  # noqa: S611 (a constant)
        found = found.annotate(stored=stored)
    for event in found.values(*FIELDS, *(["stored"] if sqlite else [])).iterator(2000):
        event["created_at"] = db.read_dt(event["created_at"])
        if sqlite and event.pop("stored") != _stored(event):
            raise ValueError(
                f"seq {event['seq']}: uid, created_at or break_glass is not stored as "
                "the application writes it"
            )
        yield event


def _same(a: Any, b: Any) -> bool:
    """Constant-time equality of two digests as stored, whatever a tamperer put there
    (compare_digest refuses non-ASCII text: that would be a crash, not a finding)."""
    return hmac.compare_digest(
        str(a).encode("utf-8", "surrogatepass"), str(b).encode("utf-8", "surrogatepass")
    )


def _walk(after: int, prev_hash: str) -> Verdict:
    """Check every event after seq `after` links onto `prev_hash` and its successors."""
    expected_seq, count = after + 1, after
    rows = _rows(after)
    while True:
        try:
            row = next(rows, None)
        except (OperationalError, InterfaceError):
            # The database, not the log: a cancelled statement or a lost connection is
            # no finding. Recorded as one, it went into the chain for good as
            # "edited outside the application", alerted every admin, and hid a real
            # edit found within the hour behind it.
            raise
        except Exception as exc:  # a value no reader can decode was written past the app
            return Verdict(
                False,
                count,
                prev_hash,
                expected_seq,
                f"the event at or after seq {expected_seq} is unreadable "
                f"({printable(str(exc))[:200]}): edited outside the application",
            )
        if row is None:
            break
        seq = row["seq"]
        if seq != expected_seq:
            problem = (
                f"expected seq {expected_seq}, found {seq}: event(s) deleted"
                if seq > expected_seq
                else f"seq {seq} out of order"
            )
            return Verdict(False, count, prev_hash, expected_seq, problem)
        if row["prev_hash"] != prev_hash:
            return Verdict(
                False,
                count,
                prev_hash,
                seq,
                "prev_hash does not link to the previous event (inserted, deleted or reordered)",
            )
        try:
            intact = _same(event_hash(prev_hash, row), row["hash"]) or _same(
                legacy_event_hash(prev_hash, row), row["hash"]
            )
        except Exception as exc:  # a column no reader can use (an unreadable time, say)
            return Verdict(
                False, count, prev_hash, seq, f"the event is unreadable ({exc.__class__.__name__})"
            )
        if not intact:
            return Verdict(
                False,
                count,
                prev_hash,
                seq,
                "content does not match its HMAC (edited, or re-hashed without the key)",
            )
        prev_hash, expected_seq, count = row["hash"], seq + 1, count + 1
    return Verdict(True, count, prev_hash)


def verify_since(seq: int, head: str) -> Verdict | None:
    """The events after `seq`, linked onto `head` (a link this process verified
    itself, or a signed checkpoint's: verify_tail), and the checkpoints written over
    them held against the log: work in
    proportion to the new events only. None when the log no longer has `head` at
    `seq` (a different database, or the row changed): only a full walk can say more."""
    if seq and _hash_at(seq) != head:
        return None
    broken: tuple[int, str] | None = None
    try:
        tail = _checkpoints_after(seq)  # before the walk, as in verify_chain()
    except ChainBroken as exc:
        tail, broken = [], exc.problem
    verdict = _walk(seq, head)
    if not verdict.ok:
        return verdict
    try:
        problem = broken or (
            _unchained()
            or _series_problem(_first_checkpoint(), _series_start())
            or _against_checkpoints(tail, verdict.count)
        )
    except ChainBroken as exc:
        problem = exc.problem
    if problem:
        return Verdict(False, verdict.count, verdict.head, problem[0], problem[1])
    return verdict


def verify_tail(
    checkpoint: dict[str, Any] | None, at: datetime, limit: int
) -> tuple[int, Verdict | None]:
    """A page's own check, bounded: the events after the newest checkpoint
    (`checkpoint`: latest_checkpoint(); from genesis if there is none), linked onto its
    signed head (verify_since), the checkpoint itself readable, signed and recent
    (AUDIT_CHECKPOINT_MAX_AGE, as verify demands). Returns the seq it checked from and
    the verdict; None when more than `limit` events would be walked (the checkpoint
    job is behind): then nothing is walked."""
    count = head_seq()
    problem = _unsigned(checkpoint, 0) if checkpoint is not None else None
    problem = problem or _checkpoint_stale([checkpoint] if checkpoint else [], count, at)
    since, head = (checkpoint["seq"], checkpoint["head"]) if checkpoint else (0, GENESIS)
    if problem:
        return since, Verdict(False, count, "", problem[0], problem[1])
    if count - since > limit:
        return since, None
    verdict = verify_since(since, head)
    if verdict is None:  # the log no longer holds what the checkpoint signed
        problem = (_against_checkpoints([checkpoint], count) if checkpoint else None) or (
            since,
            "the log no longer holds the head the newest checkpoint signed",
        )
        return since, Verdict(False, min(count, since), "", problem[0], problem[1])
    return since, verdict


def holds(seq: int, head: str) -> bool:
    """Does the log still hold `head` at `seq` (the head a full walk verified)?"""
    return not seq or _hash_at(seq) == head


def recorded_failure() -> dict[str, Any] | None:
    """The newest `audit.verify_failed` event in the chain: its seq, time and what it
    found (one indexed read)."""
    from governance.models import AuditEvent

    found = AuditEvent.objects.filter(event_type=EventType.AUDIT_VERIFY_FAILED, seq__gt=0)
    row = found.order_by("-seq").values_list("seq", "created_at", "data").first()
    if row is None:
        return None
    try:  # written by verify_and_record; anything else there is not worth a 500
        data = json.loads(row[2] or "{}")
    except ValueError:
        data = {}
    found_then = {k: data.get(k) for k in ("bad_seq", "problem")} if isinstance(data, dict) else {}
    return {"seq": row[0], "time": db.read_dt(row[1]), **found_then}


def _unchained() -> tuple[int, str] | None:
    """An event outside the chain (seq below 1) is never walked, yet exports and
    reports would show it: its presence alone is the finding."""
    from governance.models import AuditEvent

    seq = AuditEvent.objects.filter(seq__lt=1).order_by("seq").values_list("seq", flat=True).first()
    if seq is None:
        return None
    return seq, f"an event at seq {seq} is outside the chain (it starts at seq 1): inserted"


def _against_checkpoints(checkpoints: list[dict[str, Any]], count: int) -> tuple[int, str] | None:
    """Does a log of `count` events still hold what each checkpoint signed? Every one,
    not only the newest: newest events deleted and then written again before the next
    checkpoint would otherwise pass, that checkpoint signing the new head."""
    from governance.models import AuditEvent

    if not checkpoints:
        return None
    newest = max(checkpoints, key=lambda cp: cp["seq"])
    if newest["seq"] > count:
        return (
            count + 1,
            f"checkpoint {newest['file']} covers seq {newest['seq']} but the log ends at "
            f"seq {count}: the newest {newest['seq'] - count} event(s) were deleted",
        )
    seqs = sorted({cp["seq"] for cp in checkpoints if cp["seq"] > 0})
    hashes: dict[int, str] = {}
    for i in range(0, len(seqs), 1000):
        found = AuditEvent.objects.filter(seq__in=seqs[i : i + 1000]).values_list("seq", "hash")
        hashes.update(found)
    for cp in sorted(checkpoints, key=lambda cp: cp["seq"]):
        if cp["seq"] > 0 and hashes.get(cp["seq"]) != cp["head"]:
            return cp["seq"], f"event hash differs from checkpoint {cp['file']}"
    return None


def verify_chain(at: datetime | None = None) -> Verdict:
    """Walk the chain from genesis, look for events outside it, then hold it against
    every checkpoint and against the head the last passing full verify signed
    (verified.json: _against_full_verify); the latest checkpoint must exist (once there
    are events) and be recent (AUDIT_CHECKPOINT_MAX_AGE)."""
    # The checkpoints and the record first: one the job (or another verify) writes
    # while the walk runs signs events the walk may not reach, and would read as the
    # newest events deleted. Each one read here signed events that had committed, so
    # the walk reaches them all.
    with _series_held():  # compaction never deletes a file between listing and read
        checkpoints = _load_all()
        bridges, bad_bridge = _load_bridges()
    held = _held_head(last_full_verify())
    verdict = _walk(0, GENESIS)
    if not verdict.ok:
        return verdict
    count, prev_hash = verdict.count, verdict.head
    # The chain passes through every checkpoint still kept; over a compacted stretch,
    # only through a signed bridge (compact_checkpoints()).
    series = _follow(checkpoints, bridges)
    problem = (
        _unchained()
        or bad_bridge
        or series.problem
        or _series_problem(series.kept, _series_start())
        or _against_checkpoints(series.kept, count)
        or _against_full_verify(held, count)
    )
    if problem:
        return Verdict(False, count, prev_hash, problem[0], problem[1])
    stale = _checkpoint_stale(series.kept, count, at or datetime.now(UTC))
    if stale:
        return Verdict(False, count, prev_hash, stale[0], stale[1])
    return Verdict(True, count, prev_hash, gaps=_checkpoint_gaps(series.kept, series.bridged))


def _against_full_verify(held: dict[str, Any] | None, count: int) -> tuple[int, str] | None:
    """Does a log of `count` events still hold the head the last passing full verify
    signed (`held`: _held_head())? Events it verified that no checkpoint had signed yet,
    deleted and written again (or re-chained) before the next checkpoint signed the new
    head, pass every checkpoint; only this record still knows the old head. Without
    this check the next verify passed and replaced the record with the new head, and
    the page, which had said FAILED, said ok again."""
    if held is None:
        return None
    if "unreadable" in held:  # as on the page: a finding, never a pass
        return count, (
            f"the record of the last full verify ({_VERIFIED}) was found unreadable "
            f"({held['unreadable']}): the head it verified cannot be held against the log "
            "(restart_checkpoints moves it aside once the log is known good)"
        )
    seq, head = held["count"], held["head"]
    if not seq:
        return None
    signed = (
        f"the last full verify ({held['time']}, by {held['by']}) signed head {head} at seq {seq}"
    )
    if count < seq:
        return seq, (
            f"{signed}; the log now ends at seq {count}: the newest events up to seq {seq} "
            "were deleted"
        )
    found = _hash_at(seq)
    if found != head:
        return seq, (
            f"{signed}; the log now has hash {found} there: events up to seq {seq} were "
            "deleted and written again, or rewritten, since"
        )
    return None


def _series_problem(
    checkpoints: list[dict[str, Any]], series: tuple[int, str | None] | None
) -> tuple[int, str] | None:
    """The series in the directory is the one the log says began last (`series`:
    _series_start()): its first checkpoint signed that event or a later one (or is the
    one a log from before series were recorded adopted). None, when the log says one
    began, is an emptied directory; an older series put back is one the log has moved
    on from."""
    if series is None:
        return None
    started, adopted = series
    if not checkpoints:
        return started, _NO_SERIES.format(seq=started)
    first = checkpoints[0]
    if "unreadable" in first:
        return None  # a finding of its own (_check_checkpoint_chain)
    if first["file"] != adopted and (adopted is not None or first["seq"] < started):
        return started, (
            f"checkpoint {first['file']} begins a series the log does not say began (its "
            f"newest series began at seq {started}): not the current series"
        )
    return None


def _first_checkpoint() -> list[dict[str, Any]]:
    """The series' first checkpoint, alone (none: an empty list): the one the pointer
    names (one file read), else the directory's first name."""
    pointer = _pointer()
    found = _read_named(pointer.first) if pointer else None
    if found is not None:
        return [found]
    names = _listing(_CHECKPOINT)
    return [_read_checkpoint(_checkpoint_dir() / names[0])] if names else []


def _checkpoint_gaps(
    checkpoints: list[dict[str, Any]], bridged: frozenset[str] = frozenset()
) -> tuple[str, ...]:
    """Each pair of consecutive checkpoints further apart than AUDIT_CHECKPOINT_MAX_AGE.
    A pair joined by a bridge (`bridged`: the later one's file) is not one: the
    checkpoints between them were compacted, not missing, and compaction keeps both
    sides of every real gap, so each is still named."""
    max_age = settings.AUDIT_CHECKPOINT_MAX_AGE
    if not max_age:
        return ()
    found = []
    for before, after in itertools.pairwise(checkpoints):
        if after["file"] in bridged:
            continue
        apart = _written(after) - _written(before)
        if apart > max_age:
            found.append(
                f"checkpoints {before['file']} and {after['file']} are "
                f"{int(apart.total_seconds() // 60)} min apart (more than "
                f"AUDIT_CHECKPOINT_MAX_AGE): events after seq {before['seq']} were not "
                f"protected until seq {after['seq']} was signed; newest events deleted in "
                "that window would not show"
            )
    return tuple(found)


def _checkpoint_stale(
    checkpoints: list[dict[str, Any]], count: int, at: datetime
) -> tuple[int, str] | None:
    """Without a recent checkpoint, the newest events could be deleted unseen."""
    max_age = settings.AUDIT_CHECKPOINT_MAX_AGE
    if not max_age or count == 0:
        return None
    if not checkpoints:
        return count, (
            "no checkpoint outside the database: the newest events could be deleted "
            "unseen (run manage.py audit_checkpoint; is the audit-checkpoint job running?)"
        )
    newest = checkpoints[-1]
    written = datetime.fromisoformat(newest["time"])
    if written < at - max_age:
        minutes = int((at - written).total_seconds() // 60)
        return newest["seq"], (
            f"the newest checkpoint, {newest['file']}, is {minutes} min old (more than "
            f"AUDIT_CHECKPOINT_MAX_AGE): the checkpoint job has stopped, and events after "
            f"seq {newest['seq']} could be deleted unseen"
        )
    return None


def verify_and_record(
    *, actor: Actor, at: datetime, once_within: timedelta | None = None
) -> Verdict:
    """Verify; a failure is logged and recorded as an event in the chain itself
    (appended after the damage, so the next verify still reports the damage).
    Used by the nightly job and by `manage.py audit_verify` alike. With `once_within`
    (the job), a failure already recorded in that window before `at` is not recorded
    or alerted again: a redelivered message, a run on top of the nightly one, or a
    message anyone with the broker can send, each added an event and an admin alert."""
    verdict = verify_chain(at)
    _record_full_verify(verdict, actor=actor, at=at)
    if verdict.ok:
        return verdict
    log.error("audit chain verification failed: %s", verdict.render())
    if once_within is None:
        _record_failure(verdict, actor=actor, at=at)
        return verdict
    with _refusal_lock():
        if not _finding_recorded_within(verdict, at, once_within):
            _record_failure(verdict, actor=actor, at=at)
    return verdict


def _finding_recorded_within(verdict: Verdict, at: datetime, window: timedelta) -> bool:
    """Was a finding of this kind recorded in the `window` before `at`? Another kind is
    recorded whatever came before it: one damage must not hide the next behind it. The
    kind is the problem with its numbers left out: a missing or stale checkpoint's
    finding names the head's seq and the checkpoint's age, which move with every event
    and every minute, so comparing them whole recorded (and alerted) once per message."""
    from governance.models import AuditEvent

    recent = AuditEvent.objects.filter(
        event_type=EventType.AUDIT_VERIFY_FAILED, seq__gt=0, created_at__gt=at - window
    ).values_list("data", flat=True)
    kind = _finding_kind(verdict.problem)
    return any(_finding_kind(_recorded_problem(data)) == kind for data in recent)


def _finding_kind(problem: str | None) -> str:
    return re.sub(r"[0-9]+", "#", problem or "")


def _recorded_problem(data: str) -> str | None:
    try:
        body = json.loads(data or "{}")
    except ValueError:
        return None  # unreadable: no match, so the finding is recorded again
    return body.get("problem") if isinstance(body, dict) else None


def _record_failure(verdict: Verdict, *, actor: Actor, at: datetime) -> None:
    """One `audit.verify_failed` event, and with it the admins' alert."""
    with transaction.atomic():
        append(
            event_type=EventType.AUDIT_VERIFY_FAILED,
            actor=actor,
            at=at,
            reason="verify_failed",
            data={"bad_seq": verdict.bad_seq, "problem": verdict.problem},
        )
        from governance import notifications  # local: notifications imports models

        try:
            with transaction.atomic():  # a savepoint: the alert never undoes the event
                notifications.audit_verify_failed(
                    bad_seq=verdict.bad_seq, problem=verdict.problem, at=at
                )
        except Exception:
            log.exception("could not queue the audit verification alert")


# --- The record of the last full verify ------------------------------------------------
#
# A walk from genesis costs time in proportion to the log (33 s at 500,000 events), so
# pages never make one: they show what the last one found, kept here by whoever walked
# (the nightly job, `manage.py audit_verify`, the checkpoint job over damage). A failure
# is also an `audit.verify_failed` event; a pass needs a record of its own. It is kept
# beside the checkpoints, outside the database, and signed with a key of its own derived
# from AUDIT_HMAC_KEY (it can pass for no checkpoint or bridge, nor they for it): who
# can write only the database can neither forge nor remove it. Who can write the
# directory can delete it (the page then says no walk is on record) or put an older
# signed one back (the page shows its older time, and a failure recorded after it in
# the log still shows): hiding a known failure takes both the directory and deleting
# the failure's event from the log, which itself breaks the chain.
#
# The record is also evidence for the next walk: every full verify holds the log
# against the head the last passing one signed (_against_full_verify). A failing
# record carries that head on (`held`), so the failure is found again by every verify
# after it, as a checkpoint the log no longer holds is, until the log is known good
# and restart_checkpoints() moves the record aside with the old series. An unreadable
# or forged record is a failure, carried on the same way; no record (a fresh install,
# or one deleted from the directory: see above) holds nothing.

_VERIFIED = "verified.json"
_VERIFIED_SIGNED = ("time", "ok", "count", "head", "bad_seq", "problem", "by")


def _sign_verified(body: Mapping[str, Any]) -> str:
    fields = {k: body[k] for k in _VERIFIED_SIGNED}
    if "held" in body:  # signed when there: records written before it had none
        fields["held"] = body["held"]
    return hmac.digest(
        _derived_key(b"full-verify"), canonical_json(fields).encode(), "sha256"
    ).hex()


def _record_full_verify(verdict: Verdict, *, actor: Actor, at: datetime) -> None:
    """Keep what a full walk found (pass or fail), replacing the record before it at
    once (readers see the old one or the new one). A failure carries on the head the
    record before it held (`held`: _held_head()), so the next verify still holds the
    log against it: replaced by a pass, a failure against that record would have
    been forgotten at the next walk. A record that cannot be written is logged, never
    a failure of the verify itself: its exit code and its event stay what they were."""
    body: dict[str, Any] = {
        "time": _iso(at),
        "ok": verdict.ok,
        "count": verdict.count,
        "head": verdict.head,
        "bad_seq": verdict.bad_seq,
        "problem": verdict.problem,
        "by": actor.label,
    }
    held = None if verdict.ok else _held_head(last_full_verify())
    if held is not None:
        body["held"] = held
    body["signature"] = _sign_verified(body)
    directory = _checkpoint_dir()
    tmp = directory / f".{_VERIFIED}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp.write_text(canonical_json(body))
        os.replace(tmp, directory / _VERIFIED)
    except OSError as exc:
        log.warning("the record of the full verify was not written (%s)", exc)
        tmp.unlink(missing_ok=True)


def last_full_verify() -> dict[str, Any] | None:
    """What the last recorded full walk found: time, ok, count, head, bad_seq,
    problem, by (who walked). None: none on record. A record that cannot be read or
    whose signature is wrong comes back with `unreadable` (someone wrote it who does
    not hold the key): a finding, never a crash and never a pass."""
    path = _checkpoint_dir() / _VERIFIED
    try:
        body = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:
        return {"unreadable": printable(str(exc))[:200]}
    try:
        good = isinstance(body, dict) and _same(_sign_verified(body), body.get("signature", ""))
        good = good and isinstance(body["ok"], bool) and isinstance(body["count"], int)
        good = good and isinstance(body.get("held"), dict | None)
        if good:
            body["time"] = datetime.fromisoformat(body["time"])
    except (KeyError, TypeError, ValueError):
        good = False
    return body if good else {"unreadable": "its signature does not match its content"}


def _held_head(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """The head a full verify must find the log still holding (seq `count`, `head`,
    and the `time` and `by` of the pass that signed it), from the record
    (last_full_verify()): a pass's own, a failure's carried on (`held`), an unreadable
    record's `unreadable` (a finding, as on the page); None: nothing to hold."""
    if record is None or "unreadable" in record:
        return record
    if not record["ok"]:
        return record.get("held")
    return {k: record[k] for k in ("count", "head", "by")} | {"time": _iso(record["time"])}


def _hash_at(seq: int) -> str | None:
    from governance.models import AuditEvent

    return AuditEvent.objects.filter(seq=seq).values_list("hash", flat=True).first()


# --- Checkpoints -------------------------------------------------------------
#
# The directory holds, beside `.lock`:
#   checkpoint-<index>-<time>.json  the signed series; names sort in order of writing
#   bridge-<index>-<index>.json     signed: "these two checkpoints were consecutive
#                                   before compaction deleted those between" (below)
#   pointer.json                    the first and the newest few names, so a page reads
#                                   one file, not a listing of every one (_pointer())
# Verify, the writer and compaction list the directory; pages follow the pointer.

_CHECKPOINT, _BRIDGE = "checkpoint-", "bridge-"
_POINTER = "pointer.json"
_INDEX = re.compile(r"checkpoint-([0-9]{9})-")
# How many of the newest names the pointer keeps: the page's quick check reads back to
# the head it last walked (minutes ago at most); further back it lists the directory.
_RECENT = 64


def _sign_checkpoint(body: Mapping[str, Any]) -> str:
    fields = {k: body[k] for k in ("seq", "head", "count", "time", "prev_signature")}
    return hmac.digest(_derived_key(b"checkpoint"), canonical_json(fields).encode(), "sha256").hex()


def _checkpoint_dir() -> Path:
    return Path(settings.AUDIT_CHECKPOINT_DIR)


# What a checkpoint file holds. A file that is not this (someone wrote garbage into the
# directory) is a finding for verify, never a crash that skips its alert.
_CHECKPOINT_FIELDS = {
    "seq": int, "head": str, "count": int, "time": str, "prev_signature": str, "signature": str,
}  # fmt: skip


def _read_checkpoint(path: Path, fields: Mapping[str, type] = _CHECKPOINT_FIELDS) -> dict[str, Any]:
    try:
        body = json.loads(path.read_text())
        if not isinstance(body, dict):
            raise ValueError("not a JSON object")
        for key, kind in fields.items():
            value = body.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"{key!r} is missing or not a {kind.__name__}")
        datetime.fromisoformat(body["time"])
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        return {"file": path.name, "seq": 0, "unreadable": printable(str(exc))[:200]}
    body["file"] = path.name
    return body


def _written(checkpoint: Mapping[str, Any]) -> datetime:
    return datetime.fromisoformat(checkpoint["time"])


def _listing(prefix: str) -> list[str]:
    """The directory's `prefix*.json` names, sorted. As strings: sorting Path objects
    was most of the seconds a page spent at fifty thousand checkpoints."""
    try:
        with os.scandir(_checkpoint_dir()) as entries:
            return sorted(
                e.name for e in entries if e.name.startswith(prefix) and e.name.endswith(".json")
            )
    except OSError:  # no directory (yet), or not one: no checkpoint there
        return []


def _load_all() -> list[dict[str, Any]]:
    directory = _checkpoint_dir()
    return [_read_checkpoint(directory / name) for name in _listing(_CHECKPOINT)]


def load_checkpoints() -> list[dict[str, Any]]:
    """All checkpoint files, oldest first (file names sort by sequence of writing)."""
    with _series_held():
        return _load_all()


_HELD_WAIT = 10.0  # seconds


@contextmanager
def _series_held() -> Iterator[None]:
    """A reader's shared hold on the directory's lock while it lists and reads: the
    writer, compaction and a restart hold it exclusively, so no file the listing named
    is deleted or moved before it is read (that would read as an unreadable checkpoint,
    a false alarm recorded for ever). Waited for _HELD_WAIT at most, then read without
    it: a caller inside a transaction holding the chain lock, while the writer holds
    this one and waits for that, would otherwise wait for ever (no database sees a
    deadlock that is half a file lock). No lock file yet: nothing has written there."""
    try:
        lock = open(_checkpoint_dir() / ".lock", "rb")  # noqa: SIM115 (closed below)
    except OSError:
        yield
        return
    with lock:
        deadline = time.monotonic() + _HELD_WAIT
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning("checkpoint directory still locked: read without the lock")
                    break
                time.sleep(0.01)
        yield


@dataclass(frozen=True)
class _Pointer:
    first: str
    recent: list[str]  # oldest first; the last is the newest checkpoint


def _is_checkpoint_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name.startswith(_CHECKPOINT)
        and name.endswith(".json")
        and "/" not in name
        and "\x00" not in name
    )


def _pointer() -> _Pointer | None:
    """The pointer as the writer last left it, or None (none yet, or not one). A hint
    for readers, never evidence: whatever it names is read and checked as any
    checkpoint is, and anything amiss (a name that is gone, a chain that does not
    follow) sends the reader back to the listing. The writer, verify and compaction
    never trust it: they list the directory."""
    try:
        body = json.loads((_checkpoint_dir() / _POINTER).read_text())
        first, recent = body["first"], body["recent"]
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        return None
    if not isinstance(recent, list) or not recent:
        return None
    if not all(_is_checkpoint_name(name) for name in (first, *recent)):
        return None
    return _Pointer(first, recent)


def _point_at(directory: Path, first: str, recent: list[str]) -> None:
    """Replace the pointer at once (readers see the old one or the new one, never
    half). If it cannot be written it is removed, so readers list the directory rather
    than follow a stale one; the checkpoint itself is already written."""
    path, tmp = directory / _POINTER, directory / f".{_POINTER}.{os.getpid()}.tmp"
    try:
        tmp.write_text(canonical_json({"first": first, "recent": recent[-_RECENT:]}))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("audit checkpoint pointer not written (%s): readers list instead", exc)
        for stale in (tmp, path):
            stale.unlink(missing_ok=True)


def _read_named(name: str) -> dict[str, Any] | None:
    """The checkpoint file `name`, or None if there is none by that name."""
    path = _checkpoint_dir() / name
    return _read_checkpoint(path) if path.is_file() else None


def _recent_after(seq: int) -> list[dict[str, Any]] | None:
    """_checkpoints_after() from the pointer's names: a few files read, no listing.
    None when they do not reach back to `seq`, or anything about them is amiss; the
    caller then lists the directory, and reports what it finds there."""
    pointer = _pointer()
    if pointer is None:
        return None
    found: list[dict[str, Any]] = []
    for name in reversed(pointer.recent):
        body = _read_named(name)
        if body is None or "unreadable" in body:
            return None
        found.append(body)
        if body["seq"] <= seq:
            found.reverse()
            return None if _follow(found, continues=True).problem else found
    return None


def _checkpoints_after(seq: int) -> list[dict[str, Any]]:
    """The newest checkpoints, back to the first one at or below `seq` (read newest
    first, so the work is the checkpoints written since, not the whole series)."""
    found = _recent_after(seq)
    if found is not None:
        return found
    found = []
    with _series_held():
        directory = _checkpoint_dir()
        for name in reversed(_listing(_CHECKPOINT)):
            body = _read_checkpoint(directory / name)
            found.append(body)
            if "unreadable" not in body and body["seq"] <= seq:
                break
        bridges = _load_bridges()[0] if found else {}
    found.reverse()
    problem = _follow(found, bridges, continues=True).problem
    if problem:
        raise ChainBroken(problem)
    return found


def latest_checkpoint() -> dict[str, Any] | None:
    """The newest checkpoint alone (a page needs only that, not the whole series): the
    one the pointer names, one file read however many the directory holds; with no
    usable pointer, the directory's last name."""
    pointer = _pointer()
    found = _read_named(pointer.recent[-1]) if pointer else None
    if found is not None:
        return found
    names = _listing(_CHECKPOINT)
    return _read_checkpoint(_checkpoint_dir() / names[-1]) if names else None


# --- Bridges over compacted checkpoints -------------------------------------------------

# What a bridge file holds: the checkpoints it joins (`from` was followed, through the
# checkpoints compaction deleted, by `to`), and how many it stands for.
_BRIDGE_FIELDS = {
    "from_file": str, "from_seq": int, "from_signature": str,
    "to_file": str, "to_seq": int, "to_prev_signature": str,
    "files": int, "time": str, "signature": str,
}  # fmt: skip


def _sign_bridge(body: Mapping[str, Any]) -> str:
    # Its own derived key: no bridge can pass for a checkpoint, nor one for a bridge.
    fields = {k: body[k] for k in _BRIDGE_FIELDS if k != "signature"}
    return hmac.digest(
        _derived_key(b"checkpoint-bridge"), canonical_json(fields).encode(), "sha256"
    ).hex()


def _load_bridges() -> tuple[dict[str, list[dict[str, Any]]], tuple[int, str] | None]:
    """Every good bridge, by the signature it leaves from; and the first bad one as a
    finding (garbage or a forgery in the directory, like an unreadable checkpoint). A
    bad bridge joins nothing."""
    directory = _checkpoint_dir()
    leaving: dict[str, list[dict[str, Any]]] = {}
    bad: tuple[int, str] | None = None
    for name in _listing(_BRIDGE):
        body = _read_checkpoint(directory / name, _BRIDGE_FIELDS)
        if "unreadable" in body:
            bad = bad or (1, f"checkpoint bridge {name} is unreadable ({body['unreadable']})")
        elif not _same(_sign_bridge(body), body["signature"]):
            bad = bad or (body["from_seq"], f"checkpoint bridge {name} has a bad signature")
        else:
            leaving.setdefault(body["from_signature"], []).append(body)
    return leaving, bad


@dataclass(frozen=True)
class _Series:
    kept: list[dict[str, Any]]  # the checkpoints the chain passes through, oldest first
    bridged: frozenset[str]  # those reached over a bridge (the file names)
    problem: tuple[int, str] | None
    # Files a bridge stands for that are still there (a compaction stopped part-way).
    leftovers: tuple[str, ...] = ()


def _follow(
    checkpoints: list[dict[str, Any]],
    bridges: Mapping[str, list[dict[str, Any]]] | None = None,
    *,
    continues: bool = False,
) -> _Series:
    """Each checkpoint readable, signed, and following the one before: its
    prev_signature is that one's signature, or a good bridge leaves that one for it
    (the checkpoints between were compacted; any still there, a compaction stopped
    part-way, are passed over, each still a genuine checkpoint). `continues`: the list
    is the tail of the series, so its first one's predecessor is not in it."""
    bridges = bridges or {}
    at = {body["file"]: i for i, body in enumerate(checkpoints)}
    prev_signature = checkpoints[0].get("prev_signature", "") if continues and checkpoints else ""
    prev_seq = 0
    kept: list[dict[str, Any]] = []
    bridged: set[str] = set()
    leftovers: list[str] = []

    def broken(problem: tuple[int, str]) -> _Series:
        return _Series(kept, frozenset(bridged), problem, tuple(leftovers))

    i = 0
    while i < len(checkpoints):
        body = checkpoints[i]
        problem = _unsigned(body, prev_seq)
        if problem:
            return broken(problem)
        if body["prev_signature"] != prev_signature:
            ahead = [
                (at[b["to_file"]], b)
                for b in bridges.get(prev_signature, ())
                if at.get(b["to_file"], -1) >= i
            ]
            if not ahead:
                return broken(_not_following(body))
            target, bridge = min(ahead, key=lambda found: found[0])
            for left in checkpoints[i:target]:
                problem = _unsigned(left, prev_seq)
                if problem:  # not a checkpoint the bridge stood for: put there since
                    return broken(problem)
                leftovers.append(left["file"])
            body = checkpoints[target]
            problem = _unsigned(body, prev_seq)
            if problem:
                return broken(problem)
            if body["prev_signature"] != bridge["to_prev_signature"]:
                return broken(_not_following(body))
            bridged.add(body["file"])
            i = target
        if body["seq"] < prev_seq:
            going = f"checkpoint {body['file']} goes backwards from seq {prev_seq}"
            return broken((body["seq"], going))
        kept.append(body)
        prev_signature, prev_seq = body["signature"], body["seq"]
        i += 1
    return _Series(kept, frozenset(bridged), None, tuple(leftovers))


def _unsigned(body: Mapping[str, Any], prev_seq: int) -> tuple[int, str] | None:
    name = body["file"]
    if "unreadable" in body:
        return prev_seq + 1, (
            f"checkpoint {name} is unreadable ({body['unreadable']}): the events it "
            "should cover are not protected by it"
        )
    if not _same(_sign_checkpoint(body), body.get("signature", "")):
        return body.get("seq", 0), f"checkpoint {name} has a bad signature"
    return None


def _not_following(body: Mapping[str, Any]) -> tuple[int, str]:
    return body["seq"], f"checkpoint {body['file']} does not follow the previous checkpoint"


def _check_checkpoint_chain(
    checkpoints: list[dict[str, Any]], *, continues: bool = False
) -> tuple[int, str] | None:
    """_follow() with no bridge: the problem alone."""
    return _follow(checkpoints, continues=continues).problem


def record_refusal_once(*, actor: Actor, at: datetime, window: timedelta) -> bool:
    """verify_and_record(), unless a failed verification was recorded in the `window`
    before `at` (refusal_recorded_within). The check and the record are made under one
    lock in AUDIT_CHECKPOINT_DIR: two refused checkpoint jobs at once (a backlog, two
    beats) both saw none recorded while the first was still walking the log, and the
    damage was recorded and alerted twice. True if this call recorded it."""
    with _refusal_lock():
        if refusal_recorded_within(at, window):
            return False
        return not verify_and_record(actor=actor, at=at).ok


@contextlib.contextmanager
def _refusal_lock() -> Iterator[None]:
    """Held while deciding whether to record a failed verification, and recording it."""
    directory = _checkpoint_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".refusal.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def refusal_recorded_within(at: datetime, window: timedelta) -> bool:
    """Was a failed verification recorded in the `window` before `at`? The minutely
    checkpoint job, refused over a damaged log, records and alerts at most once per
    window instead of every minute (the nightly verify, too, records none already
    recorded in the window)."""
    from governance.models import AuditEvent

    return AuditEvent.objects.filter(
        event_type=EventType.AUDIT_VERIFY_FAILED, seq__gt=0, created_at__gt=at - window
    ).exists()


def restart_checkpoints(*, reason: str, actor: Actor, at: datetime) -> dict[str, Any]:
    """Start a new checkpoint series: after the database was restored from a backup
    (its newest events are gone, as checkpoints say), every checkpoint is refused until
    someone who knows why says so. The old series is moved aside, not deleted (its
    files are evidence), with the record of the last full verify (verified.json: the
    next verify would hold the restored log against the head it signed), an
    `audit.checkpoints_restarted` event names it and the reason, then the first
    checkpoint of the new series signs the head. Whoever runs it holds AUDIT_HMAC_KEY,
    and with it could sign anything anyway; the event and the kept files are what make
    this visible."""
    if not (reason or "").strip():
        raise ValueError("say why the checkpoint series is restarted (--reason)")
    if not is_text(reason):
        # Checked before the old series is moved aside: the event could not be written
        # (no database stores a lone surrogate), leaving the series archived unrecorded.
        raise ValueError("the reason must be UTF-8 text without NUL characters (--reason)")
    directory = _checkpoint_dir()
    directory.mkdir(parents=True, exist_ok=True)
    # One lock over the move, the event and the new series' first checkpoint: the job
    # in between would find the restart on record and no checkpoint, and cry damage.
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # The pointer first: a page reading it meanwhile lists the directory instead.
        (directory / _POINTER).unlink(missing_ok=True)
        old = [directory / name for name in _listing(_CHECKPOINT)]
        bridges = [directory / name for name in _listing(_BRIDGE)]
        last = _read_checkpoint(old[-1]) if old else None
        stamp = at.strftime("%Y%m%dT%H%M%S%fZ")
        aside = directory / f"archived-{stamp}"
        for n in itertools.count(2):  # two restarts at one instant: two folders
            try:
                aside.mkdir()
                break
            except FileExistsError:
                aside = directory / f"archived-{stamp}-{n}"
        # The event first, the files moved in its transaction, and put back if anything
        # fails before it commits: an event that could not be written (a database still
        # read-only after a restore) left the series archived with no record, and a
        # retry recorded an empty folder instead of the one holding the evidence.
        moved: list[Path] = []
        first: dict[str, Any] = {}
        try:
            with transaction.atomic():
                append(
                    event_type=EventType.AUDIT_CHECKPOINTS_RESTARTED,
                    actor=actor,
                    at=at,
                    reason="checkpoints_restarted",
                    data={
                        "comment": reason,
                        "archived": aside.name,
                        "files": len(old),
                        "bridges": len(bridges),
                        "last_seq": last.get("seq") if last else None,
                        "last_head": last.get("head") if last else None,
                    },
                )
                # The bridges belong to the old series, and so does the record of the
                # last full verify: it signed a head of the log before the restore,
                # and the next verify would hold the restored log against it.
                verified = [directory / _VERIFIED] if (directory / _VERIFIED).exists() else []
                for path in (*old, *bridges, *verified):
                    path.rename(aside / path.name)
                    moved.append(path)
                # The new series' first checkpoint in the same transaction: one that
                # could not be written (a full disk) left the restart on record over
                # an empty directory, which the job then took for one emptied.
                first = _write_locked(directory, at, new_series=True)
        except BaseException:
            if first:  # written, but its events did not commit: it signs nothing
                (directory / first["file"]).unlink(missing_ok=True)
                (directory / _POINTER).unlink(missing_ok=True)
            for path in reversed(moved):
                (aside / path.name).rename(path)
            with contextlib.suppress(OSError):
                aside.rmdir()
            raise
        return first


def _record_gap(previous: dict[str, Any] | None, at: datetime) -> bool:
    """If the previous checkpoint is older than AUDIT_CHECKPOINT_MAX_AGE, the job
    stopped for a while: that window is put on record for good (`audit.checkpoint_gap`,
    which the checkpoint being written then covers). Newest events deleted during it
    would not show, and verify names it every time (Verdict.gaps). True if recorded."""
    max_age = settings.AUDIT_CHECKPOINT_MAX_AGE
    if previous is None or not max_age:
        return False
    since = datetime.fromisoformat(previous["time"])
    if at - since <= max_age:
        return False
    minutes = int((at - since).total_seconds() // 60)
    log.warning("audit checkpoint gap: %s min since %s", minutes, previous["file"])
    if _gap_recorded_after(previous):
        # An earlier attempt recorded this gap, then could not write its checkpoint (a
        # full disk, say): the gap is on record once, and the checkpoint written now
        # signs that event.
        return False
    with transaction.atomic():
        append(
            event_type=EventType.AUDIT_CHECKPOINT_GAP,
            actor=_JOB,
            at=at,
            data={"after": previous["file"], "after_seq": previous["seq"], "minutes": minutes},
        )
    return True


def _gap_recorded_after(previous: dict[str, Any]) -> bool:
    from governance.models import AuditEvent

    mark = canonical_json({"after": previous["file"]})[1:-1]  # `"after":"checkpoint-..."`
    return AuditEvent.objects.filter(
        event_type=EventType.AUDIT_CHECKPOINT_GAP, seq__gt=previous["seq"], data__contains=mark
    ).exists()


_JOB = Actor.system("audit_checkpoint")


_SERIES_EVENTS = (EventType.AUDIT_CHECKPOINTS_STARTED, EventType.AUDIT_CHECKPOINTS_RESTARTED)


def _series_start() -> tuple[int, str | None] | None:
    """The newest event that began a checkpoint series: its seq, and the first
    checkpoint's file name when it adopted a series already in the directory."""
    from governance.models import AuditEvent

    found = AuditEvent.objects.filter(event_type__in=_SERIES_EVENTS, seq__gt=0)
    row = found.order_by("-seq").values_list("seq", "data").first()
    if row is None:
        return None
    return row[0], json.loads(row[1] or "{}").get("adopted")


def _begin_series(restarted: bool, series: tuple[int, str | None] | None, at: datetime) -> bool:
    """The directory holds no checkpoint. The first series of a log's life begins here,
    on record (`audit.checkpoints_started`, signed by the checkpoint being written, and
    committed only with its file: _write_locked; True).
    A restart has put its own event on record (False). Otherwise the log says a series
    began and its checkpoints are gone: the directory was emptied (or the setting points
    elsewhere), and the newest events may have gone with them. Signing a new first
    checkpoint would bless that, so it is refused, as over any damage."""
    if restarted:
        return False
    if series is not None:
        raise ChainBroken((series[0], _NO_SERIES.format(seq=series[0])))
    with transaction.atomic():
        append(event_type=EventType.AUDIT_CHECKPOINTS_STARTED, actor=_JOB, at=at)
    return True


def _adopt_series(first: Path, series: tuple[int, str | None] | None, at: datetime) -> bool:
    """A series already in the directory that the log says nothing about (written
    before series were recorded): adopted, on record, naming its first checkpoint, so
    from now on an emptied directory is a finding here too. True if recorded."""
    if series is not None:
        return False
    with transaction.atomic():
        append(
            event_type=EventType.AUDIT_CHECKPOINTS_STARTED,
            actor=_JOB,
            at=at,
            data={"adopted": first.name},
        )
    return True


_NO_SERIES = (
    "the log says a checkpoint series began at seq {seq}, but AUDIT_CHECKPOINT_DIR holds "
    "no checkpoint: it was emptied or points elsewhere, and the newest events could have "
    "been deleted with its checkpoints"
)


def write_checkpoint(at: datetime) -> dict[str, Any]:
    """Sign the current head to a file outside the database.

    Written even when nothing happened since the last one, so a gap in the
    checkpoint series itself means the job stopped. One writer at a time (an
    exclusive lock on the directory's `.lock` from reading the series to writing
    the file): two at once (the command during the job, or a worker running a
    backlog) would both sign after the same predecessor and fork the series, and
    every later verify would fail. The file is created exclusively, so a writer
    that somehow raced anyway fails instead of forking it. With no checkpoint in the
    directory, only the log's first series begins by itself (_begin_series); any
    other is begun by restart_checkpoints, which records why.
    """
    directory = _checkpoint_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _write_locked(directory, at, new_series=False)


def _write_locked(directory: Path, at: datetime, *, new_series: bool) -> dict[str, Any]:
    """write_checkpoint() with the directory's lock held. The writer lists the names
    (strings, no file read but the first and the last), not the pointer: it must see
    what verify sees, a file put there to sort last included."""
    existing = _listing(_CHECKPOINT)
    previous = _read_checkpoint(directory / existing[-1]) if existing else None
    with transaction.atomic():
        # Read a head no writer is half-way through extending.
        seq, head = _lock_and_read_head()
    series = _series_start()
    if previous is not None:
        # Never sign over damage: if the log no longer holds what the previous
        # checkpoint signed (its newest events deleted and written again, say), a
        # new signature would bless the forged head; nor extend a series the log says
        # is not the current one. Refused; verify reports it.
        problem = (
            _check_checkpoint_chain([previous], continues=True)
            or _series_problem([_read_checkpoint(directory / existing[0])], series)
            or _against_checkpoints([previous], seq)
        )
        if problem:
            log.error("audit checkpoint refused at seq %s: %s", *problem)
            raise ChainBroken(problem)
    # The previous one's number, plus one: compaction leaves fewer files than that.
    number = _INDEX.match(existing[-1]) if existing else None
    index = int(number.group(1)) + 1 if number else len(existing) + 1
    path = directory / f"checkpoint-{index:09d}-{at.strftime('%Y%m%dT%H%M%S%fZ')}.json"
    # Only a checkpoint that will be written says there was a gap (a refused one,
    # every minute while damage stays, would repeat it), and it signs that event.
    recorded = _record_gap(previous, at)
    body: dict[str, Any] = {}
    try:
        # A series' start commits only once its first checkpoint is written. On record
        # with no checkpoint of it, it is at every later run a directory emptied to
        # hide deleted events (verify fails, the job refuses and alerts, until an admin
        # restarts the series): a first checkpoint that could not be written (a full
        # disk) must leave no start behind, and the next run begins the series afresh.
        # This does not excuse an emptied directory: a start that committed had its
        # checkpoint written, so one found missing was removed. (On PostgreSQL the
        # chain lock is held over that one small file write, once in a log's life.)
        # The minute's plain checkpoint records nothing here and opens no transaction.
        records = previous is None or series is None  # a start, or an adoption
        with transaction.atomic() if records else contextlib.nullcontext():
            if previous is None:
                recorded = _begin_series(new_series, series, at) or recorded
            else:
                recorded = _adopt_series(directory / existing[0], series, at) or recorded
            if recorded:
                with transaction.atomic():
                    seq, head = _lock_and_read_head()
            body.update(
                seq=seq,
                head=head,
                count=seq,
                time=_iso(at),
                prev_signature=previous["signature"] if previous else "",
            )
            body["signature"] = _sign_checkpoint(body)
            _create(path, body)
            body["file"] = path.name
    except BaseException:
        # Not committed (or not known to be): no file may sign events the log does
        # not hold, which would read as the newest events deleted.
        if "file" in body:
            path.unlink(missing_ok=True)
        raise
    # Then the pointer: a crash in between leaves it a minute behind, never ahead.
    pointer = _pointer()
    recent = [previous["file"]] if previous else []
    if pointer and recent and pointer.recent[-1] == recent[0]:
        recent = pointer.recent  # the names before it still lead up to it
    _point_at(directory, existing[0] if existing else path.name, [*recent, path.name])
    return body


def _create(path: Path, body: Mapping[str, Any]) -> None:
    """Write a file whole, under a name nobody has yet (FileExistsError otherwise)."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        # A full disk fails the write with the file half made: it goes too.
        tmp.write_text(canonical_json(body))
        os.link(tmp, path)  # atomic and exclusive: never half a file, never two Ns
    finally:
        tmp.unlink(missing_ok=True)


# --- Compaction ----------------------------------------------------------------------


def compact_checkpoints(*, at: datetime, actor: Actor) -> dict[str, Any]:
    """Delete the checkpoints nobody needs one by one any more, so the series stops
    growing by 525,600 files a year: every checkpoint of the last
    AUDIT_CHECKPOINT_KEEP_DAYS stays, and of older ones only the last of each UTC day,
    the series' first, both sides of every gap, and any the log names (a printable
    report's checkpoint). Each stretch deleted between two kept checkpoints is replaced
    by a signed bridge joining them, so verify still follows one chain from the first
    checkpoint to the newest and holds every kept one against the log.

    Nothing is deleted unless the whole series verifies first (readable, signed,
    linked, the log's current one, every checkpoint held against the log): damage is
    never compacted away, it is refused (ChainBroken) and left for verify to report.
    The nightly job runs this after its full verify passed, so every checkpoint has
    been held against a full walk before it goes. What is given up, stated: the
    minute-by-minute heads older than the window. Tampering with older history is
    still caught: an edit, deletion, insertion or reordering breaks the HMAC chain
    whatever the checkpoints; deleting the newest events and writing the log again is
    caught by the newest checkpoint (every later hash differs), and the writer never
    signs over that. Only a forgery that some writer had signed over (a writer without
    that check, or someone holding AUDIT_HMAC_KEY, who could forge checkpoints anyway)
    and that began and ended between two kept daily checkpoints outside the window
    would no longer show. Recorded as `audit.checkpoints_compacted` (and logged) before
    any file goes. AUDIT_CHECKPOINT_KEEP_DAYS 0: nothing is ever deleted."""
    window = timedelta(days=settings.AUDIT_CHECKPOINT_KEEP_DAYS)
    directory = _checkpoint_dir()
    if not window or not directory.is_dir():
        return {"deleted": 0, "bridges": []}
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _compact_locked(directory, at, actor, window)


def _compact_locked(
    directory: Path, at: datetime, actor: Actor, window: timedelta
) -> dict[str, Any]:
    checkpoints = _load_all()
    bridges, bad_bridge = _load_bridges()
    series = _follow(checkpoints, bridges)
    problem = (
        bad_bridge
        or series.problem
        or _series_problem(series.kept, _series_start())
        or _against_checkpoints(series.kept, head_seq())
    )
    if problem:
        log.error("audit checkpoint compaction refused at seq %s: %s", *problem)
        raise ChainBroken(problem)
    kept = series.kept
    if not kept:
        return {"deleted": 0, "bridges": []}
    # The window ends at the newest checkpoint's time, not only at `at`: a clock (or
    # an argument) far ahead never makes the newest checkpoints old.
    cutoff = min(at, _written(kept[-1])) - window
    keep = _always_kept(kept, series.bridged)
    doomed = [cp for cp in kept if cp["file"] not in keep and _written(cp) < cutoff]
    named = _named_in_log(min((cp["seq"] for cp in doomed), default=0)) if doomed else set()
    doomed = [cp for cp in doomed if cp["file"] not in named]
    if not doomed and not series.leftovers:
        return {"deleted": 0, "bridges": []}
    gone = {cp["file"] for cp in doomed}
    old_bridges = [b for found in bridges.values() for b in found]
    superseded = [b for b in old_bridges if b["from_file"] in gone or b["to_file"] in gone]
    # Oldest first, with what a stopped compaction left: at every moment the files
    # deleted so far precede those left in each stretch, so its bridge (written first)
    # joins what remains and verify never sees a half-compacted series as a broken one.
    files = sorted(gone.union(series.leftovers))
    protected = keep | named | {cp["file"] for cp in kept if _written(cp) >= cutoff}
    _refuse_to_delete(files, protected)
    made = [_bridge(run, at, superseded) for run in _runs(kept, gone)]
    names = [b["file"] for b in made]
    with transaction.atomic():
        append(
            event_type=EventType.AUDIT_CHECKPOINTS_COMPACTED,
            actor=actor,
            at=at,
            data={
                "deleted": len(files),
                "first": files[0],
                "last": files[-1],
                "bridges": names,
                "kept_days": window.days,
            },
        )
    log.info(
        "audit checkpoints compacted: %s file(s) deleted, %s to %s; bridges %s",
        len(files), files[0], files[-1], ", ".join(names) or "none",
    )  # fmt: skip
    _delete_compacted(directory, files, [b["file"] for b in superseded], protected=protected)
    return {"deleted": len(files), "bridges": names}


def _always_kept(kept: list[dict[str, Any]], bridged: frozenset[str]) -> set[str]:
    """Whatever the window: the series' first (the log names it as the series' start)
    and newest, the last of each UTC day, both sides of every gap (so verify still
    names it), and whatever the pointer names (the pages' view)."""
    keep = {kept[0]["file"], kept[-1]["file"]}
    days: dict[Any, str] = {}
    for cp in kept:
        days[_written(cp).astimezone(UTC).date()] = cp["file"]  # the last one wins
    keep.update(days.values())
    max_age = settings.AUDIT_CHECKPOINT_MAX_AGE
    for before, after in itertools.pairwise(kept):
        apart = _written(after) - _written(before)
        if max_age and after["file"] not in bridged and apart > max_age:
            keep.update((before["file"], after["file"]))
    pointer = _pointer()
    if pointer is not None:
        keep.update((pointer.first, *pointer.recent))
    return keep


def _named_in_log(after_seq: int) -> set[str]:
    """Checkpoint files the log names after `after_seq`: the one each printable report
    says it was produced against, and the one before each recorded gap. An auditor who
    follows the name finds the file."""
    from governance.models import AuditEvent

    found = AuditEvent.objects.filter(
        event_type__in=(EventType.REPORT_EXPORTED, EventType.AUDIT_CHECKPOINT_GAP),
        seq__gt=after_seq,
        data__contains='"checkpoint-',
    ).values_list("data", flat=True)
    names: set[str] = set()
    for data in found.iterator():
        try:
            body = json.loads(data or "{}")
        except ValueError:
            continue
        for key in ("checkpoint", "after"):
            if isinstance(body, dict) and isinstance(body.get(key), str):
                names.add(body[key])
    return names


def _runs(
    kept: list[dict[str, Any]], gone: set[str]
) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]]:
    """Each stretch of consecutive checkpoints to delete, with the kept one before it
    and the kept one after (the first and the newest are kept, so both exist)."""
    run: list[dict[str, Any]] = []
    before = kept[0]
    for cp in kept[1:]:
        if cp["file"] in gone:
            run.append(cp)
            continue
        if run:
            yield before, run, cp
        before, run = cp, []


def _bridge(
    run: tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]],
    at: datetime,
    superseded: list[dict[str, Any]],
) -> dict[str, Any]:
    """The signed bridge from the checkpoint before `run` to the one after it. Written
    before anything is deleted; one already there for the same pair (a compaction that
    stopped part-way) is kept as it is."""
    before, deleted, after = run
    inside = {before["file"], *(cp["file"] for cp in deleted), after["file"]}
    replaced = sum(b["files"] for b in superseded if b["from_file"] in inside)
    body: dict[str, Any] = {
        "from_file": before["file"],
        "from_seq": before["seq"],
        "from_signature": before["signature"],
        "to_file": after["file"],
        "to_seq": after["seq"],
        "to_prev_signature": after["prev_signature"],
        "files": len(deleted) + replaced,
        "time": _iso(at),
    }
    body["signature"] = _sign_bridge(body)
    path = _checkpoint_dir() / f"{_BRIDGE}{_index(before)}-{_index(after)}.json"
    try:
        _create(path, body)
    except FileExistsError:
        there = _read_checkpoint(path, _BRIDGE_FIELDS)
        if (
            "unreadable" in there
            or not _same(_sign_bridge(there), there["signature"])
            or any(there[k] != body[k] for k in ("from_signature", "to_file", "to_prev_signature"))
        ):
            raise  # not this bridge: verify names it; nothing is deleted
        return there
    body["file"] = path.name
    return body


def _index(checkpoint: Mapping[str, Any]) -> str:
    number = _INDEX.match(checkpoint["file"])
    return number.group(1) if number else checkpoint["file"].removesuffix(".json")


def _refuse_to_delete(checkpoints: list[str], protected: set[str]) -> None:
    """Raise, before anything is deleted, if `checkpoints` names one that must never
    go, whatever was planned: the directory's first or newest, one written within
    AUDIT_CHECKPOINT_KEEP_DAYS of the newest (each is read again to see), one that
    cannot be read, any the caller protects (the pointer's, the log's), or a name
    that is not a checkpoint's."""
    directory = _checkpoint_dir()
    listed = _listing(_CHECKPOINT)
    newest = _read_checkpoint(directory / listed[-1]) if listed else None
    never = protected | {listed[0], listed[-1]} if listed else protected
    wrong = []
    for name in checkpoints:
        body = _read_checkpoint(directory / name) if _is_checkpoint_name(name) else None
        if (
            name in never
            or body is None
            or newest is None
            or "unreadable" in body
            or "unreadable" in newest
            or not settings.AUDIT_CHECKPOINT_KEEP_DAYS
            or _written(newest) - _written(body)
            <= timedelta(days=settings.AUDIT_CHECKPOINT_KEEP_DAYS)
        ):
            wrong.append(name)
    if wrong:
        raise RuntimeError(f"checkpoint compaction refused to delete {', '.join(wrong)}")


def _delete_compacted(
    directory: Path, checkpoints: list[str], bridges: list[str], *, protected: set[str]
) -> None:
    """The only code that deletes checkpoint files, in the order given, then the
    bridges the new ones replace. It checks again what it was told to delete
    (_refuse_to_delete), whatever its caller planned."""
    _refuse_to_delete(checkpoints, protected)
    if any(not name.startswith(_BRIDGE) or "/" in name for name in bridges):
        raise RuntimeError(f"checkpoint compaction refused to delete {', '.join(bridges)}")
    for name in (*checkpoints, *bridges):
        (directory / name).unlink(missing_ok=True)
