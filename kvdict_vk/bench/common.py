"""What the benchmarks share: interleaved timing, statistics, the run header (host and
device), size presets, JSON and PNG output, and a progress line on stderr. (Arenas in a
given mode come from ``runtime.enabled_with``, random slots from ``kvdict_vk.synthetic``.)

Every benchmark measures its candidates side by side in one process, interleaved (machine
noise hits every candidate alike): wall time by time.perf_counter, GPU time from the
timestamps of recorded submissions (kvdict_vk.bench.timing) where the device has them.

Each benchmark module has PRESETS, its own command-line options per size preset:
"quick" (a smoke run: seconds on lavapipe), "cpu" (its defaults: what a software driver
finishes in minutes) and "gpu" (working sets well past a GPU's L2). kvdict-bench picks
"gpu" or "cpu" by the device's kind unless told (--preset, --quick).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from .. import diagnostics
from ..dictionary import FORGE_SPARSITY


def stats(samples) -> dict:
    """Median, quartiles, min/max and the samples themselves."""
    a = np.asarray(samples, float)
    return {"median": float(np.median(a)), "p25": float(np.percentile(a, 25)),
            "p75": float(np.percentile(a, 75)), "min": float(a.min()), "max": float(a.max()),
            "samples": a.tolist()}


def dims(text: str) -> tuple[int, ...]:
    """A shape written "a x b [x c]" ("8x4x64": n_kv × gqa × head_dim) as a tuple of ints —
    how the benchmarks and the tools spell one on the command line."""
    return tuple(int(x) for x in text.lower().split("x"))


def interleaved(candidates: dict, repeats: int, after_repeat=None, before=None) -> tuple[dict, dict]:
    """Run every candidate once per repeat, in turn: ({name: [seconds, ...]}, {name: what
    its last call returned}). ``after_repeat(rep, seconds)`` is called after each repeat;
    ``before()``, where given, before each call, outside its timing (a dict: each
    candidate's own, or none for a name it lacks)."""
    seconds = {name: [] for name in candidates}
    last = {}
    for rep in range(repeats):
        for name, fn in candidates.items():
            pre = before.get(name) if isinstance(before, dict) else before
            if pre is not None:
                pre()
            t = time.perf_counter()
            last[name] = fn()
            seconds[name].append(time.perf_counter() - t)
        if after_repeat:
            after_repeat(rep, seconds)
    return seconds, last


def host_info() -> dict:
    """The host as every result names it (kvdict_vk.diagnostics.host: OS, Python, CPU, load)."""
    return diagnostics.host()


def open_device(args):
    """The Vulkan device ``args.device`` names. Without ``--validation`` the Khronos layer is
    disabled first, even when VK_INSTANCE_LAYERS asks for it (the test session does): it
    distorts timings. That only takes effect before the process's first Vulkan instance."""
    if not args.validation:
        os.environ["VK_LOADER_LAYERS_DISABLE"] = "VK_LAYER_KHRONOS_validation"
    from kvdict_vk.vk import get_device
    return get_device(args.device)


def run_header(tool: str, args, dev, t0: float) -> dict:
    """The keys every GPU benchmark's JSON starts with: the run, and kvdict_vk.diagnostics'
    host, versions (kp and its patch, the driver) and the device (limits, features)."""
    device = diagnostics.device_entry(dev.info, selected=True)
    return {"tool": tool, "argv": args.argv, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "seconds": round(time.time() - t0, 1), "host": host_info(), "versions": diagnostics.versions([device]),
            "device": device, "validation_layer": bool(args.validation)}


def parser(doc: str, name: str, repeats: int, gpu: bool = True) -> argparse.ArgumentParser:
    """The options every benchmark has: --out (default out/bench_<name>.json), --repeats,
    the dictionary's dimensions and, on the GPU, the KV heads, --device and --validation."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(f"out/bench_{name}.json"))
    ap.add_argument("--repeats", type=int, default=repeats, help="interleaved repeats")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--n-atoms", type=int, default=1024)
    ap.add_argument("--sparsity", type=int, default=FORGE_SPARSITY,
                    help="code words a slot (default: the forge's, the certified format's)")
    if gpu:
        ap.add_argument("--n-kv", type=int, default=3, help="KV heads")
        ap.add_argument("--device", default=None, help="index or name substring (default: $KVDICT_VK_DEVICE, 0)")
        ap.add_argument("--validation", action="store_true",
                        help="keep the Khronos validation layer if VK_INSTANCE_LAYERS requests it")
    return ap


def parse(parser, argv):
    """``parser.parse_args(argv)`` that remembers the argv, for the JSON."""
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    return args


def missing_modules(requires: dict) -> str | None:
    """Why a benchmark cannot run here ({module: package} it imports), or None."""
    absent = [pkg for mod, pkg in requires.items() if importlib.util.find_spec(mod) is None]
    return f"needs {', '.join(absent)} (not installed)" if absent else None


def unavailable(mod) -> str | None:
    """Why benchmark module ``mod`` cannot run here, or None: a module it imports is not
    installed (its REQUIRES), or what its own ``missing()`` says (an outside program)."""
    return missing_modules(mod.REQUIRES) or (mod.missing() if hasattr(mod, "missing") else None)


PRESETS = ("quick", "cpu", "gpu")


def preset_for(dev) -> str:
    """The size preset a device gets by default: "gpu" on a GPU, "cpu" on a software driver."""
    from kvdict_vk.vk.submit import device_kind
    return device_kind(dev)


def write_json(result: dict, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def save_png(draw, result: dict, path: Path) -> Path | None:
    """``draw(plt, result) -> figure`` saved to ``path``; None, with a note on stderr, when
    matplotlib (an optional extra) is not installed."""
    try:
        import matplotlib
    except ImportError:
        print(f"note: matplotlib is not installed; no {path}", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = draw(plt, result)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)  # kvdict-bench draws several in one process
    return Path(path)


def write_outputs(result: dict, out: Path, draw) -> list[Path]:
    """The JSON at ``out`` and the PNG beside it (same stem): the paths written."""
    written = [write_json(result, out)]
    png = save_png(draw, result, Path(out).with_suffix(".png"))
    return written + ([png] if png else [])


def standalone(name: str, args, run, draw, report) -> int:
    """What every benchmark's ``main`` does: run, write JSON + PNG, print the report."""
    progress = Progress(name)
    try:
        result = run(args, progress)
    finally:
        progress.end()
    written = write_outputs(result, args.out, draw)
    print("\n".join(report(result)))
    print("wrote " + " and ".join(map(str, written)))
    return 0


class Progress:
    """One line per benchmark step on stderr: rewritten in place (``\\r``) on a terminal,
    a plain ``[name] step`` line otherwise (logs, CI). Call it with each step's text;
    ``end()`` finishes the line before anything else is printed."""

    def __init__(self, name: str, stream=None):
        self.name = name
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self._shown = 0  # characters of the line being rewritten

    def __call__(self, step: str) -> None:
        line = f"[{self.name}] {step}"
        if not self.tty:
            self.stream.write(line + "\n")
        else:
            # a line wider than the terminal wraps, and \r then returns to its last row only
            line = line[:max(20, shutil.get_terminal_size().columns - 1)]
            self.stream.write("\r" + line.ljust(self._shown))
            self._shown = len(line)
        self.stream.flush()

    def end(self) -> None:
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = 0
