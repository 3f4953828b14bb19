#version 450
// RoPE in place over n_rows rows of head_dim floats: adjacent pairs (2i, 2i + 1), i below
// rope_dim / 2, rotated by the angles of the position at word pos_word of the step's values, from a table
// the host made as kvdict_vk.forge.llama.rope_cos_sin makes it (row p: rope_dim / 2 cosines,
// then rope_dim / 2 sines).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(std430, binding = 0) readonly buffer Table { float table_vals[]; };
layout(std430, binding = 1) readonly buffer Values { uint value_words[]; };
layout(std430, binding = 2) buffer Rows { float row_vals[]; };

layout(push_constant) uniform RopePush {
    uint row_word;
    uint n_rows;
    uint head_dim;
    uint rope_dim;
    uint pos_word;
    uint n_pos;  // the table's positions: a position past it reads the last
} pc;

void main() {
    uint half_dim = pc.rope_dim / 2u;
    uint p = min(value_words[pc.pos_word], pc.n_pos - 1u);
    for (uint w = gl_GlobalInvocationID.x; w < pc.n_rows * half_dim; w += grid_stride()) {
        uint r = w / half_dim, i = w - r * half_dim;
        uint e = pc.row_word + r * pc.head_dim + 2u * i;
        float c = table_vals[p * pc.rope_dim + i], s = table_vals[p * pc.rope_dim + half_dim + i];
        float even = row_vals[e], odd = row_vals[e + 1u];
        precise float a = even * c - odd * s;
        precise float b = even * s + odd * c;
        row_vals[e] = a;
        row_vals[e + 1u] = b;
    }
}
