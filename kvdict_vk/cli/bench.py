"""kvdict-bench: the side-by-side benchmarks on one Vulkan device, their rows and headline
figures in one summary.json.

    kvdict-bench                           # all of them, sizes for this device (minutes)
    kvdict-bench --quick                   # small settings (a minute or so on lavapipe)
    kvdict-bench --out-dir docs/results/h200          # the committed results of a device
    kvdict-bench omp reconstruct --json    # some of them; the summary as JSON on stdout
    kvdict-bench --out-dir D --resummarize # summary.json again from D's benchmark JSONs

NAME is one of fixed, attention, encode, omp, reconstruct, llama_fa (default: all, in that order;
llama_fa — llama.cpp's Vulkan flash attention on the same device — where a test-backend-ops
binary is given: kvdict_vk.bench.llama_fa).
Each runs in this process on the same device and writes <out-dir>/<name>.json and .png
(the PNG only when matplotlib is installed). Sizes come from each benchmark's presets:
"gpu" (working sets well past a GPU's L2) on a GPU, "cpu" on a software driver, or what
--preset / --quick say.

<out-dir>/summary.json: device, driver, command, when; roofline (the best copy shader's
read + write bandwidth, measured first: kvdict_vk.bench.roofline); anchors (on a GPU with
torch + CUDA: a tiny CUDA kernel + synchronize, torch's device copy; else null with a
note: kvdict_vk.bench.torch_anchor); fixed_costs_us (kvdict_vk.bench.fixed); rows (one per measured case: kvdict_vk.bench.results has the
schema); and per benchmark its headline figures (numerator / denominator = ratio, from
the benchmark's medians). Logs and progress go to stderr, the summary table (or --json)
to stdout.

RESUMMARIZE: --resummarize rebuilds <out-dir>/summary.json from the benchmarks' JSONs there
(a run the device tool could not return whole, or one benchmark run again alone): rows,
headlines and fixed costs from them (each entry keeps its run's "when"), the device and the
roofline from the JSONs' own records, the anchors (a property of the device and torch, not
of this code) kept from the summary.json it replaces when that names the same device.

Exit status: 0; 1 when a benchmark failed (one line on stderr names it); 2 on bad
arguments or no usable Vulkan device. A benchmark whose optional dependency is missing
(scikit-learn for omp, a test-backend-ops binary for llama_fa) is skipped with a note and
recorded as "skipped" in summary.json; --resummarize skips, rather than fails, a benchmark
whose JSON is absent where it could not run either.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

from .. import errors as E
from ..bench import attention, common, encode, fixed, llama_fa, omp, reconstruct, results, roofline, torch_anchor

BENCHMARKS = {"fixed": fixed, "attention": attention, "encode": encode, "omp": omp, "reconstruct": reconstruct,
              "llama_fa": llama_fa}
ROOFLINE_KEYS = ("bytes", "bytes_per_s", "kernel", "timing", "gpu_s", "wall_s", "repeats", "note")


def _log(msg: str) -> None:
    print(f"[kvdict-bench] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="kvdict-bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"{', '.join(BENCHMARKS)} (default: all)")
    ap.add_argument("--quick", action="store_true", help="small settings, for a smoke run (= --preset quick)")
    ap.add_argument("--preset", choices=common.PRESETS, default=None,
                    help="size preset (default: gpu on a GPU, cpu on a software driver)")
    ap.add_argument("--out-dir", type=Path, default=Path("out/bench"), help="for the JSON, PNG and summary.json")
    ap.add_argument("--device", default=None, help="index or name substring (default: $KVDICT_VK_DEVICE, 0)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default: each benchmark's)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--resummarize", action="store_true",
                    help="write summary.json from the benchmarks' JSONs already in --out-dir instead of running "
                         "them, measuring nothing (see RESUMMARIZE below)")
    a = ap.parse_args(argv)
    unknown = [n for n in a.names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark {', '.join(unknown)} (choose from {', '.join(BENCHMARKS)})")
    if a.repeats is not None and a.repeats < 1:
        ap.error("--repeats must be at least 1")
    if a.quick and a.preset not in (None, "quick"):
        ap.error(f"--quick contradicts --preset {a.preset}")
    a.names = list(dict.fromkeys(a.names)) or list(BENCHMARKS)
    a.argv = sys.argv[1:] if argv is None else list(argv)
    return a


def bench_argv(name: str, a, preset: str) -> list[str]:
    """The benchmark's own command line for these kvdict-bench options (later options win,
    so --repeats overrides the preset's)."""
    mod = BENCHMARKS[name]
    argv = list(mod.PRESETS[preset])
    if a.repeats is not None:
        argv += ["--repeats", str(a.repeats)]
    if mod.USES_DEVICE and a.device is not None:
        argv += ["--device", a.device]
    return argv + ["--out", str(a.out_dir / f"{name}.json")]


