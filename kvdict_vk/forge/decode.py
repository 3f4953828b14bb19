"""Token-by-token decode of the llama model over an external KV cache.

This is how an engine drives kvdict_vk: per token and layer it appends the new K/V rows
to the cache and asks the cache for the attention output of the new query. The cache
is anything with ``append(layer, k_rows, v_rows)`` ((n_kv, 1, head_dim) each) and
``attend(layer, q, n_used) -> (n_heads, head_dim)`` — or ``step(layer, k_rows, v_rows, q)``
doing both at once (used when present) — `kvdict_vk.vk.KvArena` in both of
its modes, or :class:`NumpyCache` (the float64 reference).

:class:`ReferenceCheck` runs the reference beside another cache on the decode's own
inputs. That is the exact comparison a decode allows: per-token NLL of two correct
dict-coded decodes need not agree, because the encoder's discrete choices (which atom,
which level) turn the rounding differences of two forward implementations into different
codes for a few vectors, and the NLL then drifts by up to nats per token (measured on
SmolLM2 against the batched forward; docs/DESIGN.md). For the f32 cache the NLL does agree.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .. import attention_ref, codec
from ..dictionary import KvDictArtifact
from ..kivi import cache_rows as kivi_cache_rows
from ..rows import held_rows
from ..window import cache_rows as window_cache_rows
from ..metrics import nmse
from .gguf_model import Model, load_model
from .llama import rms_norm, rope_cos_sin, rotate_pairs, silu


class NumpyCache:
    """Reference cache: what the GPU arena of the same mode must reproduce — f32 rows; or
    (given an artifact) slots decoded in float64, an exact window's tokens in binary16
    (kvdict_vk.window.cache_rows); or (``kivi``, a KiviSpec) the KIVI cache's values
    (kvdict_vk.kivi.cache_rows); or (``rows`` "f16" / "q8_0") the uncoded cache's rows
    (kvdict_vk.rows.held_rows)."""

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, n_ctx: int, art: KvDictArtifact | None = None,
                 kivi=None, rows: str = "f32"):
        self.art, self.n_ctx, self.kivi, self.rows = art, n_ctx, kivi, rows
        self.k = np.zeros((n_layers, n_kv, n_ctx, head_dim), np.float64)
        self.v = np.zeros_like(self.k)
        self.raw = tuple(np.zeros((n_layers, n_kv, n_ctx, head_dim), np.float32) for _ in "kv")  # as appended
        self.n = [0] * n_layers

    def append(self, layer: int, k_rows: np.ndarray, v_rows: np.ndarray) -> int:
        t0, t = self.n[layer], k_rows.shape[1]
        for j, (store, rows) in enumerate(((self.k, k_rows), (self.v, v_rows))):
            d = None if self.art is None else self.art.layers[layer][j]
            self.raw[j][layer, :, t0:t0 + t] = rows
            if d is not None:  # keys coded before RoPE turned at their positions (kvdict_vk.rope)
                rows = codec.held_heads(rows, d, self.art.stream_rope(layer, j == 0), t0)
            elif self.rows != "f32":
                rows = held_rows(rows, self.rows)
            store[layer, :, t0:t0 + t] = rows
        self.n[layer] = t0 + t
        return self.n[layer]

    def held(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) of the layer's tokens as the cache holds them."""
        n = self.n[layer]
        k_raw, v_raw = self.raw[0][layer, :, :n], self.raw[1][layer, :, :n]
        if self.kivi is not None:
            return kivi_cache_rows(k_raw, v_raw, n, self.kivi)
        out = []
        for j, (x, raw) in enumerate(((self.k[layer, :, :n], k_raw), (self.v[layer, :, :n], v_raw))):
            d = None if self.art is None else self.art.layers[layer][j]
            if d is not None and self.art.window:
                x = window_cache_rows(x, raw, self.art.window)
            out.append(x)
        return out[0], out[1]

    def attend(self, layer: int, q: np.ndarray, n_used: int, scale: float | None = None) -> np.ndarray:
        k, v = self.held(layer)
        return attention_ref.attend(q, k, v, n_used, scale)


