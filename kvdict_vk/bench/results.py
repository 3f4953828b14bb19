"""Rows of ``summary.json`` (docs/results/<device>/): one per measured case, the schema
every benchmark writes and the README quotes (tests/unit/test_readme_figures.py).

A row: benchmark, case (unique within the benchmark: ``rows[<benchmark>/<case>]`` names
it), cache (one of CACHES; None for what has no cache: the copy, encoders),
n_used, n_kv, gqa, head_dim, batch, gpu_s (median, timestamps; None with a note where
the driver has none or the work spans submissions), wall_s (median), bytes (from
:func:`kvdict_vk.bench.traffic.bytes_moved`, None where nothing is counted), bytes_per_s,
roofline_fraction (bytes over kernel_s — the GPU time of the recording's core ops, as
vs_torch_sdpa uses — where the row has it, else over gpu_s; :func:`kvdict_vk.bench.roofline.fraction`),
torch_sdpa_f16_s (None where there is no anchor) — then whatever the benchmark adds
(kernel_s, vs_torch_sdpa, path, format, vectors_per_s, device_kind, …).
"""
from __future__ import annotations

from . import roofline as R
from . import timing as T

REQUIRED = ("benchmark", "case", "cache", "n_used", "n_kv", "gqa", "head_dim", "batch", "gpu_s", "wall_s",
            "bytes", "roofline_fraction", "torch_sdpa_f16_s")
CACHES = ("f16", "f32", "q8_0", "q4_0", "kivi", "dict", None)  # q4_0: llama.cpp's rows (llama_fa)


def shape_case(n_kv: int, gqa: int, head_dim: int, n_used: int) -> str:
    """The shape part of an attention case's name ("8x4 d64 n32768"): the attention benchmark
    and llama_fa name their cases with it, so a README ratio can pair their rows."""
    return f"{n_kv}x{gqa} d{head_dim} n{n_used}"


def row(benchmark: str, case: str, t: dict, *, cache=None, n_used=None, n_kv=None, gqa=None, head_dim=None,
        batch: int = 1, moved: dict | None = None, roofline: dict | None = None, torch_sdpa_f16_s=None,
        **extra) -> dict:
    """One row from a timing (kvdict_vk.bench.timing) and the bytes it moved."""
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")
    n_bytes = None if moved is None else moved["total"]
    seconds = T.best_seconds(t)
    r = {"benchmark": benchmark, "case": case, "cache": cache, "n_used": n_used, "n_kv": n_kv, "gqa": gqa,
         "head_dim": head_dim, "batch": batch, "gpu_s": t["gpu_s"], "wall_s": t["wall_s"], "bytes": n_bytes,
         "bytes_per_s": None if n_bytes is None else n_bytes / seconds,
         # kernel_s where the timing has it, else gpu_s (roofline.fraction): the time vs_torch_sdpa uses
         "roofline_fraction": R.fraction(n_bytes, t, roofline), "torch_sdpa_f16_s": torch_sdpa_f16_s,
         "kernel_s": t.get("kernel_s"),
         # against SDPA: the passes' GPU time where the recording marks them (SDPA's timing has
         # no host copies either), else the whole recording's
         "vs_torch_sdpa": None if torch_sdpa_f16_s is None or t["gpu_s"] is None
         else (t.get("kernel_s") or t["gpu_s"]) / torch_sdpa_f16_s}
    if moved is not None:
        r["bytes_by_part"] = {k: v for k, v in moved.items() if k != "total"}
    notes = [t["note"]] if t.get("note") else []
    r.update(extra)
    if notes:
        r["notes"] = notes + r.get("notes", [])
    return r


def check(rows: list[dict]) -> list[dict]:
    """The rows, after checking each has the schema's keys and (benchmark, case) is unique
    (the README names rows by it): ValueError otherwise."""
    seen = set()
    for r in rows:
        missing = [k for k in REQUIRED if k not in r]
        if missing:
            raise ValueError(f"row {r.get('benchmark')}/{r.get('case')} lacks {missing}")
        key = (r["benchmark"], r["case"])
        if key in seen:
            raise ValueError(f"two rows named {key[0]}/{key[1]}")
        if "/" in r["benchmark"] or "]" in r["case"]:
            raise ValueError(f"row {key}: a benchmark name has no '/', a case no ']'")
        seen.add(key)
    return rows
