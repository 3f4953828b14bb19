#version 450
// Decode attention, last pass of the flash paths (attend_flash*.comp, attend_flash_coded.comp,
// attend_mma.comp; attend_flash's MERGE_LAST builds merge in their last split instead): merges
// the splits' records into the output like attend_merge.comp, shaped for GPUs — ONE WORKGROUP
// per query head h, invocations across (split lane, quad c) — merge_head.glsl's merge, plus
// the V dictionary's mean[g', c] where there is one.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "attend_common.glsl"

const uint LOCAL = gl_WorkGroupSize.x;  // a multiple of Q4 (host)
layout(std430, binding = 3) writeonly buffer Out { vec4 out_quads[]; };

layout(push_constant) uniform AttendMergeHeadPush {
    uint n_kv;
    uint n_splits;   // records per (KV head, query head)
    uint use_mean;   // 1: add the V dictionary's mean
    uint mean_word;  // a multiple of 4
    uint head_vec;   // words between two KV heads' means (0: shared dictionary)
    uint seq_heads;  // KV heads of a sequence: n_kv counts virtual heads (attend_common.glsl)
    uint out_word;   // where the output starts in Out, a multiple of 4 (a recorded step's layers share one)
} pc;

#include "attend_merge.glsl"

#define MERGE_ACC(rec, c) accs[(rec) * Q4 + (c)]
#include "merge_head.glsl"

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint c = tid % Q4, lane = tid / Q4;
    for (uint h = gl_WorkGroupID.x; h < pc.n_kv * GROUP; h += gl_NumWorkGroups.x) {
        uint g = h / GROUP;
        uint hj = h - g * GROUP;
        // the mean's quad, loaded beside the records (only the first lane uses it)
        vec4 mean = vec4(0.0);
        if (lane == 0u)
            mean = mean_quad(g % pc.seq_heads, c);
        vec4 merged = merge_head(g, hj, pc.n_splits, pc.n_kv, tid);
        if (lane == 0u)
            out_quads[pc.out_word / 4u + h * Q4 + c] = mean + merged;
    }
}
