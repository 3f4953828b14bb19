#version 450
// Decode attention straight over dict-coded slots (docs/FORMAT.md), shaped for GPUs: one
// workgroup per (split i, KV head g, block of HB query heads) attends over the split's
// tokens without decoding a key or a value; attend_merge_head.comp combines the splits' records
// (and adds the V mean). Both streams dict-coded, each with or without a residual stage.
//   keys:   score = scale * (sum_j c_j T[h, idx_j] + step * sum_e (q*rscale_k)[h, e] * (lvl_e - half))
//           with T = q . atom from attend_table.comp (run once per step), kept in shared
//           memory for the block's heads; q . mean_k is the same for every token (cancels);
//   values: out = mean_v + sum_a w[h, a] atom[a] + rscale_v * sum_t p_t step_t (lvl_t - half)
//           with the per-atom weights w[h, a] = sum over code words selecting a of p_t c_j,
//           multiplied by the atoms once at the end.
// The split is walked in chunks of LOCAL tokens, one token per invocation: its K and V slot
// words are loaded a chunk ahead into registers (all of a slot's words at once: the code
// word counts are specialization constants), so the next chunk's loads are in flight while
// this one computes. The invocation scores its key, publishes its probabilities and stages
// its V levels in shared memory; then invocations across (token lane, element quad)
// accumulate the V residual from shared memory.
// The atom weights are OWNED: invocation x holds w[h, a] for the atoms a = x + s*LOCAL in
// registers (NSUB of them per head). A token's V code word is not added where it lands (a
// float read-modify-write in shared memory per code word and head needs a compare-and-swap
// loop in core Vulkan — the old scatter; on an H200 this is 2-12 % faster in the certified
// format, docs/DESIGN.md); it is handed
// to its atom's owner: one integer atomicAdd on the owner's count gives it a place in the
// owner's bucket (BUCKET words, a specialization constant the host sizes to the device's
// shared memory) and the word goes there with its token. After a barrier each owner adds its
// bucket's words into its registers for every head at once (the token's probabilities are one
// vec4 load). A bucket that fills up leaves the rest with their tokens, which hand them over
// in further passes of the same chunk (a flag; rare for spread-out code words, it also keeps
// a chunk whose tokens all pick one atom exact). At the split's end the weights go to shared
// memory (the table's place) and are multiplied by the atoms.
// The softmax reference m moves only when a score exceeds it by more than GROW_MARGIN
// (flag, then a workgroup maximum — the first chunk and rarely after), so a chunk needs no
// reduction: probabilities stay ≤ e^GROW_MARGIN, each invocation sums its own, and the
// record's (m, l) are exact for any reference (the merge rescales by exp(m - M)).
// Levels become floats without an int→float conversion (slot.glsl's centred_level).
// An out-of-range atom index contributes exactly zero. A windowed dictionary layer
// (kvdict_vk.window): tokens its exact window holds score -inf here (attend_window.comp
// attends over them, one more record for the merge).
// Keys coded before RoPE (K_ROPE, kvdict_vk.rope): a turned key's q·atom products change with
// its position, so no table serves them: a chunk's keys are decoded quad by quad (their atoms'
// quads, the residual, the mean — which no longer cancels), each quad turned to its token's
// position by the layer's rotation table (rope.glsl) and multiplied into the heads' scores,
// KEY_LANES invocations a key (turned_key_parts). V is attended as above.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "attend_common.glsl"
#include "window.glsl"
#include "rope.glsl"

