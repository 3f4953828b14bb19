"""Probe: where a short decode attention's GPU time goes on a GPU — attend_flash over the f16
cache at each workgroup count (KvArena.attention's ``flash_workgroups``, the tuner's choice
first), each op's GPU time by timestamps (the query's copy up, the attend pass, the merge,
the read-back), beside the same timestamps around a tiny copy alone (the floor a recorded op
costs). Medians over --runs runs of one recording, after a warm-up. One JSON object to stdout.
--kernels pins attend_flash's builds one after another (else the tuner chooses among them);
--l2-flush-mib reads a torch buffer before every run, as the attention benchmark does.
--formats adds attention over dict-coded slots (K bits / V bits, the attention benchmark's gpu
preset dictionaries: bench.attention.dict_args) beside the f16 cache; their ops are
the query's copy up, the q·atom table, the attend pass, the merge, the read-back, and
--coded-heads pins the query heads a workgroup takes (0: the tuner's choice); --locals replaces
attend_flash's candidate workgroup sizes, --end-elems the wide end's elements a pass. --builds
times each case with each SPIR-V build (name=dir; an empty dir: the package's), a fresh engine
for each (the tuner keys its choices by the SPIR-V too: choice_store.device_identity).

    . .bundle/env.sh && KVDICT_VK_DEVICE=NVIDIA python3 lab/probes/attend_floor_probe.py

Run as ``python lab/probes/attend_floor_probe.py`` from the checkout with the package installed
(``pip install -e .``; scripts/setup.sh's .venv has it): the probe uses kvdict_vk's
public API only, and lab/ is not part of the package.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

from kvdict_vk.bench import attention as BA, common
from kvdict_vk.vk import KvArena, spirv
from kvdict_vk.vk.attend import engine as A
from kvdict_vk.vk.attend import flash as F
from kvdict_vk.vk.submit import Recording


def op_medians(rec: Recording, runs: int, warm_s: float = 0.5, before=None) -> tuple[list[float], float | None]:
    """(median GPU seconds of each op, median of the core span) over ``runs`` runs, ``before()``
    ahead of each run where given (untimed: lab/probes/l2_probe.py's flushes). The warm-up is
    longer than the benchmarks' 0.3 s: the first case after an arena's upload (seconds of
    host work) measured 2-2.5x its later repeats on the H200 after 0.2 s."""
    t = time.perf_counter()
    while time.perf_counter() - t < warm_s:  # clocks up
        if before is not None:
            before()
        rec.run()
    per_op, core = [], []
    for _ in range(runs):
        if before is not None:
            before()
        rec.run()
        per_op.append(rec.op_seconds())
        core.append(rec.core_seconds())
    ops = np.median(np.asarray(per_op), axis=0).tolist()
    return ops, (float(np.median(core)) if None not in core else None)


def f16_arena(dev, rng, n_kv: int, gqa: int, hd: int, n_ctx: int) -> tuple[KvArena, np.ndarray]:
    """An f16-cache arena of one layer (n_kv KV heads, head_dim hd) filled with n_ctx random
    rows per KV head, and a decode query for its n_kv × gqa query heads."""
    arena = KvArena(1, n_kv, hd, n_ctx, device=dev, cache="f16")
    rows = BA.random_rows(rng, n_kv, n_ctx, hd)
    arena.append(0, rows, rows)
    return arena, rng.standard_normal((n_kv * gqa, hd), dtype=np.float32)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="3x3x64,8x4x64,8x4x128", help="n_kv x gqa x head_dim, comma-separated")
    ap.add_argument("--n-used", default="8192,32768,131072")
    ap.add_argument("--workgroups", default="0,64,128,256,512,1024", help="0: the tuner's choice")
    ap.add_argument("--kernels", default="", help="attend_flash builds to pin, comma-separated (attend.FLASH_KERNELS; "
                    "empty: the tuner's choice among all)")
    ap.add_argument("--l2-flush-mib", type=int, default=0,
                    help="read this many MiB through torch before every timed run (bench.torch_anchor's flush, "
                         "what the attention benchmark does; 0: none, the cache may stay in the L2)")
    ap.add_argument("--formats", default="f16", help="f16 and/or K/V residual bits of dict-coded slots, comma-separated")
    ap.add_argument("--coded-heads", default="0", help="query heads a workgroup over the codes, comma-separated "
                    "(0: the tuner's choice)")
    ap.add_argument("--builds", default="", help="name=SPIR-V dir (empty: the package's), comma-separated: each "
                    "case timed with each build, a fresh attention for each (empty: the package's only)")
    ap.add_argument("--locals", default="", help="attend_flash's candidate workgroup sizes, comma-separated, the "
                    "untuned first (empty: attend_tune.FLASH_LOCALS)")
    ap.add_argument("--end-elems", default="", help="attend_flash_wide's END_ELEMS candidates, comma-separated, "
                    "preferred first (empty: attend_specs.FLASH_END_ELEMS)")
    ap.add_argument("--float-end-elems", default="", help="attend_flash's float builds as name=END_ELEMS, "
                    "comma-separated, the untuned first: they replace attend_specs.FLASH_FLOAT_END_ELEMS and the "
                    "float builds of attend.FLASH_KERNELS (e.g. float=2,float_pass4=4,float_pass8=8)")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--device", default=os.environ.get("KVDICT_VK_DEVICE", "0"))
    a = ap.parse_args(argv)
    if a.locals:  # what Attention.flash_locals_of offers (attend imports the tuner's tuple)
        F.FLASH_LOCALS = tuple(int(x) for x in a.locals.split(","))
    if a.end_elems:  # what Attention.flash_end_elems offers
        F.FLASH_END_ELEMS = tuple(int(x) for x in a.end_elems.split(","))
    if a.float_end_elems:  # what Attention.flash_end_elems offers the float builds, and the builds
        F.FLASH_FLOAT_END_ELEMS = {n: int(e) for n, e in (x.split("=") for x in a.float_end_elems.split(","))}
        F.FLASH_KERNELS = tuple(F.FLASH_FLOAT_END_ELEMS) + ("wide_end",)
    dev = common.open_device(SimpleNamespace(device=a.device, validation=False))
    before = None
    if a.l2_flush_mib:
        from kvdict_vk.bench import torch_anchor
        import torch
        before = torch_anchor.waited(torch, torch_anchor.l2_flush(torch, a.l2_flush_mib << 20))
    rng = np.random.default_rng(0)
    ns = [int(x) for x in a.n_used.split(",")]
    out = {"argv": sys.argv, "device": dev.name, "l2_flush_mib": a.l2_flush_mib, "cases": []}
    for shape, fmt in ((sh, f) for sh in a.shapes.split(",") for f in a.formats.split(",")):
        n_kv, gqa, hd = common.dims(shape)
        if fmt == "f16":
            arena, q = f16_arena(dev, rng, n_kv, gqa, hd, max(ns))
            heads_list = [None]
        else:
            arena = BA.dict_arena(tuple(int(b) for b in fmt.split("/")), n_kv, hd, max(ns), BA.dict_args(), dev,
                                  rng)[0]
            q = rng.standard_normal((n_kv * gqa, hd), dtype=np.float32)
            heads_list = [int(h) or None for h in a.coded_heads.split(",")]
        # the floor: timestamps around a tiny copy (the query's upload) recorded four times
        att = arena.attention(q.shape[0])
        if "tiny_copy_op_s" not in out:
            att.recording(0, q, ns[0]).free()  # makes the attention's buffers and passes
            floor = Recording(dev, [att.passes.q_upload(att.q)] * 4, timestamps="ops", what="floor")
            out["tiny_copy_op_s"] = op_medians(floor, a.runs)[0]
            floor.free()
        for n in ns:
            for kernel, heads in ((k, h) for k in (a.kernels.split(",") if a.kernels and fmt == "f16" else [None])
                                  for h in heads_list):
                builds = [tuple(b.split("=", 1)) for b in a.builds.split(",")] if a.builds else [None]
                for w, build in ((int(x), b) for x in a.workgroups.split(",") for b in builds):
                    if build is None:
                        att = arena.attention(q.shape[0])
                    else:  # a fresh engine: its pipelines are made from this build's SPIR-V
                        if build[1]:
                            os.environ[spirv.SPV_DIR_ENV] = os.path.abspath(build[1])
                        else:
                            os.environ.pop(spirv.SPV_DIR_ENV, None)
                        att = A.Attention(arena.memory, q.shape[0])
                    att.path, att.flash_workgroups, att.coded_workgroups = "flash", w or None, w or None  # (CPU: direct)
                    att.flash_kernel, att.coded_heads = kernel, heads
                    rec = att.recording(0, q, n, timestamps="ops")
                    plan = att.plan(0, n)
                    ops, core = op_medians(rec, a.runs, before=before)
                    rec.free()
                    if build is not None:
                        att.free()
                    case = {"shape": shape, "format": fmt, "n_used": n, "workgroups": w or "tuned",
                            "heads": plan.heads, "n_splits": plan.n_splits,
                            "split_len": plan.split_len, "local": plan.local, "kernel": plan.kernel,
                            "kernel_s": core, "op_s": ops, "build": build[0] if build else None}
                    out["cases"].append(case)
                    print(json.dumps(case), file=sys.stderr, flush=True)
        arena.free()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
