#version 450
// GPU OMP encoder for batches of few vectors per dictionary head (a decode step's): one
// workgroup per vector, every OMP step and the residual stage in one dispatch, the slots
// written straight into the destination. Semantics of codec.omp / codec.encode, as
// omp_encode_tiled.comp; where that kernel spreads a tile's vectors over invocations and
// leaves each vector's serial work (Gram-Schmidt, the residual stage) to one invocation,
// here every part of one vector's work is spread over the workgroup:
//   r = W (x - mean) in shared memory;
//   per step: the correlations with all atoms, 4 LOCAL atoms at a time (4 adjacent ones per
//     invocation, one vec4 load per dimension from the transposed unit-atom image, whose rows
//     are padded to whole vec4s: coalesced, and a quarter of the load instructions of scalar
//     loads — measured on the H200, the correlations were ~40 % of a decode token's time with
//     scalar loads), the best atom by codec.omp's
//     order (|c|, c >= 0, lowest index) reduced by a tree over the invocations; then the
//     atom's Gram-Schmidt against the basis (classical, repeated once where it cancelled
//     more than half the norm: "twice is enough"), every dot product and norm as a sum
//     over SUM_F strided partial sums and a tree, the element updates by element;
//   after the last step: the coefficients (back-substitution, one invocation: s x s) and the
//     code words; the residual stage (RESIDUAL=1, encode_residual.glsl: residual.quantise's
//     choices) with u by element, its RMS and largest magnitude and the N_STEPS candidate
//     errors as sums over SUM_D strided partials and a tree, the levels by element, packed by
//     level word.
// Float32 except the residual stage (df64), as the tiled kernel; sums run in another order
// than its (and codec.omp's), so near-ties may pick differently (the tests' agreement bound).
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

layout(constant_id = 0) const uint DIM = 64u;
layout(constant_id = 1) const uint SPARSITY = 8u;
layout(local_size_x = 64, local_size_x_id = 2) in;  // a power of two (the trees)
layout(constant_id = 3) const uint SUM_F = 16u;     // partial sums per float reduction, a power of two
layout(constant_id = 4) const uint METRIC = 0u;     // 1: r = W (x - mean), W at metric_word
#ifndef RESIDUAL
#define RESIDUAL 0
#endif
#if RESIDUAL
layout(constant_id = 5) const uint RESIDUAL_BITS = 4u;
layout(constant_id = 6) const uint N_STEPS = 15u;
layout(constant_id = 7) const uint SUM_D = 16u;     // partial sums per candidate error, a power of two
const uint LEVEL_WORDS = SLOT_LEVEL_WORDS_OF(DIM, RESIDUAL_BITS);
const uint SLOT_WORDS = SLOT_WORDS_OF(SPARSITY, DIM, RESIDUAL_BITS);
#else
const uint SLOT_WORDS = SPARSITY;
#endif
const uint LOCAL = gl_WorkGroupSize.x;
const uint SEGMENTS_F = SPARSITY + 2u;  // float sums at once: <= SPARSITY - 1 dots, or 2 norms
const uint NONE = 0xFFFFFFFFu;

layout(std430, binding = 0) readonly buffer InputElems { FELEM x_elems[]; };  // vector v at x_word + v*DIM
layout(std430, binding = 1) readonly buffer DictFloats { float dict_floats[]; };
layout(std430, binding = 2) readonly buffer DictVec4 { vec4 dict_vec4[]; };  // the same image
layout(std430, binding = 3) writeonly buffer Dest { uint dest_words[]; };

#include "encode_common.glsl"
#if RESIDUAL
#include "encode_df64.glsl"
#include "encode_residual.glsl"
#endif

shared float r_sh[DIM];                      // the residual r
shared float a_sh[DIM];                      // the picked atom, as it is orthogonalised
shared float q_sh[SPARSITY * DIM];           // the orthonormal basis, q_k at k*DIM
shared float rr_sh[SPARSITY * SPARSITY];     // R (upper triangle), row-major
shared float z_sh[SPARSITY];                 // z_k = <q_k, r>
shared uint idx_sh[SPARSITY];                // the picked atoms
shared float best_c_sh[LOCAL];
shared uint best_i_sh[LOCAL];
shared float sum_sh[SEGMENTS_F * SUM_F];     // float partial sums, segment g at g*SUM_F
#if RESIDUAL
shared uint code_sh[SPARSITY];
shared float x_sh[DIM];                      // x, kept from the start (the input may be host memory)
shared vec2 u_sh[DIM];
shared uint level_sh[DIM];                   // the winner's levels
shared vec2 sq_sh[SUM_D];                    // partial sums of u^2
shared vec2 max_sh[SUM_D];                   // partial maxima of |u|
shared vec2 err_sh[N_STEPS * SUM_D];         // partial candidate errors, candidate s at s*SUM_D
#endif

