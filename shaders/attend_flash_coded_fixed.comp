#version 450
// attend_flash_coded.comp's sibling with the atom weights as fixed-point integers (below): the
// same bindings, push block, specialization and records; the tuner (kvdict_vk.vk.attend_tune)
// times both per launch shape and keeps the faster — on an H200 this one won for K4/V3 over
// 8 × 4 heads and lost over 3 × 3 and for atoms-only slots (docs/DESIGN.md).
// Decode attention straight over dict-coded slots (docs/FORMAT.md), shaped for GPUs: one
// workgroup per (split i, KV head g, block of HB query heads) attends over the split's tokens
// without decoding a key or a value; attend_merge_head.comp combines the splits' records (and
// adds the V mean). Both streams dict-coded, each with or without a residual stage.
//   keys:   score = scale * (sum_j c_j T[h, idx_j] + step * sum_e (q*rscale_k)[h, e] * (lvl_e - half))
//           with T = q . atom from attend_table.comp (once per step) in shared memory;
//           q . mean_k is the same for every token (it cancels);
//   values: out = mean_v + sum_a w[h, a] atom[a] + rscale_v * sum_t p_t step_t (lvl_t - half)
//           with the per-atom weights w[h, a] = sum over code words selecting a of p_t c_j,
//           multiplied by the atoms at the split's end. (Multiplying them once per attention
//           in a pass of their own instead — the weights written per split — measured slower on
//           an H200: the extra dispatch and its barrier cost more than the atom reads it saves.)
//
// Lanes across a slot: a token is served by U = HEAD_DIM / 8 neighbouring invocations, 8
// elements each — its K and V levels are one window of 8·bits bits of the slot (a coalesced run
// over the token's lanes), code word j is loaded by lane j % U. Each lane keeps its 8 elements
// of the HB query vectors (times the score scale, K's residual scale and 2^K_BITS) and of the
// V residual's sums in registers. A token's partial scores are summed across its lanes:
//   SUBGROUP 1 (attend_flash_coded_sg; the device's subgroups hold whole tokens, host-checked):
//     a reduce-scatter by shuffles leaves lane u with the score of head u / (U / HP) only, which
//     it exponentiates; the others' probabilities come back by one shuffle per head;
//   SUBGROUP 0 (no optional feature): partial scores through shared memory, every lane sums them.
//
// The atom weights are a scatter — every V code word adds p·c to one weight per head — and it
// is the part that set this kernel's pace: a float add in shared memory needs a compare-and-
// swap loop (core Vulkan has no float atomics) whose round trips serialise. Here the weights
// are FIXED-POINT INTEGERS in shared memory, added with core atomicAdd (no loop, no result
// waited for), and flushed now and then into float weights each lane keeps in registers
// (NB of them: bins tid, tid + LOCAL, …). Exact enough by construction:
//   * per round (ROUND tokens) every lane knows x = p·|c| for its code words (p the largest of
//     the heads'); their maximum `big` and sum `total` (through shared memory) bound every
//     addition of the round and what it adds to any bin;
//   * an addition is rounded to an integer at `fix_scale`, a power of two chosen at each flush
//     so the round's largest addition is in [2^21, 2^22) units: its error is ≤ 2^-22 of it;
//     rounding x < 2^22 is one add of 1.5·2^23;
//   * `budget` sums the rounds' totals (in units): a round that would pass 1.5·2^30, or whose
//     largest addition would reach 2^22, flushes the bins first — a bin never overflows.
// The softmax reference m (uniform over the workgroup) moves only when a probability exceeds
// e^GROW_MARGIN (a flag in shared memory; then a workgroup maximum — the first round, rarely
// after), so the bins never need rescaling between flushes: a move flushes them first.
// The record's (m, l, acc) are exact for any reference (the merge rescales by exp(m - M)).
// Levels become floats without an int→float conversion: a level's bits placed at the top of
// the mantissa of 1.0 give 1 + lvl / 2^b; K folds the constant into a per-lane term, V
// subtracts 1 + half / 2^b exactly (both operands in [1, 2)).
// An out-of-range atom index contributes exactly zero.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#ifndef SUBGROUP
#define SUBGROUP 0
#endif
#if SUBGROUP
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#endif
#include "common.glsl"
#include "attend_common.glsl"
// Build-time knobs for probes (tools/coded_probe.py); all off in the shipped SPIR-V. The
// ABLATE_* ones remove a part to time the rest and make the output wrong.
#ifndef ABLATE_SCATTER
#define ABLATE_SCATTER 0
#endif
#ifndef ABLATE_ROUND_SYNC
#define ABLATE_ROUND_SYNC 0
#endif
#ifndef ABLATE_RESIDUAL
#define ABLATE_RESIDUAL 0
#endif

