#version 450
// The exact window of a dict-coded stream (kvdict_vk.window, docs/ARENA.md) over a read's
// rows: run after reconstruct into the same output, it overwrites the rows of the tokens the
// window holds with their binary16 values (window.glsl). One invocation per (KV head, window
// row, element pair), grid-stride. n is the layer's state word (the tokens appended, written
// by every append), so a recorded read stays right as the cache grows.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "window.glsl"

layout(local_size_x = WG_SIZE) in;

layout(constant_id = 0) const uint HEAD_DIM = 64u;  // even
const uint PAIRS = HEAD_DIM / 2u;

layout(std430, binding = 0) readonly buffer LayerWords { uint layer_words[]; };
layout(std430, binding = 1) writeonly buffer OutPairs { vec2 out_pairs[]; };

layout(push_constant) uniform ReadWindowPush {
    uint window_word;  // the stream's window block: (h * rows + row) * HEAD_DIM / 2 words
    uint rows;         // sink + recent
    uint sink;
    uint recent;
    uint state_word;   // the layer's token count
    uint n_kv;
    uint t0;           // the read's tokens t0 .. t0 + n_tok
    uint n_tok;
    uint out_word;     // the stream's rows in the output, (h * n_tok + t - t0) * HEAD_DIM; even
} pc;

void main() {
    uint n = layer_words[pc.state_word];
    uint items = pc.n_kv * pc.rows * PAIRS;
    for (uint i = gl_GlobalInvocationID.x; i < items; i += grid_stride()) {
        uint hr = i / PAIRS;
        uint c = i - hr * PAIRS;
        uint h = hr / pc.rows;
        uint r = hr - h * pc.rows;
        uint t = window_token(r, n, pc.sink, pc.recent);
        if (t < n && t >= pc.t0 && t - pc.t0 < pc.n_tok)
            out_pairs[pc.out_word / 2u + (h * pc.n_tok + t - pc.t0) * PAIRS + c] =
                unpackHalf2x16(layer_words[pc.window_word + hr * PAIRS + c]);
    }
}
