"""The main job, end to end, on one Vulkan device (Mesa lavapipe unless you pick another):

1. make (first run, a few minutes) or reuse a certified dictionary for SmolLM2-135M;
2. load_certified + activate it (the engine's fail-closed path);
3. validate the shaders against NumPy on this device;
4. decode real text (GPL-3) token by token with the KV cache on the GPU, twice — an f32
   arena (the cache the certificate is relative to) and the dict-coded arena the runtime
   switch gives — attention computed on the GPU in both; and a third time through the forge's
   winner (the certified cache with the smallest whole arena at the model's context, gated
   beside the dictionary: q8_0, KIVI) where that is not the dictionary;
5. check both decodes against the CPU path: at every (layer, token) step the GPU cache's
   attention output equals the NumPy reference's over the same cached vectors (the
   forge's codec for the dict cache) within the validation tolerance; and the f32
   decode's per-token NLL equals the forge's batched CPU forward within NLL_TOLERANCE.
   (The dict decode's NLL is not compared per token: see kvdict_vk.forge.decode.)
6. report the certified ΔPPL (from the certificate, once), bytes per token and
   compression, the ranking and why the winner won, tokens/s for each cache, and the
   validation NMSE.

The device: --device, else $KVDICT_VK_DEVICE, else lavapipe (the embedded default, which
scripts/setup.sh installs), by index or name substring; `kvdict-validate --list` lists them.
Logs go to stderr; the report to stdout (and --json for a machine-readable copy). Exit
status 1 when the GPU decode does not reproduce the CPU path or validation fails.
"""
from __future__ import annotations

import os

# The decode's matrix-vector products are tiny: OpenBLAS threads only fight each other
# (and lavapipe's) for the 2 cores. Must be set before numpy is imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from .. import artifact as A  # noqa: E402
from .. import errors as E  # noqa: E402
from .. import runtime  # noqa: E402


