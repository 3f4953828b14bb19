#version 450
// Decode attention over the uncoded cache (f16, f32 or q8_0 rows), shaped for GPUs: ONE WORKGROUP
// per (split i, KV head g) attends all GROUP query heads of g over the split's tokens, so each
// key and value row is read from memory once (FlashDecoding: the context split across
// workgroups, the running softmax in registers, attend_merge_head.comp combining the splits'
// records in one small pass).
//
// Lanes across a row: a token is served by UNITS neighbouring invocations, one row unit of 8
// elements each (a uvec4 of halves, two of floats, two q8_0 value words), so a row is one coalesced run of
// loads for its key and one for its value; LOCAL / UNITS tokens are in flight per workgroup,
// TB of them per invocation with their loads issued together. Each invocation keeps its unit
// of the GROUP query vectors in registers and dots it with its unit of the key; the UNITS
// partial scores are summed across the token's lanes — by subgroup shuffles (SUBGROUP 1, the
// attend_flash_sg variant, where the device's subgroups support them and hold whole tokens:
// host-checked) or through shared memory (SUBGROUP 0: no optional feature). With shuffles the
// sums are reduce-scattered (SCATTER, below): each lane ends with one head's score, takes that
// head's softmax step and sends its probability to the token's other lanes. Every lane of a
// token then holds the token's probabilities and accumulates p·v over its unit, so the main
// loop needs no barrier with subgroups.
//
// The softmax: each token lane keeps its own reference m (the same in all its invocations),
// moved only when a score exceeds it by more than GROW_MARGIN, so probabilities stay
// ≤ e^GROW_MARGIN and rescaling is rare. At the split's end the lanes' references meet at
// their maximum M (through shared memory), each lane's sums are rescaled by exp(m - M),
// summed over the token lanes in shared memory, and the split's record (M, l, acc —
// attend_common.glsl's layout) is written.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#ifndef SUBGROUP
#define SUBGROUP 0
#endif
#if SUBGROUP
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#endif
// With subgroups, a token's partial scores are reduce-scattered (SCATTER 1): after an exchange
// per halving of the group's heads each lane holds ONE head's whole score and takes that head's
// softmax step alone, then hands its probability to the token's other lanes by GROUP shuffles:
// (GROUP_POW2 - 1) + log2(HEAD_LANES) + GROUP shuffles and one exp a token (8 and 1 at four
// heads and d64) against GROUP × log2(UNITS) and GROUP (12 and 4). Where the group, padded to a
// power of two, outnumbers a token's lanes, every lane sums every head's score by xor shuffles
// and takes every head's step, as SCATTER 0 does everywhere (lab/NOTEBOOK.md, "attend_flash,
// the f16 flash kernel"); a build-time knob for probes.
#ifndef SCATTER
#define SCATTER 1
#endif
// KIVI 1: the attend_flash_kivi builds, over the KIVI cache's words (kvdict_vk.kivi,
// shaders/kivi.glsl): a key unit's levels and its channels' group statistics (loaded once a
// round: an invocation's tokens of a round are consecutive and within one 32-token key group,
// the splits whole groups — host-checked), a value unit's levels and its dim group's stats
// word; tokens at or past the layer's quantised end (its state word, read here: a recorded
// attention stays right as appends quantise more groups) from the exact windows' binary16
// rings, in a loop of their own after the quantised tokens' (so the quantised loop holds a
// few level words a token, not binary16 units: registers bound this build). Decoded to floats
// per unit where they are used — a round's keys for its scores, then its values for p·v
// (kivi_unit_x: no int→float conversion) — with the round's softmax step (ROUND_SOFTMAX) and
// the same end as the other rows.
#ifndef KIVI
#define KIVI 0
#endif
// ROUND_SOFTMAX 1: a round's TB tokens take their softmax step together — every token's scores
// first, one reference move per round (to the round's largest score), the TB probabilities'
// exps and shuffles independent of each other, then p·v — so a lane's tokens of a round need not
// wait on each other's shuffle and exp latencies. 0: token by token (take_token). On an H100 the
// KIVI builds gain with it (and with 8 tokens a lane), the row builds lose (their decoded units
// of a round stay live across it): lab/NOTEBOOK.md, "A round's softmax step together".
#ifndef ROUND_SOFTMAX
#define ROUND_SOFTMAX KIVI
#endif
// KDOT 1: the attend_flash_dot builds, over q8_0 rows (ROW_Q8 1, host-checked) on devices with
// integer dot products (VK_KHR_shader_integer_dot_product): a key unit's int8 levels are dotted
// with the query in integer arithmetic, four products an instruction, with no int→float
// conversion. The query (times the score scale) is quantised per 32-element block in two int8
// parts: with s the block's largest |x| / 127, hi = round(x / s) and lo = round((x / s − hi)·254),
// so x is s·(hi + lo / 254) within s / 508; a unit's 32-bit sum 254·(k·hi) + k·lo is exact and
// becomes a float once a head (query_int8, key_int8_scores). Values as the other row builds.
#ifndef KDOT
#define KDOT 0
#endif
#if KDOT && (KIVI || ROUND_SOFTMAX)
#error "KDOT: q8_0 rows, token by token"
#endif
// KDOT_SAT: a knob for probes — 1: OpSDotAccSatKHR (the accumulate saturating); 0: OpSDotKHR and
// an add. A unit's sums are exact in 32 bits, so saturation never acts; 0 leaves the driver a
// plain 4 × 8-bit dot product with an add (NVIDIA's IDP4A).
#ifndef KDOT_SAT
#define KDOT_SAT 0
#endif
#if KDOT
#extension GL_EXT_spirv_intrinsics : require
// over two words of four signed bytes each (PackedVectorFormat4x8Bit: the literal 0)
#if KDOT_SAT
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4453)
int dot4x8_acc_sat(uint a, uint b, int acc, spirv_literal int packed_format);
#define dot4x8_add(a, b, acc) dot4x8_acc_sat(a, b, acc, 0)
#else
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4450)
int dot4x8(uint a, uint b, spirv_literal int packed_format);
#define dot4x8_add(a, b, acc) (dot4x8(a, b, 0) + (acc))
#endif
#endif
#include "common.glsl"
#include "attend_common.glsl"
#if KIVI
#include "kivi.glsl"
#endif

