"""Probe: how exactly a shader could rotate a decoded pre-RoPE key to its position without a
cos/sin table of every position (issue 51 item 3's engine side, not built).

A full table (the forward's: kvdict_vk.model_file.rope_cos_sin, float64 angles rounded to
float32) costs n_ctx × rope_dim floats — at 131 072 tokens and rope_dim 64, 256 B a token, more
than a coded token's slots. Decomposed, t = hi·B + lo: cos/sin of t·ω from two float32 tables
(hi·B·ω for hi < n_ctx / B, lo·ω for lo < B) by the angle-sum identities in float32, (n_ctx / B
+ B) × rope_dim floats. This measures, against float64, the worst element error of the
decomposed cos/sin and the NMSE of keys rotated with them next to keys rotated with the
forward's table — what a shader doing it would be held to (NMSE ≤ 1e-9, the exact path's gate).

    python lab/probes/rope_tables_probe.py [--out lab/results/cpu/rope_tables.json]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def full_table(t: np.ndarray, inv_freq: np.ndarray):
    """The forward's: float64 angles, cos/sin rounded to float32."""
    a = t[:, None].astype(np.float64) * inv_freq[None, :]
    return np.cos(a).astype(np.float32), np.sin(a).astype(np.float32)


def decomposed(t: np.ndarray, inv_freq: np.ndarray, base: int):
    """cos/sin of t·ω from float32 tables of hi·base·ω and lo·ω, combined in float32."""
    hi, lo = t // base, t % base
    ch, sh = full_table(hi * base, inv_freq)
    cl, sl = full_table(lo, inv_freq)
    return (ch * cl - sh * sl).astype(np.float32), (sh * cl + ch * sl).astype(np.float32)


def rotate(x: np.ndarray, c: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Adjacent pairs (2i, 2i + 1) of x (T, dim) rotated by (c, s) (T, dim / 2), in x's dtype."""
    out = np.array(x, copy=True)
    a, b = x[:, 0::2], x[:, 1::2]
    out[:, 0::2] = a * c - b * s
    out[:, 1::2] = a * s + b * c
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-ctx", type=int, default=131072)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    t = np.arange(a.n_ctx, dtype=np.int64)
    rows = []
    for dim, theta in ((64, 10000.0), (64, 100000.0), (128, 500000.0)):
        inv_freq = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
        exact = t[:, None].astype(np.float64) * inv_freq[None, :]
        c64, s64 = np.cos(exact), np.sin(exact)
        x = rng.standard_normal((a.n_ctx, dim))
        ref = rotate(x, c64, s64)  # float64 throughout
        fc, fs = full_table(t, inv_freq)
        full = rotate(x.astype(np.float32), fc, fs).astype(np.float64)
        for base in (256, 512, 1024):
            dc, ds = decomposed(t, inv_freq, base)
            dec = rotate(x.astype(np.float32), dc, ds).astype(np.float64)
            nmse = lambda y: float(np.sum((y - ref) ** 2) / np.sum(ref ** 2))  # noqa: E731
            rows.append(dict(rope_dim=dim, theta=theta, base=base,
                             table_floats=(a.n_ctx // base + base) * dim, full_table_floats=a.n_ctx * dim,
                             max_abs_err_cos_sin=float(max(np.abs(dc - c64).max(), np.abs(ds - s64).max())),
                             max_abs_err_full_table=float(max(np.abs(fc - c64).max(), np.abs(fs - s64).max())),
                             nmse_rotated_decomposed=nmse(dec), nmse_rotated_full_table=nmse(full)))
            print(json.dumps(rows[-1]))
    out = dict(command="python lab/probes/rope_tables_probe.py" + (f" --out {a.out}" if a.out else ""),
               when=time.strftime("%Y-%m-%dT%H:%M:%S%z"), n_ctx=a.n_ctx, rows=rows)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
