"""Host-side preparation for the GPU OMP encoder: the dictionary image and the sizes.

The image is one buffer of float32 blocks (each vec4-aligned), computed in float64 exactly
as the CPU reference computes the same things, so the GPU starts from identical numbers:

* ``atoms_word``      unit-norm atoms in the encoding space: atoms·metricᵀ / ‖atoms·metricᵀ‖
                      (codec.omp's ``dn``), per head, padded with zero atoms to whole blocks
                      of ``atom_block`` (the correlation kernel reads whole blocks);
* ``inv_norm_word``   1/‖metric·atom‖ (0 for an atom the metric maps to zero, which is then
                      never useful: correlation 0, coefficient 0 — as in codec.omp);
* ``atoms_t_word``    (tiled encoder only) the same unit atoms transposed, [head][head_dim][padded
                      atoms], so a workgroup stages an atom tile with coalesced loads (padded
                      to whole blocks and vec4s: the vector kernel reads its rows as vec4s);
* ``mean_word``       the mean per head (zeros when absent), ``metric_word`` the metric;
* residual stage only: ``raw_atoms_word`` the atoms as given (the decoder's), ``scale_word``
  1/residual_scale and ``steps_word`` the step multipliers, both as df64 pairs (hi, lo).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import residual
from ...dictionary import StreamDict
from .specs import n_blocks, state_words

# Floats of one atom block (ATOM_BLOCK × head_dim): the size of the correlation kernel's
# unrolled, straight-line body. Measured on llvmpipe at head_dim 64, n_atoms 1024: 1024 →
# ~80 ns per vector·atom, 10 s to create the pipeline; 2048 → ~50 ns, ~23 s; 4096 → ~55 ns,
# ~80 s (compile time grows faster than the body). Pipelines land in Mesa's shader cache.
BLOCK_FLOATS = 2048
MAX_ATOM_BLOCK = 256

# llvmpipe ends every loop of an invocation once that invocation's loops have run 65535
# iterations in total — silently (measured; gallivm's loop limiter). Only the pick kernel
# has loops; pick_loop_iterations bounds them and the encoder refuses what would not fit.
LOOP_ITERATION_CAP = 65535
LOOP_BUDGET = 60000


def caps_loops(device) -> bool:
    """Whether ``device``'s driver ends loops at LOOP_ITERATION_CAP (llvmpipe's gallivm)."""
    return "llvmpipe" in device.name.lower()


def atom_block(head_dim: int, n_atoms: int) -> int:
    return max(1, min(MAX_ATOM_BLOCK, BLOCK_FLOATS // head_dim, n_atoms))


def metric_rows(head_dim: int, lanes: int) -> int:
    """Rows of the metric per metric-kernel dispatch: the same body size as an atom block,
    a multiple of the vec4 width (its stores are whole elements), at most head_dim."""
    return min(head_dim, max(lanes, BLOCK_FLOATS // head_dim // lanes * lanes))


def pick_loop_iterations(head_dim: int, s: int, n_atoms: int, block: int, residual_bits: int) -> int:
    """An upper bound of the loop iterations of one pick-kernel invocation (one dispatch):
    the block reduction, the duplicate check and fallback, Gram–Schmidt, and after the last
    step the back-substitution, packing and the residual stage's loops."""
    omp = n_blocks(n_atoms, block) + 6 * s + s * s + 64
    res = (s + 64 + (head_dim * residual_bits + 31) // 32) if residual_bits else 0
    return omp + res


def step_multipliers(bits: int) -> np.ndarray:
    """What residual.quantise multiplies to get its candidate steps, in its order: the RMS
    by 2·m/2^b for each of its clip multipliers m, then max|u| by 2/(2^b − 1) (1 for one
    bit). Read from residual.py itself, so the two can never disagree on the list."""
    levels_max = (1 << bits) - 1
    mults = [2.0 * float(m) / (levels_max + 1) for m in residual._CLIP_MULTIPLIERS]
    return np.array(mults + [2.0 / levels_max if levels_max > 1 else 1.0], np.float64)


def df64(values) -> np.ndarray:
    """float64 values → (…, 2) float32 (hi, lo) with hi + lo = value to ~2^-48."""
    v = np.asarray(values, np.float64)
    hi = v.astype(np.float32)
    lo = (v - hi.astype(np.float64)).astype(np.float32)
    return np.stack([hi, lo], axis=-1)


@dataclass(frozen=True)
class DictImage:
    words: np.ndarray  # uint32, a multiple of 4 words
    offsets: dict  # push-constant name → first word of the block
    n_steps: int  # residual step candidates (0 without a residual stage)
    atoms_pad: int  # atoms per head in the unit-atom blocks (n_atoms padded to whole blocks)


def dictionary_image(d: StreamDict, block: int, transposed: bool = False) -> DictImage:
    g, k, hd = d.atoms.shape
    mapped = d.atoms.astype(np.float64)
    if d.metric is not None:
        mapped = mapped @ d.metric.astype(np.float64).T
    norms = np.linalg.norm(mapped, axis=2)
    live = norms > 0
    inv = np.where(live, 1.0 / np.where(live, norms, 1.0), 0.0)
    pad = n_blocks(k, block) * block
    if transposed:  # the vector kernel reads the transposed rows as vec4s
        pad = -(-pad // 4) * 4
    unit = np.zeros((g, pad, hd), np.float32)
    unit[:, :k] = mapped * inv[..., None]
    empty = np.zeros(0, np.float32)
    blocks = {"atoms_word": unit, "atoms_t_word": unit.transpose(0, 2, 1) if transposed else empty,
              "inv_norm_word": inv,
              "mean_word": np.zeros((g, hd)) if d.mean is None else d.mean,
              "metric_word": empty if d.metric is None else d.metric,
              "raw_atoms_word": empty, "scale_word": empty, "steps_word": empty}
    n_steps = 0
    if d.residual_bits:
        steps = step_multipliers(d.residual_bits)
        n_steps = steps.size
        blocks.update(raw_atoms_word=d.atoms, steps_word=df64(steps),
                      scale_word=df64(1.0 / d.residual_scale.astype(np.float64)))
    offsets, parts, cursor = {}, [], 0
    for name, arr in blocks.items():
        flat = np.ascontiguousarray(arr, np.float32).reshape(-1).view(np.uint32)
        offsets[name] = cursor
        parts += [flat, np.zeros(-flat.size % 4, np.uint32)]
        cursor += flat.size + (-flat.size % 4)
    return DictImage(np.concatenate(parts), offsets, n_steps, unit.shape[1])


def state_sizes(d: StreamDict, block: int, capacity: int) -> dict:
    """Words of the encoder's work buffers for ``capacity`` vectors per dispatch batch."""
    hd, s = d.head_dim, d.sparsity
    return {"state_elems": capacity * hd * (1 + s),  # residuals, then the bases
            "state_words": capacity * state_words(s),
            "keys": 2 * capacity * n_blocks(d.n_atoms, block),
            "out": capacity * d.slot_words}


def batch_capacity(d: StreamDict, block: int, cap_words: int, tile: int) -> int:
    """Vectors per batch: as many as keep every work buffer ≤ cap_words, a multiple of the
    tile, at most 4096 (a batch is one submission; more buys nothing)."""
    per_vector = max(state_sizes(d, block, 1).values())
    n = min(4096, cap_words // per_vector)
    return max(tile, n - n % tile)
