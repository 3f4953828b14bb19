"""attend_flash_kivi (shaders/attend_flash.comp's KIVI build, shaders/kivi.glsl's decoder): decode
attention straight over the KIVI cache's words — packed levels, the keys' group statistics, the
exact windows' binary16 rings, the state word read in the shader — against the float64 reference
over the same dequantised rows (kvdict_vk.kivi.attend: cache_rows + attention_ref.attend),
NMSE ≤ 1e-9, under the validation layer; every arena guarded. KvArena(cache="kivi").attend
and .step run it; the read-out path (Attention.path "rows") stays as the fallback."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import check_guards
from kvdict_vk import errors as E
from kvdict_vk import kivi as K
from kvdict_vk.cli.validate import NMSE_FAST  # attend_mma's gate (issue #50)
from kvdict_vk.metrics import nmse

pytestmark = pytest.mark.gpu

LIMIT = 1e-9

# (head_dim, GQA, n_kv, spec, append sizes, n_used values): token counts not multiples of 32
# nor of the split; caches whose window holds tokens and one whose window is empty (recent 0,
# whole groups); bits 2, 3, 4, 8 (and mixed K/V bits)
CASES = [
    (64, 4, 2, K.KiviSpec(4, 4, 128), (300, 1, 399), (1, 33, 450, 700)),
    (32, 3, 3, K.KiviSpec(2, 3, 0), (100, 220), (1, 31, 200, 319, 320)),  # window empty at 320
    (128, 1, 1, K.KiviSpec(8, 8, 33), (777, 2, 221), (1, 65, 999, 1000)),
    (64, 3, 2, K.KiviSpec(3, 2, 5), (40, 40, 17), (1, 7, 50, 97)),  # n_ctx not whole groups
    (128, 4, 3, K.KiviSpec(4, 4, 128), (100,), (1, 77, 100)),  # every token in the window
    (32, 1, 2, K.KiviSpec(3, 8, 64), (1500, 501), (1, 129, 1333, 2001)),  # several splits
    (64, 1, 1, K.KiviSpec(2, 4, 16), (4099,), (4099, 2049)),
]


def _rows(rng, n_kv, n_ctx, hd):
    k = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32) * 2
    k[:, :, 3] += 10  # an outlier channel, what per-channel keys are for
    return k, rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)


def _filled(make_arena, rng, hd, n_kv, spec, steps):
    n_ctx = sum(steps)
    k, v = _rows(rng, n_kv, n_ctx, hd)
    arena = make_arena(1, n_kv, hd, n_ctx, guard_words=64, cache="kivi", kivi=spec)
    n = 0
    for s in steps:
        arena.append(0, k[:, n:n + s], v[:, n:n + s])
        n += s
    return arena, k, v


def _check(arena, q, k, v, n_tokens, n_used, spec, scale=None):
    out = arena.attend(0, q, n_used, scale)
    assert out.dtype == np.float32 and out.shape == q.shape
    err = nmse(K.attend(q, k, v, n_tokens, n_used, spec, scale), out)  # infinite unless NaN/Inf positions agree
    assert err <= LIMIT, f"n_used {n_used}: NMSE {err:.3g}"
    return out


def _uses_fused(att, layer: int = 0, shader: str = "attend_flash_kivi") -> bool:
    keys = att.passes.pipeline_keys()
    return (any(k[0] == "flash" and k[1].startswith(shader) and k[3] == layer for k in keys)
            and att.buffers.recon is None)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"hd{c[0]}-gqa{c[1]}-kv{c[2]}-k{c[3].k_bits}v{c[3].v_bits}"
                                                     f"r{c[3].recent}-n{sum(c[4])}")
def test_fused_attention_equals_the_reference(case, make_arena):
    hd, g, n_kv, spec, steps, used = case
    rng = np.random.default_rng(hd * 7 + g + n_kv)
    arena, k, v = _filled(make_arena, rng, hd, n_kv, spec, steps)
    n = sum(steps)
    if spec.recent == 0 and n % K.GROUP == 0:
        assert K.quantised_end(n, spec.recent) == n  # no token in the window
    q = rng.standard_normal((n_kv * g, hd)).astype(np.float32)
    att = arena.attention(n_kv * g)
    for n_used in used:
        plan = att.plan(0, n_used)
        assert plan.path == "flash" and plan.n_splits * plan.split_len >= n_used
        assert plan.split_len % K.GROUP == 0 or plan.n_splits == 1
        _check(arena, q, k, v, n, n_used, spec)
    _check(arena, q, k, v, n, n, spec, scale=0.05)  # an explicit scale
    assert _uses_fused(att)
    check_guards(arena)


def test_many_splits_short_and_empty(make_arena, monkeypatch):
    """Splits of one key group and more, not whole rounds of the kernel, as many as the engine
    holds, one empty (past n_used: its record m = -inf, l = 0): the merge takes the records."""
    from kvdict_vk.vk.attend import engine
    spec = K.KiviSpec(4, 3, 40)
    rng = np.random.default_rng(3)
    arena, k, v = _filled(make_arena, rng, 64, 2, spec, (1000,))
    q = rng.standard_normal((2 * 3, 64)).astype(np.float32)
    att = arena.attention(6)
    most = att.max_splits
    for split_len in (32, 64, 160, 992):  # forced through the plan's split rule, plus an empty split
        def forced(n, *_, s=split_len, **__):
            return min(most, -(-n // s) + 1), s
        with monkeypatch.context() as m:
            m.setattr(engine.P, "split_count", forced)
            for n_used in sorted({1, min(1000, (most - 1) * split_len // 2), min(1000, (most - 1) * split_len)}):
                plan = att.plan(0, n_used)
                assert plan.split_len == split_len and plan.n_splits * split_len >= n_used
                _check(arena, q, k, v, 1000, n_used, spec)
    check_guards(arena)


@pytest.mark.parametrize("bits", [(2, 2), (3, 5), (4, 4), (8, 6), (7, 8)])
def test_every_bit_width(bits, make_arena):
    spec = K.KiviSpec(*bits, 32)
    rng = np.random.default_rng(sum(bits))
    arena, k, v = _filled(make_arena, rng, 64, 1, spec, (230,))
    q = rng.standard_normal((3, 64)).astype(np.float32)
    for n_used in (1, 100, 230):
        _check(arena, q, k, v, 230, n_used, spec)
    check_guards(arena)


@pytest.mark.parametrize("kernel", [None, "mma"])
def test_steps_across_group_boundaries(kernel, make_arena):
    """KvArena.step (append, then attend) one token at a time across the points where a group
    leaves the window (the state word moves), then a bigger step: every output the reference —
    through the engine's kernel, and through attend_mma's KIVI build at the fast paths' gate
    where the device has cooperative matrices (elsewhere forcing it is a typed error)."""
    from kvdict_vk.vk.attend.flash import MMA_KERNEL
    spec = K.KiviSpec(4, 4, 16)
    rng = np.random.default_rng(8)
    hd, n_kv, g, n_ctx = 64, 2, 3, 160
    k, v = _rows(rng, n_kv, n_ctx, hd)
    arena = make_arena(1, n_kv, hd, n_ctx, guard_words=64, cache="kivi", kivi=spec)
    arena.append(0, k[:, :40], v[:, :40])
    q = rng.standard_normal((n_kv * g, hd)).astype(np.float32)
    att, limit = arena.attention(n_kv * g), LIMIT
    if kernel == MMA_KERNEL:
        att.path, att.flash_kernel, limit = "flash", MMA_KERNEL, NMSE_FAST
        if not att.shapes.mma_locals(0):
            with pytest.raises(E.ArenaError):
                arena.step(0, k[:, 40:41], v[:, 40:41], q)
            return
    for t in range(40, 85):  # quantised ends 0 → 32 at 48 tokens, → 64 at 80
        out = arena.step(0, k[:, t:t + 1], v[:, t:t + 1], q)
        err = nmse(K.attend(q, k, v, t + 1, t + 1, spec), out)
        assert err <= limit and np.isfinite(out).all(), f"step to {t + 1} tokens: NMSE {err:.3g}"
    out = arena.step(0, k[:, 85:150], v[:, 85:150], q)
    assert nmse(K.attend(q, k, v, 150, 150, spec), out) <= limit
    assert _uses_fused(att, shader="attend_mma_kivi" if kernel else "attend_flash_kivi")
    check_guards(arena)


def test_a_recorded_attention_stays_right_as_groups_are_quantised(make_arena):
    """The kernel reads the quantised end from the layer's state word: a recording made while
    tokens 0..39 are exact attends over their quantised rows once appends quantise them."""
    spec = K.KiviSpec(4, 4, 8)
    rng = np.random.default_rng(9)
    hd, n_kv, g = 32, 1, 4
    k, v = _rows(rng, n_kv, 200, hd)
    arena = make_arena(1, n_kv, hd, 200, guard_words=64, cache="kivi", kivi=spec)
    arena.append(0, k[:, :40], v[:, :40])
    q = rng.standard_normal((n_kv * g, hd)).astype(np.float32)
    att = arena.attention(n_kv * g)
    rec = att.recording(0, q, 40)
    try:
        rec.run()
        first = att.output()
        assert nmse(K.attend(q, k, v, 40, 40, spec), first) <= LIMIT
        arena.append(0, k[:, 40:200], v[:, 40:200])  # tokens 0..39 quantised now, the ring rewritten
        rec.run()
        again = att.output()
        assert nmse(K.attend(q, k, v, 200, 40, spec), again) <= LIMIT
        assert not np.array_equal(first, again)
    finally:
        rec.free()
    check_guards(arena)


def test_large_scores_do_not_overflow(make_arena):
    spec = K.KiviSpec()
    rng = np.random.default_rng(5)
    arena, k, v = _filled(make_arena, rng, 64, 2, spec, (600,))
    q = rng.standard_normal((6, 64)).astype(np.float32) * 1e3
    for n_used in (1, 2, 600):
        assert np.isfinite(_check(arena, q, k, v, 600, n_used, spec)).all()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")
def test_non_finite_keys_give_the_references_non_finite_outputs(make_arena):
    """An Inf in the exact window's keys (binary16 overflow) makes one token's scores +Inf for
    its KV head's query heads: their outputs are NaN, as the reference's (Inf − Inf), the other
    heads' finite — nmse is infinite unless the NaN/±Inf positions agree."""
    spec = K.KiviSpec(4, 4, 64)
    rng = np.random.default_rng(12)
    k, v = _rows(rng, 2, 150, 64)
    k[1, 140, 5] = 1e6  # binary16 Inf in the window
    arena = make_arena(1, 2, 64, 150, guard_words=64, cache="kivi", kivi=spec)
    arena.append(0, k, v)
    q = rng.standard_normal((4, 64)).astype(np.float32)
    q[:, 5] = np.abs(q[:, 5]) + 0.5  # KV head 1's query heads score +Inf on token 140
    out = arena.attend(0, q, 150)
    ref = K.attend(q, k, v, 150, 150, spec)
    assert not np.isfinite(ref[2:]).all() and np.isfinite(ref[:2]).all()
    assert nmse(ref, out) <= LIMIT
    np.testing.assert_array_equal(np.isnan(ref), np.isnan(out))


