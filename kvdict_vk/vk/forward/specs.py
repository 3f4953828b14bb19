"""The forward wing's dispatch arithmetic: which words each fwd_* dispatch touches for given
push constants (registered with kvdict_vk.vk.shaders when this module is imported)."""
from __future__ import annotations

from ... import errors as E
from .. import shaders
from .weights import BLOCK, BLOCK_WORDS, FORMATS

_WORDS_BY_FORMAT = {FORMATS[f]: BLOCK_WORDS[f] for f in FORMATS}


def _row_words(p, s, what: str) -> int:
    if s["FORMAT"] not in _WORDS_BY_FORMAT or p["n_cols"] < BLOCK or p["n_cols"] % BLOCK or p["n_rows"] < 1:
        raise E.DispatchError(f"{what}: {p['n_rows']} rows of {p['n_cols']} columns in format {s['FORMAT']}: "
                              f"columns a multiple of {BLOCK}, formats {sorted(_WORDS_BY_FORMAT)}")
    return p["n_cols"] // BLOCK * _WORDS_BY_FORMAT[s["FORMAT"]]


def _matvec(p, s):
    w = _row_words(p, s, "fwd_matvec")
    return ([(p["w_word"], p["w_word"] + p["n_rows"] * w)], [(p["x_word"], p["x_word"] + p["n_cols"])],
            [(p["y_word"], p["y_word"] + p["n_rows"])])


def _embed(p, s):
    w = _row_words(p, s, "fwd_embed")
    return ([(p["w_word"], p["w_word"] + p["n_rows"] * w)], [(p["token_word"], p["token_word"] + 1)],
            [(p["y_word"], p["y_word"] + p["n_cols"])])


def _rms_norm(p, s):
    n = p["n"]
    if n < 1:
        raise E.DispatchError("fwd_rms_norm: an empty vector")
    return [(p["w_word"], p["w_word"] + n)], [(p["x_word"], p["x_word"] + n)], [(p["y_word"], p["y_word"] + n)]


def _rope(p, s):
    if p["rope_dim"] % 2 or not 2 <= p["rope_dim"] <= p["head_dim"] or p["n_pos"] < 1:
        raise E.DispatchError(f"fwd_rope: rope_dim {p['rope_dim']} must be even, within head_dim {p['head_dim']}; "
                              f"{p['n_pos']} positions")
    return ([(0, p["n_pos"] * p["rope_dim"])], [(p["pos_word"], p["pos_word"] + 1)],
            [(p["row_word"], p["row_word"] + p["n_rows"] * p["head_dim"])])


def _swiglu(p, s):
    n = p["n"]
    return ([(p[k], p[k] + n) for k in ("g_word", "u_word", "y_word")] if n else [],)


def _argmax(p, s):
    if p["n"] < 1 or p["parts"] < 1 or p["stage"] not in (0, 1):
        raise E.DispatchError(f"fwd_argmax: push constants {p} are inconsistent")
    x = [(p["x_word"], p["x_word"] + p["n"])] if p["stage"] == 0 else []
    return x, [(0, 2 * p["parts"])], ([(p["out_word"], p["out_word"] + 1)] if p["stage"] == 1 else [])


EXTENTS = {"fwd_matvec": _matvec, "fwd_embed": _embed, "fwd_rms_norm": _rms_norm, "fwd_rope": _rope,
           "fwd_swiglu": _swiglu, "fwd_argmax": _argmax}

shaders.register(EXTENTS)
