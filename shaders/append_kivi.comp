#version 450
// A recorded decode step's append to a KIVI layer (kvdict_vk.kivi, kvdict_vk.vk.arena.decode):
// one new token of each of n_seqs sequences, K and V, at the position its n_used word names
// (the query block's SEQ_USED words, as append_step reads them), from its float32 rows in the
// step buffer, by kivi_append.glsl's kivi_append_head over the sequence's KIVI head (its rows
// s·seq_rows .. of the KV head's region; its statistics, ring and state word:
// layout.StreamLayout.kivi_head). One workgroup a (sequence, KV head) (grid stride).
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
    uint k_src_word;     // the new tokens' K rows (n_seqs × n_kv × HEAD_DIM floats), then V's at v_src_word
    uint v_src_word;
    uint k_word;         // the K region (n_ctx level rows per KV head)
    uint v_word;         // the V region
    uint stats_word;     // the keys' group statistics ((kh · ceil(seq_rows / 32) + group) · HEAD_DIM + c)
    uint k_window_word;  // the rings of recent + KIVI_GROUP binary16 rows per KIVI head
    uint v_window_word;
    uint recent;         // kivi.KiviSpec.recent
    uint state_word;     // the sequences' quantised ends
    uint n_kv;
    uint n_ctx;          // rows of a KV head's region: n_ctx / seq_rows sequences
    uint lengths_word;   // the query block's n_used words, one a sequence
    uint n_seqs;         // sequences appended to (0 .. n_seqs − 1)
    uint seq_rows;       // rows a sequence holds
} pc;

// KIVI head kh = g · (n_ctx / seq_rows) + s: the row of KV head g of sequence s in the source
float kivi_source(bool key, uint kh, uint e) {
    uint seqs = pc.n_ctx / pc.seq_rows, g = kh / seqs, seq = kh - g * seqs;
    return uintBitsToFloat(step_words[(key ? pc.k_src_word : pc.v_src_word) + (seq * pc.n_kv + g) * HEAD_DIM + e]);
}

#include "kivi_append.glsl"

void main() {
    uint seqs = pc.n_ctx / pc.seq_rows;
    for (uint item = gl_WorkGroupID.x; item < pc.n_seqs * pc.n_kv; item += gl_NumWorkGroups.x) {
        uint seq = item / pc.n_kv, g = item - seq * pc.n_kv;
        uint n_used = clamp(query_words[pc.lengths_word + seq], 1u, pc.seq_rows);  // as SEQ_USED clamps it
        KiviLayer a = KiviLayer(pc.k_word, pc.v_word, pc.stats_word, pc.k_window_word, pc.v_window_word, pc.recent,
                                pc.state_word + seq, pc.seq_rows);
        kivi_append_head(a, kivi_head(g, seq, seqs), n_used);
    }
}
