"""The token-by-token decode driving an external cache equals the batched forward."""
from __future__ import annotations

import numpy as np

from kvdict_vk.forge import decode, llama, texts, tokenizer
from kvdict_vk.forge.gguf_model import load_model


def test_decode_matches_forward_with_f32_reference_cache():
    toks = tokenizer.encode(texts.EVAL_TEXTS["gpl3"].text())[:24]
    c = load_model().config
    cache = decode.NumpyCache(c.n_layers, c.n_kv_heads, c.head_dim, 32)
    res = decode.decode(toks, cache)
    ref = llama.token_nll(toks)
    assert res.nll.shape == ref.shape
    np.testing.assert_allclose(res.nll, ref, rtol=2e-3, atol=2e-3)
    assert cache.n == [24] * c.n_layers


def test_reference_check_sees_every_step_and_catches_a_wrong_cache():
    toks = tokenizer.encode(texts.EVAL_TEXTS["gpl3"].text())[:6]
    c = load_model().config
    dims = (c.n_layers, c.n_kv_heads, c.head_dim, 8)
    check = decode.ReferenceCheck(decode.NumpyCache(*dims))
    decode.decode(toks, decode.NumpyCache(*dims), observe=check)
    assert check.steps == len(toks) * c.n_layers
    assert check.worst_nmse < 1e-12  # the same float64 math; only the float32 output differs

    class TooSharp(decode.NumpyCache):  # attends with twice the softmax scale
        def attend(self, layer, q, n_used, scale=None):
            return super().attend(layer, q, n_used, 2 / np.sqrt(q.shape[-1]))
    wrong = decode.ReferenceCheck(decode.NumpyCache(*dims))
    decode.decode(toks, TooSharp(*dims), observe=wrong)
    assert wrong.worst_nmse > 1e-3


def test_observer_time_is_not_decode_time(monkeypatch):
    """A clock that only the observer advances: the decode's seconds must stay zero."""
    clock = [0.0]
    monkeypatch.setattr(decode.time, "perf_counter", lambda: clock[0])

    def slow_observer(layer, k, v, q, out):
        clock[0] += 1.0

    c = load_model().config
    res = decode.decode(tokenizer.encode(texts.EVAL_TEXTS["gpl3"].text())[:3],
                        decode.NumpyCache(c.n_layers, c.n_kv_heads, c.head_dim, 4), observe=slow_observer)
    assert clock[0] == 3 * c.n_layers  # it ran at every step
    assert res.seconds == 0.0 and res.first_token_seconds == 0.0
