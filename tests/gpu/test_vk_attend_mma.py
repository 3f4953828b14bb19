"""attend_mma (shaders/attend_mma.comp): decode attention on cooperative matrices
(GL_NV_cooperative_matrix, binary16 operands, float32 accumulators) over f16, q8_0 and KIVI
caches, against the float64 reference over the same cached values at the fast paths' gate
(NMSE ≤ 1e-5, issue #50's decision), under the validation layer, every arena guarded.

Where the device lacks what attend_mma needs (lavapipe: no cooperative matrices) it is never
offered, and forcing it is a typed error — those tests assert that instead. (Its KIVI steps
across group boundaries: test_vk_attend_kivi.py.)"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import check_guards
from kvdict_vk import errors as E
from kvdict_vk import kivi as K
from kvdict_vk import rows as R
from kvdict_vk.cli.validate import NMSE_FAST as GATE  # the fast paths' gate (issue #50)
from kvdict_vk.metrics import nmse
from kvdict_vk.vk import abi
from kvdict_vk.vk.attend import flash
from kvdict_vk.vk.attend.flash import MMA_KERNEL, MMA_LOCALS
from helpers import rising_keys
from test_vk_attend import batched_within, reference
from test_vk_attend_kivi import _filled as kivi_filled, _rows

pytestmark = pytest.mark.gpu


def _has_mma(device) -> bool:
    return set(abi.MMA_FEATURES) <= set(device.features()) and device.limit("subgroup_size") == 32


def _held(cache, k, v):
    return R.held_rows(k, cache), R.held_rows(v, cache)


def _force_mma(arena, n_q_heads, attempt):
    """The arena's attention with attend_mma forced (256 workgroups); where the device lacks it,
    None once ``attempt()`` — an attention through it — has raised the typed error."""
    att = arena.attention(n_q_heads)
    att.path, att.flash_kernel, att.flash_workgroups = "flash", MMA_KERNEL, 256
    if att.shapes.mma_locals(0):
        return att
    with pytest.raises(E.ArenaError):
        attempt()
    return None


def test_offered_only_where_the_device_has_it(make_arena, monkeypatch):
    """attend_mma has launch shapes (FlashShapes.mma_locals) over f16, q8_0 and KIVI layers of
    2, 4 or 8 bits exactly where the device reports float16 arithmetic, NV cooperative matrices
    with its shape, and subgroups of 32; never over f32 rows or other KIVI widths. The tuner
    times it only with MMA_TUNED. Elsewhere forcing it is a typed error and the variant itself
    is refused before the driver sees it."""
    from kvdict_vk.vk import kernels
    dev_has = None
    for cache, kw, offered in (("f16", {}, True), ("q8_0", {}, True), ("f32", {}, False),
                               ("kivi", dict(kivi=K.KiviSpec(4, 4, 32)), True),
                               ("kivi", dict(kivi=K.KiviSpec(3, 4, 32)), False)):
        arena = make_arena(1, 2, 64, 256, cache=cache, **kw)
        dev_has = _has_mma(arena.device)
        att = arena.attention(6)
        fits = offered and dev_has
        assert bool(att.shapes.mma_locals(0)) == fits, cache
        assert MMA_KERNEL not in att.shapes.flash_kernels(0)  # not tuned (flash.MMA_TUNED)
        if cache != "f32":
            with monkeypatch.context() as m:
                m.setattr(flash, "MMA_TUNED", True)
                assert (MMA_KERNEL in arena.attention(6).shapes.flash_kernels(0)) == fits, cache
        if not (offered and dev_has):
            att.path, att.flash_kernel = "flash", MMA_KERNEL
            with pytest.raises(E.ArenaError):
                att.plan(0, 100)
    if not dev_has:
        buf = kernels.Buffer(arena.device, 1024, "storage", "x")
        try:
            with pytest.raises(E.DispatchError, match="cooperative_matrix_nv"):
                kernels.Kernel(arena.device, "attend_mma", [buf] * 5, dict(HEAD_DIM=64, GROUP=3, LOCAL=64, HB=1,
                                                                           ROW_HALF=1), max_items=64)
        finally:
            buf.destroy()


@pytest.mark.parametrize("local", MMA_LOCALS)
@pytest.mark.parametrize("cache", ["f16", "q8_0"])
@pytest.mark.parametrize("hd,g,n_kv,n_ctx", [(64, 3, 3, 5000), (128, 4, 2, 3000), (32, 8, 2, 1000),
                                             (64, 1, 1, 37), (128, 7, 1, 700)])
def test_rows_within_the_gate(hd, g, n_kv, n_ctx, cache, local, make_arena, monkeypatch):
    """f16 and q8_0 rows at each workgroup size: token counts that are not whole tiles nor
    whole splits, one token, many splits and one, an explicit score scale."""
    monkeypatch.setattr(flash, "MMA_LOCALS", (local,))
    rng = np.random.default_rng(hd * 31 + g + n_ctx)
    arena = make_arena(1, n_kv, hd, n_ctx, guard_words=64, cache=cache)
    k, v = _rows(rng, n_kv, n_ctx, hd)
    arena.append(0, k, v)
    k, v = _held(cache, k, v)
    q = rng.standard_normal((n_kv * g, hd)).astype(np.float32)
    att = _force_mma(arena, n_kv * g, lambda: arena.attend(0, q, n_ctx))
    if att is None:
        return
    assert att.shapes.mma_locals(0) == [local]
    for workgroups in (256, 1):
        att.flash_workgroups = workgroups
        for n_used, scale in ((1, None), (17, None), (n_ctx // 2 + 3, None), (n_ctx, None), (n_ctx, 0.05)):
            plan = att.plan(0, n_used)
            assert plan.kernel == MMA_KERNEL and plan.local == local
            out = arena.attend(0, q, n_used, scale)
            err = nmse(reference(q, k, v, None, None, n_used, scale), out)
            assert err <= GATE, f"{workgroups} workgroups, n_used {n_used}: NMSE {err:.3g}"
    assert any(key[1] == "attend_mma" for key in att.passes.pipeline_keys())
    check_guards(arena)


@pytest.mark.parametrize("cache", ["f16", "q8_0"])
def test_reference_moves_with_rising_scores(cache, make_arena):
    """Scores that rise along the context and a spike: the softmax reference moves many times,
    each time the accumulators go through shared memory to be rescaled."""
    rng = np.random.default_rng(11)
    hd, g, n_kv, n_ctx = 64, 4, 2, 3000
    arena = make_arena(1, n_kv, hd, n_ctx, guard_words=64, cache=cache)
    q, k, v = rising_keys(rng, n_kv, g, hd, n_ctx)
    arena.append(0, k, v)
    k, v = _held(cache, k, v)
    att = _force_mma(arena, n_kv * g, lambda: arena.attend(0, q, n_ctx))
    if att is None:
        return
    for n_used in (1, 300, n_ctx // 3 + 1, n_ctx):
        err = nmse(reference(q, k, v, None, None, n_used), arena.attend(0, q, n_used))
        assert err <= GATE, f"n_used {n_used}: NMSE {err:.3g}"
    check_guards(arena)


KIVI_CASES = [
    (64, 4, 2, K.KiviSpec(4, 4, 128), (300, 1, 399), (1, 33, 450, 700)),
    (128, 3, 3, K.KiviSpec(4, 4, 128), (2000, 61), (1, 1000, 2061)),
    (32, 3, 3, K.KiviSpec(2, 4, 0), (100, 220), (1, 31, 200, 319, 320)),  # window empty at 320
    (128, 1, 1, K.KiviSpec(8, 8, 33), (777, 2, 221), (1, 65, 999, 1000)),
    (64, 8, 2, K.KiviSpec(8, 2, 5), (40, 40, 17), (1, 7, 50, 97)),
    (64, 4, 1, K.KiviSpec(4, 4, 16), (4099,), (4099, 2049)),
]


@pytest.mark.parametrize("case", KIVI_CASES, ids=lambda c: f"hd{c[0]}-gqa{c[1]}-kv{c[2]}-k{c[3].k_bits}"
                                                           f"v{c[3].v_bits}r{c[3].recent}")
def test_kivi_within_the_gate(case, make_arena):
    """attend_mma's KIVI build: packed levels, the keys' group statistics folded into the query,
    the values' into the probabilities, the exact window's binary16 rows after them."""
    hd, g, n_kv, spec, steps, used = case
    rng = np.random.default_rng(hd * 7 + g + n_kv)
    n = sum(steps)
    arena, k, v = kivi_filled(make_arena, rng, hd, n_kv, spec, steps)
    q = rng.standard_normal((n_kv * g, hd)).astype(np.float32)
    att = _force_mma(arena, n_kv * g, lambda: arena.attend(0, q, n))
    if att is None:
        return
    for n_used in used:
        plan = att.plan(0, n_used)
        assert plan.kernel == MMA_KERNEL and (plan.split_len % K.GROUP == 0 or plan.n_splits == 1)
        err = nmse(K.attend(q, k, v, n, n_used, spec), arena.attend(0, q, n_used))
        assert err <= GATE, f"n_used {n_used}: NMSE {err:.3g}"
    err = nmse(K.attend(q, k, v, n, n, spec, 0.05), arena.attend(0, q, n, 0.05))
    assert err <= GATE
    assert any(key[1] == "attend_mma_kivi" for key in att.passes.pipeline_keys())
    check_guards(arena)


@pytest.mark.parametrize("cache", ["f16", "q8_0"])
def test_batched_rows_within_the_gate(cache, make_arena):
    """B sequences of their own lengths over one arena (attend_batch)."""
    lengths = (700, 1, 130, 33)
    rng = np.random.default_rng(21)
    n_kv, g, hd = 2, 3, 64
    arena = make_arena(1, n_kv, hd, max(lengths), cache=cache, seqs=len(lengths), guard_words=64)
    held = []
    for b, n in enumerate(lengths):
        k, v = _rows(rng, n_kv, n, hd)
        arena.append(0, k, v, seq=b)
        held.append(_held(cache, k, v))
    q = rng.standard_normal((len(lengths), n_kv * g, hd), dtype=np.float32)
    att = _force_mma(arena, n_kv * g, lambda: arena.attend_batch(0, q, list(lengths)))
    if att is None:
        return
    for used in (list(lengths), [5, 1, 129, 2]):
        batched_within(arena, q, held, used, GATE)
    check_guards(arena)
