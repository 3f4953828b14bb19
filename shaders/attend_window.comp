#version 450
// Decode attention over a windowed dictionary layer's exact window (kvdict_vk.window,
// window.glsl): the sink and recent tokens' binary16 rows, which the coded passes
// (attend_flash_coded, attend_direct) skip. One invocation per (KV head g, query head hj):
// an online softmax over the window's rows whose tokens are below n_used, written as one
// more split record (index split0, after the coded passes' splits) that the merge combines
// with theirs. Like the coded passes it leaves the means out — q . mean_k is the same for
// every token (it cancels), mean_v is added by the merge — so the records agree.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "attend_common.glsl"
#include "window.glsl"

const uint PAIRS = HEAD_DIM / 2u;

layout(std430, binding = 0) readonly buffer LayerWords { uint layer_words[]; };
layout(std430, binding = 1) readonly buffer Query { float q_floats[]; };
layout(std430, binding = 2) writeonly buffer Accs { vec4 accs[]; };
layout(std430, binding = 3) writeonly buffer Stats { float stats[]; };

layout(push_constant) uniform AttendWindowPush {
    uint k_window_word;  // the K stream's window block: (g * rows + row) * HEAD_DIM / 2 words
    uint v_window_word;
    uint rows;           // sink + recent
    uint sink;
    uint recent;
    uint state_word;     // the layer's token count
    uint k_mean_word;    // the streams' means (zeros when absent), KV head g's at + g * head_vec
    uint v_mean_word;
    uint head_vec;
    uint n_kv;
    uint n_used;
    uint split0;         // the record index this pass writes
    uint n_seqs;         // 1 (attend_common.glsl's SEQ_USED)
    uint q_word;
    float score_scale;
} pc;

vec4 mean_quad(uint word, uint c) {
    uint w = word + 4u * c;
    return uintBitsToFloat(uvec4(layer_words[w], layer_words[w + 1u], layer_words[w + 2u], layer_words[w + 3u]));
}

vec4 row_quad(uint word, uint c) {
    uint w = word + 2u * c;
    return vec4(unpackHalf2x16(layer_words[w]), unpackHalf2x16(layer_words[w + 1u]));
}

void main() {
    uint n = layer_words[pc.state_word];
    uint end = min(n, SEQ_USED(q_floats, 0u));
    for (uint h = gl_GlobalInvocationID.x; h < pc.n_kv * GROUP; h += grid_size()) {
        uint g = h / GROUP;
        vec4 q[Q4], acc[Q4];
        [[unroll]] for (uint c = 0u; c < Q4; ++c) {
            uint f = pc.q_word + h * HEAD_DIM + 4u * c;
            q[c] = vec4(q_floats[f], q_floats[f + 1u], q_floats[f + 2u], q_floats[f + 3u]);
            acc[c] = vec4(0.0);
        }
        float m = NEG_INF, l = 0.0;
        uint k_mean = pc.k_mean_word + g * pc.head_vec, v_mean = pc.v_mean_word + g * pc.head_vec;
        for (uint r = 0u; r < pc.rows; ++r) {
            if (window_token(r, n, pc.sink, pc.recent) >= end)
                continue;
            uint k_row = pc.k_window_word + (g * pc.rows + r) * PAIRS;
            uint v_row = pc.v_window_word + (g * pc.rows + r) * PAIRS;
            float s = 0.0;
            [[unroll]] for (uint c = 0u; c < Q4; ++c)
                s += dot(q[c], row_quad(k_row, c) - mean_quad(k_mean, c));
            s *= pc.score_scale;
            float m_new = max(m, s);
            float corr = exp(m - m_new);  // 0 for the first token (m = -inf)
            float p = exp(s - m_new);
            l = l * corr + p;
            m = m_new;
            [[unroll]] for (uint c = 0u; c < Q4; ++c)
                acc[c] = acc[c] * corr + p * (row_quad(v_row, c) - mean_quad(v_mean, c));
        }
        uint rec = record(pc.split0, g, pc.n_kv) + (h - g * GROUP);
        stats[rec * 2u] = m;
        stats[rec * 2u + 1u] = l;
        [[unroll]] for (uint c = 0u; c < Q4; ++c)
            accs[rec * Q4 + c] = acc[c];
    }
}
