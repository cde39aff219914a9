"""Break-glass, reviews and second looks in the web UI.

Pages over the lifecycle services (governance/services/breakglass.py, reviews.py,
second_look.py): the views parse, call the service, and show its answer; the rules
(who may review, TTL cap, comments required, never wider) are the services'.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.conf import settings
from django.contrib import messages
from django.core.paginator import Paginator
from django.db.models import Count, Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from governance import selectors
from governance.models import (
    Agent,
    BreakGlass,
    ReviewCampaign,
    ReviewItem,
    SecondLook,
    Task,
    Tool,
)
from governance.services import breakglass as bg_services
from governance.services import reviews as review_services
from governance.services import second_look as second_look_services
from governance.web import common, forms
from governance.web.access import require


def active_break_glass(now: datetime) -> list[Any]:
    """For the banner on every page."""
    return list(selectors.breakglass_active(now))


def overdue_break_glass(now: datetime) -> list[Any]:
    """For the other banner on every page: post-incident reviews past due. The elevation
    has normally ended by then, so the active banner is gone and only this one says a
    second person still owes a ratification."""
    return selectors.breakglass_reviews_pending(now, overdue_only=True)


def dashboard_context(user: Any, now: datetime) -> dict[str, Any]:
    reviews_pending = selectors.breakglass_reviews_pending(now)
    overdue_items = (
        ReviewItem.objects.filter(status=ReviewItem.Status.PENDING, due_at__lte=now)
        .select_related("grant__agent", "grant__tool", "reviewer", "campaign")
        .order_by("due_at")
    )
    assigned, fallen = selectors.review_items_counts(user)
    return {
        "bg_active": active_break_glass(now),
        "bg_overdue": [bg for bg in reviews_pending if bg.is_overdue],
        "bg_reviews_pending": len(reviews_pending),
        "my_review_count": assigned,
        "fallen_review_count": fallen,
        "overdue_items": overdue_items[:20],
        "overdue_items_count": overdue_items.count(),
        "trend": selectors.grant_trend(days=14),
        "second_looks_mine": selectors.second_looks_for(user).count(),
        "lifecycle": True,
    }


# --- Break-glass -------------------------------------------------------------------------


@require("read")
@require_GET
def breakglass_page(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    rows = list(
        BreakGlass.objects.select_related(
            "grant__agent", "grant__tool", "grant__task", "opened_by", "closed_by", "reviewed_by"
        ).order_by("-opened_at")[:100]
    )
    # The banner's rule (and authorize()'s): the grant's own end, the opener's account.
    active = set(selectors.breakglass_active(now).values_list("pk", flat=True))
    for bg in rows:
        bg.is_active = bg.pk in active  # type: ignore[attr-defined]
        bg.review_overdue = (  # type: ignore[attr-defined]
            bg.review_status == BreakGlass.Review.PENDING and bg.review_due_at <= now
        )
    return render(
        request,
        "ui/breakglass.html",
        {
            "rows": rows,
            "now": now,
            "ttl_choices": forms.breakglass_ttl_choices(),
            "default_ttl": _default_ttl_minutes(),
            "agents": Agent.objects.filter(status=Agent.Status.ACTIVE).order_by("name"),
            "tools": Tool.objects.order_by("name"),
            "tasks": Task.objects.filter(status=Task.Status.OPEN).order_by("key"),
            "actions": forms.ACTION_CHOICES,
        },
    )


def _default_ttl_minutes() -> int:
    from django.conf import settings

    return int(settings.BREAKGLASS_DEFAULT_TTL.total_seconds() // 60)


@require("decide")
@require_POST
def breakglass_open(request: HttpRequest) -> HttpResponse:
    data = common.cleaned(forms.BreakGlassOpenForm(request.POST))
    agent = selectors.by_name(Agent, "agent", name=data["agent"])
    tool = selectors.by_name(Tool, "tool", name=data["tool"])
    task = selectors.by_name(Task, "task", key=data["task"]) if data.get("task") else None
    bg = bg_services.breakglass_open(
        opener=request.user,
        agent=agent,
        tool=tool,
        actions=data["actions"],
        scope=data["scope"],
        task=task,
        ticket=data["ticket"],
        reason=data["reason"],
        ttl=timedelta(minutes=data["ttl_minutes"]),
        actor=common.actor(request),
        at=timezone.now(),
    )
    until = f"{bg.expires_at:%H:%M} UTC"
    messages.warning(request, f"Break-glass {bg.ticket} is open for {agent.name} until {until}.")
    return redirect("ui:break-glass")


def _bg_action(request: HttpRequest, pk: int, what: str) -> HttpResponse:
    bg = common.one(BreakGlass.objects.all(), pk=pk)
    comment = common.cleaned(forms.CommentForm(request.POST))["comment"]
    actor, now = common.actor(request), timezone.now()
    if what == "close":
        bg_services.breakglass_close(
            breakglass_id=bg.pk, closed_by=request.user, comment=comment, actor=actor, at=now
        )
    elif what == "ratify":
        bg_services.breakglass_ratify(
            breakglass_id=bg.pk, reviewer=request.user, comment=comment, actor=actor, at=now
        )
    else:
        bg_services.breakglass_confirm_closed(
            breakglass_id=bg.pk, reviewer=request.user, comment=comment, actor=actor, at=now
        )
    done = {"close": "closed early", "ratify": "ratified", "confirm": "confirmed closed"}[what]
    messages.success(request, f"Break-glass {bg.ticket} {done}.")
    return redirect("ui:break-glass")


# Closing early changes state: approvers and admins. The service also lets the person
# who opened it close it (an agent's owner need not be an approver: through the API), but
# never an auditor, who is read-only; so in the UI, whose roles are these three, it is
# the decide right.
@require("decide")
@require_POST
def breakglass_close(request: HttpRequest, pk: int) -> HttpResponse:
    return _bg_action(request, pk, "close")


@require("decide")
@require_POST
def breakglass_ratify(request: HttpRequest, pk: int) -> HttpResponse:
    return _bg_action(request, pk, "ratify")


@require("decide")
@require_POST
def breakglass_confirm(request: HttpRequest, pk: int) -> HttpResponse:
    return _bg_action(request, pk, "confirm")


# --- Reviews -----------------------------------------------------------------------------


@require("read")
@require_GET
def review_campaigns(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    rows = list(selectors.review_campaigns().select_related("agent", "opened_by")[:100])
    for c in rows:
        c.decided = c.total - c.pending  # type: ignore[attr-defined]
        c.overdue = c.status == "open" and c.due_at <= now and c.pending  # type: ignore[attr-defined]
    context = {
        "campaigns": rows,
        "mine": selectors.review_items_counts(request.user),
        "agent_names": Agent.objects.order_by("name").values_list("name", flat=True),
        "default_due_days": settings.REVIEW_DUE.days,
    }
    return render(request, "ui/reviews.html", context)


@require("admin")
@require_POST
def review_campaign_open(request: HttpRequest) -> HttpResponse:
    """Admins open a campaign on demand (the schedule opens the periodic ones)."""
    data = common.cleaned(forms.ReviewOpenForm(request.POST))
    at = timezone.now()
    agent = selectors.by_name(Agent, "agent", name=data["agent"]) if data.get("agent") else None
    campaign = review_services.review_campaign_open(
        kind=ReviewCampaign.Kind.ON_DEMAND,
        reason=data["reason"],
        agent=agent,
        opened_by=request.user,
        due_at=at + timedelta(days=data["due_days"]) if data.get("due_days") else None,
        actor=common.actor(request),
        at=at,
    )
    messages.success(
        request, f"Campaign #{campaign.pk} is open with {campaign.items.count()} item(s)."
    )
    return redirect("ui:review-campaign", campaign.pk)


# Rows per page: a campaign has an item per live grant (40,000 items were one page of
# 10 MB), and each of my items carries a decide form (about 1.8 kB).
CAMPAIGN_PAGE = 100
MINE_PAGE = 50


@require("read")
@require_GET
def review_campaign(request: HttpRequest, pk: int) -> HttpResponse:
    """A campaign's items a page at a time, pending first, with the count of each status
    over the whole campaign; `status` shows one."""
    campaign = common.one(ReviewCampaign.objects.select_related("agent", "opened_by"), pk=pk)
    form = forms.ReviewItemsFilterForm(request.GET or None)
    wanted = common.optional(form)
    now = timezone.now()
    counted = dict(campaign.items.order_by().values_list("status").annotate(n=Count("id")))
    items = campaign.items.select_related(
        "grant__agent", "grant__tool", "grant__task", "reviewer", "decided_by"
    ).order_by(*selectors.PENDING_FIRST)
    if wanted.get("status"):
        items = items.filter(status=wanted["status"])
    page = Paginator(items, CAMPAIGN_PAGE).get_page(wanted.get("page"))
    context = {
        "campaign": campaign,
        "form": form,
        "status": wanted.get("status") or "",
        "counts": [(s, counted.get(s, 0)) for s in ReviewItem.Status.values],
        "total": sum(counted.values()),
        "overdue": campaign.items.filter(status=ReviewItem.Status.PENDING, due_at__lte=now).count(),
        "items": page.object_list,
        "page": page,
        "page_links": common.page_links(request, page),
        "now": now,
    }
    return render(request, "ui/review_campaign.html", context)


@require("read")
@require_GET
def review_mine(request: HttpRequest) -> HttpResponse:
    """The reviewer's items a page at a time, open ones first (one form each: keep,
    narrow or revoke, each with a comment), then those closed; `campaign` shows one
    campaign's. There is deliberately no "keep all": every item is decided on its own."""
    form = forms.ReviewMineFilterForm(request.GET or None)
    wanted = common.optional(form)
    now = timezone.now()
    items = selectors.review_items_query(request.user, decided=True)
    if wanted.get("campaign"):
        items = items.filter(campaign_id=wanted["campaign"])
    pending = Q(status=ReviewItem.Status.PENDING)
    counts = items.aggregate(
        open=Count("id", filter=pending),
        assigned=Count("id", filter=pending & Q(reviewer=request.user)),
        overdue=Count("id", filter=pending & Q(due_at__lte=now)),
        closed=Count("id", filter=~pending),
    )
    counts["fallen"] = counts["open"] - counts["assigned"]  # an admin's: the admins' to decide
    page = Paginator(items, MINE_PAGE).get_page(wanted.get("page"))
    page.object_list = selectors.review_items_marked(request.user, page.object_list, now)
    context = {
        "form": form,
        "campaign": wanted.get("campaign"),
        "campaigns": ReviewCampaign.objects.order_by("-opened_at", "-id")[:50],
        "counts": counts,
        "items": page.object_list,
        "page": page,
        "page_links": common.page_links(request, page),
        "now": now,
    }
    return render(request, "ui/review_mine.html", context)


