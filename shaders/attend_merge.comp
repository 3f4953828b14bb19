#version 450
// Decode attention, last pass of the direct path (attend_direct.comp): merges the splits'
// records into the output — flash-decoding's combine and reduce in one dispatch, which the
// direct path can afford because, unlike a dict-coded V on the table path, it has no atom
// weights that need the factors first. One invocation per output quad (query head h, quad c):
//   M = max_i m_i,  L = sum_i exp(m_i - M) * l_i,
//   out[h, c] = mean[g', c] + sum_i exp(m_i - M) * acc_i[c] / L
// (every quad of a head recomputes M and L: 2 * n_splits stats words, less than a dispatch).
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "attend_common.glsl"

const uint MERGE_UNROLL = 8u;

layout(std430, binding = 3) writeonly buffer Out { vec4 out_quads[]; };

layout(push_constant) uniform AttendMergePush {
    uint n_kv;
    uint n_splits;   // records per (KV head, query head)
    uint use_mean;   // 1: add the V dictionary's mean
    uint mean_word;  // a multiple of 4
    uint head_vec;   // words between two KV heads' means (0: shared dictionary)
} pc;

#include "attend_merge.glsl"

void main() {
    uint items = pc.n_kv * GROUP * Q4;
    for (uint item = gl_GlobalInvocationID.x; item < items; item += grid_size()) {
        uint h, c, g, hj;
        quad_item(item, h, c, g, hj);
        // MERGE_UNROLL records per iteration: their loads are independent, so a GPU has them
        // in flight together (a loop of one record per iteration waits out a load latency
        // per split: ~15-50 us for 64 splits on an H200, measured)
        float big_m = NEG_INF;
        [[dont_unroll]] for (uint i0 = 0u; i0 < pc.n_splits; i0 += MERGE_UNROLL)
            [[unroll]] for (uint u = 0u; u < MERGE_UNROLL; ++u)
                if (i0 + u < pc.n_splits)
                    big_m = max(big_m, stats[(record(i0 + u, g, pc.n_kv) + hj) * 2u]);
        float big_l = 0.0;
        vec4 o = vec4(0.0);
        [[dont_unroll]] for (uint i0 = 0u; i0 < pc.n_splits; i0 += MERGE_UNROLL) {
            [[unroll]] for (uint u = 0u; u < MERGE_UNROLL; ++u) {
                if (i0 + u < pc.n_splits) {
                    uint rec = record(i0 + u, g, pc.n_kv) + hj;
                    float f = exp(stats[rec * 2u] - big_m);  // 0 for an empty split (m = -inf)
                    merge_add(f, stats[rec * 2u + 1u], accs[rec * Q4 + c], big_l, o);
                }
            }
        }
        out_quads[item] = mean_quad(g, c) + o * (1.0 / big_l);
    }
}
