#version 450
// y = W x (+ y where accumulate): ROW_THREADS invocations a row, WG_SIZE / ROW_THREADS rows a
// workgroup at a time (grid stride over rows); an invocation sums chunks of 8 columns, the
// row's invocations then add theirs in shared memory (none where ROW_THREADS is 1: a CPU
// driver's SIMD lanes take a row each, with no barrier). W in any of weights.glsl's formats;
// x, y float32. (kvdict_vk.vk.forward: the projections, the MLP and the LM head.)
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(std430, binding = 0) readonly buffer Weights { uint w_words[]; };
layout(std430, binding = 1) readonly buffer X { float x_vals[]; };
layout(std430, binding = 2) buffer Y { float y_vals[]; };

#include "weights.glsl"

layout(constant_id = 1) const uint ROW_THREADS = 1u;  // a power of two ≤ WG_SIZE
const uint ROWS = WG_SIZE / ROW_THREADS;

layout(push_constant) uniform MatvecPush {
    uint w_word;      // row r at w_word + r · (n_cols / 32) · BLOCK_WORDS
    uint x_word;
    uint y_word;
    uint n_rows;
    uint n_cols;      // a multiple of 32
    uint accumulate;  // 1: y += W x (a residual), 0: y = W x
} pc;

shared float partial[WG_SIZE];

void main() {
    uint lid = gl_LocalInvocationID.x;
    uint lane = lid % ROW_THREADS;
    uint chunks = pc.n_cols / 8u;
    uint row_words = (pc.n_cols / 32u) * BLOCK_WORDS;
    for (uint r0 = gl_WorkGroupID.x * ROWS; r0 < pc.n_rows; r0 += gl_NumWorkGroups.x * ROWS) {
        uint r = r0 + lid / ROW_THREADS;
        float acc = 0.0;
        if (r < pc.n_rows) {
            for (uint c = lane; c < chunks; c += ROW_THREADS) {
                vec4 lo, hi;
                block_chunk(pc.w_word + r * row_words + (c / 4u) * BLOCK_WORDS, c & 3u, lo, hi);
                uint x = pc.x_word + 8u * c;
                acc += dot(lo, vec4(x_vals[x], x_vals[x + 1u], x_vals[x + 2u], x_vals[x + 3u]))
                     + dot(hi, vec4(x_vals[x + 4u], x_vals[x + 5u], x_vals[x + 6u], x_vals[x + 7u]));
            }
        }
        if (ROW_THREADS > 1u) {
            partial[lid] = acc;
            barrier();
            for (uint s = ROW_THREADS / 2u; s > 0u; s >>= 1u) {
                if (lane < s)
                    partial[lid] += partial[lid + s];
                barrier();
            }
            acc = partial[lid];
            barrier();  // read before the next rows overwrite it
        }
        if (lane == 0u && r < pc.n_rows)
            y_vals[pc.y_word + r] = (pc.accumulate != 0u ? y_vals[pc.y_word + r] : 0.0) + acc;
    }
}