@require("decide")
@require_POST
def review_item_decide(request: HttpRequest, pk: int) -> HttpResponse:
    item = common.one(ReviewItem.objects.select_related("grant"), pk=pk)
    form = forms.ReviewDecideForm(request.POST)
    decision = common.cleaned(form)["decision"]
    # The form always carries the narrowing fields. A keep with some of them changed is
    # refused by the service (400 invalid_decision), not read as "keep all": the
    # reviewer unticked something. A revoke ends the grant, less than any narrowing.
    narrowing = (
        form.narrowing(item.grant.scope, list(item.grant.actions), item.grant.delegable)
        if decision != "revoke"
        else {}
    )
    review_services.review_item_decide(
        item_id=item.pk,
        reviewer=request.user,
        decision=decision,
        comment=form.cleaned_data["comment"],
        actor=common.actor(request),
        at=timezone.now(),
        **narrowing,
    )
    messages.success(request, f"Grant #{item.grant_id}: {decision}.")
    # Back to the page and campaign the form was on (numbers only: no open redirect).
    back = {
        name: form.cleaned_data[f"back_{name}"]
        for name in ("campaign", "page")
        if form.cleaned_data.get(f"back_{name}")
    }
    return redirect(reverse("ui:reviews-mine") + (f"?{urlencode(back)}" if back else ""))


