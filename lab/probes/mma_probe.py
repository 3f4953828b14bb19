"""Probe: attend_mma (cooperative matrices) beside attend_flash's float build over the f16, q8_0
and KIVI caches of the same rows, each build's launch shape tuned on the device, with torch
SDPA over f16 — kernel GPU time (timestamps, L2 flushed, primed) in one run on one device —
and each build's NMSE against the float64 reference over the cached values at 8 192 tokens.
With --knobs, attend_mma rebuilt under build-time knobs (shaders/attend_mma.comp's ablations
NO_K, NO_V, NO_SOFTMAX), each timed in a process of its own
($KVDICT_VK_SPV_DIR at its SPIR-V) after the shipped build.

    python lab/probes/mma_probe.py --build lab/spv_probe_mma   # here: the knob builds
    python lab/probes/mma_probe.py [--n-ctx 32768,131072] [--shapes 8x4x64,...] [--knobs early_v,no_k] \
        [--spv lab/spv_probe_mma] > $OUT/mma_probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kivi_variants_probe import _core_us, _filled, build, run_child  # noqa: E402  (the probes' shared parts)

KERNELS = ("float", "mma")
MMA_VARIANTS = ("attend_mma", "attend_mma_kivi")
KNOBS = {label: (MMA_VARIANTS, defines) for label, defines in
         (("no_k", {"NO_K": "1"}), ("no_v", {"NO_V": "1"}), ("no_softmax", {"NO_SOFTMAX": "1"}))}


N_CHECK = 8192  # tokens each build's output is checked over


def _reference(cache: str, rows, q, n_ctx: int, spec) -> np.ndarray:
    """float64 attention over the first N_CHECK tokens as the cache of n_ctx tokens holds them
    (KIVI: quantised up to its window's start; kivi.attend)."""
    from kvdict_vk import kivi as K, rows as R
    from kvdict_vk.attention_ref import attend
    if cache == "kivi":
        return K.attend(q, rows[0], rows[1], n_ctx, N_CHECK, spec)
    return attend(q, *(R.held_rows(x[:, :N_CHECK], cache) for x in rows), N_CHECK)


def measure(shape: tuple, n_ctx: int, sdpa: bool, kernels=KERNELS) -> dict:
    from kvdict_vk.metrics import nmse
    n_kv, g, hd = shape
    rng = np.random.default_rng(hd + g)
    block = rng.standard_normal((2, n_kv, 4096, hd), dtype=np.float32)
    block[0, :, :, 3] += 6.0  # an outlier key channel
    rows = [np.ascontiguousarray(np.tile(b, (1, n_ctx // 4096, 1))) for b in block]
    q = rng.standard_normal((n_kv * g, hd), dtype=np.float32)
    row = {}
    for cache in ("f16", "q8_0", "kivi"):
        t = time.time()
        with _filled(cache, rows, n_ctx) as arena:
            ref = _reference(cache, rows, q, n_ctx, arena.layout.kivi)
            for kernel in kernels:
                att = arena.attention(n_kv * g)
                att.path, att.flash_kernel = "flash", kernel
                try:
                    plan = att.plan(0, n_ctx)
                except Exception as e:  # noqa: BLE001 — a probe records what refused
                    row[f"{cache}/{kernel}"] = {"error": f"{type(e).__name__}: {e}"}
                    continue
                us = _core_us(att, q, n_ctx)
                err = float(nmse(ref, arena.attend(0, q, N_CHECK)))
                row[f"{cache}/{kernel}"] = {"us": us, "plan": str(plan), "variant": att.variant(0, plan),
                                            f"nmse_{N_CHECK}": err}
        row[f"{cache}_setup_s"] = time.time() - t
    if sdpa:
        from kvdict_vk.bench.torch_anchor import Anchor
        s = Anchor().seconds(n_kv, g, hd, n_ctx)
        row["torch_sdpa_f16_us"] = s * 1e6 if s else None
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-ctx", default="131072")
    ap.add_argument("--shapes", default="8x4x64,8x4x128,3x3x64,3x3x128")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--build", type=Path, help="compile the knob builds into this directory and exit")
    ap.add_argument("--spv", type=Path, default=Path("lab/spv_probe_mma"))
    ap.add_argument("--knobs", default="", help="knob labels (comma-separated) timed after the shipped build")
    ap.add_argument("--knobs-only", action="store_true", help="skip the shipped builds' measurements")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: the mma kernel of this knob's build only
    a = ap.parse_args(argv)
    if a.build:
        return build(a.build, KNOBS)
    from kvdict_vk.vk import get_device
    result = {"device": get_device().name, "rows": {}}
    for n_ctx in (int(x) for x in a.n_ctx.split(",")) if not a.knobs_only else ():
        for s in a.shapes.split(","):
            shape = tuple(int(x) for x in s.split("x"))
            key = f"{s}@{n_ctx}"
            kernels = ("mma",) if a.one else KERNELS
            result["rows"][key] = measure(shape, n_ctx, not (a.no_sdpa or a.one), kernels)
            print(f"[{a.one or 'shipped'}] {key}: {json.dumps(result['rows'][key])}", file=sys.stderr, flush=True)
            if os.environ.get("OUT") and not a.one:
                Path(os.environ["OUT"], "mma_probe.json").write_text(json.dumps(result, indent=1))
    if a.one:
        json.dump(result, sys.stdout)
        return None
    result["knobs"] = {}
    for label in [x for x in a.knobs.split(",") if x]:
        result["knobs"][label] = run_child(__file__, label, a.spv, ["--n-ctx", a.n_ctx, "--shapes", a.shapes])
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "mma_probe.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
