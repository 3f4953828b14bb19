"""The vector form of the GPU OMP encoder (shaders/omp_encode_vector.comp): its launch shape,
used by :class:`kvdict_vk.vk.encode.tiled.TiledKernels` for batches of few vectors per
dictionary head.

Why a second kernel: a decode step encodes one token per KV head. In the tiled kernel such a
batch is one 4-vector tile per dictionary head with one live lane, and each vector's serial
work — Gram–Schmidt against its basis, the back-substitution, the residual stage's 64-element
loops in df64 — runs in one invocation while the rest of the workgroup waits. The vector
kernel gives each vector a workgroup and spreads all of that work over it; the correlations
take 4 adjacent atoms per invocation, one vec4 load per dimension, coalesced from the
transposed image (about two and a half times faster for a decode step's token:
lab/NOTEBOOK.md, "The GPU encoder"; docs/BENCHMARKS.md, "Encode").

The shape (workgroup size, partial-sum widths) is chosen from the device's limits, so no
optional feature is needed; where the shared arrays do not fit, there is no vector form and
the tiled kernel's smallest tile takes those batches.
"""
from __future__ import annotations

from dataclasses import dataclass

LOCALS = (256, 128, 64)  # workgroup sizes tried, largest first (powers of two: the trees)
ATOMS_PER = 4  # the shader's atoms per invocation per pass (one vec4 load per dimension)
SHARED_BUDGET = 48 * 1024  # bytes: at most this much of the device's shared memory
# Batches with at most this many vectors per dictionary head take the vector form (a
# workgroup per vector); larger ones the tiled kernel (where the two met on the H200:
# lab/NOTEBOOK.md, "The GPU encoder").
MAX_PER_HEAD = 32


@dataclass(frozen=True)
class VectorShape:
    local: int  # invocations per workgroup
    sum_f: int  # partial sums per float reduction (dot products, norms)
    sum_d: int  # partial sums per df64 reduction (the residual stage's); 0 without one


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _log2(n: int) -> int:
    return max(0, n.bit_length() - 1)


def shared_bytes(head_dim: int, sparsity: int, shape: VectorShape, n_steps: int) -> int:
    """Shared memory of one workgroup (the shader's shared arrays; n_steps 0: no residual stage)."""
    d, s, local = head_dim, sparsity, shape.local
    words = 2 * d + s * d + s * s + 2 * s + 2 * local + (s + 2) * shape.sum_f
    residual = 4 * s + 16 * d + 16 * shape.sum_d + 8 * n_steps * shape.sum_d if n_steps else 0
    return 4 * words + residual


def candidate_shapes(device, head_dim: int, sparsity: int, n_steps: int) -> list:
    """The shapes vector_shape tries, in its order: each workgroup size the device allows,
    largest first, with as many partials as the widest reduction (s − 1 dot products, or two
    norms; the N_STEPS candidate errors) gives each invocation at most one, and no more
    partials than there are elements."""
    max_local = min(device.limit("max_compute_work_group_invocations"),
                    device.limit("max_compute_work_group_size")[0])
    return [VectorShape(local, _pow2_floor(min(head_dim, local // max(2, sparsity - 1))),
                        _pow2_floor(min(head_dim, local // n_steps)) if n_steps else 0)
            for local in LOCALS if local <= max_local]


def vector_shape(device, head_dim: int, sparsity: int, n_steps: int) -> VectorShape | None:
    """The first candidate shape whose shared arrays fit the device; None when none does."""
    budget = min(SHARED_BUDGET, device.limit("max_compute_shared_memory_size"))
    return next((shape for shape in candidate_shapes(device, head_dim, sparsity, n_steps)
                 if shared_bytes(head_dim, sparsity, shape, n_steps) <= budget), None)


def spec(stream, shape: VectorShape, n_steps: int) -> dict:
    """Specialization constants of omp_encode_vector for this stream and shape."""
    out = {"DIM": stream.head_dim, "SPARSITY": stream.sparsity, "LOCAL": shape.local, "SUM_F": shape.sum_f,
           "METRIC": int(stream.metric is not None)}
    if stream.residual_bits:
        out.update(RESIDUAL_BITS=stream.residual_bits, N_STEPS=n_steps, SUM_D=shape.sum_d)
    return out


def loop_iterations(head_dim: int, s: int, n_atoms: int, shape: VectorShape, residual_bits: int,
                    n_steps: int, metric: bool, items_per_workgroup: int) -> int:
    """An upper bound of one invocation's loop iterations (llvmpipe's cap), counting every
    loop as if none were unrolled."""
    d, local, sf, sd = head_dim, shape.local, shape.sum_f, shape.sum_d
    per = lambda n: -(-n // local)  # a strided loop's iterations
    init = per(d) * (2 + (d if metric else 0))
    tree_f = lambda segs: _log2(sf) * (1 + per(segs * sf // 2)) + 1
    gs_pass = per(s * sf) * -(-d // sf) + tree_f(s) + per(d) * s + 1
    norms = per(2 * sf) * -(-d // sf) + tree_f(2)
    step = (-(-n_atoms // (ATOMS_PER * local)) * (d * ATOMS_PER + ATOMS_PER) + _log2(local) + 2 * s + s * s
            + 2 * (gs_pass + norms) + per(d))
    finish = s * s + 2 * s
    res = 0
    if residual_bits:
        tree_d = lambda segs: _log2(sd) * (1 + per(segs * sd // 2)) + 1
        res = (per(d) * 2 * s + per(sd) * -(-d // sd) + tree_d(1) + per(n_steps * sd) * -(-d // sd) + tree_d(n_steps)
               + n_steps + per(d) + per(-(-d * residual_bits // 32) + 1) * (32 // residual_bits + 2))
    return items_per_workgroup * (init + s * step + finish + res)
