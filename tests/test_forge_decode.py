"""The token-by-token decode driving an external cache equals the batched forward."""
from __future__ import annotations

import numpy as np

from kvdict_vk.forge import decode, llama, tokenizer
from kvdict_vk.forge.gguf_model import load_model


def test_decode_matches_forward_with_f32_reference_cache():
    toks = tokenizer.encode(tokenizer.read_text())[:24]
    c = load_model().config
    cache = decode.NumpyCache(c.n_layers, c.n_kv_heads, c.head_dim, 32)
    res = decode.decode(toks, cache)
    ref = llama.token_nll(toks)
    assert res.nll.shape == ref.shape
    np.testing.assert_allclose(res.nll, ref, rtol=2e-3, atol=2e-3)
    assert cache.n == [24] * c.n_layers
