"""kvdict-dump: show how a KV arena will be laid out, before allocating it.

    kvdict-dump smollm2.q42art --n-ctx 4096          # an artifact's dict-coded layout
    kvdict-dump --n-layers 30 --n-kv-heads 3 --head-dim 64 --n-ctx 4096   # the f16 layout (--cache f32)
    kvdict-dump smollm2.q42art --json --layer 0      # JSON to stdout, one layer

After the layout, a "memory" table: the whole arena (regions + tails) and the bytes per
head vector effective at that length (dictionaries amortised) at --n-ctx, at the model's
context (the artifact's recorded n_ctx, else SmolLM2's 8 192), 32 768 and 131 072 tokens,
beside the f16 cache of the same shapes (kvdict_vk.memory_report; --json: "memory").

Needs neither Vulkan nor Kompute: every number comes from kvdict_vk.layout (the module
the GPU backend allocates from). Logs and errors go to stderr; exit status 1 on bad input.
"""
from __future__ import annotations

import argparse
import json
import sys

from .. import errors as E
from .. import layout as L
from .. import memory_report as M
from ..artifact import read_artifact


def sanitise(value, limit: int = 80) -> str:
    """Strings from a file are untrusted: printable ASCII/Unicode only, bounded length."""
    s = str(value)
    s = "".join(ch if ch.isprintable() else "?" for ch in s)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _spans_with_padding(ll: L.LayerLayout) -> list[dict]:
    """The layer's regions and tail blocks in address order, with the alignment padding
    after each (derived from the layout's own offsets)."""
    blocks = []
    for s in ll.streams:
        blocks.append((f"{s.stream} region", s.region_word, s.region_words))
        atoms = "atoms_f16" if s.atoms_f16 else "atoms"
        for name, word, words in ((atoms, s.atoms_word, s.atoms_words), ("mean", s.mean_word, s.mean_words),
                                  ("residual_scale", s.scale_word, s.scale_words)):
            if word is not None and words:
                blocks.append((f"{s.stream} {name}", word, words))
        if s.kivi and s.stats_words:  # the KIVI cache's key statistics (kvdict_vk.kivi)
            blocks.append((f"{s.stream} group_stats", s.stats_word, s.stats_words))
        if s.kivi or s.windowed:  # an exact window: KIVI's, or a dictionary's (kvdict_vk.window)
            blocks.append((f"{s.stream} window", s.window_word, s.window_words))
        if s.key_rope is not None:  # keys coded before RoPE: the rotation table (kvdict_vk.rope)
            blocks.append((f"{s.stream} rope_table", s.rope_word, s.rope_words))
    if ll.k.kivi or ll.windowed:  # the layer's state word (K and V): KIVI's quantised end, a window's token count
        blocks.append(("k state", ll.k.state_word or ll.v.state_word, 1))
    blocks.sort(key=lambda b: b[1])
    out = []
    for i, (name, word, words) in enumerate(blocks):
        nxt = blocks[i + 1][1] if i + 1 < len(blocks) else ll.total_words
        out.append(dict(name=name, word=word, words=words, bytes=words * L.WORD_BYTES,
                        padding_words=nxt - word - words))
    return out


def describe(lay: L.ArenaLayout, cert=None, source: str | None = None, only_layer: int | None = None) -> dict:
    layers = []
    region = tail = pad = 0
    for ll in lay.layers:
        blocks = _spans_with_padding(ll)
        lead = blocks[0]["word"] if blocks else 0
        region += sum(b["words"] for b in blocks if b["name"].endswith("region"))
        tail += sum(b["words"] for b in blocks if not b["name"].endswith("region"))
        pad += lead + sum(b["padding_words"] for b in blocks)
        if only_layer is None or ll.index == only_layer:
            layers.append(dict(ll.to_dict(), blocks=blocks))
    w = L.WORD_BYTES
    totals = dict(bytes=lay.total_bytes, region_bytes=region * w, tail_bytes=tail * w, padding_bytes=pad * w,
                  bytes_per_token=lay.bytes_per_token, f32_bytes_per_token=lay.f32_bytes_per_token,
                  compression_vs_f32=lay.f32_bytes_per_token / lay.bytes_per_token,
                  compression_vs_f16=lay.f32_bytes_per_token / 2 / lay.bytes_per_token,
                  max_layer_bytes=lay.max_layer_bytes)
    out = dict(source=sanitise(source) if source else None, mode=lay.mode,
               dims=dict(n_layers=lay.n_layers, n_kv_heads=lay.n_kv_heads, head_dim=lay.head_dim,
                         n_ctx=lay.n_ctx, n_atoms=lay.n_atoms, sparsity=lay.sparsity,
                         n_dict_heads=lay.n_dict_heads),
               totals=totals, layers=layers)
    if cert is not None:
        out["certification"] = dict(
            passed=cert.passed, kind=sanitise(cert.kind), metric=sanitise(cert.metric), value=cert.value,
            threshold=cert.threshold, baseline_ppl=cert.baseline_ppl, coded_ppl=cert.coded_ppl,
            eval_tokens=cert.eval_tokens, eval_text_sha256=sanitise(cert.eval_text_sha256, 64),
            ci95=cert.extra.get("ci95"), model=sanitise(cert.model.get("name", "?")),
            producer=sanitise(f"{cert.producer.get('name', '?')} {cert.producer.get('version', '')}"))
    return out


def _mode(s) -> str:
    if not s["coded"]:
        return s.get("row_format", "f32")
    return f"s{s['sparsity']}" + (f"+{s['residual_bits']}b" if s["residual_bits"] else "")


