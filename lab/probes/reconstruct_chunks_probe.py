"""Probe: reconstruct.comp's chunk mapping on a GPU with CHUNKS output chunks per invocation
(the shader takes any divisor of head_dim / 4), PIPELINED or not, and the reconstruct kernels'
workgroup cap (kernels.MAX_WORKGROUPS: the grid-stride loop covers the rest) — the choices
arena.RECONSTRUCT_GPU_MAPPINGS makes per sparsity. Runs kvdict_vk.bench.reconstruct once per
(CHUNKS, PIPELINED, cap) with the read wing's reconstruct_mapping and the reconstruct kernels' cap
overridden for every sparsity of the run (the copy shader and the f32 / f16 baselines keep
theirs), each writing <out-dir>/chunks<C>_pipe<P>_wg<W>.json.

    . .bundle/env.sh && KVDICT_VK_DEVICE=NVIDIA python3 lab/probes/reconstruct_chunks_probe.py \
        --chunks 2,4 --pipelined 0,1 --out-dir $OUT/chunks -- <bench.reconstruct args>

Run as ``python lab/probes/reconstruct_chunks_probe.py`` from the checkout with the package installed
(``pip install -e .``; scripts/setup.sh's .venv has it): the probe uses kvdict_vk's
public API only, and lab/ is not part of the package.
"""
import argparse
import sys

from kvdict_vk.bench import reconstruct
from kvdict_vk.vk import kernels
from kvdict_vk.vk.read import mapping


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="1,2,4")
    ap.add_argument("--pipelined", default="0,1")
    ap.add_argument("--max-workgroups", default=str(kernels.MAX_WORKGROUPS))
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    rest = [a for a in args.bench_args if a != "--"]
    plain_mapping, plain_init = mapping.reconstruct_mapping, kernels.Kernel.__init__
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
                for p in (bool(int(x)) for x in args.pipelined.split(",")):
                    mapping.reconstruct_mapping = lambda memory, sparsity, atoms_f16=False, c=c, p=p: (c, p)
                    cap["reconstruct"] = w
                    print(f"CHUNKS {c} PIPELINED {int(p)} MAX_WORKGROUPS {w}", file=sys.stderr, flush=True)
                    reconstruct.main([*rest, "--out", f"{args.out_dir}/chunks{c}_pipe{int(p)}_wg{w}.json"])
    finally:
        mapping.reconstruct_mapping, kernels.Kernel.__init__ = plain_mapping, plain_init


if __name__ == "__main__":
    main()
