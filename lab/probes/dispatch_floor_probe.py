"""What a dispatch costs when it does almost nothing: the floor under every op of a device
forward.

One recording of N copies of the `scatter` shader (one workgroup, a few words), each behind a
compute→compute barrier on the buffer it writes (a dependent chain, as the forward's ops are),
and one of N copies with no barrier between them; GPU time from the recording's timestamps
(median over --runs, after warm-up runs), divided by N.

    python lab/probes/dispatch_floor_probe.py [--n 256] [--runs 20] [--out docs/results/<device>/dispatch_floor.json]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main(argv=None) -> None:
    from kvdict_vk.vk import get_device
    from kvdict_vk.vk.kernels import Buffer, barrier, pipeline
    from kvdict_vk.vk.submit import Recording
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    dev = get_device(None)
    src = Buffer(dev, 64, "device", "floor source", np.arange(64, dtype=np.uint32))
    dst = Buffer(dev, 64, "device", "floor destination")
    k = pipeline(dev, "scatter", [src, dst], max_items=32)
    op = k.op(src_word=0, dst_word=0, row_words=1, group_rows=1, group_stride=1, n_words=32)
    out = {"device": dev.name, "n": a.n, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": "python lab/probes/dispatch_floor_probe.py " + " ".join(argv or [])}
    for name, ops in (("dependent", [x for _ in range(a.n) for x in (op, barrier(dst))]),
                      ("independent", [op] * a.n)):
        rec = Recording(dev, ops, timestamps=True, what=name)
        times = []
        for i in range(a.runs + 5):
            rec.run()
            if i >= 5:
                times.append(rec.gpu_seconds())
        rec.free()
        us = 1e6 * float(np.median(times)) / a.n
        out[f"{name}_us"] = us  # a dispatch
        print(f"{name:12s}: {us:6.2f} µs a dispatch")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