class ReferenceCheck:
    """An observer for :func:`decode`: every step's K/V rows go into ``reference`` (a
    :class:`NumpyCache` of the same mode) too, and the cache's attention output is
    compared with the reference's over the very same cached vectors: ``worst_nmse`` over
    ``steps`` (layer, token) steps."""

    def __init__(self, reference: NumpyCache):
        self.reference = reference
        self.worst_nmse, self.steps = 0.0, 0

    def __call__(self, layer: int, k_rows: np.ndarray, v_rows: np.ndarray, q: np.ndarray, out: np.ndarray) -> None:
        n_used = self.reference.append(layer, k_rows, v_rows)
        self.worst_nmse = max(self.worst_nmse, nmse(self.reference.attend(layer, q, n_used), out))
        self.steps += 1


@dataclass
class DecodeResult:
    nll: np.ndarray  # (T-1,) float64: −log p(token[t+1] | tokens[:t+1])
    seconds: float  # every token but the first
    tokens: int
    first_token_seconds: float  # includes one-time work (pipeline creation on first use)

    @property
    def tokens_per_s(self) -> float:
        """Steady-state decode speed (the first token excluded)."""
        n = self.tokens - 1
        return n / self.seconds if self.seconds > 0 else float("inf")


def decode(tokens, cache, model: Model | None = None, progress=None, observe=None) -> DecodeResult:
    """Teacher-forced decode: feed tokens one at a time through `cache`, score each next token.
    ``observe(layer, k_rows, v_rows, q, out)``, when given, sees every step's inputs and the
    cache's output (e.g. a :class:`ReferenceCheck`); its time is left out of the result's."""
    m = model or load_model()
    c = m.config
    tokens = np.asarray(tokens, np.int64)
    cos, sin = rope_cos_sin(np.arange(len(tokens)), c.rope_theta, c.rope_dim)
    nll = np.empty(len(tokens) - 1)
    fused = hasattr(cache, "step")
    t_start = time.perf_counter()
    t_first = 0.0
    observed = [0.0, 0.0]  # the observer's seconds during the first token, and after it
    for pos, tok in enumerate(tokens):
        if pos == 1:
            t_first = time.perf_counter() - t_start
        x = m.tok_embd[tok].astype(np.float32)
        cs, sn = cos[pos:pos + 1], sin[pos:pos + 1]
        for i, w in enumerate(m.layers):
            h = rms_norm(x, w.attn_norm, c.rms_eps)
            q = rotate_pairs((w.wq @ h).reshape(c.n_heads, 1, c.head_dim), cs, sn)[:, 0]
            k = rotate_pairs((w.wk @ h).reshape(c.n_kv_heads, 1, c.head_dim), cs, sn)
            v = (w.wv @ h).reshape(c.n_kv_heads, 1, c.head_dim)
            k32, v32, q32 = (np.ascontiguousarray(a, np.float32) for a in (k, v, q))
            if fused:  # append + attend in one submission (KvArena.step)
                o = np.asarray(cache.step(i, k32, v32, q32), np.float32)
            else:
                cache.append(i, k32, v32)
                o = np.asarray(cache.attend(i, q32, pos + 1), np.float32)
            if observe:
                t_obs = time.perf_counter()
                observe(i, k32, v32, q32, o)
                observed[pos > 0] += time.perf_counter() - t_obs
            x = x + w.wo @ o.reshape(-1)
            h = rms_norm(x, w.ffn_norm, c.rms_eps)
            x = x + w.w_down @ (silu(w.w_gate @ h) * (w.w_up @ h))
        if pos + 1 < len(tokens):
            logits = (m.output @ rms_norm(x, m.output_norm, c.rms_eps)).astype(np.float64)
            top = logits.max()
            nll[pos] = top + np.log(np.exp(logits - top).sum()) - logits[tokens[pos + 1]]
        if progress:
            progress(pos)
    total = time.perf_counter() - t_start
    return DecodeResult(nll, total - t_first - observed[1], len(tokens), max(0.0, t_first - observed[0]))
