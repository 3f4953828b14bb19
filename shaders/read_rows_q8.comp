#version 450
// Read of a q8_0 passthrough stream: rows (h, t0 .. t0+n_tok), each its block scales (f16
// pairs, block 2k in the low half) then HEAD_DIM int8 values four to a word (element 4k in
// the low byte; docs/ARENA.md), decoded to f32 as value * scale — the twin of
// kvdict_vk.layout.q8_0_rows. One invocation per value word (four elements), grid-stride.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(constant_id = 0) const uint HEAD_DIM = 64u;  // a multiple of 32
const uint SCALE_WORDS = (HEAD_DIM / 32u + 1u) / 2u;
const uint VALUE_WORDS = HEAD_DIM / 4u;
const uint ROW_WORDS = SCALE_WORDS + VALUE_WORDS;

layout(std430, binding = 0) readonly buffer LayerWords { uint layer_words[]; };
layout(std430, binding = 1) writeonly buffer OutQuads { vec4 out_quads[]; };

#include "read_rows.glsl"

void main() {
    uint n = pc.n_rows * VALUE_WORDS;
    for (uint i = gl_GlobalInvocationID.x; i < n; i += grid_stride()) {
        uint row = i / VALUE_WORDS;
        uint c = i - row * VALUE_WORDS;  // value word: elements 4c .. 4c+3, block 4c / 32
        uint base = pc.src_word + stored_row(row) * ROW_WORDS;
        uint block = c / 8u;
        float d = unpackHalf2x16(layer_words[base + block / 2u])[block % 2u];
        out_quads[pc.out_word / 4u + i] = int8x4(layer_words[base + SCALE_WORDS + c]) * d;
    }
}
