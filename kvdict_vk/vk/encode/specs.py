"""Dispatch arithmetic of the GPU OMP encoder's shaders, for ``SHADERS`` (kvdict_vk/vk/shaders.py).

The encoder (kvdict_vk/vk/encoder.py) runs, per batch, either one dispatch of
omp_encode_tiled (every step of a tile of vectors per workgroup; kvdict_vk/vk/encode_tiled.py)
or of omp_encode_vector (a vector per workgroup, for few vectors per dictionary head;
kvdict_vk/vk/encode_vector.py), or the stepwise kernels: omp_encode_pick phase 0 (r = x −
mean), omp_encode_metric (metric streams: r = W(x − mean), by blocks of rows of W), then per OMP step omp_encode_corr (correlation
blocks) and omp_encode_pick phase 1 (the pick, Gram–Schmidt; after the last step the
slots). The extents below say which words of each binding a dispatch may touch for given
push constants (shaders/encode_common.glsl documents the fields), so kernels.Kernel.op
refuses a dispatch that would leave a buffer (DispatchError).

What each variant binds, its push block (abi.ENCODE_PUSH) and specialization constants are
declared in kvdict_vk/vk/abi.py; here are ``EXTENTS`` and ``GROUPS`` by variant name.
"""
from __future__ import annotations

from ... import errors as E
from ...residual import slot_words
from .. import abi, shaders


