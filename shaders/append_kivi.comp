#version 450
// A recorded decode step's append to a KIVI layer (kvdict_vk.kivi, kvdict_vk.vk.arena.decode):
// one new token of one sequence, K and V, at the position its n_used word names (the query
// block's SEQ_USED word, as append_step reads it), from its float32 rows in the step buffer, by
// kivi_append.glsl's kivi_append_head. One workgroup a KV head (grid stride).
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "rows_encode.glsl"
#include "kivi.glsl"

layout(local_size_x = WG_SIZE) in;

layout(constant_id = 0) const uint HEAD_DIM = 64u;  // a multiple of KIVI_GROUP
layout(constant_id = 1) const uint K_BITS = 4u;     // 2 .. 8
layout(constant_id = 2) const uint V_BITS = 4u;

layout(std430, binding = 0) readonly buffer Step { uint step_words[]; };
layout(std430, binding = 1) readonly buffer Query { uint query_words[]; };
layout(std430, binding = 2) coherent buffer Layer { uint layer_words[]; };

layout(push_constant) uniform AppendKiviPush {
    uint k_src_word;     // the new token's K rows (n_kv × HEAD_DIM floats), then V's at v_src_word
    uint v_src_word;
    uint k_word;         // the K region (n_ctx level rows per KV head)
    uint v_word;         // the V region
    uint stats_word;     // the keys' group statistics ((h · ceil(n_ctx / 32) + group) · HEAD_DIM + c)
    uint k_window_word;  // the rings of recent + KIVI_GROUP binary16 rows per KV head
    uint v_window_word;
    uint recent;         // kivi.KiviSpec.recent
    uint state_word;     // the layer's quantised end
    uint n_kv;
    uint n_ctx;
    uint lengths_word;   // the query block's n_used word
} pc;

float kivi_source(bool key, uint h, uint e) {
    return uintBitsToFloat(step_words[(key ? pc.k_src_word : pc.v_src_word) + h * HEAD_DIM + e]);
}

#include "kivi_append.glsl"

void main() {
    uint n_used = clamp(query_words[pc.lengths_word], 1u, pc.n_ctx);  // as SEQ_USED clamps it
    KiviLayer a = KiviLayer(pc.k_word, pc.v_word, pc.stats_word, pc.k_window_word, pc.v_window_word, pc.recent,
                            pc.state_word, pc.n_ctx);
    for (uint h = gl_WorkGroupID.x; h < pc.n_kv; h += gl_NumWorkGroups.x)
        kivi_append_head(a, h, n_used);
}
