#version 450
// Decode attention straight over dict-coded slots (docs/FORMAT.md), shaped for GPUs: one
// workgroup per (split i, KV head g, block of HB query heads) attends over the split's
// tokens without decoding a key or a value; attend_merge_head.comp combines the splits' records
// (and adds the V mean). Both streams dict-coded, each with or without a residual stage.
//   keys:   score = scale * (sum_j c_j T[h, idx_j] + step * sum_e (q*rscale_k)[h, e] * (lvl_e - half))
//           with T = q . atom from attend_table.comp (run once per step), kept in shared
//           memory for the block's heads; q . mean_k is the same for every token (cancels);
//   values: out = mean_v + sum_a w[h, a] atom[a] + rscale_v * sum_t p_t step_t (lvl_t - half)
//           with the per-atom weights w[h, a] = sum over code words selecting a of p_t c_j
//           accumulated in shared memory — a compare-and-swap loop on the float's bits
//           (core Vulkan has no float atomics) — and multiplied by the atoms once at the end.
//
// Lanes across a slot: a token is served by TL = HEAD_DIM / 8 neighbouring invocations, lane u
// owning elements 8u .. 8u+7 — their levels (one 64-bit window of the slot's level words),
// its part of the residual dot products and of the V residual sums — and code words u,
// u + TL, …: a K code word's table lookups, a V code word's additions to the weights. So a
// slot is one coalesced run of loads, a token's code words are handled side by side, and
// the TL partial scores are summed across the token's lanes by subgroup shuffles (SUBGROUP
// 1, the attend_flash_coded_sg variant, where the device has them and its subgroups hold a
// token's lanes: host-checked) or through shared memory (SUBGROUP 0: no optional feature).
// LOCAL / TL tokens are in flight per workgroup, TB per invocation, the next round's slot
// words loaded while this round computes.
// The softmax reference m is the workgroup's (the atom weights mix every token): it moves
// only when a score exceeds it by more than GROW_MARGIN (flag, then a workgroup maximum — the
// first round and rarely after), so probabilities stay ≤ e^GROW_MARGIN, each invocation sums
// its own, and the record's (m, l) are exact for any reference (the merge rescales).
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

layout(constant_id = 4) const uint K_BITS = 0u;   // residual bits of K (0: atoms only)
layout(constant_id = 5) const uint V_BITS = 0u;
layout(constant_id = 6) const uint N_ATOMS = 1024u;  // atoms per dictionary head (shared memory)
layout(constant_id = 7) const uint K_SPARSITY = 4u;  // code words per K slot
layout(constant_id = 8) const uint V_SPARSITY = 4u;
const uint LOCAL = gl_WorkGroupSize.x;  // a multiple of TL (host)
const uint E = 8u;                   // elements per lane
const uint TL = HEAD_DIM / E;        // lanes per token (HEAD_DIM % 8 == 0, host)
const uint TLANES = LOCAL / TL;      // tokens in flight per workgroup
const uint TB = 2u;                  // tokens per invocation per round
const uint K_LEVEL_WORDS = SLOT_LEVEL_WORDS_OF(HEAD_DIM, K_BITS);
const uint V_LEVEL_WORDS = SLOT_LEVEL_WORDS_OF(HEAD_DIM, V_BITS);
const uint K_ROW = SLOT_WORDS_OF(K_SPARSITY, HEAD_DIM, K_BITS);  // words of a slot
const uint V_ROW = SLOT_WORDS_OF(V_SPARSITY, HEAD_DIM, V_BITS);
const uint K_CODES = (K_SPARSITY + TL - 1u) / TL;  // code words per lane (the last lanes may have fewer)
const uint V_CODES = (V_SPARSITY + TL - 1u) / TL;
const uint UNROLL = 8u;              // atom rows loaded together at the end (latency)
const uint TABLE_ROUNDS = (HB * N_ATOMS + LOCAL - 1u) / LOCAL;  // table words per invocation
const float GROW_MARGIN = 8.0;       // probabilities stay ≤ e^8 between rescales

