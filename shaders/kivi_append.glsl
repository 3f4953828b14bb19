// A KIVI layer's append of one token for one KV head (kvdict_vk.kivi): its float32 rows go
// into the exact windows' rings as binary16 (rows_encode.glsl: NumPy's bits); when the token
// completes a group's stay in the window (kivi.quantised_end moves by a group) the group is
// quantised from the binary16 rows the rings hold — kivi._stats_levels' arithmetic, correctly
// rounded (div_rn, f16_bits), so the words are the host's (KiviStore) bit for bit: the keys'
// per-channel statistics and levels, the values' per-token statistics and levels — and the
// layer's state word moves to the new quantised end. append_kivi.comp (a recorded step) and
// fwd_qkv.comp (a device forward's projection, by the workgroup whose rows complete the head)
// call it. The includer declares HEAD_DIM, K_BITS and V_BITS (constants), layer_words[]
// (coherent: the group is read back from the rings just written) and
// float kivi_source(bool key, uint h, uint e) — element e of the token's K or V float row of
// KIVI head h — and includes rows_encode.glsl and kivi.glsl first. A group's rows are staged in
// shared memory, one stream at a time, by loads issued together (read element by element from
// the rings, a quantisation waited on ~130 loads in turn: lab/NOTEBOOK.md, "Stop 71"); the
// includer may name the stage — KIVI_STAGE_GET(i) and KIVI_STAGE_SET(i, w), word
// i < KIVI_GROUP · HEAD_DIM / 2 — or get one of its own.

const uint K_ROW = SLOT_LEVEL_WORDS_OF(HEAD_DIM, K_BITS);         // a key: its levels
const uint V_STATS = HEAD_DIM / KIVI_GROUP;                      // a value: its dim groups'
const uint V_ROW = V_STATS + SLOT_LEVEL_WORDS_OF(HEAD_DIM, V_BITS);  // stats words, its levels
const uint HALF_ROW = HEAD_DIM / 2u;                             // a window row's words

// Where a sequence's KIVI words are (kvdict_vk.kivi's layout): the K and V regions (n_ctx
// level rows per KIVI head h — layout.StreamLayout.kivi_head: a KV head's, or in a batched
// arena a KV head's sequence's), the keys' group statistics ((h · ceil(n_ctx / 32) + group) ·
// HEAD_DIM + c), the rings of recent + KIVI_GROUP binary16 rows per KIVI head,
// kivi.KiviSpec.recent, the state word (the sequence's quantised end), rows a KIVI head.
struct KiviLayer {
    uint k_word;
    uint v_word;
    uint stats_word;
    uint k_window_word;
    uint v_window_word;
    uint recent;
    uint state_word;
    uint n_ctx;
};

shared float ch_scale[HEAD_DIM];  // the group's per-channel key statistics
shared float ch_lo[HEAD_DIM];

const uint STAGE_WORDS = KIVI_GROUP * HALF_ROW;  // a stream's group: token i's word w at i · HALF_ROW + w
const uint STAGE_PER = (STAGE_WORDS + WG_SIZE - 1u) / WG_SIZE;  // of them an invocation loads
#ifndef KIVI_STAGE_GET
shared uint kivi_stage[STAGE_WORDS];
#define KIVI_STAGE_GET(i) kivi_stage[i]
#define KIVI_STAGE_SET(i, w) kivi_stage[i] = (w)
#endif
// A level's quotient by float division where no tie of roundEven lies within this of it
// (Vulkan's division is within 2.5 ulp; below 2^8 an ulp is at most 2^-16), else by div_rn
const float TIE_MARGIN = 1.0 / 1024.0;

// kivi.quantised_end
uint quantised_end(uint n, uint recent) { return (n > recent ? n - recent : 0u) / KIVI_GROUP * KIVI_GROUP; }

// The group of rows from token g0 of KIVI head h's ring from `base` (rings of `rows` rows:
// kivi.KiviSpec.window) into the stage (the whole workgroup: ends with a barrier).
void stage_group(uint base, uint h, uint g0, uint rows) {
    uint tid = gl_LocalInvocationID.x;
    uint w[STAGE_PER];
    [[unroll]] for (uint k = 0u; k < STAGE_PER; ++k) {
        uint x = min(tid + k * WG_SIZE, STAGE_WORDS - 1u), i = x / HALF_ROW;
        w[k] = layer_words[kivi_window_row(base, h, g0 + i, rows, HEAD_DIM) + x - i * HALF_ROW];
    }
    [[unroll]] for (uint k = 0u; k < STAGE_PER; ++k)
        if (tid + k * WG_SIZE < STAGE_WORDS)
            KIVI_STAGE_SET(tid + k * WG_SIZE, w[k]);
    barrier();
}

