"""Re-certification: campaigns, items, decisions, the due-date rule and reminders.

Signatures (all keyword-only; `actor` is who the audit log names, `at` is now):

    review_campaign_open(*, kind, reason, actor, at, key=None, agent=None,
                         opened_by=None, due_at=None) -> ReviewCampaign
        kind: "scheduled" | "on_demand" | "incident". One item per live grant, delegated
        and break-glass grants included (a subagent's grant is certified on its own:
        keeping the parent does not keep what was handed down; a live break-glass
        grant is reviewed here as well as by its own post-incident review). Unused
        grants carry a proposal ("remove" / "narrow_to_read" / "narrow_to_used") and
        the actions found idle (selectors.unused_grants).
        With a `key`, opening again returns the same campaign. Items whose grant ends
        before anyone decides are closed as `ended` by the job, with no reminder or
        overdue notice: nothing is left to review, so nobody is nagged about it.
    review_campaign_open_scheduled(*, actor, at) -> ReviewCampaign   (the job; one per
        period of REVIEW_EVERY_MONTHS, key "scheduled:<year>-P<n>")
    review_item_decide(*, item_id, reviewer, decision, comment, actor, at,
                       actions=None, scope=None, expires_at=None,
                       delegable=None) -> ReviewItem
        decision: "keep" | "narrow" (any of actions/scope/expires_at, delegable False:
        never wider; switching delegation off revokes the grant's live delegations) |
        "revoke"; effective at once. Raises GovernanceError `comment_required` /
        `invalid_decision`, Forbidden `self_review` (the grant's approver or requester,
        or, for a delegated grant, anyone who requested or approved a grant up its
        chain, or anyone with a stake in the agent: approvals.stakeholders) /
        `not_assigned` (neither the assigned reviewer nor an admin), Conflict
        `already_decided` (a second decision changes nothing), Conflict `past_due` (at
        or after the item's due date the reviewer's decision is refused and
        REVIEW_DEFAULT_RULE is applied to the item at once, exactly as the job would:
        a late "keep" can never override the revoke rule, and the outcome does not
        depend on when the job last ran), Conflict `grant_not_live` (the grant has
        ended (revoked, expired): the item is closed as `ended` at once, as the job
        would, instead of recording a decision about nothing).
    review_items_apply_due_rule(*, actor, at) -> int     (the job: items whose grant
        ended are closed `ended`; items undecided at the due date get REVIEW_DEFAULT_RULE)
    review_campaigns_close(*, actor, at) -> int          (the job)
    review_reminders_send(*, actor, at) -> int           (the job)

Reviewers rotate among approvers (groups approvers/admins, superusers; governance.roles)
in username order, skipping whoever is barred from the grant (its approver and
requester, and up a delegated grant's chain every ancestor's; the owners of the agent
and the agents above it; whoever held a live token for them when the grant was
created); an item nobody may
review is left unassigned (admins decide it) and still falls under the due-date rule.
Selectors: review_items_for(user, at), unused_grants(at) in governance/selectors.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction

from governance import audit, notifications, roles
from governance.codes import EventType
from governance.errors import Conflict, Forbidden, GovernanceError
from governance.models import Agent, Grant, ReviewCampaign, ReviewItem
from governance.models.reviews import undecided_at_due_q
from governance.policy import PastState, grant_dead_reason
from governance.selectors import agent_tree, approver_users, grants_in_force, unused_grants
from governance.services.approvals import Call, staked, stakeholders
from governance.services.claims import claim_each
from governance.services.grants import grant_event, grant_narrow, grant_revoke, lock_chain
from governance.services.usage import usage_fold

DECISIONS = ("keep", "narrow", "revoke")


def _grant_event(
    grant: Grant, event_type: str, actor: audit.Actor, at: datetime, **data: Any
) -> None:
    grant_event(grant, event_type, actor=actor, at=at, data=data)


def _behind(grant: Grant) -> set[int]:
    """Whoever requested or approved the grant and, up a delegated grant's chain, each
    ancestor's requester and approver (a delegated grant has no human of its own: the
    people behind its parent stand behind it)."""
    return {pk for g in grant.chain() for pk in (g.requested_by_id, g.approved_by_id)} - {None}


def _barred(grant: Grant) -> set[int]:
    """Who may not re-certify this grant: the people behind it (_behind) and everyone
    with a stake in the agent (approvals.stakeholders as of the grant's creation: the
    owners up the agent tree, whoever held a live token for it)."""
    return _behind(grant) | stakeholders(grant.agent, grant, at=grant.created_at)


def _barred_among(grants: Sequence[Grant], pool: Sequence[Any]) -> dict[int, set[int]]:
    """_barred(grant) for each of a campaign's grants, as far as the people of `pool`
    go (the only ones a reviewer is drawn from), read for all of them at once: the
    stake rule through approvals.staked, a few queries per person. Asked grant by grant
    it was two queries per grant (2,000 grants: 4,000 queries, 20 s)."""
    barred = {grant.pk: _behind(grant) for grant in grants}
    calls = [Call(g.pk, g.agent_id, g.pk, g.created_at) for g in grants]
    agents: dict[int, Any] = {}
    chains: dict[int, Any] = {}
    for person in pool:
        for pk in staked(person.pk, calls, agents, chains):
            barred[pk].add(person.pk)
    return barred


def _rotation(campaign_pk: int, barred_from: dict[int, set[int]], pool: list[Any]) -> Any:
    """A reviewer picker that walks the approver pool round-robin, skipping people
    barred from the grant (`barred_from`: _barred_among's, for the pool)."""
    state = {"next": campaign_pk % len(pool) if pool else 0}

    def pick(grant: Grant) -> Any:
        barred = barred_from[grant.pk]
        for step in range(len(pool)):
            candidate = pool[(state["next"] + step) % len(pool)]
            if candidate.pk not in barred:
                state["next"] = (state["next"] + step + 1) % len(pool)
                return candidate
        return None

    return pick


RESERVED_KEYS = ("scheduled:", "incident:")


def review_campaign_open(
    *,
    kind: str,
    reason: str,
    actor: audit.Actor,
    at: datetime,
    key: str | None = None,
    agent: Agent | None = None,
    opened_by: Any = None,
    due_at: datetime | None = None,
) -> ReviewCampaign:
    """Open a campaign (see the module docstring)."""
    if kind not in ReviewCampaign.Kind.values:
        raise GovernanceError("invalid_kind", f"Kind must be one of {ReviewCampaign.Kind.values}.")
    if not (reason or "").strip():
        raise GovernanceError("reason_required", "Say why the campaign is opened.")
    due_at = due_at or at + settings.REVIEW_DUE
    if due_at <= at:
        raise GovernanceError("invalid_due", "The due date must be in the future.")
    if kind == ReviewCampaign.Kind.ON_DEMAND and (key or "").startswith(RESERVED_KEYS):
        # The scheduled job's and break-glass's own keys: a campaign opened by hand
        # under one would stand in for (or block) the period's or the incident's.
        raise GovernanceError(
            "reserved_key", f"Keys starting {' or '.join(RESERVED_KEYS)} are the system's."
        )
    if key is not None and (existing := ReviewCampaign.objects.filter(key=key).first()):
        return _same(existing, kind, agent)
    try:
        with transaction.atomic():
            if key is None and (repeat := _repeat(kind, reason, agent, opened_by, at)):
                return repeat
            campaign = ReviewCampaign.objects.create(
                key=key,
                kind=kind,
                reason=reason,
                agent=agent,
                opened_by=opened_by,
                opened_at=at,
                due_at=due_at,
            )
            items, barred_from = _create_items(campaign, at)
            # Before the event: its append takes the chain lock every decision waits for.
            _notify_assigned(campaign, items, at, barred_from)
            audit.append(
                event_type=EventType.REVIEW_CAMPAIGN_OPENED,
                actor=actor,
                at=at,
                agent=agent.name if agent else "",
                data={
                    "campaign_id": campaign.pk,
                    "kind": kind,
                    "key": key,
                    "reason": reason,
                    "due_at": due_at.isoformat(),
                    "items": [
                        {
                            "grant": i.grant_id,
                            "reviewer": i.reviewer.get_username() if i.reviewer else None,
                            "proposal": i.proposal,
                            "idle_actions": i.idle_actions,
                        }
                        for i in items
                    ],
                },
            )
    except IntegrityError:
        # Another worker opened the same keyed campaign first: that one stands.
        if key is None:
            raise
        return _same(ReviewCampaign.objects.get(key=key), kind, agent)
    return campaign


def _repeat(
    kind: str, reason: str, agent: Agent | None, opened_by: Any, at: datetime
) -> ReviewCampaign | None:
    """The same unkeyed campaign asked for again while it is open (a double click): that
    one. A second copy put every grant under review twice, and a grant its reviewer kept
    in one was revoked at the due date for the other's silence. The opener's row, held
    to the commit, makes two asked at once see each other."""
    if opened_by is None:
        return None
    get_user_model().objects.select_for_update(no_key=True).filter(pk=opened_by.pk).first()
    return (
        ReviewCampaign.objects.filter(
            key=None,
            kind=kind,
            reason=reason,
            agent=agent,
            opened_by=opened_by,
            items__status=ReviewItem.Status.PENDING,
        )
        .exclude(due_at__lte=at)
        .distinct()
        .first()
    )


def _same(existing: ReviewCampaign, kind: str, agent: Agent | None) -> ReviewCampaign:
    """The campaign already opened under a key, if it is the one asked for: a key names
    one campaign, and another kind or agent must not stand in for it (a one-agent
    campaign keyed like the quarter's would skip everyone else)."""
    if (existing.kind, existing.agent_id) != (kind, agent.pk if agent else None):
        raise Conflict(
            "campaign_key_taken",
            f"Campaign #{existing.pk} ({existing.kind}) already has the key {existing.key!r}.",
        )
    return existing


def _create_items(
    campaign: ReviewCampaign, at: datetime
) -> tuple[list[ReviewItem], dict[int, set[int]]]:
    """The items, and who of the approver pool is barred from each item's grant."""
    # In force: not one whose review in another campaign fell due undecided (revoked
    # from then on, whether or not the job has run) nor one whose task is over.
    grants = grants_in_force(at)
    if campaign.agent_id is not None:
        # The agent and its subagents: what it handed down is its access too (keeping
        # the parent grant does not keep what was delegated from it).
        tree = agent_tree(Agent.objects.all(), campaign.agent_id)
        grants = grants.filter(agent_id__in=[a.pk for a in tree])
    usage_fold(at=at)  # usage as of now, not as of the last scheduled fold
    unused = {g.pk: g for g in unused_grants(at)}
    listed = list(grants.order_by("id"))
    pool = approver_users()
    barred_from = _barred_among(listed, pool)
    pick = _rotation(campaign.pk, barred_from, pool)
    items = [
        ReviewItem(
            campaign=campaign,
            grant=grant,
            reviewer=pick(grant),
            proposal=getattr(unused.get(grant.pk), "proposal", ""),
            idle_actions=getattr(unused.get(grant.pk), "idle_actions", []),
            due_at=campaign.due_at,
        )
        for grant in listed
    ]
    ReviewItem.objects.bulk_create(items)
    return items, barred_from


def _notify_assigned(
    campaign: ReviewCampaign,
    items: Sequence[ReviewItem],
    at: datetime,
    barred_from: dict[int, set[int]],
) -> None:
    """Each person told once, with their items: an item's reviewer, or for an item left
    unassigned (every approver barred) the admins who decide it instead (_reviewers,
    with the bars the campaign read for all its items at once)."""
    by_reviewer: dict[int, list[ReviewItem]] = {}
    people: dict[int, Any] = {}
    for item in items:
        for person in _reviewers(item, barred_from[item.grant_id]):
            people[person.pk] = person
            by_reviewer.setdefault(person.pk, []).append(item)
    for pk, mine in by_reviewer.items():
        reviewer = people[pk]
        notifications.review_due(
            users=[reviewer],
            subject=f"{len(mine)} grant(s) to review by {campaign.due_at.date().isoformat()}",
            body=(
                f"Review campaign #{campaign.pk} ({campaign.kind}: {campaign.reason}). "
                f"Keep, narrow or revoke each grant, with a comment, by "
                f"{campaign.due_at.isoformat()}; undecided items are handled by the rule "
                f"'{settings.REVIEW_DEFAULT_RULE}'."
            ),
            data={"campaign_id": campaign.pk, "items": [i.pk for i in mine]},
            at=at,
        )


def review_campaign_open_scheduled(*, actor: audit.Actor, at: datetime) -> ReviewCampaign:
    """The job (daily): the period's campaign, opened by the first run in the period."""
    period = (at.month - 1) // settings.REVIEW_EVERY_MONTHS + 1
    return review_campaign_open(
        kind=ReviewCampaign.Kind.SCHEDULED,
        reason=f"scheduled re-certification {at.year} period {period}",
        key=f"scheduled:{at.year}-P{period}",
        actor=actor,
        at=at,
    )


def review_item_decide(
    *,
    item_id: int,
    reviewer: Any,
    decision: str,
    comment: str,
    actor: audit.Actor,
    at: datetime,
    actions: Sequence[str] | None = None,
    scope: str | None = None,
    expires_at: datetime | None = None,
    delegable: bool | None = None,
) -> ReviewItem:
    """Keep, narrow or revoke one item's grant, with a comment, effective at once."""
    if decision not in DECISIONS:
        raise GovernanceError("invalid_decision", f"Decision must be one of {DECISIONS}.")
    if not (comment or "").strip():
        raise GovernanceError("comment_required", "A review decision needs a comment.")
    shape = (actions, scope, expires_at, delegable)
    narrowing = any(value is not None for value in shape)
    if decision == "narrow" and not narrowing:
        raise GovernanceError(
            "invalid_decision",
            "Narrowing names fewer actions, a narrower scope, an expiry or delegable false.",
        )
    if decision != "narrow" and narrowing:
        # Refused, not ignored: the reviewer meant something the decision would not do.
        raise GovernanceError(
            "invalid_decision",
            f"Only a narrow decision takes actions, scope, expires_at or delegable; "
            f"{decision} ignores them.",
        )
    with transaction.atomic():
        item = (
            ReviewItem.objects.select_for_update(of=("self",), no_key=True)
            .select_related("grant__agent", "grant__tool", "grant__task", "campaign")
            .get(pk=item_id)
        )
        if item.status != ReviewItem.Status.PENDING:
            raise Conflict("already_decided", f"The item is already {item.status}.")
        # The grant as a revoke or narrowing committing meanwhile left it (waited for
        # under the locks they take, ancestors first): a decision on a grant someone else
        # just ended is not recorded as the reviewer's revoke (nor refused as not live,
        # leaving the item pending), the item is closed as ended.
        grant = item.grant = lock_chain(item.grant_id)
        if reviewer.pk in _barred(grant):
            raise Forbidden(
                "self_review",
                "Nobody re-certifies a grant they requested or approved, or one handed "
                "down from such a grant.",
            )
        if not (item.reviewer_id == reviewer.pk or roles.is_admin(reviewer)):
            raise Forbidden("not_assigned", "The item is assigned to another reviewer.")
        # The assigned reviewer deactivated or no longer an approver since the campaign
        # opened: a keep would re-certify access on no one's authority.
        roles.require_may_approve(reviewer, "Review items")
        late = at >= item.due_at
        # Ended as the job reads it (the row: revoked, denied, expired, or past its
        # expiry before the job ran). A suspended agent's grant is not ended: it may
        # come back, so it is still reviewed (and may be revoked).
        ended = (
            grant.status != Grant.Status.ACTIVE
            or grant.expires_at <= at
            # Ended by a rule authorize() applies before a job records it (another
            # campaign's due date, its task's end, an ancestor's end). Asked with every
            # agent active and every tool approved (an empty PastState): a suspension
            # or quarantine may be lifted, so it does not end a grant, and must not hide
            # what does. Past this item's own due date its rule applies, whatever holds.
            or (not late and grant_dead_reason(grant.pk, at, PastState()) is not None)
        )
        if not (late or ended):
            _record_decision(
                item, reviewer, decision, comment, actor, at, actions, scope, expires_at, delegable
            )
            return item
    # Refused: nothing of the reviewer's is written. What the job would do to this item
    # is done now, in its own transaction, so the refusal is the last word. (Callers
    # run this outside a transaction of their own, as the API and UI views do: inside
    # one, raising the refusal would roll the applied rule back with the rest, and the
    # job would apply it at its next run.)
    # The rule's doing, not the reviewer's: the events name the system, as the job's.
    applied = _close_now(item.pk, ended=ended, actor=audit.Actor.system("review_due_rule"), at=at)
    if late:
        raise Conflict(
            "past_due",
            f"Review item #{item.pk} was due at {item.due_at.isoformat()}; past that, "
            f"the rule '{applied}' applies instead of a reviewer's decision, and it was "
            "applied now.",
        )
    raise Conflict(
        "grant_not_live",
        f"Grant #{grant.pk} is no longer live, so there is nothing to keep, narrow or "
        f"revoke; review item #{item.pk} was closed as ended.",
    )


def _record_decision(
    item: ReviewItem,
    reviewer: Any,
    decision: str,
    comment: str,
    actor: audit.Actor,
    at: datetime,
    actions: Sequence[str] | None,
    scope: str | None,
    expires_at: datetime | None,
    delegable: bool | None,
) -> None:
    """The locked, pending, in-time item: its row, then the grant's, then its event."""
    grant = item.grant
    item.status = {
        "keep": ReviewItem.Status.KEPT,
        "narrow": ReviewItem.Status.NARROWED,
        "revoke": ReviewItem.Status.REVOKED,
    }[decision]
    item.decided_by = reviewer
    item.decided_at = at
    item.comment = comment
    item.save(update_fields=["status", "decided_by", "decided_at", "comment"])
    # Then the grant (its own events), and this item's event last.
    if decision == "narrow":
        shape = (list(grant.actions), grant.scope, grant.expires_at, grant.delegable)
        grant_narrow(
            grant_id=grant.pk,
            actions=actions,
            scope=scope,
            expires_at=expires_at,
            delegable=delegable,
            reason=f"review: {comment}",
            narrowed_by=reviewer,
            actor=actor,
            at=at,
        )
        grant.refresh_from_db()
        if (list(grant.actions), grant.scope, grant.expires_at, grant.delegable) == shape:
            # Recorded as narrowed, it would say the grant shrank: it is as wide as before.
            raise GovernanceError(
                "invalid_decision", "This narrowing changes nothing: keep the grant instead."
            )
    elif decision == "revoke":
        grant_revoke(
            grant_id=grant.pk,
            reason=f"review: {comment}",
            revoked_by=reviewer,
            actor=actor,
            at=at,
        )
    _grant_event(
        grant,
        EventType.REVIEW_ITEM_DECIDED,
        actor,
        at,
        item_id=item.pk,
        campaign_id=item.campaign_id,
        decision=decision,
        comment=comment,
        decided_by=reviewer.get_username(),
        proposal=item.proposal,
        idle_actions=item.idle_actions,
    )


def _close_now(item_id: int, *, ended: bool, actor: audit.Actor, at: datetime) -> str:
    """The job's transition for one pending item, now: `ended` for a grant that has
    ended, else REVIEW_DEFAULT_RULE. Claimed like the job's (a
    conditional UPDATE), so a job running at the same moment applies it once."""
    if ended:
        claim_each(
            [item_id],
            claim=lambda pk: ReviewItem.objects.filter(
                pk=pk, status=ReviewItem.Status.PENDING
            ).update(status=ReviewItem.Status.ENDED, decided_at=at, comment="grant already ended"),
            announce=lambda pk: _item_event(pk, actor, at, rule="ended"),
        )
        return "ended"
    rule = settings.REVIEW_DEFAULT_RULE
    claim_each(
        [item_id],
        claim=lambda pk: _claim_due(pk, rule, at),
        announce=lambda pk: _announce_due(pk, rule, actor, at),
    )
    return rule


def _claim_due(pk: int, rule: str, at: datetime) -> int:
    status = ReviewItem.Status.AUTO_REVOKED if rule == "revoke" else ReviewItem.Status.AUTO_KEPT
    return ReviewItem.objects.filter(
        pk=pk, status=ReviewItem.Status.PENDING, due_at__lte=at
    ).update(status=status, decided_at=at, comment=f"due-date rule: {rule}")


def _announce_due(pk: int, rule: str, actor: audit.Actor, at: datetime) -> None:
    if rule == "revoke":  # the grant's rows and events first, the item's event last
        grant_id = ReviewItem.objects.values_list("grant_id", flat=True).get(pk=pk)
        # Read under the locks a revoke takes (item, then grant: review_item_decide's
        # order): ended meanwhile (a person's revoke committing while this run waited,
        # or its expiry), there is nothing to revoke, and the item is closed as the run's
        # first step closes it, not recorded as "revoke applied".
        grant = lock_chain(grant_id)
        if grant.status != Grant.Status.ACTIVE or grant.expires_at <= at:
            ReviewItem.objects.filter(pk=pk).update(
                status=ReviewItem.Status.ENDED, comment="grant already ended"
            )
            _item_event(pk, actor, at, rule="ended")
            return
        # authorize() refused it from the earliest due date any of its items passed
        # undecided (this one, or another campaign's before it): the row says so too, so
        # an access report for a moment before the job ran does not show it live.
        first_due = (
            ReviewItem.objects.filter(undecided_at_due_q(), grant_id=grant_id, due_at__lte=at)
            .order_by("due_at")
            .values_list("due_at", flat=True)
            .first()
        )
        grant_revoke(
            grant_id=grant_id,
            reason=f"review item #{pk} not decided by its due date",
            actor=actor,
            at=at,
            effective_at=first_due,
        )
    item = _item_event(pk, actor, at, rule=rule)
    notifications.review_overdue(
        users=_reviewers(item),
        subject=f"Review item #{item.pk} was not decided in time: {rule} applied",
        body=(
            f"Grant #{item.grant_id} ({item.grant.agent.name} on {item.grant.tool.name} "
            f"{item.grant.scope}) was due for review by {item.due_at.isoformat()}; the "
            f"rule '{rule}' was applied."
        ),
        data={"item_id": item.pk, "grant_id": item.grant_id, "rule": rule},
        at=at,
    )


def _pending_with_ended_grant(at: datetime) -> Any:
    return ReviewItem.objects.filter(status=ReviewItem.Status.PENDING).exclude(
        grant__status=Grant.Status.ACTIVE, grant__expires_at__gt=at
    )


def review_items_apply_due_rule(*, actor: audit.Actor, at: datetime) -> int:
    """The job. First, items whose grant has already ended (expired, revoked) are closed
    as `ended`: nothing is left to review, nobody is nagged. Then items still undecided
    at their due date follow REVIEW_DEFAULT_RULE (revoke by default). Each item once:
    claimed by a conditional UPDATE on status='pending'. Returns how many changed."""
    ended = claim_each(
        _pending_with_ended_grant(at).values_list("pk", flat=True),
        # The claim tests the item's own status: an UPDATE filtered across the join to
        # the grant became `id IN (subquery)`, whose status test a waiting UPDATE does
        # not re-check, and two runs (or a reviewer's decision and a run) both won it.
        # A grant that has ended never lives again: the candidates stay candidates.
        claim=lambda pk: ReviewItem.objects.filter(pk=pk, status=ReviewItem.Status.PENDING).update(
            status=ReviewItem.Status.ENDED, decided_at=at, comment="grant already ended"
        ),
        announce=lambda pk: _item_event(pk, actor, at, rule="ended"),
    )
    rule = settings.REVIEW_DEFAULT_RULE
    due = ReviewItem.objects.filter(status=ReviewItem.Status.PENDING, due_at__lte=at).values_list(
        "pk", flat=True
    )
    return ended + claim_each(
        due,
        claim=lambda pk: _claim_due(pk, rule, at),
        announce=lambda pk: _announce_due(pk, rule, actor, at),
    )


def _item_event(pk: int, actor: audit.Actor, at: datetime, *, rule: str) -> ReviewItem:
    item = ReviewItem.objects.select_related(
        "grant__agent", "grant__tool", "grant__task", "reviewer"
    ).get(pk=pk)
    _grant_event(
        item.grant,
        EventType.REVIEW_ITEM_DUE_RULE,
        actor,
        at,
        item_id=item.pk,
        campaign_id=item.campaign_id,
        rule=rule,
        reviewer=item.reviewer.get_username() if item.reviewer else None,
    )
    return item


def review_campaigns_close(*, actor: audit.Actor, at: datetime) -> int:
    """The job: open campaigns with nothing left pending are closed, once each."""
    due = (
        ReviewCampaign.objects.filter(status=ReviewCampaign.Status.OPEN)
        .exclude(items__status=ReviewItem.Status.PENDING)
        .values_list("pk", flat=True)
    )

    def announce(pk: int) -> None:
        counts: dict[str, int] = {}
        for status in ReviewItem.objects.filter(campaign_id=pk).values_list("status", flat=True):
            counts[status] = counts.get(status, 0) + 1
        audit.append(
            event_type=EventType.REVIEW_CAMPAIGN_CLOSED,
            actor=actor,
            at=at,
            data={"campaign_id": pk, "items": counts},
        )

    return claim_each(
        due,
        claim=lambda pk: (
            ReviewCampaign.objects.filter(pk=pk, status=ReviewCampaign.Status.OPEN)
            .exclude(items__status=ReviewItem.Status.PENDING)
            .update(status=ReviewCampaign.Status.CLOSED, closed_at=at)
        ),
        announce=announce,
    )


def _reviewers(item: ReviewItem, barred: set[int] | None = None) -> list[Any]:
    """Who hears about an item: its reviewer while they may still decide it (active, an
    approver, not barred from the grant: a stake taken since the campaign opened, such
    as a token for the agent, bars them as review_item_decide does); else the admins who
    may decide it instead (an admin decides any item, unless barred from this grant),
    or, if every admin is barred, every admin. `barred`: _barred(item.grant), when the
    caller read it already (as far as the approvers go: only they are told)."""
    barred = _barred(item.grant) if barred is None else barred
    reviewer = item.reviewer
    if reviewer is not None and roles.may_approve(reviewer) and reviewer.pk not in barred:
        return [reviewer]
    admins = [u for u in approver_users() if roles.is_admin(u)]
    return [u for u in admins if u.pk not in barred] or admins


def review_reminders_send(*, actor: audit.Actor, at: datetime) -> int:
    """The job: one reminder per pending item within REVIEW_REMIND_BEFORE of its due
    date, to whoever decides it (_reviewers: an unassigned item's admins). No audit
    event: a reminder changes no governance state; the Notification row is its record.
    `actor` is accepted for the uniform job signature."""
    window_start = at + settings.REVIEW_REMIND_BEFORE
    due = ReviewItem.objects.filter(
        status=ReviewItem.Status.PENDING,
        reminded_at__isnull=True,
        due_at__gt=at,
        due_at__lte=window_start,
        # A grant that already ended needs no decision: no reminder about it.
        grant__status=Grant.Status.ACTIVE,
        grant__expires_at__gt=at,
    ).values_list("pk", flat=True)

    def announce(pk: int) -> None:
        item = ReviewItem.objects.select_related("grant__agent", "grant__tool", "reviewer").get(
            pk=pk
        )
        notifications.review_due(
            users=_reviewers(item),
            subject=f"Reminder: review grant #{item.grant_id} by {item.due_at.isoformat()}",
            body=(
                f"Review item #{item.pk}: {item.grant.agent.name} on {item.grant.tool.name} "
                f"{item.grant.scope}. Undecided at the due date, the rule "
                f"'{settings.REVIEW_DEFAULT_RULE}' applies."
            ),
            data={"item_id": item.pk, "grant_id": item.grant_id, "reminder": True},
            at=at,
        )

    return claim_each(
        due,
        claim=lambda pk: ReviewItem.objects.filter(
            pk=pk, status=ReviewItem.Status.PENDING, reminded_at__isnull=True
        ).update(reminded_at=at),
        announce=announce,
    )
