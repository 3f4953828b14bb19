"""The forward wing's dispatch arithmetic: which words each fwd_* dispatch touches for given
push constants (registered with kvdict_vk.vk.shaders when this module is imported)."""
from __future__ import annotations

from ... import errors as E
from ... import layout as L
from ... import kivi as K
from ... import rows as R
from ..extents import kivi_layer_ranges
from .. import shaders
from .weights import BLOCK, BLOCK_WORDS, FORMATS

_WORDS_BY_FORMAT = {FORMATS[f]: BLOCK_WORDS[f] for f in FORMATS}


def _row_words(p, s, what: str) -> int:
    if s["FORMAT"] not in _WORDS_BY_FORMAT or p["n_cols"] < BLOCK or p["n_cols"] % BLOCK or p["n_rows"] < 1:
        raise E.DispatchError(f"{what}: {p['n_rows']} rows of {p['n_cols']} columns in format {s['FORMAT']}: "
                              f"columns a multiple of {BLOCK}, formats {sorted(_WORDS_BY_FORMAT)}")
    return p["n_cols"] // BLOCK * _WORDS_BY_FORMAT[s["FORMAT"]]


X_MODES = {"plain": 0, "rms_norm": 1, "swiglu": 2}  # matvec.glsl's X_*


def _seqs(p, what: str) -> int:
    """The push's n_seqs (a caller of the extents alone may leave it out: one)."""
    seqs = p.get("n_seqs", 1)
    if seqs < 1:
        raise E.DispatchError(f"{what}: a batch of {seqs} sequences")
    return seqs


def _batched(word: int, n: int, seqs: int, stride: int) -> tuple:
    """The span covering [word, word + n) of each of ``seqs`` sequences ``stride`` words apart."""
    return word, word + (seqs - 1) * stride + n


def _x_span(p, s, what: str, x_seq_words: int) -> tuple:
    """The words x' reads (SwiGLU: the gate and the up, n_cols each; each sequence's, x_seq_words
    apart) and the norm's weights."""
    if s["X_MODE"] not in X_MODES.values():
        raise E.DispatchError(f"{what}: X_MODE {s['X_MODE']} (have {X_MODES})")
    n = p["n_cols"] * (2 if s["X_MODE"] == X_MODES["swiglu"] else 1)
    norm = [(p["norm_word"], p["norm_word"] + p["n_cols"])] if s["X_MODE"] == X_MODES["rms_norm"] else []
    return [_batched(p["x_word"], n, _seqs(p, what), x_seq_words)], norm


def _rows_spec(s, what: str) -> None:
    if s["ROW_THREADS"] not in (1, 2, 4, 8, 16, 32, 64):
        raise E.DispatchError(f"{what}: ROW_THREADS {s['ROW_THREADS']} is not a power of two up to 64")


MAX_SEQ_TILE = 8  # fwd_matvec's and fwd_qkv's SEQ_TILE: an accumulator a sequence, held by every invocation


def _tile_spec(s, what: str) -> int:
    """The specialization's SEQ_TILE (a caller of the extents alone may leave it out: one)."""
    tile = s.get("SEQ_TILE", 1)
    if not 1 <= tile <= MAX_SEQ_TILE:
        raise E.DispatchError(f"{what}: SEQ_TILE {tile} outside 1..{MAX_SEQ_TILE}")
    return tile


def _matvec(p, s):
    _rows_spec(s, "fwd_matvec")
    _tile_spec(s, "fwd_matvec")
    w = _row_words(p, s, "fwd_matvec")
    x, norm = _x_span(p, s, "fwd_matvec", p["x_seq_words"])
    return ([(p["w_word"], p["w_word"] + p["n_rows"] * w), *norm], x,
            [_batched(p["y_word"], p["n_rows"], _seqs(p, "fwd_matvec"), p["y_seq_words"])])


