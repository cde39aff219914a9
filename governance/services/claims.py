"""The race-safe job pattern, once: claim a row with a conditional UPDATE, act
only on the rows you won (healthchecks' sendalerts). Two workers running the
same job at once each announce a transition exactly once."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from django.db import IntegrityError, transaction

log = logging.getLogger(__name__)

Row = TypeVar("Row")


class PartlyFailed(Exception):
    """Some rows or parts of a job failed and the rest were done: raised at the end, so
    the run shows as failed without one bad row stopping the work on every other."""


def claim_each(
    rows: Iterable[Row], claim: Callable[[Row], int], announce: Callable[[Row], None]
) -> int:
    """For each candidate: in one transaction, `claim` (a conditional UPDATE
    returning its row count) and, if it won, `announce` (the audit event).
    Returns how many were won. A row that fails is rolled back and logged and the
    others go on; then PartlyFailed says how many failed."""
    won = 0
    failed: list[Exception] = []
    for row in list(rows):
        try:
            with transaction.atomic():
                if claim(row):
                    announce(row)
                    won += 1
        except Exception as exc:
            log.exception("a job's row failed and was rolled back; the others go on")
            failed.append(exc)
    if failed:
        raise PartlyFailed(f"{len(failed)} row(s) failed, {won} done: {failed[0]!r}") from failed[0]
    return won


def run_parts(job: str, parts: dict[str, Callable[[], int]]) -> dict[str, int]:
    """Run each part of a job even if one before it failed (each is its own bookkeeping);
    then PartlyFailed names the parts that failed. How many each did, by name."""
    done: dict[str, int] = {}
    failed: dict[str, Exception] = {}
    for name, part in parts.items():
        try:
            done[name] = part()
        except Exception as exc:
            log.exception("%s: part %s failed; the other parts go on", job, name)
            failed[name] = exc
    if failed:
        first = next(iter(failed.values()))
        raise PartlyFailed(f"{job}: {', '.join(failed)} failed ({first!r}); done {done}") from first
    return done


def locked_mark(model: Any) -> Any:
    """A job's watermark: the one row (pk 1) of `model`, created if missing, locked
    until the caller's transaction ends, so two workers running the job take turns
    over it. Call inside transaction.atomic()."""
    try:
        with transaction.atomic():  # a savepoint: losing the race to create it is fine
            model.objects.get_or_create(pk=1)
    except IntegrityError:
        pass  # another worker created it first
    return model.objects.select_for_update().get(pk=1)