def n_blocks(n_atoms: int, atom_block: int) -> int:
    """Atom blocks of the correlation kernel (the last one padded with zero atoms)."""
    return -(-n_atoms // atom_block)


def state_words(sparsity: int) -> int:
    """Per-vector bookkeeping words of the pick kernel: R (s×s), z (s), atom indices (s)."""
    return sparsity * sparsity + 2 * sparsity


def _span(word: int, words: int) -> tuple:
    return (word, word + words)


def _batch(p) -> tuple:
    """(n_vectors, n_kv, dictionary heads read) after the checks every kernel shares."""
    n, t = p["n_vectors"], p["n_tok"]
    if t < 1 or n < 1 or n % t or p["n_atoms"] < 1 or p["per_head"] > 1 or p["phase"] > 1:
        raise E.DispatchError(f"omp_encode: n_vectors={n} n_tok={t} n_atoms={p['n_atoms']} "
                              f"per_head={p['per_head']} phase={p['phase']} is inconsistent")
    return n, n // t, (n // t if p["per_head"] else 1)


def _dest_span(p, slot: int, n_kv: int) -> tuple:
    """Words of the destination slots of tokens t0 .. t0+n_tok of every head (the encoders'
    addressing: slot of head h, token t at dst_word + (h·n_ctx + t)·slot)."""
    return (p["dst_word"] + p["t0"] * slot, p["dst_word"] + ((n_kv - 1) * p["n_ctx"] + p["t0"] + p["n_tok"]) * slot)


def _residual_floats(p, s, heads: int) -> list:
    """The residual stage's image floats: 1/scale and the step multipliers (df64 pairs)."""
    return [_span(p["scale_word"], heads * 2 * s["DIM"]), _span(p["steps_word"], 2 * s["N_STEPS"])]


def _corr_extents(p, s):
    n, _, heads = _batch(p)
    d, blk = s["DIM"], s["ATOM_BLOCK"]
    nb = n_blocks(p["n_atoms"], blk)
    if p["block"] >= nb or p["dict_head"] >= heads:
        raise E.DispatchError(f"omp_encode_corr: block {p['block']} of {nb}, dictionary head "
                              f"{p['dict_head']} of {heads}")
    first = p["atoms_word"] + (p["dict_head"] * nb + p["block"]) * blk * d
    return [_span(first, blk * d)], [_span(p["res_word"], n * d)], [_span(0, 2 * n * nb)]


def _metric_extents(p, s):
    n, _, _ = _batch(p)
    d = s["DIM"]
    if p["block"] * s["METRIC_ROWS"] >= d:
        raise E.DispatchError(f"omp_encode_metric: row block {p['block']} of {s['METRIC_ROWS']} rows "
                              f"starts past DIM {d}")
    # reads x − mean from the basis area, writes its rows of W·(x − mean) to the residual area
    return [_span(p["metric_word"], d * d)], [_span(p["basis_word"], n * d), _span(p["res_word"], n * d)]


def _pick_extents(p, s):
    n, n_kv, heads = _batch(p)
    d, sp, blk, k = s["DIM"], s["SPARSITY"], s["ATOM_BLOCK"], p["n_atoms"]
    bits = s.get("RESIDUAL_BITS", 0)
    if p["step"] >= sp or p["t0"] + p["n_tok"] > p["n_ctx"]:
        raise E.DispatchError(f"omp_encode_pick: step {p['step']} (sparsity {sp}) or tokens "
                              f"[{p['t0']}, {p['t0'] + p['n_tok']}) beyond n_ctx {p['n_ctx']}")
    nb, slot = n_blocks(k, blk), slot_words(d, sp, bits)
    elems = [_span(p["atoms_word"], heads * nb * blk * d), _span(p["mean_word"], heads * d)]
    floats = [_span(p["inv_norm_word"], heads * k)]
    if bits:
        elems.append(_span(p["raw_atoms_word"], heads * k * d))
        floats += _residual_floats(p, s, heads)
    return ([_span(0, n * d)], elems, floats,
            [_span(p["res_word"], n * d), _span(p["basis_word"], n * sp * d)],
            [_span(0, n * state_words(sp))], [_span(0, 2 * n * nb)], [_dest_span(p, slot, n_kv)])


def _one_dispatch_extents(p, s, name: str) -> tuple:
    """(input, unit-atom rows, transposed unit atoms, image floats, destination) spans of a
    one-dispatch encoder (omp_encode_tiled, omp_encode_vector): both read the dictionary
    image's float blocks and write the slots of tokens t0 .. t0+n_tok of every head."""
    n, n_kv, heads = _batch(p)
    d, pad = s["DIM"], p["atoms_pad"]
    bits = s.get("RESIDUAL_BITS", 0)
    if pad < p["n_atoms"] or p["t0"] + p["n_tok"] > p["n_ctx"]:
        raise E.DispatchError(f"{name}: atoms_pad {pad} < n_atoms {p['n_atoms']}, or tokens "
                              f"[{p['t0']}, {p['t0'] + p['n_tok']}) beyond n_ctx {p['n_ctx']}")
    slot = slot_words(d, s["SPARSITY"], bits)
    rows = [_span(p["atoms_word"], heads * pad * d), _span(p["mean_word"], heads * d)]
    atoms_t = _span(p["atoms_t_word"], heads * pad * d)
    floats = [atoms_t, _span(p["inv_norm_word"], heads * p["n_atoms"]), _span(p["mean_word"], heads * d)]
    if s["METRIC"]:
        floats.append(_span(p["metric_word"], d * d))
    if bits:
        floats += [_span(p["raw_atoms_word"], heads * p["n_atoms"] * d)] + _residual_floats(p, s, heads)
    return [_span(0, n * d)], rows, [atoms_t], floats, [_dest_span(p, slot, n_kv)]


def _tiled_extents(p, s):
    x, rows, _, floats, dest = _one_dispatch_extents(p, s, "omp_encode_tiled")
    # bindings 3 and 4 (work state) hold a region per workgroup from word 0: sized by the
    # encoder from the pipeline's workgroup count (encode_tiled.TiledKernels), not by push
    return x, rows, floats, [], [], dest


def _vector_extents(p, s):
    x, _, atoms_t, floats, dest = _one_dispatch_extents(p, s, "omp_encode_vector")
    return x, floats, atoms_t, dest  # binding 2: the transposed atoms as vec4s


def _per_workgroup(spec) -> int:
    return abi.WG_SIZE


_VECS = ("vec4", "scalar")
# variant → extents (push, spec) -> spans per binding (bindings: abi.DECLARATIONS)
EXTENTS = {
    **{f"omp_encode_corr_{v}": _corr_extents for v in _VECS},
    **{f"omp_encode_metric_{v}": _metric_extents for v in _VECS},
    **{f"omp_encode_{k}{r}_{v}": f for k, f in (("pick", _pick_extents), ("vector", _vector_extents),
                                               ("tiled", _tiled_extents))
       for r in ("", "_residual") for v in _VECS},
}
# The stepwise kernels take one workgroup per item (a tile of WG_SIZE tokens × an atom
# block): abi.WG_SIZE invocations share it; the tiled one runs a grid-stride loop over tiles
# of TILE_VECTORS vectors, the vector one a vector per workgroup (1).
GROUPS = {f"omp_encode_{k}_{v}": _per_workgroup for k in ("corr", "metric", "pick", "pick_residual")
          for v in _VECS}

shaders.register(EXTENTS, GROUPS)
