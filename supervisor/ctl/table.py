"""Aligned text tables and the short forms of sizes and durations they show."""

from __future__ import annotations

from collections.abc import Sequence


def render(headers: Sequence[str], rows: Sequence[Sequence[str]],
           right: frozenset[int] = frozenset()) -> str:
    """Columns two spaces apart, each as wide as its widest cell; the columns in `right`
    (numbers) aligned right. No trailing spaces."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows,
                                                                        strict=True)]

    def line(cells: Sequence[str]) -> str:
        out = [cell.rjust(w) if i in right else cell.ljust(w)
               for i, (cell, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def mib(value: float) -> str:
    """MiB as people read them: `812 MiB`, `1.2 GiB`."""
    if value >= 1024:
        return f"{value / 1024:.1f} GiB"
    return f"{value:.0f} MiB"


def duration(seconds: float) -> str:
    """`45s`, `4m05s`, `2h10m`."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