layout(constant_id = 4) const uint K_BITS = 0u;   // residual bits of K (0: atoms only)
layout(constant_id = 5) const uint V_BITS = 0u;
layout(constant_id = 6) const uint N_ATOMS = 1024u;  // atoms per dictionary head (shared memory)
layout(constant_id = 7) const uint K_SPARSITY = 4u;  // code words per K slot
layout(constant_id = 8) const uint V_SPARSITY = 4u;
layout(constant_id = 9) const uint BUCKET = 16u;    // code words an owner takes per pass (host: fits shared memory)
layout(constant_id = 10) const bool ATOMS_F16 = false;  // the atoms in binary16 (atoms.glsl)
layout(constant_id = 11) const bool K_ROPE = false;     // keys coded before RoPE (see above)
// (K_ROPE) invocations a key is decoded by: a power of two dividing LOCAL and the uvec4s of an
// atom, KEY_LANES * LOCAL <= TAB_ROWS (their partial scores fill the table's place; host: specs)
layout(constant_id = 12) const uint KEY_LANES = 1u;
#include "atoms.glsl"
const uint LOCAL = gl_WorkGroupSize.x;  // tokens per chunk (host: <= 256, a token's index is 8 bits)
const uint K_LEVEL_WORDS = SLOT_LEVEL_WORDS_OF(HEAD_DIM, K_BITS);
const uint V_LEVEL_WORDS = SLOT_LEVEL_WORDS_OF(HEAD_DIM, V_BITS);
const uint K_ROW = SLOT_WORDS_OF(K_SPARSITY, HEAD_DIM, K_BITS);  // words of a slot
const uint V_ROW = SLOT_WORDS_OF(V_SPARSITY, HEAD_DIM, V_BITS);
const uint V_STAGE = V_BITS > 0u ? V_LEVEL_WORDS : 1u;  // staged level words per token
// register copies of a slot: room for LEVEL's "next word" and the step also when a stream
// has no residual stage (those code paths are dead, but their indices stay in bounds)
const uint K_ARR = K_SPARSITY + K_LEVEL_WORDS + 2u;
const uint V_ARR = V_SPARSITY + V_STAGE + 1u;
const uint VQ = HEAD_DIM / 4u;       // element quads of a head vector
const uint VLANES = LOCAL / VQ;      // token lanes of the V residual and atoms passes (host: >= 1)
const uint UNROLL = 16u;             // atom rows loaded together at the end (latency)
const uint TABLE_ROUNDS = (HB * N_ATOMS + LOCAL - 1u) / LOCAL;  // table words per invocation
const uint NSUB = (N_ATOMS + LOCAL - 1u) / LOCAL;  // atoms an invocation owns (host: NSUB * HB <= 32)
const uint HB4 = (HB + 3u) / 4u;     // vec4s of a token's probabilities
const float GROW_MARGIN = 8.0;       // probabilities stay ≤ e^8 between rescales

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
    uint split_round;   // split_len 0: the splits' rounding (SPLIT_LEN)
    uint q_word;        // the query block's first word (SEQ_USED)
    uint win_sink;      // a windowed layer (window.glsl): only tokens [win_sink, coded_end) score here
    uint win_recent;
    uint state_word;    // (windowed) the layer's token count
    uint k_atoms_word;  // (K_ROPE) K's atoms, mean and rotation table (rope.glsl)
    uint k_mean_word;
    uint rope_word;
    uint rope_hi;
    uint rope_shift;
    float score_scale;
} pc;

// q·atom table × score scale, atom-major (TAB: a code word's heads are adjacent, one wide load);
// after the split the atom weights, the same way
const uint TAB_ROWS = K_ROPE && LOCAL > N_ATOMS ? LOCAL : N_ATOMS;  // (K_ROPE: the partial scores' rows)
shared float tab_sh[HB * TAB_ROWS];
#define TAB(a, h) tab_sh[(a) * HB + (h)]
shared uint bucket_sh[BUCKET * LOCAL];  // [k*LOCAL + owner]: coef bits | token << 16 | atom / LOCAL << 24
shared uint count_sh[LOCAL];        // code words handed to each owner this pass (may pass BUCKET)
shared vec4 qs_sh[HB * VQ];         // scale * q * K's residual scale (K_ROPE: scale * q)
const uint KQ_SH = K_ROPE ? VQ : 1u;
shared vec4 kmean_sh[KQ_SH];        // (K_ROPE) K's mean and residual scale
shared vec4 kscale_sh[KQ_SH];
shared vec4 p4_sh[LOCAL * HB4];     // [x*HB4 + h/4][h%4]: p of the chunk's tokens; reductions; the end's sums
shared float step_sh[LOCAL];        // V's step of the chunk's tokens
shared uint vlev_sh[LOCAL * V_STAGE];  // the chunk's V level words, token-major
shared uint grow_sh;
shared uint full_sh[2];             // a bucket was full in pass k (k % 2)

#define P_OF(x, h) p4_sh[(x) * HB4 + (h) / 4u][(h) % 4u]

