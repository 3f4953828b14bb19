// A model's weight matrices on the device (kvdict_vk.vk.forward.weights): rows of n_cols
// columns, each row a run of blocks of 32 columns in one of three formats (the FORMAT
// specialization constant):
//   W_F32:  32 float words;
//   W_Q4_1: GGUF's Q4_1 as stored, 20 bytes = 5 words — d (low half) and m (high half) as
//           binary16, then 16 bytes: byte j holds column j (low nibble) and j + 16 (high);
//           a weight is d · q + m;
//   W_Q8_0: GGUF's Q8_0 padded to a word — d (binary16, low half), then 32 int8, column 4k
//           in word k's low byte; a weight is q · d.
// The including shader declares the weights' words as w_words[].
#define W_F32 0u
#define W_Q4_1 1u
#define W_Q8_0 2u

layout(constant_id = 0) const uint FORMAT = W_F32;

const uint BLOCK_WORDS = FORMAT == W_F32 ? 32u : (FORMAT == W_Q4_1 ? 5u : 9u);

// A chunk's words as loaded, before they are decoded: F32 its 8 floats (a, b); Q4_1 and Q8_0
// the block's header word (head) and the chunk's two payload words (a.xy). Loading all of a
// row's chunks first and decoding after keeps their loads in flight together.
struct ChunkWords {
    uint head;
    uvec4 a;
    uvec4 b;
};

// The words of chunk p (0 .. 3: columns 8p .. 8p + 7) of the block at word b.
ChunkWords chunk_load(uint b, uint p) {
    ChunkWords cw;
    if (FORMAT == W_F32) {
        uint w = b + 8u * p;
        cw.a = uvec4(w_words[w], w_words[w + 1u], w_words[w + 2u], w_words[w + 3u]);
        cw.b = uvec4(w_words[w + 4u], w_words[w + 5u], w_words[w + 6u], w_words[w + 7u]);
    } else {
        // Q4_1: columns 16 .. 31 are the high nibbles of bytes 0 .. 15 (chunks 2, 3 read 0, 1's words)
        uint w = FORMAT == W_Q4_1 ? b + 1u + 2u * (p & 1u) : b + 1u + 2u * p;
        cw.head = w_words[b];
        cw.a.xy = uvec2(w_words[w], w_words[w + 1u]);
    }
    return cw;
}

// Chunk p's 8 weights from its words.
void chunk_decode(ChunkWords cw, uint p, out vec4 lo, out vec4 hi) {
    if (FORMAT == W_F32) {
        lo = uintBitsToFloat(cw.a);
        hi = uintBitsToFloat(cw.b);
    } else if (FORMAT == W_Q4_1) {
        vec2 dm = unpackHalf2x16(cw.head);
        uvec2 nib = (cw.a.xy >> (p >= 2u ? 4u : 0u)) & 0x0F0F0F0Fu;
        lo = dm.x * vec4(nib.x & 0xFFu, (nib.x >> 8u) & 0xFFu, (nib.x >> 16u) & 0xFFu, nib.x >> 24u) + dm.y;
        hi = dm.x * vec4(nib.y & 0xFFu, (nib.y >> 8u) & 0xFFu, (nib.y >> 16u) & 0xFFu, nib.y >> 24u) + dm.y;
    } else {
        float d = unpackHalf2x16(cw.head).x;
        lo = int8x4(cw.a.x) * d;
        hi = int8x4(cw.a.y) * d;
    }
}

// The 8 weights of chunk p of the block at word b.
void block_chunk(uint b, uint p, out vec4 lo, out vec4 hi) {
    chunk_decode(chunk_load(b, p), p, lo, hi);
}
