#version 450
// Decode attention, the direct path: one invocation per (KV head g, head block, split i)
// decodes each cached key and value it attends over — exactly — and runs the online softmax
// in one pass (running maximum, accumulator rescaled when it grows):
//   score_t = scale * q . (sum_j c_j atoms[g', idx_j] + r_t)      (K dict-coded)
//   acc    += p_t * (sum_j c_j atoms[g', idx_j] + r_t)             (V dict-coded)
// with r_t the residual stage (levels - half) * step * residual_scale[g'] when the stream
// has one; a passthrough stream (K_SPARSITY / V_SPARSITY 0, and the f16/f32 caches) reads its
// rows (f16 or f32: ROW_HALF). The means are left out: q . mean_k is the same for every token of a head (it cancels
// in the softmax) and mean_v is added once at the end (probabilities sum to one).
//
// Why a second path next to the table one (attend_table/split/atoms.comp): that one reads
// every atom twice per query (the q . atom table, the weights x atoms product) — n_atoms x
// HEAD_DIM words per head block and stream whatever the context — while this one reads
// sparsity x HEAD_DIM atom words per token and stream. Below a few hundred tokens that is
// far less; kvdict_vk.vk.attend_plan picks the path by the words each would load.
//
// Keys coded before RoPE (K_ROPE, kvdict_vk.rope): a decoded key plus its mean (which no longer
// cancels) is turned to its token's position by the layer's rotation table (rope.glsl).
//
// A windowed dictionary layer (kvdict_vk.window): the cached tokens the exact window holds are
// skipped here and attended by attend_window.comp (one more record, merged with these).
//
// Two sources of tokens, so a decode step can attend over the token it appends in the same
// submission without a barrier on the layer buffer (Kompute records none for storage
// buffers): tokens t < n_cached come from the cache (the layer's regions, or f32 rows of
// another buffer), tokens n_cached <= t < n_used from the fresh rows in the upload buffer
// (the slots the step's scatter is copying into the layer at the same time — it writes only
// tokens >= n_cached, which nothing here reads from the layer). The loop body is one
// function called with a constant `fresh`, so after inlining each copy loads from one buffer.
//
// Output: the split's record (stats m, l and the accumulator, attend_common.glsl) at split
// index split0 + i, merged by attend_merge.comp (or attend_combine/atoms/reduce when these
// are the fresh tokens of a table-path step); or, when write_out is set (one split covers
// every token), the attention output itself: mean_v + acc / l.
//
// llvmpipe ends an invocation's loops after 65535 iterations in total: per token the token
// loop, each dict-coded stream's code-word loop (sparsity + 1) — the host caps split_len
// (attend_plan.direct_loop_iterations).
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "attend_common.glsl"
#include "window.glsl"
#include "rope.glsl"

layout(constant_id = 4) const uint K_SPARSITY = 0u;  // code words per K slot (0: f32 rows)
layout(constant_id = 5) const uint K_BITS = 0u;      // residual bits of K (0: none)
layout(constant_id = 6) const uint V_SPARSITY = 0u;
layout(constant_id = 7) const uint V_BITS = 0u;
// Passthrough rows as f16 (the default uncoded cache: two halves per word, element 2k in the
// low half, unpackHalf2x16 — no 16-bit storage feature needed) or f32. Needs HEAD_DIM % 8 == 0.
layout(constant_id = 8) const uint ROW_HALF = 0u;
layout(constant_id = 9) const bool ATOMS_F16 = false;  // the atoms in binary16 (atoms.glsl)
layout(constant_id = 10) const bool K_ROPE = false;    // keys coded before RoPE (K dict-coded)
#include "atoms.glsl"
const uint PASS_ROW = ROW_HALF > 0u ? HEAD_DIM / 2u : HEAD_DIM;
const uint K_LEVEL_WORDS = SLOT_LEVEL_WORDS_OF(HEAD_DIM, K_BITS);
const uint V_LEVEL_WORDS = SLOT_LEVEL_WORDS_OF(HEAD_DIM, V_BITS);
const uint K_ROW = K_SPARSITY > 0u ? SLOT_WORDS_OF(K_SPARSITY, HEAD_DIM, K_BITS) : PASS_ROW;
const uint V_ROW = V_SPARSITY > 0u ? SLOT_WORDS_OF(V_SPARSITY, HEAD_DIM, V_BITS) : PASS_ROW;
const uint MAX_LEVEL_WORDS = K_LEVEL_WORDS > V_LEVEL_WORDS ? K_LEVEL_WORDS : V_LEVEL_WORDS;

