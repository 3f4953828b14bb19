// Keys coded before RoPE (kvdict_vk.rope: the one definition; docs/ARENA.md): a layer's
// rotation table holds, for position t = hi·B + lo (B = 1 << shift), row hi (angles hi·B·ω),
// HEAD_DIM/4 quads a row, and after the hi_rows rows the lo angles lo·ω quad-major (quad c of
// every lo, then quad c + 1's); quad c is (cos, sin, cos, sin) of pairs 2c and 2c + 1 — the
// pairs of a key's vec4 chunk c.

// The table quads of chunk c at position t: (hi row's, lo angle's) quad indices, counted from
// the table's first quad.
uvec2 rope_quads(uint t, uint c, uint hi_rows, uint shift, uint row_quads) {
    return uvec2((t >> shift) * row_quads + c, hi_rows * row_quads + (c << shift) + (t & ((1u << shift) - 1u)));
}

// Chunk x turned by the angle sum of quads hi and lo, in float32 as
// kvdict_vk.rope.rotate_tabled spells it.
vec4 rope_turn(vec4 x, vec4 hi, vec4 lo) {
    vec2 c = hi.xz * lo.xz - hi.yw * lo.yw;
    vec2 s = hi.yw * lo.xz + hi.xz * lo.yw;
    return vec4(x.x * c.x - x.y * s.x, x.x * s.x + x.y * c.x, x.z * c.y - x.w * s.y, x.z * s.y + x.w * c.y);
}
