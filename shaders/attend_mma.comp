#version 450
// Decode attention on cooperative matrices (GL_NV_cooperative_matrix: 16×16 binary16 times
// 16×8 binary16 into 16×8 float32, subgroup scope, subgroups of 32 — host-checked), over the
// uncoded rows (f16, q8_0) or, built with KIVI 1, the KIVI cache's words. Same buffers, push
// block and split records as attend_flash.comp; attend_merge_head.comp merges the splits.
//
// One workgroup per (split, KV head): its NW subgroups take the split's 16-token tiles in turn
// and meet at the end. A subgroup loads a tile's words while its tile before computes, and
// stages them through shared memory as binary16 operands. The GROUP ≤ 8 query heads are the 8 columns of N (FlashInfer's GQA
// decode: the heads packed into one matrix dimension), tokens and channels the 16 of M and K:
//   scores  S^T (16 tokens × 8 heads) = K tile (16 × 16 channels) · Q^T chunk, over the chunks;
//   output  O^T (16 channels × 8 heads) += V^T chunk (16 × 16 tokens) · P^T (16 tokens × 8).
// The query is split into two binary16 parts (hi + lo: ~2^-21 of it left), both multiplied, so
// scores keep float32's precision over binary16 keys; probabilities enter as binary16 (≤ e^4).
// Decoded operands are exact in binary16, their scales folded where they are linear:
//   f16      rows are the operands;
//   q8_0     int8 levels; a key's block scale multiplies its block's partial score (one
//            accumulator per 32-channel block), a value's block scale its probability (P^T per
//            block);
//   KIVI     levels as x = 1 + l/2^b (bits into a binary16 1.0's mantissa: kivi.glsl's fold,
//            value = x·S + B): a key group's per-channel S folds into the query (Q' = Q·S, per
//            tile: tiles stay inside one 32-token group) and its B into a per-head bias q·B; a
//            value group's per-token S into the probability, its B into a per-head sum p·B.
//            The exact window's binary16 rows, after the quantised tokens, as f16 rows.
// The softmax in float32: each (head, token pair) a lane, the reference m moved only when a
// tile's maximum passes it by GROW_MARGIN (then the accumulators go through shared memory once
// to be rescaled: a matrix's element-to-lane map is the driver's).
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_NV_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_KHR_shader_subgroup_vote : require
#define SUBGROUP 1  // lane_index(): subgroup by subgroup
#ifndef KIVI
#define KIVI 0
#endif
#include "common.glsl"
#include "attend_common.glsl"
#if KIVI
#include "kivi.glsl"
#endif

layout(constant_id = 4) const uint ROW_HALF = 1u;  // attend_flash's row formats: f16 rows
layout(constant_id = 5) const uint ROW_Q8 = 0u;    // q8_0 rows (ROW_HALF 0)
#if KIVI
layout(constant_id = 6) const uint K_BITS = 4u;  // 2, 4 or 8 (whole levels a word: host-checked)
layout(constant_id = 7) const uint V_BITS = 4u;
const uint K_ROW = SLOT_LEVEL_WORDS_OF(HEAD_DIM, K_BITS);
const uint V_STATS = HEAD_DIM / KIVI_GROUP;
const uint V_ROW = V_STATS + SLOT_LEVEL_WORDS_OF(HEAD_DIM, V_BITS);
#endif

#define CM_A fcoopmatNV<16, gl_ScopeSubgroup, 16, 16>
#define CM_B fcoopmatNV<16, gl_ScopeSubgroup, 16, 8>
#define CM_C fcoopmatNV<32, gl_ScopeSubgroup, 16, 8>