layout(constant_id = 4) const uint ROW_HALF = 1u;  // 1: f16 rows (two halves a word), 0: f32
// 1: q8_0 rows (ROW_HALF 0): the block scales (f16 pairs), then the int8 values four to a word
layout(constant_id = 5) const uint ROW_Q8 = 0u;
// The split's end moves END_ELEMS elements of every invocation's unit a pass through shared
// memory (the host's attend.flash_end_elems, per build). attend_flash: each head's reference
// and sum of p from the token lanes' unit-0 invocations, then the elements summed over the
// token lanes, 5 + 16 / END_ELEMS barriers (END_ELEMS 2: on an H200 1 was slower, 4 took the
// build past 128 registers at 4 query heads and gained nothing at 3 — docs/DESIGN.md).
// attend_flash_wide (WIDE_END 1): the end in 3 + 2 × (8 / END_ELEMS - 1) barriers (END_ELEMS 8
// or 4). Measured on an H200: the wide end is shorter, but the driver gives its build 151-177
// registers a thread (WIDE_END 0: 115-128), half the workgroups a multiprocessor, and its token
// loop runs up to a third slower at long contexts, so the tuner times both (docs/DESIGN.md).
#ifndef WIDE_END
#define WIDE_END 0
#endif
layout(constant_id = 6) const uint END_ELEMS = 1u;
const uint LOCAL = gl_WorkGroupSize.x;  // specialization constant 2
const uint Q8_SCALE_WORDS = (HEAD_DIM / 32u + 1u) / 2u;
const uint ROW_WORDS = ROW_Q8 > 0u ? Q8_SCALE_WORDS + HEAD_DIM / 4u : (ROW_HALF > 0u ? HEAD_DIM / 2u : HEAD_DIM);
#if KIVI
layout(constant_id = 7) const uint K_BITS = 4u;  // 2 .. 8 (kvdict_vk.kivi.KiviSpec)
layout(constant_id = 8) const uint V_BITS = 4u;
const uint K_ROW = SLOT_LEVEL_WORDS_OF(HEAD_DIM, K_BITS);                       // a key: its levels
const uint V_STATS = HEAD_DIM / KIVI_GROUP;                                     // a value: its dim
const uint V_ROW = V_STATS + SLOT_LEVEL_WORDS_OF(HEAD_DIM, V_BITS);             // groups' stats, levels
#endif
// a row unit: 8 elements — a uvec4 of halves, two of floats, two q8_0 value words (rows of
// whole units: HEAD_DIM % 8 == 0, host-checked)
const uint UNIT_DIMS = 8u;
const uint UNITS = HEAD_DIM / UNIT_DIMS;  // invocations per token; LOCAL % UNITS == 0 (host)
const uint TLANES = LOCAL / UNITS;        // tokens in flight per workgroup
// Tokens per invocation whose rows are loaded together, and whether the next round's rows
// are loaded while this round computes (else after it): 2 tokens with prefetch won for f16 and
// q8_0 rows, f32 rows — twice the registers a unit — won without (lab/NOTEBOOK.md,
// "attend_flash, the f16 flash kernel"). Build-time knobs for such probes.
#ifndef TOKENS_PER_LANE
#define TOKENS_PER_LANE (KIVI > 0 ? 8u : 2u)
#endif
#ifndef PREFETCH
#define PREFETCH (ROW_Q8 > 0u || ROW_HALF > 0u)
#endif
const uint TB = TOKENS_PER_LANE;
// Split token of an invocation's b-th token of the round from `first`: KIVI, TB consecutive
// tokens (one key group: TB divides 32); else TLANES apart (each load a coalesced run).
#if KIVI
#define TOKEN_OF(first, b) ((first) + tlane * TB + (b))
#else
#define TOKEN_OF(first, b) ((first) + tlane + (b) * TLANES)
#endif
const uint MAX_G = 8u;  // registers per query head are unrolled up to this; GROUP <= MAX_G (host)
// SCATTER: the group padded to a power of two (its padding heads' scores are 0, never used), and
// the lanes of a token that end with one head's score (HEAD_LANES neighbours a head)
const uint GROUP_POW2 = GROUP <= 1u ? 1u : (GROUP <= 2u ? 2u : (GROUP <= 4u ? 4u : 8u));
const bool SCATTERED = SUBGROUP > 0 && SCATTER > 0 && GROUP_POW2 <= UNITS;
const uint HEAD_LANES = GROUP_POW2 <= UNITS ? UNITS / GROUP_POW2 : 1u;
const float GROW_MARGIN = 8.0;

layout(std430, binding = 0) readonly buffer CacheWords { uint cache_words[]; };
layout(std430, binding = 1) readonly buffer CacheQuads { uvec4 cache_quads[]; };
layout(std430, binding = 2) readonly buffer Query { float q_floats[]; };
layout(std430, binding = 3) writeonly buffer Accs { float acc_floats[]; };
layout(std430, binding = 4) writeonly buffer Stats { float stats[]; };

layout(push_constant) uniform AttendFlashPush {
    uint k_word;    // the layer's K region (multiple of 4), n_ctx rows per KV head
    uint v_word;
    uint n_ctx;
    uint n_used;    // the most tokens any sequence attends over (its own: SEQ_USED)
    uint split_len; // tokens per split
    uint n_splits;  // splits per KV head and sequence
    uint n_kv;
    uint n_seqs;    // sequences (attend_common.glsl: batched decode)
    uint seq_rows;  // rows between two sequences' first tokens in a KV head
    // the KIVI builds': the keys' group statistics ((kh * ceil(seq_rows / 32) + group) *
    // HEAD_DIM + c, kh the KIVI head g * (n_ctx / seq_rows) + sequence), the exact windows
    // (rings of `window` binary16 rows per KIVI head), the sequences' quantised ends (a
    // sequence's tokens below its own are quantised)
    uint stats_word;
    uint k_window_word;
    uint v_window_word;
    uint window;
    uint state_word;
    uint split_round;  // split_len 0: the splits' rounding (SPLIT_LEN)
    uint q_word;       // the query block's first word (SEQ_USED)
    float score_scale;
} pc;

