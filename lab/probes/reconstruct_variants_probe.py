"""Probe: reconstruct.comp variants timed side by side in one process on the same codes.

Each variant is a directory of SPIR-V built from an edited copy of shaders/
(``python -m kvdict_vk.vk.shader_build --shaders <copy> --out probe_spv/<name>``), or empty
for the package's own build. The reconstruct kernels are loaded per variant
($KVDICT_VK_SPV_DIR set while its read is planned), each over its own arena holding the
same slots (one seed), all writing one output buffer; then every read and the copy shader
are timed interleaved (kvdict_vk.bench.timing.measure: a drifting clock hits all alike) —
run-to-run noise on the H200 is ~1 % of the roofline fraction, as large as the effects
looked for, so separate runs cannot rank them. One JSON object to stdout, lines to stderr.

    . .bundle/env.sh && KVDICT_VK_DEVICE=NVIDIA python3 lab/probes/reconstruct_variants_probe.py \
        --variants main=,walk=probe_spv/walk --rounds 2 -- <kvdict_vk.bench.reconstruct args>

Run as ``python lab/probes/reconstruct_variants_probe.py`` from the checkout with the package installed
(``pip install -e .``; scripts/setup.sh's .venv has it): the probe uses kvdict_vk's
public API only, and lab/ is not part of the package.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np

from kvdict_vk.bench import common, reconstruct, roofline, timing, traffic
from kvdict_vk.vk import ReadPlan, spirv
from kvdict_vk.vk.kernels import Buffer
from kvdict_vk.vk.read import mapping
from kvdict_vk.vk.spirv import SPV_DIR_ENV


def planned_read(args, dev, out, spv_dir: str):
    """(arena, its recorded read into ``out`` with reconstruct from ``spv_dir``, NMSE vs float64,
    the sha256 of the reconstruct SPIR-V it loaded — distinct variants must show distinct ones)."""
    saved = os.environ.pop(SPV_DIR_ENV, None)
    if spv_dir:
        os.environ[SPV_DIR_ENV] = os.path.abspath(spv_dir)
    try:
        arena, codes, dicts = reconstruct.coded_arena(args.sparsity, args, dev, np.random.default_rng(0))
        rec = ReadPlan(arena.memory, 0, 0, args.n_ctx, out=out).recording("dispatch", timestamps=True)
        digest = hashlib.sha256(spirv.load(f"reconstruct_{'vec4' if mapping.vec4_rows(arena.memory) else 'scalar'}")).hexdigest()
    finally:
        os.environ.pop(SPV_DIR_ENV, None)
        if saved is not None:
            os.environ[SPV_DIR_ENV] = saved
    rec.run()  # warm-up
    return arena, rec, reconstruct.nmse_check(arena, codes, dicts, args.n_ctx), digest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", required=True, help="name=spv_dir,… (an empty dir: the package's SPIR-V)")
    ap.add_argument("--rounds", type=int, default=1, help="timed rounds (each interleaves every variant)")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = reconstruct.parse_args([x for x in a.bench_args if x != "--"])
    variants = dict(v.split("=", 1) for v in a.variants.split(","))
    dev = common.open_device(args)
    roof = roofline.measure(dev)
    n_words = 2 * args.n_kv * args.n_ctx * args.head_dim
    out = Buffer(dev, n_words, "storage", "reconstructed rows")
    copy_rec, keep = reconstruct.copy_recording(dev, n_words)
    copy_rec.run()
    arenas, recs, nmse, digests = [], {}, {}, {}
    try:
        for name, spv in variants.items():
            arena, recs[name], nmse[name], digests[name] = planned_read(args, dev, out, spv)
            arenas.append(arena)
        moved = traffic.bytes_moved("read", arenas[0].layout, 0, args.n_ctx)["total"]
        rounds = []
        for r in range(a.rounds):
            times = timing.measure({**recs, "copy_shader": copy_rec}, args.repeats, warm_s=timing.warm_for(dev))
            row = {}
            for name in recs:
                sec = times[name]["gpu_s"]
                paired = np.asarray(times["copy_shader"]["gpu"]["samples"]) / np.asarray(times[name]["gpu"]["samples"])
                row[name] = {"gpu_s": sec, "gpu": {k: v for k, v in times[name]["gpu"].items() if k != "samples"},
                             "roofline_fraction": roofline.fraction(moved, times[name], roof),
                             "paired_copy_over_reconstruct_median": float(np.median(paired))}
                print(f"round {r}: {name:12s} {sec * 1e6:8.1f} us  roofline {row[name]['roofline_fraction']:.3f}  "
                      f"paired {row[name]['paired_copy_over_reconstruct_median']:.3f}", file=sys.stderr, flush=True)
            rounds.append(row)
    finally:
        for rec in recs.values():
            rec.free()
        for arena in arenas:
            arena.free()
        copy_rec.free()
        for x in keep:
            x.destroy()
        out.destroy()
    json.dump({"argv": sys.argv, "device": dev.name, "variants": variants, "bytes_moved": moved,
               "roofline_bytes_per_s": roof["bytes_per_s"], "spirv_sha256": digests,
               "nmse_vs_float64": nmse, "rounds": rounds},
              sys.stdout, indent=1)


if __name__ == "__main__":
    main()
