"""Server-rendered SVG charts: real pictures, no script, no CDN.

Drawn with SVG presentation attributes only (fill, stroke), never `style`, so
the Content-Security-Policy needs no 'unsafe-inline'. Every label is escaped.
"""

from __future__ import annotations

from collections.abc import Sequence

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

WIDTH, HEIGHT = 560, 200
LEFT, RIGHT, TOP, BOTTOM = 36, 110, 12, 28
PALETTE = ("#2f5d8a", "#c77c2e", "#4d8a5a", "#8a4d7a", "#7a7a2e", "#2e7a7a", "#999999")
ALLOW, DENY, ASK = "#4d8a5a", "#b5473a", "#c7a02e"


def _scale(values: Sequence[int]) -> int:
    top = max([1, *values])
    # A round ceiling so the gridline labels are plain numbers.
    for step in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10000):
        if top <= step * 4:
            return step * 4
    return top


def _frame(labels: Sequence[str], ceiling: int, title: str) -> list[str]:
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{escape(title)}" '
        'class="chart" font-family="system-ui, sans-serif" font-size="10">',
        f"<title>{escape(title)}</title>",
    ]
    for i in range(5):
        y = TOP + plot_h - plot_h * i / 4
        parts.append(
            f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" '
            'stroke="#e3e3e3" stroke-width="1"/>'
        )
        parts.append(
            f'<text x="{LEFT - 4}" y="{y + 3:.1f}" text-anchor="end" fill="#666">'
            f"{ceiling * i // 4}</text>"
        )
    n = len(labels)
    every = max(1, n // 7)
    for i, label in enumerate(labels):
        last = i == n - 1
        # Every `every`-th day and the last one, but not one crowding the last.
        if not last and (i % every or n - 1 - i < every):
            continue
        x = LEFT + (plot_w * (i + 0.5) / n if n else 0)
        parts.append(
            f'<text x="{x:.1f}" y="{HEIGHT - 10}" text-anchor="middle" fill="#666">'
            f"{escape(label)}</text>"
        )
    return parts


def _legend(parts: list[str], names: Sequence[str], colours: Sequence[str]) -> None:
    for i, (name, colour) in enumerate(zip(names, colours, strict=True)):
        y = TOP + 6 + i * 14
        parts.append(
            f'<rect x="{WIDTH - RIGHT + 8}" y="{y - 7}" width="9" height="9" fill="{colour}"/>'
        )
        parts.append(
            f'<text x="{WIDTH - RIGHT + 21}" y="{y + 1}" fill="#333">{escape(name[:16])}</text>'
        )


def line_chart(
    labels: Sequence[str], series: Sequence[tuple[str, Sequence[int]]], title: str
) -> SafeString:
    """One polyline per series, e.g. live grants per day: total and per agent."""
    ceiling = _scale([v for _, values in series for v in values])
    parts = _frame(labels, ceiling, title)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    n = len(labels)
    colours = [PALETTE[i % len(PALETTE)] for i in range(len(series))]
    for (name, values), colour in zip(series, colours, strict=True):
        points = " ".join(
            f"{LEFT + plot_w * (i + 0.5) / n:.1f},{TOP + plot_h - plot_h * v / ceiling:.1f}"
            for i, v in enumerate(values)
        )
        width = 2.5 if name == "total" else 1.5
        parts.append(
            f'<polyline points="{points}" fill="none" stroke="{colour}" '
            f'stroke-width="{width}"><title>{escape(name)}</title></polyline>'
        )
    _legend(parts, [name for name, _ in series], colours)
    parts.append("</svg>")
    return mark_safe("".join(parts))  # noqa: S308 - every interpolated label is escaped above


def stacked_bars(
    labels: Sequence[str], stacks: Sequence[tuple[str, str, Sequence[int]]], title: str
) -> SafeString:
    """Stacked bars per day, e.g. allow / approval required / deny decisions."""
    totals = [sum(values[i] for _, _, values in stacks) for i in range(len(labels))]
    ceiling = _scale(totals)
    parts = _frame(labels, ceiling, title)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    n = len(labels) or 1
    bar = plot_w / n * 0.7
    for i, label in enumerate(labels):
        base = TOP + plot_h
        x = LEFT + plot_w * (i + 0.5) / n - bar / 2
        for name, colour, values in stacks:
            h = plot_h * values[i] / ceiling
            if h <= 0:
                continue
            base -= h
            parts.append(
                f'<rect x="{x:.1f}" y="{base:.1f}" width="{bar:.1f}" height="{h:.1f}" '
                f'fill="{colour}"><title>{escape(label)}: {values[i]} {escape(name)}</title></rect>'
            )
    _legend(parts, [name for name, _, _ in stacks], [colour for _, colour, _ in stacks])
    parts.append("</svg>")
    return mark_safe("".join(parts))  # noqa: S308 - every interpolated label is escaped above