def _qkv(p, s):
    _rows_spec(s, "fwd_qkv")
    if s["ROW_THREADS"] > 32 or s["X_MODE"] != X_MODES["rms_norm"]:
        raise E.DispatchError("fwd_qkv: ROW_THREADS ≤ 32 (a rotated pair's rows in one workgroup), X_MODE rms_norm")
    hd, rd, q, k = p["head_dim"], p["rope_dim"], p["q_rows"], p["k_rows"]
    if rd % 2 or not 2 <= rd <= hd or q < 1 or k < 1 or q % hd or k % hd or p["n_pos"] < 1:
        raise E.DispatchError(f"fwd_qkv: push constants {p} are inconsistent")
    w = _row_words({**p, "n_rows": q + 2 * k}, s, "fwd_qkv")
    x, norm = _x_span(p, s, "fwd_qkv", p["n_cols"])
    n_kv, rw, seqs = k // hd, p["row_words"], _seqs(p, "fwd_qkv")
    tile = _tile_spec(s, "fwd_qkv")
    if rw and (seqs != 1 or tile != 1):
        raise E.DispatchError(f"fwd_qkv: a batch of {seqs} sequences (SEQ_TILE {tile}) writes the step's rows, "
                              f"not a layer's")
    # the formats fwd_qkv writes
    fmt = next((n for n, f in R.QKV_FORMATS.items() if f == p["row_format"]), None) if rw else None
    stored = (K.key_row_words(hd, s["K_BITS"]) if fmt == "kivi" else
              L.row_words(hd, 0, 0, {"words": "f32"}.get(fmt, fmt)) if fmt else None)
    through_rows = fmt in R.QKV_THROUGH_ROWS  # the source rows read back by the workgroup completing a unit
    if rw and (stored != rw or p["n_ctx"] < p["n_pos"] or (through_rows and (hd % 32 or q % 32))
               or (fmt == "kivi" and (s["HEAD_DIM"] != hd or not K.MIN_BITS <= min(s["K_BITS"], s["V_BITS"])
                                      or max(s["K_BITS"], s["V_BITS"]) > K.MAX_BITS))):
        raise E.DispatchError(f"fwd_qkv: rows of {rw} words in format {p['row_format']} over {p['n_ctx']} rows a "
                              f"KV head (f32, f16 or q8_0 rows or a KIVI layer of head_dim {hd} — q8_0, KIVI: "
                              f"head_dim and the query rows {q} multiples of 32 —, n_ctx ≥ {p['n_pos']}; "
                              f"specialization {s})")
    # appending: the token's row of each KV head, wherever the position puts it (the regions); else the source
    # rows — and for q8_0 blocks and KIVI both, and the units' arrival words
    if fmt == "kivi":
        layer = kivi_layer_ranges(p["k_layer_word"], p["v_layer_word"], p, s, n_kv, p["n_ctx"])
    else:
        layer = [(p[w_], p[w_] + n_kv * p["n_ctx"] * rw) for w_ in ("k_layer_word", "v_layer_word")] if rw else []
    rows = [] if rw and not through_rows else [_batched(p[w_], k, seqs, k) for w_ in ("k_word", "v_word")]
    if through_rows:
        rows.append((p["arrival_word"], p["arrival_word"] + R.qkv_arrival_words(n_kv, hd)))
    if p["k_pre_word"]:  # the keys before RoPE too (a layer coding them so)
        if rw:
            raise E.DispatchError("fwd_qkv: keys before RoPE go to the source rows, not a rows layer")
        rows.append(_batched(p["k_pre_word"], k, seqs, k))
    return ([(p["w_word"], p["w_word"] + (q + 2 * k) * w), *norm], x, [_batched(p["y_word"], q, seqs, q)], rows,
            [(0, p["n_pos"] * rd)], [(p["pos_word"], p["pos_word"] + seqs)], layer)


def _embed(p, s):
    w, seqs = _row_words(p, s, "fwd_embed"), _seqs(p, "fwd_embed")
    return ([(p["w_word"], p["w_word"] + p["n_rows"] * w)], [(p["token_word"], p["token_word"] + seqs)],
            [(p["y_word"], p["y_word"] + seqs * p["n_cols"])])


def _argmax(p, s):
    if p["n"] < 1 or p["parts"] < 1 or p["stage"] not in (0, 1):
        raise E.DispatchError(f"fwd_argmax: push constants {p} are inconsistent")
    seqs = _seqs(p, "fwd_argmax")
    x = [(p["x_word"], p["x_word"] + seqs * p["n"])] if p["stage"] == 0 else []
    return x, [(0, 2 * p["parts"] * seqs)], ([(p["out_word"], p["out_word"] + seqs)] if p["stage"] == 1 else [])


EXTENTS = {"fwd_matvec": _matvec, "fwd_matvec_sg": _matvec, "fwd_qkv": _qkv, "fwd_qkv_sg": _qkv,
           "fwd_embed": _embed, "fwd_argmax": _argmax}

shaders.register(EXTENTS)
