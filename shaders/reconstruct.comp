#version 450
// Dictionary reconstruction of one stream of one layer for a token range:
//   out[h, i, :] = mean[g] + sum_j coef_j * atoms[g, idx_j, :] + residual[h, t0 + i, :]
// for h < n_kv, i < n_tok, where g = h with per-head dictionaries and g = 0 when one
// dictionary is shared (the host passes the per-head strides head_atoms / head_vec, 0 when
// shared). Slots: word(h,t,j) = src_word + (h*n_ctx + t)*SLOT_WORDS + j; a slot is SPARSITY
// code words then, when RES_BITS > 0, the residual stage (slot.glsl). Atoms, means and
// residual scales are read straight from the layer buffer's tail; with ATOMS_F16 the atoms
// are binary16 (the arena's one copy when the forge rounded them: a quad of 8 halves per
// load, atoms.glsl).
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require  // [[dont_unroll]]: core SPIR-V LoopControl
#include "common.glsl"

layout(local_size_x = WG_SIZE) in;

layout(constant_id = 0) const uint HEAD_DIM = 64u;
layout(constant_id = 1) const uint SPARSITY = 8u;
// Output chunks (LANES floats each) per invocation and row: on GPUs a few (the host's
// arena.RECONSTRUCT_GPU_CHUNKS, measured; neighbouring invocations write neighbouring chunks:
// coalesced, and a row's code words are unpacked by fewer invocations), a whole row on CPU
// drivers (the slot of a row is then read exactly once per row).
layout(constant_id = 2) const uint CHUNKS = 1u;
// Bits per residual level, 0 = no residual stage (the residual code is compiled out).
layout(constant_id = 3) const uint RES_BITS = 0u;
// GPUs (rows_chunked): whether an invocation loads its next row's slot words before this
// row's atom gathers (the host's arena.RECONSTRUCT_GPU_MAPPINGS says per sparsity, measured).
layout(constant_id = 4) const bool PIPELINED = false;
// Whether the atoms block holds binary16 atoms (the forge's atoms are binary16 values; vec4
// variant with HEAD_DIM % 8 == 0 only, the host checks), not float32 rows. The gathers'
// count, not their bytes, is what costs on the H200: a quad of 8 halves per load — two output
// chunks half a row apart — halves it (docs/DESIGN.md, "The atoms stored once, in binary16").
layout(constant_id = 5) const bool ATOMS_F16 = false;
#include "atoms.glsl"

const uint ROW_CHUNKS = HEAD_DIM / LANES;
const uint GROUPS = ROW_CHUNKS / CHUNKS;  // invocations per row
// Quads (8 halves) per binary16 atom: quad p holds chunks p and p + HALF_CHUNKS.
const uint HALF_CHUNKS = ROW_CHUNKS / 2u;
const uint LEVEL_WORDS = SLOT_LEVEL_WORDS_OF(HEAD_DIM, RES_BITS);
const uint SLOT_WORDS = SLOT_WORDS_OF(SPARSITY, HEAD_DIM, RES_BITS);
const uint STEP_WORD = SLOT_STEP_WORD_OF(SPARSITY, HEAD_DIM, RES_BITS);
const uint RES_MASK = (1u << RES_BITS) - 1u;
// Whether a chunk's levels can straddle two words (LANES*RES_BITS does not divide 32;
// 32 % 1 = 0 without a residual stage). No `&&` in spec-constant expressions: glslang spells
// it as branches inside whichever function first uses it, which other functions cannot see.
const bool RES_STRADDLES = (32u % (LANES * RES_BITS + (RES_BITS == 0u ? 1u : 0u))) != 0u;
// Whether an invocation writes whole rows (CPU drivers, rows_whole) or CHUNKS chunks of a
// row (GPUs, rows_chunked). Private arrays of the path not taken keep one element (GLSL has
// no empty arrays).
const bool WHOLE_ROWS = CHUNKS == ROW_CHUNKS;
const uint LEVEL_COPY = WHOLE_ROWS ? LEVEL_WORDS + 1u : 1u;
// rows_chunked's code words and chunks per invocation: 1 where rows_whole runs, so the path
// not taken stays small for compilers that build it before dropping it.
const uint ROW_CODES = WHOLE_ROWS ? 1u : SPARSITY;
const uint PIECES = WHOLE_ROWS ? 1u : CHUNKS;
// rows_chunked with binary16 atoms and an even number of chunks per invocation: each quad
// gathered serves two of its chunks (ATOMS_F16 && PIECES even, spelled without `&&`).
const bool QUAD_PAIRS = (ATOMS_F16 ? PIECES % 2u : 1u) == 0u;
// rows_whole's steps along a row: a chunk each, or a quad's two chunks (binary16 atoms)
const uint WHOLE_STEPS = ATOMS_F16 ? HALF_CHUNKS : CHUNKS;

