"""Batched OMP (kvdict_vk.codec.omp) against scikit-learn's orthogonal_mp_gram.

Both run in the same process, interleaved, on the same random unit-norm dictionary and
Gaussian vectors; scikit-learn gets a subset (it is ~50–100× slower) and both are
reported as vectors per second. JSON to --out, a PNG beside it.

    .venv/bin/python tools/bench_omp.py                 # 100 000 vectors, d 64, K 1024, s 8
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100_000, help="vectors for kvdict_vk")
    ap.add_argument("--n-sklearn", type=int, default=2_000, help="vectors for scikit-learn")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--n-atoms", type=int, default=1024)
    ap.add_argument("--sparsity", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="out/bench_omp.json")
    args = ap.parse_args(argv)

    from sklearn.linear_model import orthogonal_mp_gram
    from kvdict_vk import codec

    rng = np.random.default_rng(0)
    atoms = rng.standard_normal((args.n_atoms, args.head_dim)).astype(np.float32)
    atoms /= np.linalg.norm(atoms, axis=1, keepdims=True)
    x = rng.standard_normal((args.n, args.head_dim)).astype(np.float32)
    a64 = atoms.astype(np.float64)
    gram = a64 @ a64.T
    xs = x[: args.n_sklearn].astype(np.float64)

    ours, theirs = [], []
    for rep in range(args.repeats):  # interleaved, so both see the same machine load
        t = time.perf_counter()
        idx, coef = codec.omp(x, atoms, args.sparsity)
        ours.append(args.n / (time.perf_counter() - t))
        t = time.perf_counter()
        ref = orthogonal_mp_gram(gram, a64 @ xs.T, n_nonzero_coefs=args.sparsity).T
        theirs.append(args.n_sklearn / (time.perf_counter() - t))
        print(f"[bench_omp] repeat {rep + 1}: kvdict_vk {ours[-1]:,.0f} vec/s, "
              f"scikit-learn {theirs[-1]:,.0f} vec/s", file=sys.stderr)

    agree = float(np.mean([set(np.flatnonzero(ref[i])) == set(idx[i]) for i in range(len(xs))]))
    ratios = [a / b for a, b in zip(ours, theirs)]
    result = dict(
        benchmark="omp_encode", head_dim=args.head_dim, n_atoms=args.n_atoms,
        sparsity=args.sparsity, n_vectors=args.n, n_vectors_sklearn=args.n_sklearn,
        kvdict_vk_vec_per_s=dict(median=statistics.median(ours), all=ours),
        sklearn_vec_per_s=dict(median=statistics.median(theirs), all=theirs),
        speedup=dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios)),
        same_atoms_fraction=agree, machine=dict(cpu_count=os.cpu_count(), platform=platform.platform()),
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    _plot(result, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps(result["speedup"] | {"same_atoms": agree}))
    return 0


def _plot(r: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = ["scikit-learn\northogonal_mp_gram", "kvdict_vk\ncodec.omp"]
    vals = [r["sklearn_vec_per_s"]["median"], r["kvdict_vk_vec_per_s"]["median"]]
    ax.bar(names, vals, color=["#999", "#2a7"])
    ax.set_yscale("log")
    ax.set_ylabel("vectors / s (median)")
    ax.set_title(f"OMP d={r['head_dim']} K={r['n_atoms']} s={r['sparsity']}: "
                 f"{r['speedup']['median']:.0f}× faster")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
