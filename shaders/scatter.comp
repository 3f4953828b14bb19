#version 450
// Write path: move freshly encoded code words (or raw f32 rows — all 32-bit words) from
// the small upload buffer into their slots in a layer buffer. Word w of the upload is
// row r = w / row_words, element w % row_words; row r is token (r % group_rows) of group
// (head) r / group_rows, stored at dst_word + group*group_stride + (r % group_rows)*row_words.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(std430, binding = 0) readonly buffer Upload { uint upload_words[]; };
layout(std430, binding = 1) writeonly buffer Layer { uint layer_words[]; };

layout(push_constant) uniform ScatterPush {
    uint src_word;
    uint dst_word;
    uint row_words;
    uint group_rows;
    uint group_stride;
    uint n_words;
} pc;

void main() {
    for (uint w = gl_GlobalInvocationID.x; w < pc.n_words; w += grid_stride()) {
        uint row = w / pc.row_words;
        uint group = row / pc.group_rows;
        uint dst = pc.dst_word + group * pc.group_stride
                 + (row - group * pc.group_rows) * pc.row_words + (w - row * pc.row_words);
        layer_words[dst] = upload_words[pc.src_word + w];
    }
}