def test_kivi_arena_attends_by_the_fused_kernel_and_keeps_the_read_out_path(make_arena):
    spec = K.KiviSpec()
    rng = np.random.default_rng(13)
    arena, k, v = _filled(make_arena, rng, 64, 3, spec, (500,))
    q = rng.standard_normal((9, 64)).astype(np.float32)
    att = arena.attention(9)
    fused = _check(arena, q, k, v, 500, 499, spec)
    assert att.plan(0, 499).path == "flash" and _uses_fused(att)
    att.path = "rows"  # the fallback: read out to f32 (read_rows_kivi), then attend
    rows = _check(arena, q, k, v, 500, 499, spec)
    assert att.buffers.recon is not None
    assert nmse(rows.astype(np.float64), fused) <= LIMIT
    for path in ("direct", "table", "rows"):
        with pytest.raises(E.ArenaError, match="attend_reconstructed"):
            att.plan(0, 10, path=path)
    att.path = "flash"
    _check(arena, q, k, v, 500, 500, spec)
    check_guards(arena)


def test_extents_refuse_what_the_kernel_cannot_run():
    from kvdict_vk.vk.shaders import SHADERS
    ext = SHADERS["attend_flash_kivi"].extents
    p = dict(k_word=0, v_word=1000, n_ctx=100, n_used=50, split_len=64, n_splits=1, n_kv=2, n_seqs=1, seq_rows=100,
             stats_word=5000, k_window_word=6000, v_window_word=8000, window=160, state_word=9999, split_round=1,
             q_word=0, score_scale=0.1)
    s = dict(HEAD_DIM=64, GROUP=4, LOCAL=64, HB=1, ROW_HALF=1, ROW_Q8=0, END_ELEMS=2, K_BITS=4, V_BITS=4)
    spans = ext(p, s)
    assert [9999, 10000] in [list(x) for x in spans[0]]  # the state word is read
    two = ext(dict(p, n_ctx=200, n_seqs=2, v_word=2000), s)  # a batch: both sequences' state words
    assert [9999, 10001] in [list(x) for x in two[0]]
    for bad_s in (dict(s, LOCAL=60), dict(s, K_BITS=1), dict(s, V_BITS=9), dict(s, HEAD_DIM=48, LOCAL=96),
                  dict(s, GROUP=9), dict(s, ROW_HALF=0), dict(s, ROW_Q8=1)):
        with pytest.raises(E.DispatchError):
            ext(p, bad_s)
    for bad_p in (dict(p, n_used=101), dict(p, n_splits=0), dict(p, split_len=48, n_splits=2),
                  dict(p, window=0),
                  dict(p, n_seqs=2), dict(p, seq_rows=0), dict(p, seq_rows=30), dict(p, stats_word=5001),
                  dict(p, k_window_word=6002),
                  dict(p, split_len=0, split_round=0), dict(p, split_len=0, split_round=48, n_splits=2),
                  dict(p, q_word=2)):
        with pytest.raises(E.DispatchError):
            ext(bad_p, s)


