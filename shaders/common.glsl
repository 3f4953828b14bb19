// Shared by every kvdict_vk compute shader. Compiled with
//   glslangValidator -V --target-env vulkan1.1 [-DVEC4=0|1]
// No optional Vulkan feature or extension: 32-bit uint/float storage buffers only,
// no subgroup operations, workgroups of WG_SIZE (<= 128) invocations.
// (GL_GOOGLE_include_directive, used to include this file, is a front-end feature of
// glslang; it leaves no capability or extension in the SPIR-V.)

// 64 invocations: two warps / one wave64 on GPUs, eight 8-wide SIMD rows on llvmpipe.
#define WG_SIZE 64u

// Element type of the "wide" views: vec4/uvec4 where head_dim % 4 == 0, else scalars.
#ifndef VEC4
#define VEC4 1
#endif
#if VEC4
#define LANES 4u
#define FELEM vec4
#define UELEM uvec4
#else
#define LANES 1u
#define FELEM float
#define UELEM uint
#endif

// --- code words (DESIGN.md): bits 0-15 atom index, bits 16-31 binary16 coefficient ------
uint code_atom(uint word) { return word & 0xFFFFu; }
float code_coef(uint word) { return unpackHalf2x16(word >> 16u).x; }

// --- bounds helpers -------------------------------------------------------------------------
// Every shader walks its work items with a grid-stride loop, so the dispatch size is a
// tuning choice (bounded by maxComputeWorkGroupCount) and never a correctness one.
uint grid_stride() { return gl_NumWorkGroups.x * WG_SIZE; }

// An out-of-range code word (atom index >= n_atoms) contributes exactly zero and never reads
// outside the atoms: it is redirected to atom 0 with coefficient 0 (atoms are finite), the
// documented behaviour shared with codec.reconstruct.
uint safe_atom(uint atom, uint n_atoms) { return atom < n_atoms ? atom : 0u; }
float safe_coef(uint atom, uint n_atoms, float coef) { return atom < n_atoms ? coef : 0.0; }

// --- residual stage (docs/FORMAT.md, kvdict_vk.residual) --------------------------------------
// After a slot's code words: ceil(head_dim*b/32) words holding head_dim b-bit levels (element e
// at bit e*b of the little-endian stream, possibly straddling two words), then the step as
// float32. Element e decodes as (level - (2^b - 1)/2) * step * residual_scale[e].
//
// The level of the element starting at bit `bit` (0..31) of word w0, w1 being the next word
// (only read when the level straddles; pass anything otherwise).
uint residual_level(uint w0, uint w1, uint bit, uint bits) {
    uint v = w0 >> bit;
    if (bit + bits > 32u)
        v |= w1 << (32u - bit);  // bit > 0 here, so the shift is < 32
    return v & ((1u << bits) - 1u);
}
float residual_half(uint bits) { return float((1u << bits) - 1u) * 0.5; }

// --- q8_0 rows (docs/ARENA.md, kvdict_vk.layout.q8_0_words) ------------------------------------
// The four int8 values of a word (element 4k in the low byte), as floats: bitfieldExtract of
// a signed int sign-extends.
vec4 int8x4(uint w) {
    int s = int(w);
    return vec4(bitfieldExtract(s, 0, 8), bitfieldExtract(s, 8, 8), bitfieldExtract(s, 16, 8), bitfieldExtract(s, 24, 8));
}
