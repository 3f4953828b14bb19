#version 450
// Decode attention, pass 1: one invocation per (KV head g, head block, split i) writes the
// split's stats and accumulators (attend_common.glsl) for its HB query heads.
//
// The dict-coded cache (the table path), never materialising K or V. Each stream is dict-coded
//   (K_CODED / V_CODED, slots of docs/FORMAT.md, sparsity in the push constants) or
//   passthrough (f32 rows).
//   Keys: score = scale * q.k = scale * (q.mean + sum_j c_j * (q.atom[idx_j]) + q.r): q.atom
//     comes from the table attend_table.comp built once per query head (n_atoms dot
//     products), so a key costs `sparsity` lookups; the residual term is
//     step * sum_e (q*residual_scale)[e] * (level_e - half), a dot with the unpacked levels;
//     q.mean is the same for every token of a head, so it cancels in the softmax and is
//     never computed.
//   Values: out = sum_t p_t v_t = mean + sum_a w_a * atom[a] + sum_t p_t * r_t with
//     w_a = sum over (t, j) with idx_j = a of p_t * c_j. Both value paths are exact; we
//     take the atom weights: per-token accumulation costs sparsity * HEAD_DIM atom loads
//     per token (8x the f32 cache's HEAD_DIM at s = 8), the weights one read-modify-write
//     per code word and query head here, plus ONE n_atoms x HEAD_DIM matrix-vector product
//     per query head after the combine (attend_atoms.comp). Core Vulkan 1.1 has no float
//     atomics, so each split owns its weights (its slice of `bins`, which attend_atoms.comp
//     zeroes again after reading it: no races, no clearing pass); they need the split's
//     final maximum, so this pass walks the split twice: scores (kept in a scratch buffer),
//     then probabilities, sums, weights and the residual accumulator.
//
// llvmpipe ends any invocation's loops after 65535 iterations in total (all loops share
// one counter, LP_MAX_TGSI_LOOP_ITERATIONS) — silently. The host therefore caps the tokens
// per split (kvdict_vk.vk.attend.loop_iterations, which counts a loop of n iterations as
// n + 1, as llvmpipe does): about 1 iteration per token here for the f32 cache, 2 + the
// sparsities + 2 for the dict-coded one.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "attend_common.glsl"

layout(constant_id = 4) const uint K_CODED = 0u;  // 0: K is passthrough (f32 rows)
layout(constant_id = 5) const uint K_BITS = 0u;   // residual bits of K (0: none)
layout(constant_id = 6) const uint V_CODED = 0u;
layout(constant_id = 7) const uint V_BITS = 0u;
const uint K_LEVEL_WORDS = SLOT_LEVEL_WORDS_OF(HEAD_DIM, K_BITS);
const uint V_LEVEL_WORDS = SLOT_LEVEL_WORDS_OF(HEAD_DIM, V_BITS);
const uint MAX_LEVEL_WORDS = K_LEVEL_WORDS > V_LEVEL_WORDS ? K_LEVEL_WORDS : V_LEVEL_WORDS;

layout(std430, binding = 0) readonly buffer LayerWords { uint layer_words[]; };
layout(std430, binding = 1) readonly buffer LayerQuads { uvec4 layer_quads[]; };
layout(std430, binding = 2) readonly buffer Query { vec4 q_quads[]; };
layout(std430, binding = 3) writeonly buffer Accs { vec4 accs[]; };
layout(std430, binding = 4) buffer Stats { float stats[]; };
layout(std430, binding = 5) readonly buffer Table { float table[]; };
layout(std430, binding = 6) buffer Bins { float bins[]; };
layout(std430, binding = 7) buffer Scores { float scores[]; };

layout(push_constant) uniform AttendSplitPush {
    uint k_word;        // start of the layer's K region (slots or f32 rows)
    uint v_word;        // start of the V region
    uint n_ctx;
    uint n_used;        // attend over tokens 0 .. n_used-1
    uint split_len;     // tokens per split
    uint n_splits;      // splits per KV head
    uint n_kv;
    uint n_atoms;
    uint k_sparsity;    // code words per slot (dict-coded streams)
    uint v_sparsity;
    uint k_scale_word;  // residual scales of K / V (read only with a residual stage)
    uint v_scale_word;
    uint head_vec;      // words between two KV heads' scales (0: shared dictionary)
    float score_scale;  // softmax temperature, usually 1/sqrt(HEAD_DIM)
} pc;

