"""Forge reports: baselines on the gate's windows, JSON + Markdown table + PNG plot."""
from __future__ import annotations

import json
import os

import numpy as np

from . import certify, quant

# Baselines measured next to every dictionary, K and V both replaced (llama.cpp's cache
# types, the same with each head's mean removed first, per-token int8/int4).
BASELINES = ("f16", "q8_0", "q4_1", "q4_0", "mean_q8_0", "mean_q4_1", "mean_q4_0", "int8_token", "int4_token")


def baselines(wins, base_nll, head_dim: int, cache_path: str | None, log=print) -> list[dict]:
    """ΔPPL and bytes per vector for each baseline; cached by the windows' identity."""
    cached = {}
    if cache_path and os.path.exists(cache_path):
        with open(cache_path) as f:
            cached = {r["name"]: r for r in json.load(f)}
    rows = []
    for name in BASELINES:
        if name in cached:
            rows.append(cached[name])
            continue
        res = certify.evaluate(wins, quant.QuantHook(name, "kv"), base_nll)
        rows.append(dict(name=name, kind="baseline", bytes_per_vector=quant.bytes_per_vector(name, head_dim),
                         **res.to_dict()))
        log(f"baseline {name}: ΔPPL {100 * res.delta_rel:+.2f} % at {rows[-1]['bytes_per_vector']:.1f} B/vector")
        if cache_path:
            os.makedirs(os.path.dirname(cache_path), exist_ok=True)
            with open(cache_path, "w") as f:
                json.dump(rows + [r for n, r in cached.items() if n not in {x["name"] for x in rows}], f, indent=1)
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| cache | bytes / head vector | ΔPPL | 95 % CI | PPL |", "|---|---:|---:|---|---:|"]
    for r in sorted(rows, key=lambda r: r["bytes_per_vector"]):
        lo, hi = r["ci95"]
        lines.append(f"| {r['name']} | {r['bytes_per_vector']:.1f} | {100 * r['delta_rel']:+.2f} % | "
                     f"[{100 * lo:+.2f}, {100 * hi:+.2f}] % | {r['coded_ppl']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, style in (("baseline", dict(marker="s", color="#888")), ("dictionary", dict(marker="o", color="#1a7"))):
        pts = [r for r in rows if r.get("kind") == kind]
        if not pts:
            continue
        x = [r["bytes_per_vector"] for r in pts]
        y = [max(100 * r["delta_rel"], 1e-3) for r in pts]
        ax.scatter(x, y, label=kind, **style)
        for r, xi, yi in zip(pts, x, y):
            ax.annotate(r["name"], (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axhline(1.0, color="#c33", lw=0.8, ls="--", label="gate +1 %")
    ax.set_xlabel("bytes per cached head vector (head_dim 64; f32 = 256)")
    ax.set_ylabel("ΔPPL on GPL-3 (%; log)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


KIND_STYLE = {"dictionary": dict(marker="o", color="#1a7"), "kivi": dict(marker="s", color="#c60"),
              "rotated": dict(marker="^", color="#36c"), "residual_only": dict(marker="D", color="#a3a"),
              "q8_0": dict(marker="v", color="#666")}


def plot_texts(rows: list[dict], sets, path: str) -> None:
    """One panel per evaluation text: ΔPPL (upper CI bound as an error bar) vs bytes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(sets), figsize=(5.5 * len(sets), 4.5), squeeze=False)
    for ax, es in zip(axes[0], sets):
        name = es.text.name
        for kind, style in KIND_STYLE.items():
            pts = [r for r in rows if r["kind"] == kind and name in r["texts"]]
            if not pts:
                continue
            x = [r["bytes_per_vector"] for r in pts]
            y = [100 * r["texts"][name]["delta_rel"] for r in pts]
            hi = [100 * r["texts"][name]["ci95"][1] - yi for r, yi in zip(pts, y)]
            ax.errorbar(x, y, yerr=[[0] * len(hi), hi], ls="none", label=kind, capsize=2, **style)
        ax.axhline(1.0, color="#c33", lw=0.8, ls="--", label="gate +1 %")
        ax.set_ylim(-0.5, 6)
        ax.set_xlabel("bytes per cached head vector (head_dim 64)")
        ax.set_ylabel("ΔPPL (%), bar to the upper 95 % bound")
        ax.set_title(f"{name} ({len(es.base_nll)} tokens)", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_json(path: str, payload: dict) -> None:
    def default(o):
        if isinstance(o, (np.floating, np.integer)):
            return o.item()
        raise TypeError(type(o).__name__)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=default)
