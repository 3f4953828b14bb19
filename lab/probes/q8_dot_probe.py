"""Probe: attend_flash over q8_0 rows, its float build against its integer-dot build
(attend_flash_dot: the keys' int8 levels dotted with a two-part int8 query), beside attend_flash
over an f16 cache of the same rows and torch SDPA over f16, on one device; each build tuned for
its launch shape, its output against the float64 reference. Knob builds of the integer-dot
build (KNOBS: compiled here by --build, each timed in a process of its own with
$KVDICT_VK_SPV_DIR at its directory) beside the shipped ones.

    python lab/probes/q8_dot_probe.py --build lab/spv_probe
    python lab/probes/q8_dot_probe.py [--n-ctx 131072] [--shapes 8x4x64,...] [--knobs dot_tb4] > $OUT/q8_dot.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from pathlib import Path

from kivi_variants_probe import _core_us, _filled, build, run_child, shape_data

DOT_VARIANTS = ("attend_flash_dot", "attend_flash_dot_sg")
KNOBS = {"dot_tb4": (DOT_VARIANTS, {"TOKENS_PER_LANE": "4u"}), "dot_tb3": (DOT_VARIANTS, {"TOKENS_PER_LANE": "3u"}),
        "dot_sat": (DOT_VARIANTS, {"KDOT_SAT": "1"})}
SHAPES = ((8, 4, 64), (8, 4, 128), (3, 3, 64), (3, 3, 128))


def measure(n_ctx: int, shapes, repeats: int, kernels=("float", "int_dot"), anchors: bool = True) -> dict:
    from kvdict_vk.bench.torch_anchor import Anchor
    from kvdict_vk.forge import quant
    from kvdict_vk.metrics import nmse
    from kvdict_vk.attention_ref import attend as ref_attend
    out = {}
    for n_kv, g, hd in shapes:
        rows, q = shape_data(n_kv, g, hd, n_ctx)
        row, t = {}, time.time()
        with _filled("q8_0", rows, n_ctx) as qa:
            out.setdefault("device", qa.device.info.name)
            for kernel in kernels:
                att = qa.attention(n_kv * g)
                att.flash_kernel = kernel
                row[f"{kernel}_us"] = _core_us(att, q, n_ctx, repeats)
                plan = att.plan(0, n_ctx)
                row[f"{kernel}_plan"] = f"{att.variant(0, plan)} local {plan.local} splits {plan.n_splits}"
                kq, vq = (quant.q8_0(x[:, :8192]) for x in rows)
                row[f"{kernel}_nmse_8192"] = float(nmse(ref_attend(q, kq, vq, 8192), qa.attend(0, q, 8192)))
        if anchors:
            with _filled("f16", rows, n_ctx) as fa:
                row["f16_us"] = _core_us(fa.attention(n_kv * g), q, n_ctx, repeats)
            s = Anchor().seconds(n_kv, g, hd, n_ctx)
            row["torch_sdpa_f16_us"] = s * 1e6 if s else None
        row["setup_s"] = time.time() - t
        out.setdefault("shapes", {})[f"{n_kv}x{g}_d{hd}"] = row
        print(f"{n_kv}x{g} d{hd}: {json.dumps(row)}", file=sys.stderr, flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-ctx", type=int, default=131072)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--shapes", default=",".join(f"{n}x{g}x{d}" for n, g, d in SHAPES))
    ap.add_argument("--build", type=Path, help="compile the knob builds into this directory and exit")
    ap.add_argument("--spv", type=Path, default=Path("lab/spv_probe"), help="the --build directory")
    ap.add_argument("--knobs", default="", help="these knob builds (KNOBS, comma-separated) after the shipped ones")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: a knob build's integer-dot kernel only
    a = ap.parse_args(argv)
    if a.build:
        return build(a.build, KNOBS)
    shapes = [tuple(int(x) for x in sh.split("x")) for sh in a.shapes.split(",")]
    if a.one:
        json.dump(measure(a.n_ctx, shapes, a.repeats, ("int_dot",), False), sys.stdout)
        return None
    result = {"n_ctx": a.n_ctx, "command": "python " + " ".join(sys.argv), **measure(a.n_ctx, shapes, a.repeats),
              "knobs": {}}
    for label in filter(None, a.knobs.split(",")):
        result["knobs"][label] = {"defines": KNOBS[label][1], **run_child(
            __file__, label, a.spv, ["--n-ctx", str(a.n_ctx), "--repeats", str(a.repeats), "--shapes", a.shapes])}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
