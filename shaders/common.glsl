// Shared by every kvdict_vk compute shader. Compiled with
//   glslangValidator -V --target-env vulkan1.1 [-DVEC4=0|1]
// No optional Vulkan feature or extension: 32-bit uint/float storage buffers only,
// no subgroup operations (a variant built with -DSUBGROUP=1, attend_flash_sg, uses shuffles
// and runs only where the device reports them), workgroups of WG_SIZE (<= 128) invocations.
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

#include "slot.glsl"

// --- bounds helpers -------------------------------------------------------------------------
// Every shader walks its work items with a grid-stride loop, so the dispatch size is a
// tuning choice (bounded by maxComputeWorkGroupCount) and never a correctness one.
uint grid_stride() { return gl_NumWorkGroups.x * WG_SIZE; }

// --- q8_0 rows (docs/ARENA.md, kvdict_vk.layout.q8_0_words) ------------------------------------
// The four int8 values of a word (element 4k in the low byte), as floats, exact either way:
// bitfieldExtract of a signed int sign-extends, then converts. INT8_BY_BITS 1 (a build-time
// knob for probes): without an int→float conversion — each byte + 128 in the mantissa of 2^23,
// minus 2^23 + 128 (slower in attend_flash on an H100: lab/NOTEBOOK.md).
#ifndef INT8_BY_BITS
#define INT8_BY_BITS 0
#endif
vec4 int8x4(uint w) {
#if INT8_BY_BITS
    uint u = w ^ 0x80808080u;
    return uintBitsToFloat(uvec4(u & 0xFFu, (u >> 8u) & 0xFFu, (u >> 16u) & 0xFFu, u >> 24u) | 0x4B000000u)
           - 8388736.0;
#else
    int s = int(w);
    return vec4(bitfieldExtract(s, 0, 8), bitfieldExtract(s, 8, 8), bitfieldExtract(s, 16, 8), bitfieldExtract(s, 24, 8));
#endif
}
