#version 450
// Decode attention, last pass: one invocation per output quad (query head h, quad c):
//   out[h, c] = mean[g', c] + (sum_i f_i * acc_i[c] + sum_b blocks_b[c]) / L
// with f_i and 1/L from attend_combine.comp; blocks (attend_atoms.comp, dict-coded V only)
// carry the atom-weight products, mean (dict-coded V only) the V dictionary's mean — the
// probabilities sum to one, so it is added once.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "attend_common.glsl"

layout(std430, binding = 3) readonly buffer Blocks { vec4 blocks[]; };
layout(std430, binding = 4) writeonly buffer Out { vec4 out_quads[]; };

layout(push_constant) uniform AttendReducePush {
    uint n_kv;
    uint n_splits;
    uint f_word;
    uint inv_l_word;
    uint n_blocks;   // atom blocks per KV head (0: V is not dict-coded)
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
        vec4 o = vec4(0.0);
        [[dont_unroll]] for (uint i = 0u; i < pc.n_splits; ++i) {
            uint rec = record(i, g, pc.n_kv) + hj;
            o += stats[pc.f_word + rec] * accs[rec * Q4 + c];
        }
        [[dont_unroll]] for (uint b = 0u; b < pc.n_blocks; ++b)
            o += blocks[((g * pc.n_blocks + b) * GROUP + hj) * Q4 + c];
        out_quads[item] = mean_quad(g, c) + o * stats[pc.inv_l_word + h];
    }
}
