"""kvdict-bench: the side-by-side benchmarks on one Vulkan device, and their headline figures.

    kvdict-bench                           # all four, full settings (several minutes)
    kvdict-bench --quick                   # small settings (under 2 minutes on lavapipe)
    kvdict-bench omp reconstruct --json    # some of them; the summary as JSON on stdout

NAME is one of attention, encode, omp, reconstruct (default: all, in that order). Each runs
in this process on the same device and writes <out-dir>/<name>.json and .png (the PNG
only when matplotlib is installed); <out-dir>/summary.json holds each one's headline
figures (numerator / denominator = ratio, the medians of the benchmark's JSON). Logs and
progress go to stderr, the summary table (or --json) to stdout.

Exit status: 0; 1 when a benchmark failed (one line on stderr names it); 2 on bad
arguments or no usable Vulkan device. A benchmark whose optional dependency is missing
(scikit-learn for omp) is skipped with a note and recorded as "skipped" in summary.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from .. import errors as E
from ..bench import attention, common, encode, omp, reconstruct

BENCHMARKS = {"attention": attention, "encode": encode, "omp": omp, "reconstruct": reconstruct}


def _log(msg: str) -> None:
    print(f"[kvdict-bench] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="kvdict-bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"{', '.join(BENCHMARKS)} (default: all)")
    ap.add_argument("--quick", action="store_true", help="small settings, for a smoke run")
    ap.add_argument("--out-dir", type=Path, default=Path("out/bench"), help="for the JSON, PNG and summary.json")
    ap.add_argument("--device", default=None, help="index or name substring (default: $KVDICT_VK_DEVICE, 0)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default: each benchmark's)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = ap.parse_args(argv)
    unknown = [n for n in a.names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark {', '.join(unknown)} (choose from {', '.join(BENCHMARKS)})")
    if a.repeats is not None and a.repeats < 1:
        ap.error("--repeats must be at least 1")
    a.names = list(dict.fromkeys(a.names)) or list(BENCHMARKS)
    return a


def bench_argv(name: str, a) -> list[str]:
    """The benchmark's own command line for these kvdict-bench options (later options win,
    so --repeats overrides --quick's)."""
    mod = BENCHMARKS[name]
    argv = list(mod.QUICK) if a.quick else []
    if a.repeats is not None:
        argv += ["--repeats", str(a.repeats)]
    if mod.USES_DEVICE and a.device is not None:
        argv += ["--device", a.device]
    return argv + ["--out", str(a.out_dir / f"{name}.json")]


def run_benchmark(name: str, a) -> dict:
    """Run one benchmark, write its JSON + PNG: its summary entry."""
    mod = BENCHMARKS[name]
    reason = common.missing_modules(mod.REQUIRES)
    if reason:
        _log(f"{name}: skipped: {reason}")
        return {"skipped": reason}
    args = mod.parse_args(bench_argv(name, a))
    progress = common.Progress(name)
    t0 = time.perf_counter()
    try:
        result = mod.run(args, progress)
    except E.KvDictError as e:
        progress.end()
        _log(f"{name}: failed: {type(e).__name__}: {e}")
        return {"failed": f"{type(e).__name__}: {e}"}
    progress.end()
    seconds = time.perf_counter() - t0
    written = common.write_outputs(result, args.out, mod.plot)
    _log(f"{name}: {seconds:.1f} s, wrote {' and '.join(map(str, written))}")
    return {"seconds": round(seconds, 1), "argv": args.argv, "json": str(written[0]),
            "png": str(written[1]) if len(written) > 1 else None, "headline": mod.headline(result)}


def _values(fig: dict) -> str:
    num, den, unit = fig["numerator"], fig["denominator"], fig["unit"]
    if unit == "s":
        return f"{1e3 * num:.2f} / {1e3 * den:.2f} ms"
    if unit == "GB/s":
        return f"{num:.3f} / {den:.3f} GB/s"
    return f"{num:,.0f} / {den:,.0f} {unit}"


def summary_table(summary: dict) -> list[str]:
    lines = [f"{'benchmark':<12} {'figure':<36} {'case':<22} {'ratio':>7}  from medians"]
    for name, entry in summary["benchmarks"].items():
        if "headline" not in entry:
            state = "skipped" if "skipped" in entry else "FAILED"
            lines.append(f"{name:<12} {state}: {entry.get('skipped') or entry.get('failed')}")
            continue
        for fig in entry["headline"]:
            goal = fig.get("goal")
            note = f"  (goal ≥ {goal['at_least']}: {'met' if goal['met'] else 'NOT met'})" if goal else ""
            lines.append(f"{name:<12} {fig['figure']:<36} {fig['case']:<22} {fig['ratio']:7.2f}  "
                         f"{_values(fig)}{note}")
    where = f" on {summary['device']}" if summary["device"] else ""
    lines.append(f"{summary['seconds']:.0f} s{where}; JSON and PNG in {summary['out_dir']}")
    return lines


def main(argv=None) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()
    device = None
    if any(BENCHMARKS[n].USES_DEVICE for n in a.names):
        try:  # once, up front: a wrong --device is an argument error, not three failed benchmarks
            device = common.open_device(SimpleNamespace(device=a.device, validation=False)).name
        except (E.KvDictError, ImportError) as e:
            print(f"kvdict-bench: no usable Vulkan device: {e}", file=sys.stderr)
            return 2
    _log(f"{', '.join(a.names)}{' (quick)' if a.quick else ''}" + (f" on {device}" if device else "")
         + f" → {a.out_dir}")
    entries = {name: run_benchmark(name, a) for name in a.names}
    summary = {"tool": "kvdict-bench", "argv": sys.argv[1:] if argv is None else list(argv),
               "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": a.quick,
               "seconds": round(time.perf_counter() - t0, 1), "out_dir": str(a.out_dir), "device": device,
               "host": common.host_info(), "benchmarks": entries}
    common.write_json(summary, a.out_dir / "summary.json")
    print(json.dumps(summary, indent=1) if a.json else "\n".join(summary_table(summary)))
    return 1 if any("failed" in e for e in entries.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
