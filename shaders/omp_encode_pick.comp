#version 450
// GPU OMP encoder, the per-vector half (one invocation per vector), semantics of codec.omp:
//   phase 0: r = x - mean at res_word (metric streams: the host points res_word at the basis
//     area, and omp_encode_metric writes W (x - mean) to the residual area).
//   phase 1, step k: the best atom over omp_encode_corr's blocks; indices stay distinct (a
//     pick that is already chosen — only possible when every correlation is ~0 — becomes the
//     lowest index not chosen yet); Gram-Schmidt of the unit atom against the basis so far,
//     a second pass when the first cancelled more than half its norm (as codec.omp does); an
//     atom left with squared norm <= 1e-10 is dependent: R_kk = 0, the residual unchanged;
//     otherwise r -= <q_k, r> q_k.
//   after the last step: back-substitution R c = z (a dependent atom's c is 0), c / ||atom||,
//     the code words, and (RESIDUAL=1) the residual stage, written into the destination.
// So zero vectors, duplicate or antiparallel atoms and s = head_dim give finite, valid codes.
// Float32 throughout, except the residual stage (df64, encode_residual.glsl).
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require  // [[unroll]]/[[dont_unroll]]: core LoopControl
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(constant_id = 0) const uint DIM = 64u;
layout(constant_id = 1) const uint SPARSITY = 8u;
layout(constant_id = 2) const uint ATOM_BLOCK = 64u;
#ifndef RESIDUAL
#define RESIDUAL 0
#endif
#if RESIDUAL
layout(constant_id = 3) const uint RESIDUAL_BITS = 4u;
layout(constant_id = 4) const uint N_STEPS = 15u;  // residual.py's step candidates
const uint LEVEL_WORDS = SLOT_LEVEL_WORDS_OF(DIM, RESIDUAL_BITS);
const uint SLOT_WORDS = SLOT_WORDS_OF(SPARSITY, DIM, RESIDUAL_BITS);
#else
const uint SLOT_WORDS = SPARSITY;
#endif
const uint DIM_ELEMS = DIM / LANES;
// Per-vector bookkeeping words: R (s x s, row-major, upper triangle used), z (s), indices (s).
const uint STATE_WORDS = SPARSITY * SPARSITY + 2u * SPARSITY;
const uint Z_AT = SPARSITY * SPARSITY;
const uint IDX_AT = Z_AT + SPARSITY;

layout(std430, binding = 0) readonly buffer InputElems { FELEM x_elems[]; };  // vector v at x_word + v*DIM
layout(std430, binding = 1) readonly buffer DictElems { FELEM dict_elems[]; };
layout(std430, binding = 2) readonly buffer DictFloats { float dict_floats[]; };
layout(std430, binding = 3) buffer StateElems { FELEM state_elems[]; };
layout(std430, binding = 4) buffer StateWords { uint state_words[]; };
layout(std430, binding = 5) readonly buffer Keys { uvec2 keys[]; };
layout(std430, binding = 6) writeonly buffer Dest { uint dest_words[]; };

#include "encode_common.glsl"
#if RESIDUAL
#include "encode_df64.glsl"
#include "encode_residual.glsl"
#endif

float state_float(uint word) { return uintBitsToFloat(state_words[word]); }

void start(uint v, uint dict_head) {
    uint mean_elem = pc.mean_word / LANES + dict_head * DIM_ELEMS;
    uint r_elem = pc.res_word / LANES + v * DIM_ELEMS;
    [[unroll]] for (uint e = 0u; e < DIM_ELEMS; ++e)  // float32 of the exact difference
        state_elems[r_elem + e] = X_ELEM(v * DIM_ELEMS + e) - dict_elems[mean_elem + e];
}