layout(std430, binding = 0) readonly buffer CacheWords { uint cache_words[]; };
layout(std430, binding = 1) readonly buffer CacheQuads { uvec4 cache_quads[]; };  // + atoms, scales, mean
layout(std430, binding = 2) readonly buffer FreshWords { uint fresh_words[]; };
layout(std430, binding = 3) readonly buffer FreshQuads { uvec4 fresh_quads[]; };
layout(std430, binding = 4) readonly buffer Query { vec4 q_quads[]; };
layout(std430, binding = 5) writeonly buffer Accs { vec4 accs[]; };
layout(std430, binding = 6) writeonly buffer Stats { float stats[]; };
layout(std430, binding = 7) writeonly buffer Out { vec4 out_quads[]; };

layout(push_constant) uniform AttendDirectPush {
    uint k_word;        // the cache's K region (slots or f32 rows), n_ctx tokens per KV head
    uint v_word;
    uint n_ctx;
    uint fresh_k_word;  // the fresh tokens' K rows in the upload buffer, n_used - n_cached per head
    uint fresh_v_word;
    uint t_first;       // this dispatch attends over tokens t_first .. n_used-1
    uint n_used;
    uint n_cached;      // tokens below come from the cache, the rest are fresh
    uint split_len;
    uint n_splits;      // splits of this dispatch (per KV head and head block)
    uint split0;        // record index of its first split
    uint n_kv;
    uint n_atoms;
    uint k_atoms_word;  // atoms blocks (multiples of 4), KV head h's at + h*head_atoms
    uint v_atoms_word;
    uint head_atoms;    // 0: one dictionary shared by the KV heads
    uint k_scale_word;  // residual scales (read only with a residual stage)
    uint v_scale_word;
    uint head_vec;      // words between two KV heads' scales / means (0: shared)
    uint write_out;     // 1: one split covers every token: write the output, not a record
    uint use_mean;      // (write_out) add the V dictionary's mean
    uint mean_word;
    uint k_mean_word;   // (K_ROPE) the K dictionary's mean, and the rotation table (rope.glsl)
    uint rope_word;
    uint rope_hi;
    uint rope_shift;
    uint win_sink;      // a windowed layer (window.glsl): only tokens [win_sink, coded_end) from here
    uint win_recent;
    uint state_word;    // (windowed) the layer's token count
    float score_scale;
} pc;

// The invocation's state, private (indexed by unrolled-loop constants only).
vec4 q[BQ], acc[BQ];
float m[HB], l[HB];
vec4 k_scale[Q4], v_scale[Q4];
vec4 k_mean[Q4];  // K_ROPE only

// Branches, not selects: each load sits under its own (constant, once inlined) condition, so
// no driver ever evaluates an index against the other buffer.
uint slot_word(bool fresh, uint w) {
    if (fresh)
        return fresh_words[w];
    return cache_words[w];
}
vec4 row_quad(bool fresh, uint x) {
    if (fresh)
        return uintBitsToFloat(fresh_quads[x]);
    return uintBitsToFloat(cache_quads[x]);
}