// A lane's level words: its E levels start at bit 8u·b of the level words, at a multiple of 8
// bits within a word (8u·b is a multiple of 8), so they span at most (8b + 24 + 31) / 32
// words, at most 3; 8b a multiple of 32: exactly 8b / 32.
#define LANE_WORDS_OF(BITS) ((BITS) == 0u ? 0u : ((8u * (BITS)) % 32u == 0u ? (8u * (BITS)) / 32u : (8u * (BITS) + 55u) / 32u))
const uint K_LANE_WORDS = LANE_WORDS_OF(K_BITS);
const uint V_LANE_WORDS = LANE_WORDS_OF(V_BITS);

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
    float score_scale;
} pc;

shared float tab_sh[HB * N_ATOMS];
shared uint bins_sh[HB * N_ATOMS];  // float bits: the per-atom value weights
shared float red_sh[HB * LOCAL];    // partial scores (SUBGROUP 0); reductions; the end's sums
shared uint grow_sh[3];             // a round's "the reference must move" flag, three in rotation

uint lane_index() {  // with subgroups counted through them: a token's lanes share one
#if SUBGROUP
    return gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;
#else
    return gl_LocalInvocationID.x;
#endif
}

void bin_add(uint idx, float v) {
    uint seen = bins_sh[idx];
    for (;;) {
        uint want = floatBitsToUint(uintBitsToFloat(seen) + v);
        uint was = atomicCompSwap(bins_sh[idx], seen, want);
        if (was == seen)
            break;
        seen = was;
    }
}

void reduce(uint tid, bool take_max) {  // red_sh[h*LOCAL + x] over x → red_sh[h*LOCAL]
    for (uint width = LOCAL / 2u; width > 0u; width >>= 1u) {
        barrier();
        if (tid < width)
            for (uint h = 0u; h < HB; ++h) {
                float a = red_sh[h * LOCAL + tid], b = red_sh[h * LOCAL + tid + width];
                red_sh[h * LOCAL + tid] = take_max ? max(a, b) : a + b;
            }
    }
    barrier();
}

// The E centred levels (level - half, as floats) of a lane whose levels start `off` bits
// (a multiple of 8) into w[0]: a 64-bit window (hi:lo) made once, each level at a constant
// shift of it. Levels become floats through the mantissa of 2^22 (slot.glsl centred_level).
void lane_levels(uint w[3], uint off, uint bits, out float lv[E]) {
    uint lo = off == 0u ? w[0] : (w[0] >> off) | (w[1] << (32u - off));
    uint hi = off == 0u ? w[1] : (w[1] >> off) | (w[2] << (32u - off));
    uint mask = (1u << bits) - 1u;
    [[unroll]] for (uint e = 0u; e < E; ++e) {
        uint p = e * bits, level;
        if (p + bits <= 32u)
            level = lo >> p;
        else if (p >= 32u)
            level = hi >> (p - 32u);
        else
            level = (lo >> p) | (hi << (32u - p));
        lv[e] = centred_level(level & mask, bits);
    }
}

