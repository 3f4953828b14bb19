#version 450
// GPU OMP encoder shaped for GPUs: every OMP step of a tile of TILE_VECTORS vectors (one
// dictionary head's) in one workgroup, one dispatch per batch, the slots written straight
// into the destination. Semantics of codec.omp / codec.encode, as omp_encode_pick.comp
// (whose step-per-dispatch form is what llvmpipe runs well, encode_common.glsl):
//   r = W (x - mean) in shared memory, [DIM][TILE_VECTORS] floats;
//   per step: the correlations of all the tile's residuals with all atoms as a tiled matrix
//     product — atom tiles of ATOM_TILE atoms x CHUNK_DIMS dimensions staged in shared memory
//     from the transposed unit-atom image (coalesced), each invocation a 4 vectors x 4 atoms
//     block of accumulators — the best atom per vector by codec.omp's order (|c|, c >= 0,
//     lowest index), reduced over the atom groups by a tree in shared memory; then one invocation
//     per vector: distinct indices, Gram-Schmidt against its basis (kept in the state buffer,
//     interleaved by vector so the loads coalesce), r -= <q, r> q in shared memory;
//   after the last step: one invocation per vector solves R c = z and writes the code words;
//     the residual stage (RESIDUAL=1, encode_residual.glsl: bit-for-bit residual.quantise)
//     spread over invocations: u in df64 by (vector, element) into shared memory, its RMS
//     and largest magnitude by vector, the N_STEPS candidate steps by (vector, candidate),
//     then per vector the best candidate's levels and step.
// Float32 throughout (the correlations sum in another order than codec.omp's float32 GEMM,
// the coefficients are float32 where codec's are float64), except the residual stage (df64).
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

layout(constant_id = 0) const uint DIM = 64u;
layout(constant_id = 1) const uint SPARSITY = 8u;
layout(constant_id = 2) const uint TILE_VECTORS = 64u;  // vectors per workgroup, a multiple of 4
layout(local_size_x = 64, local_size_x_id = 3) in;
// dimensions per staged atom tile (divides DIM); 0: no staging, each invocation reads its
// atoms straight from the image (one-vector tiles: staging would buy no reuse)
layout(constant_id = 4) const uint CHUNK_DIMS = 64u;
layout(constant_id = 5) const uint METRIC = 0u;         // 1: r = W (x - mean), W at metric_word
#ifndef RESIDUAL
#define RESIDUAL 0
#endif
#if RESIDUAL
layout(constant_id = 6) const uint RESIDUAL_BITS = 4u;
layout(constant_id = 7) const uint N_STEPS = 15u;
const uint LEVEL_WORDS = SLOT_LEVEL_WORDS_OF(DIM, RESIDUAL_BITS);
const uint SLOT_WORDS = SLOT_WORDS_OF(SPARSITY, DIM, RESIDUAL_BITS);
#else
const uint SLOT_WORDS = SPARSITY;
#endif
const uint LOCAL = gl_WorkGroupSize.x;
const uint DIM_ELEMS = DIM / LANES;
const uint VGROUPS = TILE_VECTORS / 4u;    // vector groups (host: LOCAL % VGROUPS == 0)
const uint AGROUPS = LOCAL / VGROUPS;      // atom groups
const uint ATOM_TILE = 4u * AGROUPS;       // atoms per staged tile
// Per-vector state words (interleaved: word w of tile vector lv at w*TILE_VECTORS + lv),
// each read and written by its vector's invocation only: R (s x s, upper triangle), z (s),
// atom indices (s).
const uint Z_AT = SPARSITY * SPARSITY;
const uint IDX_AT = Z_AT + SPARSITY;
const uint STATE_WORDS = IDX_AT + SPARSITY;
const uint A_SH = CHUNK_DIMS > 0u ? CHUNK_DIMS * AGROUPS : 1u;

