"""Probe: attend_flash's KIVI and q8_0 builds under other build-time knobs (tokens per lane,
levels decoded one at a time rather than two through binary16, int8 widened without a conversion),
timed beside the shipped builds, attend_flash over an f16 cache of the same rows and torch
SDPA over f16, in one run on one device; each KIVI build's output against the float64 reference.

Build the knob variants here (glslangValidator), then run on the GPU; each variant runs in
its own process with $KVDICT_VK_SPV_DIR pointing at its SPIR-V:

    python lab/probes/kivi_variants_probe.py --build lab/spv_probe
    python lab/probes/kivi_variants_probe.py --spv lab/spv_probe [--n-ctx 131072] > $OUT/kivi_variants.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

KIVI_VARIANTS = ("attend_flash_kivi", "attend_flash_kivi_sg")
ROW_VARIANTS = ("attend_flash", "attend_flash_sg")
# label → (the variants it rebuilds, the defines it adds)
WIDE_VARIANTS = ("attend_flash_wide", "attend_flash_wide_sg")
ALL_FLASH = KIVI_VARIANTS + ROW_VARIANTS + WIDE_VARIANTS
KNOBS = {"tb2": (KIVI_VARIANTS, {"TOKENS_PER_LANE": "2u"}), "tb8": (KIVI_VARIANTS, {"TOKENS_PER_LANE": "8u"}),
         "nohalves": (KIVI_VARIANTS, {"LEVELS_BY_HALVES": "0"}),
         "int8bits": (ROW_VARIANTS, {"INT8_BY_BITS": "1"}),
         # a round's tokens take their softmax step together rather than token by token
         "round_step": (ALL_FLASH, {"ROUND_SOFTMAX": "1"}),
         # the KIVI build as it shipped before stop 61 (token by token, 4 tokens a lane), and at 4 with rounds
         "kivi_before": (KIVI_VARIANTS, {"ROUND_SOFTMAX": "0", "TOKENS_PER_LANE": "4u"}),
         "kivi_tb4": (KIVI_VARIANTS, {"TOKENS_PER_LANE": "4u"}),
         "kivi_tb16": (KIVI_VARIANTS, {"TOKENS_PER_LANE": "16u"}),
         "round_tb8": (KIVI_VARIANTS, {"ROUND_SOFTMAX": "1", "TOKENS_PER_LANE": "8u"}),
         "round_rows_tb4": (ROW_VARIANTS + WIDE_VARIANTS, {"ROUND_SOFTMAX": "1", "TOKENS_PER_LANE": "4u"}),
         "rows_tb4": (ROW_VARIANTS + WIDE_VARIANTS, {"TOKENS_PER_LANE": "4u"}),
         "rows_tb3": (ROW_VARIANTS + WIDE_VARIANTS, {"TOKENS_PER_LANE": "3u"})}
# label → (the variants, how they were built): builds made by hand into --spv/<label>, not by --build.
# "before": attend_flash's four row builds at ce49b03, q8_0 levels converted by int→float and
# scaled element by element (INT8_BY_BITS 0, no folded scales), e.g.
#   git worktree add /tmp/old ce49b03 && (cd /tmp/old && python -m kvdict_vk.vk.shader_build) &&
#   cp /tmp/old/kvdict_vk/spv/attend_flash{,_sg,_wide,_wide_sg}.spv lab/spv_probe/before/
# "rows_decode_tb2" / "rows_decode_tb4": attend_flash's row builds at fccd669 built with
# -DROUND_SOFTMAX=1 -DDECODE_IN_ROUND=1 -DTOKENS_PER_LANE=2u / 4u (the knob, measured slower —
# lab/results/h100/rows_decode_in_round.json — and removed after)
PREBUILT = {"before": (ROW_VARIANTS + ("attend_flash_wide", "attend_flash_wide_sg"), "ce49b03"),
            "rows_decode_tb2": (ROW_VARIANTS, "fccd669"), "rows_decode_tb4": (ROW_VARIANTS, "fccd669")}
SHAPES = ((8, 4, 64), (8, 4, 128), (3, 3, 64))
FLUSH = 128 << 20


def build(root: Path, knobs: dict = KNOBS) -> None:
    """Each knob's variants (``knobs``: label → (variants, extra defines)) compiled into root/label."""
    from kvdict_vk.vk import abi, shader_build
    for label, (variants, extra) in knobs.items():
        out = root / label
        out.mkdir(parents=True, exist_ok=True)
        for name in variants:
            v = abi.DECLARATIONS[name]
            cmd = ["glslangValidator", "-V", "--target-env", abi.TARGET_ENV,
                   *[f"-D{k}={val}" for k, val in sorted({**v.defines_dict, **extra}.items())],
                   "-o", str(out / f"{name}.spv"), str(shader_build.SHADER_DIR / v.source)]
            subprocess.run(cmd, check=True, capture_output=True)
        print(f"built {label} into {out}", file=sys.stderr)


def run_child(script: str, label: str, spv: Path | None, argv: list) -> dict:
    """``script --one label argv…`` in a process of its own — SPIR-V is loaded once a process —
    with $KVDICT_VK_SPV_DIR at spv/label (None: the shipped build): the JSON it prints."""
    env = dict(os.environ)
    if spv is not None:
        env["KVDICT_VK_SPV_DIR"] = str(spv / label)
    proc = subprocess.run([sys.executable, script, "--one", label, *argv], env=env, stdout=subprocess.PIPE, text=True)
    return json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.returncode}


