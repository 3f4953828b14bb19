"""Study (NumPy, no device): how far attention over q8_0 rows moves when the query is quantised
to int8 per 32-element block — in one part (x ≈ s·hi) and in the two parts attend_flash_dot takes
(x ≈ s·(hi + lo/254)) — NMSE against the float64 attention with the exact query, on random rows
with an outlier key channel (×10), at three query scales.

    python lab/probes/int8_query_study.py
"""
from __future__ import annotations

import numpy as np


def attend(q, k, v):
    s = k @ q
    p = np.exp(s - s.max())
    return (p @ v) / p.sum()


def q8_0(x):
    """Rows through q8_0 blocks of 32 (d = max / 127, levels rounded)."""
    b = x.reshape(-1, 32)
    d = np.abs(b).max(1, keepdims=True) / 127
    d[d == 0] = 1
    return (np.round(b / d) * d).reshape(x.shape)


def int8_query(q, two_parts: bool):
    b = q.reshape(-1, 32)
    s = np.abs(b).max(1, keepdims=True) / 127
    hi = np.round(b / s)
    lo = np.clip(np.round((b / s - hi) * 254), -127, 127) if two_parts else 0.0
    return ((hi + lo / 254) * s).reshape(q.shape)


def main() -> None:
    rng = np.random.default_rng(0)
    d, n = 64, 4096
    for scale in (0.5, 0.5, 2.0):
        k = rng.standard_normal((n, d))
        k[:, 5] *= 10.0
        k, v = q8_0(k), q8_0(rng.standard_normal((n, d)))
        q = rng.standard_normal(d) * scale
        ref = attend(q, k, v)
        for two in (False, True):
            out = attend(int8_query(q, two), k, v)
            print(f"query ×{scale}: {'two parts' if two else 'one part '} NMSE "
                  f"{np.mean((out - ref) ** 2) / np.mean(ref ** 2):.2e}")


if __name__ == "__main__":
    main()