// restrict: nothing this dispatch writes aliases the layer (the two read-only views of it
// alias each other, which restrict allows: neither is written).
layout(std430, binding = 0) restrict readonly buffer LayerWords { uint layer_words[]; };
layout(std430, binding = 1) restrict readonly buffer LayerElems { FELEM layer_elems[]; };
layout(std430, binding = 2) restrict writeonly buffer OutElems { FELEM out_elems[]; };
// A fourth read-only view of the layer: its binary16 atoms, a quad (8 halves) per element.
// (Four bindings: Vulkan's minimum of storage buffers per stage.)
layout(std430, binding = 3) restrict readonly buffer LayerQuads { uvec4 layer_quads[]; };

layout(push_constant) uniform ReconstructPush {
    uint src_word;    // start of the stream's slot region
    uint atoms_word;  // start of the stream's atoms block (multiple of LANES; of 4 if ATOMS_F16)
    uint mean_word;   // start of the stream's means (multiple of LANES)
    uint n_atoms;
    uint n_ctx;
    uint t0;
    uint n_tok;
    uint n_rows;      // n_kv * n_tok
    uint out_word;    // output row r = h*n_tok + i starts at out_word + r*HEAD_DIM
    uint scale_word;  // start of the stream's residual scales (read only if RES_BITS > 0)
    uint head_atoms;  // words between two KV heads' atoms (0: one shared dictionary)
    uint head_vec;    // words between two KV heads' means / scales (0: shared)
} pc;

// Chunk `chunk`'s first level: its bit, its level word (counted from the slot's first level
// word) and its offset in that word — one spelling for both paths.
#define CHUNK_LEVEL_BIT(chunk) ((chunk) * LANES * RES_BITS)
#define CHUNK_LEVEL_WORD(chunk) (CHUNK_LEVEL_BIT(chunk) >> 5u)

// The residual of chunk `chunk` of a row: LANES levels starting at element chunk*LANES.
// A chunk's levels span at most two words (LANES*RES_BITS <= 32 bits, any bit offset): they
// are taken as one window of bits, then each level at a constant shift.
FELEM residual_chunk(uint lw0, uint lw1, uint chunk, float step_, FELEM scale) {
    uint off = CHUNK_LEVEL_BIT(chunk) & 31u;
    uint bits = level_window(lw0, lw1, off);
    FELEM r;
#if VEC4
    [[unroll]] for (uint i = 0u; i < LANES; ++i)
        r[i] = centred_level((bits >> (i * RES_BITS)) & RES_MASK, RES_BITS);
#else
    r = centred_level(bits & RES_MASK, RES_BITS);
#endif
    return r * step_ * scale;
}

// Where head `head`'s atoms start: in chunks of float32 atoms, or in quads of binary16 ones
// (ATOMS_F16; the host keeps atoms_word and head_atoms multiples of 4). Atom a then starts
// at atoms_base(head) + a * ATOM_STRIDE.
const uint ATOM_STRIDE = ATOMS_F16 ? HALF_CHUNKS : ROW_CHUNKS;
uint atoms_base(uint head) {
    return (pc.atoms_word + head * pc.head_atoms) / (ATOMS_F16 ? 4u : LANES);
}

// Chunk `chunk` of the atom starting at `at` (atoms_base + a * ATOM_STRIDE), one load.
FELEM atom_chunk(uint at, uint chunk) {
#if VEC4
    if (ATOMS_F16) {
        uvec4 q = layer_quads[at + chunk % HALF_CHUNKS];
        return chunk < HALF_CHUNKS ? atom_quad_lo(q) : atom_quad_hi(q);
    }
#endif
    return layer_elems[at + chunk];
}

// Row r = h*n_tok + i: its KV head and the first word of its slot.
uint head_of(uint row) { return row / pc.n_tok; }
uint slot_of(uint row, uint head) { return pc.src_word + (head * pc.n_ctx + pc.t0 + row - head * pc.n_tok) * SLOT_WORDS; }

// The first element of head `head`'s mean and of its residual scale. (Loaded into each path's
// own private arrays: passing them to a function copies them in and out, which llvmpipe
// unrolled element by element — 75 s to compile at head_dim 256.)
uint mean_elem(uint head) { return (pc.mean_word + head * pc.head_vec) / LANES; }
uint scale_elem(uint head) { return (pc.scale_word + head * pc.head_vec) / LANES; }

