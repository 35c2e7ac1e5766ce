// half.cu: float16 and bfloat16 storage for the training step under a
// half-precision policy (exec::train's module doc: every float value held in its
// storage's type, computed in f32). Values are raw 16-bit words; `kind` 1 is
// float16, 2 bfloat16. The conversions are the `half` crate's (2.x, the CPU's
// Tensor::cast / Tensor::from_f32 / to_f32) written bit for bit in integer
// arithmetic: round to nearest even, overflow to infinity, NaN kept quiet with
// its top mantissa bits, so a value rounded here is the CPU's bitwise.

// half::binary16 f32_to_f16_fallback (the F16C instruction rounds the same).
__device__ __forceinline__ unsigned short mp_f32_to_f16(float value) {
    unsigned int x = __float_as_uint(value);
    unsigned int sign = x & 0x80000000u;
    unsigned int exp = x & 0x7F800000u;
    unsigned int man = x & 0x007FFFFFu;
    if (exp == 0x7F800000u) {
        unsigned int nan_bit = man == 0 ? 0u : 0x0200u;
        return (unsigned short)((sign >> 16) | 0x7C00u | nan_bit | (man >> 13));
    }
    unsigned int half_sign = sign >> 16;
    int half_exp = (int)(exp >> 23) - 127 + 15;
    if (half_exp >= 0x1F) return (unsigned short)(half_sign | 0x7C00u);
    if (half_exp <= 0) {
        if (14 - half_exp > 24) return (unsigned short)half_sign;
        man |= 0x00800000u;
        unsigned int half_man = man >> (14 - half_exp);
        unsigned int round_bit = 1u << (13 - half_exp);
        if ((man & round_bit) != 0 && (man & (3u * round_bit - 1u)) != 0) half_man += 1;
        return (unsigned short)(half_sign | half_man);
    }
    unsigned int he = (unsigned int)half_exp << 10;
    unsigned int half_man = man >> 13;
    unsigned int round_bit = 0x00001000u;
    if ((man & round_bit) != 0 && (man & (3u * round_bit - 1u)) != 0)
        return (unsigned short)((half_sign | he | half_man) + 1u);
    return (unsigned short)(half_sign | he | half_man);
}

// half::binary16 f16_to_f32_fallback (exact; NaN quiet, mantissa kept).
__device__ __forceinline__ float mp_f16_to_f32(unsigned short i) {
    unsigned int h = i;
    if ((h & 0x7FFFu) == 0) return __uint_as_float(h << 16);
    unsigned int half_sign = h & 0x8000u;
    unsigned int half_exp = h & 0x7C00u;
    unsigned int half_man = h & 0x03FFu;
    if (half_exp == 0x7C00u) {
        if (half_man == 0) return __uint_as_float((half_sign << 16) | 0x7F800000u);
        return __uint_as_float((half_sign << 16) | 0x7FC00000u | (half_man << 13));
    }
    unsigned int sign = half_sign << 16;
    int unbiased_exp = (int)(half_exp >> 10) - 15;
    if (half_exp == 0) {
        // A subnormal: normalized by the leading zeros of its 10-bit mantissa.
        int e = 0;
        unsigned int m = half_man;
        while ((m & 0x0200u) == 0) { m <<= 1; ++e; }
        unsigned int ex = (unsigned int)(127 - 15 - e) << 23;
        unsigned int mn = (half_man << (14 + e)) & 0x7FFFFFu;
        return __uint_as_float(sign | ex | mn);
    }
    unsigned int ex = (unsigned int)(unbiased_exp + 127) << 23;
    unsigned int mn = half_man << 13;
    return __uint_as_float(sign | ex | mn);
}

// half::bfloat f32_to_bf16.
__device__ __forceinline__ unsigned short mp_f32_to_bf16(float value) {
    unsigned int x = __float_as_uint(value);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (unsigned short)((x >> 16) | 0x0040u);
    unsigned int round_bit = 0x00008000u;
    if ((x & round_bit) != 0 && (x & (3u * round_bit - 1u)) != 0)
        return (unsigned short)((x >> 16) + 1u);
    return (unsigned short)(x >> 16);
}

// half::bfloat bf16_to_f32.
__device__ __forceinline__ float mp_bf16_to_f32(unsigned short i) {
    unsigned int h = i;
    if ((h & 0x7FFFu) > 0x7F80u) return __uint_as_float((h | 0x0040u) << 16);
    return __uint_as_float(h << 16);
}

__device__ __forceinline__ float mp_widen(int kind, unsigned short v) {
    return kind == 1 ? mp_f16_to_f32(v) : mp_bf16_to_f32(v);
}
__device__ __forceinline__ unsigned short mp_round(int kind, float v) {
    return kind == 1 ? mp_f32_to_f16(v) : mp_f32_to_bf16(v);
}

// y = x as f32 (a kernel's input widened: Tensor::to_f32).
extern "C" __global__ void half_to_f32(int kind, long long n, const unsigned short* x, float* y) {
    MP_GRID_LOOP(i, n) y[i] = mp_widen(kind, x[i]);
}

// y = x rounded to the half type (a kernel's output stored: Tensor::from_f32).
extern "C" __global__ void f32_to_half(int kind, long long n, const float* x, unsigned short* y) {
    MP_GRID_LOOP(i, n) y[i] = mp_round(kind, x[i]);
}

// In place y = round(y + x), added in f32 (StepBackend::accumulate on the CPU).
extern "C" __global__ void accumulate_half(int kind, long long n, const unsigned short* x, unsigned short* y) {
    MP_GRID_LOOP(i, n) y[i] = mp_round(kind, mp_widen(kind, y[i]) + mp_widen(kind, x[i]));
}

// p = round(p - lr * g) in f32 (the CPU's SGD of a bf16 parameter, rounded back);
// the product rounded on its own, as the CPU computes it (no FMA contraction).
extern "C" __global__ void sgd_half(int kind, long long n, float lr, const unsigned short* g, unsigned short* p) {
    MP_GRID_LOOP(i, n) p[i] = mp_round(kind, mp_widen(kind, p[i]) - __fmul_rn(lr, mp_widen(kind, g[i])));
}
