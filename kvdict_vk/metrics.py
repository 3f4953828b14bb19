"""How far a result is from its reference: the one NMSE that kvdict-validate, the demo
and the tests use.

NMSE = Σ(ref − got)² / Σref² (ggml's convention: the reference in the denominator; an
all-zero reference divides by 1), over the finite entries. NaN, +Inf and −Inf must sit at
the same positions in both arrays, else the NMSE is infinite: a shader that turns a finite
value into NaN, or loses one, fails whatever the tolerance.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Comparison:
    nmse: float  # inf when the non-finite positions differ
    max_abs: float  # max |ref − got| over the entries finite in both (0 when none)
    nonfinite_match: bool  # NaN, +Inf and −Inf at the same positions


def compare(ref, got) -> Comparison:
    a, b = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"compare: shapes {a.shape} and {b.shape} differ")
    same = (np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(np.isposinf(a), np.isposinf(b))
            and np.array_equal(np.isneginf(a), np.isneginf(b)))
    fin = np.isfinite(a) & np.isfinite(b)
    diff = a[fin] - b[fin]
    max_abs = float(np.abs(diff).max()) if diff.size else 0.0
    if not same:
        return Comparison(float("inf"), max_abs, False)
    den = float(np.sum(a[fin] ** 2)) or 1.0
    return Comparison(float(np.sum(diff ** 2)) / den, max_abs, True)


def nmse(ref, got) -> float:
    """Σ(ref − got)²/Σref² over finite entries; inf unless NaN/±Inf positions agree."""
    return compare(ref, got).nmse
