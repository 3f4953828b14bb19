"""attend_flash_kivi on a GPU: correctness against the float64 reference, and its kernel
time beside attend_flash over an f16 cache of the same rows and torch SDPA over f16 (CUDA,
when torch is there), in one run on one device; the read-out path's wall time beside.

    python lab/probes/attend_kivi_probe.py [n_ctx]    # with the package installed; $OUT/kivi_gpu.json
"""
import json
import os
import sys
import time

import numpy as np
from kvdict_vk import kivi as K
from kvdict_vk.metrics import nmse
from kvdict_vk.bench.torch_anchor import Anchor
from kvdict_vk.vk import KvArena

FLUSH = 128 << 20
out = {}
sdpa = Anchor()


def med_core(rec, n=15):
    ts = []
    for _ in range(n):
        rec.run()
        ts.append(rec.core_seconds())
    return float(np.median(ts))


shapes = [(8, 4, 64), (8, 4, 128), (3, 3, 64)]
n_ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
for n_kv, g, hd in shapes:
    rng = np.random.default_rng(hd + g)
    k = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    q = rng.standard_normal((n_kv * g, hd)).astype(np.float32)
    row = {}
    t = time.time()
    with KvArena(1, n_kv, hd, n_ctx, cache="f16") as fa:
        for t0 in range(0, n_ctx, 1 << 15):
            fa.append(0, k[:, t0:t0 + (1 << 15)], v[:, t0:t0 + (1 << 15)])
        att = fa.attention(n_kv * g)
        o = fa.attend(0, q, n_ctx)
        row["f16_plan"] = str(att.plan(0, n_ctx))
        rec = att.recording(0, q, n_ctx, timestamps=True, flush_bytes=FLUSH, primed=True)
        row["f16_us"] = med_core(rec) * 1e6
        rec.free()
    with KvArena(1, n_kv, hd, n_ctx, cache="kivi") as ka:
        for t0 in range(0, n_ctx, 1 << 15):
            ka.append(0, k[:, t0:t0 + (1 << 15)], v[:, t0:t0 + (1 << 15)])
        att = ka.attention(n_kv * g)
        spec = ka.layout.kivi
        fused = ka.attend(0, q, n_ctx)
        kr, vr = K.cache_rows(k, v, n_ctx, spec)
        from kvdict_vk.attention_ref import attend as ref_attend
        for n_used in sorted({1, min(777, n_ctx), n_ctx}):
            ref = ref_attend(q, kr, vr, n_used)
            row[f"nmse_fused_{n_used}"] = float(nmse(ref, ka.attend(0, q, n_used)))
        row["kivi_plan"] = str(att.plan(0, n_ctx))
        rec = att.recording(0, q, n_ctx, timestamps=True, flush_bytes=FLUSH, primed=True)
        row["kivi_fused_us"] = med_core(rec) * 1e6
        rec.free()
        att.path = "rows"
        t1 = time.perf_counter()
        for _ in range(5):
            rows_out = att.attend_reconstructed(0, q, n_ctx, 1 / np.sqrt(hd))
        row["kivi_rows_wall_us"] = (time.perf_counter() - t1) / 5 * 1e6
        row["nmse_rows_vs_fused"] = float(nmse(rows_out.astype(np.float64), fused))
    row["ratio_fused_over_f16"] = row["kivi_fused_us"] / row["f16_us"]
    s = sdpa.seconds(n_kv, g, hd, n_ctx)
    if s:
        row["torch_sdpa_f16_us"] = s * 1e6
        row["f16_over_sdpa"] = row["f16_us"] / row["torch_sdpa_f16_us"]
        row["kivi_fused_over_sdpa"] = row["kivi_fused_us"] / row["torch_sdpa_f16_us"]
    row["setup_s"] = time.time() - t
    out[f"{n_kv}x{g}_d{hd}"] = row
    print(json.dumps({f"{n_kv}x{g}_d{hd}": row}, indent=1), flush=True)
    if os.environ.get("OUT"):  # after every shape: a run cut short keeps what it measured
        json.dump(out, open(os.path.join(os.environ["OUT"], "kivi_gpu.json"), "w"), indent=1)