// Invocation x's HB values (a token's scores or probabilities) as its row of p4_sh, the last
// vec4 padded with zeros.
void publish(uint x, float v[HB]) {
    [[unroll]] for (uint k = 0u; k < HB4; ++k) {
        vec4 pv = vec4(0.0);
        [[unroll]] for (uint hh = 0u; hh < 4u; ++hh)
            if (4u * k + hh < HB)
                pv[hh] = v[4u * k + hh];
        p4_sh[x * HB4 + k] = pv;
    }
}

void reduce(bool take_max) {  // P_OF(x, h) over x → P_OF(0, h), every head at once
    for (uint width = LOCAL / 2u; width > 0u; width >>= 1u) {
        barrier();
        uint x = gl_LocalInvocationID.x;
        if (x < width)
            [[unroll]] for (uint k = 0u; k < HB4; ++k) {
                vec4 a = p4_sh[x * HB4 + k], b = p4_sh[(x + width) * HB4 + k];
                p4_sh[x * HB4 + k] = take_max ? max(a, b) : a + b;
            }
    }
    barrier();
}

// Level d of the residual stage of a slot copied into `row` (its levels from row[w0]), centred.
// The word after a level's is always read, and always inside the slot: the step follows the
// last level word.
#define LEVEL(row, w0, d, BITS) centred_level(residual_level(row[(w0) + (((d) * BITS) >> 5u)], \
    row[(w0) + (((d) * BITS) >> 5u) + 1u], ((d) * BITS) & 31u, BITS), BITS)

// Hand the code words of this invocation's token still marked in `pending` (bit j: word j) to
// their owners; those whose owner's bucket is full stay marked and flag pass `pass_no`.
// The pass before's flag is cleared here: every invocation read it before this pass began.
#define HAND_OVER(vc, pending, pass_no) { \
    if (tid == 0u) \
        full_sh[((pass_no) + 1u) & 1u] = 0u; \
    [[unroll]] for (uint j = 0u; j < V_SPARSITY; ++j) \
        if ((pending & (1u << j)) != 0u) { \
            uint a = code_atom(vc[j]); \
            uint pos = atomicAdd(count_sh[a % LOCAL], 1u); \
            if (pos < BUCKET) { \
                bucket_sh[pos * LOCAL + a % LOCAL] = (vc[j] >> 16u) | (tid << 16u) | ((a / LOCAL) << 24u); \
                pending &= ~(1u << j); \
            } else \
                full_sh[(pass_no) & 1u] = 1u; \
        } }

// The owner adds its bucket's code words into its weights (every head per word) and empties it.
#define TAKE_OVER(w) { \
    uint n_mine = min(count_sh[tid], BUCKET); \
    for (uint e = 0u; e < n_mine; ++e) { \
        uint word = bucket_sh[e * LOCAL + tid]; \
        float c = unpackHalf2x16(word & 0xFFFFu).x; \
        uint x = (word >> 16u) & 0xFFu, sub = word >> 24u; \
        [[unroll]] for (uint k = 0u; k < HB4; ++k) { \
            vec4 cp = c * p4_sh[x * HB4 + k]; \
            [[unroll]] for (uint sb = 0u; sb < NSUB; ++sb) \
                if (sb == sub) \
                    [[unroll]] for (uint hh = 0u; hh < 4u; ++hh) \
                        if (4u * k + hh < HB) \
                            w[sb][4u * k + hh] += cp[hh]; \
        } \
    } \
    count_sh[tid] = 0u; }

// (K_ROPE) Quad c of a key — `part` its atoms' share, then its residual from the slot at word
// `slot` (levels times `step_` and K's residual scale), its mean — turned to position t and
// multiplied into the four partial sums `r4` of each head (the scaled queries).
#define TURNED_QUAD(c, part) { \
    vec4 kq = part; \
    if (K_BITS > 0u) { \
        uint bit0_ = 4u * (c) * K_BITS, w_ = slot + K_SPARSITY + (bit0_ >> 5u), off_ = bit0_ & 31u; \
        uint bits_ = level_window(cache_words[w_], off_ + 4u * K_BITS > 32u ? cache_words[w_ + 1u] : 0u, off_); \
        kq += (step_ * centred_quad(bits_, K_BITS)) * kscale_sh[c]; \
    } \
    uvec2 at = (pc.rope_word >> 2u) + rope_quads(t, c, pc.rope_hi, pc.rope_shift, VQ); \
    kq = rope_turn(kq + kmean_sh[c], uintBitsToFloat(cache_quads[at.x]), uintBitsToFloat(cache_quads[at.y])); \
    [[unroll]] for (uint h = 0u; h < HB; ++h) \
        r4[h] += qs_sh[h * VQ + (c)] * kq; }

