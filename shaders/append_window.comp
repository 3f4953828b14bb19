#version 450
// A recorded decode step's append to a windowed dictionary layer's exact window
// (kvdict_vk.window, window.glsl; kvdict_vk.vk.arena.decode): the new token — position
// n_used - 1, n_used read from the query block as append_step reads it — in binary16 at its
// window row of both streams (NumPy's rounding, rows_encode.glsl), and the layer's state word
// n_used. Its slots go in by append_step beside it. One invocation per (stream, KV head,
// element pair); one sequence.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "rows_encode.glsl"
#include "window.glsl"

layout(local_size_x = WG_SIZE) in;

layout(std430, binding = 0) readonly buffer Step { uint step_words[]; };
layout(std430, binding = 1) readonly buffer Query { uint query_words[]; };
layout(std430, binding = 2) writeonly buffer Layer { uint layer_words[]; };

layout(push_constant) uniform AppendWindowPush {
    uint k_rows_word;    // the token's K rows, float32 (KV head, head_dim)
    uint v_rows_word;
    uint k_window_word;  // the windows: (h * rows + row) * head_dim / 2 words
    uint v_window_word;
    uint rows;
    uint sink;
    uint recent;
    uint state_word;
    uint n_kv;
    uint head_dim;
    uint lengths_word;   // the query block's n_used word
} pc;

void main() {
    uint n_used = query_words[pc.lengths_word];
    uint t = n_used - 1u;
    bool kept = t < pc.sink || pc.recent > 0u;
    uint pairs = pc.head_dim / 2u;
    uint items = 2u * pc.n_kv * pairs;
    if (gl_GlobalInvocationID.x == 0u)
        layer_words[pc.state_word] = n_used;
    for (uint i = gl_GlobalInvocationID.x; i < items && kept; i += grid_stride()) {
        uint j = i / (pc.n_kv * pairs);  // 0: K, 1: V
        uint hc = i - j * pc.n_kv * pairs;
        uint h = hc / pairs, c = hc - h * pairs;
        uint src = (j == 0u ? pc.k_rows_word : pc.v_rows_word) + h * pc.head_dim + 2u * c;
        uint lo = f16_bits(uintBitsToFloat(step_words[src]));
        uint hi = f16_bits(uintBitsToFloat(step_words[src + 1u]));
        uint row = window_row(t, pc.sink, pc.recent);
        layer_words[(j == 0u ? pc.k_window_word : pc.v_window_word) + (h * pc.rows + row) * pairs + c] = lo | (hi << 16u);
    }
}
