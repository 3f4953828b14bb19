"""The pre-RoPE-keys lever (kvdict_vk.forge.pre_rope): which dictionary codes which tensor,
and where in the forward."""
import numpy as np

from conftest import random_artifact
from kvdict_vk import codec
from kvdict_vk.forge import pre_rope as R


def test_keys_are_coded_before_rope_values_after_and_passthrough_streams_are_kept():
    rng = np.random.default_rng(4)
    # layer 0: both streams coded; layer 1: a passthrough key stream
    art = random_artifact(rng, 64, 32, [((4, 4), (4, 3)), (None, (2, 2))], n_heads=2)
    pre = random_artifact(rng, 64, 32, [((4, 4), None), ((3, 2), None)], n_heads=2)
    hook = R.PreRopeKeysHook(pre, art)
    k, v = (rng.standard_normal((2, 40, 64)).astype(np.float32) for _ in range(2))
    for layer in (0, 1):
        kd = pre.stream(layer, True)
        got = hook.keys_pre_rope(layer, k)
        assert np.array_equal(got, codec.roundtrip_heads(k, kd))  # the pre-RoPE dictionary, even where
        assert not np.array_equal(got, k)                         # the engine's keys pass through
        k_out, v_out = hook(layer, k, v)
        assert k_out is k  # the rotated keys are not coded again
        assert np.array_equal(v_out, codec.roundtrip_heads(v, art.stream(layer, False)))
    # the codec hook (the row beside it) codes the rotated keys with the artifact's dictionaries
    k_out, v_out = R.CodecHook(art)(0, k, v)
    assert np.array_equal(k_out, codec.roundtrip_heads(k, art.stream(0, True)))
    assert np.array_equal(R.CodecHook(art)(1, k, v)[0], k)


def test_fp8_coefficients_reach_both_streams():
    rng = np.random.default_rng(5)
    art = random_artifact(rng, 64, 32, [(None, (4, 3))], n_heads=2)
    pre = random_artifact(rng, 64, 32, [((4, 4), None)], n_heads=2)
    from kvdict_vk.forge.coef_fp8 import fp8_roundtrip
    hook = R.PreRopeKeysHook(pre, art, fp8=True)
    k, v = (rng.standard_normal((2, 40, 64)).astype(np.float32) for _ in range(2))
    got = hook.keys_pre_rope(0, k)
    assert np.array_equal(got, fp8_roundtrip(pre.stream(0, True), k).astype(np.float32))
    assert not np.array_equal(got, codec.roundtrip_heads(k, pre.stream(0, True)))  # the rounding shows
    assert np.array_equal(hook(0, k, v)[1], fp8_roundtrip(art.stream(0, False), v).astype(np.float32))
