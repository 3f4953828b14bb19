"""llama.cpp's Vulkan flash attention on the same device: the anchor our decode attention is
for (ggml-vulkan's FLASH_ATTN_EXT, through its test-backend-ops in perf mode).

It runs a test-backend-ops binary built with GGML_VULKAN (``tools/build_llama_anchor.sh``
builds one from the llama.cpp inside PyPI's llama-cpp-python sdist and adds the decode cases
timed here: one query row, no mask, K and V of one type, 8 KV heads × GQA 4 and 3 × 3, head_dim
64 / 128, 1 024 to 131 072 tokens, f16 / q8_0 / q4_0), one process per case and repeat,
with ggml-vulkan's GGML_VK_PERF_LOGGER, which brackets every graph node with timestamp
queries. Each case runs on ggml-vulkan's "default" path — what it picks on the device, with
cooperative matrices where device and build have them — and, with --paths, on its "scalar"
path (ggml's switches turn cooperative matrices and integer dot products off: the features
our kernels use); each process's device line ("matrix cores: …") is kept in the JSON.

A row's ``gpu_s`` is the median over the timed graphs of the FLASH_ATTN_EXT nodes' mean GPU
time (its split-k reduce included, as our kernel_s includes the merge pass); ``wall_s`` is
test-backend-ops' own figure, a graph of n copies of the op timed on the host and divided by
n. Cases are named as the attention benchmark's (``f16 8x4 d64 n32768``; the scalar path's
``f16 scalar 8x4 d64 n32768``), so ``rows[attention/CASE].kernel_s / rows[llama_fa/CASE].gpu_s``
compares the two.

    KVDICT_LLAMA_TEST_BACKEND_OPS=/path/test-backend-ops python -m kvdict_vk.bench.llama_fa

Skipped (kvdict-bench) where no binary is given; needs a Vulkan device the binary can open.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from .. import errors as E
from ..layout import Q8_BLOCK
from . import common, results, timing

NAME = "llama_fa"
ENV_BIN = "KVDICT_LLAMA_TEST_BACKEND_OPS"
# quick/cpu: the attention benchmark's quick shape (SmolLM2's heads, short contexts: a software
# driver takes ~50 s for one 8 k case); gpu: the attention benchmark's gpu cases
_SMALL = ["--shapes", "3x3", "--head-dims", "64", "--n-used", "1024,4096", "--types", "f16,q8_0"]
PRESETS = {"quick": _SMALL, "cpu": _SMALL, "gpu": ["--paths", "default,scalar", "--repeats", "1"]}
# ggml-vulkan's shader paths: what it picks on the device (cooperative matrices where the device
# and the build have them), and its scalar path — the features our kernels use — by turning the
# others off with ggml's own switches
SHADER_PATHS = {"default": {},
                "scalar": {"GGML_VK_DISABLE_COOPMAT": "1", "GGML_VK_DISABLE_COOPMAT2": "1",
                           "GGML_VK_DISABLE_INTEGER_DOT_PRODUCT": "1"}}
USES_DEVICE, REQUIRES = False, {}
# bytes a row of head_dim elements takes in ggml's cache types: its q8_0 and q4_0 blocks hold
# Q8_BLOCK (32) values and one f16 scale, the values as int8 or as nibbles (ggml's own packing,
# not our arena's q8_0 words: those pad the scales to whole words)
ROW_BYTES = {"f16": lambda d: 2 * d, "q8_0": lambda d: d // Q8_BLOCK * (2 + Q8_BLOCK),
             "q4_0": lambda d: d // Q8_BLOCK * (2 + Q8_BLOCK // 2)}
# one perf-logger line: "<name>: <count> x <mean> us = <total> us"
_LOGGER = re.compile(r"^(?P<name>FLASH_ATTN_EXT[^:]*): (?P<n>\d+) x (?P<us>[0-9.eE+-]+) us")
# ggml-vulkan's line for the device it opened: its name and the shader paths it has ("int dot:
# 1 | matrix cores: NV_coopmat2"); the first device is test-backend-ops' Vulkan0
_DEVICE = re.compile(r"^ggml_vulkan: 0 = (?P<line>.*)$")
_SQL = re.compile(r"^INSERT INTO test_backend_ops \((?P<fields>[^)]*)\) VALUES \('(?P<values>.*)'\);$")


def default_bin() -> str | None:
    """The binary: $KVDICT_LLAMA_TEST_BACKEND_OPS. Never one found on PATH: a default
    kvdict-bench run must not fail on a llama.cpp build that cannot open this device."""
    return os.environ.get(ENV_BIN) or None


def missing() -> str | None:
    """Why this benchmark cannot run here, or None (kvdict-bench skips it then)."""
    path = default_bin()
    if not path:
        return f"needs llama.cpp's test-backend-ops built with Vulkan (set {ENV_BIN}; tools/build_llama_anchor.sh)"
    if not os.access(path, os.X_OK):
        return f"{ENV_BIN}={path} is not an executable file"
    return None


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(f"out/bench_{NAME}.json"))
    ap.add_argument("--repeats", type=int, default=2, help="processes per case, interleaved over the cases")
    ap.add_argument("--bin", default=None, help=f"test-backend-ops (default: ${ENV_BIN})")
    ap.add_argument("--backend", default="Vulkan0", help="test-backend-ops' -b")
    ap.add_argument("--shapes", default="8x4,3x3", help="KV heads x GQA, comma-separated")
    ap.add_argument("--head-dims", type=_ints, default=[64, 128])
    ap.add_argument("--n-used", type=_ints, default=[8192, 32768, 131072])
    ap.add_argument("--types", default="f16,q8_0,q4_0", help="K and V type, comma-separated")
    ap.add_argument("--paths", default="default", help=f"comma-separated among {', '.join(SHADER_PATHS)}")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per process")
    args = common.parse(ap, argv)
    args.bin = args.bin or default_bin()  # none: run() says so (kvdict-bench skips before)
    args.shapes = [common.dims(s) for s in args.shapes.split(",")]
    args.types = args.types.split(",")
    args.paths = args.paths.split(",")
    bad = [t for t in args.types if t not in ROW_BYTES] + [p for p in args.paths if p not in SHADER_PATHS]
    if bad or args.repeats < 1:
        ap.error(f"types among {', '.join(ROW_BYTES)}, paths among {', '.join(SHADER_PATHS)}; --repeats at least 1")
    return args


def case_shapes(args) -> list[tuple[str, int, int, int, int]]:
    """(cache, n_kv, gqa, head_dim, n_used) of every case a run with these options times."""
    return [(c, n_kv, gqa, d, n) for (n_kv, gqa) in args.shapes for d in args.head_dims for n in args.n_used
            for c in args.types]


def decode_cases() -> list[tuple[str, int, int, int, int]]:
    """Every case any preset times: the decode cases tools/build_llama_anchor.sh adds to
    test-backend-ops (one source for both)."""
    return sorted({case for preset in PRESETS.values() for case in case_shapes(parse_args(preset))})


def case_name(cache: str, n_kv: int, gqa: int, head_dim: int, n_used: int, path: str = "default") -> str:
    """The attention benchmark's case name of the same shape (``f16 8x4 d64 n32768``); the
    scalar path's as the attention benchmark names a forced kernel (``f16 scalar 8x4 …``)."""
    return f"{cache}{'' if path == 'default' else ' ' + path} {results.shape_case(n_kv, gqa, head_dim, n_used)}"


