#version 450
// y = x · (1 / sqrt(mean(x²) + eps)) · w (llama's RMSNorm, as kvdict_vk.forge.llama.rms_norm
// orders it), over one vector of n floats, in one workgroup.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(std430, binding = 0) readonly buffer Weights { float w_vals[]; };
layout(std430, binding = 1) readonly buffer X { float x_vals[]; };
layout(std430, binding = 2) writeonly buffer Y { float y_vals[]; };

layout(push_constant) uniform RmsNormPush {
    uint w_word;
    uint x_word;
    uint y_word;
    uint n;
    float eps;
} pc;

shared float partial[WG_SIZE];

void main() {
    uint lid = gl_LocalInvocationID.x;
    float acc = 0.0;
    for (uint i = lid; i < pc.n; i += WG_SIZE)
        acc += x_vals[pc.x_word + i] * x_vals[pc.x_word + i];
    partial[lid] = acc;
    barrier();
    for (uint s = WG_SIZE / 2u; s > 0u; s >>= 1u) {
        if (lid < s)
            partial[lid] += partial[lid + s];
        barrier();
    }
    float inv = 1.0 / sqrt(partial[0] / float(pc.n) + pc.eps);
    for (uint i = lid; i < pc.n; i += WG_SIZE)
        y_vals[pc.y_word + i] = x_vals[pc.x_word + i] * inv * w_vals[pc.w_word + i];
}
