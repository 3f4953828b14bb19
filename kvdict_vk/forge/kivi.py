"""KIVI-style asymmetric quantisation of the KV cache (Liu et al., 2024): keys per channel
over groups of 32 consecutive tokens, values per token over groups of 32 dims, b bits,
each group with a binary16 scale and a binary16 minimum — optionally with the most recent
tokens kept in binary16 (KIVI's "residual" of R full-precision tokens).

Arrays are (n_kv, T, head_dim); keys are quantised as the cache holds them (after RoPE).
The quantisation is kvdict_vk.kivi's — the engine's KIVI cache (``KvArena(cache="kivi")``)
stores exactly these values. A key group that is not yet full (the window's tail) takes
its statistics over the tokens it has (the engine keeps such a group exact).

Bytes per head vector (head_dim 64): b·64/8 for the levels plus 64 channels × 4 B per 32
tokens (keys) or 2 groups × 4 B (values) = 8 B either way: 8b + 8 — 5 bit 48 B, 4 bit
40 B, 3 bit 32 B, 2 bit 24 B. A window of R exact tokens costs R × 128 B (binary16 K or
V rows) instead of their quantised bytes; ``bytes_per_vector`` charges it at the
evaluation's context (1024 tokens), where R of the 1024 cached tokens are exact.
"""
from __future__ import annotations

from .. import kivi as K
from .llama import KVHook

GROUP = K.GROUP
keys, values = K.keys, K.values  # the cache's own quantisation: the forge measures what the engine stores


def quant_bytes(bits: int, head_dim: int = 64) -> float:
    return bits * head_dim / 8 + 4 * head_dim / GROUP


def bytes_per_vector(k_bits: int, v_bits: int, recent: int = 0, head_dim: int = 64,
                     context: int = 1024) -> float:
    q = (quant_bytes(k_bits, head_dim) + quant_bytes(v_bits, head_dim)) / 2
    return ((context - recent) * q + recent * 2 * head_dim) / context


class KiviHook(KVHook):
    """K and V of every layer KIVI-quantised; `recent` exact tokens (binary16) if > 0."""

    exact_group = GROUP  # a key group is quantised once all its tokens left the window

    def __init__(self, k_bits: int, v_bits: int, recent: int = 0):
        self.k_bits, self.v_bits, self.exact_recent = k_bits, v_bits, recent

    def __call__(self, layer, k, v):
        return keys(k, self.k_bits), values(v, self.v_bits)
