#version 450
// Decode attention, pass 2: per query head, the overall maximum M of its splits' maxima,
// each split's rescale factor f_i = exp(m_i - M) (0 for an empty split) and 1/L with
// L = sum_i f_i * l_i (flash-decoding's combine), written next to the stats
// (attend_common.glsl) for attend_atoms.comp and attend_reduce.comp.
// One invocation per (KV head, query head of its group).
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "attend_common.glsl"

layout(std430, binding = 0) buffer Stats { float stats[]; };

layout(push_constant) uniform AttendCombinePush {
    uint n_kv;
    uint n_splits;
    uint f_word;      // factors: f_word + record (attend_common.glsl)
    uint inv_l_word;  // 1/L: inv_l_word + g*GROUP + hj
} pc;

void main() {
    uint items = pc.n_kv * GROUP;
    for (uint item = gl_GlobalInvocationID.x; item < items; item += grid_size()) {
        uint g = item / GROUP;
        uint hj = item - g * GROUP;
        float big_m = NEG_INF;
        [[dont_unroll]] for (uint i = 0u; i < pc.n_splits; ++i)
            big_m = max(big_m, stats[(record(i, g, pc.n_kv) + hj) * 2u]);
        float big_l = 0.0;
        [[dont_unroll]] for (uint i = 0u; i < pc.n_splits; ++i) {
            uint rec = record(i, g, pc.n_kv) + hj;
            float f = exp(stats[rec * 2u] - big_m);
            big_l += f * stats[rec * 2u + 1u];
            stats[pc.f_word + rec] = f;
        }
        stats[pc.inv_l_word + item] = 1.0 / big_l;
    }
}