// The head vector stored at `slot` (first word) minus its mean: f32 rows as stored, a slot as
// sum_j c_j atom idx_j (atoms.glsl, the head's atoms at atoms_word) + the residual times `scale`
// (a K_ROPE key's mean and turn are attend_token's).
void decode_row(bool fresh, uint slot, uint sparsity, uint bits, uint level_words, uint atoms_word,
                vec4 scale[Q4], out vec4 row[Q4]) {
    if (sparsity == 0u && ROW_HALF > 0u) {
        [[unroll]] for (uint c = 0u; c < Q4; c += 2u) {  // a quad of words is 8 halves
            uvec4 w = floatBitsToUint(row_quad(fresh, (slot >> 2u) + c / 2u));
            row[c] = vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y));
            if (c + 1u < Q4)
                row[c + 1u] = vec4(unpackHalf2x16(w.z), unpackHalf2x16(w.w));
        }
        return;
    }
    if (sparsity == 0u) {
        [[unroll]] for (uint c = 0u; c < Q4; ++c)
            row[c] = row_quad(fresh, (slot >> 2u) + c);
        return;
    }
    [[unroll]] for (uint c = 0u; c < Q4; ++c)
        row[c] = vec4(0.0);
    [[dont_unroll]] for (uint j = 0u; j < sparsity; ++j) {
        uint w = slot_word(fresh, slot + j);
        // an out-of-range index reads atom 0 with coefficient 0 (common.glsl)
        uint atom = safe_atom(code_atom(w), pc.n_atoms);
        float cf = safe_coef(code_atom(w), pc.n_atoms, code_coef(w));
        vec4 av[Q4];
        LOAD_ATOM(cache_quads, atoms_word >> 2u, atom, av)
        [[unroll]] for (uint c = 0u; c < Q4; ++c)
            row[c] += cf * av[c];
    }
    if (bits > 0u) {
        uint lw[MAX_LEVEL_WORDS + 1u];  // the levels, then a zero "next word" for the last one
        [[unroll]] for (uint w = 0u; w <= MAX_LEVEL_WORDS; ++w)
            lw[w] = w < level_words ? slot_word(fresh, slot + sparsity + w) : 0u;
        float step_ = uintBitsToFloat(slot_word(fresh, slot + sparsity + level_words));
        float half_ = residual_half(bits);
        [[unroll]] for (uint c = 0u; c < Q4; ++c) {
            vec4 d;
            LEVEL_QUAD(d, lw, c, bits, half_)
            row[c] += (step_ * d) * scale[c];
        }
    }
}

// One token, at position t: its key's scores for the HB query heads, the online softmax, its value.
void attend_token(bool fresh, uint k_slot, uint v_slot, uint g, uint t) {
    vec4 row[Q4];
    decode_row(fresh, k_slot, K_SPARSITY, K_BITS, K_LEVEL_WORDS, pc.k_atoms_word + g * pc.head_atoms, k_scale, row);
    if (K_ROPE) {
        [[unroll]] for (uint c = 0u; c < Q4; ++c) {
            uvec2 at = (pc.rope_word >> 2u) + rope_quads(t, c, pc.rope_hi, pc.rope_shift, Q4);
            row[c] = rope_turn(row[c] + k_mean[c], uintBitsToFloat(cache_quads[at.x]),
                               uintBitsToFloat(cache_quads[at.y]));
        }
    }
    float p[HB], corr[HB];
    [[unroll]] for (uint hj = 0u; hj < HB; ++hj) {
        float s = 0.0;
        [[unroll]] for (uint c = 0u; c < Q4; ++c)
            s += dot(q[hj * Q4 + c], row[c]);
        s *= pc.score_scale;
        float m_new = max(m[hj], s);
        corr[hj] = exp(m[hj] - m_new);  // 0 for the first token (m = -inf)
        p[hj] = exp(s - m_new);
        l[hj] = l[hj] * corr[hj] + p[hj];
        m[hj] = m_new;
    }
    decode_row(fresh, v_slot, V_SPARSITY, V_BITS, V_LEVEL_WORDS, pc.v_atoms_word + g * pc.head_atoms, v_scale, row);
    [[unroll]] for (uint hj = 0u; hj < HB; ++hj)
        [[unroll]] for (uint c = 0u; c < Q4; ++c)
            acc[hj * Q4 + c] = acc[hj * Q4 + c] * corr[hj] + p[hj] * row[c];
}

