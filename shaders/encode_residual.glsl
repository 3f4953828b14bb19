// Residual stage of one head vector, bit-for-bit the format and the choices of
// kvdict_vk.residual.quantise applied to x - codec.reconstruct(codes):
//   u = (x - (mean + sum_j coef16_j * atom_j)) / scale
//   rms = sqrt(mean(u^2)), amax = max|u|
//   candidate steps: float32(mult_c * rms) for the clip multipliers (mult_c = 2 m_c / 2^b,
//   from residual._CLIP_MULTIPLIERS via the dictionary image), then float32(mult * amax)
//   (mult = 2 / (2^b - 1), or 1 for b = 1);
//   levels q = clip(rint(u / step + half), 0, 2^b - 1)   (step 0 divides by 1)
//   the step with the least sum (u - (q - half) step)^2 wins, the first one on a tie;
// then the b-bit levels as a little-endian bitstream and the step as a float32 word.
// The reference computes in float64; here everything from the reconstruction on is df64
// (encode_df64.glsl), so both round the same values to the same float32 step and levels
// except when a value lies within ~2^-46 of a rounding boundary.

const uint MAX_LEVEL_U = (1u << RESIDUAL_BITS) - 1u;
#define MAX_LEVEL float(MAX_LEVEL_U)
#define HALF_LEVEL (0.5 * float(MAX_LEVEL_U))  // exact: MAX_LEVEL < 2^8

// The level of u for a step whose df64 reciprocal is inv_step.
float residual_level(vec2 u, vec2 inv_step) {
    vec2 t = df_add(df_mul(u, inv_step), vec2(HALF_LEVEL, 0.0));
    return clamp(df_rint(t), 0.0, MAX_LEVEL);
}

// The stage in parts, so a kernel can spread elements and candidates over invocations
// (omp_encode_tiled.comp, omp_encode_vector.comp) or run them all in one (omp_encode_pick.comp,
// residual_stage):
// residual_element (one element of u), residual_spread (u's RMS and largest magnitude),
// residual_candidate (one candidate's step and error), residual_write (the winner's levels
// and step). Requires (before inclusion) x_elems, dict_floats, dest_words, the encoder's
// push block, SPARSITY, DIM, RESIDUAL_BITS, N_STEPS and LEVEL_WORDS.

// 1. u_e = (x_e - (mean_e + sum_j coef16_j * atom_j[e])) * (1/scale_e) of batch vector v, in
//    df64: products of a binary16 coefficient and a float32 atom element are exact, like in
//    float64; the sum runs over j in code-word order. residual_element_of takes x_e given.
vec2 residual_element_of(float x_e, uint dict_head, uint e, uint idx[SPARSITY], float coef16[SPARSITY]) {
    uint raw = pc.raw_atoms_word + dict_head * pc.n_atoms * DIM + e;
    vec2 acc = vec2(0.0);
    [[dont_unroll]] for (uint j = 0u; j < SPARSITY; ++j)
        acc = df_add(acc, df_two_prod(coef16[j], dict_floats[raw + idx[j] * DIM]));
    vec2 approx = df_add(acc, vec2(dict_floats[pc.mean_word + dict_head * DIM + e], 0.0));
    vec2 r = df_sub(vec2(x_e, 0.0), approx);
    uint scale_float = pc.scale_word + dict_head * 2u * DIM + 2u * e;
    return df_mul(r, vec2(dict_floats[scale_float], dict_floats[scale_float + 1u]));
}

vec2 residual_element(uint dict_head, uint v, uint e, uint idx[SPARSITY], float coef16[SPARSITY]) {
    return residual_element_of(elem_at(X_ELEM((v * DIM + e) / LANES), e % LANES), dict_head, e, idx, coef16);
}

// u's RMS from its sum of squares.
vec2 residual_rms(vec2 sum_sq) { return df_sqrt(df_mul(sum_sq, df_recip(float(DIM)))); }

// 2. u's RMS and largest magnitude.
void residual_spread(vec2 u[DIM], out vec2 rms, out vec2 amax) {
    vec2 sum_sq = vec2(0.0);
    amax = vec2(0.0);
    [[unroll]] for (uint e = 0u; e < DIM; ++e) {
        sum_sq = df_add(sum_sq, df_mul(u[e], u[e]));
        vec2 mag = df_abs(u[e]);
        if (df_less(amax, mag))
            amax = mag;
    }
    rms = residual_rms(sum_sq);
}

