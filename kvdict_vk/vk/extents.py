"""The words each dispatch of the arena's own shaders touches — reconstruct, copy_rows, copy,
scatter, append_step, append_window, l2_flush, read_rows_*, read_window, rope_rows — for given push
constants and specialization constants.

Each extents function maps (push dict, spec dict) to, per binding, a list of spans (first
word, one past the last); kernels.Kernel.op refuses a dispatch whose spans leave a buffer
(DispatchError). The declarations these go with (bindings, push blocks, specialization
constants) are kvdict_vk/vk/abi.py's; kvdict_vk/vk/shaders.py joins them. The attention and
encoder shaders' extents live beside their arithmetic (attend/specs.py, encode/specs.py, forward/specs.py).
"""
from __future__ import annotations

from .. import errors as E
from .. import kivi as K
from .. import layout as L
from ..residual import slot_words
from ..rows import APPEND_FORMATS

Span = tuple  # (first word, one past the last word) touched in one binding; each binding
# gets a list of spans (empty: untouched)


def _rows_extents(p, row_words: int) -> Span:
    """Words of a region read for rows (h, t0 .. t0+n_tok) of every head."""
    n_kv = p["n_rows"] // p["n_tok"]
    lo = p["src_word"] + p["t0"] * row_words
    hi = p["src_word"] + ((n_kv - 1) * p["n_ctx"] + p["t0"] + p["n_tok"]) * row_words
    return lo, hi


def _check_rows(p) -> None:
    if p["n_rows"] and (p["n_tok"] < 1 or p["n_rows"] % p["n_tok"] or p["t0"] + p["n_tok"] > p["n_ctx"]):
        raise E.DispatchError(f"row range n_rows={p['n_rows']} n_tok={p['n_tok']} t0={p['t0']} "
                              f"n_ctx={p['n_ctx']} is inconsistent")


def _reconstruct_extents(p, s, lanes: int):
    _check_rows(p)
    hd, bits = s["HEAD_DIM"], s["RES_BITS"]
    if p["n_atoms"] < 1:
        raise E.DispatchError("n_atoms must be ≥ 1 (out-of-range codes read atom 0)")
    if not p["n_rows"]:
        return [], [], [], []
    last = p["n_rows"] // p["n_tok"] - 1  # the last KV head read: strides × last
    atom_words = p["n_atoms"] * hd // (2 if s["ATOMS_F16"] else 1)
    atoms = (p["atoms_word"], p["atoms_word"] + last * p["head_atoms"] + atom_words)
    elems = [] if s["ATOMS_F16"] else [atoms]
    elems.append((p["mean_word"], p["mean_word"] + last * p["head_vec"] + hd))
    if bits:
        elems.append((p["scale_word"], p["scale_word"] + last * p["head_vec"] + hd))
    halves = []
    if s["ATOMS_F16"]:
        if lanes != 4 or hd % L.ATOMS_F16_ELEMS:
            raise E.DispatchError(f"binary16 atoms are gathered a quad (8 halves) at a time: the vec4 variant "
                                  f"with head_dim % {L.ATOMS_F16_ELEMS} == 0 (head_dim {hd}, "
                                  f"{'vec4' if lanes == 4 else 'scalar'} variant)")
        halves.append(atoms)
    return ([_rows_extents(p, slot_words(hd, s["SPARSITY"], bits))], elems,
            [(p["out_word"], p["out_word"] + p["n_rows"] * hd)], halves)


def _copy_rows_extents(p, s):
    _check_rows(p)
    if not p["n_rows"]:
        return [], []
    hd = s["HEAD_DIM"]
    return [_rows_extents(p, hd)], [(p["out_word"], p["out_word"] + p["n_rows"] * hd)]


