#version 450
// A recorded decode step's append (kvdict_vk.vk.arena.decode): one new token of each of
// n_seqs sequences, K and V, written at the row its n_used names — read from the query
// block the attention after it reads (attend_common.glsl's SEQ_USED word: the token's
// position + 1), so one recording serves every step. The step buffer holds at k_src_word the
// K source rows (sequence, KV head), at v_src_word the V rows: float32 rows (head_dim words)
// that this kernel turns into the stream's binary16 or q8_0 words (rows_encode.glsl: NumPy's
// bits), or the stored words themselves (FORMAT_WORDS: f32 rows, a coded stream's slots).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#define Q8_PAIR_ENCODER
#include "rows_encode.glsl"

layout(local_size_x = WG_SIZE) in;

layout(std430, binding = 0) readonly buffer Step { uint step_words[]; };
layout(std430, binding = 1) readonly buffer Query { uint query_words[]; };
layout(std430, binding = 2) writeonly buffer Layer { uint layer_words[]; };

layout(push_constant) uniform AppendStepPush {
    uint k_src_word;
    uint v_src_word;
    uint k_word;        // the layer's K region: n_ctx rows per KV head
    uint v_word;
    uint k_row_words;   // words a stored row holds
    uint v_row_words;
    uint n_kv;
    uint n_seqs;
    uint n_ctx;
    uint seq_rows;      // rows a sequence holds (its first is seq * seq_rows)
    uint lengths_word;  // the query block's n_used words, one per sequence
    uint k_format;      // FORMAT_*
    uint v_format;
    uint head_dim;      // floats a source row holds (FORMAT_F16, FORMAT_Q8_0)
} pc;

float src_float(uint row_word, uint i) { return uintBitsToFloat(step_words[row_word + i]); }

// The work is cut into units a workgroup takes whole (grid stride over units): a stream in
// words (FORMAT_WORDS, FORMAT_F16) WG_SIZE words a unit, an invocation a word; a q8_0 stream a
// pair of blocks a unit (they share a scale word: rows_encode.glsl's q8_pair_words).
const uint PAIR = 64u;  // elements of a q8_0 unit: two blocks of 32

uint row_items(uint format, uint row_words) {  // units of a row: q8_0 block pairs; else words
    return format == FORMAT_Q8_0 ? (pc.head_dim / 32u + 1u) / 2u : row_words;
}

uint stream_units(uint format, uint row_words) {
    uint items = pc.n_seqs * pc.n_kv * row_items(format, row_words);
    return format == FORMAT_Q8_0 ? items : (items + WG_SIZE - 1u) / WG_SIZE;
}

// The source row and the stored row (the row n_used names) of row r = seq · n_kv + head.
void row_words_at(bool key, uint format, uint r, out uint src, out uint dst) {
    uint row_words = key ? pc.k_row_words : pc.v_row_words;
    uint seq = r / pc.n_kv, head = r - seq * pc.n_kv;
    src = (key ? pc.k_src_word : pc.v_src_word) + r * (format == FORMAT_WORDS ? row_words : pc.head_dim);
    // clamped as SEQ_USED clamps it: a bad length writes inside the sequence's rows
    uint t = clamp(query_words[pc.lengths_word + seq], 1u, pc.seq_rows) - 1u;
    dst = (key ? pc.k_word : pc.v_word) + (head * pc.n_ctx + seq * pc.seq_rows + t) * row_words;
}

// Word unit u of a stream in words: each invocation one word (of any row).
void store_words(bool key, uint format, uint u) {
    uint row_words = key ? pc.k_row_words : pc.v_row_words;
    uint x = u * WG_SIZE + gl_LocalInvocationID.x;
    if (x >= pc.n_seqs * pc.n_kv * row_words)
        return;
    uint r = x / row_words, i = x - r * row_words, src, dst;
    row_words_at(key, format, r, src, dst);
    layer_words[dst + i] = format == FORMAT_WORDS ? step_words[src + i]
        : f16_bits(src_float(src, 2u * i)) | (f16_bits(src_float(src, 2u * i + 1u)) << 16u);
}

// Unit u of a q8_0 stream: blocks 2p and 2p + 1 of a row (p = u's pair in it), the whole
// workgroup (every invocation reaches every barrier).
void store_q8_pair(bool key, uint u) {
    uint lid = gl_LocalInvocationID.x, pairs = row_items(FORMAT_Q8_0, 0u), n_blocks = pc.head_dim / 32u;
    uint r = u / pairs, p = u - r * pairs, src, dst;
    row_words_at(key, FORMAT_Q8_0, r, src, dst);
    uint e = PAIR * p + lid;  // this invocation's element; block 2p + lid / 32
    bool real = lid < PAIR && e < pc.head_dim;
    uint scale_word, value_word;
    q8_pair_words(real ? src_float(src, e) : 0.0, real, 2u * p + 1u < n_blocks, scale_word, value_word);
    if (lid == 0u)
        layer_words[dst + p] = scale_word;
    if (lid < PAIR / 4u && 4u * lid < pc.head_dim - PAIR * p)  // word lid of the pair's values
        layer_words[dst + (n_blocks + 1u) / 2u + PAIR / 4u * p + lid] = value_word;
}

void main() {
    uint k_units = stream_units(pc.k_format, pc.k_row_words);
    uint n_units = k_units + stream_units(pc.v_format, pc.v_row_words);
    for (uint u = gl_WorkGroupID.x; u < n_units; u += gl_NumWorkGroups.x) {  // uniform in a workgroup
        bool key = u < k_units;
        uint format = key ? pc.k_format : pc.v_format;
        if (format == FORMAT_Q8_0)
            store_q8_pair(key, key ? u : u - k_units);
        else
            store_words(key, format, key ? u : u - k_units);
    }
}
