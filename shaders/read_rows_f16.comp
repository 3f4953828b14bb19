#version 450
// Read of an f16 passthrough stream (the default uncoded cache): rows (h, t0 .. t0+n_tok) of
// HEAD_DIM halves — two per word, element 2k in the low half (docs/ARENA.md) — widened to f32
// into the output. One invocation per word (two elements), grid-stride; unpackHalf2x16 is
// exact, so the read equals numpy's float16 → float32 conversion bit for bit.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(constant_id = 0) const uint HEAD_DIM = 64u;  // even
const uint ROW_WORDS = HEAD_DIM / 2u;

layout(std430, binding = 0) readonly buffer LayerWords { uint layer_words[]; };
layout(std430, binding = 1) writeonly buffer OutPairs { vec2 out_pairs[]; };

#include "read_rows.glsl"

void main() {
    uint n = pc.n_rows * ROW_WORDS;
    for (uint i = gl_GlobalInvocationID.x; i < n; i += grid_stride()) {
        uint row = i / ROW_WORDS;
        uint e = i - row * ROW_WORDS;
        uint w = layer_words[pc.src_word + stored_row(row) * ROW_WORDS + e];
        out_pairs[pc.out_word / 2u + i] = unpackHalf2x16(w);
    }
}