layout(std430, binding = 0) readonly buffer InputElems { FELEM x_elems[]; };  // vector v at x_word + v*DIM
layout(std430, binding = 1) readonly buffer DictElems { FELEM dict_elems[]; };
layout(std430, binding = 2) readonly buffer DictFloats { float dict_floats[]; };
// Work state, a region per workgroup (from word 0): the bases and the bookkeeping words,
// each vector's read and written by its own invocation only (no coherence needed).
layout(std430, binding = 3) buffer StateFloats { float basis_floats[]; };
layout(std430, binding = 4) buffer StateWords { uint state_words[]; };
layout(std430, binding = 5) writeonly buffer Dest { uint dest_words[]; };

#include "encode_common.glsl"
#if RESIDUAL
#include "encode_df64.glsl"
#include "encode_residual.glsl"
#endif

shared vec4 r_sh[DIM * VGROUPS];            // r[d][lv] as [d][lv / 4][lv % 4]
shared vec4 a_sh[A_SH];                     // atom tile, [d][atom / 4][atom % 4]
shared float best_c_sh[TILE_VECTORS * AGROUPS];
shared uint best_i_sh[TILE_VECTORS * AGROUPS];
#if RESIDUAL
shared uint code_sh[TILE_VECTORS * SPARSITY];  // the code words, for the residual stage
shared vec2 u_sh[DIM * TILE_VECTORS];          // the residual stage's u, [d][lv], df64
shared vec2 spread_sh[2u * TILE_VECTORS];      // its RMS and largest magnitude per vector
shared vec2 cand_err_sh[TILE_VECTORS * N_STEPS];
shared float cand_step_sh[TILE_VECTORS * N_STEPS];
#endif

