"""Dispatch contracts of the GPU OMP encoder's shaders, for ``kernels.SHADERS``.

The encoder (kvdict_vk/vk/encoder.py) runs, per batch, either one dispatch of
omp_encode_tiled (every step of a tile of vectors per workgroup; kvdict_vk/vk/encode_tiled.py)
or of omp_encode_vector (a vector per workgroup, for few vectors per dictionary head;
kvdict_vk/vk/encode_vector.py), or the stepwise kernels: omp_encode_pick phase 0 (r = x −
mean), omp_encode_metric (metric streams: r = W(x − mean), by blocks of rows of W), then per OMP step omp_encode_corr (correlation
blocks) and omp_encode_pick phase 1 (the pick, Gram–Schmidt; after the last step the
slots). The extents below say which words of each binding a dispatch may touch for given
push constants (shaders/encode_common.glsl documents the fields), so kernels.Kernel.op
refuses a dispatch that would leave a buffer (DispatchError).

This module imports nothing from kernels (kernels calls :func:`shader_specs` with its
ShaderSpec class), so registering the encoder there is a two-line hook without an import cycle.
"""
from __future__ import annotations

from ... import errors as E
from ...residual import slot_words


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


def shader_specs(shader_spec, push, wg_size: int) -> dict:
    """The sixteen encoder variants as ``shader_spec`` (kernels.ShaderSpec) entries. The
    stepwise kernels take one workgroup per item (a tile of wg_size tokens × an atom block);
    the tiled one a grid-stride loop over tiles of TILE_VECTORS vectors."""
    per_workgroup = lambda spec: wg_size
    out = {}
    for v, n in (("vec4", 4), ("scalar", 1)):
        out[f"omp_encode_corr_{v}"] = shader_spec(
            f"omp_encode_corr_{v}", push, (n, n, 2), (False, False, True), ("DIM", "ATOM_BLOCK"),
            _corr_extents, per_workgroup)
        out[f"omp_encode_metric_{v}"] = shader_spec(
            f"omp_encode_metric_{v}", push, (n, n), (False, True), ("DIM", "METRIC_ROWS"), _metric_extents,
            per_workgroup)
        for r, extra in (("", ()), ("_residual", ("RESIDUAL_BITS", "N_STEPS"))):
            out[f"omp_encode_pick{r}_{v}"] = shader_spec(
                f"omp_encode_pick{r}_{v}", push, (n, n, 1, n, 1, 2, 1),
                (False, False, False, True, True, False, True),
                ("DIM", "SPARSITY", "ATOM_BLOCK") + extra, _pick_extents, per_workgroup)
            out[f"omp_encode_vector{r}_{v}"] = shader_spec(
                f"omp_encode_vector{r}_{v}", push, (n, 1, 4, 1), (False, False, False, True),
                ("DIM", "SPARSITY", "LOCAL", "SUM_F", "METRIC") + extra + (("SUM_D",) if r else ()),
                _vector_extents, optional_spec=(("METRIC", 0),))
            out[f"omp_encode_tiled{r}_{v}"] = shader_spec(
                f"omp_encode_tiled{r}_{v}", push, (n, n, 1, 1, 1, 1), (False, False, False, True, True, True),
                ("DIM", "SPARSITY", "TILE_VECTORS", "LOCAL", "CHUNK_DIMS", "METRIC") + extra, _tiled_extents,
                optional_spec=(("METRIC", 0), ("CHUNK_DIMS", 0)))
    return out
