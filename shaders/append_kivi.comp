#version 450
// A recorded decode step's append to a KIVI layer (kvdict_vk.kivi, kvdict_vk.vk.arena.decode):
// one new token of one sequence, K and V, at the position its n_used word names (the query
// block's SEQ_USED word, as append_step reads it). Its float32 rows (the step buffer) go into
// the exact windows' rings as binary16 (rows_encode.glsl: NumPy's bits); when the token
// completes a group's stay in the window (kivi.quantised_end moves by a group) the group is
// quantised here from the binary16 rows the rings hold — kivi._stats_levels' arithmetic,
// correctly rounded (div_rn, f16_bits), so the words are the host's (KiviStore) bit for bit:
// the keys' per-channel statistics and levels, the values' per-token statistics and levels —
// and the layer's state word moves to the new quantised end. One workgroup a KV head (grid
// stride); the new row is in its ring (and visible to the workgroup) before the group is read.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "rows_encode.glsl"
#include "kivi.glsl"

layout(local_size_x = WG_SIZE) in;

layout(constant_id = 0) const uint HEAD_DIM = 64u;  // a multiple of KIVI_GROUP
layout(constant_id = 1) const uint K_BITS = 4u;     // 2 .. 8
layout(constant_id = 2) const uint V_BITS = 4u;
const uint K_ROW = SLOT_LEVEL_WORDS_OF(HEAD_DIM, K_BITS);         // a key: its levels
const uint V_STATS = HEAD_DIM / KIVI_GROUP;                      // a value: its dim groups'
const uint V_ROW = V_STATS + SLOT_LEVEL_WORDS_OF(HEAD_DIM, V_BITS);  // stats words, its levels
const uint HALF_ROW = HEAD_DIM / 2u;                             // a window row's words

layout(std430, binding = 0) readonly buffer Step { uint step_words[]; };
layout(std430, binding = 1) readonly buffer Query { uint query_words[]; };
layout(std430, binding = 2) coherent buffer Layer { uint layer_words[]; };

layout(push_constant) uniform AppendKiviPush {
    uint k_src_word;     // the new token's K rows (n_kv × HEAD_DIM floats), then V's at v_src_word
    uint v_src_word;
    uint k_word;         // the K region (n_ctx level rows per KV head)
    uint v_word;         // the V region
    uint stats_word;     // the keys' group statistics ((h · ceil(n_ctx / 32) + group) · HEAD_DIM + c)
    uint k_window_word;  // the rings of recent + KIVI_GROUP binary16 rows per KV head
    uint v_window_word;
    uint recent;         // kivi.KiviSpec.recent
    uint state_word;     // the layer's quantised end
    uint n_kv;
    uint n_ctx;
    uint lengths_word;   // the query block's n_used word
} pc;

shared float ch_scale[HEAD_DIM];  // the group's per-channel key statistics
shared float ch_lo[HEAD_DIM];

// kivi.quantised_end
uint quantised_end(uint n) { return (n > pc.recent ? n - pc.recent : 0u) / KIVI_GROUP * KIVI_GROUP; }

// The rings' rows a KV head (kivi.KiviSpec.window)
uint ring_rows() { return pc.recent + KIVI_GROUP; }

// Element e of token t's binary16 row in KV head h's ring from `base`, as a float (exact).
float ring_elem(uint base, uint h, uint t, uint e) {
    uint w = layer_words[kivi_window_row(base, h, t, ring_rows(), HEAD_DIM) + e / 2u];
    return unpackHalf2x16(w)[e % 2u];
}

// kivi._stats_levels for one slice of min `lo` and max `hi` (binary16 values): (scale, min)
// as binary16 bits, and the float32 divisor of its levels (the scale, 1 where it is 0).
uint stats_bits(float lo, float hi, uint bits, out float scale, out float divisor) {
    uint lo_bits = f16_bits(lo);
    precise float span = hi - lo;
    uint scale_bits = f16_bits(div_rn(span, float((1u << bits) - 1u)));
    scale = unpackHalf2x16(scale_bits).x;
    divisor = scale > 0.0 ? scale : 1.0;
    return scale_bits | (lo_bits << 16u);
}

// A level: round-to-nearest-even((x − lo) / divisor), clipped to [0, 2^bits − 1].
uint level_of(float x, float lo, float divisor, uint bits) {
    precise float d = x - lo;  // ≥ 0: lo is the slice's minimum
    return uint(clamp(roundEven(div_rn(d, divisor)), 0.0, float((1u << bits) - 1u)));
}

