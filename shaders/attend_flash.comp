#version 450
// Decode attention over the uncoded cache (f16, f32 or q8_0 rows), shaped for GPUs: ONE WORKGROUP
// per (split i, KV head g) attends all GROUP query heads of g over the split's tokens, so each
// key and value row is read from memory once (FlashDecoding: the context split across
// workgroups, the running softmax in registers and shared memory, attend_merge_head.comp
// combining the splits' records in one small pass). The split is walked in chunks of LOCAL
// tokens:
//   1. values first: each invocation issues the loads of its (token lane, row unit) share of
//      the chunk's V rows — a unit is a uvec4 of f16/f32 rows or a q8_0 word, so neighbouring
//      invocations read neighbouring words — and they are in flight while the keys compute;
//   2. keys — one token per invocation (its row read as contiguous vec4s), dotted with the
//      GROUP query vectors held in shared memory;
//   3. the softmax reference m moves only when a score exceeds it by more than GROW_MARGIN
//      (a flag, then a workgroup maximum: the first chunk and rarely after), so a chunk needs
//      no reduction: probabilities stay ≤ e^GROW_MARGIN and each invocation sums its own;
//   4. the probabilities through shared memory to the value lanes, accumulating p·v in
//      registers (rescaled when m moves).
// At the end the token lanes' accumulators are summed in shared memory and the split's
// record (m, l, acc — attend_common.glsl's layout) is written. No optional feature: tree
// reductions in shared memory, 32-bit storage only.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "attend_common.glsl"

layout(constant_id = 4) const uint ROW_HALF = 1u;  // 1: f16 rows (two halves a word), 0: f32
// 1: q8_0 rows (ROW_HALF 0): the block scales (f16 pairs), then the int8 values four to a word
layout(constant_id = 5) const uint ROW_Q8 = 0u;
const uint LOCAL = gl_WorkGroupSize.x;  // specialization constant 2: tokens per chunk
const uint Q8_SCALE_WORDS = (HEAD_DIM / 32u + 1u) / 2u;
const uint ROW_WORDS = ROW_Q8 > 0u ? Q8_SCALE_WORDS + HEAD_DIM / 4u : (ROW_HALF > 0u ? HEAD_DIM / 2u : HEAD_DIM);
const uint ROW_QUADS = ROW_WORDS / 4u;  // f16 / f32 rows: HEAD_DIM % 8 == 0 / % 4 == 0 (host-checked)
// the value pass's unit: a uvec4 (8 halves or 4 floats) or a q8_0 value word (4 int8)
const uint UNIT_DIMS = ROW_Q8 > 0u ? 4u : (ROW_HALF > 0u ? 8u : 4u);
const uint UNITS = HEAD_DIM / UNIT_DIMS;  // units of a row; LOCAL % UNITS == 0 (host)
const uint VLANES = LOCAL / UNITS;        // token lanes of the value pass
const uint VBATCH = UNITS < 16u ? UNITS : 16u;  // value units per invocation loaded together
const uint MAX_G = 8u;  // registers per query head are unrolled up to this; GROUP <= MAX_G (host)
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
    uint n_used;    // attend over tokens 0 .. n_used-1
    uint split_len; // tokens per split
    uint n_splits;  // splits per KV head
    uint n_kv;
    float score_scale;
} pc;

shared vec4 q_sh[GROUP * HEAD_DIM / 4u];  // vec4: one shared load per four query elements
shared float p_sh[GROUP * LOCAL];   // the chunk's probabilities; reductions; the end's sums
shared uint grow_sh;

void reduce(bool take_max) {  // p_sh[h*LOCAL + x] over x → p_sh[h*LOCAL]
    for (uint width = LOCAL / 2u; width > 0u; width >>= 1u) {
        barrier();
        uint x = gl_LocalInvocationID.x;
        if (x < width)
            for (uint h = 0u; h < GROUP; ++h) {
                float a = p_sh[h * LOCAL + x], b = p_sh[h * LOCAL + x + width];
                p_sh[h * LOCAL + x] = take_max ? max(a, b) : a + b;
            }
    }
    barrier();
}

