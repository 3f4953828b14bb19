// The rows of y = W x that fwd_matvec.comp and fwd_qkv.comp compute: ROW_THREADS invocations
// a row, ROWS rows a workgroup at a time; an invocation sums chunks of 8 columns, the row's
// invocations add theirs (none where ROW_THREADS is 1: a CPU driver's SIMD lanes take a row
// each). x may be transformed as it is read (X_MODE), so a norm or the MLP's gate needs no
// dispatch of its own:
//   X_PLAIN:    x;
//   X_RMS_NORM: x · (1 / sqrt(mean(x²) + eps)) · w_norm (llama's RMSNorm; w_norm float32 words
//               in the weights). The factor is common to a row's columns: x · w_norm is dotted
//               and the row's sum scaled, so the sum of squares and the dots need no order;
//   X_SWIGLU:   silu(g) · u = g / (1 + exp(-g)) · u, g at x_word, u n_cols words after it.
// The normed residual is made once a workgroup into shared memory where it fits (X_SHARED
// columns); a plain x and the SwiGLU are read from memory row by row. SUBGROUP 1 (the _sg builds, where the device has shuffles): a row's
// invocations are neighbours in one subgroup (host-checked: ROW_THREADS ≤ its size) and add
// by xor shuffles, and a workgroup sum is a word a subgroup; SUBGROUP 0: trees in shared memory.
// The including shader declares w_words[] (weights.glsl reads it) and x_vals[].
#ifndef SUBGROUP
#define SUBGROUP 0
#endif
#if SUBGROUP
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#endif
#include "weights.glsl"

#define X_PLAIN 0u
#define X_RMS_NORM 1u
#define X_SWIGLU 2u

layout(constant_id = 1) const uint ROW_THREADS = 1u;  // a power of two ≤ WG_SIZE
layout(constant_id = 2) const uint X_MODE = X_PLAIN;
const uint ROWS = WG_SIZE / ROW_THREADS;
const uint X_SHARED = 2048u;  // the most columns of x' kept in shared memory
const uint X_PER = X_SHARED / WG_SIZE;  // of them an invocation stages
// Sequences whose rows a workgroup makes together (fwd_matvec's SEQ_TILE; 1 elsewhere): past one,
// each x' is read from memory, not staged
#ifndef MATVEC_SEQ_TILE
#define MATVEC_SEQ_TILE 1u
#endif
// Whether x' is staged: the normed residual only (a plain x or the SwiGLU read straight from
// memory row by row took less time on an H100: lab/NOTEBOOK.md)
#define STAGED(n_cols) (MATVEC_SEQ_TILE == 1u && X_MODE == X_RMS_NORM && (n_cols) <= X_SHARED)

shared float partial[WG_SIZE];
shared uvec4 x_sh[X_SHARED / 4u];  // float bits (fwd_qkv stages a KIVI group's binary16 words here too)

// The invocation's place in the workgroup: with subgroups, a subgroup's invocations are
// consecutive (a row's lanes in one subgroup).
uint row_lid() {
#if SUBGROUP
    return gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;
#else
    return gl_LocalInvocationID.x;
#endif
}

// The sum over the workgroup of each invocation's v (every invocation gets it).
float workgroup_sum(float v) {
    uint lid = gl_LocalInvocationID.x;
#if SUBGROUP
    for (uint w = gl_SubgroupSize / 2u; w > 0u; w >>= 1u)
        v += subgroupShuffleXor(v, w);
    if (gl_SubgroupInvocationID == 0u)
        partial[gl_SubgroupID] = v;
    barrier();
    float total = 0.0;
    for (uint s = 0u; s < gl_NumSubgroups; ++s)
        total += partial[s];
#else
    partial[lid] = v;
    barrier();
    for (uint s = WG_SIZE / 2u; s > 0u; s >>= 1u) {
        if (lid < s)
            partial[lid] += partial[lid + s];
        barrier();
    }
    float total = partial[0];
#endif
    barrier();
    return total;
}

// Column i of x' (X_RMS_NORM: without the norm's factor).
float x_at(uint x_word, uint i, uint n_cols, uint norm_word) {
    float x = x_vals[x_word + i];
    if (X_MODE == X_RMS_NORM)
        return x * uintBitsToFloat(w_words[norm_word + i]);
    if (X_MODE == X_SWIGLU)
        return x / (1.0 + exp(-x)) * x_vals[x_word + n_cols + i];
    return x;
}

