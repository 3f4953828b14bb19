"""Probe: how much of a short decode attention's time the L2 hides — our attention over the
f16 cache (its core passes' GPU time, timestamps) and torch SDPA over an f16 cache of the same
shape (CUDA events, calls queued behind a sleep: kvdict_vk.bench.torch_anchor.time_sdpa), each
timed HOT, the same call repeated back to back (a cache smaller than the L2 stays in it),
and FLUSHED, a --flush-mib buffer passed over before every call, outside its timing (as in a
model's decode step, where the other layers' caches and weights pass through the L2 between
two reads of one layer's): read (a torch sum, finished before our run; leaves clean lines)
and written (torch zeroing for SDPA, our copy shader for ours; leaves lines to write back). One JSON object to stdout.

    . .bundle/env.sh && KVDICT_VK_DEVICE=NVIDIA python3 lab/probes/l2_probe.py

Run as ``python lab/probes/l2_probe.py`` from the checkout with the package installed
(``pip install -e .``; scripts/setup.sh's .venv has it): the probe uses kvdict_vk's
public API only, and lab/ is not part of the package.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

import numpy as np

from attend_floor_probe import f16_arena, op_medians  # this directory: on sys.path when run as a script
from kvdict_vk.bench import common, torch_anchor
from kvdict_vk.vk.kernels import Buffer, Kernel
from kvdict_vk.vk.submit import Recording


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="3x3x64,3x3x128,8x4x64,8x4x128", help="n_kv x gqa x head_dim, comma-separated")
    ap.add_argument("--n-used", default="8192,32768,131072")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--flush-mib", type=int, default=torch_anchor.L2_FLUSH_BYTES >> 20,
                    help="the buffer passed over between calls (MiB)")
    ap.add_argument("--device", default=os.environ.get("KVDICT_VK_DEVICE", "0"))
    a = ap.parse_args(argv)
    dev = common.open_device(SimpleNamespace(device=a.device, validation=False))
    torch, note = torch_anchor.anchor()
    rng = np.random.default_rng(0)
    ns = [int(x) for x in a.n_used.split(",")]
    out = {"argv": sys.argv, "device": dev.name, "flush_mib": a.flush_mib, "sdpa_note": note, "cases": []}
    # the flush: one copy of flush-mib / 2 between two device-local buffers (reads and writes
    # flush-mib in all)
    words = a.flush_mib * (1 << 20) // 8
    src, dst = Buffer(dev, words, "storage", "l2 flush source"), Buffer(dev, words, "storage", "l2 flush destination")
    copy = Kernel(dev, "copy_vec4", [src, dst], max_items=words)
    flush = Recording(dev, [copy.op(src_word=0, dst_word=0, n_words=words)], timestamps=False, what="l2 flush")
    read, write = (torch_anchor.l2_flush(torch, a.flush_mib << 20, w) if torch is not None else None
                   for w in (False, True))
    for shape in a.shapes.split(","):
        n_kv, gqa, hd = common.dims(shape)
        arena, q = f16_arena(dev, rng, n_kv, gqa, hd, max(ns))
        for n in ns:
            rec = arena.attention(q.shape[0]).recording(0, q, n, timestamps=True)
            case = {"shape": shape, "n_used": n, "cache_bytes": 2 * n_kv * n * hd * 2,
                    "ours_hot_s": op_medians(rec, a.runs)[1],
                    "ours_copy_flushed_s": op_medians(rec, a.runs, before=flush.run)[1]}
            if read is not None:  # the same read SDPA's flushed calls get, waited for before each run
                case["ours_read_flushed_s"] = op_medians(rec, a.runs, before=torch_anchor.waited(torch, read))[1]
            rec.free()
            if torch is not None:
                hot = torch_anchor.time_sdpa(torch, n_kv, gqa, hd, n)
                read_s = torch_anchor.time_sdpa(torch, n_kv, gqa, hd, n, flush=read)
                write_s = torch_anchor.time_sdpa(torch, n_kv, gqa, hd, n, flush=write)
                case.update(sdpa_hot_s=hot["seconds"], sdpa_read_flushed_s=read_s["seconds"],
                            sdpa_write_flushed_s=write_s["seconds"],
                            sdpa_queued=[hot["queued"], read_s["queued"], write_s["queued"]])
                case["ratio_hot"] = case["ours_hot_s"] / case["sdpa_hot_s"]
                case["ratio_read_flushed"] = case["ours_read_flushed_s"] / case["sdpa_read_flushed_s"]
                case["ratio_write_flushed"] = case["ours_copy_flushed_s"] / case["sdpa_write_flushed_s"]
            out["cases"].append(case)
            print(json.dumps(case), file=sys.stderr, flush=True)
        arena.free()
    flush.free()
    copy.destroy()
    dst.destroy()
    src.destroy()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
