#version 450
// Decode attention over a windowed dictionary layer's exact window (kvdict_vk.window,
// window.glsl): the sink and recent tokens' binary16 rows, which the coded passes
// (attend_flash_coded, attend_direct) skip. One workgroup per (KV head g, query head hj): an
// online softmax over the window's rows whose tokens are below n_used, in chunks of LOCAL
// rows, written as one more split record (index split0, after the coded passes' splits) that
// the merge combines with theirs. Like the coded passes it leaves the means out — q . mean_k
// is the same for every token (it cancels), mean_v is added by the merge — so the records
// agree; beside keys coded before RoPE (score_k_mean), whose pass scores q . mean_k (turned,
// it no longer cancels), it keeps q . mean_k in the window's scores too.
// The window is short and its pass runs beside the coded pass's table, so its time is a few
// memory latencies in a row: every invocation works on every phase and issues its loads
// together — a row's score an invocation (its key's words unrolled), the chunk's maximum and
// sum of p by trees, then p · v with the invocations across (row group, element quad): RG =
// LOCAL / (HEAD_DIM / 4) row groups each take every RG-th row of the chunk (unrolled: their
// rows' loads in flight together), and row group 0 adds the others' quads.
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
    uint score_k_mean;   // 1: the coded pass scores q . mean_k (keys coded before RoPE): keep it
    float score_scale;
} pc;

const uint QUADS = HEAD_DIM / 4u;
const uint RG = LOCAL / QUADS;               // p · v row groups (LOCAL >= QUADS: host-checked)
const uint RG_ROWS = (LOCAL + RG - 1u) / RG;  // a row group's rows of a chunk, at most

shared vec2 q_sh[PAIRS];
shared float red_sh[LOCAL];  // the trees: q . mean_k's products, the chunk's maximum, its sum of p
shared float p_sh[LOCAL];    // the chunk's probabilities
shared vec4 acc_sh[LOCAL];   // the row groups' quads of sum p · v

uint tid;

float word_at(uint w) { return uintBitsToFloat(layer_words[w]); }

// The sum (take_max false) or maximum of red_sh[0 .. LOCAL) into red_sh[0]; every
// invocation's value is in red_sh, written before the call.
void tree(bool take_max) {
    barrier();
    for (uint width = LOCAL / 2u; width > 0u; width >>= 1u) {
        if (tid < width)
            red_sh[tid] = take_max ? max(red_sh[tid], red_sh[tid + width]) : red_sh[tid] + red_sh[tid + width];
        barrier();
    }
}

void main() {
    tid = gl_LocalInvocationID.x;
    const uint quad = tid % QUADS, rg = tid / QUADS;  // rg >= RG: no rows (LOCAL % QUADS invocations)
    uint n = layer_words[pc.state_word];
    uint end = min(n, SEQ_USED(q_floats, 0u));
    for (uint h = gl_WorkGroupID.x; h < pc.n_kv * GROUP; h += gl_NumWorkGroups.x) {
        uint g = h / GROUP;
        uint k_mean = pc.k_mean_word + g * pc.head_vec, v_mean = pc.v_mean_word + g * pc.head_vec;
        float qm = 0.0;  // q . mean_k, left out of every score: a pair's product an invocation, a tree
        for (uint c = tid; c < PAIRS; c += LOCAL) {
            vec2 q = vec2(q_floats[pc.q_word + h * HEAD_DIM + 2u * c], q_floats[pc.q_word + h * HEAD_DIM + 2u * c + 1u]);
            q_sh[c] = q;
            qm += dot(q, vec2(word_at(k_mean + 2u * c), word_at(k_mean + 2u * c + 1u)));
        }
        red_sh[tid] = qm;
        tree(false);
        const float q_mean = pc.score_k_mean != 0u ? 0.0 : red_sh[0];
        float m = NEG_INF, l = 0.0;  // uniform
        vec4 acc = vec4(0.0);        // (row group 0) quad `quad` of sum p * v
        for (uint r0 = 0u; r0 < pc.rows; r0 += LOCAL) {
            barrier();  // red_sh's last reads are done
            uint r = r0 + tid;
            float s = NEG_INF;
            if (r < pc.rows && window_token(r, n, pc.sink, pc.recent) < end) {
                uint k_row = pc.k_window_word + (g * pc.rows + r) * PAIRS;
                vec2 d2[4] = vec2[4](vec2(0.0), vec2(0.0), vec2(0.0), vec2(0.0));  // four chains of sums
                [[unroll]] for (uint c = 0u; c < PAIRS; ++c)
                    d2[c % 4u] += q_sh[c] * unpackHalf2x16(layer_words[k_row + c]);
                vec2 d = (d2[0] + d2[1]) + (d2[2] + d2[3]);
                s = ((d.x + d.y) - q_mean) * pc.score_scale;
            }
            red_sh[tid] = s;
            tree(true);
            float m_new = max(m, red_sh[0]);
            float corr = m_new == NEG_INF ? 1.0 : exp(m - m_new);  // m = -inf: exp(-inf) = 0, as wanted
            float p = s == NEG_INF ? 0.0 : exp(s - m_new);
            barrier();  // all have read the maximum
            p_sh[tid] = p;
            red_sh[tid] = p;
            tree(false);
            l = l * corr + red_sh[0];
            m = m_new;
            acc *= corr;
            vec4 part = vec4(0.0);  // this row group's rows of the chunk
            [[unroll]] for (uint j = 0u; j < RG_ROWS; ++j) {
                uint x = rg + j * RG;
                if (rg >= RG || x >= LOCAL)
                    continue;
                uint row = min(r0 + x, pc.rows - 1u);  // a row past the window: p 0, any row's words
                uint v_row = pc.v_window_word + (g * pc.rows + row) * PAIRS + 2u * quad;
                vec4 v = vec4(unpackHalf2x16(layer_words[v_row]), unpackHalf2x16(layer_words[v_row + 1u]));
                float px = p_sh[x];
                part += px != 0.0 ? px * v : vec4(0.0);  // a row not attended adds nothing (a row not yet written holds anything)
            }
            acc_sh[tid] = part;
            barrier();
            if (rg == 0u) {
                acc += part;
                for (uint x = 1u; x < RG; ++x)
                    acc += acc_sh[x * QUADS + quad];
            }
        }
        uint rec = record(pc.split0, g, pc.n_kv) + (h - g * GROUP);
        if (tid == 0u) {
            stats[rec * 2u] = m;
            stats[rec * 2u + 1u] = l;
        }
        if (rg == 0u) {  // sum p (v - mean_v) = sum p v - l mean_v
            uint w = v_mean + 4u * quad;
            accs[rec * Q4 + quad] = acc - l * vec4(word_at(w), word_at(w + 1u), word_at(w + 2u), word_at(w + 3u));
        }
        barrier();  // q_sh and acc_sh are rewritten by the next item
    }
}
