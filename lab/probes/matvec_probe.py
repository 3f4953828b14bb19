"""fwd_matvec alone: what one matvec of the device forward costs, and what in it.

Each case is a chain of --n dispatches of fwd_matvec(_sg) over random weights of one of the
forward's shapes, a barrier on the output after each (as the forward records them), timed by
timestamps around the chain (median over --runs after warm-up), per dispatch. The dependent
dispatch floor (lab/probes/dispatch_floor_probe.py) is what a dispatch costs that does nothing.
Cases vary the matrix (SmolLM2-135M's gate + up, down, O, Q/K/V rows, LM head), how x is read
(the forward's mode, or plain: no norm, no SwiGLU), the weights' format, row_threads, and the
LM head's workgroups (capped at the forward's MATVEC_WORKGROUPS, or one pass).

``--make-variants`` builds probe variants of the shaders into lab/spv_probe/<name> first
(VARIANTS: source edits of matvec.glsl); ``--variant NAME`` runs the cases with that build
(in its own process: $KVDICT_VK_SPV_DIR).

    python lab/probes/matvec_probe.py [--make-variants] [--variant base|batch4] [--n 64] [--runs 10] [--out F]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SPV_PROBE = ROOT / "lab" / "spv_probe"

# matvec.glsl's chunk loop, and a build that loads BATCH chunks of a row before it uses any
_LOOP = """        for (uint c = lane; c < n_cols / 8u; c += ROW_THREADS) {
            vec4 lo, hi, xl, xh;
            block_chunk(w_word + r * row_words + (c / 4u) * BLOCK_WORDS, c & 3u, lo, hi);
"""
_BATCH4 = """        for (uint c0 = lane; c0 < n_cols / 8u; c0 += 4u * ROW_THREADS) {
          vec4 blo[4], bhi[4];
          [[unroll]] for (uint k = 0u; k < 4u; ++k)
            if (c0 + k * ROW_THREADS < n_cols / 8u)
              block_chunk(w_word + r * row_words + ((c0 + k * ROW_THREADS) / 4u) * BLOCK_WORDS,
                          (c0 + k * ROW_THREADS) & 3u, blo[k], bhi[k]);
          [[unroll]] for (uint k = 0u; k < 4u; ++k) {
            uint c = c0 + k * ROW_THREADS;
            if (c >= n_cols / 8u)
                break;
            vec4 lo = blo[k], hi = bhi[k], xl, xh;
"""
VARIANTS = {"batch4": [("matvec.glsl", _LOOP, _BATCH4),
                       ("matvec.glsl", "            acc += dot(lo, xl) + dot(hi, xh);\n        }\n",
                        "            acc += dot(lo, xl) + dot(hi, xh);\n          }\n        }\n")]}

# (label, format, n_rows, n_cols, x mode, row_threads, one pass)
CASES = [("gate+up", "q4_1", 3072, 576, "rms_norm", rt, False) for rt in (8, 16, 32, 64)] + [
    ("gate+up plain x", "q4_1", 3072, 576, "plain", 32, False),
    ("gate+up 1/8 rows", "q4_1", 384, 576, "rms_norm", 32, False),
    ("gate+up 1/8 rows plain x", "q4_1", 384, 576, "plain", 32, False),
    ("gate+up f32", "f32", 3072, 576, "rms_norm", 32, False),
    ("down", "q4_1", 576, 1536, "swiglu", 16, False), ("down", "q4_1", 576, 1536, "swiglu", 32, False),
    ("down", "q4_1", 576, 1536, "swiglu", 64, False),
    ("down plain x", "q4_1", 576, 1536, "plain", 32, False),
    ("o", "q4_1", 576, 576, "plain", 32, False), ("o", "q4_1", 576, 576, "plain", 8, False),
    ("qkv rows", "q4_1", 960, 576, "rms_norm", 32, False),
    ("lm head", "q8_0", 49152, 576, "rms_norm", 32, False), ("lm head one pass", "q8_0", 49152, 576, "rms_norm", 32, True),
]


def make_variants() -> None:
    for name, edits in VARIANTS.items():
        src = Path("/tmp") / f"matvec_probe_{name}"
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(ROOT / "shaders", src)
        for fname, old, new in edits:
            text = (src / fname).read_text()
            if old not in text:
                raise SystemExit(f"{name}: {fname} no longer has the edited text")
            (src / fname).write_text(text.replace(old, new, 1))
        subprocess.run([sys.executable, "-m", "kvdict_vk.vk.shader_build", "--shaders", str(src),
                        "--out", str(SPV_PROBE / name)], check=True)


def run_cases(n: int, runs: int) -> list:
    from kvdict_vk.vk import get_device
    from kvdict_vk.vk.abi import WG_SIZE
    from kvdict_vk.vk.forward.model import MATVEC_WORKGROUPS
    from kvdict_vk.vk.forward.specs import X_MODES
    from kvdict_vk.vk.forward.weights import BLOCK_WORDS, FORMATS
    from kvdict_vk.vk.device import kp
    from kvdict_vk.vk.kernels import Buffer, barrier, pipeline, run
    from kvdict_vk.vk.submit import Recording
    dev = get_device(None)
    rng = np.random.default_rng(0)
    rows = []
    for label, fmt, n_rows, n_cols, mode, rt, one_pass in CASES:
        words = rng.integers(0, 1 << 32, (n_rows, n_cols // 32, BLOCK_WORDS[fmt]), dtype=np.uint64).astype(np.uint32)
        if fmt != "f32":  # finite block scales: 1.0 (and Q4_1's minimum 1.0)
            words[:, :, 0] = 0x3C003C00
        else:
            words = rng.standard_normal(words.shape, dtype=np.float32).view(np.uint32)
        norm_word = words.size
        w = Buffer(dev, words.size + n_cols, "device", "probe weights",
                   np.concatenate([words.reshape(-1), np.ones(n_cols, np.float32).view(np.uint32)]))
        x = Buffer(dev, 2 * n_cols, "device", "probe x", rng.standard_normal(2 * n_cols, dtype=np.float32))
        y = Buffer(dev, n_rows, "device", "probe y")
        run(dev, kp.OpTensorSyncDevice([w.tensor, x.tensor]))
        groups = -(-n_rows // (WG_SIZE // rt))
        items = (groups if one_pass else min(groups, MATVEC_WORKGROUPS)) * WG_SIZE
        k = pipeline(dev, "fwd_matvec_sg", [w, x, y], {"FORMAT": FORMATS[fmt], "ROW_THREADS": rt, "X_MODE": X_MODES[mode]},
                     max_items=items)
        op = k.op(w_word=0, x_word=0, y_word=0, n_rows=n_rows, n_cols=n_cols, accumulate=0, norm_word=norm_word,
                  eps=1e-5)
        rec = Recording(dev, [o for _ in range(n) for o in (op, barrier(y))], timestamps=True, what=label)
        times = []
        for i in range(runs + 5):
            rec.run()
            if i >= 5:
                times.append(rec.gpu_seconds())
        rec.free()
        for b in (w, x, y):
            b.destroy()
        us = 1e6 * float(np.median(times)) / n
        mib = words.size * 4 / 2**20
        rows.append(dict(case=label, format=fmt, n_rows=n_rows, n_cols=n_cols, x_mode=mode, row_threads=rt,
                         workgroups=items // WG_SIZE, us=us, weight_mib=mib, gb_per_s=mib * 2**20 / us / 1e3))
        print(f"{label:18s} {fmt:5s} {n_rows:6d}×{n_cols:<5d} {mode:8s} rt {rt:2d} wg {items // WG_SIZE:5d}: "
              f"{us:7.2f} µs  ({mib:6.2f} MiB, {rows[-1]['gb_per_s']:7.1f} GB/s)", flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--make-variants", action="store_true")
    ap.add_argument("--variant", action="append", default=None, help="base (the package's SPIR-V) or a VARIANTS name")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.make_variants:
        make_variants()
    if a.child:
        Path(os.environ["PROBE_OUT"]).write_text(json.dumps(run_cases(a.n, a.runs)))
        return
    from kvdict_vk.vk import get_device
    out = {"device": get_device(None).name, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": "python lab/probes/matvec_probe.py " + " ".join(argv or sys.argv[1:]), "variants": {}}
    for name in a.variant or ["base"]:
        env = dict(os.environ, PROBE_OUT=f"/tmp/matvec_probe_{name}.json")
        if name != "base":
            env["KVDICT_VK_SPV_DIR"] = str(SPV_PROBE / name)
        print(f"--- {name}", flush=True)
        subprocess.run([sys.executable, __file__, "--child", "--n", str(a.n), "--runs", str(a.runs)], env=env,
                       check=True)
        out["variants"][name] = json.loads(Path(env["PROBE_OUT"]).read_text())
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
