"""Probe: torch SDPA's decode time on this GPU, per shape, the way the attention benchmark's
anchor times it (kvdict_vk.bench.torch_anchor.time_sdpa: calls queued behind a sleep kernel, an
L2 flush before each)
beside the same calls timed back to back without the sleep (which, for small shapes, times
the host's launches), and with each of torch's SDPA backends forced, so the anchor is known to
be the fastest torch offers. One JSON object to stdout.

    . .bundle/env.sh && python3 lab/probes/sdpa_probe.py --shapes 8x4x64,3x3x64 --n-used 8192,131072

Run as ``python lab/probes/sdpa_probe.py`` from the checkout with the package installed
(``pip install -e .``; scripts/setup.sh's .venv has it): the probe uses kvdict_vk's
public API only, and lab/ is not part of the package.
"""
import argparse
import json
import sys

from kvdict_vk.bench import common, torch_anchor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8x4x64,8x4x128,3x3x64,3x3x128", help="n_kv x gqa x head_dim, comma-separated")
    ap.add_argument("--n-used", default="8192,32768,131072")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--l2-flush-mib", type=int, default=torch_anchor.L2_FLUSH_BYTES >> 20,
                    help="a read of this many MiB before each call (0: back to back)")
    args = ap.parse_args()
    torch, note = torch_anchor.anchor()
    if torch is None:
        raise SystemExit(f"sdpa_probe: {note}")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = {b: getattr(SDPBackend, b) for b in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
                if hasattr(SDPBackend, b)}
    l2 = torch_anchor.l2_flush(torch, args.l2_flush_mib << 20)
    rows = []
    for shape in args.shapes.split(","):
        n_kv, gqa, hd = common.dims(shape)
        for n_used in (int(x) for x in args.n_used.split(",")):
            r = torch_anchor.time_sdpa(torch, n_kv, gqa, hd, n_used, args.calls, flush=l2)
            row = {"n_kv": n_kv, "gqa": gqa, "head_dim": hd, "n_used": n_used, "default_s": r["seconds"],
                   "queued": r["queued"], "unqueued_s": r["unqueued_seconds"], "launch_s": r["launch_s"]}
            for name, backend in backends.items():
                try:
                    with sdpa_kernel(backend):
                        b = torch_anchor.time_sdpa(torch, n_kv, gqa, hd, n_used, args.calls, flush=l2)
                    row[f"{name.lower()}_s"] = b["seconds"]
                except RuntimeError as e:  # a backend that does not take this shape
                    row[f"{name.lower()}_s"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append(row)
            print(json.dumps(row), flush=True, file=sys.stderr)
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                      "l2_flush_bytes": args.l2_flush_mib << 20, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
