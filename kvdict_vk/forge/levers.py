"""Dictionary rows of the fidelity table beyond the certified artifact: the same learned
dictionaries with a lever an engine does not implement today, each measured in the forge
(CPU path) — what each lever buys is a row, its cost in bytes is charged honestly.

* group scales: the residual's per-channel scale per 32-token group (residual_only), +4 B.
* sink + recent window: token 0 and the 32 most recent tokens kept in binary16 (the rest
  through the engine's own reconstruct-on-write), charged at the gate's window length.
"""
from __future__ import annotations

from . import pipeline as P
from . import residual_only as R
from . import table

RECENT = 32


class WindowedRuntimeHook(P.RuntimeHook):
    exact_sink = 1
    exact_recent = RECENT


def _windowed_bytes(coded: float, context: int, head_dim: int) -> float:
    exact = 1 + RECENT
    return ((context - exact) * coded + exact * 2 * head_dim) / context


def dictionary_row_names(cfg: P.ForgeConfig) -> list[str]:
    """The names of dictionary_rows' rows, known before anything is learned."""
    base = P.dict_row_name(cfg)
    return [base + " + group scales", base + f" + sink + {RECENT} recent"]


def dictionary_rows(art, cfg: P.ForgeConfig, coded_bytes: float) -> list:
    ident = table.digest(*[a for pair in art.layers for d in pair if d is not None
                           for a in (d.atoms, d.mean, d.residual_scale)])
    grouped, windowed = dictionary_row_names(cfg)
    hd = art.head_dim
    return [
        table.Row(grouped, "dictionary", coded_bytes + 2 * hd / R.GROUP,
                  lambda: R.GroupScaleDictHook(art), ident, "lever: per-32-token residual scales (not in the slot format)"),
        table.Row(windowed, "dictionary", _windowed_bytes(coded_bytes, cfg.gate_window(), hd),
                  lambda: Installed(art, WindowedRuntimeHook()), ident,
                  "lever: token 0 and the 32 most recent tokens in binary16 (engine has no such window)"),
    ]


class Installed(P.llama.KVHook):
    """Runs `inner` (a RuntimeHook) with `art` installed for the duration of each call."""

    def __init__(self, art, inner):
        self.art, self.inner = art, inner
        self.exact_sink, self.exact_recent, self.exact_group = inner.exact_sink, inner.exact_recent, inner.exact_group

    def __call__(self, layer, k, v):
        from .. import runtime
        with runtime.enabled_with(self.art, allow_uncertified=True):
            return self.inner(layer, k, v)


def residual_stats(kv: list) -> list:
    return R.learn_means_scales(kv)
