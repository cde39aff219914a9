from __future__ import annotations

from django.db import models

from governance.models.agents import Agent


class DecisionOutcome(models.Model):
    """What happened after a decision, reported once by the agent that got it.

    The unique decision_id is what makes "once" hold under concurrency; the
    report itself is also an audit event (access.outcome).
    """

    class Outcome(models.TextChoices):
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        ABORTED = "aborted"

    decision_id = models.UUIDField(unique=True)
    agent = models.ForeignKey(Agent, on_delete=models.PROTECT, related_name="+")
    outcome = models.CharField(max_length=10, choices=Outcome.choices)
    result_digest = models.CharField(max_length=128, blank=True)
    reported_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.decision_id}: {self.outcome}"