#if WIDE_END
// The split's end: element e of every invocation's unit of every query head h at
// red_sh[e*END_STRIDE + h*LOCAL + tid], a pass of END_ELEMS elements at a time. The stride's
// padding puts the elements a warp sums (UNITS lanes an element) in different banks.
const uint END_STRIDE = GROUP * LOCAL + UNITS % 32u;
// partial scores (SUBGROUP 0: red_sh[h*LOCAL + tid]); the end's unit elements
shared float red_sh[END_ELEMS * END_STRIDE];
// the end: each token lane's reference and sum of p, its factor exp(m - M)
shared float lane_m_sh[GROUP * TLANES];
shared float lane_l_sh[GROUP * TLANES];
shared float lane_f_sh[GROUP * TLANES];
#else
// partial scores (SUBGROUP 0); the end's reductions, and a pass's END_ELEMS elements at
// red_sh[(e * GROUP + h) * LOCAL + tid]
shared float red_sh[END_ELEMS * GROUP * LOCAL];
#endif
shared float split_m_sh[GROUP];  // the split's reference M per query head

// Element e of this invocation's unit of query head h's sum of p·v (h and e constants after
// unrolling: the vectors are indexed by constants only).
#define UNIT_ELEM(h, e) ((e) < 4u ? acc_lo[h][(e) % 4u] : acc_hi[h][(e) % 4u])

#if WIDE_END
// Elements e0 .. e0 + END_ELEMS - 1 of this invocation's unit of each head's sum of p·v into
// red_sh.
#define END_WRITE(e0) \
    [[unroll]] for (uint h = 0u; h < MAX_G; ++h) \
        if (h < GROUP) \
            [[unroll]] for (uint e = 0u; e < END_ELEMS; ++e) \
                red_sh[e * END_STRIDE + h * LOCAL + tid] = UNIT_ELEM(h, (e0) + e);
#else
// The maximum (take_max) or the sum over a workgroup's token lanes of a value per (query head,
// token lane) that is the same in the lane's UNITS invocations: its unit-0 invocation writes
// it, one invocation a head reduces TLANES values (not a tree over LOCAL). Head h's result is
// returned in invocation h; red_sh is free again after the caller's next barrier.
float token_lanes_reduce(float v[MAX_G], uint tid, uint unit, uint tlane, bool take_max) {
    barrier();  // red_sh's last readers are done
    if (unit == 0u)
        [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
            if (h < GROUP)
                red_sh[h * TLANES + tlane] = v[h];
    barrier();
    float r = take_max ? NEG_INF : 0.0;
    if (tid < GROUP)
        for (uint ln = 0u; ln < TLANES; ++ln)
            r = take_max ? max(r, red_sh[tid * TLANES + ln]) : r + red_sh[tid * TLANES + ln];
    return r;
}
#endif

// A row unit's words: f16 a (8 halves); f32 a, b (4 floats each); q8_0 a.x, a.y (the value
// words) and a.z (the pair of block scales holding its block's).
void load_unit(uint base, uint unit, out uvec4 a, out uvec4 b) {  // base: the row's first word
    b = uvec4(0u);
    if (ROW_Q8 > 0u) {
        uint w = base + Q8_SCALE_WORDS + 2u * unit;
        a = uvec4(cache_words[w], cache_words[w + 1u], cache_words[base + unit / 8u], 0u);
    } else if (ROW_HALF > 0u) {
        a = cache_quads[(base >> 2u) + unit];
    } else {
        a = cache_quads[(base >> 2u) + 2u * unit];
        b = cache_quads[(base >> 2u) + 2u * unit + 1u];
    }
}

// A unit of 8 halves as two vec4s.
void half_unit(uvec4 a, out vec4 lo, out vec4 hi) {
    lo = vec4(unpackHalf2x16(a.x), unpackHalf2x16(a.y));
    hi = vec4(unpackHalf2x16(a.z), unpackHalf2x16(a.w));
}

// The unit's 8 elements as two vec4s, and the factor they stand for: q8_0's block scale d (the
// values are its int8 levels: the scale multiplies a head's partial score and its probability,
// once a token, not each element), 1 otherwise.
float unit_values(uvec4 a, uvec4 b, uint unit, out vec4 lo, out vec4 hi) {
    if (ROW_Q8 > 0u) {
        lo = int8x4(a.x);
        hi = int8x4(a.y);
        return unpackHalf2x16(a.z)[(unit / 4u) % 2u];  // 4 units a block of 32
    } else if (ROW_HALF > 0u) {
        half_unit(a, lo, hi);
    } else {
        lo = uintBitsToFloat(a);
        hi = uintBitsToFloat(b);
    }
    return 1.0;
}

#if KIVI
// The level words of the unit of a quantised token, row `row` of the regions: K's into kq
// (kivi_unit_words of them, clamped to the row), V's dim group's stats word then its level
// words into vq.
void kivi_load(uint row, uint unit, out uvec3 kq, out uvec4 vq) {
    uint kw = pc.k_word + row * K_ROW, k0 = kivi_unit_word(unit, K_BITS);
    uint vw = pc.v_word + row * V_ROW, v0 = kivi_unit_word(unit, V_BITS);
    kq = uvec3(cache_words[kw + k0], 0u, 0u);
    if (kivi_unit_words(K_BITS) > 1u)
        kq.y = cache_words[kw + min(k0 + 1u, K_ROW - 1u)];
    if (kivi_unit_words(K_BITS) > 2u)
        kq.z = cache_words[kw + min(k0 + 2u, K_ROW - 1u)];
    vq = uvec4(cache_words[vw + unit * KIVI_UNIT / KIVI_GROUP], cache_words[vw + V_STATS + v0], 0u, 0u);
    if (kivi_unit_words(V_BITS) > 1u)
        vq.z = cache_words[vw + V_STATS + min(v0 + 1u, V_ROW - V_STATS - 1u)];
    if (kivi_unit_words(V_BITS) > 2u)
        vq.w = cache_words[vw + V_STATS + min(v0 + 2u, V_ROW - V_STATS - 1u)];
}

// The quantised round from split token `first`: this invocation's TB tokens (past q_rel: the
// last quantised one, unused), all in one key group, and that group's statistics for the
// unit's 8 channels (sa, sb).
#define LOAD_QUANT_ROUND(first) { \
        uint tq = t0 + min(TOKEN_OF(first, 0u), q_rel - 1u); \
        uint sq = kivi_stats_row(pc.stats_word, kh, tq, pc.seq_rows, HEAD_DIM) / 4u + 2u * unit; \
        sa = cache_quads[sq]; \
        sb = cache_quads[sq + 1u]; \
        [[unroll]] for (uint b = 0u; b < TB; ++b) \
            kivi_load(row0 + t0 + min(TOKEN_OF(first, b), q_rel - 1u), unit, kq[b], vq[b]); \
    }
