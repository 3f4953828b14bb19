#version 450
// Keys coded before RoPE (kvdict_vk.rope) over rows in place: row r = h·n_tok + i holds the
// key of token t0 + i, turned to that position. Run after
// reconstruct over a read's K rows (before read_window, whose exact rows are turned already).
// One invocation per (row, chunk), grid-stride.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "rope.glsl"

layout(local_size_x = WG_SIZE) in;

layout(constant_id = 0) const uint HEAD_DIM = 64u;  // a multiple of 4
const uint Q4 = HEAD_DIM / 4u;

layout(std430, binding = 0) readonly buffer LayerQuads { vec4 layer_quads[]; };
layout(std430, binding = 1) buffer Rows { vec4 rows[]; };

layout(push_constant) uniform RopeRowsPush {
    uint table_word;  // the K stream's rotation table (multiple of 4)
    uint hi_rows;
    uint shift;       // B = 1 << shift
    uint t0;
    uint n_tok;
    uint n_rows;      // n_kv * n_tok
    uint out_word;    // the rows, row r at out_word + r * HEAD_DIM (multiple of 4)
} pc;

void main() {
    uint items = pc.n_rows * Q4;
    uint table = pc.table_word / 4u;
    for (uint i = gl_GlobalInvocationID.x; i < items; i += grid_stride()) {
        uint r = i / Q4;
        uint c = i - r * Q4;
        uvec2 q = rope_quads(pc.t0 + r % pc.n_tok, c, pc.hi_rows, pc.shift, Q4);
        uint at = pc.out_word / 4u + i;
        rows[at] = rope_turn(rows[at], layer_quads[table + q.x], layer_quads[table + q.y]);
    }
}
