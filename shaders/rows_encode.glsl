// float32 rows → the words an uncoded cache stores (kvdict_vk.rows.row_words_of: binary16
// pairs, q8_0 rows), in integer arithmetic where a float operation's rounding is the
// device's choice: the same bits as NumPy's on every conformant device.
// Vulkan leaves float32 → float16 conversion's rounding to the implementation and float
// division at 2.5 ULP; OpFMul and OpFAdd are correctly rounded (`precise`: never contracted
// into an fma, which rounds once where NumPy rounds twice).

// What a stream's recorded append converts (kvdict_vk.rows.APPEND_FORMATS): its rows' words as
// given (f32 rows, a coded stream's slots), binary16 pairs, q8_0 blocks.
#define FORMAT_WORDS 0u
#define FORMAT_F16 1u
#define FORMAT_Q8_0 2u

// NumPy's float32 → binary16 (round to nearest, ties to even; overflow → ±inf; a NaN keeps
// its sign and the top ten bits of its payload, made nonzero).
uint f16_bits(float f) {
    uint x = floatBitsToUint(f);
    uint sign = (x >> 16u) & 0x8000u;
    uint e = (x >> 23u) & 0xFFu;
    uint m = x & 0x7FFFFFu;
    if (e == 0xFFu)
        return sign | 0x7C00u | (m != 0u ? max(m >> 13u, 1u) : 0u);
    if (e >= 143u)  // ≥ 2^16: beyond the largest binary16 even after rounding
        return sign | 0x7C00u;
    if (e <= 112u) {  // below 2^-14: a binary16 subnormal, or zero
        if (e < 102u)  // below 2^-25: rounds to ±0 (2^-25 itself is the tie, kept below)
            return sign;
        uint full = m | 0x800000u;  // e ≥ 102: shift 126 - e in 14 .. 24
        uint shift = 126u - e;
        uint kept = full >> shift;
        uint rest = full & ((1u << shift) - 1u);
        uint half_ulp = 1u << (shift - 1u);
        if (rest > half_ulp || (rest == half_ulp && (kept & 1u) != 0u))
            kept += 1u;  // a carry into 0x400 is the smallest normal binary16: right
        return sign | kept;
    }
    uint h = ((e - 112u) << 10u) | (m >> 13u);
    uint rest = m & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u) != 0u))
        h += 1u;  // a carry out of the mantissa steps the exponent (to infinity past 65504)
    return sign | h;
}

// A positive finite float as m · 2^e, m in [2^23, 2^24) (subnormals normalised).
void float_parts(uint bits, out uint m, out int e) {
    uint ex = bits >> 23u;
    m = bits & 0x7FFFFFu;
    if (ex == 0u) {
        int s = 23 - findMSB(m);
        m <<= uint(s);
        e = -149 - s;
    } else {
        m |= 0x800000u;
        e = int(ex) - 150;
    }
}

// a / b correctly rounded (to nearest even), a ≥ 0 and b > 0 finite: restoring division of
// the mantissas, subnormal and infinite results included.
float div_rn(float a, float b) {
    if (a == 0.0)
        return 0.0;
    uint ma, mb;
    int ea, eb;
    float_parts(floatBitsToUint(a), ma, ea);
    float_parts(floatBitsToUint(b), mb, eb);
    int e = ea - eb;  // a / b = (ma / mb) · 2^e
    if (ma < mb) {
        ma <<= 1u;
        e -= 1;
    }
    uint q = 0u, r = ma;  // ma / mb in [1, 2): 25 quotient bits, q = floor(ma / mb · 2^24)
    for (int i = 0; i < 25; ++i) {
        q <<= 1u;
        if (r >= mb) {
            r -= mb;
            q |= 1u;
        }
        r <<= 1u;
    }
    // a / b = (q + r/…) · 2^(e - 24); e + 127 is the biased exponent where normal
    if (e + 127 >= 255)
        return uintBitsToFloat(0x7F800000u);
    int shift = max(1, -(e + 125));  // 1 where normal; more into the subnormals
    if (shift > 26)
        return 0.0;
    uint kept = q >> uint(shift);
    uint rest = q & ((1u << uint(shift)) - 1u);
    uint half_ulp = 1u << uint(shift - 1);
    bool sticky = r != 0u;
    if (rest > half_ulp || (rest == half_ulp && (sticky || (kept & 1u) != 0u)))
        kept += 1u;
    // normal: kept holds the implicit bit, which adds one to the exponent field
    return uintBitsToFloat(shift == 1 ? (uint(e + 126) << 23u) + kept : kept);
}

// q8_0 (kvdict_vk.rows.q8_0_words): a block of 32 with d = max|x| / 127 and q = trunc(x · (1/d)
// + copysign(0.5, x)), 0 where d is; d kept as binary16. Finite input.
float q8_inverse_scale(float d) { return d > 0.0 ? div_rn(1.0, d) : 0.0; }

int q8_value(float x, float inv) {
    precise float scaled = x * inv;
    precise float rounded = scaled + uintBitsToFloat((floatBitsToUint(x) & 0x80000000u) | 0x3F000000u);
    return int(rounded);  // conversion to int truncates toward zero
}

#ifdef Q8_PAIR_ENCODER
// q8_0 blocks 2p and 2p + 1 of a row (the pair sharing scale word p) by a workgroup of WG_SIZE
// ≥ 64 invocations, every one of which calls it (barriers): invocation i < 64 holds element
// 64p + i in x (``real``: within the row; ``second``: block 2p + 1 is). The block's largest
// magnitude by a tree in shared memory, its d and 1/d by one invocation, four invocations'
// values packed by a fifth (an invocation a block took 3× the f16 append's time: two divisions
// of 25 steps and 32 values in a row). Returns the pair's words as a row stores them:
// invocation 0 the scale word (the second half 0 where there is no second block), invocation
// i < 16 value word i.
shared float q8_magnitude[WG_SIZE];
shared float q8_inverse[2];
shared uint q8_d[2];
shared uint q8_levels[WG_SIZE];

void q8_pair_words(float x, bool real, bool second, out uint scale_word, out uint value_word) {
    uint lid = gl_LocalInvocationID.x;
    x = real ? x : 0.0;
    q8_magnitude[lid] = abs(x);
    barrier();
    for (uint s = 16u; s > 0u; s >>= 1u) {  // within each half of 32: max, as max() is exact
        if ((lid & 31u) < s)
            q8_magnitude[lid] = max(q8_magnitude[lid], q8_magnitude[lid + s]);
        barrier();
    }
    if (lid < 2u && (lid == 0u || second)) {
        float d = div_rn(q8_magnitude[32u * lid], 127.0);
        q8_d[lid] = f16_bits(d);
        q8_inverse[lid] = q8_inverse_scale(d);
    } else if (lid < 2u) {
        q8_d[lid] = 0u;  // the pad half of a last, odd block's scale word
    }
    barrier();
    q8_levels[lid] = real ? uint(q8_value(x, q8_inverse[min(lid / 32u, 1u)])) & 0xFFu : 0u;
    barrier();
    scale_word = q8_d[0] | (q8_d[1] << 16u);
    uint q = 4u * min(lid, 15u);
    value_word = q8_levels[q] | (q8_levels[q + 1u] << 8u) | (q8_levels[q + 2u] << 16u) | (q8_levels[q + 3u] << 24u);
    barrier();  // shared memory read before the next pair overwrites it
}
#endif