def _scatter_extents(p, s):
    n, rw, gr = p["n_words"], p["row_words"], p["group_rows"]
    if not n:
        return [], []
    if rw < 1 or gr < 1 or n % rw:
        raise E.DispatchError(f"scatter: n_words {n} is not whole rows of {rw} words (group_rows {gr})")
    rows = n // rw
    if rows > gr and p["group_stride"] < gr * rw:
        raise E.DispatchError(f"scatter: group_stride {p['group_stride']} < {gr}×{rw}: groups overlap")
    last = rows - 1
    g, i = divmod(last, gr)
    return [(p["src_word"], p["src_word"] + n)], [(p["dst_word"], p["dst_word"] + g * p["group_stride"] + (i + 1) * rw)]


def _append_step_extents(p, s):
    """append_step: the step's K and V words; each sequence's n_used word; anywhere in the K
    and V regions' rows of the n_seqs sequences (the row is read on the device)."""
    n_kv, n_seqs, n_ctx, rows = p["n_kv"], p["n_seqs"], p["n_ctx"], p["seq_rows"]
    if n_kv < 1 or n_seqs < 1 or rows < 1 or n_seqs * rows > n_ctx or p["k_row_words"] < 1 or p["v_row_words"] < 1:
        raise E.DispatchError(f"append_step: push constants {p} are inconsistent")
    src_words = {}
    for key in ("k", "v"):  # a source row: the stored words, or head_dim floats converted on the device
        fmt, words = p[f"{key}_format"], p[f"{key}_row_words"]
        hd = p["head_dim"]
        fits = {"words": True, "f16": hd % 2 == 0, "q8_0": hd > 0 and hd % L.Q8_BLOCK == 0}
        name = next((n for n, f in APPEND_FORMATS.items() if f == fmt), None)
        stored = words if name == "words" else L.row_words(hd, 0, 0, rows=name) if name and fits[name] else None
        if stored != words:  # an unknown format, or rows that are not head_dim's words
            raise E.DispatchError(f"append_step: push constants {p} are inconsistent")
        src_words[key] = words if fmt == APPEND_FORMATS["words"] else p["head_dim"]
    k_n, v_n = n_seqs * n_kv * src_words["k"], n_seqs * n_kv * src_words["v"]
    last = (n_kv - 1) * n_ctx + n_seqs * rows  # one past the last row written in a region
    return ([(p["k_src_word"], p["k_src_word"] + k_n), (p["v_src_word"], p["v_src_word"] + v_n)],
            [(p["lengths_word"], p["lengths_word"] + n_seqs)],
            [(p["k_word"], p["k_word"] + last * p["k_row_words"]), (p["v_word"], p["v_word"] + last * p["v_row_words"])])