void residual_input(uint dict_head, uint v, uint idx[SPARSITY], float coef16[SPARSITY],
                    out vec2 u[DIM], out vec2 rms, out vec2 amax) {
    [[unroll]] for (uint e = 0u; e < DIM; ++e)
        u[e] = residual_element(dict_head, v, e, idx, coef16);
    residual_spread(u, rms, amax);
}

// 3. Candidate s (residual.py's order): its float32 step and the df64 squared error.
//    In parts: the step, and one element's share of the error.
float residual_step(uint s, vec2 rms, vec2 amax) {
    vec2 mult = vec2(dict_floats[pc.steps_word + 2u * s], dict_floats[pc.steps_word + 2u * s + 1u]);
    return df_mul(s + 1u < N_STEPS ? rms : amax, mult).x;  // = float32(exact product)
}

vec2 residual_error_term(vec2 u, float step, vec2 inv_step) {
    float q = residual_level(u, inv_step);
    vec2 d = df_sub(u, df_two_prod(q - HALF_LEVEL, step));
    return df_mul(d, d);
}

float residual_candidate(uint s, vec2 u[DIM], vec2 rms, vec2 amax, out vec2 err) {
    float step = residual_step(s, rms, amax);
    vec2 inv_step = df_recip(step > 0.0 ? step : 1.0);
    err = vec2(0.0);
    [[unroll]] for (uint e = 0u; e < DIM; ++e)
        err = df_add(err, residual_error_term(u[e], step, inv_step));
    return step;
}

// 4. The winning levels as a bitstream, then the step. The stream's layout: element e's
//    level at bit e*b, straddling words as needed; residual_level_bits is the part of level q
//    of element e that lands in level word w (0 where none does).
uint residual_level_bits(uint q, uint e, uint w) {
    int off = int(e * RESIDUAL_BITS) - int(32u * w);
    if (off >= 32 || off + int(RESIDUAL_BITS) <= 0)
        return 0u;
    return off >= 0 ? q << uint(off) : q >> uint(-off);
}

// The elements with bits in level word w: [first, end).
uint residual_word_first(uint w) { return 32u * w / RESIDUAL_BITS; }
uint residual_word_end(uint w) { return min(DIM, (32u * w + 31u) / RESIDUAL_BITS + 1u); }

void residual_write(vec2 u[DIM], float best_step, uint out_word) {
    uint level_words[LEVEL_WORDS];
    [[unroll]] for (uint w = 0u; w < LEVEL_WORDS; ++w)
        level_words[w] = 0u;
    vec2 inv_best = df_recip(best_step > 0.0 ? best_step : 1.0);
    [[unroll]] for (uint e = 0u; e < DIM; ++e) {
        uint q = uint(residual_level(u[e], inv_best));
        uint w = e * RESIDUAL_BITS / 32u;
        level_words[w] |= residual_level_bits(q, e, w);
        if (w + 1u < LEVEL_WORDS)
            level_words[w + 1u] |= residual_level_bits(q, e, w + 1u);
    }
    for (uint w = 0u; w < LEVEL_WORDS; ++w)
        dest_words[out_word + w] = level_words[w];
    dest_words[out_word + LEVEL_WORDS] = floatBitsToUint(best_step);
}

// The whole stage in one invocation: strictly smaller error wins (the first on a tie).
void residual_stage(uint dict_head, uint v, uint idx[SPARSITY], float coef16[SPARSITY], uint out_word) {
    vec2 u[DIM];
    vec2 rms, amax;
    residual_input(dict_head, v, idx, coef16, u, rms, amax);
    float best_step = 0.0;
    vec2 best_err = vec2(0.0);
    [[dont_unroll]] for (uint s = 0u; s < N_STEPS; ++s) {
        vec2 err;
        float step = residual_candidate(s, u, rms, amax, err);
        if (s == 0u || df_less(err, best_err)) {
            best_err = err;
            best_step = step;
        }
    }
    residual_write(u, best_step, out_word);
}
