"""The ΔPPL-vs-bytes curve: plain dictionaries (atoms only) across sparsity and atom
counts, K and V separately and together, next to the residual-stage configurations and
the baselines of the fidelity table — every point on the same windows of every evaluation
text, paired against the f32 cache, one table per text.

One dictionary per (stream, KV head, n_atoms) is learned at sparsity `learn_sparsity`
and then used at every sparsity of the sweep (OMP picks s atoms from it): learning one
per (s, n_atoms) would multiply the cost by six for a small gain at the other s, and
the curve says so in its JSON.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

from .. import codec
from ..dictionary import KvDictArtifact
from ..residual import slot_words
from . import llama, pipeline as P, report, table
from . import residual_only as R

SPARSITIES = (4, 6, 8, 12, 16, 24)
ATOMS = (1024, 4096, 16384)
RESIDUAL_CONFIGS = ((4, 4, 4, 3), (4, 4, 4, 2), (2, 4, 4, 2), (4, 3, 4, 3))  # (ks, kbits, vs, vbits)


class SweepHook(llama.KVHook):
    """Code K and/or V of every layer with `art` at the given per-stream (sparsity, bits)."""

    def __init__(self, art: KvDictArtifact, k: tuple | None, v: tuple | None):
        self.art, self.spec = art, {True: k, False: v}

    def __call__(self, layer, k, v):
        out = []
        for k_not_v, x in ((True, k), (False, v)):
            spec, d = self.spec[k_not_v], self.art.stream(layer, k_not_v)
            if spec is None or d is None:
                out.append(x)
                continue
            s, bits = spec
            dd = dataclasses.replace(d, sparsity=s, residual_bits=bits,
                                     residual_scale=d.residual_scale if bits else None)
            out.append(codec.roundtrip_heads(x, dd))
        return out[0], out[1]


def slot_bytes(head_dim: int, s: int, bits: int) -> int:
    return 4 * slot_words(head_dim, s, bits)


def run_curve(cfg: P.ForgeConfig, out: str, log=print, atoms=ATOMS, sparsities=SPARSITIES,
              learn_sparsity: int = 8, residual_configs=RESIDUAL_CONFIGS) -> int:
    os.makedirs(out, exist_ok=True)
    cache = os.path.join(out, "cache")
    kv = P.calibration_kv(cfg.calib_tokens, cfg.window, log=log, cache_dir=cache, files=cfg.calib_files)
    sets = P.eval_sets(cfg, cache)
    hd = kv[0][0].shape[-1]
    rows: list = []

    def measure(new_rows):
        rows.extend(table.measure(new_rows, sets, cache, log=log))
        _save(out, rows, sets, cfg, learn_sparsity)

    for n_atoms in atoms:
        c = dataclasses.replace(cfg, n_atoms=n_atoms, k_sparsity=learn_sparsity, v_sparsity=learn_sparsity,
                                k_bits=0, v_bits=0, train_vectors=max(cfg.train_vectors, 2 * n_atoms))
        t0 = time.perf_counter()
        art = P.learn_artifact(kv, c)
        log(f"learned plain dictionaries, {n_atoms} atoms ({time.perf_counter() - t0:.0f} s)")
        ident = table.digest(*[d.atoms for pair in art.layers for d in pair if d is not None])
        points = []
        for s in sparsities:
            b = slot_bytes(hd, s, 0)
            for target, k, v, bpv in (("K", (s, 0), None, (b + 4 * hd) / 2), ("V", None, (s, 0), (b + 4 * hd) / 2),
                                      ("KV", (s, 0), (s, 0), b)):
                points.append(table.Row(f"atoms {n_atoms} s{s} {target}", "dictionary", bpv,
                                        lambda art=art, k=k, v=v: SweepHook(art, k, v), ident,
                                        f"plain atoms, {target} coded (the other stream f32)"))
        measure(points)
    # The residual-stage configurations, learned as the forge learns them.
    for ks, kb, vs, vb in residual_configs:
        c = dataclasses.replace(cfg, k_sparsity=ks, k_bits=kb, v_sparsity=vs, v_bits=vb)
        art = P.learn_artifact(kv, c)
        ident = table.digest(*[a for pair in art.layers for d in pair if d is not None
                               for a in (d.atoms, d.residual_scale)])
        bpv = (slot_bytes(hd, ks, kb) + slot_bytes(hd, vs, vb)) / 2
        measure([table.Row(P.dict_row_name(c), "dictionary", bpv,
                           lambda art=art, ks=ks, kb=kb, vs=vs, vb=vb: SweepHook(art, (ks, kb), (vs, vb)), ident)])
    measure(table.baseline_rows(R.learn_means_scales(kv), hd, cfg.window))
    one_stream = ("plain atoms, K ", "plain atoms, V ")  # the plot shows K-and-V caches only
    report.plot_texts([r for r in rows if not r["note"].startswith(one_stream)], sets, os.path.join(out, "curve.png"))
    md = table.markdown(rows, sets)
    with open(os.path.join(out, "curve.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


def _save(out, rows, sets, cfg, learn_sparsity):
    doc = table.fidelity_json(rows, sets, "kvdict-forge curve", P.dict_row_name(cfg))
    doc.update(config=dataclasses.asdict(cfg), learn_sparsity=learn_sparsity,
               note="plain dictionaries learned once per n_atoms at learn_sparsity, used at every s")
    with open(os.path.join(out, "curve.json"), "w") as f:
        json.dump(doc, f, indent=1, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