void load_row(uint word, out vec4 row[Q4]) {  // word: a multiple of 4
    [[unroll]] for (uint c = 0u; c < Q4; ++c)
        row[c] = uintBitsToFloat(layer_quads[(word >> 2u) + c]);
}

// A slot's residual levels minus half, as vec4 quads (the loops are unrolled: element e's
// word and shift are then constants).
void residual_levels(uint word, uint bits, uint level_words, out vec4 d[Q4]) {
    // Bounded by a global constant (NIR does not unroll a loop bounded by a parameter, and
    // on llvmpipe every iteration counts against the 65535-iteration limit).
    uint lw[MAX_LEVEL_WORDS + 1u];
    [[unroll]] for (uint w = 0u; w <= MAX_LEVEL_WORDS; ++w)
        lw[w] = w < level_words ? layer_words[word + w] : 0u;  // then the "next word" of the last level
    float half_ = residual_half(bits);
    [[unroll]] for (uint c = 0u; c < Q4; ++c)
        LEVEL_QUAD(d[c], lw, c, bits, half_)
}

void main() {
    uint items = pc.n_kv * N_HB * pc.n_splits;
    for (uint item = gl_GlobalInvocationID.x; item < items; item += grid_size()) {
        uint unit = item / pc.n_splits;  // (KV head, head block)
        uint i = item - unit * pc.n_splits;
        uint g = unit / N_HB;
        uint hj0 = (unit - g * N_HB) * HB;  // first query head of the block, within the group
        uint t0 = i * pc.split_len;
        uint t1 = min(t0 + pc.split_len, pc.n_used);

        float m[HB], l[HB];
        vec4 acc[BQ], q[BQ], row[Q4];
        [[unroll]] for (uint hj = 0u; hj < HB; ++hj) {
            m[hj] = NEG_INF;
            l[hj] = 0.0;
        }
        [[unroll]] for (uint x = 0u; x < BQ; ++x)
            acc[x] = vec4(0.0);

        uint k_row = K_CODED > 0u ? SLOT_WORDS_OF(pc.k_sparsity, HEAD_DIM, K_BITS) : HEAD_DIM;
        uint v_row = V_CODED > 0u ? SLOT_WORDS_OF(pc.v_sparsity, HEAD_DIM, V_BITS) : HEAD_DIM;
        uint k_base = pc.k_word + g * pc.n_ctx * k_row;
        uint v_base = pc.v_word + g * pc.n_ctx * v_row;
        // --- pass 1: scores and the split's maximum -------------------------------------------
        if (K_CODED == 0u || K_BITS > 0u) {
            // the query heads, times K's residual scale when K has a residual stage
            [[unroll]] for (uint c = 0u; c < Q4; ++c)
                row[c] = vec4(1.0);
            if (K_BITS > 0u)
                load_row(pc.k_scale_word + g * pc.head_vec, row);
            [[unroll]] for (uint x = 0u; x < BQ; ++x)
                q[x] = q_quads[(g * GROUP + hj0) * Q4 + x] * row[x % Q4];
        }
        uint table_row = (g * GROUP + hj0) * pc.n_atoms;
        uint score_row = (g * GROUP + hj0) * pc.n_ctx;
        for (uint t = t0; t < t1; ++t) {
            float s[HB];
            [[unroll]] for (uint hj = 0u; hj < HB; ++hj)
                s[hj] = 0.0;
            if (K_CODED == 0u) {
                load_row(k_base + t * HEAD_DIM, row);
                [[unroll]] for (uint hj = 0u; hj < HB; ++hj)
                    [[unroll]] for (uint c = 0u; c < Q4; ++c)
                        s[hj] += dot(q[hj * Q4 + c], row[c]);
            } else {
                uint slot = k_base + t * k_row;
                // Code words two at a time: half the loop iterations (llvmpipe's loop limit,
                // loop overhead); the second of an odd last pair is skipped.
                [[dont_unroll]] for (uint j = 0u; j < pc.k_sparsity; j += 2u) {
                    [[unroll]] for (uint u = 0u; u < 2u; ++u) {
                        if (j + u < pc.k_sparsity) {
                            uint w = layer_words[slot + j + u];
                            uint atom = code_atom(w);
                            if (atom < pc.n_atoms) {  // an out-of-range index contributes zero
                                float c = code_coef(w);
                                [[unroll]] for (uint hj = 0u; hj < HB; ++hj)
                                    s[hj] += c * table[table_row + hj * pc.n_atoms + atom];
                            }
                        }
                    }
                }
                if (K_BITS > 0u) {
                    float step_ = uintBitsToFloat(layer_words[slot + pc.k_sparsity + K_LEVEL_WORDS]);
                    residual_levels(slot + pc.k_sparsity, K_BITS, K_LEVEL_WORDS, row);
                    [[unroll]] for (uint hj = 0u; hj < HB; ++hj) {
                        float r = 0.0;
                        [[unroll]] for (uint c = 0u; c < Q4; ++c)
                            r += dot(q[hj * Q4 + c], row[c]);
                        s[hj] += step_ * r;
                    }
                }
            }
            [[unroll]] for (uint hj = 0u; hj < HB; ++hj) {
                float sc = s[hj] * pc.score_scale;
                scores[score_row + hj * pc.n_ctx + t] = sc;
                m[hj] = max(m[hj], sc);
            }
        }

        // --- pass 2: probabilities, sums, values ---------------------------------------------
        uint bin_row = (record(i, g, pc.n_kv) + hj0) * pc.n_atoms;  // zero on entry
        for (uint t = t0; t < t1; ++t) {
            float p[HB];
            [[unroll]] for (uint hj = 0u; hj < HB; ++hj) {
                p[hj] = exp(scores[score_row + hj * pc.n_ctx + t] - m[hj]);
                l[hj] += p[hj];
            }
            if (V_CODED == 0u) {
                load_row(v_base + t * HEAD_DIM, row);
                [[unroll]] for (uint hj = 0u; hj < HB; ++hj)
                    [[unroll]] for (uint c = 0u; c < Q4; ++c)
                        acc[hj * Q4 + c] += p[hj] * row[c];
            } else {
                uint slot = v_base + t * v_row;
                [[dont_unroll]] for (uint j = 0u; j < pc.v_sparsity; j += 2u) {
                    [[unroll]] for (uint u = 0u; u < 2u; ++u) {
                        if (j + u < pc.v_sparsity) {
                            uint w = layer_words[slot + j + u];
                            uint atom = code_atom(w);
                            if (atom < pc.n_atoms) {
                                float c = code_coef(w);
                                [[unroll]] for (uint hj = 0u; hj < HB; ++hj)
                                    bins[bin_row + hj * pc.n_atoms + atom] += p[hj] * c;
                            }
                        }
                    }
                }
                if (V_BITS > 0u) {
                    float step_ = uintBitsToFloat(layer_words[slot + pc.v_sparsity + V_LEVEL_WORDS]);
                    residual_levels(slot + pc.v_sparsity, V_BITS, V_LEVEL_WORDS, row);
                    [[unroll]] for (uint hj = 0u; hj < HB; ++hj)
                        [[unroll]] for (uint c = 0u; c < Q4; ++c)
                            acc[hj * Q4 + c] += (p[hj] * step_) * row[c];
                }
            }
        }
        if (V_BITS > 0u) {  // the residual scale is per channel: applied once, not per token
            load_row(pc.v_scale_word + g * pc.head_vec, row);
            [[unroll]] for (uint x = 0u; x < BQ; ++x)
                acc[x] *= row[x % Q4];
        }
        STORE_RECORDS(record(i, g, pc.n_kv) + hj0, m, l, acc);
    }
}