// CPU drivers: an invocation per row. The row's level words are copied once into a private
// array; the mean and scale stay in a small private array until the head changes (reloading
// per row costs llvmpipe one more scalarised load per output chunk, ~30% at s = 1).
// Loops not unrolled: llvmpipe expands every buffer load into a loop over its SIMD lanes (with
// a bounds check per component), so unrolled loads make its compile time explode (a minute at
// s = 32, head_dim 64); rolled, coef / atom_elem become small private arrays, no slower.
void rows_whole() {
    uint out_elem = pc.out_word / LANES;
    FELEM mean_part[CHUNKS];
    FELEM scale_part[CHUNKS];
    uint cached_head = 0xFFFFFFFFu;
    uint level_copy[LEVEL_COPY];
    for (uint row = gl_GlobalInvocationID.x; row < pc.n_rows; row += grid_stride()) {
        uint head = head_of(row);
        uint slot = slot_of(row, head);
        if (head != cached_head) {
            cached_head = head;
            [[dont_unroll]] for (uint k = 0u; k < CHUNKS; ++k) {
                mean_part[k] = layer_elems[mean_elem(head) + k];
                if (RES_BITS > 0u)
                    scale_part[k] = layer_elems[scale_elem(head) + k];
            }
        }
        uint atoms_elem = atoms_base(head);
        uint atom_elem[SPARSITY];
        float coef[SPARSITY];
        [[dont_unroll]] for (uint j = 0u; j < SPARSITY; ++j) {
            uint w = layer_words[slot + j];
            uint atom = code_atom(w);
            atom_elem[j] = atoms_elem + safe_atom(atom, pc.n_atoms) * ATOM_STRIDE;
            coef[j] = safe_coef(atom, pc.n_atoms, code_coef(w));
        }
        float step_ = 0.0;
        if (RES_BITS > 0u) {
            step_ = uintBitsToFloat(layer_words[slot + STEP_WORD]);
            [[dont_unroll]] for (uint w = 0u; w < LEVEL_WORDS; ++w)
                level_copy[w] = layer_words[slot + SPARSITY + w];
            level_copy[LEVEL_COPY - 1u] = 0u;  // the padding word past the last
        }
        // A step's chunks: one (float32 atoms), or chunks p and p + HALF_CHUNKS of one quad
        // gathered per code word (binary16 atoms)
        [[dont_unroll]] for (uint p = 0u; p < WHOLE_STEPS; ++p) {
            FELEM pair[2];
            pair[0] = mean_part[p];
            pair[1] = mean_part[min(p + HALF_CHUNKS, CHUNKS - 1u)];
            [[dont_unroll]] for (uint j = 0u; j < SPARSITY; ++j) {
#if VEC4
                if (ATOMS_F16) {
                    uvec4 q = layer_quads[atom_elem[j] + p];
                    pair[0] += coef[j] * atom_quad_lo(q);
                    pair[1] += coef[j] * atom_quad_hi(q);
                    continue;
                }
#endif
                pair[0] += coef[j] * layer_elems[atom_elem[j] + p];
            }
            [[dont_unroll]] for (uint e = 0u; e < CHUNKS / WHOLE_STEPS; ++e) {
                uint chunk = p + e * HALF_CHUNKS;
                FELEM acc = pair[e];
                if (RES_BITS > 0u) {
                    uint w = CHUNK_LEVEL_WORD(chunk);
                    acc += residual_chunk(level_copy[w], level_copy[w + 1u], chunk, step_, scale_part[chunk]);
                }
                out_elems[out_elem + row * ROW_CHUNKS + chunk] = acc;
            }
        }
    }
}

// The slot words chunk group `group` reads of the row whose slot starts at `slot`: its code
// words, its chunks' level words (the second inside the slot — a level word or the step —
// whenever used, and not read at all when no chunk straddles) and the step.
void load_slot_words(uint slot, uint group, out uint code[ROW_CODES], out uint lw0[PIECES],
                     out uint lw1[PIECES], out uint step_bits) {
    [[unroll]] for (uint j = 0u; j < ROW_CODES; ++j)
        code[j] = layer_words[slot + j];
    [[unroll]] for (uint k = 0u; k < PIECES; ++k) {
        uint w = CHUNK_LEVEL_WORD(group + k * GROUPS);
        lw0[k] = 0u;
        lw1[k] = 0u;
        if (RES_BITS > 0u)
            lw0[k] = layer_words[slot + SPARSITY + w];
        if (RES_STRADDLES)
            lw1[k] = layer_words[slot + SPARSITY + min(w + 1u, LEVEL_WORDS)];
    }
    step_bits = RES_BITS > 0u ? layer_words[slot + STEP_WORD] : 0u;
}

