#version 450
// The index of the largest of n floats (the first of equals, as numpy.argmax; NaN never
// wins), written as a word of the state buffer: greedy decoding's next token. One workgroup.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(std430, binding = 0) readonly buffer X { float x_vals[]; };
layout(std430, binding = 1) buffer State { uint state_words[]; };

layout(push_constant) uniform ArgmaxPush {
    uint x_word;
    uint n;
    uint out_word;
} pc;

shared float best_val[WG_SIZE];
shared uint best_idx[WG_SIZE];

bool better(float v, uint i, float bv, uint bi) { return v > bv || (v == bv && i < bi); }

void main() {
    uint lid = gl_LocalInvocationID.x;
    float bv = uintBitsToFloat(0xFF800000u);  // -inf
    uint bi = 0xFFFFFFFFu;
    for (uint i = lid; i < pc.n; i += WG_SIZE) {
        float v = x_vals[pc.x_word + i];
        if (better(v, i, bv, bi))
            bv = v, bi = i;
    }
    best_val[lid] = bv;
    best_idx[lid] = bi;
    barrier();
    for (uint s = WG_SIZE / 2u; s > 0u; s >>= 1u) {
        if (lid < s && better(best_val[lid + s], best_idx[lid + s], best_val[lid], best_idx[lid])) {
            best_val[lid] = best_val[lid + s];
            best_idx[lid] = best_idx[lid + s];
        }
        barrier();
    }
    if (lid == 0u)
        state_words[pc.out_word] = min(best_idx[0], pc.n - 1u);
}
