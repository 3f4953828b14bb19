"""Probe: reconstruct.comp's chunk mapping on a GPU with CHUNKS output chunks per invocation
(arena.RECONSTRUCT_GPU_CHUNKS is the default; the shader takes any divisor of head_dim / 4) and
the reconstruct kernels' workgroup cap (kernels.MAX_WORKGROUPS: the grid-stride loop covers
the rest). Runs kvdict_vk.bench.reconstruct once per (CHUNKS, cap) with the arenas'
reconstruct_chunks and the reconstruct kernels' cap overridden (the copy shader and the f32 / f16
baselines keep theirs), each writing <out-dir>/chunks<C>_wg<W>.json.

    . .bundle/env.sh && KVDICT_VK_DEVICE=NVIDIA python3 tools/reconstruct_chunks_probe.py \
        --chunks 1,2,4 --max-workgroups 4096 --out-dir $OUT/chunks -- <bench.reconstruct args>
"""
import argparse
import sys

from kvdict_vk.bench import reconstruct
from kvdict_vk.vk import KvArena, kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="1,2,4")
    ap.add_argument("--max-workgroups", default=str(kernels.MAX_WORKGROUPS))
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    rest = [a for a in args.bench_args if a != "--"]
    plain_chunks, plain_init = KvArena.reconstruct_chunks, kernels.Kernel.__init__
    cap = {"reconstruct": kernels.MAX_WORKGROUPS}

    def init(self, device, shader, *a, **k):
        saved = kernels.MAX_WORKGROUPS
        if shader.startswith("reconstruct"):
            kernels.MAX_WORKGROUPS = cap["reconstruct"]
        try:
            plain_init(self, device, shader, *a, **k)
        finally:
            kernels.MAX_WORKGROUPS = saved

    kernels.Kernel.__init__ = init
    try:
        for w in (int(x) for x in args.max_workgroups.split(",")):
            for c in (int(x) for x in args.chunks.split(",")):
                KvArena.reconstruct_chunks = property(lambda self, c=c: c)
                cap["reconstruct"] = w
                print(f"CHUNKS {c} MAX_WORKGROUPS {w}", file=sys.stderr, flush=True)
                reconstruct.main([*rest, "--out", f"{args.out_dir}/chunks{c}_wg{w}.json"])
    finally:
        KvArena.reconstruct_chunks, kernels.Kernel.__init__ = plain_chunks, plain_init


if __name__ == "__main__":
    main()