#else
// The units of this invocation's TB tokens of the round starting at split token `first`
// (past the split's end: its last token, unused) into ka/kb (K) and va/vb (V).
#define LOAD_ROUND(first) \
    [[unroll]] for (uint b = 0u; b < TB; ++b) { \
        uint t = min(TOKEN_OF(first, b), n_tok - 1u); \
        load_unit(k_base + t * ROW_WORDS, unit, ka[b], kb[b]); \
        load_unit(v_base + t * ROW_WORDS, unit, va[b], vb[b]); \
    }
#endif

// An invocation's state over one item (a split of a KV head), private: its place among the
// workgroup's lanes, its unit of each query head (times the score scale), its token lane's
// reference and sum of p per head (SCATTERED: those of its own head, m_own and l_own, handed to
// m and l after the token loop) and its unit of each head's sum of p·v.
uint tid, unit, tlane;
#if SUBGROUP
uint lane0;  // the token's first lane in the subgroup
#endif
#if KDOT
uvec2 qi_hi[MAX_G], qi_lo[MAX_G];  // (KDOT) the unit's query elements as two int8 parts
float qi_step[MAX_G];              // and their block's s / 254
#else
vec4 q_lo[MAX_G], q_hi[MAX_G];
#endif
float m[MAX_G], l[MAX_G];
float m_own, l_own;
vec4 acc_lo[MAX_G], acc_hi[MAX_G];

#if KDOT
// Query head h's unit of 8 elements from word f, in the block of 32 from word f_block, times the
// score scale, into qi_hi[h], qi_lo[h] and qi_step[h] (see KDOT). A block holding a NaN or an
// infinity gets step NaN: the head's scores are NaN, as the float builds' would be.
void query_int8(uint h, uint f_block, uint f) {
    float big = 0.0;
    bool finite = true;
    for (uint j = 0u; j < 32u; ++j) {
        float x = q_floats[f_block + j] * pc.score_scale;
        finite = finite && (floatBitsToUint(x) & 0x7F800000u) != 0x7F800000u;
        big = max(big, abs(x));
    }
    float s = big > 0.0 ? big / 127.0 : 1.0;
    uint hi[2] = uint[2](0u, 0u), lo[2] = uint[2](0u, 0u);
    [[unroll]] for (uint j = 0u; j < 8u; ++j) {
        float x = finite ? q_floats[f + j] * pc.score_scale / s : 0.0;
        float xh = clamp(round(x), -127.0, 127.0);
        float xl = clamp(round((x - xh) * 254.0), -127.0, 127.0);
        hi[j / 4u] |= (uint(int(xh)) & 0xFFu) << (8u * (j % 4u));
        lo[j / 4u] |= (uint(int(xl)) & 0xFFu) << (8u * (j % 4u));
    }
    qi_hi[h] = uvec2(hi[0], hi[1]);
    qi_lo[h] = uvec2(lo[0], lo[1]);
    qi_step[h] = finite ? s / 254.0 : uintBitsToFloat(0x7FC00000u);
}

