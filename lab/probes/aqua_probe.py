"""AQUA-KV's lever (ICML 2025), measured in the forge's gate: predict a layer's keys from the
previous layer's keys, and its values from the previous layer's values and its own keys,
with small learned linear maps, and code only what the prediction leaves (issue 51, item 2).

Per layer ℓ ≥ 1 (every KV head's vectors of a token concatenated, n_kv · head_dim):

    k̂_ℓ = A_ℓ k̂_{ℓ−1} + code(k_ℓ − A_ℓ k̂_{ℓ−1})
    v̂_ℓ = B_ℓ [v̂_{ℓ−1}; k̂_ℓ] + code(v_ℓ − B_ℓ [v̂_{ℓ−1}; k̂_ℓ])

with k̂, v̂ what the cache holds (the decoder has only those), A and B ridge least squares on
the calibration K/V (the originals: the simplification AQUA-KV's paper also starts from),
and code() the forge's dictionary + residual stage learned on the calibration residuals
(shared by the KV heads, the forge's default settings otherwise). Layer 0 codes its K/V
as they are. The maps' bytes are charged as dictionary memory (fixed), not per vector.

    python lab/probes/aqua_probe.py [--bits 6/4,4/3] [--cache DIR] [--out lab/results/cpu/aqua_kv.json] [--r2-only]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from kvdict_vk import codec
from kvdict_vk.forge import llama, pipeline as P, table
from kvdict_vk.forge.cli import _log

RIDGE = 1e-3  # relative to the mean diagonal of the normal matrix


def _tokens(x: np.ndarray) -> np.ndarray:
    """(n_kv, T, hd) → (T, n_kv · hd)."""
    return x.transpose(1, 0, 2).reshape(x.shape[1], -1).astype(np.float64)


def _heads(x: np.ndarray, n_kv: int) -> np.ndarray:
    """(T, n_kv · hd) → (n_kv, T, hd) float32."""
    return np.ascontiguousarray(x.reshape(x.shape[0], n_kv, -1).transpose(1, 0, 2), np.float32)


def ridge(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """W minimising ‖x W − y‖² + λ‖W‖² (x (N, a), y (N, b)): (a, b)."""
    g = x.T @ x
    lam = RIDGE * np.trace(g) / g.shape[0]
    return np.linalg.solve(g + lam * np.eye(g.shape[0]), x.T @ y)


def predictor_r2(kv: list) -> dict:
    """How much of each layer's K (V) variance its map explains on the calibration vectors
    (in-sample, the originals as input): 1 − ‖y − ŷ‖² / ‖y − ȳ‖², layers 1 … L − 1."""
    out = {"k": [], "v": []}
    for li in range(1, len(kv)):
        kp, vp = _tokens(kv[li - 1][0]), _tokens(kv[li - 1][1])
        kt, vt = _tokens(kv[li][0]), _tokens(kv[li][1])
        xv = np.hstack([vp, kt])
        for key, y, x in (("k", kt, kp), ("v", vt, xv)):
            res = y - x @ ridge(x, y)
            out[key].append(float(1 - (res ** 2).sum() / ((y - y.mean(0)) ** 2).sum()))
    return out


def learn(kv: list, cfg: P.ForgeConfig) -> tuple[list, list, list]:
    """(maps A, maps B, per layer the (K, V) StreamDicts of the residuals)."""
    n_kv = kv[0][0].shape[0]
    a_maps, b_maps, dicts = [None], [None], []
    for li, (k, v) in enumerate(kv):
        kt, vt = _tokens(k), _tokens(v)
        if li:
            kp, vp = _tokens(kv[li - 1][0]), _tokens(kv[li - 1][1])
            a = ridge(kp, kt)
            b = ridge(np.hstack([vp, kt]), vt)
            a_maps.append(a)
            b_maps.append(b)
            kt, vt = kt - kp @ a, vt - np.hstack([vp, kt]) @ b
        pair = []
        for j, x in enumerate((kt, vt)):
            pair.append(P.learn_head_stream(_heads(x, n_kv), cfg, j == 0, cfg.seed + 2 * li + j))
        dicts.append(tuple(pair))
        _log(f"aqua: layer {li} learned")
    return a_maps, b_maps, dicts


class AquaHook(llama.KVHook):
    """The cache as AQUA-KV holds it, layer after layer of one window."""

    def __init__(self, a_maps, b_maps, dicts):
        self.a, self.b, self.dicts, self.prev = a_maps, b_maps, dicts, None

    def __call__(self, layer, k, v):
        n_kv = k.shape[0]
        kt, vt = _tokens(k), _tokens(v)
        pred_k = self.prev[0] @ self.a[layer] if layer else 0.0
        dk, dv = self.dicts[layer]
        k_hat = pred_k + _tokens(codec.roundtrip_heads(_heads(kt - pred_k, n_kv), dk))
        pred_v = np.hstack([self.prev[1], k_hat]) @ self.b[layer] if layer else 0.0
        v_hat = pred_v + _tokens(codec.roundtrip_heads(_heads(vt - pred_v, n_kv), dv))
        self.prev = (k_hat, v_hat)
        return _heads(k_hat, n_kv), _heads(v_hat, n_kv)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", default="6/4,4/3", help="K/V residual bits of each row")
    ap.add_argument("--cache", default="out/forge-long/cache", help="the forge's capture cache")
    ap.add_argument("--out", type=Path, default=Path("lab/results/cpu/aqua_kv.json"))
    ap.add_argument("--r2-only", action="store_true", help="only the maps' explained variance, into --out's file")
    a = ap.parse_args(argv)
    t0 = time.time()
    base = P.ForgeConfig()
    kv = P.calibration_kv(base.calib_tokens, base.window, log=_log, cache_dir=a.cache, files=base.calib_files)
    if a.r2_only:
        doc = json.loads(a.out.read_text()) if a.out.exists() else {}
        doc["predictor_r2"] = dict(predictor_r2(kv), command="python lab/probes/aqua_probe.py " + " ".join(sys.argv[1:] if argv is None else argv))
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
        return 0
    sets = P.eval_sets(base, a.cache)
    out = dict(command="python lab/probes/aqua_probe.py " + " ".join(sys.argv[1:] if argv is None else argv), rows=[],
               notes="ΔPPL against the f32 cache on the forge's gate windows (1024 tokens); bytes per vector "
                     "are the slot's (the maps, 2 · 192 · 192 + 384 · 192 floats a layer, are fixed memory)")
    for spec in a.bits.split(","):
        kb, vb = (int(x) for x in spec.split("/"))
        cfg = dataclasses.replace(base, k_bits=kb, v_bits=vb)
        maps_a, maps_b, dicts = learn(kv, cfg)
        slot = np.mean([d.slot_words * 4 for pair in dicts for d in pair])
        name = f"AQUA-KV predictors + dict {cfg.n_atoms} shared atoms, K {cfg.k_sparsity}+{kb} b, V {cfg.v_sparsity}+{vb} b"
        row = table.Row(name, "dictionary", float(slot), lambda: AquaHook(maps_a, maps_b, dicts))
        measured = table.measure([row], sets, None, log=_log)[0]
        out["rows"].append(measured)
        _log(name + ": " + ", ".join(f"{t} {100 * r['delta_rel']:+.2f} % [{100 * r['ci95'][0]:+.2f}, "
                                     f"{100 * r['ci95'][1]:+.2f}]" for t, r in measured["texts"].items()))
    out["seconds"] = time.time() - t0
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
