// Shared by the decode-attention shaders (attend_*.comp): one new query token per call,
// grouped-query attention (query head h = g*GROUP + hj reads KV head g), causal over the
// first n_used cached tokens, softmax with the maximum subtracted, split into chunks of
// tokens ("splits", flash-decoding style) that a reduce combines.
//
// Work mapping — one invocation per work item (a split, an atom, a block of atoms, an
// output quad) with a grid-stride loop; the workgroup size is specialization constant 2
// (LOCAL). Why not a workgroup per split: on llvmpipe every storage-buffer or shared-memory
// load with a per-invocation address costs the same per-lane loop whatever the access
// pattern, so cooperation buys nothing there, while arithmetic on private values is ~50x
// cheaper than a load. So every word is loaded once by the invocation that needs it and
// everything else stays private. The host picks LOCAL = the SIMD width on CPU drivers (8
// lanes of 32 bits on a 256-bit llvmpipe: a workgroup is one SIMD row, so a handful of
// splits spreads over every thread) and 64 on GPUs.
//
// Compile time (llvmpipe JITs each pipeline with LLVM): private arrays are only ever
// indexed by unrolled-loop constants (a dynamically indexed private array costs seconds
// per hundred elements to compile), rows move as vec4 (a quarter of the load sites), and
// an invocation handles a block of HB query heads of its group (HB * HEAD_DIM <= 192
// floats of query and accumulator state, chosen by the host).
//
// Buffers (float unless noted; g = KV head, i = split, hj = query head within the group).
// Records are split-major — record (i, g, hj) = (i*n_kv + g)*GROUP + hj, record() below — so
// a dispatch can append splits after another's (a decode step's fresh tokens after the
// cached ones) without either knowing the total count:
//   stats  [rec*2 + 0/1] = m, l: the split's maximum score (-inf when empty) and sum of
//          exp(score - m); attend_combine.comp adds the factors f = exp(m - M) at
//          f_word + rec and 1/L at inv_l_word + g*GROUP + hj (M = max over splits, L = sum
//          of f*l)
//   accs   vec4 [rec*Q4 + c]: sum of exp(score - m) * v (attend_split.comp with a
//          dict-coded V: only the residual part, already times the residual scale)
//   bins   [rec*n_atoms + a]: attend_split.comp with a dict-coded V only, the split's atom
//          weights, sum of exp(score - m) * coef over the code words selecting atom a

#define NEG_INF uintBitsToFloat(0xFF800000u)

layout(local_size_x = 64, local_size_x_id = 2) in;

layout(constant_id = 0) const uint HEAD_DIM = 64u;  // a multiple of 4
layout(constant_id = 1) const uint GROUP = 1u;      // query heads per KV head
layout(constant_id = 3) const uint HB = 1u;         // query heads per invocation (divides GROUP)

const uint Q4 = HEAD_DIM / 4u;      // vec4 quads per head vector
const uint BQ = HB * Q4;            // quads of a block of HB head vectors
const uint N_HB = GROUP / HB;       // head blocks per KV head

uint grid_size() { return gl_NumWorkGroups.x * gl_WorkGroupSize.x; }

// Batched decode (the flash paths: attend_flash*.comp, attend_table.comp, attend_merge_head.comp):
// n_seqs sequences share the layer's dictionaries; sequence b's tokens are rows
// b*seq_rows .. of each KV head (n_ctx rows per head in all), its query heads
// b*n_kv*GROUP + g*GROUP + hj. A sequence's KV head is a "virtual head" v = b*n_kv + g for
// the queries, the q·atom table, the records and the output; the dictionary head stays g.
// The query block (from word pc.q_word of the query buffer: a recorded decode step keeps every
// layer's in one buffer) holds the n_seqs × n_kv × GROUP query vectors, then one word per
// sequence: its n_used as uint bits (the host writes both — kvdict_vk.vk.attend.specs.lengths_word
// is this offset's twin; clamped to [1, pc.n_used], the most).
#define SEQ_USED(qbuf, b) \
    clamp(floatBitsToUint(qbuf[pc.q_word + pc.n_seqs * pc.n_kv * GROUP * HEAD_DIM + (b)]), 1u, pc.n_used)

// The flash kernels' tokens per split of a sequence attending over n_used tokens: the push
// block's split_len, or — split_len 0: a decode step recorded once (kvdict_vk.vk.arena.decode),
// whose token counts change between replays — n_used over the splits, rounded up to a whole
// number of split_round tokens (the kernel's rounds; kvdict_vk.vk.attend.specs.dynamic_split_len
// is its twin).
#define SPLIT_LEN(n_used) (pc.split_len != 0u ? pc.split_len : ROUNDED_SPLIT(n_used, pc.n_splits))
// n tokens over `splits` splits, a split a whole number of split_round tokens
#define ROUNDED_SPLIT(n, splits) ((((n) + (splits) - 1u) / (splits) + pc.split_round - 1u) / pc.split_round * pc.split_round)

// The first record of split i of KV head g (add hj for query head hj of the group).
uint record(uint i, uint g, uint n_kv) { return (i * n_kv + g) * GROUP; }

// Writes an invocation's HB records from record rec (its first query head's) on: (m, l) into
// stats, the accumulator quads into accs — the includer's buffers; m, l, acc its private
// arrays of HB, HB and BQ (the per-invocation passes, attend_split.comp and attend_direct.comp).
#define STORE_RECORDS(rec, m, l, acc)                        \
    {                                                        \
        uint rec_ = (rec);                                   \
        [[unroll]] for (uint hj_ = 0u; hj_ < HB; ++hj_) {    \
            stats[(rec_ + hj_) * 2u] = m[hj_];               \
            stats[(rec_ + hj_) * 2u + 1u] = l[hj_];          \
        }                                                    \
        [[unroll]] for (uint x_ = 0u; x_ < BQ; ++x_)         \
            accs[rec_ * Q4 + x_] = acc[x_];                  \
    }

// An invocation's index in its workgroup, numbered subgroup by subgroup where a kernel uses
// subgroup operations (its SUBGROUP variants: lanes a subgroup shuffles among are then
// neighbours whatever order the device gives gl_LocalInvocationID).
uint lane_index() {
#if defined(SUBGROUP) && SUBGROUP
    return gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;
#else
    return gl_LocalInvocationID.x;
#endif
}
