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

// The 8 weights of chunk p (0 .. 3: columns 8p .. 8p + 7) of the block at word b.
void block_chunk(uint b, uint p, out vec4 lo, out vec4 hi) {
    if (FORMAT == W_F32) {
        uint w = b + 8u * p;
        lo = uintBitsToFloat(uvec4(w_words[w], w_words[w + 1u], w_words[w + 2u], w_words[w + 3u]));
        hi = uintBitsToFloat(uvec4(w_words[w + 4u], w_words[w + 5u], w_words[w + 6u], w_words[w + 7u]));
    } else if (FORMAT == W_Q4_1) {
        vec2 dm = unpackHalf2x16(w_words[b]);
        uint shift = p >= 2u ? 4u : 0u;  // columns 16 .. 31: the high nibbles of bytes 0 .. 15
        uint w = b + 1u + 2u * (p & 1u);
        uvec2 nib = (uvec2(w_words[w], w_words[w + 1u]) >> shift) & 0x0F0F0F0Fu;
        lo = dm.x * vec4(nib.x & 0xFFu, (nib.x >> 8u) & 0xFFu, (nib.x >> 16u) & 0xFFu, nib.x >> 24u) + dm.y;
        hi = dm.x * vec4(nib.y & 0xFFu, (nib.y >> 8u) & 0xFFu, (nib.y >> 16u) & 0xFFu, nib.y >> 24u) + dm.y;
    } else {
        float d = unpackHalf2x16(w_words[b]).x;
        uint w = b + 1u + 2u * p;
        lo = int8x4(w_words[w]) * d;
        hi = int8x4(w_words[w + 1u]) * d;
    }
}
