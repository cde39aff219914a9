"""The race-safe job pattern, once: claim a row with a conditional UPDATE, act
only on the rows you won (healthchecks' sendalerts). Two workers running the
same job at once each announce a transition exactly once."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from django.db import IntegrityError, transaction

Row = TypeVar("Row")


def claim_each(
    rows: Iterable[Row], claim: Callable[[Row], int], announce: Callable[[Row], None]
) -> int:
    """For each candidate: in one transaction, `claim` (a conditional UPDATE
    returning its row count) and, if it won, `announce` (the audit event).
    Returns how many were won."""
    won = 0
    for row in list(rows):
        with transaction.atomic():
            if claim(row):
                announce(row)
                won += 1
    return won


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
