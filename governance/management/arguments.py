"""Argument types for the management commands: bad input is a CommandError naming the
argument, never a traceback from deep inside a query.

A command line that is not UTF-8 (a Latin-1 terminal, a file name in another encoding)
reaches Python as lone surrogates (`\\udcff`), which no database driver can encode;
call_command() can pass a NUL, which PostgreSQL refuses in text. Given as `type=` to
add_argument(), these run while the arguments are parsed, before anything is read or
written: argparse reports "argument --agent: ..." (a CommandError from call_command(),
the usage and exit status 2 on a command line)."""

from __future__ import annotations

from argparse import ArgumentTypeError
from collections.abc import Callable
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from governance.text import is_line, is_utf8


def text(value: str) -> str:
    """Text that is stored or looked up (a name, a prefix, a reason): UTF-8, no NUL,
    not empty. An empty value is refused rather than read as "not given": `--agent ""`
    from an unset shell variable must not widen a campaign to every agent."""
    if not is_utf8(value):
        raise ArgumentTypeError(
            "is not valid UTF-8 text (the terminal or the shell passed another encoding)"
        )
    if "\x00" in value:
        raise ArgumentTypeError("holds a NUL character")
    if not value:
        raise ArgumentTypeError("is empty: give a value, or leave the argument out")
    return value


def line(value: str) -> str:
    """Text on one line, with no control characters (a key, an address)."""
    value = text(value)
    if not is_line(value):
        raise ArgumentTypeError("holds a line break or another control character")
    return value


def path(value: str) -> str:
    """A file name: any bytes the system allows (a name that is not UTF-8 arrives as
    surrogates, which open() turns back into those bytes), but no NUL and not empty."""
    if "\x00" in value:
        raise ArgumentTypeError("holds a NUL character, which no file name can")
    if not value:
        raise ArgumentTypeError("is empty: name a file")
    return value


def person(name: str, may: Callable[[Any], bool], what: str, option: str = "--as") -> Any:
    """The active account `--as NAME` (or `option`) names, if it holds the role (`may`);
    else a CommandError saying what it must be."""
    user = get_user_model().objects.filter(username=name, is_active=True).first()
    if user is None or not may(user):
        raise CommandError(f"{option}: {name!r} is not an active {what}")
    return user
