"""Soak: 100 000 tokens appended one at a time to a small dict-coded arena; resident
memory stays flat (measured) and the cache still matches the reference at the end."""
from __future__ import annotations

import numpy as np
import pytest

from kvdict_vk import attention_ref, codec, runtime
from kvdict_vk.dictionary import KvDictArtifact, StreamDict

from conftest import nmse

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
N_TOKENS = 100_000


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_hundred_thousand_appends_memory_flat(vk_device):
    from kvdict_vk.vk import KvArena
    rng = np.random.default_rng(99)
    hd, na = 16, 32
    k = StreamDict(rng.standard_normal((na, hd)), rng.standard_normal(hd), None, 2,
                   residual_bits=2, residual_scale=np.full(hd, 0.5))
    v = StreamDict(rng.standard_normal((na, hd)), None, None, 3)
    art = KvDictArtifact(hd, na, 3, [(k, v)])
    runtime.enable(art)
    try:
        arena = KvArena(1, 1, hd, N_TOKENS)
    finally:
        runtime.deactivate()
    rows_k = rng.standard_normal((1, N_TOKENS, hd)).astype(np.float32)
    rows_v = rng.standard_normal((1, N_TOKENS, hd)).astype(np.float32)
    samples = []
    with arena:
        for t in range(N_TOKENS):
            arena.append(0, rows_k[:, t:t + 1], rows_v[:, t:t + 1])
            if t % 10_000 == 9_999:
                samples.append(_rss_bytes())
        assert arena.n_tokens(0) == N_TOKENS
        # After warm-up (first sample), growth over 90 000 more tokens stays small: no
        # per-token host allocation survives (Kompute keeps ~40 B per recorded sequence).
        growth = samples[-1] - samples[1]
        assert growth < 16 << 20, f"RSS grew {growth / 2**20:.1f} MiB: {[s >> 20 for s in samples]} MiB"

        kk, vv = arena.read(0, 0, N_TOKENS)
        ref_k = codec.decode_heads(codec.encode_heads(rows_k, k), k)
        ref_v = codec.decode_heads(codec.encode_heads(rows_v, v), v)
        assert nmse(ref_k, kk) <= 1e-12 and nmse(ref_v, vv) <= 1e-12
        q = rng.standard_normal((2, hd)).astype(np.float32)
        out = arena.attend(0, q, N_TOKENS)
        assert nmse(attention_ref.attend(q, ref_k, ref_v, N_TOKENS), out) <= 1e-9