// Unit `unit` of a V row starting at word `base`: its elements as two vec4s (f16: 8, else 4
// in the first), from the unit's words (f16 / f32: a uvec4; q8_0: the value word in .x and
// its block's scale pair in .y).
void unit_values(uvec4 w, uint unit, out vec4 lo, out vec4 hi) {
    if (ROW_Q8 > 0u) {
        lo = int8x4(w.x) * unpackHalf2x16(w.y)[(unit / 8u) % 2u];
        hi = vec4(0.0);
    } else if (ROW_HALF > 0u) {
        lo = vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y));
        hi = vec4(unpackHalf2x16(w.z), unpackHalf2x16(w.w));
    } else {
        lo = uintBitsToFloat(w);
        hi = vec4(0.0);
    }
}

uvec4 load_unit(uint base, uint unit) {
    if (ROW_Q8 > 0u)
        return uvec4(cache_words[base + Q8_SCALE_WORDS + unit], cache_words[base + unit / 16u], 0u, 0u);
    return cache_quads[(base >> 2u) + unit];
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint unit = tid % UNITS, vlane = tid / UNITS;
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
        if (tid == 0u)
            grow_sh = 0u;
        float m[MAX_G], l[MAX_G];   // the reference (uniform) and this invocation's sum of p
        vec4 acc_lo[MAX_G], acc_hi[MAX_G];  // the unit's elements of each head's sum of p·v
        [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
            m[h] = NEG_INF;
            l[h] = 0.0;
            acc_lo[h] = vec4(0.0);
            acc_hi[h] = vec4(0.0);
        }
        barrier();

        uint k_base = pc.k_word + g * pc.n_ctx * ROW_WORDS;
        uint v_base = pc.v_word + g * pc.n_ctx * ROW_WORDS;
        for (uint c0 = t0; c0 < t1; c0 += LOCAL) {
            uint n = min(LOCAL, t1 - c0);
            // 1. the first batch of this invocation's value units: loads in flight during the keys
            uvec4 vw[VBATCH];
            [[unroll]] for (uint u = 0u; u < VBATCH; ++u)
                vw[u] = load_unit(v_base + (c0 + min(vlane + u * VLANES, n - 1u)) * ROW_WORDS, unit);
            // 2. this invocation's key
            float s[MAX_G];
            [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
                s[h] = 0.0;
            uint base = k_base + (c0 + min(tid, n - 1u)) * ROW_WORDS;
            if (ROW_Q8 > 0u) {
                [[unroll]] for (uint blk = 0u; blk < HEAD_DIM / 32u; ++blk) {
                    float d = unpackHalf2x16(cache_words[base + blk / 2u])[blk % 2u];
                    [[unroll]] for (uint u = 0u; u < 8u; ++u) {
                        uint c = blk * 8u + u;  // value word c: elements 4c .. 4c+3
                        vec4 kv = int8x4(cache_words[base + Q8_SCALE_WORDS + c]) * d;
                        [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
                            if (h < GROUP)
                                s[h] += dot(kv, q_sh[h * (HEAD_DIM / 4u) + c]);
                    }
                }
            } else {
                [[unroll]] for (uint c = 0u; c < ROW_QUADS; ++c) {
                    vec4 k0, k1;
                    unit_values(cache_quads[(base >> 2u) + c], 0u, k0, k1);
                    uint d4 = c * (ROW_HALF > 0u ? 2u : 1u);  // the quad's first element, in vec4s
                    [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
                        if (h < GROUP) {
                            s[h] += dot(k0, q_sh[h * (HEAD_DIM / 4u) + d4]);
                            if (ROW_HALF > 0u)
                                s[h] += dot(k1, q_sh[h * (HEAD_DIM / 4u) + d4 + 1u]);
                        }
                    }
                }
            }
            bool grow = false;
            [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
                if (h < GROUP) {
                    s[h] = tid < n ? s[h] : NEG_INF;
                    grow = grow || s[h] > m[h] + GROW_MARGIN;
                }
            }
            if (grow)
                grow_sh = 1u;
            barrier();
            // 3. a score far above the reference: the chunk's maximum becomes it (uniform branch)
            if (grow_sh != 0u) {
                [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
                    if (h < GROUP)
                        p_sh[h * LOCAL + tid] = s[h];
                reduce(true);
                [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
                    if (h < GROUP) {
                        float m_new = max(m[h], p_sh[h * LOCAL]);
                        float corr = exp(m[h] - m_new);  // 0 on the first chunk (m = -inf)
                        m[h] = m_new;
                        l[h] *= corr;
                        acc_lo[h] *= corr;
                        acc_hi[h] *= corr;
                    }
                }
                barrier();  // all have read the maximum
                if (tid == 0u)
                    grow_sh = 0u;
            }
            [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
                if (h < GROUP) {
                    float p = exp(s[h] - m[h]);  // 0 past the chunk's end
                    l[h] += p;
                    p_sh[h * LOCAL + tid] = p;
                }
            }
            barrier();
            // 4. values: the unit's elements of the lane's tokens, the first batch already loaded
            for (uint x0 = 0u; x0 < UNITS; x0 += VBATCH) {
                if (x0 > 0u)
                    [[unroll]] for (uint u = 0u; u < VBATCH; ++u)
                        vw[u] = load_unit(v_base + (c0 + min(vlane + (x0 + u) * VLANES, n - 1u)) * ROW_WORDS, unit);
                [[unroll]] for (uint u = 0u; u < VBATCH; ++u) {
                    uint x = vlane + (x0 + u) * VLANES;
                    if (x < n) {
                        vec4 lo, hi;
                        unit_values(vw[u], unit, lo, hi);
                        [[unroll]] for (uint h = 0u; h < MAX_G; ++h) {
                            if (h < GROUP) {
                                float p = p_sh[h * LOCAL + x];
                                acc_lo[h] += p * lo;
                                if (ROW_HALF > 0u && ROW_Q8 == 0u)
                                    acc_hi[h] += p * hi;
                            }
                        }
                    }
                }
            }
            barrier();  // the chunk's probabilities are read before the next chunk's
        }

        // the token lanes' accumulators, summed through shared memory one element of the unit
        // at a time (p_sh holds GROUP × LOCAL = GROUP × VLANES × UNITS floats)
        uint rec0 = record(i, g, pc.n_kv);
        [[unroll]] for (uint e = 0u; e < UNIT_DIMS; ++e) {
            barrier();
            [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
                if (h < GROUP)
                    p_sh[h * LOCAL + tid] = e < 4u ? acc_lo[h][e % 4u] : acc_hi[h][e % 4u];
            barrier();
            for (uint x = tid; x < GROUP * UNITS; x += LOCAL) {
                uint h = x / UNITS, un = x - h * UNITS;
                float a = 0.0;
                for (uint ln = 0u; ln < VLANES; ++ln)
                    a += p_sh[h * LOCAL + ln * UNITS + un];
                acc_floats[(rec0 + h) * HEAD_DIM + un * UNIT_DIMS + e] = a;  // record (i, g, h) = rec0 + h
            }
        }
        barrier();
        [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
            if (h < GROUP)
                p_sh[h * LOCAL + tid] = l[h];
        reduce(false);
        [[unroll]] for (uint h = 0u; h < MAX_G; ++h)
            if (h < GROUP && tid == h) {
                stats[(rec0 + h) * 2u] = m[h];
                stats[(rec0 + h) * 2u + 1u] = p_sh[h * LOCAL];
            }
        barrier();  // shared memory is reused by the next item
    }
}
