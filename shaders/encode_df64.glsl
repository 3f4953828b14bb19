// Double-float ("df64") arithmetic: a value is the unevaluated sum hi + lo of two float32
// (vec2(hi, lo), |lo| <= ulp(hi)/2), good to about 2^-47 relative.
//
// Why: the residual stage must pick the same step and levels as kvdict_vk.residual.quantise,
// which works in float64 and stores the step as float32. Plain float32 would flip the stored
// step's last bit for a sizeable fraction of vectors; df64 makes a disagreement need an exact
// value within ~2^-47 of a float32 rounding boundary. fp64 in shaders is an optional feature,
// so it is emulated here with core float32 only.
//
// The error-free transforms below rely on Vulkan's correctly rounded OpFAdd/OpFSub/OpFMul
// and on nothing being fused or reassociated: every temporary is `precise` (SPIR-V
// NoContraction). Division and sqrt are NOT correctly rounded in Vulkan (2.5 ulp and
// worse), so they only seed Newton steps whose corrections are error-free.

// s + err == a + b exactly (Knuth).
vec2 df_two_sum(float a, float b) {
    precise float s = a + b;
    precise float bb = s - a;
    precise float err = (a - (s - bb)) + (b - bb);
    return vec2(s, err);
}

// s + err == a + b exactly, for |a| >= |b| or a == 0 (Dekker).
vec2 df_fast_two_sum(float a, float b) {
    precise float s = a + b;
    precise float err = b - (s - a);
    return vec2(s, err);
}

// a == hi + lo with hi, lo of at most 12 significant bits each (Veltkamp split).
vec2 df_split(float a) {
    precise float c = 4097.0 * a;
    precise float hi = c - (c - a);
    precise float lo = a - hi;
    return vec2(hi, lo);
}

// p + err == a * b exactly (Dekker; no fma: Vulkan does not promise a fused fma).
vec2 df_two_prod(float a, float b) {
    precise float p = a * b;
    vec2 as = df_split(a);
    vec2 bs = df_split(b);
    precise float err = ((as.x * bs.x - p) + as.x * bs.y + as.y * bs.x) + as.y * bs.y;
    return vec2(p, err);
}

vec2 df_add(vec2 a, vec2 b) {
    vec2 s = df_two_sum(a.x, b.x);
    vec2 t = df_two_sum(a.y, b.y);
    precise float lo = s.y + t.x;
    s = df_fast_two_sum(s.x, lo);
    precise float lo2 = s.y + t.y;
    return df_fast_two_sum(s.x, lo2);
}

vec2 df_neg(vec2 a) { return vec2(-a.x, -a.y); }
vec2 df_sub(vec2 a, vec2 b) { return df_add(a, df_neg(b)); }

vec2 df_mul(vec2 a, vec2 b) {
    vec2 p = df_two_prod(a.x, b.x);
    precise float cross = a.x * b.y + a.y * b.x;
    precise float lo = p.y + cross;
    return df_fast_two_sum(p.x, lo);
}

vec2 df_mul_f(vec2 a, float b) {
    vec2 p = df_two_prod(a.x, b);
    precise float lo = p.y + a.y * b;
    return df_fast_two_sum(p.x, lo);
}

// 1 / b for a finite b != 0: a float32 seed refined by two Newton steps, each computing its
// error term 1 - b·y exactly.
vec2 df_recip(float b) {
    vec2 y = vec2(1.0 / b, 0.0);
    for (int it = 0; it < 2; ++it) {
        vec2 e = df_sub(vec2(1.0, 0.0), df_mul_f(y, b));
        y = df_add(y, df_mul(y, e));
    }
    return y;
}

// sqrt(a) for a >= 0 (0 for a <= 0): a float32 seed and two Newton steps y += (a - y²)/(2y).
vec2 df_sqrt(vec2 a) {
    if (a.x <= 0.0)
        return vec2(0.0);
    vec2 y = vec2(sqrt(a.x), 0.0);
    for (int it = 0; it < 2; ++it) {
        vec2 e = df_sub(a, df_mul(y, y));
        // e is ~2^-22·a or smaller, so a float32 quotient is accurate enough for the step.
        precise float step = e.x * (0.5 / y.x);
        y = df_add(y, vec2(step, 0.0));
    }
    return y;
}

// Signed comparison a < b, exact for normalised pairs (the sign of the df difference).
bool df_less(vec2 a, vec2 b) { return df_sub(a, b).x < 0.0; }

vec2 df_abs(vec2 a) { return a.x < 0.0 ? df_neg(a) : a; }

// rint(a) — round half to even, like numpy.rint — for |a| < 2^23. hi is the float32 nearest
// to hi + lo, so the sum can only sit on the other side of a .5 boundary when hi is exactly
// on it; then lo's sign decides, and lo == 0 leaves the tie to roundEven.
float df_rint(vec2 a) {
    precise float frac = a.x - floor(a.x);
    if (frac == 0.5 && a.y != 0.0)
        return a.y > 0.0 ? ceil(a.x) : floor(a.x);
    return roundEven(a.x);
}
