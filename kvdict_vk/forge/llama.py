"""NumPy llama forward (prefill of one window, causal, float32) with a pluggable KV hook.

RoPE layout: we keep the GGUF weights as they are, whose ``attn_q``/``attn_k`` rows
llama.cpp's converter permuted so that RoPE rotates *adjacent* pairs (2i, 2i+1). Every
key handed to a hook is therefore in that layout; ``apply_rope``/``unapply_rope`` use it
too. (Un-permuting the weights + HF rotate-half is equivalent; mixing the two is not.)

The hook sees all K/V of the window before attention reads them. That is exactly what a
token-by-token decode with reconstruct-on-write sees: each token's K/V is written to the
cache (coded) and read back (reconstructed), its own entry included.
"""

from __future__ import annotations

import functools

import numpy as np

from ..model_file import rope_cos_sin  # noqa: F401 (the forward, decode and levers use it from here)
from .gguf_model import Model, load_model


class KVHook:
    """Identity hook; subclass and override to code/reconstruct the KV cache.

    A cache that keeps some tokens in full precision (binary16) — the first ``exact_sink``
    tokens, and the recent ones: token j stays exact for the query at t while its group of
    ``exact_group`` tokens (aligned at multiples of it) ends after t − ``exact_recent`` —
    sets those attributes; attention then reads, per (query, key), the exact or the coded
    vector, which is what a decode with such a window sees at every step.
    """

    exact_sink = 0
    exact_recent = 0
    exact_group = 1

    def keys_pre_rope(self, layer: int, k: np.ndarray) -> np.ndarray:
        """k: (n_kv, T, head_dim) before RoPE."""
        return k

    def queries(self, layer: int, q: np.ndarray) -> None:
        """Sees q: (n_heads, T, head_dim) after RoPE, as attention will read it."""

    def __call__(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """k after RoPE and v, both (n_kv, T, head_dim)."""
        return k, v


def rotate_pairs(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x (..., T, head_dim) with its adjacent pairs rotated by rope_cos_sin's tables (dims past
    2 · cos.shape[-1] unrotated); -sin rotates back."""
    x = np.asarray(x, dtype=np.float32)
    dim = 2 * cos.shape[-1]
    even, odd = x[..., 0:dim:2], x[..., 1:dim:2]
    out = np.array(x, dtype=np.float32, copy=True)  # dims past rope_dim stay unrotated
    out[..., 0:dim:2] = even * cos - odd * sin
    out[..., 1:dim:2] = even * sin + odd * cos
    return out


def apply_rope(x: np.ndarray, positions, theta: float, rope_dim: int | None = None) -> np.ndarray:
    """Adjacent-pair RoPE of x (..., T, head_dim) at the given positions (T,)."""
    cos, sin = rope_cos_sin(positions, theta, rope_dim or x.shape[-1])
    return rotate_pairs(x, cos, sin)


def unapply_rope(x: np.ndarray, positions, theta: float, rope_dim: int | None = None) -> np.ndarray:
    """Inverse of ``apply_rope`` (rotation by the opposite angle)."""
    cos, sin = rope_cos_sin(positions, theta, rope_dim or x.shape[-1])
    return rotate_pairs(x, cos, -sin)


def rotate_half_order(head_dim: int) -> np.ndarray:
    """Index p with ``x_hf = x_gguf[..., p]`` (and ``x_gguf = x_hf[..., argsort(p)]``).

    The converter's permutation: HF rotate-half dim ``j*head_dim/2 + i`` is GGUF dim
    ``2i + j``. Dictionaries don't care (a permutation is orthogonal), but block
    quantisers do: their 32-element blocks group different dims in each order.
    """
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    return x * (1.0 / np.sqrt(ms + np.float32(eps))) * weight


@functools.lru_cache(maxsize=4)
def _causal_mask(T: int) -> np.ndarray:
    """Additive mask: 0 on and below the diagonal, -inf above (future tokens)."""
    mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
    mask.setflags(write=False)
    return mask


def exact_mask(hook: KVHook, rows: np.ndarray, T: int) -> np.ndarray:
    """(len(rows), T) bool: which keys the query at each row reads in full precision."""
    j = np.arange(T)
    group_end = (j // hook.exact_group) * hook.exact_group + hook.exact_group - 1
    recent = group_end[None, :] > rows[:, None] - hook.exact_recent if hook.exact_recent else False
    return (j[None, :] < hook.exact_sink) | recent


def _causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, block: int = 256,
                      exact=None) -> np.ndarray:
    """q (n_heads, T, d); k, v (n_kv, T, d) -> (T, n_heads*d).

    GQA: query head h reads KV head h // group (llama.cpp's mapping); the queries of a
    group are stacked so each KV head takes one matmul. Queries go in blocks that only
    score the keys they can see, which skips ~40 % of the causal triangle's wasted work.
    ``exact`` = (hook, k_exact, v_exact): per (query, key) the exact vectors replace the
    coded ones where ``exact_mask`` says so.
    """
    n_heads, T, d = q.shape
    n_kv = k.shape[0]
    if n_heads % n_kv:
        raise ValueError(f"{n_heads} query heads cannot share {n_kv} KV heads evenly")
    group = n_heads // n_kv
    qg = q.reshape(n_kv, group, T, d) * np.float32(1.0 / np.sqrt(d))
    mask = _causal_mask(T)
    out = np.empty((n_kv, group, T, d), dtype=np.float32)
    for s in range(0, T, block):
        e = min(T, s + block)
        rows = group * (e - s)
        scores = qg[:, :, s:e].reshape(n_kv, rows, d) @ k[:, :e].transpose(0, 2, 1)
        scores = scores.reshape(n_kv, group, e - s, e)
        if exact is not None:
            hook, k_x, v_x = exact
            keep = exact_mask(hook, np.arange(s, e), e)
            sx = (qg[:, :, s:e].reshape(n_kv, rows, d) @ k_x[:, :e].transpose(0, 2, 1)).reshape(scores.shape)
            scores = np.where(keep, sx, scores)
        scores += mask[s:e, :e]
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        denom = scores.sum(axis=-1, keepdims=True)
        # Normalise the (rows, d) output rather than the (rows, e) probabilities: fewer flops.
        if exact is None:
            ctx = (scores.reshape(n_kv, rows, e) @ v[:, :e]).reshape(n_kv, group, e - s, d)
        else:
            p_x = np.where(keep, scores, 0).reshape(n_kv, rows, e)
            p_c = np.where(keep, 0, scores).reshape(n_kv, rows, e)
            ctx = (p_x @ v_x[:, :e] + p_c @ v[:, :e]).reshape(n_kv, group, e - s, d)
        out[:, :, s:e] = ctx / denom
    return out.reshape(n_heads, T, d).transpose(1, 0, 2).reshape(T, n_heads * d)


def f16(x: np.ndarray) -> np.ndarray:
    """Round to binary16 and back as float32: what a stored scale, minimum or mean (or an
    f16 cache's row) is when read again."""
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    """x · sigmoid(x), elementwise (the MLP's gate)."""
    return x / (np.float32(1.0) + np.exp(-x))


def _checked(a: np.ndarray, shape: tuple[int, ...], layer: int) -> np.ndarray:
    """A hook that changes shapes would otherwise broadcast silently inside attention."""
    a = np.asarray(a, dtype=np.float32)
    if a.shape != shape:
        raise ValueError(f"layer {layer}: KV hook returned shape {a.shape}, expected {shape}")
    return a


def final_hidden(tokens, hook: KVHook | None = None, model: Model | None = None) -> np.ndarray:
    """Run the transformer blocks; returns the output-normed hidden states (T, hidden)."""
    m = model or load_model()
    c = m.config
    hook = hook or KVHook()
    tokens = np.asarray(tokens, dtype=np.int64)
    T = tokens.shape[0]
    positions = np.arange(T)
    cos, sin = rope_cos_sin(positions, c.rope_theta, c.rope_dim)
    x = m.tok_embd[tokens]  # (T, hidden) float32, a fresh copy
    kv_shape = (c.n_kv_heads, T, c.head_dim)

    def heads(a: np.ndarray, n: int) -> np.ndarray:  # (T, n*d) -> (n, T, d), contiguous
        return np.ascontiguousarray(a.reshape(T, n, c.head_dim).transpose(1, 0, 2))

    for i, w in enumerate(m.layers):
        h = rms_norm(x, w.attn_norm, c.rms_eps)
        q = rotate_pairs(heads(h @ w.wq.T, c.n_heads), cos, sin)
        hook.queries(i, q)
        k = _checked(hook.keys_pre_rope(i, heads(h @ w.wk.T, c.n_kv_heads)), kv_shape, i)
        k = rotate_pairs(k, cos, sin)
        v = heads(h @ w.wv.T, c.n_kv_heads)
        # The exact tokens are kept as binary16 (what such a cache stores), before the hook.
        exact = (hook, f16(k), f16(v)) if hook.exact_sink or hook.exact_recent else None
        k, v = hook(i, k, v)
        attn = _causal_attention(q, _checked(k, kv_shape, i), _checked(v, kv_shape, i), exact=exact)
        x = x + attn @ w.wo.T
        h = rms_norm(x, w.ffn_norm, c.rms_eps)
        x = x + (silu(h @ w.w_gate.T) * (h @ w.w_up.T)) @ w.w_down.T
    return rms_norm(x, m.output_norm, c.rms_eps)


def forward(tokens, hook: KVHook | None = None, model: Model | None = None) -> np.ndarray:
    """Logits (T, vocab) float32 for a window of tokens starting at position 0."""
    m = model or load_model()
    return final_hidden(tokens, hook, m) @ m.output.T


class _KVRecorder(KVHook):
    def __init__(self):
        self.k_pre: list[np.ndarray] = []
        self.kv: list[tuple[np.ndarray, np.ndarray]] = []
        self.q: list[np.ndarray] = []

    def queries(self, layer, q):
        self.q.append(q.copy())

    def keys_pre_rope(self, layer, k):
        self.k_pre.append(k.copy())
        return k

    def __call__(self, layer, k, v):
        self.kv.append((k.copy(), v.copy()))
        return k, v


def capture_kv(tokens, model: Model | None = None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per layer (K_post_rope, V, K_pre_rope), each (n_kv, T, head_dim) float32."""
    rec = _KVRecorder()
    final_hidden(tokens, rec, model)  # the output projection is not needed
    return [(k, v, kp) for (k, v), kp in zip(rec.kv, rec.k_pre)]


def capture_qkv(tokens, model: Model | None = None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per layer (Q, K, V) after RoPE: Q (n_heads, T, head_dim), K and V (n_kv, T, head_dim),
    float32 — what a decode's attention at each position reads."""
    rec = _KVRecorder()
    final_hidden(tokens, rec, model)
    return [(q, k, v) for q, (k, v) in zip(rec.q, rec.kv)]


def token_nll(tokens, hook: KVHook | None = None, model: Model | None = None,
              chunk: int = 128) -> np.ndarray:
    """-log p(token[t+1] | tokens[:t+1]) for t = 0..T-2, float64, shape (T-1,).

    Logits are formed ``chunk`` rows at a time (in place) so the (T, vocab) matrix never
    exists: peak extra memory is about ``chunk * vocab * 12`` bytes.
    """
    m = model or load_model()
    tokens = np.asarray(tokens, dtype=np.int64)
    h = final_hidden(tokens, hook, m)[:-1]
    targets = tokens[1:]
    nll = np.empty(len(targets), dtype=np.float64)
    for s in range(0, len(targets), chunk):
        logits = (h[s:s + chunk] @ m.output.T).astype(np.float64)
        picked = logits[np.arange(len(logits)), targets[s:s + chunk]]
        top = logits.max(axis=-1, keepdims=True)
        logits -= top
        np.exp(logits, out=logits)
        lse = top[:, 0] + np.log(logits.sum(axis=-1))
        nll[s:s + chunk] = lse - picked
    return nll


def eval_windows(tokens, window: int = 1024, keep_tail: bool = False) -> list[np.ndarray]:
    """Non-overlapping windows of ``window`` tokens.

    The short tail is dropped by default: that is the convention of docs/DESIGN.md's baseline
    (GPL-3: 7 full windows, PPL 19.82; with the 471-token tail as an 8th window, 19.29).
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    windows = [tokens[s:s + window] for s in range(0, len(tokens), window)]
    return [w for w in windows if len(w) == window or (keep_tail and len(w) >= 2)]


def perplexity(token_windows, hook: KVHook | None = None, model: Model | None = None) -> float:
    """exp(mean NLL) over every predicted token of every window (each window from position 0)."""
    nll = np.concatenate([token_nll(w, hook, model) for w in token_windows])
    return float(np.exp(nll.mean()))