layout(constant_id = 4) const uint K_BITS = 0u;   // residual bits of K (0: atoms only)
layout(constant_id = 5) const uint V_BITS = 0u;
layout(constant_id = 6) const uint N_ATOMS = 1024u;  // atoms per dictionary head
layout(constant_id = 7) const uint K_SPARSITY = 4u;  // code words per K slot
layout(constant_id = 8) const uint V_SPARSITY = 4u;
const uint LOCAL = gl_WorkGroupSize.x;
const uint E = 8u;                    // elements per lane
const uint U = HEAD_DIM / E;          // lanes per token: a power of two >= HP (host)
const uint TLANES = LOCAL / U;        // token lanes per workgroup
#ifndef TOKENS_PER_LANE
#define TOKENS_PER_LANE 4u
#endif
const uint TB = TOKENS_PER_LANE;      // tokens per lane and round, loaded together
const uint ROUND = TLANES * TB;       // tokens per round
const uint MAX_HB = 4u;               // registers per query head are unrolled up to this (host: HB <= 4)
const uint HP = HB > 2u ? 4u : HB;    // heads padded to a power of two: the reduce-scatter's
const uint LPH = U / HP;              // lanes holding one head's score after the reduce-scatter
const uint KC = (K_SPARSITY + U - 1u) / U;  // K code words per lane
const uint VC = (V_SPARSITY + U - 1u) / U;
const uint K_LEVEL_WORDS = SLOT_LEVEL_WORDS_OF(HEAD_DIM, K_BITS);
const uint V_LEVEL_WORDS = SLOT_LEVEL_WORDS_OF(HEAD_DIM, V_BITS);
const uint K_ROW = SLOT_WORDS_OF(K_SPARSITY, HEAD_DIM, K_BITS);
const uint V_ROW = SLOT_WORDS_OF(V_SPARSITY, HEAD_DIM, V_BITS);
// words a lane's window of E·b bits spans: its first bit is a multiple of 8, so ≤ 24 bits of
// offset (none when E·b is a multiple of 32); at least one (unused without a residual stage)
#define WIN_OF(B) ((B) == 0u ? 1u : ((E * (B)) % 32u == 0u ? (E * (B)) / 32u : (24u + E * (B) + 31u) / 32u))
const uint K_WIN = WIN_OF(K_BITS);
const uint V_WIN = WIN_OF(V_BITS);
const uint NB = (HB * N_ATOMS + LOCAL - 1u) / LOCAL;  // fixed-point bins a lane flushes
const uint VQ = HEAD_DIM / 4u;        // element quads (the end's weights × atoms product)
const uint VLANES = LOCAL / VQ;       // atom lanes of that product (host: LOCAL % VQ == 0)
const uint UNROLL = 16u;              // atom rows loaded together at the end (latency)
// Probabilities stay ≤ e^GROW_MARGIN between moves of the reference. Small, because one
// fixed-point scale serves every head: a head whose probabilities run e^GROW_MARGIN above
// another's would set a quantum that coarse for the other's additions.
const float GROW_MARGIN = 1.0;
const float P_GROW = 2.718281828459045;  // e^GROW_MARGIN
const float ADD_LIMIT = 4194304.0;    // 2^22: fixed-point additions stay below (MAGIC's range)
const float BUDGET = 1610612736.0;    // 1.5 * 2^30: the bins' worst-case magnitude between flushes
const float MAGIC = 12582912.0;       // 1.5 * 2^23: x + MAGIC rounds x (|x| < 2^22) to an integer
const uint N_CTL = 4u;                // round control buffers: 3 rotating + the slow path's

layout(std430, binding = 0) readonly buffer CacheWords { uint cache_words[]; };  // slots, scales
layout(std430, binding = 1) readonly buffer CacheQuads { uvec4 cache_quads[]; };  // V atoms
layout(std430, binding = 2) readonly buffer Table { float table[]; };  // [(g*GROUP + h)*n_atoms + a]
layout(std430, binding = 3) readonly buffer Query { float q_floats[]; };
layout(std430, binding = 4) writeonly buffer Accs { float acc_floats[]; };
layout(std430, binding = 5) writeonly buffer Stats { float stats[]; };

layout(push_constant) uniform AttendFlashCodedPush {
    uint k_word;        // the layer's K slots, n_ctx per KV head
    uint v_word;
    uint n_ctx;
    uint n_used;
    uint split_len;
    uint n_splits;
    uint n_kv;
    uint v_atoms_word;  // V atoms (KV head h's at + h*head_atoms), a multiple of 4
    uint head_atoms;
    uint k_scale_word;  // residual scales (read only with a residual stage)
    uint v_scale_word;
    uint head_vec;
    uint n_seqs;        // sequences (attend_common.glsl: batched decode)
    uint seq_rows;      // rows between two sequences' first tokens in a KV head
    float score_scale;
} pc;

