#version 450
// Decode attention, last pass of the flash paths (attend_flash*.comp): merges the splits'
// records into the output like attend_merge.comp, shaped for GPUs — ONE WORKGROUP per query
// head h, so a merge over many splits is a few loads per invocation instead of a serial
// loop per output quad (attend_merge's one invocation per quad walks every split twice: on
// an H200 that is 15-40 µs of load latency at 64-128 splits, measured):
//   M = max_i m_i (invocations across splits, a tree in shared memory),
//   L = sum_i exp(m_i - M) * l_i,   out[h, c] = mean[g', c] + sum_i exp(m_i - M) * acc_i[c] / L
// with invocations across (split lane, quad c) and the split lanes summed in shared memory.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "attend_common.glsl"

const uint LOCAL = gl_WorkGroupSize.x;  // a multiple of Q4 (host)
const uint SPLIT_LANES = LOCAL / Q4;
const uint UNROLL = 4u;  // records per split lane loaded together

layout(std430, binding = 0) readonly buffer LayerQuads { uvec4 layer_quads[]; };
layout(std430, binding = 1) readonly buffer Stats { float stats[]; };
layout(std430, binding = 2) readonly buffer Accs { vec4 accs[]; };
layout(std430, binding = 3) writeonly buffer Out { vec4 out_quads[]; };

layout(push_constant) uniform AttendMergeHeadPush {
    uint n_kv;
    uint n_splits;   // records per (KV head, query head)
    uint use_mean;   // 1: add the V dictionary's mean
    uint mean_word;  // a multiple of 4
    uint head_vec;   // words between two KV heads' means (0: shared dictionary)
    uint seq_heads;  // KV heads of a sequence: n_kv counts virtual heads (attend_common.glsl)
} pc;

shared float red_sh[LOCAL];
shared vec4 part_sh[LOCAL];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint c = tid % Q4, lane = tid / Q4;
    for (uint h = gl_WorkGroupID.x; h < pc.n_kv * GROUP; h += gl_NumWorkGroups.x) {
        uint g = h / GROUP;
        uint hj = h - g * GROUP;
        float mx = NEG_INF;
        for (uint i = tid; i < pc.n_splits; i += LOCAL)
            mx = max(mx, stats[(record(i, g, pc.n_kv) + hj) * 2u]);
        red_sh[tid] = mx;
        for (uint width = LOCAL / 2u; width > 0u; width >>= 1u) {
            barrier();
            if (tid < width)
                red_sh[tid] = max(red_sh[tid], red_sh[tid + width]);
        }
        barrier();
        float big_m = red_sh[0];
        vec4 o = vec4(0.0);
        float big_l = 0.0;
        for (uint i0 = lane; i0 < pc.n_splits; i0 += SPLIT_LANES * UNROLL) {
            [[unroll]] for (uint u = 0u; u < UNROLL; ++u) {
                uint i = i0 + u * SPLIT_LANES;
                if (i < pc.n_splits) {
                    uint rec = record(i, g, pc.n_kv) + hj;
                    float f = exp(stats[rec * 2u] - big_m);  // 0 for an empty split (m = -inf)
                    big_l += f * stats[rec * 2u + 1u];
                    o += f * accs[rec * Q4 + c];
                }
            }
        }
        barrier();  // everyone has read red_sh[0]
        part_sh[tid] = o;
        red_sh[tid] = big_l;  // the same in every quad of a lane
        barrier();
        if (tid < Q4) {
            vec4 sum = vec4(0.0);
            float l = 0.0;
            for (uint ln = 0u; ln < SPLIT_LANES; ++ln) {
                sum += part_sh[ln * Q4 + tid];
                l += red_sh[ln * Q4];
            }
            vec4 mean = vec4(0.0);
            if (pc.use_mean != 0u)
                mean = uintBitsToFloat(layer_quads[((pc.mean_word + (g % pc.seq_heads) * pc.head_vec) >> 2u) + tid]);
            out_quads[h * Q4 + tid] = mean + sum * (1.0 / l);
        }
        barrier();  // shared memory is reused by the next head
    }
}
