#version 450
// A read of n_words words (whole vec4s) that leaves nothing behind: the L2 flush a timed pass
// follows in the same submission (Attention.flush_ops). A copy would leave its destination's
// dirty lines in the L2, written back during the timed passes; a read leaves clean lines, as
// the SDPA anchor's flush (a sum) does. The one store — the reads' XOR into sink[0] when it
// equals an arbitrary constant, which the compiler cannot rule out — keeps the loads.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(std430, binding = 0) readonly buffer Src { uvec4 src_quads[]; };
layout(std430, binding = 1) writeonly buffer Sink { uint sink[]; };

layout(push_constant) uniform FlushPush {
    uint n_words;  // a multiple of 4
} pc;

void main() {
    uvec4 acc = uvec4(0u);
    for (uint i = gl_GlobalInvocationID.x; i < pc.n_words / 4u; i += grid_stride())
        acc ^= src_quads[i];
    uint x = acc.x ^ acc.y ^ acc.z ^ acc.w;
    if (x == 0x9E3779B9u)
        sink[0] = x;
}