// Bits [32·w, 32·w + 32) of a row's levels (element e at bit e·bits: residual.pack_levels),
// from `first` (the row's element 0) to HEAD_DIM elements, each level by `lv(e)`.
#define LEVEL_WORD(w, bits, lv, out_word) { \
        out_word = 0u; \
        uint e0_ = (32u * (w)) / (bits), e1_ = min((32u * (w) + 31u) / (bits) + 1u, HEAD_DIM); \
        for (uint e_ = e0_; e_ < e1_; ++e_) { \
            int sh_ = int(e_ * (bits)) - int(32u * (w)); \
            uint l_ = lv(e_); \
            out_word |= sh_ >= 0 ? l_ << uint(sh_) : l_ >> uint(-sh_); \
        } \
    }

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint n_used = clamp(query_words[pc.lengths_word], 1u, pc.n_ctx);  // as SEQ_USED clamps it
    uint t = n_used - 1u;
    uint q_old = quantised_end(n_used - 1u), q_new = quantised_end(n_used);
    uint n_groups = (pc.n_ctx + KIVI_GROUP - 1u) / KIVI_GROUP;
    for (uint h = gl_WorkGroupID.x; h < pc.n_kv; h += gl_NumWorkGroups.x) {
        // the new token's rows into the rings (binary16 pairs, element 2k in the low half)
        for (uint x = tid; x < 2u * HALF_ROW; x += WG_SIZE) {
            bool key = x < HALF_ROW;
            uint w = key ? x : x - HALF_ROW;
            uint src = (key ? pc.k_src_word : pc.v_src_word) + h * HEAD_DIM + 2u * w;
            uint lo = f16_bits(uintBitsToFloat(step_words[src])), hi = f16_bits(uintBitsToFloat(step_words[src + 1u]));
            layer_words[kivi_window_row(key ? pc.k_window_word : pc.v_window_word, h, t, ring_rows(), HEAD_DIM) + w] =
                lo | (hi << 16u);
        }
        if (q_new == q_old)
            continue;  // no group leaves the window (the same in every invocation)
        memoryBarrierBuffer();  // the new rows, read below where the group holds them (recent 0)
        barrier();
        uint g0 = q_old;  // the group [g0, g0 + 32) is quantised
        // keys: per channel over the group's tokens — the statistics word, then the levels
        for (uint c = tid; c < HEAD_DIM; c += WG_SIZE) {
            float lo = ring_elem(pc.k_window_word, h, g0, c), hi = lo;
            for (uint i = 1u; i < KIVI_GROUP; ++i) {
                float x = ring_elem(pc.k_window_word, h, g0 + i, c);
                lo = min(lo, x);
                hi = max(hi, x);
            }
            float scale, divisor;
            layer_words[pc.stats_word + (h * n_groups + g0 / KIVI_GROUP) * HEAD_DIM + c] =
                stats_bits(lo, hi, K_BITS, scale, divisor);
            ch_scale[c] = divisor;
            ch_lo[c] = lo;
        }
        barrier();
        for (uint x = tid; x < KIVI_GROUP * K_ROW; x += WG_SIZE) {
            uint i = x / K_ROW, w = x - i * K_ROW;
#define KEY_LEVEL(e) level_of(ring_elem(pc.k_window_word, h, g0 + i, e), ch_lo[e], ch_scale[e], K_BITS)
            uint word;
            LEVEL_WORD(w, K_BITS, KEY_LEVEL, word)
            layer_words[pc.k_word + (h * pc.n_ctx + g0 + i) * K_ROW + w] = word;
        }
        // values: per token and dim group — its statistics word, then its levels (a dim group's
        // 32 levels are V_BITS whole words)
        for (uint x = tid; x < KIVI_GROUP * V_STATS; x += WG_SIZE) {
            uint i = x / V_STATS, d = x - i * V_STATS;
            float lo = ring_elem(pc.v_window_word, h, g0 + i, d * KIVI_GROUP), hi = lo;
            for (uint e = 1u; e < KIVI_GROUP; ++e) {
                float v = ring_elem(pc.v_window_word, h, g0 + i, d * KIVI_GROUP + e);
                lo = min(lo, v);
                hi = max(hi, v);
            }
            float scale, divisor;
            uint row = pc.v_word + (h * pc.n_ctx + g0 + i) * V_ROW;
            layer_words[row + d] = stats_bits(lo, hi, V_BITS, scale, divisor);
            for (uint w = d * V_BITS; w < (d + 1u) * V_BITS; ++w) {
#define VALUE_LEVEL(e) level_of(ring_elem(pc.v_window_word, h, g0 + i, e), lo, divisor, V_BITS)
                uint word;
                LEVEL_WORD(w, V_BITS, VALUE_LEVEL, word)
                layer_words[row + V_STATS + w] = word;
            }
        }
        if (tid == 0u)
            layer_words[pc.state_word] = q_new;  // read by the attention after the step's barrier
        barrier();  // shared statistics are reused by the next KV head
    }
}
