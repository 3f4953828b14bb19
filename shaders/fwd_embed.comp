#version 450
// y = row `token` of the embedding matrix, as float32 (weights.glsl's formats); the token is
// the word at token_word of the step's values (the host writes it). A batch: sequence s's token
// at token_word + s, its row at y_word + s · n_cols.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(std430, binding = 0) readonly buffer Weights { uint w_words[]; };
layout(std430, binding = 1) readonly buffer Values { uint value_words[]; };
layout(std430, binding = 2) writeonly buffer State { uint state_words[]; };

#include "weights.glsl"

layout(push_constant) uniform EmbedPush {
    uint w_word;
    uint token_word;
    uint y_word;
    uint n_rows;  // the vocabulary: a token past it reads row n_rows - 1
    uint n_cols;
    uint n_seqs;
} pc;

void main() {
    for (uint seq = gl_WorkGroupID.y; seq < pc.n_seqs; seq += gl_NumWorkGroups.y) {
        uint token = min(value_words[pc.token_word + seq], pc.n_rows - 1u);
        uint row = pc.w_word + token * (pc.n_cols / 32u) * BLOCK_WORDS;
        for (uint c = gl_GlobalInvocationID.x; c < pc.n_cols / 8u; c += grid_stride()) {
            vec4 lo, hi;
            block_chunk(row + (c / 4u) * BLOCK_WORDS, c & 3u, lo, hi);
            uint y = pc.y_word + seq * pc.n_cols + 8u * c;
            for (uint i = 0u; i < 4u; ++i) {
                state_words[y + i] = floatBitsToUint(lo[i]);
                state_words[y + 4u + i] = floatBitsToUint(hi[i]);
            }
        }
    }
}
