#version 450
// Decode attention straight over the KIVI cache's words (kvdict_vk.kivi, docs/ARENA.md),
// FlashDecoding-shaped like attend_flash.comp: ONE WORKGROUP per (split i, KV head g) attends
// all GROUP query heads of g over the split's tokens (the queries, times the score scale, in
// shared memory) and writes one record per query head in attend_flash's format
// (attend_common.glsl: stats (m, l), accs acc[HEAD_DIM]), which attend_merge_head merges.
//
// The split is walked a chunk at a time: the tokens of one 32-token key group (a split need
// not start on a group: its first chunk runs to the next group boundary). A chunk below the
// layer's quantised end q (its state word, written by every append: a recorded attention
// stays right as the cache grows) is quantised, else exact (q is a multiple of 32, so a chunk
// is one or the other):
//  * keys, quantised: the group's per-channel (scale, min) are folded into the queries once
//    per chunk — qk[h][c] = q[h][c]·scale_c and bias[h] = Σ_c q[h][c]·min_c (BIAS_LANES
//    partial sums in shared memory) — so a key's score is Σ_c qk[h][c]·level_c + bias[h]
//    over the levels of its packed K_BITS-bit row (32 channels a block of K_BITS words,
//    loaded together); exact: Σ_c q[h][c]·k_c over its binary16 window row (ring slot t mod window);
//  * scores: one invocation per (query head, token) of the chunk; the chunk's maximum per
//    head moves the head's reference m (the accumulators rescaled by exp(m_old − m));
//    probabilities exp(s − m) in shared memory;
//  * values: invocation tid owns element e = tid mod HEAD_DIM of query heads
//    tid / HEAD_DIM + k·(LOCAL / HEAD_DIM) (LOCAL a multiple of HEAD_DIM, host-checked), so
//    each decodes a value element once per token — level·scale + min with the token's dim
//    group's (scale, min) at the row's start, or the window's binary16 — and adds p·v for
//    each of its heads.
// Four barriers a chunk. Core Vulkan 1.1 only: 32-bit storage, no subgroups, no float16.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "attend_common.glsl"
#include "kivi.glsl"

layout(constant_id = 4) const uint K_BITS = 4u;  // 2 .. 8 (kvdict_vk.kivi.KiviSpec.k_bits)
layout(constant_id = 5) const uint V_BITS = 4u;  // 2 .. 8
const uint LOCAL = gl_WorkGroupSize.x;          // specialization constant 2; a multiple of HEAD_DIM
const uint K_ROW = SLOT_LEVEL_WORDS_OF(HEAD_DIM, K_BITS);              // a key: its levels
const uint V_STATS = HEAD_DIM / KIVI_GROUP;                            // a value: its dim groups' stats,
const uint V_ROW = V_STATS + SLOT_LEVEL_WORDS_OF(HEAD_DIM, V_BITS);    // then its levels
const uint HALF_ROW = HEAD_DIM / 2u;                                   // a window row: binary16 pairs
const uint MAX_BITS = 8u;                       // kvdict_vk.kivi.MAX_BITS
const uint MAX_G = 8u;                          // query heads per KV head at most (host)
const uint HEADS_PER_PASS = LOCAL / HEAD_DIM;   // query heads whose element e one pass of LOCAL covers
const uint BIAS_LANES = 8u;                     // partial sums of q·min per query head
const uint CHUNK = KIVI_GROUP;                  // tokens of a chunk at most

layout(std430, binding = 0) readonly buffer LayerWords { uint layer_words[]; };
layout(std430, binding = 1) readonly buffer Query { float q_floats[]; };
layout(std430, binding = 2) writeonly buffer Accs { float acc_floats[]; };
layout(std430, binding = 3) writeonly buffer Stats { float stats[]; };

layout(push_constant) uniform AttendFlashKiviPush {
    uint k_word;         // the layer's K levels: n_ctx rows of K_ROW words per KV head
    uint v_word;         // its V rows: n_ctx rows of V_ROW words per KV head
    uint n_ctx;
    uint n_used;         // tokens attended over
    uint split_len;      // tokens per split
    uint n_splits;       // splits per KV head
    uint n_kv;
    uint stats_word;     // the keys' group statistics: (g * ceil(n_ctx / 32) + group) * HEAD_DIM + c
    uint k_window_word;  // the exact windows: rings of `window` binary16 rows per KV head
    uint v_window_word;
    uint window;
    uint state_word;     // the layer's quantised end: tokens below it are quantised
    float score_scale;
} pc;

