#version 450
// Decode attention straight over dict-coded slots (docs/FORMAT.md), shaped for GPUs: one
// workgroup per (split i, KV head g, block of HB query heads) attends over the split's
// tokens without decoding a key or a value; attend_merge.comp combines the splits' records
// (and adds the V mean). Both streams dict-coded, each with or without a residual stage.
//   keys:   score = scale * (sum_j c_j T[h, idx_j] + step * sum_e (q*rscale_k)[h, e] * (lvl_e - half))
//           with T = q . atom from attend_table.comp (run once per step), kept in shared
//           memory for the block's heads; q . mean_k is the same for every token (cancels);
//   values: out = mean_v + sum_a w[h, a] atom[a] + rscale_v * sum_t p_t step_t (lvl_t - half)
//           with the per-atom weights w[h, a] = sum over code words selecting a of p_t c_j
//           accumulated in shared memory — a compare-and-swap loop on the float's bits
//           (core Vulkan has no float atomics) — and multiplied by the atoms once at the end.
// The split is walked in chunks of LOCAL tokens (one token per invocation for the key and
// the values' code words; the residual of V across invocations by element). The running
// maximum moves per chunk; when it grows the weights are rescaled (rarely, after the first
// chunks). An out-of-range atom index contributes exactly zero.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "attend_common.glsl"

layout(constant_id = 4) const uint K_BITS = 0u;   // residual bits of K (0: atoms only)
layout(constant_id = 5) const uint V_BITS = 0u;
layout(constant_id = 6) const uint N_ATOMS = 1024u;  // atoms per dictionary head (shared memory)
const uint LOCAL = gl_WorkGroupSize.x;
const uint K_LEVEL_WORDS = (HEAD_DIM * K_BITS + 31u) / 32u;
const uint V_LEVEL_WORDS = (HEAD_DIM * V_BITS + 31u) / 32u;
const uint UNROLL = 8u;  // loads issued together in the token and atom loops (latency, not bandwidth)
const uint TOKEN_LANES = LOCAL / HEAD_DIM;  // token lanes of the V residual and atoms passes (host: >= 1)

layout(std430, binding = 0) readonly buffer CacheWords { uint cache_words[]; };  // slots, atoms, scales
layout(std430, binding = 1) readonly buffer Table { float table[]; };  // [(g*GROUP + h)*n_atoms + a]
layout(std430, binding = 2) readonly buffer Query { float q_floats[]; };
layout(std430, binding = 3) writeonly buffer Accs { float acc_floats[]; };
layout(std430, binding = 4) writeonly buffer Stats { float stats[]; };

layout(push_constant) uniform AttendFlashCodedPush {
    uint k_word;        // the layer's K slots, n_ctx per KV head
    uint v_word;
    uint n_ctx;
    uint n_used;
    uint split_len;
    uint n_splits;
    uint n_kv;
    uint n_atoms;       // == N_ATOMS
    uint k_sparsity;
    uint v_sparsity;
    uint v_atoms_word;  // V atoms (KV head h's at + h*head_atoms)
    uint head_atoms;
    uint k_scale_word;  // residual scales (read only with a residual stage)
    uint v_scale_word;
    uint head_vec;
    float score_scale;
} pc;

shared float tab_sh[HB * N_ATOMS];
shared uint bins_sh[HB * N_ATOMS];  // float bits: the per-atom value weights
shared vec4 qs_sh[HB * HEAD_DIM / 4u];  // scale * q * K's residual scale, as vec4
shared float p_sh[HB * LOCAL];      // the chunk's scores, then probabilities; at the end the lanes' sums
shared float red_sh[HB * LOCAL];
shared float m_sh[HB], l_sh[HB];

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

