// The KIVI cache's words (kvdict_vk.kivi, docs/ARENA.md): how a stats word, a level and a
// window row decode — the shaders that read the cache in place (attend_flash_kivi.comp)
// share these; pure functions of words (the includer owns its buffers). Needs slot.glsl
// (residual_level: the levels' bitstream is the slot's).
//   stats word   binary16 scale in the low half, binary16 minimum in the high half
//   level        element e of a row at bit e*b of its level words (possibly straddling two)
//   window       a ring of `window` binary16 rows per KV head: token t at slot t mod window
const uint KIVI_GROUP = 32u;  // kvdict_vk.kivi.GROUP: tokens of a key group, dims of a value group

// (scale, min) of a stats word
vec2 kivi_scale_min(uint stats) { return unpackHalf2x16(stats); }

// level * scale + min (the reference rounds twice; a fused multiply-add differs by an ulp at
// most, far inside the attention's 1e-9 NMSE)
float kivi_value(uint level, vec2 scale_min) { return float(level) * scale_min.x + scale_min.y; }

// The first word of KV head h's window row of token t: a ring of `window` rows of
// head_dim / 2 words each, from word `base`.
uint kivi_window_row(uint base, uint h, uint t, uint window, uint head_dim) {
    return base + (h * window + t % window) * (head_dim / 2u);
}

// Whether element e's level (bits e*b .. e*b+b-1 of the row's level words) reaches into the
// next word: only then is that word read.
bool kivi_straddles(uint e, uint bits) { return ((e * bits) & 31u) + bits > 32u; }