shared float q_sh[GROUP * HEAD_DIM];        // the queries times the score scale
shared float qk_sh[GROUP * HEAD_DIM];       // folded with the chunk's key group: q_c · scale_c
shared float bias_sh[GROUP * BIAS_LANES];   // partial sums of q_c · min_c
shared float p_sh[GROUP * CHUNK];           // the chunk's scores, then its probabilities
shared float m_sh[GROUP];                   // each head's reference after the chunk
shared float corr_sh[GROUP];                // exp(m_old - m): the accumulators' rescale

// Query head h's score of token t (of KV head g): the chunk's folded queries over its
// levels (quantised), or the queries over its window row (exact).
float key_score(uint h, uint t, uint g, bool exact) {
    float s = 0.0;
    if (exact) {
        uint w = kivi_window_row(pc.k_window_word, g, t, pc.window, HEAD_DIM);
        for (uint c2 = 0u; c2 < HALF_ROW; ++c2) {
            vec2 k = unpackHalf2x16(layer_words[w + c2]);
            s += q_sh[h * HEAD_DIM + 2u * c2] * k.x + q_sh[h * HEAD_DIM + 2u * c2 + 1u] * k.y;
        }
        return s;
    }
    // the row's levels, element c at bit c·K_BITS: 32 channels take K_BITS whole words, so
    // each block of 32 is loaded at once and unpacked with constant shifts once unrolled
    uint w = pc.k_word + (g * pc.n_ctx + t) * K_ROW;
    for (uint b = 0u; b < HEAD_DIM / KIVI_GROUP; ++b) {
        uint kw[MAX_BITS + 1u];  // the block's words, then 0 (the "next word" of its last level)
        [[unroll]] for (uint i = 0u; i <= MAX_BITS; ++i) {
            kw[i] = 0u;
            if (i < K_BITS)
                kw[i] = layer_words[w + b * K_BITS + i];
        }
        [[unroll]] for (uint c = 0u; c < KIVI_GROUP; ++c) {
            uint bit = c * K_BITS;
            uint level = residual_level(kw[bit >> 5u], kw[(bit >> 5u) + 1u], bit & 31u, K_BITS);
            s += qk_sh[h * HEAD_DIM + b * KIVI_GROUP + c] * float(level);
        }
    }
    float bias = 0.0;
    [[unroll]] for (uint r = 0u; r < BIAS_LANES; ++r)
        bias += bias_sh[h * BIAS_LANES + r];
    return s + bias;
}

// Element e of token t's value (KV head g).
float value_elem(uint e, uint t, uint g, bool exact) {
    if (exact)
        return unpackHalf2x16(layer_words[kivi_window_row(pc.v_window_word, g, t, pc.window, HEAD_DIM) + e / 2u])[e & 1u];
    uint base = pc.v_word + (g * pc.n_ctx + t) * V_ROW;
    uint bit = e * V_BITS;
    uint lw = base + V_STATS + (bit >> 5u);
    uint w1 = kivi_straddles(e, V_BITS) ? layer_words[lw + 1u] : 0u;
    uint level = residual_level(layer_words[lw], w1, bit & 31u, V_BITS);
    return kivi_value(level, kivi_scale_min(layer_words[base + e / KIVI_GROUP]));
}