float x_at(uint v, uint d) { return elem_at(X_ELEM((v * DIM + d) / LANES), d % LANES); }

// Sums the SUM_F partials of each of the first n_seg segments of sum_sh into its first
// word, by a tree; on return every invocation may read them. Uniform control flow only.
void tree_sum_f(uint n_seg) {
    for (uint width = SUM_F / 2u; width > 0u; width >>= 1u) {
        barrier();
        for (uint x = gl_LocalInvocationID.x; x < n_seg * width; x += LOCAL) {
            uint at = (x / width) * SUM_F + x % width;
            sum_sh[at] += sum_sh[at + width];
        }
    }
    barrier();
}

// h_i = <q_i, a> for i < k (one segment each), then a -= sum_i h_i q_i; R[i][k] gets h_i
// (pass 0) or h_i added (pass 1).
void orthogonalise(uint k, uint pass) {
    const uint tid = gl_LocalInvocationID.x;
    for (uint x = tid; x < k * SUM_F; x += LOCAL) {
        uint i = x / SUM_F, c = x % SUM_F;
        float acc = 0.0;
        for (uint e = c; e < DIM; e += SUM_F)
            acc += q_sh[i * DIM + e] * a_sh[e];
        sum_sh[x] = acc;
    }
    tree_sum_f(k);
    for (uint e = tid; e < DIM; e += LOCAL) {
        float ae = a_sh[e];
        for (uint i = 0u; i < k; ++i)
            ae -= sum_sh[i * SUM_F] * q_sh[i * DIM + e];
        a_sh[e] = ae;
    }
    if (tid < k)
        rr_sh[tid * SPARSITY + k] = pass == 0u ? sum_sh[tid * SUM_F] : rr_sh[tid * SPARSITY + k] + sum_sh[tid * SUM_F];
    barrier();
}

// sum_sh segment 0: |a|^2, segment 1: <a, r>.
void atom_norms() {
    for (uint x = gl_LocalInvocationID.x; x < 2u * SUM_F; x += LOCAL) {
        uint c = x % SUM_F;
        bool dot_r = x >= SUM_F;
        float acc = 0.0;
        for (uint e = c; e < DIM; e += SUM_F)
            acc += a_sh[e] * (dot_r ? r_sh[e] : a_sh[e]);
        sum_sh[x] = acc;
    }
    tree_sum_f(2u);
}

#if RESIDUAL
// Level word w of the winner, from its levels in shared memory.
uint residual_level_word(uint w) {
    uint word = 0u;
    for (uint e = residual_word_first(w); e < residual_word_end(w); ++e)
        word |= residual_level_bits(level_sh[e], e, w);
    return word;
}

// Each candidate's squared error, summed into err_sh[s * SUM_D] (and u's spread first).
void residual_errors(out vec2 rms, out vec2 amax) {
    const uint tid = gl_LocalInvocationID.x;
    for (uint c = tid; c < SUM_D; c += LOCAL) {
        vec2 sq = vec2(0.0), mx = vec2(0.0);
        for (uint e = c; e < DIM; e += SUM_D) {
            vec2 u = u_sh[e];
            sq = df_add(sq, df_mul(u, u));
            vec2 mag = df_abs(u);
            if (df_less(mx, mag))
                mx = mag;
        }
        sq_sh[c] = sq;
        max_sh[c] = mx;
    }
    for (uint width = SUM_D / 2u; width > 0u; width >>= 1u) {
        barrier();
        for (uint c = tid; c < width; c += LOCAL) {
            sq_sh[c] = df_add(sq_sh[c], sq_sh[c + width]);
            if (df_less(max_sh[c], max_sh[c + width]))
                max_sh[c] = max_sh[c + width];
        }
    }
    barrier();
    rms = residual_rms(sq_sh[0]);
    amax = max_sh[0];
    for (uint x = tid; x < N_STEPS * SUM_D; x += LOCAL) {
        uint s = x / SUM_D, c = x % SUM_D;
        float step = residual_step(s, rms, amax);
        vec2 inv_step = df_recip(step > 0.0 ? step : 1.0);
        vec2 err = vec2(0.0);
        for (uint e = c; e < DIM; e += SUM_D)
            err = df_add(err, residual_error_term(u_sh[e], step, inv_step));
        err_sh[x] = err;
    }
    for (uint width = SUM_D / 2u; width > 0u; width >>= 1u) {
        barrier();
        for (uint x = tid; x < N_STEPS * width; x += LOCAL) {
            uint at = (x / width) * SUM_D + x % width;
            err_sh[at] = df_add(err_sh[at], err_sh[at + width]);
        }
    }
    barrier();
}
#endif

