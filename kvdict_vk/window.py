"""The dictionary cache's exact window: the first ``sink`` tokens and the ``recent`` most
recent ones kept in binary16 beside their slots — the one definition the artifact (payload
``window``, format version 2), the arena (a window block per coded stream,
shaders/read_window.comp) and the forge's certification (forge.llama's exact mask) share.

At n cached tokens, token t is read from the window when t < sink or t ≥ coded_end(n),
else from its slot; for a decode query at position n − 1 that is the forge's per-query rule
(j < exact_sink or j > t − exact_recent). Every token is coded on append all the same, so a
token leaving the window needs no work: its slot is already there.

A KV head's window block holds ``rows`` binary16 rows: token t < sink at row t, a later
token at row sink + (t − sink) mod recent (a ring), so the rows are always the sink tokens
and the last ``recent`` tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import errors as E

MAX_SINK = 256
MAX_RECENT = 4096


@dataclass(frozen=True)
class ExactWindow:
    sink: int = 0
    recent: int = 0

    def __post_init__(self):
        for name, hi in (("sink", MAX_SINK), ("recent", MAX_RECENT)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v <= hi:
                raise E.DimsError(f"window {name} must be an integer in 0..{hi}, got {v!r}")
            object.__setattr__(self, name, int(v))

    def __bool__(self) -> bool:
        return self.rows > 0

    @property
    def rows(self) -> int:
        """Binary16 rows a KV head's window block holds."""
        return self.sink + self.recent

    def coded_end(self, n: int) -> int:
        """At n cached tokens, tokens [sink, coded_end(n)) are read from their slots."""
        return max(self.sink, n - self.recent)

    def exact(self, n: int, t0: int = 0) -> np.ndarray:
        """Bool mask over tokens [t0, n) of a cache of n tokens: read from the window."""
        t = np.arange(t0, n)
        return (t < self.sink) | (t >= self.coded_end(n))

    def row_of(self, t):
        """The window row of token t (it must be in the window: a sink or a recent token)."""
        t = np.asarray(t)
        if self.recent == 0:
            return t
        return np.where(t < self.sink, t, self.sink + (t - self.sink) % self.recent)

    def describe(self) -> str:
        return f"sink {self.sink} + {self.recent} recent" if self else "none"


NO_WINDOW = ExactWindow()


def cache_rows(coded: np.ndarray, rows: np.ndarray, window: ExactWindow) -> np.ndarray:
    """What a windowed dictionary cache holds for tokens [0, n): ``coded`` (n_kv, n, head_dim),
    the slots' reconstruction, with the window's tokens replaced by ``rows`` (n_kv, ≥ n,
    head_dim) rounded to binary16 — the reference every read and attention of such a cache
    equals (kvdict_vk.kivi.cache_rows' shapes), in ``coded``'s precision (float32 at least)."""
    out = np.array(coded, np.result_type(coded, np.float32), copy=True)
    exact = window.exact(out.shape[1])
    out[:, exact] = np.asarray(rows[:, :out.shape[1]], np.float32)[:, exact].astype(np.float16)
    return out