def format_table(d: dict) -> str:
    t, dims = d["totals"], d["dims"]
    lines = []
    if d["source"]:
        lines.append(f"source        {d['source']}")
    c = d.get("certification")
    if c:
        verdict = "PASSED" if c["passed"] else "NOT CERTIFIED (the engine refuses it)"
        lines.append(f"certification {verdict}: {c['metric']} {100 * c['value']:+.2f} % "
                     f"(threshold {100 * c['threshold']:+.2f} %) on {c['eval_tokens']} tokens; "
                     f"PPL {c['baseline_ppl']:.3f} → {c['coded_ppl']:.3f}; model {c['model']}; by {c['producer']}")
    lines.append(f"arena         {d['mode']}: {dims['n_layers']} layers × {dims['n_kv_heads']} KV heads × head_dim "
                 f"{dims['head_dim']}, n_ctx {dims['n_ctx']}"
                 + (f", {dims['n_atoms']} atoms, {dims['n_dict_heads']} dictionary head(s)" if d["mode"] == "dict" else ""))
    lines.append("")
    lines.append(f"{'layer':>5} {'block':<18} {'mode':<7} {'word':>10} {'words':>10} {'bytes':>11} {'pad':>5}")
    for ll in d["layers"]:
        modes = {"k": _mode(ll["k"]), "v": _mode(ll["v"])}
        for b in ll["blocks"]:
            stream = b["name"].split()[0]
            lines.append(f"{ll['layer']:>5} {b['name']:<18} {modes[stream]:<7} {b['word']:>10} {b['words']:>10} "
                         f"{b['bytes']:>11} {b['padding_words']:>5}")
    lines.append("")
    mib = 2 ** 20
    lines.append(f"total         {t['bytes'] / mib:.2f} MiB = regions {t['region_bytes'] / mib:.2f} + tails "
                 f"{t['tail_bytes'] / mib:.2f} + padding {t['padding_bytes'] / mib:.3f} MiB; largest layer "
                 f"{t['max_layer_bytes'] / mib:.2f} MiB")
    lines.append(f"per token     {t['bytes_per_token']} B (f16 cache {t['f32_bytes_per_token'] // 2} B, f32 "
                 f"{t['f32_bytes_per_token']} B): {t['compression_vs_f16']:.2f}× vs f16, "
                 f"{t['compression_vs_f32']:.2f}× vs f32")
    mem = d.get("memory")
    if mem:
        lines.append("")
        lines.append(f"memory        the whole arena (regions + tails) of {mem['cache']} per sequence, and bytes per "
                     f"head vector effective at that length (arena / {mem['vectors_per_token']} vectors a token), "
                     f"beside the f16 cache of the same shapes:")
        lines += M.format_memory(mem, "  ")
    return "\n".join(lines)


def model_n_ctx(cert) -> int:
    """The model's context length: the one the certificate records (model.n_ctx), else SmolLM2's."""
    n = (cert.model.get("n_ctx") if cert is not None else None)
    return n if type(n) is int and 0 < n <= 1 << 24 else M.MODEL_N_CTX


def memory_cache(lay: L.ArenaLayout, art):
    """The cache description of a layout kvdict-dump built (for kvdict_vk.memory_report)."""
    if lay.mode == "dict":
        return art
    if lay.mode == L.KIVI_CACHE:
        return lay.kivi
    return lay.mode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kvdict-dump", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("artifact", nargs="?", help="a .q42art file (certified or not)")
    ap.add_argument("--n-layers", type=int)
    ap.add_argument("--n-kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--cache", choices=L.CACHES + (L.KIVI_CACHE,), default=None,
                    help="the uncoded layout in this row format, even with an artifact (default: the "
                         f"artifact's dict-coded layout, else {L.DEFAULT_CACHE})")
    ap.add_argument("--f32", action="store_true", help="same as --cache f32")
    ap.add_argument("--layer", type=int, help="only this layer's rows")
    ap.add_argument("--json", action="store_true", help="JSON to stdout")
    a = ap.parse_args(argv)
    try:
        cert = art = None
        dims = dict(n_layers=a.n_layers, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim)
        if a.artifact:
            cert, art = read_artifact(a.artifact, require_certified=False)
            for k, v in dims.items():
                if v is not None and v != cert.model[k]:
                    raise E.DimsError(f"--{k.replace('_', '-')} {v} disagrees with the artifact's {cert.model[k]}")
                dims[k] = cert.model[k]
        missing = [k for k, v in dims.items() if v is None]
        if missing:
            raise E.DimsError("give an artifact or --" + ", --".join(m.replace("_", "-") for m in missing))
        cache = "f32" if a.f32 else a.cache
        lay = L.build_layout(dims["n_layers"], dims["n_kv_heads"], dims["head_dim"], a.n_ctx,
                             None if cache else art, cache=cache or L.DEFAULT_CACHE)
        if a.layer is not None and not 0 <= a.layer < lay.n_layers:
            raise E.LayerIndexError(f"--layer {a.layer} outside 0..{lay.n_layers - 1}")
        d = describe(lay, cert, a.artifact, a.layer)
        d["memory"] = M.memory_block(lay.n_layers, lay.n_kv_heads, lay.head_dim, memory_cache(lay, art),
                                     M.report_lengths(a.n_ctx, model_n_ctx(cert)))
    except (E.KvDictError, OSError) as e:
        print(f"kvdict-dump: error: {sanitise(e, 300)}", file=sys.stderr)
        return 1
    print(json.dumps(d, indent=1) if a.json else format_table(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
