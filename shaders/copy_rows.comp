#version 450
// Passthrough read: copy one stream's f32 rows (h, t0 .. t0+n_tok) of a layer into the
// output, bit-exact (uint views, so NaN payloads survive).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(constant_id = 0) const uint HEAD_DIM = 64u;
layout(constant_id = 1) const uint CHUNKS = 1u;  // as in reconstruct.comp

const uint ROW_CHUNKS = HEAD_DIM / LANES;
const uint GROUPS = ROW_CHUNKS / CHUNKS;

layout(std430, binding = 0) readonly buffer LayerElems { UELEM layer_elems[]; };
layout(std430, binding = 1) writeonly buffer OutElems { UELEM out_elems[]; };

#include "read_rows.glsl"

void main() {
    uint gid = gl_GlobalInvocationID.x;
    uint group = gid % GROUPS;
    uint row_step = grid_stride() / GROUPS;
    uint src_elem = pc.src_word / LANES;
    uint out_elem = pc.out_word / LANES;
    for (uint row = gid / GROUPS; row < pc.n_rows; row += row_step) {
        uint src_row = src_elem + stored_row(row) * ROW_CHUNKS;
        for (uint k = 0u; k < CHUNKS; ++k) {
            uint chunk = group + k * GROUPS;
            out_elems[out_elem + row * ROW_CHUNKS + chunk] = layer_elems[src_row + chunk];
        }
    }
}
