#version 450
// Decode attention over the uncoded cache (f16, f32 or q8_0 rows), shaped for GPUs: ONE WORKGROUP
// per (split i, KV head g) attends all GROUP query heads of g over the split's tokens, so each
// key and value row is read from memory once (FlashDecoding: the context split across
// workgroups, the running softmax kept in shared memory, attend_merge.comp combining the
// splits' records in one small pass). The split is walked in chunks of CHUNK tokens:
//   1. keys — one token per invocation (its row read as contiguous vec4s; neighbouring
//      invocations read neighbouring rows, so each memory sector is fetched once), dotted
//      with the GROUP query vectors held in shared memory → scores in shared memory;
//   2. the chunk's maximum and, after exp, its sum — tree reductions in shared memory over
//      the workgroup (no subgroup operation: core Vulkan 1.1 does not require any);
//   3. values — invocations across the row's words (coalesced loads: ROW_WORDS consecutive
//      words per token) and LOCAL / ROW_WORDS token lanes, accumulating p·v in registers with
//      the running maximum's correction applied once per chunk.
// At the end the token lanes' accumulators are summed in shared memory and the split's
// record (m, l, acc — attend_common.glsl's layout) is written for attend_merge.comp.
// Why only the uncoded cache here: the dict-coded path needs the q·atom table and per-atom
// value weights in shared memory (issue: GPU-shaped kernels over the codes), not done yet.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "attend_common.glsl"

layout(constant_id = 4) const uint ROW_HALF = 1u;  // 1: f16 rows (two halves a word), 0: f32
layout(constant_id = 5) const uint CHUNK = 256u;   // tokens per chunk, a multiple of LOCAL
// 1: q8_0 rows (ROW_HALF 0): the block scales (f16 pairs), then the int8 values four to a word
layout(constant_id = 6) const uint ROW_Q8 = 0u;
const uint LOCAL = gl_WorkGroupSize.x;  // specialization constant 2 (attend_common.glsl)
const uint Q8_SCALE_WORDS = (HEAD_DIM / 32u + 1u) / 2u;
const uint ROW_WORDS = ROW_Q8 > 0u ? Q8_SCALE_WORDS + HEAD_DIM / 4u : (ROW_HALF > 0u ? HEAD_DIM / 2u : HEAD_DIM);
const uint VALUE_WORDS = ROW_Q8 > 0u ? HEAD_DIM / 4u : ROW_WORDS;  // words holding the elements
const uint ROW_QUADS = ROW_WORDS / 4u;  // HEAD_DIM % 8 == 0 (f16) / % 4 == 0 (f32): host-checked
const uint DIMS_PER_WORD = ROW_Q8 > 0u ? 4u : (ROW_HALF > 0u ? 2u : 1u);
const uint VALUE_UNROLL = 8u;  // value words per token lane loaded together
const uint MAX_G = 8u;  // registers per query head are unrolled up to this; GROUP <= MAX_G (host)

layout(std430, binding = 0) readonly buffer CacheWords { uint cache_words[]; };
layout(std430, binding = 1) readonly buffer CacheQuads { uvec4 cache_quads[]; };
layout(std430, binding = 2) readonly buffer Query { float q_floats[]; };
layout(std430, binding = 3) writeonly buffer Accs { float acc_floats[]; };
layout(std430, binding = 4) writeonly buffer Stats { float stats[]; };

layout(push_constant) uniform AttendFlashPush {
    uint k_word;    // the layer's K region (multiple of 4), n_ctx rows per KV head
    uint v_word;
    uint n_ctx;
    uint n_used;    // attend over tokens 0 .. n_used-1
    uint split_len; // tokens per split, a multiple of CHUNK is not required
    uint n_splits;  // splits per KV head
    uint n_kv;
    float score_scale;
} pc;

shared vec4 q_sh[GROUP * HEAD_DIM / 4u];  // vec4: one shared load per four query elements
shared float p_sh[GROUP * CHUNK];   // scores, then probabilities; at the end the lane sums
shared float red_sh[GROUP * LOCAL]; // reductions
shared float m_sh[GROUP], l_sh[GROUP], corr_sh[GROUP];