def run_benchmark(name: str, a, preset: str) -> tuple[dict, dict | None]:
    """Run one benchmark, write its JSON + PNG: (its summary entry, its result or None)."""
    mod = BENCHMARKS[name]
    reason = common.unavailable(mod)
    if reason:
        _log(f"{name}: skipped: {reason}")
        return {"skipped": reason}, None
    args = mod.parse_args(bench_argv(name, a, preset))
    progress = common.Progress(name)
    t0 = time.perf_counter()
    try:
        result = mod.run(args, progress)
    except Exception as e:  # one benchmark's failure must not lose the others' results
        progress.end()
        if not isinstance(e, E.KvDictError):  # a bug, not a refused configuration: show where
            traceback.print_exc(file=sys.stderr)
        _log(f"{name}: failed: {type(e).__name__}: {e}")
        return {"failed": f"{type(e).__name__}: {e}"}, None
    progress.end()
    seconds = time.perf_counter() - t0
    written = common.write_outputs(result, args.out, mod.plot)
    _log(f"{name}: {seconds:.1f} s, wrote {' and '.join(map(str, written))}")
    return {"seconds": round(seconds, 1), "argv": args.argv, "json": str(written[0]),
            "png": str(written[1]) if len(written) > 1 else None, "headline": mod.headline(result),
            "rows": len(mod.rows(result))}, result


def load_benchmark(name: str, a) -> tuple[dict, dict | None]:
    """--resummarize: a benchmark's summary entry and result from the JSON a run wrote."""
    mod, path = BENCHMARKS[name], a.out_dir / f"{name}.json"
    if not path.is_file():  # a skip where the benchmark could not have run here either
        reason = common.unavailable(mod)
        entry = {"skipped": f"no {path} ({reason})"} if reason else {"failed": f"no {path}"}
        _log(f"{name}: {next(iter(entry))}: {next(iter(entry.values()))}")
        return entry, None
    result = json.loads(path.read_text())
    png = path.with_suffix(".png")
    return {"seconds": result.get("seconds"), "argv": result.get("argv"), "json": str(path),
            "png": str(png) if png.is_file() else None, "headline": mod.headline(result),
            "rows": len(mod.rows(result)), "when": result.get("when")}, result


def _values(fig: dict) -> str:
    num, den, unit = fig["numerator"], fig["denominator"], fig["unit"]
    if unit == "s":
        return f"{1e3 * num:.3f} / {1e3 * den:.3f} ms"
    if unit == "GB/s":
        return f"{num:.3f} / {den:.3f} GB/s"
    return f"{num:,.0f} / {den:,.0f} {unit}"


def summary_table(summary: dict) -> list[str]:
    lines = []
    roof = summary["roofline"]
    if roof and "bytes_per_s" in roof:
        lines.append(f"roofline: {roof['kernel']} {roof['bytes_per_s'] / 1e9:.2f} GB/s read+write over "
                     f"{roof['bytes'] / 2**20:.0f} MiB ({roof['timing']} time)")
    anc = summary["anchors"]
    if anc:
        lines.append("torch anchors: " + (f"CUDA tiny kernel + sync {anc['cuda_tiny_kernel_sync_us']:.1f} µs, device copy "
                                          f"{anc['torch_copy_bytes_per_s'] / 1e9:.1f} GB/s"
                                          if anc["torch_copy_bytes_per_s"] else anc["note"]))
    if summary["fixed_costs_us"]:
        lines.append("fixed costs (µs, wall median): " + ", ".join(
            f"{k} {v:.1f}" for k, v in summary["fixed_costs_us"].items()))
    lines.append(f"{'benchmark':<12} {'figure':<36} {'case':<24} {'ratio':>7}  from medians")
    for name, entry in summary["benchmarks"].items():
        if "headline" not in entry:
            state = "skipped" if "skipped" in entry else "FAILED"
            lines.append(f"{name:<12} {state}: {entry.get('skipped') or entry.get('failed')}")
            continue
        for fig in entry["headline"]:
            goal = fig.get("goal")
            note = f"  (goal ≥ {goal['at_least']}: {'met' if goal['met'] else 'NOT met'})" if goal else ""
            lines.append(f"{name:<12} {fig['figure']:<36} {fig['case']:<24} {fig['ratio']:7.2f}  "
                         f"{_values(fig)}{note}")
    where = f" on {summary['device']}" if summary["device"] else ""
    lines.append(f"{summary['seconds']:.0f} s{where}, {len(summary['rows'])} rows; JSON and PNG in "
                 f"{summary['out_dir']}")
    return lines


def _recorded_device(info: dict) -> SimpleNamespace:
    """A benchmark JSON's device record, shaped as _device_fields reads a Device."""
    return SimpleNamespace(info=SimpleNamespace(**info), is_cpu=info["device_type"] == "cpu")