// The chunk's key group statistics folded into the queries (qk_sh, bias_sh): invocation x
// takes query head x / BIAS_LANES, channels x mod BIAS_LANES + k·BIAS_LANES (neighbouring
// invocations read neighbouring stats words).
void fold_keys(uint tid, uint g, uint c0) {
    uint n_groups = (pc.n_ctx + KIVI_GROUP - 1u) / KIVI_GROUP;
    uint sw = pc.stats_word + (g * n_groups + c0 / KIVI_GROUP) * HEAD_DIM;
    for (uint x = tid; x < GROUP * BIAS_LANES; x += LOCAL) {
        uint h = x / BIAS_LANES, r = x % BIAS_LANES;
        float b = 0.0;
        for (uint c = r; c < HEAD_DIM; c += BIAS_LANES) {
            vec2 sm = kivi_scale_min(layer_words[sw + c]);
            float qc = q_sh[h * HEAD_DIM + c];
            qk_sh[h * HEAD_DIM + c] = qc * sm.x;
            b += qc * sm.y;
        }
        bias_sh[x] = b;
    }
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint e = tid % HEAD_DIM, h0 = tid / HEAD_DIM;  // this invocation's value element and first head
    const uint q_end = layer_words[pc.state_word];
    uint items = pc.n_kv * pc.n_splits;
    for (uint item = gl_WorkGroupID.x; item < items; item += gl_NumWorkGroups.x) {
        uint g = item % pc.n_kv;
        uint i = item / pc.n_kv;
        uint t0 = i * pc.split_len;
        uint t_end = t0 < pc.n_used ? min(t0 + pc.split_len, pc.n_used) : t0;  // t0: an empty split

        for (uint x = tid; x < GROUP * HEAD_DIM; x += LOCAL)
            q_sh[x] = q_floats[g * GROUP * HEAD_DIM + x] * pc.score_scale;
        float m = NEG_INF, l = 0.0;  // query head tid's reference and sum of p (tid < GROUP)
        float acc[MAX_G];            // element e of query head h0 + k·HEADS_PER_PASS's sum of p·v
        [[unroll]] for (uint k = 0u; k < MAX_G; ++k)
            acc[k] = 0.0;
        barrier();  // q_sh
        if (t0 < t_end && t0 < q_end)
            fold_keys(tid, g, t0);
        for (uint c0 = t0; c0 < t_end;) {
            uint c1 = min(t_end, (c0 / CHUNK + 1u) * CHUNK);  // the chunk: to the group's end
            uint n_c = c1 - c0;
            bool exact = c0 >= q_end;
            barrier();  // the fold is written; the last chunk's probabilities are read
            // the scores of (query head, token)
            for (uint x = tid; x < GROUP * CHUNK; x += LOCAL) {
                uint h = x / CHUNK, j = x % CHUNK;
                p_sh[x] = j < n_c ? key_score(h, c0 + j, g, exact) : NEG_INF;
            }
            barrier();
            // each head's reference moves to the chunk's largest score
            if (tid < GROUP) {
                float big = m;
                for (uint j = 0u; j < n_c; ++j)
                    big = max(big, p_sh[tid * CHUNK + j]);
                corr_sh[tid] = m > NEG_INF ? exp(m - big) : 0.0;  // 0: no token yet (acc and l are 0)
                m_sh[tid] = big;
                m = big;
            }
            barrier();
            for (uint x = tid; x < GROUP * CHUNK; x += LOCAL) {
                uint h = x / CHUNK, j = x % CHUNK;
                p_sh[x] = j < n_c ? exp(p_sh[x] - m_sh[h]) : 0.0;
            }
            barrier();
            if (tid < GROUP) {
                float sum = 0.0;
                for (uint j = 0u; j < n_c; ++j)
                    sum += p_sh[tid * CHUNK + j];
                l = l * corr_sh[tid] + sum;
            }
            [[unroll]] for (uint k = 0u; k < MAX_G; ++k) {
                uint h = h0 + k * HEADS_PER_PASS;
                if (h < GROUP)
                    acc[k] *= corr_sh[h];
            }
            for (uint j = 0u; j < n_c; ++j) {
                float v = value_elem(e, c0 + j, g, exact);
                [[unroll]] for (uint k = 0u; k < MAX_G; ++k) {
                    uint h = h0 + k * HEADS_PER_PASS;
                    if (h < GROUP)
                        acc[k] += p_sh[h * CHUNK + j] * v;
                }
            }
            // the next chunk's fold (qk_sh and bias_sh are not read above; the barrier at the
            // loop's top orders it before the next scores)
            if (c1 < t_end && c1 < q_end)
                fold_keys(tid, g, c1);
            c0 = c1;
        }
        // the split's records (an empty split: m = -inf, l = 0, acc = 0)
        uint rec0 = record(i, g, pc.n_kv);  // record (i, g, h) = rec0 + h
        if (tid < GROUP) {
            stats[(rec0 + tid) * 2u] = m;
            stats[(rec0 + tid) * 2u + 1u] = l;
        }
        [[unroll]] for (uint k = 0u; k < MAX_G; ++k) {
            uint h = h0 + k * HEADS_PER_PASS;
            if (h < GROUP)
                acc_floats[(rec0 + h) * HEAD_DIM + e] = acc[k];
        }
        barrier();  // shared memory is reused by the next item
    }
}
