"""The GPU encoder against the CPU codec on real SmolLM2 K/V: same atom sets (and, ties
aside, counting a different set of equal per-vector error as the same), identical slots
and relative error, per stream, over every layer of a certified artifact.

    .venv/bin/python lab/probes/encode_agreement.py out/forge/smollm2.q42art \
        out/forge/cache/calib-<hash>.npz [--tokens 256] [--kernel tiled|vector|stepwise] \
        [--out lab/results/lavapipe/encode_agreement.json]

The K/V file is what the forge captured for calibration (`kvdict-forge` caches it under
its cache directory: arrays k<layer>, v<layer> of shape (n_kv, T, head_dim)); the last
``--tokens`` tokens of each layer are encoded by both; ``--kernel vector`` runs the tiled
form's vector kernel (a decode step's) for every batch. Runs on any Vulkan device
(``KVDICT_VK_DEVICE``); on lavapipe the tiled kernel is slow but exact in what it decides.

Run as ``python lab/probes/encode_agreement.py`` from the checkout with the package installed
(``pip install -e .``; scripts/setup.sh's .venv has it): the probe uses kvdict_vk's
public API only, and lab/ is not part of the package.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("kv", help="npz with k<layer>, v<layer> arrays (n_kv, T, head_dim)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--kernel", default="tiled", choices=("tiled", "vector", "stepwise", "auto"))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    from kvdict_vk import codec
    from kvdict_vk.artifact import read_artifact
    from kvdict_vk.vk.device import get_device
    from kvdict_vk.vk.encode.encoder import GpuEncoder

    cert, art = read_artifact(a.artifact)
    kv = np.load(a.kv)
    dev = get_device(None)
    t0 = time.time()
    # vectors, same sets, identical slots, Σ rel err² gpu, cpu, flips of equal error
    totals = {"k": [0, 0, 0, 0.0, 0.0, 0], "v": [0, 0, 0, 0.0, 0.0, 0]}
    per_layer = []
    for layer, pair in enumerate(art.layers):
        row = {"layer": layer}
        for name, d in zip("kv", pair):
            x = np.ascontiguousarray(kv[f"{name}{layer}"][:, -a.tokens:], np.float32)
            form = dict(kernel="tiled", vector_per_head=x.shape[1]) if a.kernel == "vector" else dict(kernel=a.kernel)
            with GpuEncoder(dev, d, **form) as enc:
                gpu = enc.encode(x)
            cpu = codec.encode_heads(x, d)
            s = d.sparsity
            gi, ci = (np.sort(codec.unpack_codes(w[..., :s])[0], -1) for w in (gpu, cpu))
            same_set = (gi == ci).all(-1)
            same, ident = int(same_set.sum()), int((gpu == cpu).all(-1).sum())
            ref = np.sum(x.astype(np.float64) ** 2)
            vg = np.sum((codec.decode_heads(gpu, d) - x) ** 2, -1)
            vc = np.sum((codec.decode_heads(cpu, d) - x) ** 2, -1)
            # a tie: another atom set that reconstructs as well (per-vector error within 1e-5)
            ties = int((~same_set & (np.abs(vg - vc) <= 1e-5 * np.maximum(vc, 1e-30))).sum())
            eg, ec = float(vg.sum()), float(vc.sum())
            n = x.shape[0] * x.shape[1]
            t = totals[name]
            t[0] += n; t[1] += same; t[2] += ident; t[3] += eg / ref; t[4] += ec / ref; t[5] += ties
            row[name] = {"vectors": n, "same_atom_sets": same / n, "identical_slots": ident / n,
                         "equal_error_flips": ties, "rel_error_gpu": eg / ref, "rel_error_cpu": ec / ref}
        per_layer.append(row)
        print(f"layer {layer}: " + ", ".join(f"{n} same {row[n]['same_atom_sets']:.4f} identical "
                                             f"{row[n]['identical_slots']:.4f}" for n in "kv"), file=sys.stderr)
    n_layers = len(art.layers)
    summary = {name: {"vectors": t[0], "same_atom_sets": t[1] / t[0], "identical_slots": t[2] / t[0],
                      "same_atom_sets_ties_aside": (t[1] + t[5]) / t[0],
                      "mean_rel_error_gpu": t[3] / n_layers, "mean_rel_error_cpu": t[4] / n_layers,
                      "rel_error_difference": abs(t[3] - t[4]) / t[4]}
               for name, t in totals.items()}
    out = {"command": "python lab/probes/encode_agreement.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "device": dev.name, "kernel": a.kernel, "artifact": Path(a.artifact).name, "tokens_per_layer": a.tokens,
           "seconds": time.time() - t0, "summary": summary, "layers": per_layer}
    print(json.dumps(summary, indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