// red_sh[h * LOCAL + x] over x → red_sh[h * LOCAL], for every h (max or sum).
void reduce_group(bool take_max) {
    for (uint width = LOCAL / 2u; width > 0u; width >>= 1u) {
        barrier();
        uint x = gl_LocalInvocationID.x;
        if (x < width)
            for (uint h = 0u; h < GROUP; ++h) {
                float a = red_sh[h * LOCAL + x], b = red_sh[h * LOCAL + x + width];
                red_sh[h * LOCAL + x] = take_max ? max(a, b) : a + b;
            }
    }
    barrier();
}

vec4 row_quad_f32(uint quad) { return uintBitsToFloat(cache_quads[quad]); }

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint lanes = LOCAL / VALUE_WORDS;  // token lanes of the value pass (host: LOCAL % VALUE_WORDS == 0)
    const uint word = tid % VALUE_WORDS, lane = tid / VALUE_WORDS;
    uint items = pc.n_kv * pc.n_splits;
    for (uint item = gl_WorkGroupID.x; item < items; item += gl_NumWorkGroups.x) {
        uint g = item % pc.n_kv;
        uint i = item / pc.n_kv;
        uint t0 = i * pc.split_len;
        uint t1 = min(t0 + pc.split_len, pc.n_used);

        for (uint x = tid; x < GROUP * HEAD_DIM / 4u; x += LOCAL) {
            uint f = g * GROUP * HEAD_DIM + 4u * x;
            q_sh[x] = vec4(q_floats[f], q_floats[f + 1u], q_floats[f + 2u], q_floats[f + 3u]) * pc.score_scale;
        }
        if (tid < GROUP) {
            m_sh[tid] = NEG_INF;
            l_sh[tid] = 0.0;
        }
        vec4 acc[MAX_G];  // elements word*DIMS_PER_WORD + 0 .. DIMS_PER_WORD-1 of each head
        [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
            acc[h] = vec4(0.0);
        barrier();

        uint k_base = pc.k_word + g * pc.n_ctx * ROW_WORDS;
        uint v_base = pc.v_word + g * pc.n_ctx * ROW_WORDS;
        for (uint c0 = t0; c0 < t1; c0 += CHUNK) {
            uint n = min(CHUNK, t1 - c0);
            // 1. scores of the chunk's keys, and each invocation's maximum
            float mx[MAX_G];
            [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
                mx[h] = NEG_INF;
            for (uint x = tid; x < CHUNK; x += LOCAL) {
                float s[MAX_G];
                [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
                    s[h] = 0.0;
                if (x < n && ROW_Q8 > 0u) {
                    uint base = k_base + (c0 + x) * ROW_WORDS;
                    for (uint blk = 0u; blk < HEAD_DIM / 32u; ++blk) {
                        float d = unpackHalf2x16(cache_words[base + blk / 2u])[blk % 2u];
                        [[unroll]] for (uint u = 0u; u < 8u; ++u) {
                            uint c = blk * 8u + u;  // value word c: elements 4c .. 4c+3
                            vec4 kv = int8x4(cache_words[base + Q8_SCALE_WORDS + c]) * d;
                            [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
                                if (h < GROUP)
                                    s[h] += dot(kv, q_sh[h * (HEAD_DIM / 4u) + c]);
                        }
                    }
                } else if (x < n) {
                    uint quad = (k_base + (c0 + x) * ROW_WORDS) >> 2u;
                    for (uint c = 0u; c < ROW_QUADS; ++c) {
                        vec4 k0, k1;
                        if (ROW_HALF > 0u) {
                            uvec4 w = cache_quads[quad + c];
                            k0 = vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y));
                            k1 = vec4(unpackHalf2x16(w.z), unpackHalf2x16(w.w));
                        } else {
                            k0 = row_quad_f32(quad + c);
                        }
                        uint d4 = c * DIMS_PER_WORD;  // the quad's first element, in vec4s
                        [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
                            if (h < GROUP) {
                                uint qb = h * (HEAD_DIM / 4u) + d4;
                                s[h] += dot(k0, q_sh[qb]);
                                if (ROW_HALF > 0u)
                                    s[h] += dot(k1, q_sh[qb + 1u]);
                            }
                        }
                    }
                } else {
                    [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
                        s[h] = NEG_INF;
                }
                [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
                    if (h < GROUP) {
                        p_sh[h * CHUNK + x] = s[h];
                        mx[h] = max(mx[h], s[h]);
                    }
                }
            }
            [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
                if (h < GROUP)
                    red_sh[h * LOCAL + tid] = mx[h];
            // 2. the chunk's maximum, the new running maximum, probabilities and their sum
            reduce_group(true);
            float m_new[MAX_G], sum[MAX_G];
            [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
                m_new[h] = h < GROUP ? max(m_sh[h], red_sh[h * LOCAL]) : 0.0;
                sum[h] = 0.0;
            }
            barrier();  // everyone has read red_sh before it is reused
            for (uint x = tid; x < CHUNK; x += LOCAL)
                [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
                    if (h < GROUP) {
                        float p = exp(p_sh[h * CHUNK + x] - m_new[h]);  // 0 past the chunk's end
                        p_sh[h * CHUNK + x] = p;
                        sum[h] += p;
                    }
            [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
                if (h < GROUP)
                    red_sh[h * LOCAL + tid] = sum[h];
            reduce_group(false);
            float corr[MAX_G];
            [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
                corr[h] = h < GROUP ? exp(m_sh[h] - m_new[h]) : 0.0;  // 0 on the first chunk (m = -inf)
            barrier();  // all have read m_sh (and red_sh) before invocation h updates them
            if (tid < GROUP) {
                l_sh[tid] = l_sh[tid] * corr[tid] + red_sh[tid * LOCAL];
                m_sh[tid] = m_new[tid];
            }
            // 3. values: word `word` of each token lane's rows
            [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
                acc[h] *= corr[h];
            // VALUE_UNROLL tokens' words loaded before any is used: independent loads in flight
            // together, so the loop does not wait out a memory latency per token
            if (lane < lanes)
                for (uint x0 = lane; x0 < n; x0 += lanes * VALUE_UNROLL) {
                    uint wv[VALUE_UNROLL], ws[VALUE_UNROLL];
                    [[unroll]] for (uint u = 0u; u < VALUE_UNROLL; ++u) {
                        uint x = x0 + u * lanes;
                        uint base = v_base + (c0 + min(x, n - 1u)) * ROW_WORDS;  // past the end: unused
                        wv[u] = cache_words[base + (ROW_Q8 > 0u ? Q8_SCALE_WORDS : 0u) + word];
                        ws[u] = ROW_Q8 > 0u ? cache_words[base + word / 16u] : 0u;  // block word/8's scale pair
                    }
                    [[unroll]] for (uint u = 0u; u < VALUE_UNROLL; ++u) {
                        uint x = x0 + u * lanes;
                        if (x < n) {
                            vec4 v;
                            if (ROW_Q8 > 0u)
                                v = int8x4(wv[u]) * unpackHalf2x16(ws[u])[(word / 8u) % 2u];
                            else if (ROW_HALF > 0u)
                                v = vec4(unpackHalf2x16(wv[u]), 0.0, 0.0);
                            else
                                v = vec4(uintBitsToFloat(wv[u]), 0.0, 0.0, 0.0);
                            [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
                                if (h < GROUP)
                                    acc[h] += p_sh[h * CHUNK + x] * v;
                        }
                    }
                }
            barrier();  // the chunk's probabilities are read before the next chunk's scores
        }

        // the token lanes' accumulators, summed through shared memory (p_sh is free now;
        // the host sizes CHUNK ≥ lanes × HEAD_DIM)
        [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
            if (h < GROUP) {
                if (lane < lanes) {
                    [[unroll]] for (uint e = 0u; e < DIMS_PER_WORD; ++e)
                        p_sh[(lane * GROUP + h) * HEAD_DIM + word * DIMS_PER_WORD + e] = acc[h][e];
                }
            }
        }
        barrier();
        uint rec0 = record(i, g, pc.n_kv);
        for (uint x = tid; x < GROUP * HEAD_DIM; x += LOCAL) {
            float a = 0.0;
            for (uint ln = 0u; ln < lanes; ++ln)
                a += p_sh[ln * GROUP * HEAD_DIM + x];
            acc_floats[rec0 * HEAD_DIM + x] = a;  // record (i, g, h) = rec0 + h: h-major, like x
        }
        if (tid < GROUP) {
            stats[(rec0 + tid) * 2u] = m_sh[tid];
            stats[(rec0 + tid) * 2u + 1u] = l_sh[tid];
        }
        barrier();  // shared memory is reused by the next item
    }
}