float r_get(uint d, uint lv) { return r_sh[d * VGROUPS + (lv >> 2u)][lv & 3u]; }
void r_set(uint d, uint lv, float v) { r_sh[d * VGROUPS + (lv >> 2u)][lv & 3u] = v; }
uint sw_at(uint wg_state, uint w, uint lv) { return wg_state + w * TILE_VECTORS + lv; }
float x_at(uint v, uint d) { return elem_at(X_ELEM((v * DIM + d) / LANES), d % LANES); }

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint vg = tid % VGROUPS, ag = tid / VGROUPS;
    // vectors of one dictionary head: all of them when shared (per_head 0), else a KV head's
    uint groups = pc.per_head != 0u ? pc.n_vectors / pc.n_tok : 1u;
    uint per_group = pc.per_head != 0u ? pc.n_tok : pc.n_vectors;
    uint tiles = (per_group + TILE_VECTORS - 1u) / TILE_VECTORS;
    uint wg_state = gl_WorkGroupID.x * STATE_WORDS * TILE_VECTORS;  // this workgroup's state
    uint wg_basis = gl_WorkGroupID.x * SPARSITY * DIM * TILE_VECTORS;
    uint n_blocks_words = pc.atoms_pad * DIM;  // words of one head's atoms (either image)

    for (uint item = gl_WorkGroupID.x; item < groups * tiles; item += gl_NumWorkGroups.x) {
        uint dict_head = item / tiles;
        uint first = dict_head * per_group + (item % tiles) * TILE_VECTORS;  // batch vector of lane 0
        uint n_live = min(TILE_VECTORS, dict_head * per_group + per_group - first);
        uint atoms_t = pc.atoms_t_word + dict_head * n_blocks_words;  // [DIM][atoms_pad]
        uint atoms_rows = pc.atoms_word / LANES + dict_head * n_blocks_words / LANES;

        // r = W (x - mean); lanes past n_live hold 0 (their picks are never used)
        barrier();  // the previous item's readers of r_sh are done
        uint mean_f = pc.mean_word + dict_head * DIM;
        if (METRIC == 0u) {
            for (uint x = tid; x < DIM * TILE_VECTORS; x += LOCAL) {
                uint d = x / TILE_VECTORS, lv = x % TILE_VECTORS;
                r_set(d, lv, lv < n_live ? x_at(first + lv, d) - dict_floats[mean_f + d] : 0.0);
            }
        } else if (tid < TILE_VECTORS) {
            uint lv = tid;
            float centred[DIM];
            [[unroll]] for (uint d = 0u; d < DIM; ++d)
                centred[d] = lv < n_live ? x_at(first + lv, d) - dict_floats[mean_f + d] : 0.0;
            for (uint row = 0u; row < DIM; ++row) {
                float acc = 0.0;
                [[unroll]] for (uint e = 0u; e < DIM; ++e)
                    acc += dict_floats[pc.metric_word + row * DIM + e] * centred[e];
                r_set(row, lv, acc);
            }
        }

        for (uint k = 0u; k < SPARSITY; ++k) {
            // 1. correlations, tile by tile; each invocation keeps its 4 vectors' best
            float bc[4];
            uint bi[4];
            [[unroll]] for (uint i = 0u; i < 4u; ++i) {
                bc[i] = 0.0;
                bi[i] = 0xFFFFFFFFu;  // no atom seen yet (an atom group may have none)
            }
            for (uint a0 = 0u; a0 < pc.n_atoms; a0 += ATOM_TILE) {
                vec4 acc[4];
                [[unroll]] for (uint i = 0u; i < 4u; ++i)
                    acc[i] = vec4(0.0);
                if (CHUNK_DIMS == 0u) {  // straight from the image: coalesced across the atom groups
                    barrier();  // the pick's r updates are done (a uniform branch: a constant)
                    uint a = a0 + 4u * ag;
                    [[unroll]] for (uint d = 0u; d < DIM; ++d) {  // the loads in flight together
                        uint w = atoms_t + d * pc.atoms_pad + a;
                        vec4 av;
                        [[unroll]] for (uint j = 0u; j < 4u; ++j)
                            av[j] = a + j < pc.n_atoms ? dict_floats[w + j] : 0.0;
                        vec4 rv = r_sh[d * VGROUPS + vg];
                        acc[0] += rv.x * av;
                        acc[1] += rv.y * av;
                        acc[2] += rv.z * av;
                        acc[3] += rv.w * av;
                    }
                }
                for (uint d0 = 0u; d0 < DIM && CHUNK_DIMS > 0u; d0 += max(CHUNK_DIMS, 1u)) {
                    barrier();  // the previous chunk's (or the pick's) readers are done
                    for (uint x = tid; x < CHUNK_DIMS * ATOM_TILE; x += LOCAL) {
                        uint d = x / ATOM_TILE, a = x % ATOM_TILE;
                        float w = a0 + a < pc.n_atoms ? dict_floats[atoms_t + (d0 + d) * pc.atoms_pad + a0 + a] : 0.0;
                        a_sh[d * AGROUPS + (a >> 2u)][a & 3u] = w;
                    }
                    barrier();
                    for (uint d = 0u; d < CHUNK_DIMS; ++d) {
                        vec4 rv = r_sh[(d0 + d) * VGROUPS + vg];
                        vec4 av = a_sh[d * AGROUPS + ag];
                        acc[0] += rv.x * av;
                        acc[1] += rv.y * av;
                        acc[2] += rv.z * av;
                        acc[3] += rv.w * av;
                    }
                }
                [[unroll]] for (uint i = 0u; i < 4u; ++i)
                    [[unroll]] for (uint j = 0u; j < 4u; ++j) {
                        uint a = a0 + 4u * ag + j;
                        if (a < pc.n_atoms && (bi[i] == 0xFFFFFFFFu || key_beats(acc[i][j], a, bc[i], bi[i]))) {
                            bc[i] = acc[i][j];
                            bi[i] = a;
                        }
                    }
            }
            [[unroll]] for (uint i = 0u; i < 4u; ++i) {
                best_c_sh[(4u * vg + i) * AGROUPS + ag] = bc[i];
                best_i_sh[(4u * vg + i) * AGROUPS + ag] = bi[i];
            }
            for (uint width = AGROUPS / 2u; width > 0u; width >>= 1u) {  // the groups' best, a tree
                barrier();
                for (uint x = tid; x < TILE_VECTORS * width; x += LOCAL) {
                    uint at = (x / width) * AGROUPS + x % width;
                    uint gi = best_i_sh[at + width];
                    if (gi != 0xFFFFFFFFu && (best_i_sh[at] == 0xFFFFFFFFu
                                              || key_beats(best_c_sh[at + width], gi, best_c_sh[at], best_i_sh[at]))) {
                        best_c_sh[at] = best_c_sh[at + width];
                        best_i_sh[at] = gi;
                    }
                }
            }
            barrier();

            // 2. one invocation per vector: its pick, Gram-Schmidt, the residual update
            if (tid < n_live) {
                uint lv = tid;
                uint pick = best_i_sh[lv * AGROUPS];  // group 0 holds atom 0: never empty
                bool dup = false;
                for (uint i = 0u; i < k; ++i)
                    dup = dup || state_words[sw_at(wg_state, IDX_AT + i, lv)] == pick;
                if (dup) {  // the lowest index not chosen yet (<= k: k indices are taken)
                    pick = 0u;
                    for (uint cand = 0u; cand <= k; ++cand) {
                        bool taken = false;
                        for (uint i = 0u; i < k; ++i)
                            taken = taken || state_words[sw_at(wg_state, IDX_AT + i, lv)] == cand;
                        if (!taken) {
                            pick = cand;
                            break;
                        }
                    }
                }
                state_words[sw_at(wg_state, IDX_AT + k, lv)] = pick;

                float a[DIM];
                [[unroll]] for (uint e = 0u; e < DIM_ELEMS; ++e) {
                    FELEM w = dict_elems[atoms_rows + pick * DIM_ELEMS + e];
                    [[unroll]] for (uint cc = 0u; cc < LANES; ++cc)
                        a[e * LANES + cc] = elem_at(w, cc);
                }
                [[dont_unroll]] for (uint pass = 0u; pass < 2u; ++pass) {
                    if (pass == 1u) {  // "twice is enough", where the first pass cancelled a lot
                        float left = 0.0;
                        [[unroll]] for (uint e = 0u; e < DIM; ++e)
                            left += a[e] * a[e];
                        if (k == 0u || left >= 0.5)
                            break;
                    }
                    for (uint i = 0u; i < k; ++i) {
                        uint q0 = wg_basis + i * DIM * TILE_VECTORS + lv;
                        float h = 0.0;
                        [[unroll]] for (uint e = 0u; e < DIM; ++e)
                            h += basis_floats[q0 + e * TILE_VECTORS] * a[e];
                        [[unroll]] for (uint e = 0u; e < DIM; ++e)
                            a[e] -= h * basis_floats[q0 + e * TILE_VECTORS];
                        uint rw = sw_at(wg_state, i * SPARSITY + k, lv);
                        state_words[rw] = floatBitsToUint(pass == 0u ? h : uintBitsToFloat(state_words[rw]) + h);
                    }
                }
                float nu2 = 0.0;
                [[unroll]] for (uint e = 0u; e < DIM; ++e)
                    nu2 += a[e] * a[e];
                bool independent = nu2 > DEPENDENT_NU2;
                float nu = independent ? sqrt(nu2) : 0.0;
                float inv_nu = independent ? 1.0 / nu : 0.0;
                state_words[sw_at(wg_state, k * SPARSITY + k, lv)] = floatBitsToUint(nu);
                float zk = 0.0;
                uint qk = wg_basis + k * DIM * TILE_VECTORS + lv;
                [[unroll]] for (uint e = 0u; e < DIM; ++e) {
                    a[e] *= inv_nu;
                    basis_floats[qk + e * TILE_VECTORS] = a[e];
                    zk += a[e] * r_get(e, lv);
                }
                [[unroll]] for (uint e = 0u; e < DIM; ++e)
                    r_set(e, lv, r_get(e, lv) - zk * a[e]);
                state_words[sw_at(wg_state, Z_AT + k, lv)] = floatBitsToUint(zk);
            }
            // (the next step's first barrier orders these r_sh writes before its reads)
        }

        // 3. the coefficients (back-substitution; a dependent atom's is 0) and the code words
        uint norm_f = pc.inv_norm_word + dict_head * pc.n_atoms;
        if (tid < n_live) {
            uint lv = tid, v = first + lv;
            uint head = v / pc.n_tok, token = v - head * pc.n_tok;
            uint slot = pc.dst_word + (head * pc.n_ctx + pc.t0 + token) * SLOT_WORDS;
            float coef[SPARSITY];
            for (uint kk = SPARSITY; kk > 0u; --kk) {
                uint k = kk - 1u;
                float acc = uintBitsToFloat(state_words[sw_at(wg_state, Z_AT + k, lv)]);
                for (uint j = k + 1u; j < SPARSITY; ++j)
                    acc -= uintBitsToFloat(state_words[sw_at(wg_state, k * SPARSITY + j, lv)]) * coef[j];
                float dkk = uintBitsToFloat(state_words[sw_at(wg_state, k * SPARSITY + k, lv)]);
                coef[k] = dkk > 0.0 ? acc / dkk : 0.0;
            }
            for (uint k = 0u; k < SPARSITY; ++k) {
                uint idx = state_words[sw_at(wg_state, IDX_AT + k, lv)];
                uint word = code_word(idx, coef[k] * dict_floats[norm_f + idx]);  // the caller's atoms
                dest_words[slot + k] = word;
#if RESIDUAL
                code_sh[lv * SPARSITY + k] = word;
#endif
            }
        }
#if RESIDUAL
        barrier();  // the code words are in shared memory
        // 4. the residual stage: u by (vector, element), its spread by vector, the candidate
        //    steps by (vector, candidate), then the winners' levels by vector
        for (uint x = tid; x < n_live * DIM; x += LOCAL) {
            uint e = x / n_live, lv = x % n_live;
            uint idx[SPARSITY];
            float coef16[SPARSITY];
            for (uint k = 0u; k < SPARSITY; ++k) {  // what the decoder will use
                idx[k] = code_atom(code_sh[lv * SPARSITY + k]);
                coef16[k] = code_coef(code_sh[lv * SPARSITY + k]);
            }
            u_sh[e * TILE_VECTORS + lv] = residual_element(dict_head, first + lv, e, idx, coef16);
        }
        barrier();
        if (tid < n_live) {
            vec2 u[DIM];
            [[unroll]] for (uint e = 0u; e < DIM; ++e)
                u[e] = u_sh[e * TILE_VECTORS + tid];
            residual_spread(u, spread_sh[2u * tid], spread_sh[2u * tid + 1u]);
        }
        barrier();
        for (uint x = tid; x < n_live * N_STEPS; x += LOCAL) {
            uint lv = x / N_STEPS, s = x % N_STEPS;
            vec2 u[DIM];
            [[unroll]] for (uint e = 0u; e < DIM; ++e)
                u[e] = u_sh[e * TILE_VECTORS + lv];
            vec2 err;
            cand_step_sh[lv * N_STEPS + s] = residual_candidate(s, u, spread_sh[2u * lv], spread_sh[2u * lv + 1u], err);
            cand_err_sh[lv * N_STEPS + s] = err;
        }
        barrier();
        if (tid < n_live) {
            uint lv = tid, v = first + lv;
            uint head = v / pc.n_tok, token = v - head * pc.n_tok;
            uint slot = pc.dst_word + (head * pc.n_ctx + pc.t0 + token) * SLOT_WORDS;
            uint best = 0u;
            for (uint s = 1u; s < N_STEPS; ++s)  // strictly smaller wins: the first on a tie
                if (df_less(cand_err_sh[lv * N_STEPS + s], cand_err_sh[lv * N_STEPS + best]))
                    best = s;
            vec2 u[DIM];
            [[unroll]] for (uint e = 0u; e < DIM; ++e)
                u[e] = u_sh[e * TILE_VECTORS + lv];
            residual_write(u, cand_step_sh[lv * N_STEPS + best], slot + SPARSITY);
        }
#endif
        barrier();  // this item's shared memory is read before the next item reuses it
    }
}
