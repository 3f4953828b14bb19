// The rows of y = W x that fwd_matvec.comp and fwd_qkv.comp compute: ROW_THREADS invocations
// a row, ROWS rows a workgroup at a time; an invocation sums chunks of 8 columns, the row's
// invocations add theirs in shared memory (none where ROW_THREADS is 1: a CPU driver's SIMD
// lanes take a row each). x may be transformed as it is read (X_MODE), so a norm or the MLP's
// gate needs no dispatch of its own:
//   X_PLAIN:    x;
//   X_RMS_NORM: x · (1 / sqrt(mean(x²) + eps)) · w_norm (llama's RMSNorm, in the order
//               kvdict_vk.forge.llama.rms_norm takes; w_norm float32 words in the weights);
//   X_SWIGLU:   silu(g) · u = g / (1 + exp(-g)) · u, g at x_word, u n_cols words after it.
// The including shader declares w_words[] (weights.glsl reads it) and x_vals[].
#include "weights.glsl"

#define X_PLAIN 0u
#define X_RMS_NORM 1u
#define X_SWIGLU 2u

layout(constant_id = 1) const uint ROW_THREADS = 1u;  // a power of two ≤ WG_SIZE
layout(constant_id = 2) const uint X_MODE = X_PLAIN;
const uint ROWS = WG_SIZE / ROW_THREADS;

shared float partial[WG_SIZE];

// The sum over the workgroup of each invocation's v (every invocation gets it).
float workgroup_sum(float v) {
    uint lid = gl_LocalInvocationID.x;
    partial[lid] = v;
    barrier();
    for (uint s = WG_SIZE / 2u; s > 0u; s >>= 1u) {
        if (lid < s)
            partial[lid] += partial[lid + s];
        barrier();
    }
    float total = partial[0];
    barrier();
    return total;
}

// X_RMS_NORM's 1 / sqrt(mean(x²) + eps) over n floats at x_word (1 otherwise).
float x_scale(uint x_word, uint n, float eps) {
    if (X_MODE != X_RMS_NORM)
        return 1.0;
    float acc = 0.0;
    for (uint i = gl_LocalInvocationID.x; i < n; i += WG_SIZE)
        acc += x_vals[x_word + i] * x_vals[x_word + i];
    return 1.0 / sqrt(workgroup_sum(acc) / float(n) + eps);
}

float x_at(uint x_word, uint i, uint n_cols, float scale, uint norm_word) {
    float x = x_vals[x_word + i];
    if (X_MODE == X_RMS_NORM)
        return x * scale * uintBitsToFloat(w_words[norm_word + i]);
    if (X_MODE == X_SWIGLU)
        return x / (1.0 + exp(-x)) * x_vals[x_word + n_cols + i];
    return x;
}

// Row r's dot product with x (every invocation of the row calls it; the total comes back to
// all of them). valid: whether r is a row at all (the others add zeros, and still reach the
// barriers).
float row_dot(uint w_word, uint r, bool valid, uint x_word, uint n_cols, float scale, uint norm_word) {
    uint lid = gl_LocalInvocationID.x, lane = lid % ROW_THREADS;
    float acc = 0.0;
    if (valid) {
        uint row_words = (n_cols / 32u) * BLOCK_WORDS;
        for (uint c = lane; c < n_cols / 8u; c += ROW_THREADS) {
            vec4 lo, hi;
            block_chunk(w_word + r * row_words + (c / 4u) * BLOCK_WORDS, c & 3u, lo, hi);
            uint e = 8u * c;
            vec4 xl = vec4(x_at(x_word, e, n_cols, scale, norm_word), x_at(x_word, e + 1u, n_cols, scale, norm_word),
                           x_at(x_word, e + 2u, n_cols, scale, norm_word), x_at(x_word, e + 3u, n_cols, scale, norm_word));
            vec4 xh = vec4(x_at(x_word, e + 4u, n_cols, scale, norm_word), x_at(x_word, e + 5u, n_cols, scale, norm_word),
                           x_at(x_word, e + 6u, n_cols, scale, norm_word), x_at(x_word, e + 7u, n_cols, scale, norm_word));
            acc += dot(lo, xl) + dot(hi, xh);
        }
    }
    if (ROW_THREADS == 1u)
        return acc;
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
}