const uint LOCAL = gl_WorkGroupSize.x;  // specialization constant 2: 32 × NW
const uint SG = 32u;                    // lanes a subgroup
const uint NW = LOCAL / SG;             // subgroups a workgroup
const uint TT = 16u;                    // tokens a tile (M of the scores, K of the output)
const uint HN = 8u;                     // query-head columns (N): GROUP ≤ 8, padded with zeros
const uint MAX_D16 = 8u;                // 16-channel chunks unrolled up to this: HEAD_DIM ≤ 128
const uint D16 = HEAD_DIM / 16u;
const uint D32 = HEAD_DIM / 32u;        // 32-channel blocks: q8_0 blocks, KIVI value groups
const uint MAX_D32 = MAX_D16 / 2u;
const uint Q8_SCALE_WORDS = (D32 + 1u) / 2u;
const uint F16_ROW = HEAD_DIM / 2u;     // words of a binary16 row
const uint Q8_ROW = Q8_SCALE_WORDS + HEAD_DIM / 4u;
const uint ROW_WORDS = ROW_Q8 > 0u ? Q8_ROW : F16_ROW;  // a row of the uncoded cache
#if KIVI
const uint NBLK = 1u;                  // score accumulators a tile (key scales folded into Q')
const uint NVG = D32;                  // P^T matrices a tile (one per value group)
#else
const uint NBLK = ROW_Q8 > 0u ? D32 : 1u;
const uint NVG = ROW_Q8 > 0u ? D32 : 1u;
#endif
const uint XW = TT * F16_ROW;          // a subgroup's staging words: a tile of binary16 rows, or
                                       // O^T's HEAD_DIM × HN floats (the same count at TT 16)
const uint QW = HEAD_DIM * HN / 2u;    // Q^T (HEAD_DIM × HN binary16) in words
const uint PW = TT * HN / 2u;          // a P^T (TT × HN binary16) in words
const uint MAX_WORDS = 32u;            // a lane's words of a tile's rows, unrolled up to this
const float GROW_MARGIN = 4.0;         // probabilities ≤ e^4: binary16 keeps p × a value scale
// Build-time knobs for probes (lab/probes/mma_probe.py): NO_K / NO_V / NO_SOFTMAX leave out the
// scores' products, the values' or the softmax step (wrong results: an ablation, for time only).
#ifndef NO_K
#define NO_K 0
#endif
#ifndef NO_V
#define NO_V 0
#endif
#ifndef NO_SOFTMAX
#define NO_SOFTMAX 0
#endif

layout(std430, binding = 0) readonly buffer CacheWords { uint cache_words[]; };
layout(std430, binding = 1) readonly buffer CacheQuads { uvec4 cache_quads[]; };  // (attend_flash's view; unread)
layout(std430, binding = 2) readonly buffer Query { float q_floats[]; };
layout(std430, binding = 3) writeonly buffer Accs { float acc_floats[]; };
layout(std430, binding = 4) writeonly buffer Stats { float stats[]; };

layout(push_constant) uniform AttendFlashPush {
    uint k_word;
    uint v_word;
    uint n_ctx;
    uint n_used;
    uint split_len;
    uint n_splits;
    uint n_kv;
    uint n_seqs;
    uint seq_rows;
    uint stats_word;
    uint k_window_word;
    uint v_window_word;
    uint window;
    uint state_word;
    uint split_round;
    uint q_word;
    float score_scale;
} pc;

shared float q_sh[HN * HEAD_DIM];      // the group's queries × score scale, head-major
shared uint qb_sh[2u * QW];            // Q^T's binary16 hi and lo parts: half c*HN + h (rows f16/q8_0)
shared uint x_sh[NW * XW];             // per subgroup: a tile's rows as binary16 pairs, or O^T
shared float s_sh[NW * NBLK * TT * HN];  // per subgroup: the tile's S^T per key block
shared uint p_sh[NW * NVG * PW];       // per subgroup: P^T per value block/group (binary16 pairs)
shared uint ks_sh[NW * TT * NBLK];     // per subgroup: q8_0 key block scales (float bits)
shared uint vs_sh[NW * TT * NVG];      // per subgroup: q8_0 value block scales (float bits), KIVI
                                       // value groups' stats words
#if KIVI
shared uint qf_sh[NW * 2u * QW];       // per subgroup: Q'^T = (Q·S)^T, hi and lo parts
#endif
shared float mw_sh[NW * HN];           // the end: each subgroup's reference and sum per head
shared float lw_sh[NW * HN];

// The item's place (a split of a KV head of a sequence) and the subgroup's.
uint g, seq, t0, w, lane;

void sync_subgroup() {
    subgroupMemoryBarrierShared();
    subgroupBarrier();
}