void main() {
    const uint tid = lane_index();
    const uint u = tid % TL, tlane = tid / TL;
    // this lane's level words: the first, and the bit where its levels start in it
    const uint k_w0 = (u * E * K_BITS) >> 5u, k_off = (u * E * K_BITS) & 31u;
    const uint v_w0 = (u * E * V_BITS) >> 5u, v_off = (u * E * V_BITS) & 31u;
    uint items = pc.n_splits * pc.n_kv * N_HB;
    uint round = 0u;  // rounds done by this workgroup (the grow flags' rotation)
    if (tid < 3u)
        grow_sh[tid] = 0u;
    for (uint item = gl_WorkGroupID.x; item < items; item += gl_NumWorkGroups.x) {
        uint blk = item % N_HB;
        uint g = (item / N_HB) % pc.n_kv;
        uint i = item / (N_HB * pc.n_kv);
        uint h0 = g * GROUP + blk * HB;  // first query head of the block
        uint t0 = i * pc.split_len;
        uint n_tok = t0 < pc.n_used ? min(t0 + pc.split_len, pc.n_used) - t0 : 0u;  // 0: an empty split

        [[unroll]] for (uint r = 0u; r < TABLE_ROUNDS; ++r) {  // loads in flight together
            uint x = tid + r * LOCAL;
            if (x < HB * N_ATOMS) {
                tab_sh[x] = table[h0 * N_ATOMS + x] * pc.score_scale;  // rows h0 .. h0+HB-1
                bins_sh[x] = 0u;
            }
        }
        float qs[HB][E];  // the lane's elements of scale * q * K's residual scale
        [[unroll]] for (uint h = 0u; h < HB; ++h)
            [[unroll]] for (uint e = 0u; e < E; ++e) {
                uint f = u * E + e;
                qs[h][e] = K_BITS > 0u ? q_floats[(h0 + h) * HEAD_DIM + f] * pc.score_scale
                                         * uintBitsToFloat(cache_words[pc.k_scale_word + g * pc.head_vec + f]) : 0.0;
            }
        float m[HB], l[HB];  // the reference (uniform) and this invocation's sum of p
        float res[HB][E];    // the lane's elements of sum_t p_t step_t (lvl - half), V
        [[unroll]] for (uint h = 0u; h < HB; ++h) {
            m[h] = NEG_INF;
            l[h] = 0.0;
            [[unroll]] for (uint e = 0u; e < E; ++e)
                res[h][e] = 0.0;
        }

        uint k_base = pc.k_word + (g * pc.n_ctx + t0) * K_ROW;
        uint v_base = pc.v_word + (g * pc.n_ctx + t0) * V_ROW;
        // a token's words this lane reads: its code words, its level words, the step
        uint kc[TB][K_CODES], vc[TB][V_CODES], kl[TB][3], vl[TB][3];
        float kstep[TB], vstep[TB];
        // The slot words of this lane's TB tokens of the round starting at split token `first`
        // (past the split's end: its last token, unused).
#define LOAD_ROUND(first) \
        [[unroll]] for (uint b = 0u; b < TB; ++b) { \
            uint kb = k_base + min((first) + tlane + b * TLANES, n_tok - 1u) * K_ROW; \
            uint vb = v_base + min((first) + tlane + b * TLANES, n_tok - 1u) * V_ROW; \
            [[unroll]] for (uint j = 0u; j < K_CODES; ++j) \
                kc[b][j] = cache_words[kb + min(u + j * TL, K_SPARSITY - 1u)]; \
            [[unroll]] for (uint j = 0u; j < V_CODES; ++j) \
                vc[b][j] = cache_words[vb + min(u + j * TL, V_SPARSITY - 1u)]; \
            [[unroll]] for (uint w = 0u; w < 3u; ++w) { \
                kl[b][w] = w < K_LANE_WORDS ? cache_words[kb + K_SPARSITY + min(k_w0 + w, K_LEVEL_WORDS - 1u)] : 0u; \
                vl[b][w] = w < V_LANE_WORDS ? cache_words[vb + V_SPARSITY + min(v_w0 + w, V_LEVEL_WORDS - 1u)] : 0u; \
            } \
            kstep[b] = K_BITS > 0u ? uintBitsToFloat(cache_words[kb + K_SPARSITY + K_LEVEL_WORDS]) : 0.0; \
            vstep[b] = V_BITS > 0u ? uintBitsToFloat(cache_words[vb + V_SPARSITY + V_LEVEL_WORDS]) : 0.0; \
        }
        if (n_tok > 0u)
            LOAD_ROUND(0u);
        barrier();  // the table, the zeroed weights and the grow flags are in shared memory

        for (uint r0 = 0u; r0 < n_tok; r0 += TLANES * TB, ++round) {  // the same trip count everywhere
            uint ckc[TB][K_CODES], cvc[TB][V_CODES], ckl[TB][3], cvl[TB][3];  // this round's words
            float cks[TB], cvs[TB];
            [[unroll]] for (uint b = 0u; b < TB; ++b) {  // element by element: the arrays are
                [[unroll]] for (uint j = 0u; j < K_CODES; ++j)  // sized by specialization constants
                    ckc[b][j] = kc[b][j];
                [[unroll]] for (uint j = 0u; j < V_CODES; ++j)
                    cvc[b][j] = vc[b][j];
                [[unroll]] for (uint w = 0u; w < 3u; ++w) {
                    ckl[b][w] = kl[b][w];
                    cvl[b][w] = vl[b][w];
                }
                cks[b] = kstep[b];
                cvs[b] = vstep[b];
            }
            if (r0 + TLANES * TB < n_tok)  // the next round's, in flight while this one computes
                LOAD_ROUND(r0 + TLANES * TB);

            // 1. scores: the lane's code words' table lookups and residual part, summed over
            //    the token's lanes
            float s[TB][HB];
            bool grow = false;
            [[unroll]] for (uint b = 0u; b < TB; ++b) {
                [[unroll]] for (uint h = 0u; h < HB; ++h)
                    s[b][h] = 0.0;
                [[unroll]] for (uint j = 0u; j < K_CODES; ++j) {
                    uint a = code_atom(ckc[b][j]);
                    if (u + j * TL < K_SPARSITY && a < N_ATOMS) {
                        float c = code_coef(ckc[b][j]);
                        [[unroll]] for (uint h = 0u; h < HB; ++h)
                            s[b][h] += c * tab_sh[h * N_ATOMS + a];
                    }
                }
                if (K_BITS > 0u) {
                    float lv[E];
                    lane_levels(ckl[b], k_off, K_BITS, lv);
                    [[unroll]] for (uint h = 0u; h < HB; ++h) {
                        float r = 0.0;
                        [[unroll]] for (uint e = 0u; e < E; ++e)
                            r += qs[h][e] * lv[e];
                        s[b][h] += cks[b] * r;
                    }
                }
#if SUBGROUP
                [[unroll]] for (uint h = 0u; h < HB; ++h)
                    for (uint w = 1u; w < TL; w <<= 1u)
                        s[b][h] += subgroupShuffleXor(s[b][h], w);
#else
                barrier();  // the last token's partials are read
                [[unroll]] for (uint h = 0u; h < HB; ++h)
                    red_sh[h * LOCAL + tid] = s[b][h];
                barrier();
                [[unroll]] for (uint h = 0u; h < HB; ++h) {
                    float a = 0.0;
                    for (uint x = 0u; x < TL; ++x)
                        a += red_sh[h * LOCAL + tlane * TL + x];
                    s[b][h] = a;
                }
#endif
                bool live = r0 + tlane + b * TLANES < n_tok;
                [[unroll]] for (uint h = 0u; h < HB; ++h) {
                    s[b][h] = live ? s[b][h] : NEG_INF;
                    grow = grow || s[b][h] > m[h] + GROW_MARGIN;
                }
            }
            // 2. a score far above the reference: the round's maximum becomes it (uniform
            //    branch). The flag of round r is set before this barrier, read after it, and
            //    cleared in round r + 1 — after every invocation has read it, and a barrier
            //    before anyone sets it again in round r + 3.
            uint flag = round % 3u;
            if (grow)
                grow_sh[flag] = 1u;
            barrier();  // also: every weight of the last round is added before any rescale
            if (tid == 0u)
                grow_sh[(round + 2u) % 3u] = 0u;  // round r - 1's flag (read by all before this barrier)
            if (grow_sh[flag] != 0u) {
                [[unroll]] for (uint h = 0u; h < HB; ++h) {
                    float mx = NEG_INF;
                    [[unroll]] for (uint b = 0u; b < TB; ++b)
                        mx = max(mx, s[b][h]);
                    red_sh[h * LOCAL + tid] = mx;
                }
                reduce(tid, true);
                [[unroll]] for (uint h = 0u; h < HB; ++h) {
                    float m_new = max(m[h], red_sh[h * LOCAL]);
                    float corr = exp(m[h] - m_new);  // 0 on the first round (m = -inf)
                    m[h] = m_new;
                    l[h] *= corr;
                    [[unroll]] for (uint e = 0u; e < E; ++e)
                        res[h][e] *= corr;
                    for (uint a = tid; a < N_ATOMS; a += LOCAL)
                        bins_sh[h * N_ATOMS + a] = floatBitsToUint(uintBitsToFloat(bins_sh[h * N_ATOMS + a]) * corr);
                }
                barrier();  // all have read the maximum and rescaled the weights
            }
            // 3. probabilities; the values' code words → the atom weights; the lane's residual sums
            [[unroll]] for (uint b = 0u; b < TB; ++b) {
                float p[HB];
                [[unroll]] for (uint h = 0u; h < HB; ++h) {
                    p[h] = exp(s[b][h] - m[h]);  // 0 past the split's end
                    l[h] += u == 0u ? p[h] : 0.0;  // a token's p counted once
                }
                if (r0 + tlane + b * TLANES < n_tok) {
                    // a code word's HB additions tried together (independent shared-memory round
                    // trips); one that lost a race (another invocation's addition to the same
                    // weight) retries
                    [[unroll]] for (uint j = 0u; j < V_CODES; ++j) {
                        uint a = code_atom(cvc[b][j]);
                        if (u + j * TL < V_SPARSITY && a < N_ATOMS) {
                            float c = code_coef(cvc[b][j]);
                            uint seen[HB], was[HB];
                            [[unroll]] for (uint h = 0u; h < HB; ++h)
                                seen[h] = bins_sh[h * N_ATOMS + a];
                            [[unroll]] for (uint h = 0u; h < HB; ++h)
                                was[h] = atomicCompSwap(bins_sh[h * N_ATOMS + a], seen[h],
                                                        floatBitsToUint(uintBitsToFloat(seen[h]) + p[h] * c));
                            [[unroll]] for (uint h = 0u; h < HB; ++h)
                                if (was[h] != seen[h])
                                    bin_add(h * N_ATOMS + a, p[h] * c);
                        }
                    }
                    if (V_BITS > 0u) {
                        float lv[E];
                        lane_levels(cvl[b], v_off, V_BITS, lv);
                        [[unroll]] for (uint h = 0u; h < HB; ++h) {
                            float ps = p[h] * cvs[b];
                            [[unroll]] for (uint e = 0u; e < E; ++e)
                                res[h][e] += ps * lv[e];
                        }
                    }
                }
            }
        }
        barrier();  // every weight is added

        // the weights times the atoms (the lane's elements of atoms tlane, tlane + TLANES, …)
        // plus the residual part, then the token lanes' sums through shared memory, one
        // element of the lane's E at a time
        float part[HB][E];
        [[unroll]] for (uint h = 0u; h < HB; ++h)
            [[unroll]] for (uint e = 0u; e < E; ++e)
                part[h][e] = 0.0;
        {
            uint atoms = (pc.v_atoms_word + g * pc.head_atoms) / 4u + 2u * u;  // the lane's first quad
            for (uint a0 = tlane; a0 < N_ATOMS; a0 += TLANES * UNROLL) {
                vec4 av[UNROLL][2];  // UNROLL atoms' 8 elements loaded together
                [[unroll]] for (uint x = 0u; x < UNROLL; ++x) {
                    uint a = min(a0 + x * TLANES, N_ATOMS - 1u);
                    av[x][0] = uintBitsToFloat(cache_quads[atoms + a * (HEAD_DIM / 4u)]);
                    av[x][1] = uintBitsToFloat(cache_quads[atoms + a * (HEAD_DIM / 4u) + 1u]);
                }
                [[unroll]] for (uint x = 0u; x < UNROLL; ++x) {
                    uint a = a0 + x * TLANES;
                    if (a < N_ATOMS)
                        [[unroll]] for (uint h = 0u; h < HB; ++h) {
                            float w = uintBitsToFloat(bins_sh[h * N_ATOMS + a]);
                            [[unroll]] for (uint e = 0u; e < E; ++e)
                                part[h][e] += w * av[x][e / 4u][e % 4u];
                        }
                }
            }
            if (V_BITS > 0u)
                [[unroll]] for (uint e = 0u; e < E; ++e) {
                    float rs = uintBitsToFloat(cache_words[pc.v_scale_word + g * pc.head_vec + u * E + e]);
                    [[unroll]] for (uint h = 0u; h < HB; ++h)
                        part[h][e] += res[h][e] * rs;
                }
        }
        uint rec0 = record(i, g, pc.n_kv) + blk * HB;
        [[unroll]] for (uint e = 0u; e < E; ++e) {
            barrier();
            [[unroll]] for (uint h = 0u; h < HB; ++h)
                red_sh[h * LOCAL + tid] = part[h][e];
            barrier();
            for (uint x = tid; x < HB * TL; x += LOCAL) {
                uint h = x / TL, un = x - h * TL;
                float a = 0.0;
                for (uint ln = 0u; ln < TLANES; ++ln)
                    a += red_sh[h * LOCAL + ln * TL + un];
                acc_floats[(rec0 + h) * HEAD_DIM + un * E + e] = a;  // records are h-major
            }
        }
        // the invocations' sums of p
        barrier();
        [[unroll]] for (uint h = 0u; h < HB; ++h)
            red_sh[h * LOCAL + tid] = l[h];
        reduce(tid, false);
        [[unroll]] for (uint h = 0u; h < HB; ++h)
            if (tid == h) {
                stats[(rec0 + h) * 2u] = m[h];
                stats[(rec0 + h) * 2u + 1u] = red_sh[h * LOCAL];
            }
        barrier();  // shared memory is reused by the next item
    }
}