def _filled(cache: str, rows, n_ctx: int):
    from kvdict_vk.vk import KvArena
    k, v = rows
    arena = KvArena(1, k.shape[0], k.shape[2], n_ctx, cache=cache)
    for t0 in range(0, n_ctx, 1 << 15):
        arena.append(0, k[:, t0:t0 + (1 << 15)], v[:, t0:t0 + (1 << 15)])
    return arena


def _core_us(att, q, n, repeats: int = 15, warm_s: float = 1.0) -> float:
    rec = att.recording(0, q, n, timestamps=True, flush_bytes=FLUSH, primed=True)
    try:
        t_end = time.time() + warm_s  # clocks up from idle first: a cold process's first timings ran 2-5x long
        while time.time() < t_end:
            rec.run()
        ts = []
        for _ in range(repeats):
            rec.run()
            ts.append(rec.core_seconds())
        return float(np.median(ts)) * 1e6
    finally:
        rec.free()


def shape_data(n_kv: int, g: int, hd: int, n_ctx: int):
    """A shape's (K and V rows: a random 4 096-token block tiled to n_ctx, the queries), seeded by the shape."""
    rng = np.random.default_rng(hd + g)
    block = rng.standard_normal((2, n_kv, 4096, hd), dtype=np.float32)
    rows = [np.ascontiguousarray(np.tile(b, (1, n_ctx // 4096, 1))) for b in block]
    return rows, rng.standard_normal((n_kv * g, hd), dtype=np.float32)


def measure(label: str, n_ctx: int, baseline: bool, cache: str | None, shapes=SHAPES) -> dict:
    """One build (the SPIR-V $KVDICT_VK_SPV_DIR holds, else the shipped one): its KIVI
    attention per shape — time, plan, NMSE against float64 — and with ``baseline`` f16's and SDPA's."""
    from kvdict_vk import kivi as K
    from kvdict_vk.attention_ref import attend as ref_attend
    from kvdict_vk.metrics import nmse
    out = {}
    for n_kv, g, hd in shapes:
        rows, q = shape_data(n_kv, g, hd, n_ctx)
        row, t = {}, time.time()
        if cache in ("kivi", None):
            with _filled("kivi", rows, n_ctx) as ka:
                att = ka.attention(n_kv * g)
                plan = att.plan(0, n_ctx)
                row.update(kivi_us=_core_us(att, q, n_ctx), plan=str(plan), variant=att.variant(0, plan))
                kr, vr = K.cache_rows(rows[0], rows[1], n_ctx, ka.layout.kivi)  # as the cache holds them
                row["nmse_8192"] = float(nmse(ref_attend(q, kr, vr, 8192), ka.attend(0, q, 8192)))
        if cache in ("q8_0", None):
            with _filled("q8_0", rows, n_ctx) as qa:
                row["q8_0_us"] = _core_us(qa.attention(n_kv * g), q, n_ctx)
        if baseline:
            from kvdict_vk.bench.torch_anchor import Anchor
            with _filled("f16", rows, n_ctx) as fa:
                row["f16_us"] = _core_us(fa.attention(n_kv * g), q, n_ctx)
            s = Anchor().seconds(n_kv, g, hd, n_ctx)
            row["torch_sdpa_f16_us"] = s * 1e6 if s else None
        row["setup_s"] = time.time() - t
        out[f"{n_kv}x{g}_d{hd}"] = row
        print(f"[{label}] {n_kv}x{g} d{hd}: {json.dumps(row)}", file=sys.stderr, flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", type=Path, help="compile the knob variants into this directory and exit")
    ap.add_argument("--spv", type=Path, default=Path("lab/spv_probe"), help="the --build directory")
    ap.add_argument("--n-ctx", type=int, default=131072)
    ap.add_argument("--only", help="these knob labels (comma-separated) after the shipped build")
    ap.add_argument("--shapes", default=",".join(f"{n}x{g}x{d}" for n, g, d in SHAPES),
                    help="KV heads x query heads a KV head x head_dim, comma-separated")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: this label's build
    a = ap.parse_args(argv)
    a.shapes = [tuple(int(x) for x in sh.split("x")) for sh in a.shapes.split(",")]
    if a.build:
        return build(a.build)
    if a.one:
        rebuilt = {**KNOBS, **PREBUILT}[a.one][0] if a.one in KNOBS or a.one in PREBUILT else ALL_FLASH
        kivi, rows = any(v in KIVI_VARIANTS for v in rebuilt), any(v in ROW_VARIANTS for v in rebuilt)
        cache = None if kivi and rows else ("kivi" if kivi else "q8_0")
        json.dump(measure(a.one, a.n_ctx, rows, cache, a.shapes), sys.stdout)
        return None
    result = {"n_ctx": a.n_ctx, "command": "python " + " ".join(sys.argv), "knobs": {k: {"variants": v, "defines": d} for k, (v, d) in KNOBS.items()},
              "builds": {}}
    for label in ("shipped",) + tuple(a.only.split(",") if a.only else KNOBS):
        result["builds"][label] = run_child(__file__, label, None if label == "shipped" else a.spv,
                                            ["--n-ctx", str(a.n_ctx), "--shapes",
                                             ",".join("x".join(map(str, sh)) for sh in a.shapes)])
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "kivi_variants.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