// Element e of the staged group's token i, as a float (exact).
float stage_elem(uint i, uint e) { return unpackHalf2x16(KIVI_STAGE_GET(i * HALF_ROW + e / 2u))[e % 2u]; }

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
    float q = d / divisor;
    if (!(abs(q - floor(q) - 0.5) > TIE_MARGIN))  // near a tie (or not finite): the exact quotient
        q = div_rn(d, divisor);
    return uint(clamp(roundEven(q), 0.0, float((1u << bits) - 1u)));
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


// Token n_used − 1 of KIVI head h into layer `a` (the whole workgroup: barriers; `h` the same in
// every invocation); the new row is in its ring (and visible to the workgroup) before the group
// is read. Returns whether a group was quantised (the stage overwritten; the same in every
// invocation).
bool kivi_append_head(KiviLayer a, uint h, uint n_used) {
    uint tid = gl_LocalInvocationID.x, t = n_used - 1u, rows = a.recent + KIVI_GROUP;
    uint q_old = quantised_end(n_used - 1u, a.recent), q_new = quantised_end(n_used, a.recent);
    // the new token's rows into the rings (binary16 pairs, element 2k in the low half)
    for (uint x = tid; x < 2u * HALF_ROW; x += WG_SIZE) {
        bool key = x < HALF_ROW;
        uint w = key ? x : x - HALF_ROW;
        uint lo = f16_bits(kivi_source(key, h, 2u * w)), hi = f16_bits(kivi_source(key, h, 2u * w + 1u));
        layer_words[kivi_window_row(key ? a.k_window_word : a.v_window_word, h, t, rows, HEAD_DIM) + w] =
            lo | (hi << 16u);
    }
    if (q_new == q_old)
        return false;  // no group leaves the window (the same in every invocation)
    memoryBarrierBuffer();  // the new rows, read below where the group holds them (recent 0)
    barrier();
    uint g0 = q_old;  // the group [g0, g0 + 32) is quantised
    // keys: per channel over the group's tokens — the statistics word, then the levels
    stage_group(a.k_window_word, h, g0, rows);
    for (uint p = tid; p < HALF_ROW; p += WG_SIZE) {  // channels 2p and 2p + 1
        vec2 lo = unpackHalf2x16(KIVI_STAGE_GET(p)), hi = lo;
        for (uint i = 1u; i < KIVI_GROUP; ++i) {
            vec2 x = unpackHalf2x16(KIVI_STAGE_GET(i * HALF_ROW + p));
            lo = min(lo, x);
            hi = max(hi, x);
        }
        [[unroll]] for (uint j = 0u; j < 2u; ++j) {
            float scale, divisor;
            uint c = 2u * p + j;
            layer_words[kivi_stats_row(a.stats_word, h, g0, a.n_ctx, HEAD_DIM) + c] =
                stats_bits(lo[j], hi[j], K_BITS, scale, divisor);
            ch_scale[c] = divisor;
            ch_lo[c] = lo[j];
        }
    }
    barrier();
    for (uint x = tid; x < KIVI_GROUP * K_ROW; x += WG_SIZE) {
        uint i = x / K_ROW, w = x - i * K_ROW;
#define KEY_LEVEL(e) level_of(stage_elem(i, e), ch_lo[e], ch_scale[e], K_BITS)
        uint word;
        LEVEL_WORD(w, K_BITS, KEY_LEVEL, word)
        layer_words[a.k_word + (h * a.n_ctx + g0 + i) * K_ROW + w] = word;
    }
    barrier();  // the keys' stage read before the values' replaces it
    // values: per token and dim group — its statistics word, then its levels (a dim group's
    // 32 levels are V_BITS whole words)
    stage_group(a.v_window_word, h, g0, rows);
    for (uint x = tid; x < KIVI_GROUP * V_STATS; x += WG_SIZE) {
        uint i = x / V_STATS, d = x - i * V_STATS;
        float lo = stage_elem(i, d * KIVI_GROUP), hi = lo;
        for (uint e = 1u; e < KIVI_GROUP; ++e) {
            float v = stage_elem(i, d * KIVI_GROUP + e);
            lo = min(lo, v);
            hi = max(hi, v);
        }
        float scale, divisor;
        uint row = a.v_word + (h * a.n_ctx + g0 + i) * V_ROW;
        layer_words[row + d] = stats_bits(lo, hi, V_BITS, scale, divisor);
        for (uint w = d * V_BITS; w < (d + 1u) * V_BITS; ++w) {
#define VALUE_LEVEL(e) level_of(stage_elem(i, e), lo, divisor, V_BITS)
            uint word;
            LEVEL_WORD(w, V_BITS, VALUE_LEVEL, word)
            layer_words[row + V_STATS + w] = word;
        }
    }
    if (tid == 0u)
        layer_words[a.state_word] = q_new;  // read by the attention after the step's barrier
    barrier();  // shared statistics are reused by the next KV head
    return true;
}