// The first word of token tok's (split-relative) row of the keys or values: the cache's rows,
// or (KIVI) the quantised rows or the exact window's ring rows.
uint row_word(bool keys, bool exact, uint tok) {
    uint t = t0 + tok;
#if KIVI
    if (exact)
        return kivi_window_row(keys ? pc.k_window_word : pc.v_window_word, g, t, pc.window, HEAD_DIM);
    return keys ? pc.k_word + (g * pc.n_ctx + t) * K_ROW : pc.v_word + (g * pc.n_ctx + t) * V_ROW;
#else
    return (keys ? pc.k_word : pc.v_word) + (g * pc.n_ctx + seq * pc.seq_rows + t) * ROW_WORDS;
#endif
}

// Two levels of `bits` (the low 2·bits of t) as binary16 1 + l/2^bits, a pair.
uint level_pair(uint t, uint bits) {
    uint mask = (1u << bits) - 1u;
    return ((t & mask) << (10u - bits)) | (((t >> bits) & mask) << (26u - bits)) | 0x3C003C00u;
}

// Words of a row of the keys or values as a tile reads them, and where its levels start (a
// q8_0 row's after its block scales, a KIVI value row's after its groups' stats words).
uint raw_row_words(bool keys, bool exact) {
#if KIVI
    return exact ? F16_ROW : (keys ? K_ROW : V_ROW);
#else
    return ROW_WORDS;
#endif
}

uint raw_first(bool keys, bool exact) {
#if KIVI
    return (exact || keys) ? 0u : V_STATS;
#else
    return ROW_Q8 > 0u ? Q8_SCALE_WORDS : 0u;
#endif
}

// The lane's words of tile tokens [ts, ts + TT) of the keys or values (rows past `te` are token
// te - 1's): word j*SG + lane of the tile's rows, one after another.
void load_raw(bool keys, bool exact, uint ts, uint te, out uint raw[MAX_WORDS]) {
    uint rw = raw_row_words(keys, exact);
    [[unroll]] for (uint j = 0u; j < MAX_WORDS; ++j) {
        uint idx = j * SG + lane;
        raw[j] = 0u;
        if (j * SG < TT * rw && idx < TT * rw)
            raw[j] = cache_words[row_word(keys, exact, min(ts + idx / rw, te - 1u)) + idx % rw];
    }
}

// load_raw's words into the subgroup's staging words as binary16 pairs, their scales into
// ks_sh/vs_sh.
void put_raw(bool keys, bool exact, uint raw[MAX_WORDS]) {
    uint xb = w * XW, rw = raw_row_words(keys, exact), first = raw_first(keys, exact);
#if KIVI
    uint bits = keys ? K_BITS : V_BITS;
#endif
    [[unroll]] for (uint j = 0u; j < MAX_WORDS; ++j) {
        uint idx = j * SG + lane;
        if (j * SG < TT * rw && idx < TT * rw) {
            uint row = idx / rw, wd = idx % rw, word = raw[j];
            uint xr = xb + row * F16_ROW;
            if (wd < first) {  // a scale or stats word
#if KIVI
                vs_sh[w * TT * NVG + row * NVG + wd] = word;
#else
                vec2 sc = unpackHalf2x16(word);
                [[unroll]] for (uint e = 0u; e < 2u; ++e)
                    if (2u * wd + e < D32) {
                        if (keys)
                            ks_sh[w * TT * NBLK + row * NBLK + 2u * wd + e] = floatBitsToUint(sc[e]);
                        else
                            vs_sh[w * TT * NVG + row * NVG + 2u * wd + e] = floatBitsToUint(sc[e]);
                    }
#endif
                continue;
            }
            uint lw = wd - first;
#if KIVI
            if (!exact) {  // 32 / bits levels: 16 / bits pairs
                uint pairs = 16u / bits;
                [[unroll]] for (uint k = 0u; k < 8u; ++k)
                    if (k < pairs)
                        x_sh[xr + lw * pairs + k] = level_pair(word >> (2u * k * bits), bits);
                continue;
            }
#endif
            if (ROW_Q8 > 0u) {
                vec4 f = int8x4(word);
                x_sh[xr + 2u * lw] = packHalf2x16(f.xy);
                x_sh[xr + 2u * lw + 1u] = packHalf2x16(f.zw);
            } else {
                x_sh[xr + lw] = word;
            }
        }
    }
}

