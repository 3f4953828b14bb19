"""kvdict_vk.rope: the turn every read of a key coded before RoPE is held to (float64), its
inverse, the forge forward's RoPE, and the arena's two-table rotation that the shaders compute
(rope.rotate_tabled: their float32 arithmetic) against float64 up to 131 072 tokens."""
from __future__ import annotations

import numpy as np
import pytest

from kvdict_vk import errors as E
from kvdict_vk import rope as R
from kvdict_vk.forge import llama
from kvdict_vk.metrics import nmse


@pytest.mark.parametrize("hd,dims,theta", [(64, 64, 1e4), (64, 32, 1e5), (128, 128, 5e5), (16, 8, 100.0)])
def test_turn_matches_the_forward_and_turns_back(hd, dims, theta):
    rope = R.KeyRope(theta, dims)
    x = np.random.default_rng(hd).standard_normal((3, 50, hd)).astype(np.float32)
    t0 = 7000
    turned = rope.rotate(x, t0)
    forge = llama.apply_rope(x, np.arange(t0, t0 + 50), theta, dims)  # float32 cos/sin
    assert nmse(forge, turned) <= 1e-12
    np.testing.assert_array_equal(turned[..., dims:], x[..., dims:])  # past dims: unturned
    assert nmse(x, R.KeyRope(theta, dims).unturn(turned, t0)) <= 1e-13
    assert not np.allclose(turned[..., :dims], x[..., :dims])


def test_a_batch_of_keys_turns_each_at_its_own_position():
    """Positions as an array (a batched step's tokens, each at its sequence's position): the same
    turn as each key alone at its start; a count that does not match the keys is a DimsError."""
    rope = R.KeyRope(1e4, 64)
    x = np.random.default_rng(3).standard_normal((2, 4, 64))
    pos = np.array([5, 0, 70000, 12])
    want = np.concatenate([rope.rotate(x[:, i:i + 1], int(p)) for i, p in enumerate(pos)], axis=1)
    np.testing.assert_array_equal(rope.rotate(x, pos), want)
    assert nmse(x, rope.unturn(rope.rotate(x, pos), pos)) <= 1e-13
    with pytest.raises(E.DimsError, match="positions"):
        rope.rotate(x, pos[:3])


@pytest.mark.parametrize("n_ctx", [1, 97, 8192, 131072])
@pytest.mark.parametrize("dims", [64, 48])
def test_the_tables_turn_keys_within_the_exact_path(n_ctx, dims):
    hd, rope = 64, R.KeyRope(1e5, dims)
    b = R.table_block(n_ctx)
    assert b * b >= n_ctx and (b == 1 or (b // 2) ** 2 < n_ctx) and b & (b - 1) == 0
    tab = R.table(rope, n_ctx, hd)
    assert tab.shape == (R.table_rows(n_ctx) * hd,) == ((R.table_hi_rows(n_ctx) + b) * hd,)
    hi, lo = R.table_rows_of(tab, n_ctx, hd)
    for rows, pos in ((hi, np.arange(R.table_hi_rows(n_ctx)) * b), (lo, np.arange(b))):
        np.testing.assert_array_equal(rows[:, dims + 0::2], 1.0)  # pairs past dims: (cos, sin) = (1, 0)
        np.testing.assert_array_equal(rows[:, dims + 1::2], 0.0)
        np.testing.assert_allclose(rows[:, 0:dims:2], np.cos(pos[:, None] * rope.inv_freq(hd)[None, :dims // 2]),
                                   atol=1e-7)
    # the lo angles quad-major: quad c of lo angles 0, 1, … adjacent
    lo_part = tab[R.table_hi_rows(n_ctx) * hd:].reshape(hd // 4, b, 4)
    np.testing.assert_array_equal(lo_part[1], lo[:, 4:8])
    n = min(n_ctx, 4000)
    x = np.random.default_rng(n_ctx).standard_normal((2, n, hd)).astype(np.float32)
    t0 = n_ctx - n  # the last positions: the largest angles
    assert nmse(rope.rotate(x, t0), R.rotate_tabled(x, t0, tab, n_ctx)) <= 1e-12


def test_key_rope_refuses_what_it_cannot_turn():
    for theta, dims in ((1.0, 64), (float("nan"), 64), (1e4, 3), (1e4, 0), (True, 64), (1e4, 2.0)):
        with pytest.raises(E.DimsError):
            R.KeyRope(theta, dims)
    with pytest.raises(E.DimsError, match="multiple of 4"):
        R.KeyRope(1e4, 6).check_head_dim(6)
    with pytest.raises(E.DimsError):
        R.KeyRope(1e4, 66).check_head_dim(64)
