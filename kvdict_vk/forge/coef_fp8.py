"""The fp8-coefficient lever (#14; Lexico stores each code word in 3 bytes): the learned
dictionaries with every coefficient rounded to OCP FP8 E4M3 before the residual stage
sees what the atoms leave, measured on the forge's evaluation texts beside the artifact
as stored (binary16 coefficients).

A code word is then 3 bytes — a 10-bit atom index (up to 1024 atoms; 12 bits up to 4096)
and an 8-bit coefficient fit in 24 bits — so a slot of s code words is s bytes smaller.
The engine's slot format does not implement it (its code words are 32-bit: docs/FORMAT.md);
this measures what it would buy first.

    python -m kvdict_vk.forge.coef_fp8 out/forge/exp_k4v3_a4096.q42art --out docs/results/fidelity_levers/fp8_coefficients_4096_atoms.json
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys

import numpy as np

from .. import artifact as A
from .. import codec
from . import pipeline as P
from . import table
from .residual_only import DictLeverHook, quantise_residual

E4M3_MAX = 448.0  # the largest finite E4M3 value (no infinities in the format)
E4M3_MANTISSA_BITS = 3
E4M3_MIN_EXP = -6  # the smallest normal exponent; below it the subnormals' step 2^-9


def e4m3(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest E4M3 value (ties to even), saturating at ±448; zeros and
    signs kept. Every E4M3 value is a binary16 value, so the result packs exactly (the hook
    rounds the stored binary16 coefficient: OMP's own is not public)."""
    x = np.asarray(x, np.float64)
    mag = np.abs(x)
    exp = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    quantum = np.exp2(np.maximum(exp, E4M3_MIN_EXP) - E4M3_MANTISSA_BITS)
    rounded = np.minimum(np.rint(mag / quantum) * quantum, E4M3_MAX)  # rint: ties to even
    return np.copysign(rounded, x).astype(np.float32)


def fp8_roundtrip(d, x: np.ndarray) -> np.ndarray:
    """What stream ``d``'s cache would return for x (n_kv, T, head_dim) with E4M3
    coefficients: OMP as the engine runs it, the coefficients rounded, the atoms'
    reconstruction from those, then the residual stage (the stream's static per-channel
    scale and bits) over what that leaves."""
    atoms_only = dataclasses.replace(d, residual_bits=0, residual_scale=None)
    idx, coef = codec.unpack_codes(codec.encode_heads(x, atoms_only))
    approx = codec.decode_heads(codec.pack_codes(idx, e4m3(coef)), atoms_only)
    if not d.residual_bits:
        return approx
    scale = np.broadcast_to(d.residual_scale, (x.shape[0], d.head_dim))
    return approx + quantise_residual(np.asarray(x, np.float64) - approx, scale, d.residual_bits)


class Fp8CoefHook(DictLeverHook):
    """Each coded stream through fp8_roundtrip; passthrough streams unchanged."""

    def code(self, d, x, atoms_only):
        return fp8_roundtrip(d, x)


def coded_bytes(art, code_word_bytes: float) -> float:
    """Bytes per cached head vector (pipeline.bytes_per_vector's average over every stream,
    passthrough at f32) with code words of ``code_word_bytes`` instead of 4."""
    saved = np.mean([0 if d is None else (4 - code_word_bytes) * d.sparsity for pair in art.layers for d in pair])
    return P.bytes_per_vector(art, art.head_dim)["all"] - float(saved)


def rows(art, stored: bool = True) -> list:
    """The artifact as stored (binary16 coefficients, through the engine's reconstruct
    path; unless not ``stored``) and with E4M3 coefficients."""
    from .levers import Installed
    # forge.allocate's identity of a re-coded artifact, so its uniform rows' cached results are reused
    ident = table.digest(*[x for pair in art.layers for d in pair if d is not None
                           for x in (d.atoms, d.residual_scale, np.array([d.residual_bits]))])
    k, v = art.layers[0]
    name = f"dict {art.n_atoms} atoms, K {k.sparsity}+{k.residual_bits} b, V {v.sparsity}+{v.residual_bits} b"
    out = [table.Row(name, "dictionary", coded_bytes(art, 4), lambda: Installed(art, P.RuntimeHook(art.window)), ident)]
    out.append(table.Row(name + " + fp8 coefficients", "dictionary", coded_bytes(art, 3), lambda: Fp8CoefHook(art),
                         ident, "lever: E4M3 coefficients, 3-byte code words (not in the slot format)"))
    return out if stored else out[1:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvdict_vk.forge.coef_fp8", description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", help="a learned .q42art (certified or not: only its dictionaries are used)")
    ap.add_argument("--bits", type=lambda s: tuple(int(b) for b in s.split("/")), default=None,
                    help="K/V residual bits to re-code the artifact at first (forge.allocate.with_bits), e.g. 4/2")
    ap.add_argument("--fp8-only", action="store_true", help="skip the row with the stored binary16 coefficients")
    ap.add_argument("--cache", default="out/forge/cache", help="the forge's cache (evaluation sets, rows)")
    ap.add_argument("--out", default=None, help="JSON of the rows (default stdout)")
    a = ap.parse_args(argv)
    _, art = A.read_artifact(a.artifact, require_certified=False)
    if a.bits:
        from .allocate import with_bits
        art = with_bits(art, {(li, kv): a.bits[0] if kv else a.bits[1] for li in range(len(art.layers))
                              for kv in (True, False)})
    log = lambda m: print(f"[coef_fp8] {m}", file=sys.stderr, flush=True)  # noqa: E731
    sets = P.eval_sets(P.ForgeConfig(), a.cache)
    measured = table.measure(rows(art, stored=not a.fp8_only), sets, a.cache, log=log)
    print(table.markdown(measured, sets), file=sys.stderr)
    table.write_doc({"command": "python -m kvdict_vk.forge.coef_fp8 " + shlex.join(sys.argv[1:] if argv is None else argv),
                     "artifact": a.artifact, "rows": measured}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