def params_regex(cache: str, n_kv: int, gqa: int, head_dim: int, n_used: int) -> str:
    """test-backend-ops' -p for exactly one of the added decode cases (its vars() string)."""
    return (rf"^hsk={head_dim},hsv={head_dim},nh={n_kv},nr23=\[{gqa},1\],kv={n_used},nb=1,mask=0,sinks=0,"
            rf".*,type_K={cache},type_V={cache},")


def parse_output(text: str) -> dict:
    """One process's output: its test result (SQL), ggml-vulkan's line for the device, and the
    FLASH_ATTN_EXT means the perf logger printed after each graph (the first graph is
    test-backend-ops' warm-up)."""
    sql, means, device = [], [], None
    for line in text.splitlines():
        m = _DEVICE.match(line.strip())
        if m:
            device = m.group("line")
            continue
        m = _SQL.match(line.strip())
        if m:
            fields = [f.strip() for f in m.group("fields").split(",")]
            sql.append(dict(zip(fields, m.group("values").split("', '"))))
            continue
        m = _LOGGER.match(line.strip())
        if m:
            means.append(float(m.group("us")) * 1e-6)
    perf = [r for r in sql if r.get("op_name") == "FLASH_ATTN_EXT" and r.get("test_mode") == "perf"]
    if len(perf) != 1:
        raise E.AnchorError(f"expected one FLASH_ATTN_EXT perf result, found {len(perf)}")
    r = perf[0]
    out = {"supported": r.get("supported") in ("1", "true", "yes"), "params": r.get("op_params"),
           "device_description": r.get("device_description"), "backend": r.get("backend_name"),
           "build_commit": r.get("build_commit"), "vulkan_device": device, "graph_means_s": means[1:]}
    if out["supported"]:
        try:
            out["wall_per_op_s"] = float(r["time_us"]) * 1e-6
            out["n_runs"] = int(r["n_runs"])
        except (KeyError, ValueError) as e:
            raise E.AnchorError(f"a perf result without its time_us / n_runs: {e!r}") from None
    return out