# --- Second look -------------------------------------------------------------------------

# As the requests inbox's "show all" (200): a page a person reads through, not the backlog.
SECOND_LOOKS_SHOWN = 200


@require("read")
@require_GET
def second_look_inbox(request: HttpRequest) -> HttpResponse:
    """Sampled approvals waiting for a different approver's second look: mine first,
    then the unassigned ones (admins decide those), then everyone's for readers; the
    oldest SECOND_LOOKS_SHOWN in all, with how many wait. Every pending one was on
    the page (3,000 at a customer's size: 3.2 MB, 3 s)."""
    pending = (
        SecondLook.objects.filter(status=SecondLook.Status.PENDING)
        .select_related(
            "grant__agent",
            "grant__tool",
            "grant__task",
            "grant__requested_by",
            "approval__agent",
            "approval__tool",
            "approval__task",
            "original_approver",
            "reviewer",
        )
        .order_by("sampled_at", "pk")
    )
    waiting = pending.filter(reviewer=request.user)
    elsewhere = pending.exclude(reviewer=request.user)
    mine = list(waiting[:SECOND_LOOKS_SHOWN])
    others = (
        list(elsewhere[: SECOND_LOOKS_SHOWN - len(mine)]) if len(mine) < SECOND_LOOKS_SHOWN else []
    )
    mine_total, others_total = waiting.count(), elsewhere.count()
    recent = (
        SecondLook.objects.exclude(status=SecondLook.Status.PENDING)
        .select_related(
            "grant__agent", "grant__tool", "approval__agent", "approval__tool", "decided_by"
        )
        .order_by("-decided_at")[:30]
    )
    return render(
        request,
        "ui/inbox_second_look.html",
        {
            "mine": mine,
            "others": others,
            "mine_total": mine_total,
            "others_total": others_total,
            # Said on the page, as the backlog is not all there.
            "capped": len(mine) + len(others) < mine_total + others_total,
            "shown": len(mine) + len(others),
            "total": mine_total + others_total,
            "recent": recent,
            "now": timezone.now(),
        },
    )


@require("decide")
@require_POST
def second_look_decide(request: HttpRequest, pk: int) -> HttpResponse:
    look = common.one(SecondLook.objects.all(), pk=pk)
    data = common.cleaned(forms.SecondLookForm(request.POST))
    second_look_services.second_look_decide(
        second_look_id=look.pk,
        reviewer=request.user,
        verdict=data["verdict"],
        comment=data["comment"],
        actor=common.actor(request),
        at=timezone.now(),
    )
    messages.success(request, f"Second look #{look.pk}: {data['verdict']}.")
    return redirect("ui:inbox-second-look")