void reduce(bool take_max) {  // red_sh[h*LOCAL + x] over x → red_sh[h*LOCAL]
    for (uint width = LOCAL / 2u; width > 0u; width >>= 1u) {
        barrier();
        uint x = gl_LocalInvocationID.x;
        if (x < width)
            for (uint h = 0u; h < HB; ++h) {
                float a = red_sh[h * LOCAL + x], b = red_sh[h * LOCAL + x + width];
                red_sh[h * LOCAL + x] = take_max ? max(a, b) : a + b;
            }
    }
    barrier();
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint e = tid % HEAD_DIM, lane = tid / HEAD_DIM;  // the element and lane of the V passes
    const uint k_row = pc.k_sparsity + (K_BITS > 0u ? K_LEVEL_WORDS + 1u : 0u);
    const uint v_row = pc.v_sparsity + (V_BITS > 0u ? V_LEVEL_WORDS + 1u : 0u);
    uint items = pc.n_splits * pc.n_kv * N_HB;
    for (uint item = gl_WorkGroupID.x; item < items; item += gl_NumWorkGroups.x) {
        uint blk = item % N_HB;
        uint g = (item / N_HB) % pc.n_kv;
        uint i = item / (N_HB * pc.n_kv);
        uint h0 = g * GROUP + blk * HB;  // first query head of the block
        uint t0 = i * pc.split_len;
        uint t1 = min(t0 + pc.split_len, pc.n_used);

        for (uint x = tid; x < HB * N_ATOMS; x += LOCAL) {
            tab_sh[x] = table[h0 * pc.n_atoms + x] * pc.score_scale;  // rows h0 .. h0+HB-1
            bins_sh[x] = 0u;
        }
        for (uint x = tid; x < HB * HEAD_DIM / 4u; x += LOCAL) {
            vec4 qv, rs = vec4(0.0);
            [[unroll]] for (uint k = 0u; k < 4u; ++k) {
                uint f = 4u * x + k;
                qv[k] = q_floats[h0 * HEAD_DIM + f];
                if (K_BITS > 0u)
                    rs[k] = uintBitsToFloat(cache_words[pc.k_scale_word + g * pc.head_vec + f % HEAD_DIM]);
            }
            qs_sh[x] = qv * rs * pc.score_scale;
        }
        if (tid < HB) {
            m_sh[tid] = NEG_INF;
            l_sh[tid] = 0.0;
        }
        float res[HB];  // this invocation's element e of sum_t p_t step_t (lvl - half), V
        [[unroll]] for (uint h = 0u; h < HB; ++h)
            res[h] = 0.0;
        barrier();

        uint k_base = pc.k_word + g * pc.n_ctx * k_row;
        uint v_base = pc.v_word + g * pc.n_ctx * v_row;
        for (uint c0 = t0; c0 < t1; c0 += LOCAL) {
            uint n = min(LOCAL, t1 - c0);
            // 1. this invocation's key: its scores
            float s[HB];
            [[unroll]] for (uint h = 0u; h < HB; ++h)
                s[h] = NEG_INF;
            if (tid < n) {
                [[unroll]] for (uint h = 0u; h < HB; ++h)
                    s[h] = 0.0;
                uint slot = k_base + (c0 + tid) * k_row;
                for (uint j = 0u; j < pc.k_sparsity; ++j) {
                    uint w = cache_words[slot + j];
                    uint a = code_atom(w);
                    if (a < pc.n_atoms) {
                        float c = code_coef(w);
                        [[unroll]] for (uint h = 0u; h < HB; ++h)
                            s[h] += c * tab_sh[h * N_ATOMS + a];
                    }
                }
                if (K_BITS > 0u) {
                    // the level words once into registers; element d's word and shift are
                    // constants of the unrolled loop
                    uint lw0 = slot + pc.k_sparsity;
                    uint lw[K_LEVEL_WORDS + 1u];
                    [[unroll]] for (uint w = 0u; w < K_LEVEL_WORDS; ++w)
                        lw[w] = cache_words[lw0 + w];
                    lw[K_LEVEL_WORDS] = 0u;  // the "next word" of the last level
                    float step_ = uintBitsToFloat(cache_words[lw0 + K_LEVEL_WORDS]);
                    float half_ = residual_half(K_BITS);
                    float r[HB];
                    [[unroll]] for (uint h = 0u; h < HB; ++h)
                        r[h] = 0.0;
                    [[unroll]] for (uint d4 = 0u; d4 < HEAD_DIM / 4u; ++d4) {
                        vec4 lv;
                        [[unroll]] for (uint k = 0u; k < 4u; ++k) {
                            uint bit = (4u * d4 + k) * K_BITS;
                            lv[k] = float(residual_level(lw[bit >> 5u], lw[(bit >> 5u) + 1u], bit & 31u, K_BITS)) - half_;
                        }
                        [[unroll]] for (uint h = 0u; h < HB; ++h)
                            r[h] += dot(qs_sh[h * (HEAD_DIM / 4u) + d4], lv);
                    }
                    [[unroll]] for (uint h = 0u; h < HB; ++h)
                        s[h] += step_ * r[h];
                }
            }
            [[unroll]] for (uint h = 0u; h < HB; ++h) {
                p_sh[h * LOCAL + tid] = s[h];
                red_sh[h * LOCAL + tid] = s[h];
            }
            // 2. the chunk's maximum → the running one; probabilities and their sum
            reduce(true);
            float m_new[HB], m_old[HB];
            [[unroll]] for (uint h = 0u; h < HB; ++h) {
                m_old[h] = m_sh[h];
                m_new[h] = max(m_old[h], red_sh[h * LOCAL]);
            }
            barrier();
            [[unroll]] for (uint h = 0u; h < HB; ++h) {
                float p = exp(p_sh[h * LOCAL + tid] - m_new[h]);  // 0 past the split's end
                p_sh[h * LOCAL + tid] = p;
                red_sh[h * LOCAL + tid] = p;
            }
            reduce(false);
            // 3. a grown maximum rescales what was accumulated (uniform per head)
            [[unroll]] for (uint h = 0u; h < HB; ++h) {
                float corr = exp(m_old[h] - m_new[h]);  // 0 on the first chunk, 1 when unchanged
                if (m_new[h] != m_old[h]) {
                    for (uint a = tid; a < N_ATOMS; a += LOCAL)
                        bins_sh[h * N_ATOMS + a] = floatBitsToUint(uintBitsToFloat(bins_sh[h * N_ATOMS + a]) * corr);
                    res[h] *= corr;
                }
            }
            barrier();  // everyone has read m_sh; the weights are rescaled before the adds
            if (tid < HB) {
                float corr = exp(m_old[tid] - m_new[tid]);
                l_sh[tid] = l_sh[tid] * corr + red_sh[tid * LOCAL];
                m_sh[tid] = m_new[tid];
            }
            // 4. this invocation's value code words → the per-atom weights
            if (tid < n) {
                uint slot = v_base + (c0 + tid) * v_row;
                for (uint j = 0u; j < pc.v_sparsity; ++j) {
                    uint w = cache_words[slot + j];
                    uint a = code_atom(w);
                    if (a < pc.n_atoms) {
                        float c = code_coef(w);
                        [[unroll]] for (uint h = 0u; h < HB; ++h)
                            bin_add(h * N_ATOMS + a, p_sh[h * LOCAL + tid] * c);
                    }
                }
            }
            // 5. the values' residual, element e, token lanes
            if (V_BITS > 0u && lane < TOKEN_LANES) {
                // UNROLL tokens' words loaded before any is used (loads in flight together)
                float half_ = residual_half(V_BITS);
                uint bit = e * V_BITS, w = bit >> 5u;
                bool straddles = (bit & 31u) + V_BITS > 32u;
                for (uint x0 = lane; x0 < n; x0 += TOKEN_LANES * UNROLL) {
                    uint w0[UNROLL], w1[UNROLL], st[UNROLL];
                    [[unroll]] for (uint u = 0u; u < UNROLL; ++u) {
                        uint x = min(x0 + u * TOKEN_LANES, n - 1u);  // past the end: re-read the last (unused)
                        uint lw0 = v_base + (c0 + x) * v_row + pc.v_sparsity;
                        w0[u] = cache_words[lw0 + w];
                        w1[u] = straddles ? cache_words[lw0 + w + 1u] : 0u;
                        st[u] = cache_words[lw0 + V_LEVEL_WORDS];
                    }
                    [[unroll]] for (uint u = 0u; u < UNROLL; ++u) {
                        uint x = x0 + u * TOKEN_LANES;
                        if (x < n) {
                            float d = uintBitsToFloat(st[u]) * (float(residual_level(w0[u], w1[u], bit & 31u, V_BITS)) - half_);
                            [[unroll]] for (uint h = 0u; h < HB; ++h)
                                res[h] += p_sh[h * LOCAL + x] * d;
                        }
                    }
                }
            }
            barrier();  // the chunk's probabilities are read before the next chunk's scores
        }

        // the weights times the atoms, element e, atoms split over the lanes; then the lanes' sums
        float o[HB];
        [[unroll]] for (uint h = 0u; h < HB; ++h)
            o[h] = 0.0;
        if (lane < TOKEN_LANES) {
            uint atoms = pc.v_atoms_word + g * pc.head_atoms + e;
            for (uint a0 = lane; a0 < pc.n_atoms; a0 += TOKEN_LANES * UNROLL) {
                float av[UNROLL];  // UNROLL atoms' element e loaded together
                [[unroll]] for (uint u = 0u; u < UNROLL; ++u)
                    av[u] = uintBitsToFloat(cache_words[atoms + min(a0 + u * TOKEN_LANES, pc.n_atoms - 1u) * HEAD_DIM]);
                [[unroll]] for (uint u = 0u; u < UNROLL; ++u) {
                    uint a = a0 + u * TOKEN_LANES;
                    if (a < pc.n_atoms)
                        [[unroll]] for (uint h = 0u; h < HB; ++h)
                            o[h] += uintBitsToFloat(bins_sh[h * N_ATOMS + a]) * av[u];
                }
            }
            float rs = V_BITS > 0u ? uintBitsToFloat(cache_words[pc.v_scale_word + g * pc.head_vec + e]) : 0.0;
            [[unroll]] for (uint h = 0u; h < HB; ++h)
                p_sh[(lane * HB + h) * HEAD_DIM + e] = o[h] + res[h] * rs;  // TOKEN_LANES*HB*HEAD_DIM <= HB*LOCAL
        }
        barrier();
        uint rec0 = record(i, g, pc.n_kv) + blk * HB;
        for (uint x = tid; x < HB * HEAD_DIM; x += LOCAL) {
            float a = 0.0;
            for (uint ln = 0u; ln < TOKEN_LANES; ++ln)
                a += p_sh[ln * HB * HEAD_DIM + x];
            acc_floats[rec0 * HEAD_DIM + x] = a;  // (h, e) with x = h*HEAD_DIM + e: records are h-major
        }
        if (tid < HB) {
            stats[(rec0 + tid) * 2u] = m_sh[tid];
            stats[(rec0 + tid) * 2u + 1u] = l_sh[tid];
        }
        barrier();  // shared memory is reused by the next item
    }
}