def _log(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def ensure_artifact(out: str, rebuild: bool) -> tuple[str, dict]:
    """The forge's default artifact and its ranking (forge.ranking: the certified caches by
    their whole arena at the model's context, the dictionary beside q8_0 and KIVI), reused when
    both exist, the artifact passed, and was made with the current default settings."""
    from ..forge import cli as forge_cli, pipeline as P, ranking
    path = os.path.join(out, "smollm2.q42art")
    ranked_path = os.path.join(out, "smollm2-ranking.json")
    want = P.config_key(P.ForgeConfig())
    if os.path.exists(path) and os.path.exists(ranked_path) and not rebuild:
        try:
            info = A.read_header(path)
            with open(ranked_path) as f:
                ranked = json.load(f)
            if info.passed and info.producer.get("config_key") == want and "default" in ranked:
                _log(f"reusing {path} (ΔPPL {100 * info.value:+.2f} %, certified) and its ranking")
                return path, ranked
        except (E.ArtifactError, ValueError, OSError) as e:
            _log(f"{path} unusable ({e}); rebuilding")
    _log("forging a dictionary for SmolLM2-135M and gating q8_0 and KIVI beside it (first run: a few minutes)")
    code, summary = forge_cli.build(P.ForgeConfig(), out, "smollm2", with_baselines=True,
                                    table_rows=ranking.RANKED_BASELINES, show=False)
    if code != 0:
        raise SystemExit("the dictionary did not pass its gate; see the forge report")
    return path, summary["ranking"]


# Per-token NLL of the f32-cache GPU decode against the forge's batched CPU forward, in
# nats. Measured on lavapipe over 256 GPL-3 tokens: max |Δ| 3.8e-5, mean 4.4e-6; the
# tolerance leaves 25× margin and is still far below what it guards against (a token's
# NLL moves by 0.1–1 nats when its K/V or attention are wrong).
NLL_TOLERANCE = 1e-3
DEFAULT_DEVICE = "llvmpipe"  # Mesa lavapipe: the device scripts/setup.sh installs everywhere


def run_decode(tokens, n_ctx: int, label: str, dev, cache: str | None = None, kivi=None):
    """A GPU decode — ``cache`` (and ``kivi``) as KvArena takes them (None: the runtime switch
    decides) — checked step by step against the NumPy reference cache: (DecodeResult, arena
    layout, ReferenceCheck, the SPIR-V variant its attention ran on at the last step)."""
    from ..forge import decode
    from ..forge.gguf_model import load_model
    from ..vk import KvArena
    c = load_model().config
    with KvArena(c.n_layers, c.n_kv_heads, c.head_dim, n_ctx, device=dev, cache=cache, kivi=kivi) as arena:
        _log(f"{label}: arena mode {arena.mode}, {arena.layout.total_bytes / 2**20:.1f} MiB; decoding {len(tokens)} tokens")
        art = runtime.snapshot().artifact if arena.mode == "dict" else None
        rows = arena.mode if arena.mode in ("f16", "q8_0") else "f32"
        check = decode.ReferenceCheck(decode.NumpyCache(c.n_layers, c.n_kv_heads, c.head_dim, n_ctx, art,
                                                        kivi=arena.layout.kivi, rows=rows))
        step = max(1, len(tokens) // 4)
        res = decode.decode(tokens, arena, observe=check,
                            progress=lambda p: (p + 1) % step == 0 and _log(f"{label}: {p + 1}/{len(tokens)}"))
        att = arena.attention(c.n_heads)
        variant = att.variant(0, att.plan(0, len(tokens)))
        _log(f"{label}: attention ran on {variant}")
        return res, arena.layout, check, variant


def decode_winner(ranked: dict, tokens, n_ctx: int, dev) -> dict | None:
    """The forge's winner decoded too where it is not the dictionary cache (decoded anyway):
    its steps checked like the others'; None when the winner is the dictionary or none passes."""
    default = ranked.get("default")
    if default is None or default["cache"] == "dict":
        return None
    from ..kivi import KiviSpec
    kivi = KiviSpec(**default["kivi"]) if "kivi" in default else None
    res, _, steps, variant = run_decode(tokens, n_ctx, f"{ranked['winner']} cache (the winner)", dev,
                                        cache=default["cache"], kivi=kivi)
    return dict(name=ranked["winner"], cache=default["cache"], steps=steps.steps, worst_step_nmse=steps.worst_nmse,
                tokens_per_s=res.tokens_per_s, variant=variant)


def format_ranking(ranked: dict) -> list[str]:
    """The demo's lines for the forge's ranking: every certified cache by its whole arena, the winner."""
    mib = 2 ** 20
    lines = [f"  ranking         the caches the forge gated, by their whole arena at {ranked['n_ctx']} tokens:"]
    for i, r in enumerate(ranked["rows"], 1):
        lines.append(f"    {i}. {r['name']:<52} {r['arena_bytes'] / mib:7.1f} MiB  "
                     f"{'passes' if r['passes'] else 'FAILS '} (worst {r['worst_text']} "
                     f"{100 * r['worst_delta_ppl']:+.2f} %, upper bound {100 * r['worst_upper']:+.2f} %)")
    lines.append(f"  winner          {ranked['winner'] or 'none'}: {ranked['reason']}")
    return lines


def nll_agreement(gpu_nll: np.ndarray, cpu_nll: np.ndarray) -> dict:
    """How closely a GPU decode's per-token NLL follows the CPU forward's."""
    diff = np.abs(np.asarray(gpu_nll) - np.asarray(cpu_nll))
    return dict(max_abs_nll_diff=float(diff.max()), mean_abs_nll_diff=float(diff.mean()),
                worst_token=int(diff.argmax()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kvdict-demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256, help="tokens of GPL-3 to decode per cache")
    ap.add_argument("--out", default="out/forge", help="where the forge's artifact lives")
    ap.add_argument("--rebuild", action="store_true", help="forge a new dictionary even if one exists")
    ap.add_argument("--device", default=None,
                    help=f"Vulkan device, index or name substring (default: ${{KVDICT_VK_DEVICE}}, else {DEFAULT_DEVICE})")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    a = ap.parse_args(argv)
    try:
        return _run(a)
    except E.KvDictError as e:
        print(f"kvdict-demo: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


def choose_device(a):
    """The device the demo runs on, how it was chosen, and every device there is."""
    from ..vk import device as vk_device
    spec, how = a.device, "--device"
    if spec is None:
        spec, how = os.environ.get(vk_device.ENV_DEVICE, "").strip(), f"${vk_device.ENV_DEVICE}"
    if not spec:
        spec, how = DEFAULT_DEVICE, "the embedded default"
    return vk_device.get_device(spec), how, [f"{d.index}: {d.name}" for d in vk_device.list_devices()]


def _run(a) -> int:
    from ..forge import llama, texts, tokenizer
    from .validate import NMSE_ATTEND, run_validation, worst_by_metric
    t0 = time.perf_counter()
    path, ranked = ensure_artifact(a.out, a.rebuild)
    cert = runtime.load_certified(path)
    dev, how, devices = choose_device(a)
    _log(f"device: {dev.name} ({how}; devices here: {'; '.join(devices)})")

    _log("validating every shader against NumPy on this device")
    rows = run_validation(dev, quick=True)
    worst = worst_by_metric(rows)
    if not all(r["passed"] for r in rows):
        raise SystemExit("shader validation failed on this device; run kvdict-validate")

    tokens = tokenizer.encode(texts.EVAL_TEXTS["gpl3"].text())[: a.tokens]  # GPL-3, the gate's first text
    n_ctx = -(-len(tokens) // 64) * 64
    runtime.deactivate()
    # the f32 cache (not the f16 default): the cache the certificate's ΔPPL is relative to
    f32, f32_layout, f32_steps, f32_variant = run_decode(tokens, n_ctx, "f32 cache", dev, cache="f32")
    _log("f32 cache: the forge's batched CPU forward on the same tokens")
    f32_nll = nll_agreement(f32.nll, llama.token_nll(tokens))
    runtime.activate(path)
    coded, coded_layout, coded_steps, coded_variant = run_decode(tokens, n_ctx, "dict cache", dev)
    winner = decode_winner(ranked, tokens, n_ctx, dev)
    steps_ok = max(f32_steps.worst_nmse, coded_steps.worst_nmse,
                   winner["worst_step_nmse"] if winner else 0.0) <= NMSE_ATTEND
    reproduced = steps_ok and f32_nll["max_abs_nll_diff"] <= NLL_TOLERANCE

    report = dict(
        device=dev.name, device_chosen_by=how, devices=devices, artifact=path,
        certified=dict(delta_ppl=cert.value, ci95=cert.extra.get("ci95"), baseline_ppl=cert.baseline_ppl,
                       coded_ppl=cert.coded_ppl, eval_tokens=cert.eval_tokens, threshold=cert.threshold,
                       worst_text=cert.extra.get("worst_text"),
                       texts={t["name"]: t["ci95"] for t in cert.extra.get("texts", [])}),
        decode=dict(tokens=len(tokens), reproduces_cpu_path=reproduced,
                    step_nmse_tolerance=NMSE_ATTEND, nll_tolerance_nats=NLL_TOLERANCE,
                    f32=dict(steps=f32_steps.steps, worst_step_nmse=f32_steps.worst_nmse,
                             nll_vs_cpu_forward=f32_nll, tokens_per_s=f32.tokens_per_s, variant=f32_variant),
                    dict=dict(steps=coded_steps.steps, worst_step_nmse=coded_steps.worst_nmse,
                              tokens_per_s=coded.tokens_per_s, variant=coded_variant),
                    **({"winner": winner} if winner else {})),
        ranking=ranked,
        memory=dict(f32_bytes_per_token=f32_layout.bytes_per_token, dict_bytes_per_token=coded_layout.bytes_per_token,
                    compression_vs_f32=f32_layout.bytes_per_token / coded_layout.bytes_per_token,
                    compression_vs_f16=f32_layout.bytes_per_token / 2 / coded_layout.bytes_per_token,
                    dictionary_tail_bytes=coded_layout.tail_bytes,
                    arena=arena_memory(runtime.snapshot().artifact, coded_layout, cert)),
        validation=dict(cases=len(rows), passed=sum(r["passed"] for r in rows), worst_nmse=worst.get("nmse"),
                        worst_encoder_rel_err_diff=worst.get("rel_err_diff"),
                        worst_forward_nll_abs=worst.get("nll_abs")),
        seconds=time.perf_counter() - t0,
    )
    print(json.dumps(report, indent=1) if a.json else format_report(report))
    return 0 if reproduced else 1


def arena_memory(art, layout, cert=None) -> dict:
    """The whole arena (regions + tails) of the dictionary cache the demo decodes through, at
    the model's context (the certificate's, else SmolLM2's 8 192), 32 768 and 131 072 tokens,
    and the f16 cache's of the same shapes (kvdict_vk.memory_report, as kvdict-dump shows it)."""
    from ..memory_report import memory_block, report_lengths
    from .dump import model_n_ctx
    return memory_block(layout.n_layers, layout.n_kv_heads, layout.head_dim, art,
                        report_lengths(None, model_n_ctx(cert)))


def format_arena(block: dict) -> list[str]:
    """The demo's lines for a memory block: one per context length."""
    mib = 2 ** 20
    return [f"  whole arena     {m['n_ctx']:>6} tokens: {m['arena_bytes'] / mib:7.1f} MiB (dictionaries "
            f"{m['tail_bytes'] / mib:.1f}) = {m['effective_bytes_per_vector']:.1f} B/vector effective; f16 cache "
            f"{m['f16_arena_bytes'] / mib:.1f} MiB: {m['vs_f16']:.2f}× its size" for m in block["lengths"]]


def format_report(r: dict) -> str:
    g, d, m, v = r["certified"], r["decode"], r["memory"], r["validation"]
    ci = f", 95 % CI {100 * g['ci95'][0]:+.2f} … {100 * g['ci95'][1]:+.2f} %" if g.get("ci95") else ""
    f, c, w = d["f32"], d["dict"], d.get("winner")
    w_name, w_nmse = (w["cache"], w["worst_step_nmse"]) if w else ("", 0.0)
    verdict = "reproduce" if d["reproduces_cpu_path"] else "DO NOT reproduce"
    return "\n".join([
        f"kvdict_vk demo — SmolLM2-135M on {r['device']} ({r['device_chosen_by']}; "
        f"pick another with --device or KVDICT_VK_DEVICE=<index|name>: {'; '.join(r['devices'])})",
        f"  certified       ΔPPL {100 * g['delta_ppl']:+.2f} %{ci} on the worst of its texts"
        f"{' (' + g['worst_text'] + ')' if g.get('worst_text') else ''}; {g['eval_tokens']} tokens of "
        + (", ".join(f"{n} [{100 * lo:+.2f}, {100 * hi:+.2f}] %" for n, (lo, hi) in g["texts"].items())
           if g.get("texts") else "text")
        + f"; gate: the upper 95 % bound ≤ {100 * g['threshold']:+.0f} % on every text ({r['artifact']})",
        f"  GPU decode      {d['tokens']} tokens {'three times' if w else 'twice'}, KV cache and attention on the GPU, "
        f"{verdict} the CPU path: attention at each of {f['steps'] + c['steps'] + (w['steps'] if w else 0)} "
        f"(layer, token) steps = NumPy over the same cache (worst NMSE f32 {f['worst_step_nmse']:.1e}, dict "
        f"{c['worst_step_nmse']:.1e}{f', {w_name} {w_nmse:.1e}' if w else ''}; ≤ {d['step_nmse_tolerance']:g}); "
        f"f32 per-token NLL = the forge's CPU forward (max |Δ| {f['nll_vs_cpu_forward']['max_abs_nll_diff']:.1e} "
        f"≤ {d['nll_tolerance_nats']:g} nats)",
        f"  memory          {m['dict_bytes_per_token']} B/token vs {m['f32_bytes_per_token'] // 2} for the f16 cache "
        f"(the engine's default) and {m['f32_bytes_per_token']} for f32: "
        f"{m['compression_vs_f16']:.2f}× vs f16, {m['compression_vs_f32']:.2f}× vs f32 "
        f"(+ {m['dictionary_tail_bytes'] / 2**20:.1f} MiB of dictionaries once)",
        *(format_arena(m["arena"]) if m.get("arena") else []),
        *(format_ranking(r["ranking"]) if r.get("ranking") else []),
        *([f"  winner decode   {w['name']}: {w['steps']} (layer, token) steps = NumPy over the same cache (worst "
           f"NMSE {w['worst_step_nmse']:.1e}), {w['tokens_per_s']:.1f} tok/s ({w['variant']})"] if w else []),
        f"  speed           f32 cache {f['tokens_per_s']:.1f} tok/s, dict cache {c['tokens_per_s']:.1f} tok/s "
        f"(attention kernels on this device: f32 {f['variant']}, dict {c['variant']}; kvdict-validate --variants)",
        f"  validation      {v['passed']}/{v['cases']} shader cases pass vs NumPy: worst NMSE {v['worst_nmse']:.1e} "
        f"(reconstruct ≤ 1e-12, attention ≤ 1e-9); GPU vs CPU OMP error differs by "
        f"{100 * (v['worst_encoder_rel_err_diff'] or 0):.2g} % at most",
        f"  total           {r['seconds']:.0f} s",
    ])


if __name__ == "__main__":
    sys.exit(main())
