"""Batched OMP (kvdict_vk.codec.omp) against scikit-learn's orthogonal_mp_gram.

Both run in the same process, interleaved, on the same random unit-norm dictionary and
Gaussian vectors; scikit-learn gets a subset (it is ~50–100× slower) and both are
reported as vectors per second. JSON to --out, a PNG beside it. CPU only; needs
scikit-learn (the ``test`` extra).

    .venv/bin/python -m kvdict_vk.bench.omp     # 100 000 vectors, d 64, K 1024, s 8
"""
from __future__ import annotations

import json
import os
import platform
import statistics

import numpy as np

from . import common, results, timing

NAME = "omp"
# at 8 code words a vector, as every committed run since the first (the README quotes it at s 8),
# not the parser's default (the certified format's 4)
_SPARSITY = ["--sparsity", "8"]
PRESETS = {"quick": ["--n", "5000", "--n-sklearn", "300", *_SPARSITY], "cpu": _SPARSITY, "gpu": _SPARSITY}
USES_DEVICE, REQUIRES = False, {"sklearn": "scikit-learn"}


def parse_args(argv=None):
    ap = common.parser(__doc__, NAME, repeats=3, gpu=USES_DEVICE)
    ap.add_argument("--n", type=int, default=100_000, help="vectors for kvdict_vk")
    ap.add_argument("--n-sklearn", type=int, default=2_000, help="vectors for scikit-learn")
    return common.parse(ap, argv)


def run(args, progress) -> dict:
    from sklearn.linear_model import orthogonal_mp_gram
    from kvdict_vk import codec

    rng = np.random.default_rng(0)
    atoms = rng.standard_normal((args.n_atoms, args.head_dim)).astype(np.float32)
    atoms /= np.linalg.norm(atoms, axis=1, keepdims=True)
    x = rng.standard_normal((args.n, args.head_dim)).astype(np.float32)
    a64 = atoms.astype(np.float64)
    gram = a64 @ a64.T
    xs = x[: args.n_sklearn].astype(np.float64)
    vectors = {"kvdict_vk": args.n, "sklearn": args.n_sklearn}
    cands = {"kvdict_vk": lambda: codec.omp(x, atoms, args.sparsity),
             "sklearn": lambda: orthogonal_mp_gram(gram, a64 @ xs.T, n_nonzero_coefs=args.sparsity).T}
    secs, outs = common.interleaved(cands, args.repeats, lambda rep, secs: progress(
        f"repeat {rep + 1}/{args.repeats}: kvdict_vk {args.n / secs['kvdict_vk'][-1]:,.0f} vec/s, "
        f"scikit-learn {args.n_sklearn / secs['sklearn'][-1]:,.0f} vec/s"))
    ours, theirs = ([vectors[k] / t for t in secs[k]] for k in ("kvdict_vk", "sklearn"))

    idx, ref = outs["kvdict_vk"][0], outs["sklearn"]
    agree = float(np.mean([set(np.flatnonzero(ref[i])) == set(idx[i]) for i in range(len(xs))]))
    ratios = [a / b for a, b in zip(ours, theirs)]
    result = dict(
        benchmark="omp_encode", head_dim=args.head_dim, n_atoms=args.n_atoms,
        sparsity=args.sparsity, n_vectors=args.n, n_vectors_sklearn=args.n_sklearn,
        kvdict_vk_vec_per_s=dict(median=statistics.median(ours), all=ours),
        sklearn_vec_per_s=dict(median=statistics.median(theirs), all=theirs),
        speedup=dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios)),
        same_atoms_fraction=agree, machine=dict(cpu_count=os.cpu_count(), platform=platform.platform()),
        seconds={k: secs[k] for k in cands},
    )
    result["rows"] = make_rows(result)
    return result


def make_rows(result) -> list[dict]:
    """Host work: wall time only, device_kind "cpu"."""
    rows = []
    for name in ("kvdict_vk", "sklearn"):
        t = timing.timing(result["seconds"][name], recorded=False)
        t["note"] = "NumPy on the host" if name == "kvdict_vk" else "scikit-learn on the host"
        rows.append(results.row(NAME, f"{name} d{result['head_dim']} K{result['n_atoms']} s{result['sparsity']}", t,
                                head_dim=result["head_dim"], vectors_per_s=result[f"{name}_vec_per_s"]["median"],
                                n_vectors=result["n_vectors" if name == "kvdict_vk" else "n_vectors_sklearn"],
                                device_kind="cpu"))
    return rows


def rows(result) -> list[dict]:
    return result["rows"]


def headline(result) -> list[dict]:
    """kvdict_vk / scikit-learn speed: the medians of vectors per second."""
    ours, theirs = result["kvdict_vk_vec_per_s"]["median"], result["sklearn_vec_per_s"]["median"]
    return [{"figure": "kvdict_vk / scikit-learn OMP speed",
             "case": f"d {result['head_dim']}, K {result['n_atoms']}, s {result['sparsity']}",
             "numerator": ours, "denominator": theirs, "unit": "vectors/s", "ratio": ours / theirs,
             "paired_ratio_median": result["speedup"]["median"]}]


def report(result) -> list[str]:
    return [json.dumps(result["speedup"] | {"same_atoms": result["same_atoms_fraction"]})]


def plot(plt, r: dict):
    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = ["scikit-learn\northogonal_mp_gram", "kvdict_vk\ncodec.omp"]
    vals = [r["sklearn_vec_per_s"]["median"], r["kvdict_vk_vec_per_s"]["median"]]
    ax.bar(names, vals, color=["#999", "#2a7"])
    ax.set_yscale("log")
    ax.set_ylabel("vectors / s (median)")
    ax.set_title(f"OMP d={r['head_dim']} K={r['n_atoms']} s={r['sparsity']}: "
                 f"{r['speedup']['median']:.0f}× faster")
    return fig


def main(argv=None) -> int:
    return common.standalone(NAME, parse_args(argv), run, plot, report)


if __name__ == "__main__":
    raise SystemExit(main())
