"""Forge reports: the summary JSON and the per-text plot (the tables are forge.table's)."""
from __future__ import annotations

import json
import os

import numpy as np


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
