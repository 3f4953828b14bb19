#version 450
// The MLP's gate: y = silu(g) · u = g / (1 + exp(-g)) · u, elementwise over n floats.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(std430, binding = 0) buffer Act { float act_vals[]; };

layout(push_constant) uniform SwigluPush {
    uint g_word;
    uint u_word;
    uint y_word;
    uint n;
} pc;

void main() {
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += grid_stride()) {
        float g = act_vals[pc.g_word + i];
        act_vals[pc.y_word + i] = g / (1.0 + exp(-g)) * act_vals[pc.u_word + i];
    }
}
