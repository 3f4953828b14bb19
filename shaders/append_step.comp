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
#include "rows_encode.glsl"

// a stream's source format (kvdict_vk.rows.APPEND_FORMATS)
#define FORMAT_WORDS 0u
#define FORMAT_F16 1u
#define FORMAT_Q8_0 2u

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

// q8_0 block b of the source row at row_word: its d (binary16 bits) and inverse scale.
float q8_block(uint row_word, uint b, out uint d_bits) {
    float amax = 0.0;
    for (uint i = 32u * b; i < 32u * b + 32u; ++i)
        amax = max(amax, abs(src_float(row_word, i)));
    float d = div_rn(amax, 127.0);
    d_bits = f16_bits(d);
    return q8_inverse_scale(d);
}

// Item i of a stored row made from the source row at row_word, into the row at dst: a word
// (FORMAT_WORDS, FORMAT_F16), or a q8_0 block — its 8 value words and, for an even block, the
// scale word it shares with the next (whose d it works out too).
void store_item(uint format, uint row_word, uint dst, uint i) {
    if (format == FORMAT_WORDS) {
        layer_words[dst + i] = step_words[row_word + i];
    } else if (format == FORMAT_F16) {
        layer_words[dst + i] = f16_bits(src_float(row_word, 2u * i)) | (f16_bits(src_float(row_word, 2u * i + 1u)) << 16u);
    } else {
        uint n_blocks = pc.head_dim / 32u, scale_words = (n_blocks + 1u) / 2u;
        uint lo, hi = 0u;
        float inv = q8_block(row_word, i, lo);
        if ((i & 1u) == 0u) {
            if (i + 1u < n_blocks)
                q8_block(row_word, i + 1u, hi);
            layer_words[dst + i / 2u] = lo | (hi << 16u);
        }
        for (uint w = 0u; w < 8u; ++w) {  // elements 32i + 4w .. + 3, the first in the low byte
            uint word = 0u;
            for (uint k = 0u; k < 4u; ++k)
                word |= (uint(q8_value(src_float(row_word, 32u * i + 4u * w + k), inv)) & 0xFFu) << (8u * k);
            layer_words[dst + scale_words + 8u * i + w] = word;
        }
    }
}

// Items of a row in a format: words, or q8_0 blocks.
uint row_items(uint format, uint row_words) { return format == FORMAT_Q8_0 ? pc.head_dim / 32u : row_words; }

void main() {
    uint k_items = pc.n_seqs * pc.n_kv * row_items(pc.k_format, pc.k_row_words);
    uint n_items = k_items + pc.n_seqs * pc.n_kv * row_items(pc.v_format, pc.v_row_words);
    for (uint w = gl_GlobalInvocationID.x; w < n_items; w += grid_stride()) {
        bool key = w < k_items;
        uint row_words = key ? pc.k_row_words : pc.v_row_words;
        uint format = key ? pc.k_format : pc.v_format;
        uint items = row_items(format, row_words);
        uint x = key ? w : w - k_items;
        uint row = x / items;  // seq * n_kv + head
        uint seq = row / pc.n_kv;
        uint head = row - seq * pc.n_kv;
        uint src_row_words = format == FORMAT_WORDS ? row_words : pc.head_dim;
        uint src = (key ? pc.k_src_word : pc.v_src_word) + row * src_row_words;
        // clamped as SEQ_USED clamps it: a bad length writes inside the sequence's rows
        uint t = clamp(query_words[pc.lengths_word + seq], 1u, pc.seq_rows) - 1u;
        uint dst = (key ? pc.k_word : pc.v_word) + (head * pc.n_ctx + seq * pc.seq_rows + t) * row_words;
        store_item(format, src, dst, x - row * items);
    }
}
