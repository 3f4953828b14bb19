#version 450
// Plain copy of n_words words: the benchmark's bandwidth reference (vec4 variant) and the
// raw read-back of a layer buffer for tests and the dump tool (scalar variant).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(std430, binding = 0) readonly buffer Src { UELEM src_elems[]; };
layout(std430, binding = 1) writeonly buffer Dst { UELEM dst_elems[]; };

layout(push_constant) uniform CopyPush {
    uint src_word;  // multiples of LANES
    uint dst_word;
    uint n_words;
} pc;

void main() {
    uint src = pc.src_word / LANES;
    uint dst = pc.dst_word / LANES;
    uint n = pc.n_words / LANES;
    for (uint i = gl_GlobalInvocationID.x; i < n; i += grid_stride())
        dst_elems[dst + i] = src_elems[src + i];
}