def test_launch_shape_is_measured_once_per_bucket(make_arena, monkeypatch):
    """On GPUs attend_flash_kivi's launch shape (workgroup size, workgroups) is the fastest of
    its candidates timed on the device (attend_tune, attend_flash's candidates), once per layer
    signature and context bucket; the tuned attention is still exact."""
    from kvdict_vk.vk.attend import engine as A
    from kvdict_vk.vk.attend import tune as T
    monkeypatch.setattr(T, "_CHOICES", {})
    monkeypatch.setattr(T, "WARM_S", 0.0)
    spec = K.KiviSpec(4, 4, 32)
    rng = np.random.default_rng(21)
    arena, k, v = _filled(make_arena, rng, 64, 2, spec, (3000,))
    att = arena.attention(4)
    att.tune = True
    att.compute_units = 7  # planned as on a GPU of 7 multiprocessors
    shapes = att.shapes.flash_candidates(0)
    counts = {sh.workgroups for sh in shapes}  # counts whose splits the cap makes equal are timed once
    assert len({sh.local for sh in shapes}) >= 2 and len(counts) >= 2 and counts <= set(T.workgroup_counts(7, False))
    favourite = shapes[-1]
    timed = []

    def fake_time(layer, n_used, plan):
        timed.append((plan.local, plan.n_splits))
        assert (plan.split_len % K.GROUP == 0 or plan.n_splits == 1) and plan.n_splits <= att.max_splits
        return 1e-3 if plan.local == favourite.local else 2e-3
    monkeypatch.setattr(att, "time_plan", fake_time)
    monkeypatch.setattr(A, "timestamps_usable", lambda dev: True)
    p = att.plan(0, 1500)
    assert len(timed) == T.ROUNDS * len(shapes) and p.local == favourite.local and p.kernel == "float"
    assert att.plan(0, 2000).local == favourite.local and len(timed) == T.ROUNDS * len(shapes)  # same bucket
    att.plan(0, 3000)
    assert len(timed) == 2 * T.ROUNDS * len(shapes)  # bucket 4096: measured again
    q = rng.standard_normal((4, 64)).astype(np.float32)
    _check(arena, q, k, v, 3000, 1500, spec)
    check_guards(arena)
