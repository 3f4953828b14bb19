// A dict-coded stream's atoms in the layer's tail (kvdict_vk.layout, docs/ARENA.md) and their
// ONE decoder (reconstruct.comp gathers with its own chunk mapping through it). The arena keeps
// one copy a stream: float32 rows (HEAD_DIM words an atom) or, ATOMS_F16 (every atom a
// binary16 value, HEAD_DIM % 8 == 0), binary16 in chunk-pair order (HEAD_DIM / 2 words an
// atom: its uvec4 p, 8 halves, holds elements 4p … 4p+3 then HEAD_DIM/2 + 4p … HEAD_DIM/2 +
// 4p+3; rows.atoms_f16_order), widened exactly — so every reader stays exact. The includer
// declares HEAD_DIM and ATOMS_F16 (a bool specialization constant) and reads the layer
// through a uvec4 view; `base` below is the uvec4 index of a dictionary head's atoms
// ((atoms_word + g·head_atoms) / 4: the host keeps both multiples of 4).
const uint ATOM_QUADS = ATOMS_F16 ? HEAD_DIM / 8u : HEAD_DIM / 4u;  // uvec4s an atom
const uint ATOM_HALF_QUADS = HEAD_DIM / 8u;                         // binary16: the lower half's quads

// The uvec4 that holds element quad c (elements 4c … 4c+3) of atom a.
uint atom_quad_index(uint base, uint a, uint c) {
    return base + a * ATOM_QUADS + (ATOMS_F16 ? c % ATOM_HALF_QUADS : c);
}

// A binary16 uvec4's two element quads: its lower half's (quad p) and its upper half's
// (quad p + HEAD_DIM/8).
vec4 atom_quad_lo(uvec4 w) { return vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y)); }
vec4 atom_quad_hi(uvec4 w) { return vec4(unpackHalf2x16(w.z), unpackHalf2x16(w.w)); }

// Element quad c of an atom, from the uvec4 atom_quad_index names.
vec4 atom_quad(uvec4 w, uint c) {
    if (!ATOMS_F16)
        return uintBitsToFloat(w);
    return c < ATOM_HALF_QUADS ? atom_quad_lo(w) : atom_quad_hi(w);
}

// The whole of atom a, HEAD_DIM / 4 element quads, into vec4 atom[] (a macro: GLSL passes no
// buffer): binary16, a uvec4 for two quads half a row apart; float32, a uvec4 a quad.
#define LOAD_ATOM(quads, base, a, atom) \
    if (ATOMS_F16) { \
        [[unroll]] for (uint p_ = 0u; p_ < ATOM_HALF_QUADS; ++p_) { \
            uvec4 w_ = quads[(base) + (a) * ATOM_QUADS + p_]; \
            atom[p_] = atom_quad_lo(w_); \
            atom[p_ + ATOM_HALF_QUADS] = atom_quad_hi(w_); \
        } \
    } else { \
        [[unroll]] for (uint c_ = 0u; c_ < HEAD_DIM / 4u; ++c_) \
            atom[c_] = uintBitsToFloat(quads[(base) + (a) * ATOM_QUADS + c_]); \
    }
