"""Residual bits per layer and stream by their measured cost (issue 14's lever "bytes
allocated per layer and stream by marginal ΔPPL").

A learned artifact's atoms and residual scales do not depend on the residual bit count
(forge.pipeline learns the scales from what the atoms leave), so one artifact can be
re-coded at any bits per (layer, stream) without learning again. This module

1. measures each coded stream's sensitivity on calibration text: the mean KL divergence
   of the next-token distribution from the f32 cache's when only that stream is coded, at
   ``probe`` bits, every other stream exact (KL rather than the target's NLL: it is never
   negative, and one stream's effect on NLL is below a window's noise);
2. models a stream at b bits as KL_i(probe) · 4^(probe − b) (the residual's error power falls
   by 4 a bit; KL is quadratic in a small perturbation) and adds the streams (independent
   small perturbations);
3. allocates greedily: from ``max_bits`` everywhere, take a bit from the stream whose modelled
   KL grows least, until the average slot is within the byte budget (optimal for a separable
   convex cost).

The allocation is then certified like any artifact (``with_bits`` gives one; the caller runs
it through forge.pipeline.certify_artifact on the evaluation texts, which stay disjoint from
the calibration windows measured here).

    python -m kvdict_vk.forge.allocate ARTIFACT --target-bytes 48,40 [--windows 2] [--out F]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np

from .. import artifact as A
from .. import codec
from ..dictionary import KvDictArtifact
from ..residual import MAX_BITS, slot_words
from . import llama, parallel, pipeline as P, table

CHUNK = 128  # logits rows at a time


def with_bits(art: KvDictArtifact, bits: dict) -> KvDictArtifact:
    """``art`` with residual bits ``bits[(layer, k_not_v)]`` (≥ 1) for its coded streams; the
    atoms, means and residual scales unchanged."""
    layers = []
    for li, pair in enumerate(art.layers):
        layers.append(tuple(None if d is None else dataclasses.replace(d, residual_bits=bits[(li, j == 0)])
                            for j, d in enumerate(pair)))
    return KvDictArtifact(art.head_dim, art.n_atoms, art.sparsity, layers)


def stream_bytes(head_dim: int, sparsity: int, bits: int) -> int:
    return 4 * slot_words(head_dim, sparsity, bits)


def mean_bytes(art: KvDictArtifact, bits: dict) -> float:
    """Average slot bytes per head vector over the coded streams (P.bytes_per_vector's rule)."""
    return float(np.mean([stream_bytes(art.head_dim, d.sparsity, bits[(li, j == 0)])
                          for li, pair in enumerate(art.layers) for j, d in enumerate(pair) if d is not None]))


class OneStreamHook(llama.KVHook):
    """Only (layer, stream) coded, at ``bits``; every other stream exact."""

    def __init__(self, art: KvDictArtifact, layer: int, k_not_v: bool, bits: int):
        self.d = dataclasses.replace(art.stream(layer, k_not_v), residual_bits=bits)
        self.layer, self.k_not_v = layer, k_not_v

    def __call__(self, layer, k, v):
        if layer != self.layer:
            return k, v
        if self.k_not_v:
            return codec.roundtrip_heads(k, self.d), v
        return k, codec.roundtrip_heads(v, self.d)


def _log_probs(tokens, hook=None) -> np.ndarray:
    """(T, vocab) float32 log-softmax of the logits."""
    m = llama.load_model()
    h = llama.final_hidden(tokens, hook, m)
    out = np.empty((h.shape[0], m.output.shape[0]), np.float32)
    for s in range(0, h.shape[0], CHUNK):
        z = (h[s:s + CHUNK] @ m.output.T).astype(np.float64)
        z -= z.max(axis=-1, keepdims=True)
        z -= np.log(np.exp(z).sum(axis=-1, keepdims=True))
        out[s:s + CHUNK] = z
    return out


def _kl(base: np.ndarray, coded: np.ndarray) -> float:
    """Mean over tokens of KL(p_base ‖ p_coded), from log-probabilities."""
    total = 0.0
    for s in range(0, base.shape[0], CHUNK):
        b, c = base[s:s + CHUNK].astype(np.float64), coded[s:s + CHUNK].astype(np.float64)
        total += float((np.exp(b) * (b - c)).sum())
    return total / base.shape[0]


def sensitivity(art: KvDictArtifact, windows: list, probe: dict, log=print) -> dict:
    """{(layer, k_not_v): mean KL over the windows' tokens with only that stream coded at
    probe[k_not_v] bits}. BLAS at one thread (forge.certify says why)."""
    streams = [(li, j == 0) for li, pair in enumerate(art.layers) for j, d in enumerate(pair) if d is not None]
    out = {}
    with parallel.blas_threads(1):
        bases = [_log_probs(w) for w in windows]
        t0 = time.perf_counter()
        for n, (li, kv) in enumerate(streams):
            kl = [_kl(b, _log_probs(w, OneStreamHook(art, li, kv, probe[kv]))) for w, b in zip(windows, bases)]
            out[(li, kv)] = float(np.mean(kl))
            log(f"{'K' if kv else 'V'}{li} at {probe[kv]} bits: KL {out[(li, kv)]:.3e} "
                f"({n + 1}/{len(streams)}, {time.perf_counter() - t0:.0f} s)")
    return out


def allocate(art: KvDictArtifact, sens: dict, probe: dict, target_bytes: float, min_bits: int = 1,
             max_bits: int = MAX_BITS) -> dict:
    """Bits per stream within ``target_bytes`` on average, least modelled KL (greedy)."""
    bits = {key: max_bits for key in sens}
    model = lambda key, b: sens[key] * 4.0 ** (probe[key[1]] - b)  # noqa: E731
    while mean_bytes(art, bits) > target_bytes:
        cands = [key for key, b in bits.items() if b > min_bits]
        if not cands:
            raise ValueError(f"{target_bytes} B per vector is below {min_bits} bit everywhere")
        key = min(cands, key=lambda k: (model(k, bits[k] - 1) - model(k, bits[k]), k))
        bits[key] -= 1
    return bits


def modelled_kl(sens: dict, probe: dict, bits: dict) -> float:
    return float(sum(s * 4.0 ** (probe[key[1]] - bits[key]) for key, s in sens.items()))


def _certify(art: KvDictArtifact, allocations: list, uniform: list, cache: str, log, min_bits: int) -> list:
    """Every allocation and uniform (K bits, V bits) through the engine's reconstruct path
    (forge.levers' installed RuntimeHook) on the forge's evaluation texts: table rows."""
    from . import levers
    cfg = P.ForgeConfig()
    sets = P.eval_sets(cfg, cache)
    n = len(art.layers)
    todo = [(f"dict {art.n_atoms} atoms, K/V bits by layer (allocated, {al['target_bytes']:g} B, ≥ {min_bits} b)",
             {(li, kv): al["k_bits" if kv else "v_bits"][li] for li in range(n) for kv in (True, False)})
            for al in allocations]
    todo += [(f"dict {art.n_atoms} atoms, K {art.layers[0][0].sparsity}+{kb} b, V {art.layers[0][1].sparsity}+{vb} b",
              {(li, kv): kb if kv else vb for li in range(n) for kv in (True, False)}) for kb, vb in uniform]
    rows = []
    for name, bits in todo:
        coded = with_bits(art, bits)
        ident = table.digest(*[x for pair in coded.layers for d in pair if d is not None
                               for x in (d.atoms, d.residual_scale, np.array([d.residual_bits]))])
        rows.append(table.Row(name, "dictionary", mean_bytes(art, bits),
                              lambda coded=coded: levers.Installed(coded, P.RuntimeHook(coded.window)), ident,
                              "lever: residual bits per layer and stream" if "allocated" in name else ""))
    measured = table.measure(rows, sets, cache, log=log)
    print(table.markdown(measured, sets), file=sys.stderr)  # stdout is the JSON's when --out is not given
    return measured


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvdict_vk.forge.allocate", description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", help="a learned .q42art (certified or not: only its dictionaries are used)")
    ap.add_argument("--target-bytes", type=lambda s: [float(x) for x in s.split(",")], default=[48.0])
    ap.add_argument("--windows", type=int, default=2, help="calibration windows for the sensitivities")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--calib-files", type=lambda s: tuple(s.split(",")), default=None,
                    help="calibration files (default: the licenses but the evaluation texts)")
    ap.add_argument("--probe-k", type=int, default=2)
    ap.add_argument("--probe-v", type=int, default=2)
    ap.add_argument("--min-bits", type=int, default=1, help="fewest residual bits a stream may get")
    ap.add_argument("--sensitivity", default=None,
                    help="reuse the sensitivities of an earlier run's JSON (same artifact and probe bits)")
    ap.add_argument("--uniform", type=lambda s: [tuple(int(b) for b in x.split("/")) for x in s.split(",")],
                    default=[], help="uniform K/V bits to certify beside the allocations, e.g. 4/3,3/2")
    ap.add_argument("--certify", action="store_true",
                    help="measure every allocation (and --uniform) on the evaluation texts, as the forge's gate")
    ap.add_argument("--cache", default="out/forge/cache", help="the forge's cache (evaluation sets, rows)")
    ap.add_argument("--out", default=None, help="JSON: sensitivities and allocations (default stdout)")
    a = ap.parse_args(argv)
    _, art = A.read_artifact(a.artifact, require_certified=False)
    log = lambda m: print(f"[allocate] {m}", file=sys.stderr, flush=True)  # noqa: E731
    files = P.calibration_files(a.calib_files)
    windows = P.calibration_windows(files, a.window, a.windows, bool(a.calib_files))
    probe = {True: a.probe_k, False: a.probe_v}
    if a.sensitivity:
        with open(a.sensitivity) as f:
            old = json.load(f)
        if old["artifact"] != a.artifact or old["probe_bits"] != dict(k=a.probe_k, v=a.probe_v):
            raise SystemExit(f"{a.sensitivity}: measured on {old['artifact']} at {old['probe_bits']}")
        sens = {(e["layer"], e["stream"] == "k"): e["kl"] for e in old["sensitivity"]}
    else:
        sens = sensitivity(art, windows, probe, log)
    allocations = []
    for target in a.target_bytes:
        bits = allocate(art, sens, probe, target, min_bits=a.min_bits)
        allocations.append(dict(target_bytes=target, bytes_per_vector=mean_bytes(art, bits),
                                modelled_kl=modelled_kl(sens, probe, bits),
                                k_bits=[bits[(li, True)] for li in range(len(art.layers))],
                                v_bits=[bits[(li, False)] for li in range(len(art.layers))]))
        log(f"{target} B: K bits {allocations[-1]['k_bits']}, V bits {allocations[-1]['v_bits']}")
    rows = _certify(art, allocations, a.uniform, a.cache, log, a.min_bits) if a.certify else []
    doc = dict(command=" ".join(["python -m kvdict_vk.forge.allocate"] + list(sys.argv[1:] if argv is None else argv)),
               artifact=a.artifact, probe_bits=dict(k=a.probe_k, v=a.probe_v), min_bits=a.min_bits,
               sensitivity_from=a.sensitivity,
               calibration=[dict(path=f) for f in files], windows=len(windows), window=a.window,
               sensitivity=[dict(layer=li, stream="k" if kv else "v", kl=s) for (li, kv), s in sorted(sens.items())],
               allocations=allocations, rows=rows)
    table.write_doc(doc, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
