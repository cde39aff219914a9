"""Models split by aggregate; import them from here."""

from governance.models.agents import Agent, AgentToken
from governance.models.approvals import Approval, ConfirmationPolicy
from governance.models.audit import AuditEvent
from governance.models.breakglass import BreakGlass
from governance.models.grants import Grant, GrantActionUse, UsageFold
from governance.models.notifications import Notification
from governance.models.outcomes import DecisionOutcome
from governance.models.reviews import (
    LiveGrantSnapshot,
    ReviewCampaign,
    ReviewItem,
    SecondLook,
    SecondLookMark,
)
from governance.models.sandbox import SandboxRun
from governance.models.tasks import Task
from governance.models.tools import Tool

__all__ = [
    "Agent",
    "AgentToken",
    "Approval",
    "ConfirmationPolicy",
    "AuditEvent",
    "DecisionOutcome",
    "Grant",
    "GrantActionUse",
    "SandboxRun",
    "Task",
    "Tool",
    "UsageFold",
    "BreakGlass",
    "Notification",
    "LiveGrantSnapshot",
    "ReviewCampaign",
    "ReviewItem",
    "SecondLook",
    "SecondLookMark",
]