// (K_ROPE) The scores of the chunk's keys (tokens c0 … of the split ending at t1, slots from word
// k_base, atoms of the dictionary head whose first uvec4 is `base`), each key decoded by
// KEY_LANES adjacent invocations: invocation x takes the atoms' uvec4s p·KEY_LANES + x %
// KEY_LANES of token x / KEY_LANES + r·LOCAL/KEY_LANES in round r, so the invocations of a
// token read adjacent words of each atom (a cache line for several tokens, not one each). The
// partial scores go to the table's place (unused by K here): TAB(token·KEY_LANES + part, h).
// An out-of-range code word adds exactly zero (atom 0, coefficient 0: common.glsl).
void turned_key_parts(uint c0, uint t1, uint k_base, uint base) {
    uint x = gl_LocalInvocationID.x, part = x % KEY_LANES;
    [[unroll]] for (uint rd = 0u; rd < KEY_LANES; ++rd) {  // every round's loads in flight together
        uint tau = rd * (LOCAL / KEY_LANES) + x / KEY_LANES;
        uint t = min(c0 + tau, t1 - 1u), slot = k_base + t * K_ROW;
        uint atom[K_SPARSITY];
        float coef[K_SPARSITY];
        [[unroll]] for (uint j = 0u; j < K_SPARSITY; ++j) {
            uint w = cache_words[slot + j];
            atom[j] = safe_atom(code_atom(w), N_ATOMS);
            coef[j] = safe_coef(code_atom(w), N_ATOMS, code_coef(w));
        }
        float step_ = K_BITS > 0u ? uintBitsToFloat(cache_words[slot + K_SPARSITY + K_LEVEL_WORDS]) : 0.0;
        vec4 r4[HB];
        [[unroll]] for (uint h = 0u; h < HB; ++h)
            r4[h] = vec4(0.0);
        [[unroll]] for (uint i = 0u; i < ATOM_QUADS / KEY_LANES; ++i) {  // a uvec4 of each atom: one quad, or two (binary16)
            uint u = i * KEY_LANES + part;
            vec4 lo = vec4(0.0), hi = vec4(0.0);
            [[unroll]] for (uint j = 0u; j < K_SPARSITY; ++j) {
                uvec4 w = cache_quads[base + atom[j] * ATOM_QUADS + u];
                if (ATOMS_F16) {
                    lo += coef[j] * atom_quad_lo(w);
                    hi += coef[j] * atom_quad_hi(w);
                } else
                    lo += coef[j] * uintBitsToFloat(w);
            }
            TURNED_QUAD(u, lo)
            if (ATOMS_F16)
                TURNED_QUAD(u + ATOM_HALF_QUADS, hi)
        }
        [[unroll]] for (uint h = 0u; h < HB; ++h)
            TAB(tau * KEY_LANES + part, h) = (r4[h].x + r4[h].y) + (r4[h].z + r4[h].w);
    }
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint q4 = tid % VQ, vlane = tid / VQ;  // the element quad and token lane of the V passes
    uint items = pc.n_splits * pc.n_kv * N_HB * pc.n_seqs;
    for (uint item = gl_WorkGroupID.x; item < items; item += gl_NumWorkGroups.x) {
        uint blk = item % N_HB;
        uint g = (item / N_HB) % pc.n_kv;
        uint i = (item / (N_HB * pc.n_kv)) % pc.n_splits;
        uint seq = item / (N_HB * pc.n_kv * pc.n_splits);
        uint vh = seq * pc.n_kv + g;  // the virtual head: queries, table rows, records
        uint h0 = vh * GROUP + blk * HB;  // first query head of the block
        uint n_used = SEQ_USED(q_floats, seq);
        uint split_len = SPLIT_LEN(n_used);
        uint t0 = i * split_len;
        uint t1 = min(t0 + split_len, n_used);
        uint lo = 0u, hi = t1;  // the tokens scored here; a window's (attend_window's) are not
        if (pc.win_sink + pc.win_recent > 0u) {
            lo = pc.win_sink;
            hi = min(hi, window_coded_end(cache_words[pc.state_word], pc.win_sink, pc.win_recent));
        }

        if (!K_ROPE)
            [[unroll]] for (uint r = 0u; r < TABLE_ROUNDS; ++r) {  // loads in flight together
                uint x = tid + r * LOCAL;
                if (x < HB * N_ATOMS)
                    TAB(x % N_ATOMS, x / N_ATOMS) = table[h0 * N_ATOMS + x] * pc.score_scale;  // row h0 + x / N_ATOMS
            }
        for (uint x = tid; x < HB * VQ; x += LOCAL) {
            vec4 qv, rs = vec4(0.0);
            [[unroll]] for (uint k = 0u; k < 4u; ++k) {
                uint f = 4u * x + k;
                qv[k] = q_floats[pc.q_word + h0 * HEAD_DIM + f];
                if (K_BITS > 0u)
                    rs[k] = uintBitsToFloat(cache_words[pc.k_scale_word + g * pc.head_vec + f % HEAD_DIM]);
            }
            qs_sh[x] = K_ROPE ? qv * pc.score_scale : qv * rs * pc.score_scale;
            if (K_ROPE && x < VQ) {
                kscale_sh[x] = rs;
                uint mw = pc.k_mean_word + g * pc.head_vec + 4u * x;
                kmean_sh[x] = uintBitsToFloat(uvec4(cache_words[mw], cache_words[mw + 1u], cache_words[mw + 2u],
                                                    cache_words[mw + 3u]));
            }
        }
        count_sh[tid] = 0u;
        if (tid == 0u) {
            grow_sh = 0u;
            full_sh[0] = 0u;
            full_sh[1] = 0u;
        }
        float m[HB], l[HB];   // the reference (uniform) and this invocation's sum of p
        vec4 res[HB];         // quad q4 of sum_t p_t step_t (lvl - half) over lane vlane's tokens, V
        float w[NSUB][HB];    // the weights of the atoms tid + sb*LOCAL this invocation owns
        [[unroll]] for (uint h = 0u; h < HB; ++h) {
            m[h] = NEG_INF;
            l[h] = 0.0;
            res[h] = vec4(0.0);
            [[unroll]] for (uint sb = 0u; sb < NSUB; ++sb)
                w[sb][h] = 0.0;
        }
        uint pass_no = 0u;    // hand-over passes so far (uniform)

        uint k_base = pc.k_word + (g * pc.n_ctx + seq * pc.seq_rows) * K_ROW;
        uint v_base = pc.v_word + (g * pc.n_ctx + seq * pc.seq_rows) * V_ROW;
        // The slots of this invocation's token in the next chunk, loaded a chunk ahead (past the
        // split's end: the split's last token, unused). ~K_ROW + V_ROW more registers; on an
        // H200 it measured the same as loading each chunk's slots at its start (other
        // workgroups hide the latency there).
        uint kw[K_ARR], vw[V_ARR];
        {
            uint t = min(t0 + tid, t1 - 1u);
            [[unroll]] for (uint r = 0u; r < K_ROW; ++r)
                kw[r] = cache_words[k_base + t * K_ROW + r];
            [[unroll]] for (uint r = 0u; r < V_ROW; ++r)
                vw[r] = cache_words[v_base + t * V_ROW + r];
        }
        barrier();  // the table, counts, flags and queries are in shared memory

        for (uint c0 = t0; c0 < t1; c0 += LOCAL) {
            uint n = min(LOCAL, t1 - c0);
            bool live = tid < n && c0 + tid >= lo && c0 + tid < hi;  // staged either way: every token has a slot
            uint kc[K_ARR], vc[V_ARR];  // this chunk's slots (prefetched)
            [[unroll]] for (uint r = 0u; r < K_ROW; ++r)
                kc[r] = kw[r];
            [[unroll]] for (uint r = 0u; r < V_ROW; ++r)
                vc[r] = vw[r];
            if (c0 + LOCAL < t1) {  // the next chunk's slots, in flight while this one computes
                uint t = min(c0 + LOCAL + tid, t1 - 1u);
                [[unroll]] for (uint r = 0u; r < K_ROW; ++r)
                    kw[r] = cache_words[k_base + t * K_ROW + r];
                [[unroll]] for (uint r = 0u; r < V_ROW; ++r)
                    vw[r] = cache_words[v_base + t * V_ROW + r];
            }

            // 1. this invocation's key: its scores
            float s[HB];
            [[unroll]] for (uint h = 0u; h < HB; ++h)
                s[h] = 0.0;
            if (K_ROPE) {
                turned_key_parts(c0, t1, k_base, (pc.k_atoms_word + g * pc.head_atoms) / 4u);
                barrier();
                [[unroll]] for (uint part = 0u; part < KEY_LANES; ++part)
                    [[unroll]] for (uint h = 0u; h < HB; ++h)
                        s[h] += TAB(tid * KEY_LANES + part, h);
            } else
            [[unroll]] for (uint j = 0u; j < K_SPARSITY; ++j) {
                uint a = code_atom(kc[j]);
                if (a < N_ATOMS) {
                    float c = code_coef(kc[j]);
                    [[unroll]] for (uint h = 0u; h < HB; ++h)
                        s[h] += c * TAB(a, h);
                }
            }
            if (K_BITS > 0u && !K_ROPE) {
                // four partial sums a head (one per element of the quad), added at the end: a
                // dot() per quad would chain all HEAD_DIM multiply-adds of a head into one
                // dependent sum (docs/DESIGN.md: the measurement)
                vec4 r[HB];
                [[unroll]] for (uint h = 0u; h < HB; ++h)
                    r[h] = vec4(0.0);
                [[unroll]] for (uint d4 = 0u; d4 < VQ; ++d4) {
                    vec4 lv;
                    [[unroll]] for (uint k = 0u; k < 4u; ++k)
                        lv[k] = LEVEL(kc, K_SPARSITY, 4u * d4 + k, K_BITS);
                    [[unroll]] for (uint h = 0u; h < HB; ++h)
                        r[h] += qs_sh[h * VQ + d4] * lv;
                }
                float step_ = uintBitsToFloat(kc[K_SPARSITY + K_LEVEL_WORDS]);
                [[unroll]] for (uint h = 0u; h < HB; ++h)
                    s[h] += step_ * ((r[h].x + r[h].y) + (r[h].z + r[h].w));
            }
            bool grow = false;
            [[unroll]] for (uint h = 0u; h < HB; ++h) {
                s[h] = live ? s[h] : NEG_INF;
                grow = grow || s[h] > m[h] + GROW_MARGIN;
            }
            if (grow)
                grow_sh = 1u;
            barrier();
            // 2. a score far above the reference: the chunk's maximum becomes it (uniform branch)
            if (grow_sh != 0u) {
                publish(tid, s);
                reduce(true);
                [[unroll]] for (uint h = 0u; h < HB; ++h) {
                    float m_new = max(m[h], P_OF(0u, h));
                    float corr = exp(m[h] - m_new);  // 0 on the first chunk (m = -inf)
                    m[h] = m_new;
                    l[h] *= corr;
                    res[h] *= corr;
                    [[unroll]] for (uint sb = 0u; sb < NSUB; ++sb)
                        w[sb][h] *= corr;
                }
                barrier();  // all have read the maximum
                if (tid == 0u)
                    grow_sh = 0u;
            }
            // 3. probabilities (published); the value's code words handed to their atoms'
            //    owners; its step and levels staged
            float p[HB];
            [[unroll]] for (uint h = 0u; h < HB; ++h) {
                p[h] = live ? exp(s[h] - m[h]) : 0.0;  // m may still be -inf where no token was live
                l[h] += p[h];
            }
            publish(tid, p);
            uint pending = 0u;  // bit j: V code word j still to hand over
            if (live)
                [[unroll]] for (uint j = 0u; j < V_SPARSITY; ++j)
                    if (code_atom(vc[j]) < N_ATOMS)
                        pending |= 1u << j;
            if (tid < n) {  // a skipped token's p is 0: its finite step and levels add nothing
                if (V_BITS > 0u) {
                    step_sh[tid] = uintBitsToFloat(vc[V_SPARSITY + V_LEVEL_WORDS]);
                    [[unroll]] for (uint w_ = 0u; w_ < V_STAGE; ++w_)
                        vlev_sh[tid * V_STAGE + w_] = vc[V_SPARSITY + w_];
                }
            }
            HAND_OVER(vc, pending, pass_no)
            barrier();
            // 4. the owners take their code words; the values' residual: quad q4 of lane vlane's
            //    tokens, levels from shared memory
            TAKE_OVER(w)
            bool again = full_sh[pass_no & 1u] != 0u;
            if (V_BITS > 0u) {
                uint bit0 = 4u * q4 * V_BITS, w0 = bit0 >> 5u, off = bit0 & 31u;
                bool straddles = off + 4u * V_BITS > 32u;
                for (uint x = vlane; x < n; x += VLANES) {
                    uint lo = vlev_sh[x * V_STAGE + w0];
                    uint hi = straddles ? vlev_sh[x * V_STAGE + w0 + 1u] : 0u;
                    vec4 lv = centred_quad(level_window(lo, hi, off), V_BITS);
                    float st = step_sh[x];
                    [[unroll]] for (uint h = 0u; h < HB; ++h)
                        res[h] += (P_OF(x, h) * st) * lv;
                }
            }
            barrier();  // the chunk's staged values and buckets are read before they are rewritten
            ++pass_no;
            while (again) {  // uniform: every invocation read the same flag
                HAND_OVER(vc, pending, pass_no)
                barrier();
                TAKE_OVER(w)
                again = full_sh[pass_no & 1u] != 0u;
                barrier();
                ++pass_no;
            }
        }

        // the weights into shared memory (the table is no longer read), then times the atoms
        // (quad q4, lane vlane's atoms) plus the residual part, then the lanes' sums through
        // shared memory, one quad element at a time
        [[unroll]] for (uint sb = 0u; sb < NSUB; ++sb)
            if (tid + sb * LOCAL < N_ATOMS)
                [[unroll]] for (uint h = 0u; h < HB; ++h)
                    TAB(tid + sb * LOCAL, h) = w[sb][h];
        barrier();
        vec4 part[HB];
        [[unroll]] for (uint h = 0u; h < HB; ++h)
            part[h] = vec4(0.0);
        {
            uint atoms = (pc.v_atoms_word + g * pc.head_atoms) / 4u;
            for (uint a0 = vlane; a0 < N_ATOMS; a0 += VLANES * UNROLL) {
                vec4 av[UNROLL];  // UNROLL atoms' quad q4 loaded together
                [[unroll]] for (uint u = 0u; u < UNROLL; ++u)
                    av[u] = atom_quad(cache_quads[atom_quad_index(atoms, min(a0 + u * VLANES, N_ATOMS - 1u), q4)], q4);
                [[unroll]] for (uint u = 0u; u < UNROLL; ++u) {
                    uint a = a0 + u * VLANES;
                    if (a < N_ATOMS)
                        [[unroll]] for (uint h = 0u; h < HB; ++h)
                            part[h] += TAB(a, h) * av[u];
                }
            }
            if (V_BITS > 0u) {
                uint sw = pc.v_scale_word + g * pc.head_vec + 4u * q4;
                vec4 rs = uintBitsToFloat(uvec4(cache_words[sw], cache_words[sw + 1u], cache_words[sw + 2u],
                                                cache_words[sw + 3u]));
                [[unroll]] for (uint h = 0u; h < HB; ++h)
                    part[h] += res[h] * rs;
            }
        }
        uint rec0 = record(i, vh, pc.n_kv * pc.n_seqs) + blk * HB;
        [[unroll]] for (uint k = 0u; k < 4u; ++k) {
            barrier();
            [[unroll]] for (uint h = 0u; h < HB; ++h)
                P_OF(tid, h) = part[h][k];
            barrier();
            for (uint x = tid; x < HB * VQ; x += LOCAL) {
                uint h = x / VQ, q = x - h * VQ;
                float a = 0.0;
                for (uint ln = 0u; ln < VLANES; ++ln)
                    a += P_OF(ln * VQ + q, h);
                acc_floats[(rec0 + h) * HEAD_DIM + 4u * q + k] = a;  // records are h-major
            }
        }
        // the invocations' sums of p
        barrier();
        [[unroll]] for (uint h = 0u; h < HB; ++h)
            P_OF(tid, h) = l[h];
        reduce(false);
        [[unroll]] for (uint h = 0u; h < HB; ++h)
            if (tid == h) {
                stats[(rec0 + h) * 2u] = m[h];
                stats[(rec0 + h) * 2u + 1u] = P_OF(0u, h);
            }
        barrier();  // shared memory is reused by the next item
    }
}