// A q8_0 key unit's partial scores (a: load_unit's words): its int8 levels dotted with each
// head's two query parts, times the query block's step and the key block's scale.
void key_int8_scores(uvec4 a, uint unit, out float s[MAX_G]) {
    float d = unpackHalf2x16(a.z)[(unit / 4u) % 2u];
    [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
        int t = dot4x8_add(a.y, qi_hi[h].y, dot4x8_add(a.x, qi_hi[h].x, 0)) * 254;
        t = dot4x8_add(a.y, qi_lo[h].y, dot4x8_add(a.x, qi_lo[h].x, t));
        s[h] = float(t) * (qi_step[h] * d);
    }
}
#else
// A decoded key unit's partial scores (k_scale · k: unit_values' factor).
void key_scores(vec4 k_lo, vec4 k_hi, float k_scale, out float s[MAX_G]) {
    [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
        s[h] = (dot(k_lo, q_lo[h]) + dot(k_hi, q_hi[h])) * k_scale;
}
#endif

// One token of the invocation's token lane (``live``: within the split; every lane of the
// subgroup calls it, live or not — its shuffles and barriers need them all): its unit's partial
// scores s (key_scores, key_int8_scores) summed over the token's lanes, the softmax step, p·v
// over its unit of the value decoded (v_scale · v: unit_values' factor).
void take_token(float s[MAX_G], vec4 v_lo, vec4 v_hi, float v_scale, bool live) {
    // the token's scores: its lanes' partial scores summed (the same in each lane)
#if SUBGROUP
    if (SCATTERED) {
        // recursive halving: at each exchange a lane keeps half of its heads (the
        // upper half where its unit has the mask's bit) and adds its partner's sums of
        // them; `width` heads are left after it
        [[unroll]] for (uint width = MAX_G / 2u; width >= 1u; width >>= 1u) {
            if (width < GROUP_POW2) {
                uint mask = HEAD_LANES * width;
                bool upper = (unit & mask) != 0u;
                [[unroll]] for (uint x = 0u; x < MAX_G / 2u; ++x) {
                    if (x < width) {
                        float send = upper ? s[x] : s[x + width];
                        float keep = upper ? s[x + width] : s[x];
                        s[x] = keep + subgroupShuffleXor(send, mask);
                    }
                }
            }
        }
        for (uint w = HEAD_LANES / 2u; w > 0u; w >>= 1u)
            s[0] += subgroupShuffleXor(s[0], w);
        // s[0]: the token's score for head unit / HEAD_LANES. Its softmax step here
        // with one exp and no branch: the reference moves (as below) when the score
        // passes it by GROW_MARGIN, and then the exp is the factor exp(m_old - m)
        // (0 on the lane's first token), sent with its sign bit set (the token's
        // probability is e^0 = 1); else it is the probability. Lanes past the
        // split's end send 0 and keep their state. The shuffles sit outside any
        // branch: every lane of the subgroup takes part.
        bool moved = live && s[0] > m_own + GROW_MARGIN;
        float e = exp(moved ? m_own - s[0] : s[0] - m_own);
        m_own = moved ? s[0] : m_own;
        l_own = live ? (moved ? l_own * e + 1.0 : l_own + e) : l_own;
        uint sent = live ? (floatBitsToUint(e) | (moved ? 0x80000000u : 0u)) : 0u;
        uint got[MAX_G];
        uint signs = 0u;
        [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
            got[h] = 0u;
            if (h < GROUP) {
                got[h] = subgroupShuffle(sent, lane0 + h * HEAD_LANES);
                signs |= got[h];
            }
        }
        if (live) {
            [[dont_flatten]] if (signs >= 0x80000000u) {  // rare: a head's reference moved
                [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
                    if (h < GROUP && got[h] >= 0x80000000u) {
                        float corr = uintBitsToFloat(got[h] & 0x7fffffffu);
                        acc_lo[h] *= corr;
                        acc_hi[h] *= corr;
                        got[h] = floatBitsToUint(1.0);
                    }
                }
            }
            [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
                if (h < GROUP) {
                    float p = uintBitsToFloat(got[h]) * v_scale;
                    acc_lo[h] += p * v_lo;
                    acc_hi[h] += p * v_hi;
                }
            }
        }
    } else {
        [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
            if (h < GROUP)
                for (uint w = 1u; w < UNITS; w <<= 1u)
                    s[h] += subgroupShuffleXor(s[h], w);
    }
#else
    barrier();  // the last token's partials are read
    [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
        if (h < GROUP)
            red_sh[h * LOCAL + tid] = s[h];
    barrier();
    [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
        if (h < GROUP) {
            float a = 0.0;
            for (uint u = 0u; u < UNITS; ++u)
                a += red_sh[h * LOCAL + tlane * UNITS + u];
            s[h] = a;
        }
    }
#endif
    if (!SCATTERED && live) {
        [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
            if (h < GROUP) {
                if (s[h] > m[h] + GROW_MARGIN) {  // the reference moves up to the score
                    float corr = exp(m[h] - s[h]);  // 0 on the lane's first token
                    m[h] = s[h];
                    l[h] *= corr;
                    acc_lo[h] *= corr;
                    acc_hi[h] *= corr;
                }
                float p = exp(s[h] - m[h]);
                l[h] += p;
                acc_lo[h] += (p * v_scale) * v_lo;
                acc_hi[h] += (p * v_scale) * v_hi;
            }
        }
    }
}

#if ROUND_SOFTMAX
// The round's scores per token and query head (partials, then the token's sums; SCATTERED: a
// lane's own head's in rs[b][0]) and probabilities as every lane of the token sees them.
float rs[TB][MAX_G];
float rp[TB][MAX_G];

// Token b of the round: its unit of the key decoded (k_scale · k), the partial scores.
void round_score(uint b, vec4 k_lo, vec4 k_hi, float k_scale) {
    key_scores(k_lo, k_hi, k_scale, rs[b]);
}

// The round's softmax step (``live[b]``: token b is within the split; every lane of the subgroup
// calls it): the scores summed over the token's lanes, the reference moved once to the round's
// largest score where it passes the reference by GROW_MARGIN (the sums so far rescaled), the
// probabilities into rp.
void round_softmax(bool live[TB]) {
#if SUBGROUP
    if (SCATTERED) {
        // each token's sums reduce-scattered as take_token does: rs[b][0] is the token's score
        // for head unit / HEAD_LANES
        [[unroll]] for (uint b = 0u; b < TB; ++b) {
            [[unroll]] for (uint width = MAX_G / 2u; width >= 1u; width >>= 1u) {
                if (width < GROUP_POW2) {
                    uint mask = HEAD_LANES * width;
                    bool upper = (unit & mask) != 0u;
                    [[unroll]] for (uint x = 0u; x < MAX_G / 2u; ++x) {
                        if (x < width) {
                            float send = upper ? rs[b][x] : rs[b][x + width];
                            float keep = upper ? rs[b][x + width] : rs[b][x];
                            rs[b][x] = keep + subgroupShuffleXor(send, mask);
                        }
                    }
                }
            }
            for (uint w = HEAD_LANES / 2u; w > 0u; w >>= 1u)
                rs[b][0] += subgroupShuffleXor(rs[b][0], w);
        }
        float top = NEG_INF;
        [[unroll]] for (uint b = 0u; b < TB; ++b)
            top = live[b] ? max(top, rs[b][0]) : top;
        bool moved = top > m_own + GROW_MARGIN;
        float corr = exp(moved ? m_own - top : 0.0);  // 0 on the lane's first round
        m_own = moved ? top : m_own;
        float e[TB];
        float sum = 0.0;
        [[unroll]] for (uint b = 0u; b < TB; ++b) {
            e[b] = live[b] ? exp(rs[b][0] - m_own) : 0.0;
            sum += e[b];
        }
        l_own = l_own * corr + sum;
        // every head's factor and probabilities from the lanes that took its step; the
        // shuffles outside any branch
        float got_corr[MAX_G];
        bool any_moved = false;
        [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
            got_corr[h] = 1.0;
            if (h < GROUP) {
                got_corr[h] = subgroupShuffle(corr, lane0 + h * HEAD_LANES);
                any_moved = any_moved || got_corr[h] != 1.0;
                [[unroll]] for (uint b = 0u; b < TB; ++b)
                    rp[b][h] = subgroupShuffle(e[b], lane0 + h * HEAD_LANES);
            }
        }
        [[dont_flatten]] if (any_moved) {  // rare: a head's reference moved
            [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
                if (h < GROUP) {
                    acc_lo[h] *= got_corr[h];
                    acc_hi[h] *= got_corr[h];
                }
            }
        }
        return;
    }
    [[unroll]] for (uint b = 0u; b < TB; ++b)
        [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
            if (h < GROUP)
                for (uint w = 1u; w < UNITS; w <<= 1u)
                    rs[b][h] += subgroupShuffleXor(rs[b][h], w);
#else
    [[unroll]] for (uint b = 0u; b < TB; ++b) {
        barrier();  // the last token's partials are read
        [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
            if (h < GROUP)
                red_sh[h * LOCAL + tid] = rs[b][h];
        barrier();
        [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
            if (h < GROUP) {
                float a = 0.0;
                for (uint u = 0u; u < UNITS; ++u)
                    a += red_sh[h * LOCAL + tlane * UNITS + u];
                rs[b][h] = a;
            }
        }
    }
#endif
    [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
        if (h < GROUP) {
            float top = NEG_INF;
            [[unroll]] for (uint b = 0u; b < TB; ++b)
                top = live[b] ? max(top, rs[b][h]) : top;
            if (top > m[h] + GROW_MARGIN) {  // the reference moves up to the round's largest score
                float corr = exp(m[h] - top);  // 0 on the lane's first round
                m[h] = top;
                l[h] *= corr;
                acc_lo[h] *= corr;
                acc_hi[h] *= corr;
            }
            [[unroll]] for (uint b = 0u; b < TB; ++b) {
                rp[b][h] = live[b] ? exp(rs[b][h] - m[h]) : 0.0;
                l[h] += rp[b][h];
            }
        }
    }
}

// Token b of the round (live: within the split): its unit of the value decoded (v_scale · v)
// added into each head's sum of p·v.
void round_value(uint b, vec4 v_lo, vec4 v_hi, float v_scale, bool live) {
    if (live)
        [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
            if (h < GROUP) {
                float p = rp[b][h] * v_scale;
                acc_lo[h] += p * v_lo;
                acc_hi[h] += p * v_hi;
            }
}
#endif

void main() {
    // lane_index(): with subgroups the UNITS invocations of a token are neighbours in one
    // subgroup (the host makes LOCAL a multiple of the subgroup size and UNITS a power of two
    // dividing it)
    tid = lane_index();
    unit = tid % UNITS;
    tlane = tid / UNITS;
#if SUBGROUP
    lane0 = gl_SubgroupInvocationID - unit;
#endif
    uint items = pc.n_kv * pc.n_splits * pc.n_seqs;
    for (uint item = gl_WorkGroupID.x; item < items; item += gl_NumWorkGroups.x) {
        uint g = item % pc.n_kv;
        uint i = (item / pc.n_kv) % pc.n_splits;
        uint seq = item / (pc.n_kv * pc.n_splits);
        uint vh = seq * pc.n_kv + g;  // the virtual head: queries, records
        uint n_used = SEQ_USED(q_floats, seq);
        uint split_len = SPLIT_LEN(n_used);
        uint t0 = i * split_len;
        uint n_tok = t0 < n_used ? min(t0 + split_len, n_used) - t0 : 0u;  // 0: an empty split

        m_own = NEG_INF;
        l_own = 0.0;
        [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
            uint f = pc.q_word + (vh * GROUP + h) * HEAD_DIM + unit * UNIT_DIMS;
#if KDOT
            qi_hi[h] = uvec2(0u);
            qi_lo[h] = uvec2(0u);
            qi_step[h] = 0.0;
            if (h < GROUP)
                query_int8(h, f - (unit % 4u) * UNIT_DIMS, f);  // 4 units a block of 32
#else
            q_lo[h] = vec4(0.0);
            q_hi[h] = vec4(0.0);
            if (h < GROUP) {
                q_lo[h] = vec4(q_floats[f], q_floats[f + 1u], q_floats[f + 2u], q_floats[f + 3u]) * pc.score_scale;
                q_hi[h] = vec4(q_floats[f + 4u], q_floats[f + 5u], q_floats[f + 6u], q_floats[f + 7u]) * pc.score_scale;
            }
#endif
            m[h] = NEG_INF;
            l[h] = 0.0;
            acc_lo[h] = vec4(0.0);
            acc_hi[h] = vec4(0.0);
        }

#if KIVI
        // The split's quantised tokens [0, q_rel) (below the sequence's quantised end), then
        // its exact ones [q_rel, n_tok) from the windows: two loops, so the quantised one keeps
        // only its few level words a token (the exact one, short, loads binary16 units). The
        // sequence's statistics and rings are its KIVI head's (kh: layout.StreamLayout.kivi_head).
        const uint q_end = cache_words[pc.state_word + seq];
        const uint kh = kivi_head(g, seq, pc.n_ctx / pc.seq_rows), row0 = g * pc.n_ctx + seq * pc.seq_rows;
        // More than one split, and the quantised tokens [0, q_end) fit the others in runs no
        // longer than split_len: the last split takes the exact tokens [q_end, n_used) — a
        // window at most — and the others the quantised ones in equal runs of whole rounds
        // (split_round: whole key groups). A split that held the window beside quantised tokens
        // ran both loops, a round of them twice (lab/NOTEBOOK.md, "Stop 71").
        if (pc.n_splits > 1u) {
            uint n_q = min(q_end, n_used), q_splits = pc.n_splits - 1u;
            uint q_len = ROUNDED_SPLIT(n_q, q_splits);
            if (q_len <= split_len) {  // the same in every workgroup of the sequence
                bool window = i == q_splits;
                t0 = window ? n_q : i * q_len;
                n_tok = window ? n_used - n_q : (t0 < n_q ? min(t0 + q_len, n_q) - t0 : 0u);
            }
        }
        const uint q_rel = q_end > t0 ? min(q_end - t0, n_tok) : 0u;
        // TB tokens' level words (K: kivi_unit_words(K_BITS); V: its dim group's stats word, then
        // its level words) and their key group's stats for the unit's 8 channels (sa, sb), loaded
        // together; the next round's in flight while this round computes
        uvec3 kq[TB];
        uvec4 vq[TB];
        uvec4 sa, sb;
        if (q_rel > 0u)
            LOAD_QUANT_ROUND(0u);
        for (uint r0 = 0u; r0 < q_rel; r0 += TLANES * TB) {
            uvec3 kc[TB] = kq;
            uvec4 vc[TB] = vq;
            // the key group's (S, B) per channel of the unit (kivi.glsl: value = x·S + B)
            uint sw[8] = uint[8](sa.x, sa.y, sa.z, sa.w, sb.x, sb.y, sb.z, sb.w);
            vec2 f[8];
            [[unroll]] for (uint c = 0u; c < 8u; ++c)
                f[c] = kivi_fold(sw[c], K_BITS);
            vec4 ks_lo = vec4(f[0].x, f[1].x, f[2].x, f[3].x), ks_hi = vec4(f[4].x, f[5].x, f[6].x, f[7].x);
            vec4 kb_lo = vec4(f[0].y, f[1].y, f[2].y, f[3].y), kb_hi = vec4(f[4].y, f[5].y, f[6].y, f[7].y);
            uint next = r0 + TLANES * TB;
            if (next < q_rel)
                LOAD_QUANT_ROUND(next);
#if ROUND_SOFTMAX
            bool live[TB];
            [[unroll]] for (uint b = 0u; b < TB; ++b) {
                live[b] = TOKEN_OF(r0, b) < q_rel;
                vec4 k_lo, k_hi;
                kivi_unit_x(kc[b], kivi_unit_bit(unit, K_BITS), K_BITS, k_lo, k_hi);
                round_score(b, k_lo * ks_lo + kb_lo, k_hi * ks_hi + kb_hi, 1.0);
            }
            round_softmax(live);
            [[unroll]] for (uint b = 0u; b < TB; ++b) {
                vec4 v_lo, v_hi;
                vec2 sv = kivi_fold(vc[b].x, V_BITS);
                kivi_unit_x(vc[b].yzw, kivi_unit_bit(unit, V_BITS), V_BITS, v_lo, v_hi);
                round_value(b, v_lo * sv.x + sv.y, v_hi * sv.x + sv.y, 1.0, live[b]);
            }
#else
            [[unroll]] for (uint b = 0u; b < TB; ++b) {
                vec4 k_lo, k_hi, v_lo, v_hi;
                kivi_unit_x(kc[b], kivi_unit_bit(unit, K_BITS), K_BITS, k_lo, k_hi);
                vec2 sv = kivi_fold(vc[b].x, V_BITS);
                kivi_unit_x(vc[b].yzw, kivi_unit_bit(unit, V_BITS), V_BITS, v_lo, v_hi);
                float s[MAX_G];
                key_scores(k_lo * ks_lo + kb_lo, k_hi * ks_hi + kb_hi, 1.0, s);
                take_token(s, v_lo * sv.x + sv.y, v_hi * sv.x + sv.y, 1.0, TOKEN_OF(r0, b) < q_rel);
            }
#endif
        }
        // (from the round holding q_rel; none where every token is quantised)
        for (uint r0 = q_rel < n_tok ? q_rel - q_rel % (TLANES * TB) : n_tok; r0 < n_tok; r0 += TLANES * TB) {
#if ROUND_SOFTMAX
            bool live[TB];
            [[unroll]] for (uint b = 0u; b < TB; ++b) {
                uint t = TOKEN_OF(r0, b);
                live[b] = t >= q_rel && t < n_tok;
                uint tw = t0 + min(t, n_tok - 1u);  // any token's ring row is in the buffer
                vec4 k_lo, k_hi;
                half_unit(cache_quads[(kivi_window_row(pc.k_window_word, kh, tw, pc.window, HEAD_DIM) >> 2u) + unit],
                          k_lo, k_hi);
                round_score(b, k_lo, k_hi, 1.0);
            }
            round_softmax(live);
            [[unroll]] for (uint b = 0u; b < TB; ++b) {
                uint tw = t0 + min(TOKEN_OF(r0, b), n_tok - 1u);
                vec4 v_lo, v_hi;
                half_unit(cache_quads[(kivi_window_row(pc.v_window_word, kh, tw, pc.window, HEAD_DIM) >> 2u) + unit],
                          v_lo, v_hi);
                round_value(b, v_lo, v_hi, 1.0, live[b]);
            }
#else
            [[unroll]] for (uint b = 0u; b < TB; ++b) {
                uint t = TOKEN_OF(r0, b);
                uint tw = t0 + min(t, n_tok - 1u);  // any token's ring row is in the buffer
                vec4 k_lo, k_hi, v_lo, v_hi;
                half_unit(cache_quads[(kivi_window_row(pc.k_window_word, kh, tw, pc.window, HEAD_DIM) >> 2u) + unit],
                          k_lo, k_hi);
                half_unit(cache_quads[(kivi_window_row(pc.v_window_word, kh, tw, pc.window, HEAD_DIM) >> 2u) + unit],
                          v_lo, v_hi);
                float s[MAX_G];
                key_scores(k_lo, k_hi, 1.0, s);
                take_token(s, v_lo, v_hi, 1.0, t >= q_rel && t < n_tok);
            }
#endif
        }
#else
        uint k_base = pc.k_word + (g * pc.n_ctx + seq * pc.seq_rows + t0) * ROW_WORDS;
        uint v_base = pc.v_word + (g * pc.n_ctx + seq * pc.seq_rows + t0) * ROW_WORDS;
        // TB tokens' units, loaded together; with PREFETCH the next round's are in flight
        // while this round computes (else loaded after it)
        uvec4 ka[TB], kb[TB], va[TB], vb[TB];
        if (n_tok > 0u)
            LOAD_ROUND(0u);
        for (uint r0 = 0u; r0 < n_tok; r0 += TLANES * TB) {  // the same trip count in every invocation
            vec4 k_lo[TB], k_hi[TB], v_lo[TB], v_hi[TB];
            float k_scale[TB], v_scale[TB];
#if KDOT
            uvec4 k_words[TB] = ka;  // dotted as they are (key_int8_scores)
#endif
            [[unroll]] for (uint b = 0u; b < TB; ++b) {
#if !KDOT
                k_scale[b] = unit_values(ka[b], kb[b], unit, k_lo[b], k_hi[b]);
#endif
                v_scale[b] = unit_values(va[b], vb[b], unit, v_lo[b], v_hi[b]);
            }
            uint next = r0 + TLANES * TB;
            if (PREFETCH && next < n_tok)
                LOAD_ROUND(next);
#if KDOT
            [[unroll]] for (uint b = 0u; b < TB; ++b) {
                float s[MAX_G];
                key_int8_scores(k_words[b], unit, s);
                take_token(s, v_lo[b], v_hi[b], v_scale[b], TOKEN_OF(r0, b) < n_tok);
            }
#elif ROUND_SOFTMAX
            bool live[TB];
            [[unroll]] for (uint b = 0u; b < TB; ++b) {
                live[b] = TOKEN_OF(r0, b) < n_tok;
                round_score(b, k_lo[b], k_hi[b], k_scale[b]);
            }
            round_softmax(live);
            [[unroll]] for (uint b = 0u; b < TB; ++b)
                round_value(b, v_lo[b], v_hi[b], v_scale[b], live[b]);
#else
            [[unroll]] for (uint b = 0u; b < TB; ++b) {
                float s[MAX_G];
                key_scores(k_lo[b], k_hi[b], k_scale[b], s);
                take_token(s, v_lo[b], v_hi[b], v_scale[b], TOKEN_OF(r0, b) < n_tok);
            }
#endif
            if (!(PREFETCH) && next < n_tok)
                LOAD_ROUND(next);
        }
#endif
#if SUBGROUP
        if (SCATTERED)  // every head's reference and sum from the lanes that kept them
            [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
                if (h < GROUP) {
                    m[h] = subgroupShuffle(m_own, lane0 + h * HEAD_LANES);
                    l[h] = subgroupShuffle(l_own, lane0 + h * HEAD_LANES);
                }
#endif

#if WIDE_END
        // The split's end, in 3 + 2 × (8 / END_ELEMS - 1) barriers: each token lane's reference
        // m and sum l (the same in all its invocations: its unit 0 writes them) and the first
        // pass of the units' elements; the split's reference M per query head (the lanes'
        // largest) and each lane's factor exp(m - M) (0 for a lane without tokens); then every
        // record element summed over the token lanes by one invocation, scaled by the factors.
        barrier();  // the loop's partial scores (SUBGROUP 0) are read
        if (unit == 0u)
            [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
                if (h < GROUP) {
                    lane_m_sh[h * TLANES + tlane] = m[h];
                    lane_l_sh[h * TLANES + tlane] = l[h];
                }
        END_WRITE(0u);
        barrier();
        for (uint x = tid; x < GROUP * TLANES; x += LOCAL) {
            uint h0 = x - x % TLANES;
            float big = NEG_INF;
            for (uint ln = 0u; ln < TLANES; ++ln)
                big = max(big, lane_m_sh[h0 + ln]);
            float own = lane_m_sh[x];
            lane_f_sh[x] = own > NEG_INF ? exp(own - big) : 0.0;
            if (x == h0)
                split_m_sh[x / TLANES] = big;
        }
        barrier();
        uint rec0 = record(i, vh, pc.n_kv * pc.n_seqs);  // record (i, g, h) = rec0 + h
        if (tid < GROUP) {  // the sums of p
            float sum = 0.0;
            for (uint ln = 0u; ln < TLANES; ++ln)
                sum += lane_l_sh[tid * TLANES + ln] * lane_f_sh[tid * TLANES + ln];
            stats[(rec0 + tid) * 2u] = split_m_sh[tid];
            stats[(rec0 + tid) * 2u + 1u] = sum;
        }
        [[unroll]] for (uint e0 = 0u; e0 < UNIT_DIMS; e0 += END_ELEMS) {
            if (e0 > 0u) {
                barrier();  // the last pass's elements are read
                END_WRITE(e0);
                barrier();
            }
            // x = (h, e, un), un fastest: a warp's lanes read neighbouring words of one element
            for (uint x = tid; x < GROUP * END_ELEMS * UNITS; x += LOCAL) {
                uint un = x % UNITS, e = (x / UNITS) % END_ELEMS, h = x / (UNITS * END_ELEMS);
                float sum = 0.0;
                for (uint ln = 0u; ln < TLANES; ++ln)
                    sum += red_sh[e * END_STRIDE + h * LOCAL + ln * UNITS + un] * lane_f_sh[h * TLANES + ln];
                acc_floats[(rec0 + h) * HEAD_DIM + un * UNIT_DIMS + e0 + e] = sum;
            }
        }
#else
        // The split's end. Its reference M per query head: the largest of the token lanes'
        // references (the loop's partial scores, SUBGROUP 0, are read by then); each lane's
        // sums rescaled to it (a lane without tokens, m = -inf, adds nothing).
        float big = token_lanes_reduce(m, tid, unit, tlane, true);
        if (tid < GROUP)
            split_m_sh[tid] = big;
        barrier();
        float m_split[MAX_G];
        [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
            if (h < GROUP) {
                m_split[h] = split_m_sh[h];
                float f = m[h] > NEG_INF ? exp(m[h] - m_split[h]) : 0.0;
                l[h] *= f;
                acc_lo[h] *= f;
                acc_hi[h] *= f;
            }
        }
        // the token lanes' accumulators, summed through shared memory END_ELEMS elements
        // of the unit a pass
        uint rec0 = record(i, vh, pc.n_kv * pc.n_seqs);  // record (i, g, h) = rec0 + h
        [[unroll]] for (uint e0 = 0u; e0 < UNIT_DIMS; e0 += END_ELEMS) {
            barrier();
            [[unroll]] for (uint e = 0u; e < END_ELEMS; ++e)
                [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
                    if (h < GROUP)
                        red_sh[(e * GROUP + h) * LOCAL + tid] = UNIT_ELEM(h, e0 + e);
            barrier();
            // x = (e, h, un), un fastest: a warp's lanes read neighbouring words
            for (uint x = tid; x < END_ELEMS * GROUP * UNITS; x += LOCAL) {
                uint un = x % UNITS, eh = x / UNITS;
                uint h = eh % GROUP, e = eh / GROUP;
                float a = 0.0;
                for (uint ln = 0u; ln < TLANES; ++ln)
                    a += red_sh[eh * LOCAL + ln * UNITS + un];
                acc_floats[(rec0 + h) * HEAD_DIM + un * UNIT_DIMS + e0 + e] = a;
            }
        }
        // the sums of p
        float sum = token_lanes_reduce(l, tid, unit, tlane, false);
        if (tid < GROUP) {
            stats[(rec0 + tid) * 2u] = split_m_sh[tid];
            stats[(rec0 + tid) * 2u + 1u] = sum;
        }
#endif
        barrier();  // shared memory is reused by the next item
    }
}
