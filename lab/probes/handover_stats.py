"""Probe (CPU only): what attend_flash_coded's hand-over of V code words to their atoms' owners
costs on given code words — captured ones (lab/probes/atom_usage.py --save-codes) against uniform
draws — counted from the shader's rules, not timed.

Per chunk of LOCAL tokens (a token per invocation, invocation x owning the atoms a with
a % LOCAL == x): the hand-over passes the chunk takes (each pass places at most BUCKET code
words per owner, so ceil(most words on one owner / BUCKET)), the code words past full buckets
in its first pass (what a spill list of SPILL words would have to hold for the chunk to take one
pass: `chunks_over_one_pass_with_spill`), and, per warp of 32 tokens and
code word j (one integer atomicAdd on count_sh[a % LOCAL] per lane), how many lanes hit the
same address (same-address atomics serialise) and the busiest shared-memory bank (32 banks of
4 bytes: count_sh[x] sits in bank x % 32). The uniform rows draw every atom index with equal
chance, as the attention benchmark's slots do. One JSON object to stdout.

    python lab/probes/handover_stats.py --codes docs/results/captured_codes_gpl3.npz

Run as ``python lab/probes/handover_stats.py`` from the checkout with the package installed
(``pip install -e .``; scripts/setup.sh's .venv has it): the probe uses kvdict_vk's
public API only, and lab/ is not part of the package.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from kvdict_vk import codec
from kvdict_vk.bench import attention as BA
from kvdict_vk.vk.attend.specs import FLASH_CODED_BUCKET

WARP, BANKS = 32, 32


def chunk_stats(atoms: np.ndarray, local: int, bucket: int, spill: int) -> dict:
    """atoms: (streams, tokens, sparsity) V atom indices; chunks of ``local`` tokens from token 0."""
    streams, tokens, s = atoms.shape
    n_chunks = tokens // local
    chunks = atoms[:, :n_chunks * local].reshape(streams * n_chunks, local, s)
    owners = chunks % local
    counts = [np.bincount(c.ravel(), minlength=local) for c in owners]
    most = np.array([n.max() for n in counts])
    past = np.array([np.maximum(n - bucket, 0).sum() for n in counts])  # past full buckets, first pass
    passes = np.maximum(1, -(-most // bucket))
    same, bank = [], []
    for c in owners:
        for w0 in range(0, local, WARP):
            for j in range(s):
                addr = c[w0:w0 + WARP, j]
                same.append(np.bincount(addr).max())
                bank.append(np.bincount(addr % BANKS, minlength=BANKS).max())
    return {"chunks": int(len(passes)), "passes_mean": float(passes.mean()),
            "chunks_over_one_pass": float((passes > 1).mean()), "passes_max": int(passes.max()),
            "past_buckets_mean": float(past.mean()), "past_buckets_max": int(past.max()),
            "chunks_over_one_pass_with_spill": float((past > spill).mean()),
            "most_on_one_owner_mean": float(most.mean()), "most_on_one_owner_max": int(most.max()),
            "same_address_lanes_mean": float(np.mean(same)), "same_address_lanes_max": int(np.max(same)),
            "busiest_bank_lanes_mean": float(np.mean(bank)), "busiest_bank_lanes_max": int(np.max(bank))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codes", required=True, help=".npz of captured code words (lab/probes/atom_usage.py --save-codes)")
    ap.add_argument("--locals", default="256,128", help="invocations a workgroup (tokens a chunk), comma-separated")
    ap.add_argument("--bucket", type=int, default=FLASH_CODED_BUCKET[1],
                    help="code words an owner takes a pass (default: the most the host sizes BUCKET to)")
    ap.add_argument("--spill", type=int, default=64, help="a spill list's words (branch wip/coded-spill's SPILL)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    (_, v_codes), n_atoms = BA.read_codes(a.codes)
    sparsity = v_codes.shape[2]
    captured, _ = codec.unpack_codes(v_codes)  # int64 atom indices
    uniform = np.random.default_rng(a.seed).integers(0, n_atoms, size=captured.shape)
    out = {"argv": sys.argv, "codes": a.codes, "n_atoms": n_atoms, "sparsity": sparsity, "bucket": a.bucket,
           "spill": a.spill, "cases": []}
    for local in (int(x) for x in a.locals.split(",")):
        for name, atoms in (("captured", captured), ("uniform", uniform)):
            row = {"local": local, "code_words": name, **chunk_stats(atoms, local, a.bucket, a.spill)}
            out["cases"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