def _run_case(args, case: dict) -> dict:
    shape = (case["cache"], case["n_kv"], case["gqa"], case["head_dim"], case["n_used"])
    cmd = [args.bin, "perf", "-b", args.backend, "-o", "FLASH_ATTN_EXT", "-p", params_regex(*shape),
           "--output", "sql"]
    env = dict(os.environ, GGML_VK_PERF_LOGGER="1", **SHADER_PATHS[case["path"]])
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise E.AnchorError(f"{' '.join(cmd)}: {e}") from e
    if p.returncode != 0:
        raise E.AnchorError(f"{' '.join(cmd)} exited {p.returncode}: {(p.stderr or p.stdout)[-400:]}")
    try:
        return parse_output(p.stdout + "\n" + p.stderr)
    except E.AnchorError as e:
        raise E.AnchorError(f"{' '.join(cmd)}: {e}") from None


def run(args, progress) -> dict:
    if not args.bin:
        raise E.AnchorError(missing())
    keys = ("cache", "n_kv", "gqa", "head_dim", "n_used")
    cases = [{**dict(zip(keys, case)), "path": path, "runs": []} for case in case_shapes(args) for path in args.paths]
    t0 = time.perf_counter()
    for rep in range(args.repeats):
        for k, case in enumerate(cases):
            case["runs"].append(_run_case(args, case))
            progress(f"repeat {rep + 1}/{args.repeats}, case {k + 1}/{len(cases)}: {_name(case)}")
    first = cases[0]["runs"][0]
    result = {"benchmark": NAME, "argv": args.argv, "bin": str(args.bin), "backend": first["backend"],
              "device_description": first["device_description"], "build_commit": first["build_commit"],
              "vulkan_device": first.get("vulkan_device"),
              "seconds": round(time.perf_counter() - t0, 1),
              "paths_env": {p: SHADER_PATHS[p] for p in args.paths}, "cases": cases}
    result["rows"] = make_rows(result)
    return result


def _name(case: dict) -> str:
    return case_name(case["cache"], case["n_kv"], case["gqa"], case["head_dim"], case["n_used"], case["path"])


def make_rows(result) -> list[dict]:
    rows = []
    for c in result["cases"]:
        if not all(r["supported"] for r in c["runs"]):
            continue
        gpu = [s for r in c["runs"] for s in r["graph_means_s"]]
        t = timing.timing([r["wall_per_op_s"] for r in c["runs"]], gpu or None, recorded=bool(gpu))
        kv_bytes = 2 * c["n_kv"] * c["n_used"] * ROW_BYTES[c["cache"]](c["head_dim"])
        moved = {"total": kv_bytes, "cache": kv_bytes}
        rows.append(results.row(NAME, _name(c), t,
                                cache=c["cache"], n_used=c["n_used"], n_kv=c["n_kv"], gqa=c["gqa"],
                                head_dim=c["head_dim"], moved=moved, device_kind="gpu",
                                path=f"llama.cpp ggml-vulkan FLASH_ATTN_EXT, {c['path']} path"))
    return rows


def rows(result) -> list[dict]:
    return result["rows"]


def headline(result) -> list[dict]:
    """llama.cpp's f16 flash attention at the longest context measured, per shape and path:
    GPU time over test-backend-ops' wall time per op."""
    f16 = [r for r in result["rows"] if r["cache"] == "f16" and r["gpu_s"] is not None]
    longest = max((r["n_used"] for r in f16), default=None)
    return [{"figure": "llama.cpp Vulkan flash attention, f16 cache", "case": r["case"], "numerator": r["gpu_s"],
             "denominator": r["wall_s"], "unit": "s", "ratio": r["gpu_s"] / r["wall_s"]}
            for r in f16 if r["n_used"] == longest]


def report(result) -> list[str]:
    return [f"{r['case']:24s} gpu {1e6 * r['gpu_s']:8.1f} us  wall/op {1e6 * r['wall_s']:8.1f} us"
            if r["gpu_s"] is not None else f"{r['case']:24s} wall/op {1e6 * r['wall_s']:8.1f} us"
            for r in result["rows"]]


def plot(plt, r: dict):
    """One bar per row, coloured by cache; the scalar path's hatched beside the default's."""
    fig, ax = plt.subplots(figsize=(11, 4))
    colours = {"f16": "#27a", "q8_0": "#a72", "q4_0": "#7a2"}
    rows = [x for x in r["rows"] if x["gpu_s"] is not None]
    for k, x in enumerate(rows):
        scalar = " scalar " in x["case"]
        ax.bar(k, 1e6 * x["gpu_s"], color=colours.get(x["cache"], "#888"), hatch="///" if scalar else None,
               edgecolor="white", label=f"{x['cache']}{' scalar' if scalar else ''}")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([x["case"].split(" ", 1)[1].replace("scalar ", "") for x in rows], fontsize=5, rotation=90)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7, ncol=2)
    ax.set_ylabel("µs (GPU, median)")
    ax.set_yscale("log")
    ax.set_title("llama.cpp Vulkan FLASH_ATTN_EXT, one query row (hatched: scalar path)")
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    return common.standalone(NAME, parse_args(argv), run, plot, report)


if __name__ == "__main__":
    sys.exit(main())
