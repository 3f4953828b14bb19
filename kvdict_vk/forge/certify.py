"""The gate: perplexity with the f32 cache and with a coded cache over the same held-out
windows, as a paired comparison.

ΔPPL (relative) = exp(mean NLL_coded − mean NLL_f32) − 1 over every scored token. Its
95 % interval comes from the per-token paired differences, with the standard error
taken over blocks of 64 consecutive tokens (batch means): neighbouring tokens' errors are
correlated, and pretending otherwise would make the interval several times too narrow.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import numpy as np

from . import llama, parallel

BLOCK = 64


@dataclass
class PairedResult:
    baseline_ppl: float
    coded_ppl: float
    delta_rel: float  # exp(mean δ) − 1
    ci95: tuple[float, float]  # on delta_rel
    eval_tokens: int
    windows: int

    def to_dict(self) -> dict:
        return asdict(self)


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def baseline_nll(windows) -> np.ndarray:
    """Per-token NLL of the f32 cache, concatenated over windows (reuse it across configs).
    BLAS at one thread, as in evaluate: the forward's last bits depend on the thread count."""
    with parallel.blas_threads(1):
        return np.concatenate([llama.token_nll(w) for w in windows])


def paired(base_nll: np.ndarray, coded_nll: np.ndarray, windows: int) -> PairedResult:
    if base_nll.shape != coded_nll.shape:
        raise ValueError("baseline and coded NLL must cover the same tokens")
    diff = coded_nll - base_nll
    n = len(diff)
    m = n // BLOCK
    blocks = diff[: m * BLOCK].reshape(m, BLOCK).mean(1) if m >= 2 else diff
    se = float(np.std(blocks, ddof=1) / np.sqrt(len(blocks))) if len(blocks) > 1 else float("inf")
    mu = float(diff.mean())
    return PairedResult(
        baseline_ppl=float(np.exp(base_nll.mean())), coded_ppl=float(np.exp(coded_nll.mean())),
        delta_rel=float(np.expm1(mu)), ci95=(float(np.expm1(mu - 1.96 * se)), float(np.expm1(mu + 1.96 * se))),
        eval_tokens=n, windows=windows)


def evaluate(windows, hook: llama.KVHook, base_nll: np.ndarray | None = None) -> PairedResult:
    """Paired ΔPPL of `hook`'s cache against the f32 cache on the same windows."""
    if base_nll is None:
        base_nll = baseline_nll(windows)
    # BLAS at one thread: the forward's float32 matmuls round differently at another thread
    # count (measured: 1 vs 2 threads change K's last bits), and OMP's choices then move
    # the coded PPL — the gate's figure would depend on the machine's core count
    with parallel.blas_threads(1):
        coded = np.concatenate([llama.token_nll(w, hook) for w in windows])
    return paired(base_nll, coded, len(windows))
