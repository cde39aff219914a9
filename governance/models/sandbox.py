from __future__ import annotations

from django.db import models
from django.db.models import Q

from governance.models.grants import Grant


class SandboxRun(models.Model):
    """One execution by the sandbox runner, from request to exit. Never reused.

    Agent, task and tool are kept as the names that were asked for (like the
    audit log), so a run refused as `unknown_agent` is still on record. The
    status moves forward only: requested -> denied | running -> finished |
    reaped | failed, each transition claimed by a conditional UPDATE so the
    runner and the reaper can never both finish the same run.
    """

    class Status(models.TextChoices):
        REQUESTED = "requested"
        DENIED = "denied"
        RUNNING = "running"
        FINISHED = "finished"
        # The reaper killed it (past its deadline, or its agent was suspended).
        REAPED = "reaped"
        # Authorized, but the backend could not start or run it.
        FAILED = "failed"

    run_id = models.UUIDField(unique=True)
    agent = models.CharField(max_length=100)
    task = models.CharField(max_length=100, blank=True)
    tool = models.CharField(max_length=100)
    grant = models.ForeignKey(
        Grant, null=True, blank=True, on_delete=models.PROTECT, related_name="sandbox_runs"
    )
    decision = models.CharField(max_length=20, blank=True)
    reason = models.CharField(max_length=40, blank=True)
    message = models.TextField(blank=True)
    decision_id = models.CharField(max_length=36, blank=True)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.REQUESTED)

    backend = models.CharField(max_length=20)
    image = models.CharField(max_length=300)
    # The image id the decision bound (RunSpec.image_id; empty: nothing to bind), and
    # the one the backend reported starting: a start with any other is refused.
    image_id = models.CharField(max_length=71, blank=True, default="")
    image_digest = models.CharField(max_length=100, blank=True)
    container_id = models.CharField(max_length=100, blank=True)
    command = models.JSONField(default=list)
    script_sha256 = models.CharField(max_length=64, blank=True)
    input_sha256 = models.CharField(max_length=64, blank=True)
    # What was asked for, and what the run got (the grant is the ceiling).
    requested_limits = models.JSONField(default=dict)
    limits = models.JSONField(default=dict, blank=True)
    # How each limit was enforced: docker | cgroup | rlimit | runner (the wall clock).
    enforcement = models.JSONField(default=dict, blank=True)
    egress = models.JSONField(default=list, blank=True)

    requested_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    deadline_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    timed_out = models.BooleanField(default=False)
    oom_killed = models.BooleanField(default=False)
    stdout_excerpt = models.TextField(blank=True)
    stdout_sha256 = models.CharField(max_length=64, blank=True)
    stdout_bytes = models.PositiveBigIntegerField(default=0)
    stderr_excerpt = models.TextField(blank=True)
    stderr_sha256 = models.CharField(max_length=64, blank=True)
    stderr_bytes = models.PositiveBigIntegerField(default=0)
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [
            # The reaper's question: which runs are still running?
            models.Index(
                fields=["deadline_at"], name="sandbox_run_running", condition=Q(status="running")
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=~Q(status="running") | Q(started_at__isnull=False),
                name="sandbox_run_running_has_start",
            ),
        ]

    def __str__(self) -> str:
        return f"run {self.run_id} ({self.status})"

    @property
    def outputs(self) -> list[tuple[str, str, str, int]]:
        """(name, masked excerpt, sha256 of the whole stream, its size) per stream."""
        return [
            ("stdout", self.stdout_excerpt, self.stdout_sha256, self.stdout_bytes),
            ("stderr", self.stderr_excerpt, self.stderr_sha256, self.stderr_bytes),
        ]