def _append_kivi_extents(p, s):
    """append_kivi: the step's K and V rows; the n_used word; the K and V regions, the key
    statistics, both rings and the state word (written where the device says)."""
    hd, kb, vb, n_kv, n_ctx, n_seqs = s["HEAD_DIM"], s["K_BITS"], s["V_BITS"], p["n_kv"], p["n_ctx"], p["n_seqs"]
    ok = (n_kv >= 1 and n_ctx >= 1 and hd % K.GROUP == 0 and K.MIN_BITS <= kb <= K.MAX_BITS
          and K.MIN_BITS <= vb <= K.MAX_BITS and 1 <= p["seq_rows"] and n_ctx % p["seq_rows"] == 0
          and 1 <= n_seqs <= n_ctx // p["seq_rows"])
    if not ok:
        raise E.DispatchError(f"append_kivi: push constants {p} / specialization {s} are inconsistent")
    src = n_seqs * n_kv * hd
    return ([(p["k_src_word"], p["k_src_word"] + src), (p["v_src_word"], p["v_src_word"] + src)],
            [(p["lengths_word"], p["lengths_word"] + n_seqs)],
            kivi_layer_ranges(p["k_word"], p["v_word"], p, s, n_kv, n_ctx, n_ctx // p["seq_rows"]))


def kivi_layer_ranges(k_word: int, v_word: int, p, s, n_kv: int, n_ctx: int, seqs: int = 1) -> list:
    """The words a KIVI layer's append may write (shaders/kivi_append.glsl): the K and V regions
    (from k_word, v_word; n_ctx rows a KV head), the key statistics, both rings and the state
    words of its ``seqs`` sequences (p's stats_word, k/v_window_word, recent, state_word; s's
    HEAD_DIM, K_BITS, V_BITS)."""
    hd, kb, vb = s["HEAD_DIM"], s["K_BITS"], s["V_BITS"]
    rows, window = n_kv * n_ctx, K.KiviSpec(kb, vb, p["recent"]).window
    return [(k_word, k_word + rows * K.key_row_words(hd, kb)), (v_word, v_word + rows * K.value_row_words(hd, vb)),
            (p["stats_word"], p["stats_word"] + K.stats_words(n_kv, n_ctx, seqs, hd)),
            (p["k_window_word"], p["k_window_word"] + K.window_words(n_kv, seqs, window, hd)),
            (p["v_window_word"], p["v_window_word"] + K.window_words(n_kv, seqs, window, hd)),
            (p["state_word"], p["state_word"] + seqs)]


def _append_window_extents(p, s):
    """append_window: the token's K and V float rows; its n_used word; both windows; the state word."""
    n_kv, hd, rows = p["n_kv"], p["head_dim"], p["rows"]
    if n_kv < 1 or hd < 2 or hd % 2 or rows != p["sink"] + p["recent"] or rows < 1:
        raise E.DispatchError(f"append_window: push constants {p} are inconsistent")
    block = n_kv * rows * hd // 2
    return ([(p["k_rows_word"], p["k_rows_word"] + n_kv * hd), (p["v_rows_word"], p["v_rows_word"] + n_kv * hd)],
            [(p["lengths_word"], p["lengths_word"] + 1)],
            [(p["k_window_word"], p["k_window_word"] + block), (p["v_window_word"], p["v_window_word"] + block),
             (p["state_word"], p["state_word"] + 1)])


def _read_f16_extents(p, s):
    _check_rows(p)
    if not p["n_rows"]:
        return [], []
    hd = s["HEAD_DIM"]
    if hd % 2:
        raise E.DispatchError(f"read_rows_f16: HEAD_DIM {hd} is odd")
    return [_rows_extents(p, hd // 2)], [(p["out_word"], p["out_word"] + p["n_rows"] * hd)]


def _read_q8_extents(p, s):
    _check_rows(p)
    if not p["n_rows"]:
        return [], []
    hd = s["HEAD_DIM"]
    if hd % L.Q8_BLOCK:
        raise E.DispatchError(f"read_rows_q8: HEAD_DIM {hd} is not whole q8_0 blocks")
    return [_rows_extents(p, L.row_words(hd, 0, 0, "q8_0"))], [(p["out_word"], p["out_word"] + p["n_rows"] * hd)]


def _read_kivi_extents(p, s):
    _check_rows(p)
    hd, bits, keys = s["HEAD_DIM"], s["BITS"], s["KEYS"]
    if s["GROUP"] != K.GROUP or hd % K.GROUP or not K.MIN_BITS <= bits <= K.MAX_BITS or keys not in (0, 1) \
            or p["window"] < 1:
        raise E.DispatchError(f"read_rows_kivi: HEAD_DIM {hd}, BITS {bits}, KEYS {keys}, GROUP {s['GROUP']}, "
                              f"window {p['window']}")
    seq_ctx = p["seq_ctx"]
    if not 1 <= seq_ctx <= p["n_ctx"] or p["n_ctx"] % seq_ctx:
        raise E.DispatchError(f"read_rows_kivi: n_ctx {p['n_ctx']} is not whole sequences of {seq_ctx}")
    seqs = p["n_ctx"] // seq_ctx
    reads = [(p["state_word"], p["state_word"] + seqs)]
    if p["n_rows"]:
        n_kv = p["n_rows"] // p["n_tok"]
        row = K.key_row_words(hd, bits) if keys else K.value_row_words(hd, bits)
        reads += [_rows_extents(p, row), (p["window_word"], p["window_word"] + K.window_words(n_kv, seqs, p["window"], hd))]
        if keys:
            reads.append((p["stats_word"], p["stats_word"] + K.stats_words(n_kv, p["n_ctx"], seqs, hd)))
    return reads, [(p["out_word"], p["out_word"] + p["n_rows"] * hd)] if p["n_rows"] else []


def _read_window_extents(p, s):
    hd, rows = s["HEAD_DIM"], p["rows"]
    if hd % 2 or p["out_word"] % 2 or rows != p["sink"] + p["recent"] or rows < 1:
        raise E.DispatchError(f"read_window: HEAD_DIM {hd}, out_word {p['out_word']}, rows {rows}, "
                              f"sink {p['sink']}, recent {p['recent']}")
    reads = [(p["state_word"], p["state_word"] + 1)]
    if not (p["n_kv"] and p["n_tok"]):
        return reads, []
    reads.append((p["window_word"], p["window_word"] + p["n_kv"] * rows * hd // 2))
    return reads, [(p["out_word"], p["out_word"] + p["n_kv"] * p["n_tok"] * hd)]


def _rope_rows_extents(p, s):
    hd = s["HEAD_DIM"]
    if hd % 4 or p["table_word"] % 4 or p["out_word"] % 4 or p["shift"] > 16:
        raise E.DispatchError(f"rope_rows: HEAD_DIM {hd}, table_word {p['table_word']}, out_word {p['out_word']}, "
                              f"shift {p['shift']}")
    if not p["n_rows"]:
        return [], []
    if p["n_rows"] % p["n_tok"]:
        raise E.DispatchError(f"rope_rows: n_rows {p['n_rows']} is not whole KV heads of {p['n_tok']} tokens")
    table_rows = p["hi_rows"] + (1 << p["shift"])
    if (p["t0"] + p["n_tok"] - 1) >> p["shift"] >= p["hi_rows"]:
        raise E.DispatchError(f"rope_rows: tokens to {p['t0'] + p['n_tok']} past the table's {p['hi_rows']} hi rows")
    return ([(p["table_word"], p["table_word"] + table_rows * hd)],
            [(p["out_word"], p["out_word"] + p["n_rows"] * hd)])


def _copy_extents(p, s):
    n = p["n_words"]
    return ([(p["src_word"], p["src_word"] + n)], [(p["dst_word"], p["dst_word"] + n)]) if n else ([], [])


def _flush_extents(p, s):
    n = p["n_words"]
    if n % 4:
        raise E.DispatchError(f"l2_flush reads whole vec4s: n_words {n} is not a multiple of 4")
    return ([(0, n)] if n else []), [(0, 1)]


def _row_groups(s, lanes):
    return s["HEAD_DIM"] // lanes // s["CHUNKS"]


# variant → extents (push, spec) -> spans per binding
EXTENTS = {
    **{f"reconstruct_{v}": (lambda p, s, n=n: _reconstruct_extents(p, s, n)) for v, n in (("vec4", 4), ("scalar", 1))},
    "copy_rows_vec4": _copy_rows_extents, "copy_rows_scalar": _copy_rows_extents,
    "copy_vec4": _copy_extents, "copy_scalar": _copy_extents,
    "scatter": _scatter_extents, "append_step": _append_step_extents, "append_kivi": _append_kivi_extents,
    "append_window": _append_window_extents, "l2_flush": _flush_extents,
    "read_rows_f16": _read_f16_extents, "read_rows_q8": _read_q8_extents, "read_rows_kivi": _read_kivi_extents,
    "read_window": _read_window_extents, "rope_rows": _rope_rows_extents,
}
# variant → invocations that share one row, from the spec (grid stride % groups == 0); others 1
GROUPS = {f"{k}_{v}": (lambda s, n=n: _row_groups(s, n))
          for k in ("reconstruct", "copy_rows") for v, n in (("vec4", 4), ("scalar", 1))}