// GPUs: GROUPS invocations per row, invocation g writing chunks g + k*GROUPS (k < CHUNKS), so
// neighbouring invocations write neighbouring chunks (coalesced). PIPELINED: the slot words an
// invocation needs for its next row are loaded before this row's atom gathers, so a row's HBM
// latency hides under the previous row's work; it pays at middling sparsity only (more
// registers elsewhere), and gathering the next row's atoms early too lost (lab/NOTEBOOK.md,
// "Reconstruct"; the host picks it per sparsity: kvdict_vk/vk/read/mapping.py).
void rows_chunked() {
    uint gid = gl_GlobalInvocationID.x;
    // The host makes grid_stride() a multiple of GROUPS, so an invocation keeps the same
    // chunk group for every row it visits.
    uint group = gid % GROUPS;
    uint row_step = grid_stride() / GROUPS;
    uint out_elem = pc.out_word / LANES;
    FELEM mean_part[PIECES];
    FELEM scale_part[PIECES];
    uint cached_head = 0xFFFFFFFFu;
    uint next_code[ROW_CODES];
    uint next_lw0[PIECES];
    uint next_lw1[PIECES];
    uint next_step;
    uint row = gid / GROUPS;
    if (PIPELINED && row < pc.n_rows)
        load_slot_words(slot_of(row, head_of(row)), group, next_code, next_lw0, next_lw1, next_step);

    for (; row < pc.n_rows; row += row_step) {
        uint head = head_of(row);
        uint code[ROW_CODES];
        uint lw0[PIECES];
        uint lw1[PIECES];
        uint step_bits;
        if (PIPELINED) {
            // this row's words (loaded one iteration before), then the next row's loads
            [[unroll]] for (uint j = 0u; j < ROW_CODES; ++j)
                code[j] = next_code[j];
            [[unroll]] for (uint k = 0u; k < PIECES; ++k) {
                lw0[k] = next_lw0[k];
                lw1[k] = next_lw1[k];
            }
            step_bits = next_step;
            uint next_row = row + row_step;
            if (next_row < pc.n_rows)
                load_slot_words(slot_of(next_row, head_of(next_row)), group, next_code, next_lw0, next_lw1, next_step);
        } else {
            load_slot_words(slot_of(row, head), group, code, lw0, lw1, step_bits);
        }
        float step_ = uintBitsToFloat(step_bits);

        if (head != cached_head) {
            cached_head = head;
            [[dont_unroll]] for (uint k = 0u; k < PIECES; ++k) {
                mean_part[k] = layer_elems[mean_elem(head) + group + k * GROUPS];
                if (RES_BITS > 0u)
                    scale_part[k] = layer_elems[scale_elem(head) + group + k * GROUPS];
            }
        }
        uint atoms_elem = atoms_base(head);
        uint atom_elem[ROW_CODES];
        float coef[ROW_CODES];
        [[dont_unroll]] for (uint j = 0u; j < ROW_CODES; ++j) {
            uint atom = code_atom(code[j]);
            atom_elem[j] = atoms_elem + safe_atom(atom, pc.n_atoms) * ATOM_STRIDE;
            coef[j] = safe_coef(atom, pc.n_atoms, code_coef(code[j]));
        }
        // The sums of the chunks this invocation writes, mean first, atoms in code order (the
        // reference's order either way). Loops rolled for llvmpipe's compile time (tests run
        // this path there); GPU compilers unroll them anyway.
        FELEM sums[PIECES];
        [[dont_unroll]] for (uint k = 0u; k < PIECES; ++k)
            sums[k] = mean_part[k];
        if (QUAD_PAIRS) {
#if VEC4
            // chunk k < PIECES/2 lies in the first half of the row, chunk k + PIECES/2 is its
            // partner half a row on (group + k*GROUPS + HALF_CHUNKS): one quad serves both
            [[dont_unroll]] for (uint j = 0u; j < ROW_CODES; ++j) {
                [[dont_unroll]] for (uint k = 0u; k < PIECES / 2u; ++k) {
                    uvec4 q = layer_quads[atom_elem[j] + group + k * GROUPS];
                    sums[k] += coef[j] * atom_quad_lo(q);
                    sums[k + PIECES / 2u] += coef[j] * atom_quad_hi(q);
                }
            }
#endif
        } else {
            [[dont_unroll]] for (uint k = 0u; k < PIECES; ++k)
                [[dont_unroll]] for (uint j = 0u; j < ROW_CODES; ++j)
                    sums[k] += coef[j] * atom_chunk(atom_elem[j], group + k * GROUPS);
        }
        [[dont_unroll]] for (uint k = 0u; k < PIECES; ++k) {
            uint chunk = group + k * GROUPS;
            FELEM acc = sums[k];
            if (RES_BITS > 0u)
                acc += residual_chunk(lw0[k], lw1[k], chunk, step_, scale_part[k]);
            out_elems[out_elem + row * ROW_CHUNKS + chunk] = acc;
        }
    }
}

void main() {
    if (WHOLE_ROWS)
        rows_whole();
    else
        rows_chunked();
}
