"""The decode-attention shaders' arithmetic (shaders/attend_*.comp, layouts in
shaders/attend_common.glsl): buffer sizes, shared-memory and shape limits, and which words
a dispatch touches (``EXTENTS``) — checked by kernels.Kernel before anything reaches the
driver. What each variant binds, its push block and specialization constants are declared
in kvdict_vk/vk/abi.py; kvdict_vk/vk/shaders.py joins the two into SHADERS.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ... import errors as E
from ... import kivi as K
from ... import layout as L
from ...layout import row_words
from .. import shaders

ATOM_BLOCK = 16  # atoms per attend_atoms.comp invocation (its ATOM_BLOCK)
FLASH_MAX_GROUP = 8  # attend_flash.comp's MAX_G: query heads per KV head it keeps in registers
# attend_flash.comp's UNIT_DIMS: the elements of a row one invocation takes (a unit: a uvec4 of an
# f16 row, two of an f32 row, two value words of a q8_0 row; a test reads the shader's)
FLASH_UNIT_DIMS = 8


# attend_flash_wide's END_ELEMS, preferred first (fewer passes): 2 or 1 would be correct too,
# but made the whole kernel 3-4x slower on an H200 (the compiler's choices with 4-8 passes)
FLASH_END_ELEMS = (8, 4)
# attend_flash's END_ELEMS per float build (FLASH_KERNELS): elements of a unit its split's
# end moves a pass, 16 / END_ELEMS barriers. 2 was never slower than 1; 4 costs registers
# (fewer workgroups a multiprocessor) and gained nothing, so it is not offered
# (lab/NOTEBOOK.md, "Registers").
FLASH_FLOAT_END_ELEMS = {"float": 2}
FLASH_FLOAT_END_ELEMS["int_dot"] = FLASH_FLOAT_END_ELEMS["float"]  # attend_flash_dot: the same split end


def flash_shared_bytes(group: int, local: int, units: int, end_elems: int, wide: bool = False) -> int:
    """attend_flash.comp's shared memory at END_ELEMS = end_elems. attend_flash: end_elems
    floats per (query head, invocation) — partial scores without subgroups, a pass of the
    end's sums — and one per query head (the split's reference). attend_flash_wide (wide):
    end_elems floats per (query head, invocation) plus a padding of units % 32 each — partial
    scores, the end's unit elements —, three floats per (query head, token lane) and one per
    query head (the end's references, sums, factors)."""
    if not wide:
        return 4 * (end_elems * group * local + group)
    return 4 * (end_elems * (group * local + units % 32) + 3 * group * (local // units) + group)


def flash_units(head_dim: int) -> int:
    """Invocations attend_flash spreads a row over, a unit of 8 elements each (a uvec4 of an
    f16 row, two of an f32 row, two value words of a q8_0 row): the same for every format."""
    return head_dim // FLASH_UNIT_DIMS


# attend_mma.comp: its subgroups' lanes (SG), tokens a tile (TT), query-head columns (HN), the
# largest head_dim it unrolls (16 × MAX_D16), the KIVI bit widths whose levels fill whole words,
# and its workgroup sizes (subgroups of 32: the tuner times each that fits)
MMA_SUBGROUP, MMA_TILE_TOKENS, MMA_HEAD_COLUMNS, MMA_MAX_HEAD_DIM = 32, 16, 8, 128
MMA_KIVI_BITS = (2, 4, 8)
MMA_LOCALS = (64, 128)


def mma_shared_bytes(head_dim: int, local: int, rows: str) -> int:
    """attend_mma.comp's shared memory over ``rows`` ("f16", "q8_0", "kivi") at ``local``
    invocations: the queries and (rows) Q^T, the workgroup's; per subgroup the staging tile (or
    O^T), the tile's scores, P^T, the scales (KIVI: and its folded Q'^T), the end's references
    and sums. (The driver's figure for the H100's builds: lab/results/h100/pipeline_statistics_mma.json.)"""
    nw, d32, hn, tt = local // MMA_SUBGROUP, head_dim // 32, MMA_HEAD_COLUMNS, MMA_TILE_TOKENS
    nblk = d32 if rows == "q8_0" else 1
    nvg = d32 if rows in ("q8_0", "kivi") else 1
    qw = head_dim * hn // 2
    per_sg = tt * head_dim // 2 + nblk * tt * hn + nvg * tt * hn // 2 + tt * (nblk + nvg) + 2 * hn \
        + (2 * qw if rows == "kivi" else 0)
    return 4 * (hn * head_dim + (0 if rows == "kivi" else 2 * qw) + nw * per_sg)


# attend_flash.comp's TOKENS_PER_LANE (its defaults; a test reads the shader's): rows, and the
# KIVI builds (a round's tokens of an invocation share their key group's statistics)
FLASH_TOKENS_PER_LANE = 2
FLASH_KIVI_TOKENS_PER_LANE = 8


def flash_round_tokens(head_dim: int, local: int, coded: bool, kivi: bool = False, mma: bool = False) -> int:
    """Tokens a flash workgroup takes in one round of its token loop (a split shorter than a
    whole number of rounds still runs its last round whole): attend_flash_coded a chunk of
    ``local`` tokens (one an invocation), attend_flash its token lanes × TOKENS_PER_LANE,
    attend_mma a tile a subgroup — over a KIVI layer, a whole number of 32-token key groups too
    (its splits start on one)."""
    if coded:
        return local
    if mma:
        tiles = local // MMA_SUBGROUP * MMA_TILE_TOKENS
        return math.lcm(tiles, K.GROUP) if kivi else tiles
    if kivi:
        return math.lcm(local // flash_units(head_dim) * FLASH_KIVI_TOKENS_PER_LANE, K.GROUP)
    return local // flash_units(head_dim) * FLASH_TOKENS_PER_LANE


FLASH_CODED_BUCKET = (4, 16)  # attend_flash_coded's BUCKET: code words an owner takes per pass, least and most
FLASH_CODED_MAX_OWNED = 32  # its NSUB * HB: atom weights an invocation keeps in registers
FLASH_CODED_MAX_LOCAL = 256  # its bucket words carry a token's index in the chunk in 8 bits
FLASH_CODED_MAX_V_SPARSITY = 32  # a token's V code words still to hand over are bits of one word


def flash_coded_shared_bytes(head_dim: int, hb: int, local: int, n_atoms: int, v_bits: int, bucket: int,
                             key_rope: bool = False) -> int:
    """attend_flash_coded.comp's shared memory: the q·atom table of its HB heads (the atom
    weights at the end), the owners' buckets and counts, the scaled queries, the chunk's
    probabilities (vec4s of heads; reductions), steps and staged V level words, three flags;
    K's mean and residual scale (``key_rope``: its K_ROPE build) or a quad of each."""
    v_stage = L.residual_words(head_dim, v_bits) - 1 if v_bits else 1
    hb4 = -(-hb // 4)
    rows = max(n_atoms, local) if key_rope else n_atoms  # K_ROPE: the table's place holds partial scores
    return 4 * (hb * rows + bucket * local + local + hb * head_dim + 4 * hb4 * local + local
                + local * v_stage + 3 + 2 * (head_dim if key_rope else 4))


def flash_coded_fits(head_dim: int, hb: int, local: int, n_atoms: int, v_sparsity: int) -> bool:
    """Whether attend_flash_coded.comp runs at ``hb`` query heads and ``local`` invocations
    (shared memory aside: flash_coded_bucket): head_dim a multiple of 4 whose quads divide
    ``local``, ``local`` at most FLASH_CODED_MAX_LOCAL, the atoms an invocation owns times ``hb``
    at most FLASH_CODED_MAX_OWNED, V's code words per slot at most FLASH_CODED_MAX_V_SPARSITY."""
    return (head_dim % 4 == 0 and local % (head_dim // 4) == 0 and local <= FLASH_CODED_MAX_LOCAL
            and -(-n_atoms // local) * hb <= FLASH_CODED_MAX_OWNED and v_sparsity <= FLASH_CODED_MAX_V_SPARSITY)


def flash_coded_key_lanes(head_dim: int, atoms_f16: bool, n_atoms: int, local: int) -> int:
    """attend_flash_coded's KEY_LANES (its K_ROPE build): the invocations a key is decoded by — the
    most, a power of two, dividing ``local`` and an atom's uvec4s (shaders/atoms.glsl) whose
    partial scores (local × lanes rows) fit the table's place (max(n_atoms, local) rows)."""
    quads, rows, lanes = head_dim // (8 if atoms_f16 else 4), max(n_atoms, local), 1
    while quads % (2 * lanes) == 0 and local % (2 * lanes) == 0 and 2 * lanes * local <= rows:
        lanes *= 2
    return lanes


def flash_coded_bucket(head_dim: int, hb: int, local: int, n_atoms: int, v_sparsity: int, v_bits: int,
                       shared_limit: int, key_rope: bool = False) -> int:
    """attend_flash_coded.comp's BUCKET at ``hb`` query heads and ``local`` invocations: the
    most code words an atom's owner takes per pass (at most FLASH_CODED_BUCKET[1]) that leave its
    shared memory within ``shared_limit`` — 0 where fewer than FLASH_CODED_BUCKET[0] fit or the
    kernel cannot run at that shape (flash_coded_fits)."""
    if not flash_coded_fits(head_dim, hb, local, n_atoms, v_sparsity):
        return 0
    least, most = FLASH_CODED_BUCKET
    rest = flash_coded_shared_bytes(head_dim, hb, local, n_atoms, v_bits, 0, key_rope)
    fit = min(most, (shared_limit - rest) // (4 * local)) if shared_limit > rest else 0
    return fit if fit >= least else 0


def lengths_word(n_seqs: int, n_q_heads: int, head_dim: int) -> int:
    """Where the query block's per-sequence n_used words start: after the n_seqs × n_q_heads
    query vectors (attend_common.glsl's SEQ_USED reads word lengths_word + b); the block is
    query_words long."""
    return n_seqs * n_q_heads * head_dim


def query_words(n_seqs: int, n_q_heads: int, head_dim: int) -> int:
    """Words of the query block: the queries, then one n_used word per sequence."""
    return lengths_word(n_seqs, n_q_heads, head_dim) + n_seqs


def n_blocks(n_atoms: int) -> int:
    return -(-n_atoms // ATOM_BLOCK)


@dataclass(frozen=True)
class Sizes:
    """Word counts of the attention buffers for n_kv KV heads, `group` query heads each,
    up to `max_splits` splits per KV head, n_ctx tokens and `seqs` sequences (batched decode:
    the flash paths' records, queries, table and output are per sequence; attend_common.glsl
    has the layouts)."""
    n_kv: int
    group: int
    head_dim: int
    n_atoms: int
    n_ctx: int
    max_splits: int
    seqs: int = 1

    @property
    def records(self) -> int:  # (sequence, KV head, split, query head)
        return self.seqs * self.n_kv * self.max_splits * self.group

    @property
    def f_word(self) -> int:  # factors after the (m, l) pairs
        return 2 * self.records

    @property
    def inv_l_word(self) -> int:
        return 3 * self.records

    @property
    def stats(self) -> int:
        return 3 * self.records + self.n_kv * self.group

    @property
    def accs(self) -> int:
        return self.records * self.head_dim

    @property
    def bins(self) -> int:
        return self.records * self.n_atoms

    @property
    def table(self) -> int:  # q·atom for every query head (of every sequence) and atom
        return self.seqs * self.n_kv * self.group * self.n_atoms

    @property
    def scores(self) -> int:
        return self.n_kv * self.group * self.n_ctx

    @property
    def blocks(self) -> int:
        return self.n_kv * n_blocks(self.n_atoms) * self.group * self.head_dim

    @property
    def out(self) -> int:
        return self.seqs * self.n_kv * self.group * self.head_dim

    @property
    def query(self) -> int:  # the queries, then each sequence's n_used
        return query_words(self.seqs, self.n_kv * self.group, self.head_dim)


def _span(start: int, words: int):
    return (start, start + words)


def _vec_span(word: int, n_kv: int, head_vec: int, head_dim: int):
    return (word, word + (n_kv - 1) * head_vec + head_dim)


def _check(cond: bool, what: str, p) -> None:
    if not cond:
        raise E.DispatchError(f"{what}: push constants {p} are inconsistent")


def _split_extents(p, s):
    hd, g, n_kv, used, n_splits = s["HEAD_DIM"], s["GROUP"], p["n_kv"], p["n_used"], p["n_splits"]
    _check(n_kv >= 1 and 1 <= used <= p["n_ctx"] and n_splits >= 1 and p["split_len"] >= 1
           and n_splits * p["split_len"] >= used and g % s["HB"] == 0, "attend_split", p)
    kc, kb, vc, vb = s["K_CODED"], s["K_BITS"], s["V_CODED"], s["V_BITS"]
    _check((not kc or p["k_sparsity"] >= 1) and (not vc or p["v_sparsity"] >= 1)
           and (not (kc or vc) or p["n_atoms"] >= 1), "attend_split", p)
    words, quads = [], []
    for word, sp, c, bits in ((p["k_word"], p["k_sparsity"], kc, kb), (p["v_word"], p["v_sparsity"], vc, vb)):
        span = _span(word, ((n_kv - 1) * p["n_ctx"] + used) * row_words(hd, sp if c else 0, bits))
        (words if c else quads).append(span)
    for word, bits in ((p["k_scale_word"], kb), (p["v_scale_word"], vb)):
        if bits:
            quads.append(_vec_span(word, n_kv, p["head_vec"], hd))
    sizes = Sizes(n_kv, g, hd, p["n_atoms"], p["n_ctx"], n_splits)
    common = [words, quads, [_span(0, sizes.out)], [_span(0, sizes.accs)], [_span(0, 2 * sizes.records)]]
    table = [_span(0, sizes.table)] if kc else []
    bins = [_span(0, sizes.bins)] if vc else []
    return common + [table, bins, [_span(0, sizes.scores)]]


def _atoms_span(p, s, n_atoms=None, word="atoms_word"):
    """The atoms of every KV head a kernel reads: float32 rows, or binary16 (ATOMS_F16: half
    the words, read a uvec4 at a time — atoms.glsl's layout, its alignment checked here)."""
    hd, f16 = s["HEAD_DIM"], s.get("ATOMS_F16", 0)
    if f16 and (hd % 8 or p[word] % 4 or p["head_atoms"] % 4):
        raise E.DispatchError(f"binary16 atoms need HEAD_DIM % 8 == 0 and {word}, head_atoms multiples of 4 "
                              f"(HEAD_DIM {hd}, {word} {p[word]}, head_atoms {p['head_atoms']})")
    n = p["n_atoms"] if n_atoms is None else n_atoms
    return _span(p[word], (p["n_kv"] - 1) * p["head_atoms"] + n * hd // (2 if f16 else 1))


def _table_extents(p, s):
    _check(p["n_kv"] >= 1 and p["n_atoms"] >= 1 and p["n_seqs"] >= 1, "attend_table", p)
    hd, g, heads = s["HEAD_DIM"], s["GROUP"], p["n_kv"] * p["n_seqs"]
    return [[_atoms_span(p, s)], [_query_span(p, heads * g * hd, "attend_table")],
            [_span(0, heads * g * p["n_atoms"])]]


def dynamic_split_len(n_used: int, n_splits: int, split_round: int) -> int:
    """The flash kernels' tokens per split where the push block's split_len is 0 (a recorded
    decode step's: attend_common.glsl's SPLIT_LEN, this function's twin): n_used over the
    splits, rounded up to a whole number of split_round tokens."""
    even = -(-n_used // n_splits)
    return -(-even // split_round) * split_round


def _splits_cover(p) -> bool:
    """Whether a flash dispatch's splits cover [0, n_used) of every sequence: n_splits ×
    split_len tokens, or split_len 0 (SPLIT_LEN: derived from each sequence's n_used, in
    rounds of split_round ≥ 1 tokens)."""
    if p["n_splits"] < 1:
        return False
    if p["split_len"] == 0:
        return p["split_round"] >= 1
    return p["n_splits"] * p["split_len"] >= p["n_used"]


def _query_span(p, words: int, what: str):
    """The query block a dispatch reads: ``words`` from push q_word on, which starts on a quad."""
    _check(p["q_word"] % 4 == 0, what, p)
    return _span(p["q_word"], words)


def _seq_rows(p, what: str) -> int:
    """The flash kernels' rows read per KV head: sequence n_seqs − 1's first n_used (each
    sequence's rows within seq_rows of the next's, all within the head's n_ctx)."""
    used, n_seqs = p["n_used"], p["n_seqs"]
    _check(n_seqs >= 1 and (n_seqs == 1 or used <= p["seq_rows"])
           and (n_seqs - 1) * p["seq_rows"] + used <= p["n_ctx"], what, p)
    return (n_seqs - 1) * p["seq_rows"] + used


def _combine_extents(p, s):
    _check(p["n_kv"] >= 1 and p["n_splits"] >= 1, "attend_combine", p)
    records = p["n_kv"] * p["n_splits"] * s["GROUP"]
    return [[_span(0, 2 * records), _span(p["f_word"], records),
             _span(p["inv_l_word"], p["n_kv"] * s["GROUP"])]]


def _atoms_extents(p, s):
    _check(p["n_kv"] >= 1 and p["n_atoms"] >= 1 and p["n_splits"] >= 1, "attend_atoms", p)
    hd, g = s["HEAD_DIM"], s["GROUP"]
    records = p["n_kv"] * p["n_splits"] * g
    return [[_atoms_span(p, s)], [_span(p["f_word"], records)], [_span(0, records * p["n_atoms"])],
            [_span(0, p["n_kv"] * n_blocks(p["n_atoms"]) * g * hd)]]


def _reduce_extents(p, s):
    hd, g, n_kv = s["HEAD_DIM"], s["GROUP"], p["n_kv"]
    _check(n_kv >= 1 and p["n_splits"] >= 1 and p["use_mean"] <= 1, "attend_reduce", p)
    records = n_kv * p["n_splits"] * g
    layer = [_vec_span(p["mean_word"], n_kv, p["head_vec"], hd)] if p["use_mean"] else []
    stats = [_span(p["f_word"], records), _span(p["inv_l_word"], n_kv * g)]
    blocks = [_span(0, n_kv * p["n_blocks"] * g * hd)] if p["n_blocks"] else []
    return [layer, stats, [_span(0, records * hd)], blocks, [_span(0, n_kv * g * hd)]]


def _direct_extents(p, s):
    """attend_direct.comp: tokens [t_first, n_used), those below n_cached from the cache
    (slots read as words, f32 rows as quads; atoms, scales and the mean as quads), the rest
    from the fresh rows; records split0 .. split0 + n_splits, or the output."""
    hd, g, n_kv = s["HEAD_DIM"], s["GROUP"], p["n_kv"]
    first, used, cached = p["t_first"], p["n_used"], p["n_cached"]
    _check(n_kv >= 1 and first < used and cached <= used and min(used, cached) <= p["n_ctx"]
           and p["n_splits"] >= 1 and p["split_len"] >= 1 and p["n_splits"] * p["split_len"] >= used - first
           and g % s["HB"] == 0 and p["write_out"] <= 1 and p["use_mean"] <= p["write_out"]
           and (not p["write_out"] or (p["n_splits"] == 1 and p["split0"] == 0 and first == 0)), "attend_direct", p)
    _check((not (s["K_SPARSITY"] or s["V_SPARSITY"]) or p["n_atoms"] >= 1), "attend_direct", p)
    words, quads, fresh_words, fresh_quads = [], [], [], []
    n_fresh = used - cached
    streams = ((p["k_word"], p["fresh_k_word"], s["K_SPARSITY"], s["K_BITS"], p["k_atoms_word"], p["k_scale_word"]),
               (p["v_word"], p["fresh_v_word"], s["V_SPARSITY"], s["V_BITS"], p["v_atoms_word"], p["v_scale_word"]))
    if s["ROW_HALF"] and hd % 8:
        raise E.DispatchError(f"attend_direct: f16 rows need HEAD_DIM % 8 == 0, got {hd}")
    for word, fresh_word, sparsity, bits, atoms_word, scale_word in streams:
        row = row_words(hd, sparsity, bits, "f16" if s["ROW_HALF"] else "f32")
        if min(used, cached) > first:
            (words if sparsity else quads).append(_span(word, ((n_kv - 1) * p["n_ctx"] + min(used, cached)) * row))
        if used > max(first, cached):
            (fresh_words if sparsity else fresh_quads).append(_span(fresh_word, n_kv * n_fresh * row))
        if sparsity:
            quads.append(_atoms_span(dict(p, atoms_word=atoms_word), s))
        if bits:
            quads.append(_vec_span(scale_word, n_kv, p["head_vec"], hd))
    if p["use_mean"]:
        quads.append(_vec_span(p["mean_word"], n_kv, p["head_vec"], hd))
    if s.get("K_ROPE"):  # the K mean and the rotation table (kvdict_vk.rope)
        _check(s["K_SPARSITY"] > 0 and hd % 4 == 0 and p["rope_word"] % 4 == 0 and p["rope_shift"] <= 16
               and (used - 1) >> p["rope_shift"] < p["rope_hi"], "attend_direct (K_ROPE)", p)
        quads += [_vec_span(p["k_mean_word"], n_kv, p["head_vec"], hd),
                  _span(p["rope_word"], (p["rope_hi"] + (1 << p["rope_shift"])) * hd)]
    words += _window_state(p)
    lo, hi = p["split0"] * n_kv * g, (p["split0"] + p["n_splits"]) * n_kv * g  # records
    records = [] if p["write_out"] else [[_span(lo * hd, (hi - lo) * hd)], [_span(2 * lo, 2 * (hi - lo))]]
    return [words, quads, fresh_words, fresh_quads, [_span(0, n_kv * g * hd)],
            *(records or [[], []]), [_span(0, n_kv * g * hd)] if p["write_out"] else []]


def _flash_extents(p, s):
    """attend_flash.comp: K and V rows of tokens [0, n_used) of every KV head, the queries,
    records 0 .. n_splits of every (KV head, query head)."""
    hd, g, n_kv, used, local = s["HEAD_DIM"], s["GROUP"], p["n_kv"], p["n_used"], s["LOCAL"]
    rows = "q8_0" if s["ROW_Q8"] else ("f16" if s["ROW_HALF"] else "f32")
    row, units = row_words(hd, 0, 0, rows), flash_units(hd)
    _check(n_kv >= 1 and 1 <= used <= p["n_ctx"] and _splits_cover(p), "attend_flash", p)
    _check(g <= FLASH_MAX_GROUP and (rows == "q8_0" or row % 4 == 0) and hd % FLASH_UNIT_DIMS == 0
           and units <= local and local % units == 0 and not (s["ROW_Q8"] and s["ROW_HALF"])
           and (rows != "q8_0" or hd % L.Q8_BLOCK == 0) and p["k_word"] % 4 == 0 and p["v_word"] % 4 == 0
           and 0 < s["END_ELEMS"] and FLASH_UNIT_DIMS % s["END_ELEMS"] == 0,  # the end's passes cover a unit
           "attend_flash (specialization)", dict(p, **s))
    last = _seq_rows(p, "attend_flash")
    rows = [_span(w, ((n_kv - 1) * p["n_ctx"] + last) * row) for w in (p["k_word"], p["v_word"])]
    records = p["n_seqs"] * n_kv * p["n_splits"] * g
    quads = [] if s["ROW_Q8"] else rows  # q8_0 rows are read as words only (17 a row at head_dim 64)
    queries = _query_span(p, query_words(p["n_seqs"], n_kv * g, hd), "attend_flash")
    return [rows, quads, [queries], [_span(0, records * hd)], [_span(0, 2 * records)]]


def _flash_dot_extents(p, s):
    """attend_flash.comp's KDOT builds: attend_flash's extents, over q8_0 rows only."""
    _check(s["ROW_Q8"] == 1, "attend_flash_dot (specialization: q8_0 rows)", s)
    return _flash_extents(p, s)


def _flash_kivi_extents(p, s):
    """attend_flash.comp's KIVI builds: of KV heads 0 .. n_kv-1 and sequences 0 .. n_seqs-1,
    the K and V rows of each sequence's first n_used tokens (whatever its state word says is
    quantised), the keys' group statistics of those tokens' groups, both exact windows, the
    sequences' state words; the queries; records 0 .. n_splits of each sequence. More than one
    split: the last takes the exact tokens, the others the quantised ones in whole rounds of
    split_round (whole key groups); the exact windows' rows are binary16 (ROW_HALF 1); the arena
    holds n_ctx / seq_rows sequences (layout.StreamLayout's KIVI heads)."""
    hd, g, n_kv, used, local = s["HEAD_DIM"], s["GROUP"], p["n_kv"], p["n_used"], s["LOCAL"]
    units = flash_units(hd)
    _check(n_kv >= 1 and 1 <= used and p["seq_rows"] >= 1 and p["n_ctx"] % p["seq_rows"] == 0
           and _splits_cover(p) and p["window"] >= 1
           and (p["n_splits"] == 1 or (p["split_round"] >= 1 and p["split_round"] % K.GROUP == 0))
           and all(p[w] % 4 == 0 for w in ("stats_word", "k_window_word", "v_window_word")), "attend_flash_kivi", p)
    _check(g <= FLASH_MAX_GROUP and hd % K.GROUP == 0 and units <= local and local % units == 0
           and s["ROW_HALF"] == 1 and s["ROW_Q8"] == 0 and 0 < s["END_ELEMS"] and FLASH_UNIT_DIMS % s["END_ELEMS"] == 0
           and K.GROUP % FLASH_KIVI_TOKENS_PER_LANE == 0
           and all(K.MIN_BITS <= s[b] <= K.MAX_BITS for b in ("K_BITS", "V_BITS")),
           "attend_flash_kivi (specialization)", dict(p, **s))
    last, n_seqs = _seq_rows(p, "attend_flash_kivi"), p["n_seqs"]
    n_ctx, seqs = p["n_ctx"], p["n_ctx"] // p["seq_rows"]
    k_row, v_row = K.key_row_words(hd, s["K_BITS"]), K.value_row_words(hd, s["V_BITS"])
    last_head = (n_kv - 1) * seqs + n_seqs - 1  # the last KIVI head read (layout.StreamLayout.kivi_head)
    stats = _span(p["stats_word"], (last_head * -(-p["seq_rows"] // K.GROUP) + -(-used // K.GROUP)) * hd)
    window = K.window_words(n_kv, seqs, p["window"], hd)
    windows = [_span(p["k_window_word"], window), _span(p["v_window_word"], window)]
    words = [_span(p["k_word"], ((n_kv - 1) * n_ctx + last) * k_row),
             _span(p["v_word"], ((n_kv - 1) * n_ctx + last) * v_row), _span(p["state_word"], n_seqs)]
    records = n_seqs * n_kv * p["n_splits"] * g
    queries = _query_span(p, query_words(n_seqs, n_kv * g, hd), "attend_flash_kivi")
    return [words, [stats] + windows, [queries], [_span(0, records * hd)], [_span(0, 2 * records)]]


def _mma_check(s, bits: tuple = ()):
    """attend_mma.comp's specialization: its head columns, head_dims, subgroups of 32; a row
    format (f16 or q8_0 rows; the KIVI build's exact windows are f16 rows); KIVI ``bits`` that
    fill whole words."""
    hd = s["HEAD_DIM"]
    _check(s["GROUP"] <= MMA_HEAD_COLUMNS and hd % 32 == 0 and hd <= MMA_MAX_HEAD_DIM
           and s["LOCAL"] % MMA_SUBGROUP == 0 and all(b in MMA_KIVI_BITS for b in bits)
           and s["ROW_HALF"] + s["ROW_Q8"] == 1 and (not bits or s["ROW_HALF"] == 1),
           "attend_mma (specialization)", s)


def _mma_extents(p, s):
    """attend_mma.comp over rows: what attend_flash reads and writes (the same rows, clamped to
    the split's last token; as words only)."""
    _mma_check(s)
    words, _quads, *rest = _flash_extents(p, dict(s, END_ELEMS=1))
    return [words, [], *rest]


def _mma_kivi_extents(p, s):
    """attend_mma.comp's KIVI build: attend_flash_kivi's spans, the statistics and windows read
    as words (not quads)."""
    _mma_check(s, (s["K_BITS"], s["V_BITS"]))
    _check(p["n_seqs"] == 1 and p["seq_rows"] == p["n_ctx"], "attend_mma_kivi (one sequence)", p)
    words, quads, *rest = _flash_kivi_extents(p, dict(s, END_ELEMS=1))
    return [words + quads, [], *rest]


def _flash_coded_extents(p, s):
    """attend_flash_coded.comp: the K and V slots of tokens [0, n_used), both residual scales,
    V's atoms (as quads), the q·atom table, the queries, records 0 .. n_splits; its K_ROPE
    build K's atoms (as quads), mean and rotation table in place of the table."""
    hd, g, hb, n_kv, used, local = s["HEAD_DIM"], s["GROUP"], s["HB"], p["n_kv"], p["n_used"], s["LOCAL"]
    _check(n_kv >= 1 and 1 <= used <= p["n_ctx"] and _splits_cover(p) and p["v_atoms_word"] % 4 == 0
           and p["head_atoms"] % 4 == 0, "attend_flash_coded", p)
    # the bucket's size against the device's shared memory is the caller's (attend.flash.FlashShapes.flash_coded_bucket)
    fits = s["BUCKET"] >= 1 and flash_coded_fits(hd, hb, local, s["N_ATOMS"], s["V_SPARSITY"])
    _check(g % hb == 0 and fits, "attend_flash_coded (specialization)", s)
    last, heads = _seq_rows(p, "attend_flash_coded"), p["n_seqs"] * n_kv  # virtual heads
    words = []
    for word, sp, bits in ((p["k_word"], s["K_SPARSITY"], s["K_BITS"]), (p["v_word"], s["V_SPARSITY"], s["V_BITS"])):
        words.append(_span(word, ((n_kv - 1) * p["n_ctx"] + last) * row_words(hd, sp, bits)))
    for word, bits in ((p["k_scale_word"], s["K_BITS"]), (p["v_scale_word"], s["V_BITS"])):
        if bits:
            words.append(_vec_span(word, n_kv, p["head_vec"], hd))
    words += _window_state(p)
    quads = [_atoms_span(p, s, s["N_ATOMS"], "v_atoms_word")]
    table = [_span(0, heads * g * s["N_ATOMS"])]
    if s.get("K_ROPE"):  # no table: K's atoms, mean (read as words) and rotation table
        lanes = s.get("KEY_LANES", 1)  # the most flash_coded_key_lanes allows, or fewer
        _check(s["K_SPARSITY"] > 0 and p["k_atoms_word"] % 4 == 0 and p["rope_word"] % 4 == 0
               and p["rope_shift"] <= 16 and (used - 1) >> p["rope_shift"] < p["rope_hi"] and lanes >= 1
               and lanes & (lanes - 1) == 0
               and flash_coded_key_lanes(hd, s.get("ATOMS_F16", 0), s["N_ATOMS"], local) % lanes == 0,
               "attend_flash_coded (K_ROPE)", dict(p, **s))
        table = []
        quads += [_atoms_span(p, s, s["N_ATOMS"], "k_atoms_word"),
                  _span(p["rope_word"], (p["rope_hi"] + (1 << p["rope_shift"])) * hd)]
        words.append(_vec_span(p["k_mean_word"], n_kv, p["head_vec"], hd))
    records = heads * p["n_splits"] * g
    queries = _query_span(p, query_words(p["n_seqs"], n_kv * g, hd), "attend_flash_coded")
    return [words, quads, table, [queries], [_span(0, records * hd)], [_span(0, 2 * records)]]


def _window_state(p) -> list:
    """A windowed layer's state word (the coded passes read the token count there)."""
    return [_span(p["state_word"], 1)] if p["win_sink"] + p["win_recent"] else []


def _window_extents(p, s):
    """attend_window.comp: the state word, both streams' window blocks and means, the
    queries, the records of split split0 (a power-of-two workgroup with a quad of every
    element per invocation)."""
    hd, g, n_kv, rows = s["HEAD_DIM"], s["GROUP"], p["n_kv"], p["rows"]
    local = s["LOCAL"]
    _check(n_kv >= 1 and rows >= 1 and rows == p["sink"] + p["recent"] and p["n_seqs"] == 1 and hd % 4 == 0
           and s["HB"] == 1 and local & (local - 1) == 0 and 4 * local >= hd, "attend_window", dict(p, **s))
    layer = [_span(p["state_word"], 1)]
    for word in (p["k_window_word"], p["v_window_word"]):
        layer.append(_span(word, n_kv * rows * hd // 2))
    for word in (p["k_mean_word"], p["v_mean_word"]):
        layer.append(_vec_span(word, n_kv, p["head_vec"], hd))
    lo = p["split0"] * n_kv * g
    queries = _query_span(p, query_words(1, n_kv * g, hd), "attend_window")
    return [layer, [queries], [_span(lo * hd, n_kv * g * hd)], [_span(2 * lo, 2 * n_kv * g)]]


def _merge_extents(p, s):
    hd, g, n_kv = s["HEAD_DIM"], s["GROUP"], p["n_kv"]
    _check(n_kv >= 1 and p["n_splits"] >= 1 and p["use_mean"] <= 1, "attend_merge", p)
    records = n_kv * p["n_splits"] * g
    mean = [_vec_span(p["mean_word"], n_kv, p["head_vec"], hd)] if p["use_mean"] else []
    return [mean, [_span(0, 2 * records)], [_span(0, records * hd)], [_span(0, n_kv * g * hd)]]


def _merge_head_extents(p, s):
    """attend_merge's, over n_kv virtual heads (sequences × seq_heads KV heads) whose means
    are their KV head's, the output from out_word on."""
    _check(s["LOCAL"] % (s["HEAD_DIM"] // 4) == 0, "attend_merge_head (specialization)", s)
    _check(1 <= p["seq_heads"] <= p["n_kv"] and p["n_kv"] % p["seq_heads"] == 0 and p["out_word"] % 4 == 0,
           "attend_merge_head", p)
    spans = _merge_extents(p, s)
    if p["use_mean"]:
        spans[0] = [_vec_span(p["mean_word"], p["seq_heads"], p["head_vec"], s["HEAD_DIM"])]
    spans[3] = [_span(p["out_word"], p["n_kv"] * s["GROUP"] * s["HEAD_DIM"])]  # at out_word
    return spans


def merge_head_local(head_dim: int, most: int) -> int:
    """attend_merge_head's workgroup: up to 256 invocations (the device's ``most`` allowing:
    Attention.max_local, maxComputeWorkGroupInvocations and maxComputeWorkGroupSize[0]), a
    multiple of head_dim / 4 — its split lanes × quads, up to 16 split lanes (0: none fits).
    More split lanes, more records in flight at once: 16 lanes of 4 records each at d64 take
    64 splits a round trip to memory, d128's 8 lanes 32."""
    q4 = head_dim // 4
    return max((n * q4 for n in (16, 8, 4, 2, 1) if n * q4 <= min(256, most)), default=0)


# variant → extents (push, spec) -> spans per binding (bindings: abi.DECLARATIONS)
EXTENTS = {
    "attend_split_coded": _split_extents,
    "attend_table": _table_extents,
    "attend_combine": _combine_extents,
    "attend_atoms": _atoms_extents,
    "attend_reduce": _reduce_extents,
    "attend_direct": _direct_extents,
    "attend_window": _window_extents,
    "attend_merge": _merge_extents,
    "attend_merge_head": _merge_head_extents,
    **{name: _flash_extents for name in ("attend_flash", "attend_flash_sg", "attend_flash_wide",
                                         "attend_flash_wide_sg")},
    **{name: _flash_dot_extents for name in ("attend_flash_dot", "attend_flash_dot_sg")},
    **{name: _flash_kivi_extents for name in ("attend_flash_kivi", "attend_flash_kivi_sg")},
    "attend_flash_coded": _flash_coded_extents,
    "attend_mma": _mma_extents,
    "attend_mma_kivi": _mma_kivi_extents,
}

shaders.register(EXTENTS)
