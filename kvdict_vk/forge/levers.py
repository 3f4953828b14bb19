"""Dictionary rows of the fidelity table beyond the certified artifact: the same learned
dictionaries with a lever an engine does not implement today, each measured in the forge
(CPU path) — what each lever buys is a row, its cost in bytes is charged honestly.

* group scales: the residual's per-channel scale per 32-token group (residual_only), +4 B.
* sink + recent window: token 0 and the 32 most recent tokens kept in binary16 (the rest
  through the engine's own reconstruct-on-write), charged at the gate's window length — the
  certified path's window (pipeline.RuntimeHook), offered as a row when the artifact has none.

An artifact with its own exact window keeps it in every row here (names and bytes too).
"""
from __future__ import annotations

from ..window import ExactWindow
from . import pipeline as P
from . import residual_only as R
from . import table

RECENT = 32
WINDOW = ExactWindow(1, RECENT)  # the lever row's window


def dictionary_row_names(cfg: P.ForgeConfig) -> list[str]:
    """The names of dictionary_rows' rows, known before anything is learned."""
    base = P.dict_row_name(cfg)
    return [base + " + group scales"] + ([] if cfg.exact_window() else [base + f" + sink + {RECENT} recent"])


def dictionary_rows(art, cfg: P.ForgeConfig, coded_bytes: float) -> list:
    """The lever rows of ``art`` (learned with ``cfg``); ``coded_bytes``: its slot's bytes per
    head vector (pipeline.bytes_per_vector), each row's window charged on top."""
    ident = table.digest(*[a for pair in art.layers for d in pair if d is not None
                           for a in (d.atoms, d.mean, d.residual_scale)])
    names = dictionary_row_names(cfg)
    hd, context = art.head_dim, cfg.gate_window()

    def grouped_hook():
        hook = R.GroupScaleDictHook(art)
        hook.exact_sink, hook.exact_recent = art.window.sink, art.window.recent
        return hook

    rows = [table.Row(names[0], "dictionary", P.windowed_bytes(coded_bytes + 2 * hd / R.GROUP, context, hd, art.window),
                      grouped_hook, ident, "lever: per-32-token residual scales (not in the slot format)")]
    if len(names) > 1:
        rows.append(table.Row(names[1], "dictionary", P.windowed_bytes(coded_bytes, context, hd, WINDOW),
                              lambda: Installed(art, P.RuntimeHook(WINDOW)), ident,
                              "lever: token 0 and the 32 most recent tokens in binary16"))
    return rows


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