// Tile tokens [ts, ts + TT) of the keys or values into the staging words (load_raw, put_raw).
void stage(bool keys, bool exact, uint ts, uint te) {
    uint raw[MAX_WORDS];
    load_raw(keys, exact, ts, te, raw);
    put_raw(keys, exact, raw);
}

#if KIVI
// A lane's elements of Q'^T: word x = j*SG + lane (j < KQ_WORDS) is channel x / (HN/2) = j*8 + tq;
// LOAD_KEY_STATS: their key group's stats words for the tile at split token ts0.
const uint KQ_WORDS = MAX_D16 * HN / 2u * 16u / SG;
#define LOAD_KEY_STATS(dst, ts0) { \
        uint sw_ = kivi_stats_row(pc.stats_word, g, t0 + (ts0), pc.n_ctx, HEAD_DIM); \
        [[unroll]] for (uint j_ = 0u; j_ < KQ_WORDS; ++j_) \
            dst[j_] = j_ * SG + lane < QW ? cache_words[sw_ + (j_ * SG + lane) / (HN / 2u)] : 0u; \
    }
#endif

// Two heads' elements of Q^T (or of Q'^T = (Q·S)^T) as binary16 hi and lo parts, word x of
// each part from `base` in `dst` (word x = c*HN/2 + hp: heads 2hp, 2hp+1 of channel c). hi keeps
// the float's top 10 mantissa bits by a mask (exact in binary16 within its range), lo = v − hi
// exactly in float32: a conversion round trip would do, but drivers fold it (lab/NOTEBOOK.md).
#define WRITE_QT(dst, base, x, vals) { \
        vec2 v_ = (vals); \
        vec2 hi_ = uintBitsToFloat(floatBitsToUint(v_) & 0xFFFFE000u); \
        dst[(base) + (x)] = packHalf2x16(hi_); \
        dst[(base) + QW + (x)] = packHalf2x16(v_ - hi_); \
    }

