"""Two-sample chi2 for the T > 0 distribution tests (CPU and GPU)."""
from __future__ import annotations

from collections import Counter
from typing import Hashable, Sequence


def two_sample_chi2(a: Sequence[Hashable], b: Sequence[Hashable]) -> tuple[float, int]:
    """Two-sample chi2 of equal-size samples over their cells -> (statistic, dof)."""
    ca, cb = Counter(a), Counter(b)
    cells = set(ca) | set(cb)
    return sum((ca[c] - cb[c]) ** 2 / (ca[c] + cb[c]) for c in cells), len(cells) - 1


def critical(dof: int) -> float:
    """A bound above chi2's p = 0.001 point at `dof` (26.1 at dof 8)."""
    return dof + 3.1 * (2 * dof) ** 0.5 + 5
