"""kvdict-validate: every shader against the NumPy reference, on your Vulkan device.

    kvdict-validate --list                 # devices: name, driver, limits
    kvdict-validate --report               # host, versions, devices, artifact, tuner cache, SPIR-V
    kvdict-validate                        # the shape grid on the default device
    kvdict-validate --device 1 --json      # another device, machine-readable
    kvdict-validate --abi                  # every SPIR-V variant's contract, JSON (docs/EMBEDDING.md)
    kvdict-validate --variants             # the kernel each cache type attends by on this device

Each row is one operation at one shape: reconstruct (read), append (encode + scatter,
checked through a read), attention over the dict-coded cache (with and without an exact
window), the uncoded caches and the KIVI cache (and, where the
device has cooperative matrices, attend_mma at the fast paths' gate), and the GPU
OMP encoder — with guard words around every region, compared by NMSE (Σ(a−b)²/Σa²) and
exact NaN/Inf positions. Exit status 1 if any row fails, 2 if no device could be used.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np

from .. import attention_ref, codec, diagnostics, runtime
from .. import kivi as K
from .. import layout as L
from .. import rows as R
from .. import errors as E
from ..dictionary import KvDictArtifact, StreamDict
from ..metrics import compare
from ..rope import KeyRope
from ..window import ExactWindow, cache_rows as window_rows

NMSE_READ = 1e-12  # reconstruct / append: float32 GPU vs float64 reference
NMSE_ATTEND = 1e-9
# the fast paths' gate (issue #50): attend_mma, binary16 operands with float32 sums, where the
# device has it
NMSE_FAST = 1e-5


# (head_dim, n_atoms, (K sparsity, K bits) | None, (V sparsity, V bits) | None, per-head, n_ctx, GQA)
QUICK_GRID = [(64, 1024, (4, 4), (4, 3), True, 512, 3), (48, 256, (8, 0), None, False, 300, 1),
              (36, 64, (1, 2), (3, 8), True, 97, 2)]
FULL_GRID = QUICK_GRID + [(128, 4096, (16, 0), (8, 4), True, 2048, 8), (32, 65536, (4, 1), None, False, 64, 1),
                          (256, 16, (16, 0), (1, 0), False, 33, 1), (64, 1024, None, (8, 3), True, 4096, 3)]


def _artifact(rng, hd, n_atoms, ks, vs, per_head, n_kv) -> KvDictArtifact:
    def stream(spec):
        if spec is None:
            return None
        s, bits = spec
        g = n_kv if per_head else 1
        return StreamDict(rng.standard_normal((g, n_atoms, hd)).astype(np.float32), rng.standard_normal((g, hd)),
                          None, s, bits, rng.uniform(0.05, 0.3, (g, hd)) if bits else None)
    s_max = max(sp[0] for sp in (ks, vs) if sp)
    return KvDictArtifact(hd, n_atoms, s_max, [(stream(ks), stream(vs))])


def _shape(hd, n_atoms, ks, vs, per_head, n_ctx, gqa) -> str:
    return f"hd={hd} atoms={n_atoms} K={ks} V={vs} per_head={per_head} n_ctx={n_ctx} gqa={gqa}"


def _case(dev, rng, hd, n_atoms, ks, vs, per_head, n_ctx, gqa) -> list[dict]:
    from ..vk import KvArena
    n_kv = 2
    art = _artifact(rng, hd, n_atoms, ks, vs, per_head, n_kv)
    shape = _shape(hd, n_atoms, ks, vs, per_head, n_ctx, gqa)
    k = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    q = rng.standard_normal((n_kv * gqa, hd)).astype(np.float32)
    rows = []
    # The CPU codec encodes (the reference's own codes), so these rows test the read and
    # attention shaders on exactly the reference's slots; a GPU encoder picks different atoms
    # for a few vectors (ties, rounding) and is compared with the codec in its own rows below.
    with runtime.enabled_with(art, allow_uncertified=True):  # random dictionaries, to test the shaders
        arena = KvArena(1, n_kv, hd, n_ctx, device=dev, guard_words=8, encoder="cpu")
    with arena:
        dk, dv = art.layers[0]
        ref_k = k if dk is None else codec.held_heads(k, dk)
        ref_v = v if dv is None else codec.held_heads(v, dv)
        t0 = time.perf_counter()
        arena.append(0, k, v)
        gk, gv = arena.read(0, 0, n_ctx)
        rows.append(_row("append+reconstruct K", shape, ref_k, gk, NMSE_READ, time.perf_counter() - t0, arena))
        rows.append(_row("append+reconstruct V", shape, ref_v, gv, NMSE_READ, None, arena))
        for n_used in sorted({1, n_ctx // 3 + 1, n_ctx}):
            t0 = time.perf_counter()
            out = arena.attend(0, q, n_used)
            ref = attention_ref.attend(q, ref_k, ref_v, n_used)
            rows.append(_row(f"attend dict n_used={n_used}", shape, ref, out, NMSE_ATTEND, time.perf_counter() - t0, arena))
    if hd % L.ATOMS_F16_ELEMS == 0:  # binary16 atoms (as the forge makes them): the arena keeps them so
        art16 = art.with_f16_atoms()
        with runtime.enabled_with(art16, allow_uncertified=True):
            arena16 = KvArena(1, n_kv, hd, n_ctx, device=dev, guard_words=8, encoder="cpu")
        with arena16:
            arena16.append(0, k, v)
            got = arena16.read(0, 0, n_ctx)
            for name, x, d, g in zip("KV", (k, v), art16.layers[0], got):
                ref = x if d is None else codec.held_heads(x, d)
                rows.append(_row(f"append+reconstruct {name}, binary16 atoms", shape, ref, g, NMSE_READ, None, arena16))
    if hd % 2 == 0 and ks and vs:  # the exact window (kvdict_vk.window), appended in two parts: its ring wraps
        win = ExactWindow(1, 32)
        artw = dataclasses.replace(art, window=win)
        with runtime.enabled_with(artw, allow_uncertified=True):
            arena_w = KvArena(1, n_kv, hd, n_ctx, device=dev, guard_words=8, encoder="cpu")
        with arena_w:
            half = n_ctx // 2
            held = []  # each part coded as the arena codes it, the window's tokens in binary16
            for x, d in zip((k, v), artw.layers[0]):
                coded = np.concatenate([codec.held_heads(x[:, a:b], d)
                                        for a, b in ((0, half), (half, n_ctx))], axis=1)
                held.append(window_rows(coded, x, win))
            arena_w.append(0, k[:, :half], v[:, :half])
            arena_w.append(0, k[:, half:], v[:, half:])
            for name, ref, got in zip("KV", held, arena_w.read(0, 0, n_ctx)):
                rows.append(_row(f"append+reconstruct {name}, exact window {win.describe()}", shape, ref, got,
                                 NMSE_READ, None, arena_w))
            out = arena_w.attend(0, q, n_ctx)
            rows.append(_row(f"attend dict, exact window {win.describe()}", shape,
                             attention_ref.attend(q, *held, n_ctx), out, NMSE_ATTEND, None, arena_w))
    if hd % 4 == 0 and ks:  # keys coded before RoPE (kvdict_vk.rope), appended in two parts at their positions
        rope = KeyRope(10000.0, hd)
        artr = dataclasses.replace(art, key_rope=rope)
        with runtime.enabled_with(artr, allow_uncertified=True):
            arena_r = KvArena(1, n_kv, hd, n_ctx, device=dev, guard_words=8, encoder="cpu")
        with arena_r:
            half = n_ctx // 2
            held = []
            for j, (x, d) in enumerate(zip((k, v), artr.layers[0])):
                held.append(x.astype(np.float64) if d is None else np.concatenate(
                    [codec.held_heads(x[:, a:b], d, artr.stream_rope(0, j == 0), a) for a, b in ((0, half), (half, n_ctx))],
                    axis=1))
            arena_r.append(0, k[:, :half], v[:, :half])
            arena_r.append(0, k[:, half:], v[:, half:])
            for name, ref, got in zip("KV", held, arena_r.read(0, 0, n_ctx)):
                rows.append(_row(f"append+reconstruct {name}, keys before RoPE", shape, ref, got, NMSE_READ, None,
                                 arena_r))
            out = arena_r.attend(0, q, n_ctx)
            rows.append(_row("attend dict, keys before RoPE", shape, attention_ref.attend(q, *held, n_ctx), out,
                             NMSE_ATTEND, None, arena_r))
    # GPU attention over f16 needs hd % 8; over q8_0 (attend_flash), head_dim / 4 dividing 128
    caches = ["f32"] + (["f16"] if hd % 8 == 0 else []) + (["q8_0"] if hd % 32 == 0 and 128 % (hd // 4) == 0 else [])
    for cache in caches:
        with KvArena(1, n_kv, hd, n_ctx, device=dev, guard_words=8, cache=cache) as plain:
            # the reference is the float64 attention over what the cache holds
            kc, vc = R.held_rows(k, cache), R.held_rows(v, cache)
            plain.append(0, k, v)
            gk, gv = plain.read(0, 0, n_ctx)
            rows.append(_row(f"append+read {cache} K", shape, kc, gk, NMSE_READ, None, plain))
            rows.append(_row(f"append+read {cache} V", shape, vc, gv, NMSE_READ, None, plain))
            plain.attention(q.shape[0]).exact = True  # the exact builds here; the fast ones below
            out = plain.attend(0, q, n_ctx)
            ref = attention_ref.attend(q, kc, vc, n_ctx)
            rows.append(_row(f"attend {cache}", shape, ref, out, NMSE_ATTEND, None, plain))
            rows += _fast_rows(plain, q, ref, n_ctx, shape, cache)
    if hd % K.GROUP == 0:  # the KIVI cache: reads against kvdict_vk.kivi's reference, attention over them
        with KvArena(1, n_kv, hd, n_ctx, device=dev, guard_words=8, cache="kivi") as kv_arena:
            kc, vc = K.cache_rows(k, v, n_ctx, kv_arena.layout.kivi)
            kv_arena.append(0, k, v)
            gk, gv = kv_arena.read(0, 0, n_ctx)
            rows.append(_row("append+read kivi K", shape, kc, gk, NMSE_READ, None, kv_arena))
            rows.append(_row("append+read kivi V", shape, vc, gv, NMSE_READ, None, kv_arena))
            out = kv_arena.attend(0, q, n_ctx)
            ref = attention_ref.attend(q, kc, vc, n_ctx)
            rows.append(_row("attend kivi", shape, ref, out, NMSE_ATTEND, None, kv_arena))
            rows += _fast_rows(kv_arena, q, ref, n_ctx, shape, "kivi")
        # a batch of two sequences (each its own statistics, rings, state), 8 recent tokens: groups quantised
        spec, cut = K.KiviSpec(4, 4, 8), n_ctx // 2
        with KvArena(1, n_kv, hd, n_ctx, device=dev, guard_words=8, cache="kivi", kivi=spec, seqs=2) as kv_batch:
            parts = ((k[:, :cut], v[:, :cut]), (k[:, cut:], v[:, cut:]))
            held = [K.cache_rows(pk, pv, pk.shape[1], spec) for pk, pv in parts]
            for b, (pk, pv) in enumerate(parts):
                kv_batch.append(0, pk, pv, seq=b)
            got = [kv_batch.read(0, seq=b) for b in range(2)]
            for j, name in enumerate("KV"):
                rows.append(_row(f"append+read kivi {name}, 2 sequences", shape,
                                 np.concatenate([h[j] for h in held], 1), np.concatenate([g[j] for g in got], 1),
                                 NMSE_READ, None, kv_batch))
            used = [pk.shape[1] for pk, _ in parts]
            out = kv_batch.attend_batch(0, np.stack([q, q]), used)
            ref = np.stack([attention_ref.attend(q, *h, n) for h, n in zip(held, used)])
            rows.append(_row("attend kivi, 2 sequences", shape, ref, out, NMSE_ATTEND, None, kv_batch))
    for d, name in ((art.layers[0][0], "K"), (art.layers[0][1], "V")):
        if d is not None:
            rows.append(_encoder_row(dev, d, k[:, :64], f"{shape} stream={name}"))
    return rows


def _fast_rows(arena, q, ref, n_ctx, shape, cache) -> list[dict]:
    """The fast builds over ``arena``'s layer 0 at the fast paths' gate, each forced where the
    device has it (the arena's last use): attend_mma (mma_locals; the tuner does not pick it) and
    attend_flash_dot (a q8_0 layer, integer dot products); none elsewhere."""
    from ..vk.attend.flash import INT_DOT_KERNEL, MMA_KERNEL
    att = arena.attention(q.shape[0])
    att.exact = False
    kernels = ([MMA_KERNEL] if att.shapes.mma_locals(0) else []) + \
        ([INT_DOT_KERNEL] if att.shapes.int_dot_fits(0) else [])
    rows = []
    for kernel in kernels:
        att.path, att.flash_kernel = "flash", kernel
        out = arena.attend(0, q, n_ctx)
        row = _row(f"attend {cache}, {att.variant(0, att.plan(0, n_ctx))}", shape, ref, out, NMSE_FAST, None, arena)
        rows.append(dict(row, metric="nmse_fast"))  # its own worst (worst_by_metric): the exact paths' stays theirs
    return rows


def _row(op, shape, ref, got, tol, seconds, arena) -> dict:
    c = compare(ref, got)
    guards = not arena.layout.guard_breaches(arena.layer_words)
    return dict(op=op, shape=shape, metric="nmse", nmse=c.nmse, max_abs=c.max_abs, nan_inf_match=c.nonfinite_match,
                guards_intact=guards, tolerance=tol, seconds=seconds,
                passed=bool(c.nmse <= tol and c.nonfinite_match and guards))


def _error_row(shape, exc: BaseException) -> dict:
    """A case that raised (a typed error from the engine, or the driver): a failing row."""
    return dict(op="error", shape=shape, metric="error", nmse=float("inf"), max_abs=float("inf"),
                nan_inf_match=False, guards_intact=False, tolerance=0.0, seconds=None, passed=False,
                error=f"{type(exc).__name__}: {exc}")


def _encoder_row(dev, d: StreamDict, x, shape) -> dict:
    """The GPU OMP encoder: same reconstruction quality as the CPU encoder."""
    try:
        from ..vk.encode.encoder import GpuEncoder
    except ImportError:
        return dict(op="encode (GPU OMP)", shape=shape, nmse=0.0, max_abs=0.0, nan_inf_match=True,
                    guards_intact=True, tolerance=0.0, seconds=None, passed=True, skipped="no GPU encoder")
    enc = GpuEncoder(dev, d)
    try:
        gpu = codec.decode_heads(enc.encode(x), d)
    finally:
        enc.free()
    cpu = codec.held_heads(x, d)
    on_gpu, err_cpu = compare(x, gpu), compare(x, cpu).nmse
    err_gpu, same = on_gpu.nmse, on_gpu.nonfinite_match
    rel = abs(err_gpu - err_cpu) / max(err_cpu, 1e-30)
    # the metric here is the relative difference of the two encoders' reconstruction NMSE
    return dict(op="encode (GPU OMP) error vs CPU", shape=shape, metric="rel_err_diff", nmse=rel,
                max_abs=abs(err_gpu - err_cpu),
                nan_inf_match=same, guards_intact=True, tolerance=1e-2, seconds=None,
                passed=bool(rel <= 1e-2 and same and np.isfinite(gpu).all()))


FORWARD_NLL = 1e-3  # nats a token: a device forward against the forge's (issue 52)


def _forward_row(dev, rng) -> dict:
    """The fwd_* kernels: a random 2-layer model (Q4_1 matrices, a Q8_0 embedding; hidden 96,
    6 query heads over 2 KV heads of 32) decoded on the device over an f16 cache, each
    token's NLL against the forge's NumPy forward over the same weights and binary16 K/V."""
    from ..forge import llama
    from ..forge.gguf_model import dequantised_model
    from ..forge.quant import QuantHook
    from ..model_file import ModelConfig
    from ..vk import KvArena
    from ..vk.forward import DeviceForward, random_weights
    cfg = ModelConfig("llama", 2, 96, 6, 2, 32, 160, 10000.0, 32, 1e-5, 300, 64, False)
    weights, tokens = random_weights(cfg, rng, "q4_1", embedding="q8_0"), rng.integers(0, cfg.vocab, 10)

    arena = KvArena(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, len(tokens), device=dev, cache="f16")
    t0 = time.perf_counter()
    try:
        with DeviceForward(weights, arena, logits=True) as forward:
            got = []
            for i, tok in enumerate(tokens[:-1]):
                forward.run(int(tok))
                x = forward.logits().astype(np.float64)
                got.append(x.max() + np.log(np.exp(x - x.max()).sum()) - x[tokens[i + 1]])
        seconds = time.perf_counter() - t0
        guards = not arena.layout.guard_breaches(arena.layer_words)
    finally:
        arena.free()
    want = llama.token_nll(tokens, QuantHook("f16"), model=dequantised_model(weights))
    diff = float(np.abs(np.array(got) - want).max())
    return dict(op="device forward (fwd_*), f16 cache", shape="2 layers, hidden 96, 6/2 heads × 32, Q4_1",
                metric="nll_abs", nmse=diff, max_abs=diff, nan_inf_match=bool(np.isfinite(got).all()),
                guards_intact=guards, tolerance=FORWARD_NLL, seconds=seconds,
                passed=bool(diff <= FORWARD_NLL and np.isfinite(got).all() and guards))


def run_validation(dev, quick: bool = False, seed: int = 0, log=None) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for case in (QUICK_GRID if quick else FULL_GRID):
        try:
            rows += _case(dev, rng, *case)
        except E.KvDictError as e:
            rows.append(_error_row(_shape(*case), e))
        if log:
            log(rows[-1])
    try:
        rows.append(_forward_row(dev, rng))
    except E.KvDictError as e:
        rows.append(_error_row("device forward", e))
    if log:
        log(rows[-1])
    return rows


def worst_by_metric(rows) -> dict:
    """{metric: worst value} over the rows (the demo's one-line summary)."""
    out: dict = {}
    for r in rows:
        out[r["metric"]] = max(out.get(r["metric"], 0.0), r["nmse"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kvdict-validate", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--device", help="index or name substring (default: KVDICT_VK_DEVICE, else the first)")
    ap.add_argument("--list", action="store_true", help="list Vulkan devices and exit")
    ap.add_argument("--report", action="store_true",
                    help="print the installation's diagnostics (kvdict_vk.diagnostics: host, versions, devices "
                         "with limits and features, artifact, tuner cache, SPIR-V) and exit")
    ap.add_argument("--quick", action="store_true", help="the small grid the demo runs")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--abi", action="store_true",
                    help="print the SPIR-V variants' embedding contract (kvdict_vk/spv/abi.json) and exit")
    ap.add_argument("--variants", action="store_true",
                    help="list the kernel variant each cache type attends by on the device (8 x 4 heads, "
                         "head_dim 64, 32 768 tokens) and exit")
    a = ap.parse_args(argv)
    if a.abi:  # no device needed: the shipped abi.json's text, from the one declaration
        from ..vk import shader_build
        sys.stdout.write(shader_build.abi_json())
        return 0
    if a.report:  # every section says its own errors: exit 0 whatever the machine has
        if a.json:
            print(json.dumps(diagnostics.report(), indent=1, default=str))
        else:
            diagnostics.print_report()
        return 0
    try:
        if a.list:
            devs = diagnostics.devices()
            print(json.dumps(devs, indent=1) if a.json else "\n".join(diagnostics.device_line(d) for d in devs))
            return 0
        from ..vk import device as vkd
        dev = vkd.get_device(a.device)
    except (E.KvDictError, ImportError) as e:
        print(f"kvdict-validate: no usable Vulkan device: {e}", file=sys.stderr)
        return 2
    print(f"[validate] device: {dev.name}", file=sys.stderr)
    variants = diagnostics.attention_variants(dev)
    if a.variants:
        print(json.dumps(dict(device=dev.name, variants=variants), indent=1) if a.json else
              "\n".join([f"attention variants on {dev.name} (8 x 4 heads, d64, 32 768 tokens):"]
                        + diagnostics.variant_lines(variants)))
        return 0 if all("error" not in r for r in variants) else 1
    rows = run_validation(dev, quick=a.quick)
    ok = all(r["passed"] for r in rows)
    if a.json:
        print(json.dumps(dict(device=dev.name, passed=ok, rows=rows, variants=variants), indent=1))
    else:
        print("\n".join(["attention by cache type (8 x 4 heads, d64, 32 768 tokens):"]
                        + ["  " + line for line in diagnostics.variant_lines(variants)]))
        print(f"{'op':<34} {'metric':<12} {'value':>9} {'max|Δ|':>9}  {'ok':<4} shape")
        for r in rows:
            print(f"{r['op']:<34} {r['metric']:<12} {r['nmse']:9.1e} {r['max_abs']:9.1e}  "
                  f"{'PASS' if r['passed'] else 'FAIL':<4} {r['shape']}")
            if "error" in r:
                print(f"    {r['error']}")
        print(f"{sum(r['passed'] for r in rows)}/{len(rows)} passed on {dev.name}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
