#version 450
// Decode attention over a windowed dictionary layer's exact window (kvdict_vk.window,
// window.glsl): the sink and recent tokens' binary16 rows, which the coded passes
// (attend_flash_coded, attend_direct) skip. One workgroup per (KV head g, query head hj): an
// online softmax over the window's rows whose tokens are below n_used, in chunks of LOCAL
// rows — an invocation a row's score, a reduction for the chunk's maximum, then invocations
// across element quads for p · v — written as one more split record (index split0, after the
// coded passes' splits) that the merge combines with theirs. Like the coded passes it leaves
// the means out — q . mean_k is the same for every token (it cancels), mean_v is added by the
// merge — so the records agree.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "attend_common.glsl"
#include "window.glsl"

const uint LOCAL = gl_WorkGroupSize.x;
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

shared vec2 q_sh[PAIRS];
shared float red_sh[LOCAL];  // the chunk's scores, then their maximum; then the probabilities
shared float p_sh[LOCAL];

float word_at(uint w) { return uintBitsToFloat(layer_words[w]); }

void main() {
    const uint tid = gl_LocalInvocationID.x;
    uint n = layer_words[pc.state_word];
    uint end = min(n, SEQ_USED(q_floats, 0u));
    for (uint h = gl_WorkGroupID.x; h < pc.n_kv * GROUP; h += gl_NumWorkGroups.x) {
        uint g = h / GROUP;
        uint k_mean = pc.k_mean_word + g * pc.head_vec, v_mean = pc.v_mean_word + g * pc.head_vec;
        for (uint c = tid; c < PAIRS; c += LOCAL)
            q_sh[c] = vec2(q_floats[pc.q_word + h * HEAD_DIM + 2u * c], q_floats[pc.q_word + h * HEAD_DIM + 2u * c + 1u]);
        barrier();
        float q_mean = 0.0;  // q . mean_k, left out of every score
        for (uint c = 0u; c < PAIRS; ++c)
            q_mean += dot(q_sh[c], vec2(word_at(k_mean + 2u * c), word_at(k_mean + 2u * c + 1u)));
        float m = NEG_INF, l = 0.0;  // uniform
        vec4 acc = vec4(0.0);        // quad tid (tid < HEAD_DIM / 4) of sum p * v
        for (uint r0 = 0u; r0 < pc.rows; r0 += LOCAL) {
            uint r = r0 + tid;
            float s = NEG_INF;
            if (r < pc.rows && window_token(r, n, pc.sink, pc.recent) < end) {
                uint k_row = pc.k_window_word + (g * pc.rows + r) * PAIRS;
                float dot_ = 0.0;
                for (uint c = 0u; c < PAIRS; ++c)
                    dot_ += dot(q_sh[c], unpackHalf2x16(layer_words[k_row + c]));
                s = (dot_ - q_mean) * pc.score_scale;
            }
            red_sh[tid] = s;
            barrier();
            for (uint width = LOCAL / 2u; width > 0u; width >>= 1u) {
                if (tid < width)
                    red_sh[tid] = max(red_sh[tid], red_sh[tid + width]);
                barrier();
            }
            float m_new = max(m, red_sh[0]);
            barrier();  // all have read the maximum
            float corr = m_new == NEG_INF ? 1.0 : exp(m - m_new);  // m = -inf: exp(-inf) = 0, as wanted
            float p = s == NEG_INF ? 0.0 : exp(s - m_new);
            p_sh[tid] = p;
            barrier();
            float chunk_l = 0.0;
            for (uint x = 0u; x < LOCAL; ++x)
                chunk_l += p_sh[x];
            l = l * corr + chunk_l;
            m = m_new;
            if (tid < HEAD_DIM / 4u) {
                acc *= corr;
                for (uint x = 0u; x < LOCAL && r0 + x < pc.rows; ++x) {
                    float px = p_sh[x];
                    if (px != 0.0) {
                        uint v_row = pc.v_window_word + (g * pc.rows + r0 + x) * PAIRS + 2u * tid;
                        acc += px * vec4(unpackHalf2x16(layer_words[v_row]), unpackHalf2x16(layer_words[v_row + 1u]));
                    }
                }
            }
            barrier();  // p_sh is rewritten by the next chunk
        }
        uint rec = record(pc.split0, g, pc.n_kv) + (h - g * GROUP);
        if (tid == 0u) {
            stats[rec * 2u] = m;
            stats[rec * 2u + 1u] = l;
        }
        if (tid < HEAD_DIM / 4u) {  // sum p (v - mean_v) = sum p v - l mean_v
            uint w = v_mean + 4u * tid;
            accs[rec * Q4 + tid] = acc - l * vec4(word_at(w), word_at(w + 1u), word_at(w + 2u), word_at(w + 3u));
        }
        barrier();  // q_sh is rewritten by the next item
    }
}