// head-major, so one head's lookups and additions of a warp spread over every bank
shared float tab_sh[HB * N_ATOMS];  // [h*N_ATOMS + a]: q . atom * score scale
shared int bins_sh[HB * N_ATOMS];   // [h*N_ATOMS + a]: the atom weights in fixed point; at the end, floats
shared float red_sh[MAX_HB * LOCAL];  // partial scores (SUBGROUP 0); the end's sums
shared float out_sh[MAX_HB * HEAD_DIM];  // the end: the V residual part of each head
shared uint mx_sh[N_CTL];           // per round buffer: the largest addition's bits
shared vec4 sum4_sh[N_CTL][LOCAL / 4u];  // per round buffer: partial sums of the additions' magnitudes
shared uint grow_sh[N_CTL];         // per round buffer: a probability passed e^GROW_MARGIN
shared uint smax_sh[MAX_HB];        // the slow path: each head's round maximum (ordered bits)

// floats → uints whose order is the floats' (for atomicMax over signed scores)
uint ordered(float x) {
    uint b = floatBitsToUint(x);
    return (b & 0x80000000u) != 0u ? ~b : b | 0x80000000u;
}
float unordered(uint b) { return uintBitsToFloat((b & 0x80000000u) != 0u ? b & 0x7FFFFFFFu : ~b); }

// The largest power of two ≤ y (y > 0 finite; clamped to [2^-100, 2^100]).
float pow2_floor(float y) { return uintBitsToFloat(floatBitsToUint(clamp(y, 7.9e-31, 1.2e30)) & 0xFF800000u); }

// The E levels of a lane (elements unit*E .. unit*E+E-1) from its window words.
void lane_levels(uint w[3], uint unit, uint b, out float f[E]) {
    uint off = (unit * E * b) & 31u;
    if (E * b <= 32u) {
        uint win = (E * b) % 32u == 0u ? w[0] : level_window(w[0], w[1], off);
        [[unroll]] for (uint e = 0u; e < E; ++e)
            f[e] = window_unit_level(win, e, b);
    } else {  // 5..8 bits: two windows of E/2 elements
        uint win0 = (E * b) % 32u == 0u ? w[0] : level_window(w[0], w[1], off);
        uint off1 = off + (E / 2u) * b;
        uint win1 = off1 >= 32u ? level_window(w[1], w[2], off1 - 32u) : level_window(w[0], w[1], off1);
        [[unroll]] for (uint e = 0u; e < E / 2u; ++e) {
            f[e] = window_unit_level(win0, e, b);
            f[e + E / 2u] = window_unit_level(win1, e, b);
        }
    }
}

// The round's bound: the largest addition (a maximum in shared memory) and the sum of their
// magnitudes (partial sums in shared memory, added up in the same order by every lane).
#if SUBGROUP
#define PUBLISH_BOUND(buf) \
            for (uint w = 1u; w < gl_SubgroupSize; w <<= 1u) { \
                xmax = max(xmax, subgroupShuffleXor(xmax, w)); \
                xsum += subgroupShuffleXor(xsum, w); \
            } \
            if (gl_SubgroupInvocationID == 0u) { \
                atomicMax(mx_sh[buf], floatBitsToUint(xmax));  /* non-negative: bits order as floats */ \
                sum4_sh[buf][gl_SubgroupID / 4u][gl_SubgroupID % 4u] = xsum; \
            }
#define N_PARTS gl_NumSubgroups
#else
#define PUBLISH_BOUND(buf) \
            if (xmax > 0.0) \
                atomicMax(mx_sh[buf], floatBitsToUint(xmax)); \
            sum4_sh[buf][tid / 4u][tid % 4u] = xsum;
#define N_PARTS LOCAL
#endif
#define READ_BOUND(buf, big, total) { \
            big = uintBitsToFloat(mx_sh[buf]); \
            vec4 t4 = vec4(0.0); \
            for (uint k = 0u; k < (N_PARTS + 3u) / 4u; ++k)  /* entries past N_PARTS stay 0 */ \
                t4 += sum4_sh[buf][k]; \
            total = (t4.x + t4.y) + (t4.z + t4.w); }

