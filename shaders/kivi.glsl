// The KIVI cache's words (kvdict_vk.kivi, docs/ARENA.md) and their ONE decoder: how a stats
// word, a unit of levels and a window row decode. attend_flash.comp's and attend_mma.comp's
// KIVI builds decode units of levels; the read-out (read_rows_kivi.comp) takes the stats word
// and the window row from here and a level at a time from slot.glsl, as the reference does.
// Pure functions of words (the includer owns its buffers). Needs slot.glsl (level_window: the
// levels' bitstream is the slot's residual's).
//   stats word   binary16 scale in the low half, binary16 minimum in the high half
//   level        element e of a row at bit e*b of its level words (possibly straddling two)
//   window       a ring of `window` binary16 rows per KIVI head: token t at slot t mod window
//   statistics   per KIVI head and 32-token group, a stats word per channel
// A KIVI head is a KV head's sequence (layout.StreamLayout.kivi_head; the KV head in an arena of
// one sequence).
const uint KIVI_GROUP = 32u;  // kvdict_vk.kivi.GROUP: tokens of a key group, dims of a value group
const uint KIVI_UNIT = 8u;    // elements a unit decodes at once (attend_flash's row unit)

// (scale, min) of a stats word
vec2 kivi_scale_min(uint stats) { return unpackHalf2x16(stats); }

// The KIVI head of KV head g's sequence s in an arena of `seqs` sequences.
uint kivi_head(uint g, uint s, uint seqs) { return g * seqs + s; }

// The first word of KIVI head h's window row of token t: a ring of `window` rows of
// head_dim / 2 words each, from word `base`.
uint kivi_window_row(uint base, uint h, uint t, uint window, uint head_dim) {
    return base + (h * window + t % window) * (head_dim / 2u);
}

// The first of the head_dim stats words of token t's key group in KIVI head h (each head
// `rows` tokens: ⌈rows / 32⌉ groups), from word `base`.
uint kivi_stats_row(uint base, uint h, uint t, uint rows, uint head_dim) {
    return base + (h * ((rows + KIVI_GROUP - 1u) / KIVI_GROUP) + t / KIVI_GROUP) * head_dim;
}

// --- units: KIVI_UNIT levels decoded together, without an int→float conversion -------------
// A level l of b bits is read as x = 1 + l / 2^b (its bits at the top of 1.0's mantissa: a
// shift, an and, an or), and its value l·scale + min as x·S + B with S = scale·2^b (exact) and
// B = min − S: x·S is exact in float32 (b + 1 bits times binary16's 11), so the fused
// multiply-add rounds min + l·scale once — as the reference does, up to B's rounding.

// Words that hold a unit's levels at most: 8 levels of `bits` from bit 8·unit·bits span
// ceil((32 − gcd(8·bits, 32) + 8·bits) / 32) words.
uint kivi_unit_words(uint bits) { return bits == 7u ? 3u : (bits == 2u || bits == 4u ? 1u : 2u); }

// The first of unit u's level words in a row's levels, and its first level's bit in it.
uint kivi_unit_word(uint u, uint bits) { return (u * KIVI_UNIT * bits) >> 5u; }
uint kivi_unit_bit(uint u, uint bits) { return (u * KIVI_UNIT * bits) & 31u; }

// The level at bit sh (sh + bits <= 32) of `win` as 1 + level / 2^bits.
float kivi_level_x(uint win, uint sh, uint bits) {
    uint top = 23u - bits;
    uint v = sh <= top ? win << (top - sh) : win >> (sh - top);
    return uintBitsToFloat((v & (((1u << bits) - 1u) << top)) | 0x3F800000u);
}

// A unit's 8 levels as 1 + level / 2^bits, from its words w (kivi_unit_words of them, the
// rest any value) whose first level starts at bit `bit` of w.x: element j into lo/hi.
// LEVELS_BY_HALVES (a build-time knob for probes): 4-bit levels two at a time — elements j
// and j + 4, 16 bits apart, moved to the top of two binary16 1.0s' mantissas and widened
// (one shift, one and-or, one unpack for two).
#ifndef LEVELS_BY_HALVES
#define LEVELS_BY_HALVES 1
#endif
void kivi_unit_x(uvec3 w, uint bit, uint bits, out vec4 lo, out vec4 hi) {
    uint n0 = level_window(w.x, w.y, bit), n1 = level_window(w.y, w.z, bit);  // the unit's 64 bits
#if LEVELS_BY_HALVES
    if (bits == 4u) {
        vec2 p0 = unpackHalf2x16(((n0 << 6u) & 0x03C003C0u) | 0x3C003C00u);  // elements 0, 4
        vec2 p1 = unpackHalf2x16(((n0 << 2u) & 0x03C003C0u) | 0x3C003C00u);  // 1, 5
        vec2 p2 = unpackHalf2x16(((n0 >> 2u) & 0x03C003C0u) | 0x3C003C00u);  // 2, 6
        vec2 p3 = unpackHalf2x16(((n0 >> 6u) & 0x03C003C0u) | 0x3C003C00u);  // 3, 7
        lo = vec4(p0.x, p1.x, p2.x, p3.x);
        hi = vec4(p0.y, p1.y, p2.y, p3.y);
        return;
    }
#endif
    float x[8];
    [[unroll]] for (uint j = 0u; j < KIVI_UNIT; ++j) {
        uint sh = j * bits;
        if (sh + bits <= 32u)
            x[j] = kivi_level_x(n0, sh, bits);
        else if (sh >= 32u)
            x[j] = kivi_level_x(n1, sh - 32u, bits);
        else
            x[j] = kivi_level_x(level_window(n0, n1, sh), 0u, bits);
    }
    lo = vec4(x[0], x[1], x[2], x[3]);
    hi = vec4(x[4], x[5], x[6], x[7]);
}

// (S, B) of a stats word for levels of `bits`: value = x·S + B (above).
vec2 kivi_fold(uint stats, uint bits) {
    vec2 sm = kivi_scale_min(stats);
    float s = sm.x * float(1u << bits);
    return vec2(s, sm.y - s);
}