// The factor every row's sum takes: X_RMS_NORM's 1 / sqrt(mean(x²) + eps) over the n_cols
// floats at x_word (x · w_norm into x_sh where STAGED), 1 otherwise. Every invocation calls it,
// once, before row_dot.
float x_prepare(uint x_word, uint n_cols, float eps, uint norm_word) {
    if (X_MODE != X_RMS_NORM)
        return 1.0;  // nothing staged
    float sq = 0.0;
    if (STAGED(n_cols)) {
        // an invocation's columns lid + k · WG_SIZE: every load issued before any is used
        float x[X_PER], w[X_PER];
        [[unroll]] for (uint k = 0u; k < X_PER; ++k) {
            uint i = min(gl_LocalInvocationID.x + k * WG_SIZE, n_cols - 1u);
            x[k] = x_vals[x_word + i];
            w[k] = uintBitsToFloat(w_words[norm_word + i]);
            if (k * WG_SIZE >= n_cols)
                break;
        }
        [[unroll]] for (uint k = 0u; k < X_PER; ++k) {
            uint i = gl_LocalInvocationID.x + k * WG_SIZE;
            if (k * WG_SIZE >= n_cols)
                break;
            if (i < n_cols) {
                sq += x[k] * x[k];
                x_sh[i >> 2u][i & 3u] = floatBitsToUint(x[k] * w[k]);
            }
        }
    } else {
        for (uint i = gl_LocalInvocationID.x; i < n_cols; i += WG_SIZE)
            sq += x_vals[x_word + i] * x_vals[x_word + i];
    }
    return 1.0 / sqrt(workgroup_sum(sq) / float(n_cols) + eps);  // its barriers make x_sh whole too
}

// Columns 8c .. 8c + 7 of x' read from memory (x_at).
void x_chunk(uint x_word, uint c, uint n_cols, uint norm_word, out vec4 xl, out vec4 xh) {
    uint e = 8u * c;
    xl = vec4(x_at(x_word, e, n_cols, norm_word), x_at(x_word, e + 1u, n_cols, norm_word),
              x_at(x_word, e + 2u, n_cols, norm_word), x_at(x_word, e + 3u, n_cols, norm_word));
    xh = vec4(x_at(x_word, e + 4u, n_cols, norm_word), x_at(x_word, e + 5u, n_cols, norm_word),
              x_at(x_word, e + 6u, n_cols, norm_word), x_at(x_word, e + 7u, n_cols, norm_word));
}

// The sum of a row's invocations' acc (every invocation of the row calls it; the total comes
// back to all of them).
float row_sum(float acc) {
    if (ROW_THREADS == 1u)
        return acc;
#if SUBGROUP
    for (uint w = ROW_THREADS / 2u; w > 0u; w >>= 1u)
        acc += subgroupShuffleXor(acc, w);
    return acc;
#else
    uint lid = row_lid(), lane = lid % ROW_THREADS;
    partial[lid] = acc;
    barrier();
    for (uint s = ROW_THREADS / 2u; s > 0u; s >>= 1u) {
        if (lane < s)
            partial[lid] += partial[lid + s];
        barrier();
    }
    float total = partial[lid - lane];
    barrier();  // read before the next rows overwrite it
    return total;
#endif
}

// Row r's dot product with x' times x_prepare's factor (every invocation of the row calls it;
// the total comes back to all of them). valid: whether r is a row at all (the others add
// zeros, and still reach the barriers and shuffles).
float row_dot(uint w_word, uint r, bool valid, uint x_word, uint n_cols, float scale, uint norm_word) {
    uint lane = row_lid() % ROW_THREADS;
    float acc = 0.0;
    if (valid) {
        uint row_words = (n_cols / 32u) * BLOCK_WORDS;
        for (uint c = lane; c < n_cols / 8u; c += ROW_THREADS) {
            vec4 lo, hi, xl, xh;
            block_chunk(w_word + r * row_words + (c / 4u) * BLOCK_WORDS, c & 3u, lo, hi);
            if (STAGED(n_cols)) {
                xl = uintBitsToFloat(x_sh[2u * c]);
                xh = uintBitsToFloat(x_sh[2u * c + 1u]);
            } else {
                x_chunk(x_word, c, n_cols, norm_word, xl, xh);
            }
            acc += dot(lo, xl) + dot(hi, xh);
        }
    }
    return row_sum(acc) * scale;
}

// Row r's dot products with the x' of `tile` sequences (≤ MATVEC_SEQ_TILE) x_seq_words apart, read
// from memory, each weight chunk decoded once for all of them: acc[t], before the row's sum (every
// invocation of the row calls it; acc[t] is 0 past tile, and everywhere where r is not valid).
void row_dots(uint w_word, uint r, bool valid, uint x_word, uint x_seq_words, uint tile, uint n_cols,
              uint norm_word, out float acc[MATVEC_SEQ_TILE]) {
    for (uint t = 0u; t < MATVEC_SEQ_TILE; ++t)
        acc[t] = 0.0;
    if (!valid)
        return;
    uint row_words = (n_cols / 32u) * BLOCK_WORDS;
    for (uint c = row_lid() % ROW_THREADS; c < n_cols / 8u; c += ROW_THREADS) {
        vec4 lo, hi;
        block_chunk(w_word + r * row_words + (c / 4u) * BLOCK_WORDS, c & 3u, lo, hi);
        for (uint t = 0u; t < tile; ++t) {
            vec4 xl, xh;
            x_chunk(x_word + t * x_seq_words, c, n_cols, norm_word, xl, xh);
            acc[t] += dot(lo, xl) + dot(hi, xh);
        }
    }
}