void main() {
    const uint tid = gl_LocalInvocationID.x;
    for (uint v = gl_WorkGroupID.x; v < pc.n_vectors; v += gl_NumWorkGroups.x) {
        // vectors of one dictionary head: all of them when shared (per_head 0), else a KV head's
        uint dict_head = pc.per_head != 0u ? v / pc.n_tok : 0u;
        uint atoms_t = pc.atoms_t_word + dict_head * pc.atoms_pad * DIM;  // [DIM][atoms_pad]
        uint mean_f = pc.mean_word + dict_head * DIM;

        barrier();  // the previous vector's readers of shared memory are done
        for (uint e = tid; e < DIM; e += LOCAL) {
            float xe = x_at(v, e);
#if RESIDUAL
            x_sh[e] = xe;
#endif
            if (METRIC == 0u)
                r_sh[e] = xe - dict_floats[mean_f + e];
            else
                a_sh[e] = xe - dict_floats[mean_f + e];
        }
        if (METRIC != 0u) {  // r = W (x - mean), the metric's rows by invocation (the tiled kernel's sum order)
            barrier();
            for (uint row = tid; row < DIM; row += LOCAL) {
                float acc = 0.0;
                for (uint e = 0u; e < DIM; ++e)
                    acc += dict_floats[pc.metric_word + row * DIM + e] * a_sh[e];
                r_sh[row] = acc;
            }
        }

        for (uint k = 0u; k < SPARSITY; ++k) {
            barrier();  // r is complete
            // 1. correlations: atoms a0 .. a0+3 per invocation and pass (a0 + 3 < atoms_pad, a
            //    multiple of 4: the padding atoms are zeros, and skipped)
            float bc = 0.0;
            uint bi = NONE;  // no atom seen yet (an invocation may have none)
            for (uint a0 = 4u * tid; a0 < pc.n_atoms; a0 += 4u * LOCAL) {
                vec4 acc = vec4(0.0);
                uint w4 = (atoms_t + a0) / 4u, row4 = pc.atoms_pad / 4u;
                [[unroll]] for (uint d = 0u; d < DIM; ++d)
                    acc += dict_vec4[w4 + d * row4] * r_sh[d];
                [[unroll]] for (uint j = 0u; j < 4u; ++j) {
                    uint a = a0 + j;
                    if (a < pc.n_atoms && (bi == NONE || key_beats(acc[j], a, bc, bi))) {
                        bc = acc[j];
                        bi = a;
                    }
                }
            }
            best_c_sh[tid] = bc;
            best_i_sh[tid] = bi;
            for (uint width = LOCAL / 2u; width > 0u; width >>= 1u) {
                barrier();
                if (tid < width) {
                    uint gi = best_i_sh[tid + width];
                    if (gi != NONE && (best_i_sh[tid] == NONE
                                       || key_beats(best_c_sh[tid + width], gi, best_c_sh[tid], best_i_sh[tid]))) {
                        best_c_sh[tid] = best_c_sh[tid + width];
                        best_i_sh[tid] = gi;
                    }
                }
            }
            barrier();

            // 2. the pick (every invocation alike), distinct from the chosen ones
            uint pick = best_i_sh[0];  // invocation 0 holds atom 0: never NONE
            bool dup = false;
            for (uint i = 0u; i < k; ++i)
                dup = dup || idx_sh[i] == pick;
            if (dup) {  // the lowest index not chosen yet (<= k: k indices are taken)
                pick = 0u;
                for (uint cand = 0u; cand <= k; ++cand) {
                    bool taken = false;
                    for (uint i = 0u; i < k; ++i)
                        taken = taken || idx_sh[i] == cand;
                    if (!taken) {
                        pick = cand;
                        break;
                    }
                }
            }
            for (uint e = tid; e < DIM; e += LOCAL)
                a_sh[e] = dict_floats[atoms_t + e * pc.atoms_pad + pick];
            barrier();  // every invocation has read idx_sh[.. k) and a is staged
            if (tid == 0u)
                idx_sh[k] = pick;

            // 3. Gram-Schmidt, the new basis vector and the residual update
            if (k > 0u)
                orthogonalise(k, 0u);
            atom_norms();
            if (k > 0u && sum_sh[0] < 0.5) {  // "twice is enough", where the first pass cancelled a lot
                barrier();  // sum_sh is read before orthogonalise overwrites it
                orthogonalise(k, 1u);
                atom_norms();
            }
            float nu2 = sum_sh[0];
            bool independent = nu2 > DEPENDENT_NU2;
            float nu = independent ? sqrt(nu2) : 0.0;
            float inv_nu = independent ? 1.0 / nu : 0.0;
            float zk = sum_sh[SUM_F] * inv_nu;  // <q_k, r>
            for (uint e = tid; e < DIM; e += LOCAL) {
                float q = a_sh[e] * inv_nu;
                q_sh[k * DIM + e] = q;
                r_sh[e] -= zk * q;
            }
            if (tid == 0u) {
                rr_sh[k * SPARSITY + k] = nu;
                z_sh[k] = zk;
            }
            // (the next step's first barrier orders these writes before their readers)
        }

        // 4. the coefficients (back-substitution; a dependent atom's is 0) and the code words
        barrier();
        uint head = v / pc.n_tok, token = v - head * pc.n_tok;
        uint slot = pc.dst_word + (head * pc.n_ctx + pc.t0 + token) * SLOT_WORDS;
        if (tid == 0u) {
            uint norm_f = pc.inv_norm_word + dict_head * pc.n_atoms;
            float coef[SPARSITY];
            for (uint kk = SPARSITY; kk > 0u; --kk) {
                uint k = kk - 1u;
                float acc = z_sh[k];
                for (uint j = k + 1u; j < SPARSITY; ++j)
                    acc -= rr_sh[k * SPARSITY + j] * coef[j];
                float dkk = rr_sh[k * SPARSITY + k];
                coef[k] = dkk > 0.0 ? acc / dkk : 0.0;
            }
            for (uint k = 0u; k < SPARSITY; ++k) {
                uint idx = idx_sh[k];
                uint word = code_word(idx, coef[k] * dict_floats[norm_f + idx]);  // the caller's atoms
                dest_words[slot + k] = word;
#if RESIDUAL
                code_sh[k] = word;
#endif
            }
        }
#if RESIDUAL
        barrier();  // the code words are in shared memory
        // 5. the residual stage: u by element, the candidates' errors, the winner's levels by word
        for (uint e = tid; e < DIM; e += LOCAL) {
            uint idx[SPARSITY];
            float coef16[SPARSITY];
            for (uint k = 0u; k < SPARSITY; ++k) {  // what the decoder will use
                idx[k] = code_atom(code_sh[k]);
                coef16[k] = code_coef(code_sh[k]);
            }
            u_sh[e] = residual_element_of(x_sh[e], dict_head, e, idx, coef16);
        }
        barrier();
        vec2 rms, amax;
        residual_errors(rms, amax);
        uint best = 0u;
        for (uint s = 1u; s < N_STEPS; ++s)  // strictly smaller wins: the first on a tie
            if (df_less(err_sh[s * SUM_D], err_sh[best * SUM_D]))
                best = s;
        float best_step = residual_step(best, rms, amax);
        vec2 inv_best = df_recip(best_step > 0.0 ? best_step : 1.0);
        for (uint e = tid; e < DIM; e += LOCAL)
            level_sh[e] = uint(residual_level(u_sh[e], inv_best));
        barrier();
        for (uint w = tid; w <= LEVEL_WORDS; w += LOCAL)
            dest_words[slot + SPARSITY + w] = w < LEVEL_WORDS ? residual_level_word(w) : floatBitsToUint(best_step);
#endif
    }
}
