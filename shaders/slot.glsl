// The dict-coded slot (docs/FORMAT.md; kvdict_vk.residual.slot_words and .dequantise
// are its Python twins): the one place the shaders spell its layout and how a word of it
// decodes — readers (reconstruct, attend_*) and writers (omp_encode_*, encode_residual.glsl)
// alike. A slot of a stream with S code words and a b-bit residual stage over D elements:
//   words [0, S)                 code words: bits 0-15 atom index, bits 16-31 binary16 coefficient
//   words [S, S + L)             with b > 0: the levels, element e at bit e*b of the little-endian
//                                stream (possibly straddling two words), L = ceil(D*b/32)
//   word  S + L                  with b > 0: the step, float32
// Element e decodes as (level - (2^b - 1)/2) * step * residual_scale[e]; b is 1..8.
// Macros, not functions: GLSL sizes arrays and specialization constants only with constant
// expressions.
#define SLOT_LEVEL_WORDS_OF(D, BITS) (((D) * (BITS) + 31u) / 32u)
#define SLOT_STEP_WORD_OF(S, D, BITS) ((S) + SLOT_LEVEL_WORDS_OF(D, BITS))
// (b + 7) / 8 is 1 for any b in 1..8, 0 without a residual stage
#define SLOT_WORDS_OF(S, D, BITS) (SLOT_STEP_WORD_OF(S, D, BITS) + ((BITS) + 7u) / 8u)

// --- code words --------------------------------------------------------------------------
uint code_atom(uint word) { return word & 0xFFFFu; }
float code_coef(uint word) { return unpackHalf2x16(word >> 16u).x; }

// An out-of-range code word (atom index >= n_atoms) contributes exactly zero and never reads
// outside the atoms: it is redirected to atom 0 with coefficient 0 (atoms are finite), the
// documented behaviour shared with codec.reconstruct.
uint safe_atom(uint atom, uint n_atoms) { return atom < n_atoms ? atom : 0u; }
float safe_coef(uint atom, uint n_atoms, float coef) { return atom < n_atoms ? coef : 0.0; }

// --- the residual stage's levels ---------------------------------------------------------
// The level of the element starting at bit `bit` (0..31) of word w0, w1 being the next word
// (only read when the level straddles; pass anything otherwise).
uint residual_level(uint w0, uint w1, uint bit, uint bits) {
    uint v = w0 >> bit;
    if (bit + bits > 32u)
        v |= w1 << (32u - bit);  // bit > 0 here, so the shift is < 32
    return v & ((1u << bits) - 1u);
}
float residual_half(uint bits) { return float((1u << bits) - 1u) * 0.5; }
// Elements 4c .. 4c+3 of a slot's levels minus half (centre: residual_half(bits)) into the
// vec4 d, from lw: a private array of the slot's level words then one more (the "next word" of
// the last level: 0). A macro (the array's size is the includer's constant); unrolled, so with
// c a constant every element's word and shift are constants too. Needs
// GL_EXT_control_flow_attributes.
#define LEVEL_QUAD(d, lw, c, bits, centre)                                                    \
    [[unroll]] for (uint k_ = 0u; k_ < 4u; ++k_) {                                            \
        uint bit_ = (4u * (c) + k_) * (bits);                                                 \
        d[k_] = float(residual_level(lw[bit_ >> 5u], lw[(bit_ >> 5u) + 1u], bit_ & 31u, bits)) - (centre); \
    }
// The 32 bits of the level stream starting `off` bits (0..31) into word w0, w1 the next word
// (its bits are taken only when off > 0: pass 0 where no level straddles). No branch: for
// off = 0, (w1 << 1) << 31 drops every bit of w1.
uint level_window(uint w0, uint w1, uint off) { return (w0 >> off) | ((w1 << 1u) << (31u - off)); }
// level - half as a float without an int→float conversion (a quarter-rate instruction on
// NVIDIA GPUs): the level's bits in the mantissa of 2^22, whose ulp is 0.5, so
// float(0x4A800000 | level << 1) - (2^22 + half) = level - half exactly (levels < 2^22).
float centred_level(uint level, uint bits) {
    return uintBitsToFloat(0x4A800000u | (level << 1u)) - (4194304.0 + residual_half(bits));
}
// The first four levels of a window (level_window), centred: an element quad's.
vec4 centred_quad(uint win, uint bits) {
    uint m = (1u << bits) - 1u;
    return vec4(centred_level(win & m, bits), centred_level((win >> bits) & m, bits),
                centred_level((win >> (2u * bits)) & m, bits), centred_level((win >> (3u * bits)) & m, bits));
}
// Level e of a window (element e at bit e*bits) as 1 + level / 2^bits, also without a
// conversion: its bits moved to the top of 1.0's mantissa (one shift, one and, one or).
float window_unit_level(uint win, uint e, uint bits) {
    uint sh = e * bits, top = 23u - bits;
    uint v = sh <= top ? win << (top - sh) : win >> (sh - top);
    return uintBitsToFloat((v & (((1u << bits) - 1u) << top)) | 0x3F800000u);
}