void main() {
    uint items = pc.n_kv * N_HB * pc.n_splits;
    uint n_fresh = pc.n_used - pc.n_cached;
    for (uint item = gl_GlobalInvocationID.x; item < items; item += grid_size()) {
        uint unit = item / pc.n_splits;  // (KV head, head block)
        uint i = item - unit * pc.n_splits;
        uint g = unit / N_HB;
        uint hj0 = (unit - g * N_HB) * HB;  // first query head of the block, within the group
        uint t0 = pc.t_first + i * pc.split_len;
        uint t1 = min(t0 + pc.split_len, pc.n_used);

        [[unroll]] for (uint hj = 0u; hj < HB; ++hj) {
            m[hj] = NEG_INF;
            l[hj] = 0.0;
        }
        [[unroll]] for (uint x = 0u; x < BQ; ++x) {
            q[x] = q_quads[(g * GROUP + hj0) * Q4 + x];
            acc[x] = vec4(0.0);
        }
        [[unroll]] for (uint c = 0u; c < Q4; ++c) {
            k_scale[c] = vec4(0.0);
            v_scale[c] = vec4(0.0);
            if (K_BITS > 0u)
                k_scale[c] = uintBitsToFloat(cache_quads[((pc.k_scale_word + g * pc.head_vec) >> 2u) + c]);
            if (V_BITS > 0u)
                v_scale[c] = uintBitsToFloat(cache_quads[((pc.v_scale_word + g * pc.head_vec) >> 2u) + c]);
            k_mean[c] = vec4(0.0);
            if (K_ROPE)
                k_mean[c] = uintBitsToFloat(cache_quads[((pc.k_mean_word + g * pc.head_vec) >> 2u) + c]);
        }

        uint k_base = pc.k_word + g * pc.n_ctx * K_ROW;
        uint v_base = pc.v_word + g * pc.n_ctx * V_ROW;
        uint lo = 0u, hi = pc.n_cached;  // the cached tokens read from here
        if (pc.win_sink + pc.win_recent > 0u) {  // attend_window attends over the rest
            lo = pc.win_sink;
            hi = min(hi, window_coded_end(cache_words[pc.state_word], pc.win_sink, pc.win_recent));
        }
        for (uint t = max(t0, lo); t < min(t1, hi); ++t)
            attend_token(false, k_base + t * K_ROW, v_base + t * V_ROW, g, t);
        k_base = pc.fresh_k_word + g * n_fresh * K_ROW;
        v_base = pc.fresh_v_word + g * n_fresh * V_ROW;
        for (uint t = max(t0, pc.n_cached); t < t1; ++t)
            attend_token(true, k_base + (t - pc.n_cached) * K_ROW, v_base + (t - pc.n_cached) * V_ROW, g, t);

        if (pc.write_out != 0u) {
            uint h0 = g * GROUP + hj0;
            vec4 mean[Q4];
            [[unroll]] for (uint c = 0u; c < Q4; ++c)
                mean[c] = vec4(0.0);
            if (pc.use_mean != 0u)
                [[unroll]] for (uint c = 0u; c < Q4; ++c)
                    mean[c] = uintBitsToFloat(cache_quads[((pc.mean_word + g * pc.head_vec) >> 2u) + c]);
            [[unroll]] for (uint hj = 0u; hj < HB; ++hj)
                [[unroll]] for (uint c = 0u; c < Q4; ++c)
                    out_quads[(h0 + hj) * Q4 + c] = mean[c] + acc[hj * Q4 + c] * (1.0 / l[hj]);
        } else {
            STORE_RECORDS(record(pc.split0 + i, g, pc.n_kv) + hj0, m, l, acc);
        }
    }
}