def _recorded_header(a, results_: dict) -> tuple:
    """--resummarize: (device, roofline, anchors, notes) from the benchmarks' JSONs and the
    summary.json they replace; nothing is measured."""
    recorded = [r for r in results_.values() if r is not None and r.get("device")]
    dev = _recorded_device(recorded[0]["device"]) if recorded else None
    roof_from = next((n for n, r in results_.items() if r is not None and isinstance(r.get("roofline"), dict)), None)
    roof = {k: v for k, v in results_[roof_from]["roofline"].items() if k in ROOFLINE_KEYS} if roof_from else None
    notes = ["re-summarised (kvdict-bench --resummarize) from the benchmarks' JSONs: each row is from its "
             "benchmark's own run (benchmarks[name].when)"]
    if roof_from:
        notes.append(f"roofline: {roof_from}.json's (measured at the start of that run)")
    anchors, old = None, a.out_dir / "summary.json"
    if dev is not None and old.is_file():
        prev = json.loads(old.read_text())
        if prev.get("device") == dev.info.name and prev.get("anchors"):
            anchors = prev["anchors"]
            notes.append(f"anchors: kept from the summary.json this one replaced (its run: {prev.get('when')})")
    return dev, roof, anchors, notes


def _device_fields(dev) -> dict:
    if dev is None:
        return {"device": None, "driver": None, "device_kind": None, "timestamps": None}
    from ..vk.submit import device_kind, timestamps_usable
    info = dev.info
    return {"device": info.name, "driver": f"{info.driver_name} {info.driver_info}".strip(),
            "device_kind": device_kind(dev), "timestamps": timestamps_usable(dev)}


def main(argv=None) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()
    if a.resummarize:
        loaded = {name: load_benchmark(name, a) for name in a.names}
        dev, roof, anchors, notes = _recorded_header(a, {name: r for name, (_, r) in loaded.items()})
        preset = "quick" if a.quick else a.preset or (common.preset_for(dev) if dev else "cpu")
        return _summarize(a, t0, dev, preset, roof, anchors, notes, loaded.__getitem__)
    dev = None
    if any(BENCHMARKS[n].USES_DEVICE for n in a.names):
        try:  # once, up front: a wrong --device is an argument error, not five failed benchmarks
            dev = common.open_device(SimpleNamespace(device=a.device, validation=False))
        except (E.KvDictError, ImportError) as e:
            print(f"kvdict-bench: no usable Vulkan device: {e}", file=sys.stderr)
            return 2
    preset = "quick" if a.quick else a.preset or (common.preset_for(dev) if dev else "cpu")
    _log(f"{', '.join(a.names)} (preset {preset})" + (f" on {dev.name}" if dev else "") + f" → {a.out_dir}")
    roof = None
    if dev is not None:  # first, on an idle device: every bandwidth row is divided by it
        try:
            roof = {k: v for k, v in roofline.measure(dev).items() if k in ROOFLINE_KEYS}
            _log(f"roofline: {roof['bytes_per_s'] / 1e9:.2f} GB/s ({roof['kernel']}, {roof['timing']} time)")
        except E.KvDictError as e:
            roof = {"failed": f"{type(e).__name__}: {e}"}
            _log(f"roofline: failed: {roof['failed']}")
    anchors = torch_anchor.device_anchors(roof["bytes"] if roof and "bytes" in roof else roofline.GPU_BYTES) \
        if dev is not None and common.preset_for(dev) == "gpu" else None
    notes = [f"roofline: {roof['note']}"] if roof and roof.get("note") else []
    return _summarize(a, t0, dev, preset, roof, anchors, notes, lambda name: run_benchmark(name, a, preset))


def _summarize(a, t0, dev, preset, roof, anchors, notes, produce) -> int:
    """summary.json (rewritten after each benchmark: a killed run keeps the rest) from
    produce(name) → (summary entry, result or None) for each benchmark; the table or JSON."""
    entries, rows, fixed_costs, fixed_gpu = {}, [], None, None

    def current_summary() -> dict:
        return {**_device_fields(dev), "command": "kvdict-bench " + shlex.join(a.argv),
                "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "preset": preset, "quick": preset == "quick",
                "roofline": roof, "anchors": anchors, "fixed_costs_us": fixed_costs, "fixed_costs_gpu_us": fixed_gpu,
                "rows": results.check(rows), "notes": notes, "tool": "kvdict-bench", "argv": a.argv,
                "seconds": round(time.perf_counter() - t0, 1), "out_dir": str(a.out_dir),
                "host": common.host_info(), "benchmarks": entries}
    for name in a.names:
        entries[name], result = produce(name)
        if result is not None:
            rows += BENCHMARKS[name].rows(result)
            notes += getattr(BENCHMARKS[name], "notes", lambda r: [])(result)
            if name == "fixed":
                fixed_costs, fixed_gpu = fixed.fixed_costs_us(result), fixed.fixed_costs_gpu_us(result)
        common.write_json(current_summary(), a.out_dir / "summary.json")
    summary = current_summary()
    common.write_json(summary, a.out_dir / "summary.json")
    print(json.dumps(summary, indent=1) if a.json else "\n".join(summary_table(summary)))
    return 1 if any("failed" in e for e in entries.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