void omp_step(uint v, uint dict_head, uint k) {
    uint n_blocks = (pc.n_atoms + ATOM_BLOCK - 1u) / ATOM_BLOCK;
    uint sw = v * STATE_WORDS;

    // 1. The best atom of all blocks (blocks in index order, so corr_beats keeps "first").
    uvec2 best = keys[v * n_blocks];
    for (uint b = 1u; b < n_blocks; ++b) {
        uvec2 key = keys[v * n_blocks + b];
        if (corr_beats(uintBitsToFloat(key.x), uintBitsToFloat(best.x)))
            best = key;
    }
    uint pick = best.y;
    bool dup = false;
    for (uint i = 0u; i < k; ++i)
        dup = dup || state_words[sw + IDX_AT + i] == pick;
    if (dup) {  // the lowest index not chosen yet (k indices are taken, so it is <= k)
        uint taken[SPARSITY / 32u + 1u];
        for (uint w = 0u; w <= k / 32u; ++w)
            taken[w] = 0u;
        for (uint i = 0u; i < k; ++i) {
            uint t = state_words[sw + IDX_AT + i];
            if (t <= k)
                taken[t / 32u] |= 1u << (t % 32u);
        }
        for (uint w = 0u; w <= k / 32u; ++w) {
            if (taken[w] != 0xFFFFFFFFu) {
                pick = w * 32u + uint(findLSB(~taken[w]));
                break;
            }
        }
    }
    state_words[sw + IDX_AT + k] = pick;

    // 2. Its component outside the span of the basis so far (modified Gram-Schmidt).
    float a[DIM];
    uint atoms_elem = pc.atoms_word / LANES + dict_head * n_blocks * ATOM_BLOCK * DIM_ELEMS;
    LOAD_ROW(a, dict_elems, atoms_elem + pick * DIM_ELEMS);
    uint basis_elem = pc.basis_word / LANES + v * SPARSITY * DIM_ELEMS;
    [[dont_unroll]] for (uint pass = 0u; pass < 2u; ++pass) {
        if (pass == 1u) {  // "twice is enough", only where the first pass cancelled a lot
            float left = 0.0;
            [[unroll]] for (uint e = 0u; e < DIM; ++e)
                left += a[e] * a[e];
            if (k == 0u || left >= 0.5)
                break;
        }
        [[dont_unroll]] for (uint i = 0u; i < k; ++i) {
            float q[DIM];
            LOAD_ROW(q, state_elems, basis_elem + i * DIM_ELEMS);
            float h = 0.0;
            [[unroll]] for (uint e = 0u; e < DIM; ++e)
                h += q[e] * a[e];
            [[unroll]] for (uint e = 0u; e < DIM; ++e)
                a[e] -= h * q[e];
            uint rw = sw + i * SPARSITY + k;
            state_words[rw] = floatBitsToUint(pass == 0u ? h : state_float(rw) + h);
        }
    }
    float nu2 = 0.0;
    [[unroll]] for (uint e = 0u; e < DIM; ++e)
        nu2 += a[e] * a[e];
    bool independent = nu2 > DEPENDENT_NU2;
    float nu = independent ? sqrt(nu2) : 0.0;
    float inv_nu = independent ? 1.0 / nu : 0.0;
    state_words[sw + k * SPARSITY + k] = floatBitsToUint(nu);
    [[unroll]] for (uint e = 0u; e < DIM; ++e)
        a[e] *= inv_nu;
    STORE_ROW(state_elems, basis_elem + k * DIM_ELEMS, a);

    // 3. The residual loses its component along the new direction.
    float r[DIM];
    uint r_elem = pc.res_word / LANES + v * DIM_ELEMS;
    LOAD_ROW(r, state_elems, r_elem);
    float zk = 0.0;
    [[unroll]] for (uint e = 0u; e < DIM; ++e)
        zk += a[e] * r[e];
    [[unroll]] for (uint e = 0u; e < DIM; ++e)
        r[e] -= zk * a[e];
    STORE_ROW(state_elems, r_elem, r);
    state_words[sw + Z_AT + k] = floatBitsToUint(zk);
}

void finish(uint v, uint head, uint token, uint dict_head) {
    uint sw = v * STATE_WORDS;
    uint idx[SPARSITY];
    float coef[SPARSITY];
    for (uint k = 0u; k < SPARSITY; ++k)
        idx[k] = state_words[sw + IDX_AT + k];
    for (uint kk = SPARSITY; kk > 0u; --kk) {
        uint k = kk - 1u;
        float acc = state_float(sw + Z_AT + k);
        for (uint j = k + 1u; j < SPARSITY; ++j)
            acc -= state_float(sw + k * SPARSITY + j) * coef[j];
        float d = state_float(sw + k * SPARSITY + k);
        coef[k] = d > 0.0 ? acc / d : 0.0;
    }
    uint norm_word = pc.inv_norm_word + dict_head * pc.n_atoms;
    uint slot = pc.dst_word + (head * pc.n_ctx + pc.t0 + token) * SLOT_WORDS;
    float coef16[SPARSITY];
    for (uint k = 0u; k < SPARSITY; ++k) {
        // back to the stream's own (unnormalised) atoms
        uint word = code_word(idx[k], coef[k] * dict_floats[norm_word + idx[k]]);
        coef16[k] = code_coef(word);  // what the decoder will use
        dest_words[slot + k] = word;
    }
#if RESIDUAL
    residual_stage(dict_head, v, idx, coef16, slot + SPARSITY);
#endif
}

void main() {
    uint v = (pc.group0 + gl_WorkGroupID.x) * WG_SIZE + gl_LocalInvocationID.x;
    if (v >= pc.n_vectors)
        return;
    uint head = v / pc.n_tok;
    uint token = v - head * pc.n_tok;
    uint dict_head = head * pc.per_head;
    if (pc.phase == 0u) {
        start(v, dict_head);
        return;
    }
    omp_step(v, dict_head, pc.step);
    if (pc.step + 1u == SPARSITY)
        finish(v, head, token, dict_head);
}