void main() {
    const uint tid = lane_index();
    const uint unit = tid % U, tlane = tid / U;
    const uint own = unit / LPH;  // the head whose score this lane holds (SUBGROUP 1) and whose p it sums
#if SUBGROUP
    const uint tok0 = gl_SubgroupInvocationID - unit;  // the token's first lane in the subgroup
#endif
    const float k_c0 = 1.0 + residual_half(K_BITS) / float(1u << K_BITS);
    const float v_c0 = 1.0 + residual_half(V_BITS) / float(1u << V_BITS);
    uint items = pc.n_splits * pc.n_kv * N_HB * pc.n_seqs;
    for (uint item = gl_WorkGroupID.x; item < items; item += gl_NumWorkGroups.x) {
        uint blk = item % N_HB;
        uint g = (item / N_HB) % pc.n_kv;
        uint i = (item / (N_HB * pc.n_kv)) % pc.n_splits;
        uint seq = item / (N_HB * pc.n_kv * pc.n_splits);
        uint vh = seq * pc.n_kv + g;  // the virtual head: queries, table rows, records
        uint h0 = vh * GROUP + blk * HB;  // first query head of the block
        uint n_used = SEQ_USED(q_floats, seq);
        uint t0 = i * pc.split_len;
        uint n_tok = t0 < n_used ? min(t0 + pc.split_len, n_used) - t0 : 0u;  // 0: an empty split

        for (uint x = gl_LocalInvocationID.x; x < HB * N_ATOMS; x += LOCAL) {
            tab_sh[x] = table[h0 * N_ATOMS + x] * pc.score_scale;  // the block's rows, contiguous
            bins_sh[x] = 0;
        }
        if (gl_LocalInvocationID.x < N_CTL) {
            mx_sh[gl_LocalInvocationID.x] = 0u;
            grow_sh[gl_LocalInvocationID.x] = 0u;
        }
        for (uint x = gl_LocalInvocationID.x; x < N_CTL * (LOCAL / 4u); x += LOCAL)
            sum4_sh[x / (LOCAL / 4u)][x % (LOCAL / 4u)] = vec4(0.0);
        // this lane's elements of the queries: times the score scale, K's residual scale and
        // 2^K_BITS; kconst = (1 + half/2^b) * their sum (window_unit_level's offset, folded)
        float qk[MAX_HB][E], kconst[MAX_HB];
        float acc[MAX_HB][E];  // the V residual: sum_t p step (lvl - half) / 2^V_BITS, this lane's elements
        float m[MAX_HB];       // the reference (uniform)
        [[unroll]] for (uint h = 0u; h < MAX_HB; ++h) {
            kconst[h] = 0.0;
            m[h] = NEG_INF;
            [[unroll]] for (uint e = 0u; e < E; ++e) {
                qk[h][e] = 0.0;
                acc[h][e] = 0.0;
                if (h < HB && K_BITS > 0u) {
                    uint d = unit * E + e;
                    float rs = uintBitsToFloat(cache_words[pc.k_scale_word + g * pc.head_vec + d]);
                    qk[h][e] = q_floats[(h0 + h) * HEAD_DIM + d] * pc.score_scale * rs * float(1u << K_BITS);
                    kconst[h] += qk[h][e];
                }
            }
            kconst[h] *= k_c0;
        }
        float wf[NB];  // the flushed atom weights of bins tid + k*LOCAL (head tid % HP)
        [[unroll]] for (uint k = 0u; k < NB; ++k)
            wf[k] = 0.0;
        float l_own = 0.0;     // sum of p of head `own` over this lane's tokens
        float fix_scale = 1.0, budget = 0.0;  // uniform

        uint k_base = pc.k_word + (g * pc.n_ctx + seq * pc.seq_rows + t0) * K_ROW;
        uint v_base = pc.v_word + (g * pc.n_ctx + seq * pc.seq_rows + t0) * V_ROW;
        // this lane's words of TB tokens (next round's, loaded while this one computes)
        uint kcw[TB][KC], vcw[TB][VC], kwin[TB][3], vwin[TB][3], kst[TB], vst[TB];
        const uint k_w0 = K_SPARSITY + ((unit * E * K_BITS) >> 5u);
        const uint v_w0 = V_SPARSITY + ((unit * E * V_BITS) >> 5u);
#define LOAD_ROUND(first) \
        [[unroll]] for (uint b = 0u; b < TB; ++b) { \
            uint t = min((first) + tlane + b * TLANES, n_tok - 1u); \
            uint kr = k_base + t * K_ROW, vr = v_base + t * V_ROW; \
            [[unroll]] for (uint c = 0u; c < KC; ++c) \
                kcw[b][c] = cache_words[kr + min(unit + c * U, K_SPARSITY - 1u)]; \
            [[unroll]] for (uint c = 0u; c < VC; ++c) \
                vcw[b][c] = cache_words[vr + min(unit + c * U, V_SPARSITY - 1u)]; \
            [[unroll]] for (uint w = 0u; w < 3u; ++w) { \
                kwin[b][w] = 0u; \
                vwin[b][w] = 0u; \
            } \
            kst[b] = 0u; \
            vst[b] = 0u; \
            if (K_BITS > 0u) { \
                [[unroll]] for (uint w = 0u; w < K_WIN; ++w) \
                    kwin[b][w] = cache_words[kr + min(k_w0 + w, K_SPARSITY + K_LEVEL_WORDS)]; \
                kst[b] = cache_words[kr + K_SPARSITY + K_LEVEL_WORDS]; \
            } \
            if (V_BITS > 0u) { \
                [[unroll]] for (uint w = 0u; w < V_WIN; ++w) \
                    vwin[b][w] = cache_words[vr + min(v_w0 + w, V_SPARSITY + V_LEVEL_WORDS)]; \
                vst[b] = cache_words[vr + V_SPARSITY + V_LEVEL_WORDS]; \
            } \
        }
        if (n_tok > 0u)
            LOAD_ROUND(0u);
        barrier();  // the table, the zeroed bins and control words

        uint round_no = 0u;
        for (uint r0 = 0u; r0 < n_tok; r0 += ROUND, ++round_no) {  // the same trip count everywhere
            uint cur = round_no % 3u;
            if (gl_LocalInvocationID.x == 0u) {  // the buffer the next round writes: last read two rounds ago
                mx_sh[(round_no + 1u) % 3u] = 0u;
                grow_sh[(round_no + 1u) % 3u] = 0u;
            }
            uint kc[TB][KC], vc[TB][VC], kw[TB][3], vw[TB][3], ks[TB], vs[TB];
            [[unroll]] for (uint b = 0u; b < TB; ++b) {
                [[unroll]] for (uint c = 0u; c < KC; ++c)
                    kc[b][c] = kcw[b][c];
                [[unroll]] for (uint c = 0u; c < VC; ++c)
                    vc[b][c] = vcw[b][c];
                kw[b] = kwin[b];
                vw[b] = vwin[b];
                ks[b] = kst[b];
                vs[b] = vst[b];
            }
            if (r0 + ROUND < n_tok)
                LOAD_ROUND(r0 + ROUND);

            // 1. the partial scores of this lane's tokens: its code words' table entries and its
            //    elements of the K residual
            float s[TB][MAX_HB];  // SUBGROUP 1: s[b][0] = the score of head `own`; 0: every head's
            bool live[TB];
            [[unroll]] for (uint b = 0u; b < TB; ++b) {
                live[b] = r0 + tlane + b * TLANES < n_tok;
                float part[MAX_HB];
                [[unroll]] for (uint h = 0u; h < MAX_HB; ++h)
                    part[h] = 0.0;
                if (K_BITS > 0u && ABLATE_RESIDUAL == 0) {
                    float f[E];
                    lane_levels(kw[b], unit, K_BITS, f);
                    float st = uintBitsToFloat(ks[b]);
                    [[unroll]] for (uint h = 0u; h < MAX_HB; ++h) {
                        if (h < HB) {
                            float d = 0.0;
                            [[unroll]] for (uint e = 0u; e < E; ++e)
                                d += qk[h][e] * f[e];
                            part[h] = st * (d - kconst[h]);
                        }
                    }
                }
                [[unroll]] for (uint c = 0u; c < KC; ++c) {
                    uint a = code_atom(kc[b][c]);
                    if (unit + c * U < K_SPARSITY && a < N_ATOMS) {
                        float coef = code_coef(kc[b][c]);
                        [[unroll]] for (uint h = 0u; h < MAX_HB; ++h)
                            if (h < HB)
                                part[h] += coef * tab_sh[h * N_ATOMS + a];
                    }
                }
#if SUBGROUP
                // reduce-scatter over the token's U lanes: halve the heads held at each exchange
                uint w = U / 2u;
                if (HP == 4u) {
                    bool up = (unit & w) != 0u;
                    float send0 = up ? part[0] : part[2], send1 = up ? part[1] : part[3];
                    float keep0 = up ? part[2] : part[0], keep1 = up ? part[3] : part[1];
                    part[0] = keep0 + subgroupShuffleXor(send0, w);
                    part[1] = keep1 + subgroupShuffleXor(send1, w);
                    w >>= 1u;
                }
                if (HP >= 2u) {
                    bool up = (unit & w) != 0u;
                    float send = up ? part[0] : part[1], keep = up ? part[1] : part[0];
                    part[0] = keep + subgroupShuffleXor(send, w);
                    w >>= 1u;
                }
                for (; w > 0u; w >>= 1u)
                    part[0] += subgroupShuffleXor(part[0], w);
                s[b][0] = part[0];
#else
                barrier();  // the last token's partials are read
                [[unroll]] for (uint h = 0u; h < MAX_HB; ++h)
                    if (h < HB)
                        red_sh[h * LOCAL + tid] = part[h];
                barrier();
                [[unroll]] for (uint h = 0u; h < MAX_HB; ++h) {
                    s[b][h] = 0.0;
                    if (h < HB)
                        for (uint u = 0u; u < U; ++u)
                            s[b][h] += red_sh[h * LOCAL + tlane * U + u];
                }
#endif
            }

            // 2. probabilities against the current reference; the round's largest addition
            float p[TB][MAX_HB];
            bool grow = false;
            float xmax = 0.0, xsum = 0.0;  // this lane's largest addition of the round, their sum
            float m_own = m[0];
            [[unroll]] for (uint h = 1u; h < MAX_HB; ++h)
                m_own = own == h ? m[h] : m_own;
#define PROBABILITIES() \
            [[unroll]] for (uint b = 0u; b < TB; ++b) { \
                PROBS_OF(b) \
                float pm = 0.0; \
                [[unroll]] for (uint h = 0u; h < MAX_HB; ++h) \
                    pm = h < HB ? max(pm, p[b][h]) : pm; \
                [[unroll]] for (uint c = 0u; c < VC; ++c) \
                    if (live[b] && unit + c * U < V_SPARSITY && code_atom(vc[b][c]) < N_ATOMS) { \
                        float x = pm * abs(code_coef(vc[b][c])); \
                        xmax = max(xmax, x); \
                        xsum += x; \
                    } \
            }
#if SUBGROUP
#define PROBS_OF(b) \
                float p_own = live[b] && own < HB ? exp(s[b][0] - m_own) : 0.0; \
                grow = grow || p_own > P_GROW; \
                [[unroll]] for (uint h = 0u; h < MAX_HB; ++h) \
                    p[b][h] = h < HB ? subgroupShuffle(p_own, tok0 + h * LPH) : 0.0;
#else
#define PROBS_OF(b) \
                [[unroll]] for (uint h = 0u; h < MAX_HB; ++h) { \
                    p[b][h] = h < HB && live[b] ? exp(s[b][h] - m[h]) : 0.0; \
                    grow = grow || p[b][h] > P_GROW; \
                }
#endif
            PROBABILITIES()
            if (grow)
                grow_sh[cur] = 1u;  // every writer writes 1
#if ABLATE_ROUND_SYNC
            if (round_no == 0u) {
                PUBLISH_BOUND(cur)
                barrier();
            }
#else
            PUBLISH_BOUND(cur)
            barrier();
#endif

            // 3. the bins: flushed when the reference moves, the round would overflow them or its
            //    additions would pass ADD_LIMIT (uniform decisions: every lane reads the same words)
            float big = 0.0, total = 0.0;
            if (ABLATE_ROUND_SYNC == 0 || round_no == 0u) {
                READ_BOUND(cur, big, total)
            }
            if (grow_sh[cur] != 0u && (ABLATE_ROUND_SYNC == 0 || round_no == 0u)) {
                // the slow path: each head's round maximum becomes its reference where it passed
                // the old one by GROW_MARGIN; sums so far rescaled; the round's probabilities anew
                if (gl_LocalInvocationID.x < MAX_HB)
                    smax_sh[gl_LocalInvocationID.x] = 0u;
                if (gl_LocalInvocationID.x == 0u)
                    mx_sh[3] = 0u;
                barrier();
#if SUBGROUP
                float smx = NEG_INF;
                [[unroll]] for (uint b = 0u; b < TB; ++b)
                    smx = live[b] ? max(smx, s[b][0]) : smx;
                if (own < HB)
                    atomicMax(smax_sh[own], ordered(smx));
#else
                [[unroll]] for (uint h = 0u; h < MAX_HB; ++h) {
                    float smx = NEG_INF;
                    [[unroll]] for (uint b = 0u; b < TB; ++b)
                        smx = live[b] ? max(smx, s[b][h]) : smx;
                    if (h < HB && unit == 0u)
                        atomicMax(smax_sh[h], ordered(smx));
                }
#endif
                barrier();
                float corr[MAX_HB];
                [[unroll]] for (uint h = 0u; h < MAX_HB; ++h) {
                    corr[h] = 1.0;
                    if (h < HB) {
                        float top = unordered(smax_sh[h]);
                        if (top > m[h] + GROW_MARGIN) {
                            corr[h] = exp(m[h] - top);  // 0 on the first round (m = -inf)
                            m[h] = top;
                        }
                    }
                }
                float corr_own = corr[0];
                [[unroll]] for (uint h = 1u; h < MAX_HB; ++h)
                    corr_own = own == h ? corr[h] : corr_own;
                [[unroll]] for (uint k = 0u; k < NB; ++k) {
                    uint x = tid + k * LOCAL;
                    if (x < HB * N_ATOMS) {
                        uint hx = x / N_ATOMS;  // the bin's head
                        float c = corr[0];
                        [[unroll]] for (uint h = 1u; h < MAX_HB; ++h)
                            c = hx == h ? corr[h] : c;
                        wf[k] = (wf[k] + float(bins_sh[x]) / fix_scale) * c;
                        bins_sh[x] = 0;
                    }
                }
                [[unroll]] for (uint h = 0u; h < MAX_HB; ++h)
                    [[unroll]] for (uint e = 0u; e < E; ++e)
                        acc[h][e] *= corr[h];
                l_own *= corr_own;
                m_own = m[0];
                [[unroll]] for (uint h = 1u; h < MAX_HB; ++h)
                    m_own = own == h ? m[h] : m_own;
                xmax = 0.0;
                xsum = 0.0;
                PROBABILITIES()
                PUBLISH_BOUND(3u)
                barrier();  // the bins are cleared and the new bound is in
                READ_BOUND(3u, big, total)
                fix_scale = big > 0.0 ? pow2_floor(ADD_LIMIT / big) : 1.0;
                budget = total * fix_scale;
            } else if (ABLATE_ROUND_SYNC == 0 && (big * fix_scale >= ADD_LIMIT || budget + total * fix_scale > BUDGET)) {
                [[unroll]] for (uint k = 0u; k < NB; ++k) {
                    uint x = tid + k * LOCAL;
                    if (x < HB * N_ATOMS) {
                        wf[k] += float(bins_sh[x]) / fix_scale;
                        bins_sh[x] = 0;
                    }
                }
                fix_scale = pow2_floor(ADD_LIMIT / big);
                budget = total * fix_scale;
                barrier();  // the bins are cleared
            } else {
                budget += total * fix_scale;
            }

            // 4. the values: the residual into this lane's elements, the code words into the bins
            [[unroll]] for (uint b = 0u; b < TB; ++b) {
                [[unroll]] for (uint h = 0u; h < MAX_HB; ++h)
                    l_own += unit == h * LPH && h < HB ? p[b][h] : 0.0;  // one lane of each head counts
                if (V_BITS > 0u && ABLATE_RESIDUAL == 0) {
                    float f[E];
                    lane_levels(vw[b], unit, V_BITS, f);
                    float st = uintBitsToFloat(vs[b]);
                    [[unroll]] for (uint e = 0u; e < E; ++e) {
                        float u = f[e] - v_c0;  // (lvl - half) / 2^b, exactly
                        [[unroll]] for (uint h = 0u; h < MAX_HB; ++h)
                            if (h < HB)
                                acc[h][e] += (p[b][h] * st) * u;
                    }
                }
                [[unroll]] for (uint c = 0u; c < VC; ++c) {
                    uint a = code_atom(vc[b][c]);
                    if (live[b] && unit + c * U < V_SPARSITY && a < N_ATOMS) {
                        float coef = code_coef(vc[b][c]) * fix_scale;
                        [[unroll]] for (uint h = 0u; h < MAX_HB; ++h)
                            if (h < HB)
                                if (ABLATE_SCATTER == 0)
                                    atomicAdd(bins_sh[h * N_ATOMS + a], floatBitsToInt(fma(p[b][h], coef, MAGIC)) - 0x4B400000);
                    }
                }
            }
        }

        // the last flush; the weights as floats in the bins (each lane its own)
        barrier();  // every addition is in
        uint rec0 = record(i, vh, pc.n_kv * pc.n_seqs) + blk * HB;
        [[unroll]] for (uint k = 0u; k < NB; ++k) {
            uint x = tid + k * LOCAL;
            if (x < HB * N_ATOMS)
                bins_sh[x] = floatBitsToInt(wf[k] + float(bins_sh[x]) / fix_scale);
        }
        // the V residual: this lane's elements summed over the token lanes, into out_sh. With
        // subgroups the token lanes of a subgroup are summed by shuffles first (all elements at
        // once), leaving a row per subgroup; without, a row per token lane.
        vec4 l4 = vec4(own == 0u ? l_own : 0.0, own == 1u ? l_own : 0.0, own == 2u ? l_own : 0.0,
                       own == 3u ? l_own : 0.0);  // the sums of p by head (one lane per head counts)
#if SUBGROUP
        for (uint w = U; w < gl_SubgroupSize; w <<= 1u) {
            [[unroll]] for (uint h = 0u; h < MAX_HB; ++h)
                [[unroll]] for (uint e = 0u; e < E; ++e)
                    if (h < HB)
                        acc[h][e] += subgroupShuffleXor(acc[h][e], w);
        }
        for (uint w = 1u; w < gl_SubgroupSize; w <<= 1u)
            l4 += vec4(subgroupShuffleXor(l4.x, w), subgroupShuffleXor(l4.y, w), subgroupShuffleXor(l4.z, w),
                       subgroupShuffleXor(l4.w, w));
        const uint rows = gl_NumSubgroups, row = gl_SubgroupID;
        const bool writes = gl_SubgroupInvocationID < U;
#else
        const uint rows = TLANES, row = tlane;
        const bool writes = true;
#endif
        [[unroll]] for (uint e = 0u; e < E; ++e) {
            barrier();
            [[unroll]] for (uint h = 0u; h < MAX_HB; ++h)
                if (h < HB && writes)
                    red_sh[h * LOCAL + row * U + unit] = acc[h][e];
            barrier();
            for (uint x = gl_LocalInvocationID.x; x < HB * U; x += LOCAL) {
                uint h = x / U, un = x - h * U;
                float a = 0.0;
                for (uint r = 0u; r < rows; ++r)
                    a += red_sh[h * LOCAL + r * U + un];
                uint d = un * E + e;
                float rs = V_BITS > 0u ? uintBitsToFloat(cache_words[pc.v_scale_word + g * pc.head_vec + d]) : 0.0;
                out_sh[h * HEAD_DIM + d] = a * rs * float(1u << V_BITS);
            }
        }
        barrier();  // the float weights and out_sh are in
        // the weights times the atoms (quad q4, lane vlane's atoms), then the lanes' sums
        const uint q4 = gl_LocalInvocationID.x % VQ, vlane = gl_LocalInvocationID.x / VQ;
        vec4 part[MAX_HB];
        [[unroll]] for (uint h = 0u; h < MAX_HB; ++h)
            part[h] = vec4(0.0);
        {
            uint atoms = (pc.v_atoms_word + g * pc.head_atoms) / 4u + q4;
            for (uint a0 = vlane; a0 < N_ATOMS; a0 += VLANES * UNROLL) {
                vec4 av[UNROLL];  // UNROLL atoms' quad q4 loaded together
                [[unroll]] for (uint u = 0u; u < UNROLL; ++u)
                    av[u] = uintBitsToFloat(cache_quads[atoms + min(a0 + u * VLANES, N_ATOMS - 1u) * VQ]);
                [[unroll]] for (uint u = 0u; u < UNROLL; ++u) {
                    uint a = a0 + u * VLANES;
                    if (a < N_ATOMS)
                        [[unroll]] for (uint h = 0u; h < MAX_HB; ++h)
                            if (h < HB)
                                part[h] += intBitsToFloat(bins_sh[h * N_ATOMS + a]) * av[u];
                }
            }
        }
        [[unroll]] for (uint k = 0u; k < 4u; ++k) {
            barrier();
            [[unroll]] for (uint h = 0u; h < MAX_HB; ++h)
                if (h < HB)
                    red_sh[h * LOCAL + gl_LocalInvocationID.x] = part[h][k];
            barrier();
            for (uint x = gl_LocalInvocationID.x; x < HB * VQ; x += LOCAL) {
                uint h = x / VQ, q = x - h * VQ;
                float a = out_sh[h * HEAD_DIM + 4u * q + k];
                for (uint ln = 0u; ln < VLANES; ++ln)
                    a += red_sh[h * LOCAL + ln * VQ + q];
                acc_floats[(rec0 + h) * HEAD_DIM + 4u * q + k] = a;  // records are h-major
            }
        }
        // the sums of p (l4: by head, this subgroup's or this lane's)
        barrier();
#if SUBGROUP
        if (gl_SubgroupInvocationID == 0u)
            [[unroll]] for (uint h = 0u; h < MAX_HB; ++h)
                red_sh[h * LOCAL + row] = l4[h];
#else
        [[unroll]] for (uint h = 0u; h < MAX_HB; ++h)
            red_sh[h * LOCAL + tid] = l4[h];
        for (uint width = LOCAL / 2u; width > 0u; width >>= 1u) {
            barrier();
            if (tid < width)
                [[unroll]] for (uint h = 0u; h < MAX_HB; ++h)
                    red_sh[h * LOCAL + tid] += red_sh[h * LOCAL + tid + width];
        }
#endif
        barrier();
        if (gl_LocalInvocationID.x < HB) {
            uint h = gl_LocalInvocationID.x;
            float a = 0.0;
#if SUBGROUP
            for (uint x = 0u; x < rows; ++x)
                a += red_sh[h * LOCAL + x];
#else
            a = red_sh[h * LOCAL];
#endif
            stats[(rec0 + h) * 2u] = m[h];
            stats[(rec0 + h) * 2u + 1u] = a;
        }
        barrier();  // shared memory is reused by the next item
    }
}
