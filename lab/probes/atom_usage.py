"""Probe: how a certified dictionary's atoms are used by real code words — what the attention
kernels over the codes meet, and what the benchmark's uniformly random code words do not show.

The value side of attend_flash_coded* adds p · coefficient into one weight per (query head,
atom) for every code word (shared-memory atomics: docs/DESIGN.md). How often two code words of
the same chunk of tokens hit the same atom decides the atomics' contention, and how evenly the
code words of a block fall into ranges of atoms decides a design where each warp owns a range
(DESIGN.md, "The coded target, ranked"). This encodes real K and V (SmolLM2 over a text the
forge did not calibrate on: an evaluation text, GPL-3 by default, in windows of 1024 tokens) with a certified artifact's dictionaries — the
NumPy codec, as the arena's CPU path does — and reports per stream, over every layer and KV head:
  * the atoms' usage: perplexity of the atom histogram (exp of its entropy; n_atoms when
    uniform) and the share of code words taken by the most used 1 % of atoms;
  * per block of --block tokens (block × sparsity code words): the share of code words whose
    atom already occurs earlier in the block, and the largest number of one atom's code words;
  * the same for random uniform code words of the same shape (the benchmark's), as the baseline;
  * with the atoms cut into --ranges equal ranges: the largest range's code words per block
    over the mean (1.0: even).
One JSON object to stdout, progress to stderr. --save-codes also writes the code words of
--codes-streams (layer, KV head) streams spread over the layers to an .npz (k_codes, v_codes:
(streams, tokens, s) uint32; n_atoms; streams), for `python -m kvdict_vk.bench.attention --codes`.

    .venv/bin/python lab/probes/atom_usage.py --artifact out/forge/smollm2.q42art > atom_usage.json

Run as ``python lab/probes/atom_usage.py`` from the checkout with the package installed
(``pip install -e .``; scripts/setup.sh's .venv has it): the probe uses kvdict_vk's
public API only, and lab/ is not part of the package.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from kvdict_vk import codec
from kvdict_vk.artifact import read_artifact
from kvdict_vk.forge import llama, pipeline, texts, tokenizer


def block_stats(atoms: np.ndarray, n_atoms: int, block: int, ranges: int) -> dict:
    """atoms: (T, s) atom indices of one KV head's code words in token order."""
    T, s = atoms.shape
    nb = T // block
    a = atoms[:nb * block].reshape(nb, block * s)
    dup, top, spread = [], [], []
    for row in a:
        counts = np.bincount(row, minlength=n_atoms)
        dup.append(float((row.size - np.count_nonzero(counts)) / row.size))
        top.append(int(counts.max()))
        per_range = np.bincount(row * ranges // n_atoms, minlength=ranges)
        spread.append(float(per_range.max() / per_range.mean()))
    return {"repeated_share": float(np.mean(dup)), "most_of_one_atom_max": int(np.max(top)),
            "most_of_one_atom_mean": float(np.mean(top)), "largest_range_over_mean": float(np.mean(spread)),
            "largest_range_over_mean_max": float(np.max(spread))}


def usage(atoms: np.ndarray, n_atoms: int) -> dict:
    counts = np.bincount(atoms.ravel(), minlength=n_atoms).astype(np.float64)
    p = counts / counts.sum()
    nz = p[p > 0]
    top = np.sort(counts)[::-1][:max(1, n_atoms // 100)].sum() / counts.sum()
    return {"perplexity": float(np.exp(-(nz * np.log(nz)).sum())), "top_1pct_share": float(top),
            "unused_atoms": int((counts == 0).sum())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--text", default="gpl3", choices=sorted(texts.EVAL_TEXTS), help="an evaluation text")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--block", type=int, default=64, help="tokens per block (a chunk, or the grouped layout's block)")
    ap.add_argument("--ranges", type=int, default=8, help="atom ranges (warps of a workgroup)")
    ap.add_argument("--save-codes", default=None,
                    help="an .npz for the code words (python -m kvdict_vk.bench.attention --codes)")
    ap.add_argument("--codes-streams", type=int, default=8, help="(layer, KV head) streams --save-codes keeps")
    a = ap.parse_args(argv)
    _, art = read_artifact(a.artifact)
    text = texts.get([a.text])[0]
    windows = llama.eval_windows(tokenizer.encode(text.text()), 1024)[:max(1, a.tokens // 1024)]
    kv = pipeline.capture_windows(windows, lambda m: print(m, file=sys.stderr), what=f"{a.text} window")
    rng = np.random.default_rng(0)
    out = {"argv": sys.argv, "artifact": os.path.basename(a.artifact), "text": text.path, "tokens": a.tokens,
           "block": a.block, "ranges": a.ranges, "streams": {}}
    captured = {}  # "K" / "V" → [(layer, KV head, its code words)]
    for k_not_v, name in ((True, "K"), (False, "V")):
        real, rand, use = [], [], []
        for layer, (k, v) in enumerate(kv):
            d = art.stream(layer, k_not_v)
            if d is None:
                continue
            x = k if k_not_v else v
            for h in range(x.shape[0]):
                slots = codec.encode(x[h], d, h)
                idx, _ = codec.unpack_codes(slots[:, :d.sparsity])  # int64 atom indices
                if a.save_codes:
                    captured.setdefault(name, []).append((layer, h, slots[:, :d.sparsity]))
                real.append(block_stats(idx, d.n_atoms, a.block, a.ranges))
                use.append(usage(idx, d.n_atoms))
                rand.append(block_stats(rng.integers(0, d.n_atoms, idx.shape), d.n_atoms, a.block, a.ranges))
            print(f"{name} layer {layer} encoded", file=sys.stderr)

        def summary(rows: list[dict]) -> dict:
            return {key: {"mean": float(np.mean([r[key] for r in rows])), "max": float(np.max([r[key] for r in rows]))}
                    for key in rows[0]}
        out["streams"][name] = {"n_atoms": d.n_atoms, "sparsity": d.sparsity, "heads_and_layers": len(real),
                                "usage": summary(use), "blocks_real": summary(real), "blocks_uniform": summary(rand)}
    if a.save_codes:
        k_all, v_all = captured["K"], captured["V"]
        pick = np.unique(np.linspace(0, len(k_all) - 1, a.codes_streams).round().astype(int))
        np.savez_compressed(a.save_codes, k_codes=np.stack([k_all[i][2] for i in pick]).astype(np.uint32),
                            v_codes=np.stack([v_all[i][2] for i in pick]).astype(np.uint32), n_atoms=d.n_atoms,
                            streams=np.array([k_all[i][:2] for i in pick]), text=text.path,
                            artifact=os.path.basename(a.artifact))
        out["saved_codes"] = {"path": a.save_codes, "streams": [list(map(int, k_all[i][:2])) for i in pick]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
