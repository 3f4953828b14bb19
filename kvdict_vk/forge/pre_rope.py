"""The pre-RoPE-keys lever (#14): key dictionaries learned on, and coding, the keys before
RoPE rotates them — where a channel's statistics do not turn with the token's position —,
measured on the forge's evaluation texts beside key dictionaries learned on the rotated keys
(the engine's choice), both from the same calibration capture, the same configuration and the
same value dictionaries, both through the forge's codec (``codec.roundtrip_heads``).

The engine runs it since stop 65 (``kvdict-forge --pre-rope-keys 1``: the artifact's key_rope,
kvdict_vk.rope; attend_direct turns each decoded key — the q·atom table of attend_flash_coded
cannot, since a turned atom differs per position). This measures it beside the rotated keys.

    python -m kvdict_vk.forge.pre_rope --k-bits 4 --v-bits 3 --out docs/results/fidelity_levers/pre_rope_keys_k4v3.json
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys

import numpy as np

from .. import codec
from ..dictionary import KvDictArtifact
from . import llama, table
from . import pipeline as P
from .allocate import with_bits
from .coef_fp8 import coded_bytes, fp8_roundtrip
from .residual_only import DictLeverHook


class CodecHook(DictLeverHook):
    """Every coded stream through the codec (post-RoPE keys: the engine's layout)."""

    def code(self, d, x, atoms_only):
        return codec.roundtrip_heads(x, d)


class PreRopeKeysHook(llama.KVHook):
    """An artifact whose key dictionaries were learned on pre-RoPE keys: its keys coded before
    RoPE, its values after; a passthrough stream stays as it is. ``fp8``: the coefficients
    rounded to E4M3 (forge.coef_fp8) in both streams."""

    def __init__(self, art, fp8: bool = False):
        self.art, self.fp8 = art, fp8

    def roundtrip(self, d, x):
        return fp8_roundtrip(d, x).astype(np.float32) if self.fp8 else codec.roundtrip_heads(x, d)

    def keys_pre_rope(self, layer, k):
        d = self.art.stream(layer, True)
        return k if d is None else self.roundtrip(d, k)

    def __call__(self, layer, k, v):
        d = self.art.stream(layer, False)
        return k, (v if d is None else self.roundtrip(d, v))


def with_keys_of(keys, art) -> KvDictArtifact:
    """``art`` with the key streams of ``keys`` (the same model, sizes and atoms count)."""
    return KvDictArtifact(art.head_dim, art.n_atoms, max(keys.sparsity, art.sparsity),
                          [(kp[0], pair[1]) for kp, pair in zip(keys.layers, art.layers)])


def rows(cfg: P.ForgeConfig, log, cache_dir=None, pre_only: bool = False, fp8: bool = False,
         recode: tuple = ()) -> list:
    """The two rows: key dictionaries learned on rotated keys, and on pre-RoPE keys (only
    the second with ``pre_only``: the rotated keys' dictionaries are then not learned).
    ``fp8``: the pre-RoPE row again with E4M3 coefficients (3-byte code words); ``recode``:
    ((K bits, V bits), …) — the pre-RoPE row (with fp8: its fp8 row) re-coded at those
    residual bits (the atoms and scales do not depend on them: forge.allocate.with_bits)."""
    kv3 = P.calibration_kv(cfg.calib_tokens, cfg.window, log=log, cache_dir=cache_dir, files=cfg.calib_files,
                           pre_rope_keys=True)
    n = len(kv3)
    log("learning the value dictionaries" + ("" if pre_only else " and the rotated-key ones"))
    art = P.learn_artifact([(k, v) for k, v, _ in kv3],
                           dataclasses.replace(cfg, passthrough=[f"k:{i}" for i in range(n)]) if pre_only else cfg)
    log("learning the pre-RoPE key dictionaries")
    keys = P.learn_artifact([(kp, v) for _, v, kp in kv3], dataclasses.replace(cfg, passthrough=[f"v:{i}" for i in range(n)]))
    pre = with_keys_of(keys, art)
    ident = lambda a: table.digest(*[x for pair in a.layers for d in pair if d is not None  # noqa: E731
                                     for x in (d.atoms, d.mean, d.residual_scale)])
    name = f"dict {cfg.n_atoms} atoms, K {cfg.k_sparsity}+{cfg.k_bits} b, V {cfg.v_sparsity}+{cfg.v_bits} b (codec)"
    out = [] if pre_only else [table.Row(name, "dictionary", coded_bytes(art, 4), lambda: CodecHook(art), ident(art))]
    variants = [(cfg.k_bits, cfg.v_bits, False)] + ([(cfg.k_bits, cfg.v_bits, True)] if fp8 else [])
    variants += [(kb, vb, fp8) for kb, vb in recode]
    for kb, vb, f8 in variants:
        a = with_bits(pre, {(li, kv): kb if kv else vb for li in range(n) for kv in (True, False)})
        label = name.replace(f"K {cfg.k_sparsity}+{cfg.k_bits} b, V {cfg.v_sparsity}+{cfg.v_bits} b",
                             f"K {cfg.k_sparsity}+{kb} b, V {cfg.v_sparsity}+{vb} b")
        label += ", keys coded before RoPE" + (" + fp8 coefficients" if f8 else "")
        out.append(table.Row(label, "dictionary", coded_bytes(a, 3 if f8 else 4),
                             lambda a=a, f8=f8: PreRopeKeysHook(a, f8), ident(a),
                             "lever: pre-RoPE keys" + (", E4M3 coefficients (not in the engine)" if f8 else "")))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvdict_vk.forge.pre_rope", description=__doc__.split("\n\n")[0])
    ap.add_argument("--k-bits", type=int, default=P.ForgeConfig.k_bits)
    ap.add_argument("--v-bits", type=int, default=P.ForgeConfig.v_bits)
    ap.add_argument("--n-atoms", type=int, default=P.ForgeConfig.n_atoms)
    ap.add_argument("--calib-tokens", type=int, default=P.ForgeConfig.calib_tokens)
    ap.add_argument("--train-vectors", type=int, default=P.ForgeConfig.train_vectors)
    ap.add_argument("--iters", type=int, default=P.ForgeConfig.iters)
    ap.add_argument("--pre-only", action="store_true", help="only the pre-RoPE row (the rotated keys are not learned)")
    ap.add_argument("--fp8", action="store_true", help="the pre-RoPE row also with E4M3 coefficients")
    ap.add_argument("--recode", default="", help="K/V residual bits to re-code the pre-RoPE row at, e.g. 4/2,3/3")
    ap.add_argument("--cache", default="out/forge/cache", help="the forge's cache (evaluation sets, rows)")
    ap.add_argument("--out", default=None, help="JSON of the rows (default stdout)")
    a = ap.parse_args(argv)
    log = lambda m: print(f"[pre_rope] {m}", file=sys.stderr, flush=True)  # noqa: E731
    cfg = P.ForgeConfig(k_bits=a.k_bits, v_bits=a.v_bits, n_atoms=a.n_atoms, calib_tokens=a.calib_tokens,
                        train_vectors=a.train_vectors, iters=a.iters)
    sets = P.eval_sets(cfg, a.cache)
    recode = tuple(tuple(int(b) for b in x.split("/")) for x in a.recode.split(",") if x)
    measured = table.measure(rows(cfg, log, a.cache, a.pre_only, a.fp8, recode), sets, a.cache, log=log)
    print(table.markdown(measured, sets), file=sys.stderr)
    table.write_doc({"command": "python -m kvdict_vk.forge.pre_rope " + shlex.join(sys.argv[1:] if argv is None else argv),
                     "rows": measured}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
