"""The main job, end to end, on the default Vulkan device (lavapipe here):

1. make (first run, a few minutes) or reuse a certified dictionary for SmolLM2-135M;
2. load_certified + activate it (the engine's fail-closed path);
3. validate the shaders against NumPy on this device;
4. decode real text (GPL-3) token by token with the KV cache on the GPU, twice — the
   default f32 arena and the dict-coded arena, chosen by the runtime switch alone —
   attention computed on the GPU in both;
5. report ΔPPL of the dict-coded cache against the f32 cache, bytes per token and
   compression, tokens/s for both, and the validation NMSE.

Logs go to stderr; the report to stdout (and --json for a machine-readable copy).
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


def ensure_artifact(out: str, rebuild: bool) -> str:
    """The forge's default artifact, reused when it exists, passed, and was made with the
    current default settings for this model."""
    from ..forge import cli as forge_cli, pipeline as P
    path = os.path.join(out, "smollm2.q42art")
    want = P.config_key(P.ForgeConfig())
    if os.path.exists(path) and not rebuild:
        try:
            info = A.read_header(path)
            if info.passed and info.producer.get("config_key") == want:
                _log(f"reusing {path} (ΔPPL {100 * info.value:+.2f} %, certified)")
                return path
        except E.ArtifactError as e:
            _log(f"{path} unusable ({e}); rebuilding")
    _log("forging a dictionary for SmolLM2-135M (first run: a few minutes)")
    code, _ = forge_cli.build(P.ForgeConfig(), out, "smollm2", with_baselines=False)
    if code != 0:
        raise SystemExit("the dictionary did not pass its gate; see the forge report")
    return path


def run_decode(tokens, n_ctx: int, label: str):
    from ..forge import decode
    from ..forge.gguf_model import load_model
    from ..vk import KvArena
    c = load_model().config
    with KvArena(c.n_layers, c.n_kv_heads, c.head_dim, n_ctx) as arena:
        _log(f"{label}: arena mode {arena.mode}, {arena.layout.total_bytes / 2**20:.1f} MiB; decoding {len(tokens)} tokens")
        step = max(1, len(tokens) // 4)
        res = decode.decode(tokens, arena, progress=lambda p: (p + 1) % step == 0 and _log(f"{label}: {p + 1}/{len(tokens)}"))
        return res, arena.layout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kvdict-demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256, help="tokens of GPL-3 to decode per cache")
    ap.add_argument("--out", default="out/forge", help="where the forge's artifact lives")
    ap.add_argument("--rebuild", action="store_true", help="forge a new dictionary even if one exists")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    a = ap.parse_args(argv)
    try:
        return _run(a)
    except E.KvDictError as e:
        print(f"kvdict-demo: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


def _run(a) -> int:
    from ..forge import certify, tokenizer
    from ..vk import device as vk_device
    from .validate import run_validation, worst_by_metric
    t0 = time.perf_counter()
    path = ensure_artifact(a.out, a.rebuild)
    cert = runtime.load_certified(path)
    dev = vk_device.get_device()
    _log(f"device: {dev.name}")

    _log("validating every shader against NumPy on this device")
    rows = run_validation(dev, quick=True)
    worst = worst_by_metric(rows)
    if not all(r["passed"] for r in rows):
        raise SystemExit("shader validation failed on this device; run kvdict-validate")

    tokens = tokenizer.encode(tokenizer.read_text())[: a.tokens]
    n_ctx = -(-len(tokens) // 64) * 64
    runtime.deactivate()
    f32, f32_layout = run_decode(tokens, n_ctx, "f32 cache")
    runtime.activate(path)
    coded, coded_layout = run_decode(tokens, n_ctx, "dict cache")
    paired = certify.paired(f32.nll, coded.nll, 1)

    report = dict(
        device=dev.name, artifact=path,
        forge_gate=dict(delta_ppl=cert.value, ci95=cert.extra.get("ci95"), baseline_ppl=cert.baseline_ppl,
                        coded_ppl=cert.coded_ppl, eval_tokens=cert.eval_tokens, threshold=cert.threshold),
        decode=dict(tokens=len(tokens), f32_ppl=paired.baseline_ppl, dict_ppl=paired.coded_ppl,
                    delta_ppl=paired.delta_rel, ci95=paired.ci95,
                    f32_tokens_per_s=f32.tokens_per_s, dict_tokens_per_s=coded.tokens_per_s),
        memory=dict(f32_bytes_per_token=f32_layout.bytes_per_token, dict_bytes_per_token=coded_layout.bytes_per_token,
                    compression_vs_f32=f32_layout.bytes_per_token / coded_layout.bytes_per_token,
                    compression_vs_f16=f32_layout.bytes_per_token / 2 / coded_layout.bytes_per_token,
                    dictionary_tail_bytes=coded_layout.tail_bytes),
        validation=dict(cases=len(rows), passed=sum(r["passed"] for r in rows), worst_nmse=worst.get("nmse"),
                        worst_encoder_rel_err_diff=worst.get("rel_err_diff")),
        seconds=time.perf_counter() - t0,
    )
    print(json.dumps(report, indent=1) if a.json else format_report(report))
    return 0


def format_report(r: dict) -> str:
    g, d, m, v = r["forge_gate"], r["decode"], r["memory"], r["validation"]
    return "\n".join([
        f"kvdict_vk demo — SmolLM2-135M on {r['device']}",
        f"  artifact        {r['artifact']} (certified: ΔPPL {100 * g['delta_ppl']:+.2f} % on "
        f"{g['eval_tokens']} GPL-3 tokens, gate ≤ {100 * g['threshold']:+.0f} %)",
        f"  decode          {d['tokens']} tokens, GPU attention: PPL f32 {d['f32_ppl']:.3f} → dict {d['dict_ppl']:.3f} "
        f"(ΔPPL {100 * d['delta_ppl']:+.2f} %, 95 % CI {100 * d['ci95'][0]:+.2f} … {100 * d['ci95'][1]:+.2f} %;"
        f" {d['tokens']} tokens are a smoke check — the gate above is the measurement)",
        f"  memory          {m['dict_bytes_per_token']} B/token vs {m['f32_bytes_per_token']} (f32): "
        f"{m['compression_vs_f32']:.2f}× vs f32, {m['compression_vs_f16']:.2f}× vs f16 "
        f"(+ {m['dictionary_tail_bytes'] / 2**20:.1f} MiB of dictionaries once)",
        f"  speed           f32 cache {d['f32_tokens_per_s']:.1f} tok/s, dict cache {d['dict_tokens_per_s']:.1f} tok/s",
        f"  validation      {v['passed']}/{v['cases']} shader cases pass vs NumPy: worst NMSE {v['worst_nmse']:.1e} "
        f"(reconstruct ≤ 1e-12, attention ≤ 1e-9); GPU vs CPU OMP error differs by "
        f"{100 * (v['worst_encoder_rel_err_diff'] or 0):.2g} % at most",
        f"  total           {r['seconds']:.0f} s",
    ])


if __name__ == "__main__":
    sys.exit(main())
