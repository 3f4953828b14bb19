#version 450
// A recorded decode step's append (kvdict_vk.vk.arena.decode): one new token of each of
// n_seqs sequences, K and V words, written at the row its n_used names — read from the query
// block the attention after it reads (attend_common.glsl's SEQ_USED word: the token's
// position + 1), so one recording serves every step. The step buffer holds at k_src_word the K
// words (sequence, KV head, k_row_words), at v_src_word the V words (v_row_words a row).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(std430, binding = 0) readonly buffer Step { uint step_words[]; };
layout(std430, binding = 1) readonly buffer Query { uint query_words[]; };
layout(std430, binding = 2) writeonly buffer Layer { uint layer_words[]; };

layout(push_constant) uniform AppendStepPush {
    uint k_src_word;
    uint v_src_word;
    uint k_word;        // the layer's K region: n_ctx rows per KV head
    uint v_word;
    uint k_row_words;
    uint v_row_words;
    uint n_kv;
    uint n_seqs;
    uint n_ctx;
    uint seq_rows;      // rows a sequence holds (its first is seq * seq_rows)
    uint lengths_word;  // the query block's n_used words, one per sequence
} pc;

void main() {
    uint k_words = pc.n_seqs * pc.n_kv * pc.k_row_words;
    uint n_words = k_words + pc.n_seqs * pc.n_kv * pc.v_row_words;
    for (uint w = gl_GlobalInvocationID.x; w < n_words; w += grid_stride()) {
        bool key = w < k_words;
        uint row_words = key ? pc.k_row_words : pc.v_row_words;
        uint x = key ? w : w - k_words;
        uint row = x / row_words;  // seq * n_kv + head
        uint seq = row / pc.n_kv;
        uint head = row - seq * pc.n_kv;
        // clamped as SEQ_USED clamps it: a bad length writes inside the sequence's rows
        uint t = clamp(query_words[pc.lengths_word + seq], 1u, pc.seq_rows) - 1u;
        uint dst = (key ? pc.k_word : pc.v_word) + (head * pc.n_ctx + seq * pc.seq_rows + t) * row_words
                 + (x - row * row_words);
        layer_words[dst] = step_words[(key ? pc.k_src_word : pc.v_src_word) + x];
    }
}