void main() {
    uint tid = lane_index();
    w = gl_SubgroupID;
    lane = gl_SubgroupInvocationID;
    uint hp = lane % 4u, tq = lane / 4u;  // the softmax's lane: heads 2hp, 2hp+1; tokens 2tq, 2tq+1
    uint items = pc.n_kv * pc.n_splits * pc.n_seqs;
    for (uint item = gl_WorkGroupID.x; item < items; item += gl_NumWorkGroups.x) {
        g = item % pc.n_kv;
        uint i = (item / pc.n_kv) % pc.n_splits;
        seq = item / (pc.n_kv * pc.n_splits);
        uint vh = seq * pc.n_kv + g;
        uint n_used = SEQ_USED(q_floats, seq);
        uint split_len = SPLIT_LEN(n_used);
        t0 = i * split_len;
        uint n_tok = t0 < n_used ? min(t0 + split_len, n_used) - t0 : 0u;

        for (uint x = tid; x < HN * HEAD_DIM; x += LOCAL) {
            uint h = x / HEAD_DIM;
            q_sh[x] = h < GROUP ? q_floats[pc.q_word + (vh * GROUP + h) * HEAD_DIM + x % HEAD_DIM] * pc.score_scale : 0.0;
        }
        barrier();
#if !KIVI
        for (uint x = tid; x < QW; x += LOCAL) {
            uint c = x / (HN / 2u), h = 2u * (x % (HN / 2u));
            WRITE_QT(qb_sh, 0u, x, vec2(q_sh[h * HEAD_DIM + c], q_sh[(h + 1u) * HEAD_DIM + c]));
        }
        barrier();
        CM_B qh[MAX_D16], ql[MAX_D16];
        [[unroll]] for (uint kc = 0u; kc < MAX_D16; ++kc)
            if (kc < D16) {
                coopMatLoadNV(qh[kc], qb_sh, kc * 16u * HN / 2u, HN / 2u, false);
                coopMatLoadNV(ql[kc], qb_sh, QW + kc * 16u * HN / 2u, HN / 2u, false);
            }
        const uint n_q = n_tok;
        const uint q_rel = n_tok;
#else
        const uint q_end = cache_words[pc.state_word];
        const uint q_rel = q_end > t0 ? min(q_end - t0, n_tok) : 0u;  // quantised: [0, q_rel)
        const uint n_q = q_rel;
        float vb[2][MAX_D32];  // sum of p·B per value group, heads 2hp, 2hp+1
        [[unroll]] for (uint e = 0u; e < 2u; ++e)
            [[unroll]] for (uint vg = 0u; vg < MAX_D32; ++vg)
                vb[e][vg] = 0.0;
#endif
        float m[2] = float[2](NEG_INF, NEG_INF), l[2] = float[2](0.0, 0.0);
        CM_C o[MAX_D16];
        [[unroll]] for (uint cc = 0u; cc < MAX_D16; ++cc)
            if (cc < D16)
                o[cc] = CM_C(0.0);

        uint xb = w * XW, sb = w * NBLK * TT * HN, pb = w * NVG * PW;
        uint tiles_q = (n_q + TT - 1u) / TT, tiles = tiles_q + (n_tok - q_rel + TT - 1u) / TT;
        // A tile's words are loaded while the subgroup's tile before it computes (staged through
        // shared memory, f16 rows too: read straight into matrices they waited on each tile).
        uint k_next[MAX_WORDS], v_next[MAX_WORDS];  // the subgroup's next quantised/row tile's words
        if (w < tiles_q) {
            load_raw(true, false, w * TT, n_q, k_next);
            load_raw(false, false, w * TT, n_q, v_next);
        }
#if KIVI
        uint stats_next[KQ_WORDS];  // its key group's stats words of the lane's channels
        if (w < tiles_q)
            LOAD_KEY_STATS(stats_next, w * TT);
#endif
        for (uint r = w; r < tiles; r += NW) {  // subgroup-uniform
            bool exact = r >= tiles_q;  // (KIVI: the window's tokens)
            uint ts = exact ? q_rel + (r - tiles_q) * TT : r * TT;
            uint te = exact ? n_tok : n_q;  // tokens [ts, te) of the tile are live
            uint k_raw[MAX_WORDS] = k_next, v_raw[MAX_WORDS] = v_next;
#if KIVI
            uint k_stats[KQ_WORDS] = stats_next;
#endif
            if (r + NW < tiles_q) {
                load_raw(true, false, (r + NW) * TT, n_q, k_next);
                load_raw(false, false, (r + NW) * TT, n_q, v_next);
#if KIVI
                LOAD_KEY_STATS(stats_next, (r + NW) * TT);
#endif
            }
            // --- keys: S^T per key block ---
            if (NO_K == 0) {
                if (!exact)
                    put_raw(true, false, k_raw);
                else
                    stage(true, exact, ts, te);  // (KIVI: the window's binary16 rows)
            }
            float kbias[2] = float[2](0.0, 0.0);
#if KIVI
            {   // Q'^T of this tile's key group (its per-channel S), or Q^T for exact rows; the
                // bias q·B of each of the lane's heads
                vec2 bias = vec2(0.0);
                [[unroll]] for (uint j = 0u; j < KQ_WORDS; ++j) {
                    uint x = j * SG + lane;  // = c*HN/2 + hp: c = j*8 + tq
                    if (x < QW) {
                        uint c = x / (HN / 2u);
                        vec2 q = vec2(q_sh[2u * hp * HEAD_DIM + c], q_sh[(2u * hp + 1u) * HEAD_DIM + c]);
                        vec2 sbf = exact ? vec2(1.0, 0.0) : kivi_fold(k_stats[j], K_BITS);
                        WRITE_QT(qf_sh, w * 2u * QW, x, q * sbf.x);
                        bias += q * sbf.y;
                    }
                }
                [[unroll]] for (uint k = 4u; k < SG; k <<= 1u)
                    bias += vec2(subgroupShuffleXor(bias.x, k), subgroupShuffleXor(bias.y, k));
                kbias = float[2](bias.x, bias.y);
            }
#endif
            sync_subgroup();
            [[unroll]] for (uint blk = 0u; blk < MAX_D32; ++blk) {
                if (blk < NBLK) {
                    CM_C sc = CM_C(0.0);
                    [[unroll]] for (uint kc = 0u; kc < MAX_D16; ++kc) {
                        if (NO_K == 0 && kc < D16 && (NBLK == 1u || kc / 2u == blk)) {
                            CM_A a;
                            coopMatLoadNV(a, x_sh, xb + kc * 8u, F16_ROW, false);
#if KIVI
                            CM_B bh, bl;
                            coopMatLoadNV(bh, qf_sh, w * 2u * QW + kc * 16u * HN / 2u, HN / 2u, false);
                            coopMatLoadNV(bl, qf_sh, w * 2u * QW + QW + kc * 16u * HN / 2u, HN / 2u, false);
                            sc = coopMatMulAddNV(a, bh, sc);
                            sc = coopMatMulAddNV(a, bl, sc);
#else
                            sc = coopMatMulAddNV(a, qh[kc], sc);
                            sc = coopMatMulAddNV(a, ql[kc], sc);
#endif
                        }
                    }
                    coopMatStoreNV(sc, s_sh, sb + blk * TT * HN, HN, false);
                }
            }
            sync_subgroup();
            // --- the softmax step: the lane's two tokens of its two heads ---
            float s[2][2];
            bool live[2];
            [[unroll]] for (uint e2 = 0u; e2 < 2u; ++e2) {
                uint t = 2u * tq + e2;
                live[e2] = ts + t < te;
                [[unroll]] for (uint e = 0u; e < 2u; ++e) {
                    float v = kbias[e];
                    [[unroll]] for (uint blk = 0u; blk < MAX_D32; ++blk)
                        if (blk < NBLK) {
                            float part = s_sh[sb + blk * TT * HN + t * HN + 2u * hp + e];
                            v += ROW_Q8 > 0u && KIVI == 0 ? uintBitsToFloat(ks_sh[w * TT * NBLK + t * NBLK + blk]) * part
                                                          : part;
                        }
                    s[e2][e] = v;
                }
            }
            float corr[2];
            bool rescale = false;
            [[unroll]] for (uint e = 0u; e < 2u; ++e) {
                float mx = max(live[0] ? s[0][e] : NEG_INF, live[1] ? s[1][e] : NEG_INF);
                [[unroll]] for (uint k = 4u; k < SG; k <<= 1u)
                    mx = max(mx, subgroupShuffleXor(mx, k));
                bool moved = mx > m[e] + GROW_MARGIN && (NO_SOFTMAX == 0 || m[e] == NEG_INF);
                corr[e] = moved ? exp(m[e] - mx) : 1.0;  // 0 on the first live tile
                rescale = rescale || (moved && m[e] > NEG_INF);
                m[e] = moved ? mx : m[e];
                l[e] *= corr[e];
#if KIVI
                [[unroll]] for (uint vg = 0u; vg < MAX_D32; ++vg)
                    vb[e][vg] *= corr[e];
#endif
            }
            if (subgroupAny(rescale)) {  // rare: O^T's columns scaled through shared memory
                [[unroll]] for (uint cc = 0u; cc < MAX_D16; ++cc)
                    if (cc < D16)
                        coopMatStoreNV(o[cc], x_sh, xb + cc * 16u * HN, HN, false);
                sync_subgroup();
                for (uint c = tq; c < HEAD_DIM; c += SG / 4u)
                    [[unroll]] for (uint e = 0u; e < 2u; ++e)
                        x_sh[xb + c * HN + 2u * hp + e] = floatBitsToUint(uintBitsToFloat(x_sh[xb + c * HN + 2u * hp + e]) * corr[e]);
                sync_subgroup();
                [[unroll]] for (uint cc = 0u; cc < MAX_D16; ++cc)
                    if (cc < D16)
                        coopMatLoadNV(o[cc], x_sh, xb + cc * 16u * HN, HN, false);
                sync_subgroup();
            }
            // --- values: P^T per value block, O^T += V^T · P^T ---
            if (NO_V == 0) {
                if (!exact)
                    put_raw(false, false, v_raw);
                else
                    stage(false, exact, ts, te);
            }
            sync_subgroup();
            [[unroll]] for (uint e2 = 0u; e2 < 2u; ++e2) {
                uint t = 2u * tq + e2;
                vec2 p = vec2(0.0);
                [[unroll]] for (uint e = 0u; e < 2u; ++e)
                    p[e] = live[e2] && 2u * hp + e < GROUP ? (NO_SOFTMAX > 0 ? s[e2][e] : exp(s[e2][e] - m[e])) : 0.0;
                l[0] += p.x;
                l[1] += p.y;
                [[unroll]] for (uint vg = 0u; vg < MAX_D32; ++vg) {
                    if (vg < NVG) {
                        vec2 pv = p;
#if KIVI
                        if (!exact) {
                            vec2 sbv = kivi_fold(vs_sh[w * TT * NVG + t * NVG + vg], V_BITS);
                            pv = p * sbv.x;
                            vb[0][vg] += p.x * sbv.y;
                            vb[1][vg] += p.y * sbv.y;
                        }
#else
                        if (ROW_Q8 > 0u)
                            pv = p * uintBitsToFloat(vs_sh[w * TT * NVG + t * NVG + vg]);
#endif
                        p_sh[pb + vg * PW + t * (HN / 2u) + hp] = packHalf2x16(pv);
                    }
                }
            }
            sync_subgroup();
            [[unroll]] for (uint vg = 0u; vg < MAX_D32; ++vg) {
                if (vg < NVG) {
                    CM_B pm;
                    coopMatLoadNV(pm, p_sh, pb + vg * PW, HN / 2u, false);
                    [[unroll]] for (uint cc = 0u; cc < MAX_D16; ++cc) {
                        if (NO_V == 0 && cc < D16 && (NVG == 1u || cc / 2u == vg)) {
                            CM_A a;
                            coopMatLoadNV(a, x_sh, xb + cc * 8u, F16_ROW, true);
                            o[cc] = coopMatMulAddNV(a, pm, o[cc]);
                        }
                    }
                }
            }
            sync_subgroup();  // the staging words and matrices are rewritten by the next tile
        }

        // --- the end: each subgroup's O^T, reference and sum; then the split's record ---
        [[unroll]] for (uint k = 4u; k < SG; k <<= 1u) {
            l[0] += subgroupShuffleXor(l[0], k);
            l[1] += subgroupShuffleXor(l[1], k);
#if KIVI
            [[unroll]] for (uint vg = 0u; vg < MAX_D32; ++vg) {
                vb[0][vg] += subgroupShuffleXor(vb[0][vg], k);
                vb[1][vg] += subgroupShuffleXor(vb[1][vg], k);
            }
#endif
        }
        [[unroll]] for (uint cc = 0u; cc < MAX_D16; ++cc)
            if (cc < D16)
                coopMatStoreNV(o[cc], x_sh, xb + cc * 16u * HN, HN, false);
        sync_subgroup();
#if KIVI
        for (uint c = tq; c < HEAD_DIM; c += SG / 4u)
            [[unroll]] for (uint e = 0u; e < 2u; ++e) {
                float add = 0.0;
                [[unroll]] for (uint vg = 0u; vg < MAX_D32; ++vg)
                    add += vg == c / KIVI_GROUP ? vb[e][vg] : 0.0;
                x_sh[xb + c * HN + 2u * hp + e] = floatBitsToUint(uintBitsToFloat(x_sh[xb + c * HN + 2u * hp + e]) + add);
            }
#endif
        if (tq == 0u)
            [[unroll]] for (uint e = 0u; e < 2u; ++e) {
                mw_sh[w * HN + 2u * hp + e] = m[e];
                lw_sh[w * HN + 2u * hp + e] = l[e];
            }
        barrier();
        uint rec0 = record(i, vh, pc.n_kv * pc.n_seqs);
        for (uint x = tid; x < GROUP * HEAD_DIM; x += LOCAL) {
            uint h = x / HEAD_DIM, c = x % HEAD_DIM;
            float big = NEG_INF;
            for (uint u = 0u; u < NW; ++u)
                big = max(big, mw_sh[u * HN + h]);
            float acc = 0.0, sum = 0.0;
            for (uint u = 0u; u < NW; ++u) {
                float mu = mw_sh[u * HN + h];
                float f = mu > NEG_INF ? exp(mu - big) : 0.0;
                acc += f * uintBitsToFloat(x_sh[u * XW + c * HN + h]);
                sum += f * lw_sh[u * HN + h];
            }
            acc_floats[(rec0 + h) * HEAD_DIM + c] = acc;
            if (c == 0u) {
                stats[(rec0 + h) * 2u] = big;
                stats[(rec0 + h) * 2u + 1u] = sum;
            }
        }
        barrier();  // shared memory is reused by the next item
    }
}
