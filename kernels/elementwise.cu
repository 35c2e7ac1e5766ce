// elementwise.cu: unary and binary element-wise ops, comparisons, Where, Clip,
// Dropout, and their backward. Reference: src/ops/elementwise/ (the unary
// table, binary_kernel, binary_backward, clip, dropout_kernel). Binary and
// comparison codes are exec::cuda::ops::elementwise's `binary_code`/`compare_code`.

__device__ __forceinline__ float mp_sigmoid(float x) {
    if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
    float e = expf(x);
    return e / (1.0f + e);
}
__device__ __forceinline__ float mp_softplus(float x) {
    return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));
}
// Gelu: `tanh` 0 for the exact (erf) form, 1 for the tanh approximation.
__device__ __forceinline__ float mp_gelu(float x, float tanh_form) {
    if (tanh_form == 0.0f) return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    const float c = 0.79788456080286536f;
    return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float mp_gelu_d(float s, float tanh_form) {
    if (tanh_form == 0.0f) {
        float cdf = 0.5f * (1.0f + erff(s * 0.70710678118654752f));
        float pdf = expf(-0.5f * s * s) * (0.5f * 1.12837916709551257f) * 0.70710678118654752f;
        return cdf + s * pdf;
    }
    const float c = 0.79788456080286536f;
    float t = tanhf(c * (s + 0.044715f * s * s * s));
    return 0.5f * (1.0f + t) + 0.5f * s * (1.0f - t * t) * c * (1.0f + 3.0f * 0.044715f * s * s);
}

__device__ __forceinline__ float mp_pow(float x, float y) {
    if (y == 2.0f) return x * x;
    if (y == 3.0f) return x * x * x;
    return powf(x, y);
}

// Generated from the op tables of src/ops/elementwise/ where the marker below
// stands (the op code is the row's index):
// - mp_unary(op, x, alpha, beta, gamma), mp_unary_d(op, s, ...): `UNARY`;
// - mp_binary(op, a, b), mp_binary_d(op, slot, gv, A, B, Y): `BINARY`;
// - mp_compare(op, x, z): `COMPARE`.
// @op-tables

extern "C" __global__ void unary_fwd_f32(int op, long long n, const float* x, float* y, float alpha, float beta, float gamma) {
    MP_GRID_LOOP(i, n) y[i] = mp_unary(op, x[i], alpha, beta, gamma);
}

// dx = g * f'(s); `s` null for ops whose derivative reads nothing.
extern "C" __global__ void unary_bwd_f32(int op, long long n, const float* g, const float* s, float* dx, float alpha, float beta, float gamma) {
    MP_GRID_LOOP(i, n) dx[i] = g[i] * mp_unary_d(op, s ? s[i] : 0.0f, alpha, beta, gamma);
}

// y = a op b over the broadcast shape; d.st[0] strides of a, d.st[1] of b.
extern "C" __global__ void binary_fwd_f32(int op, long long n, Strided d, const float* a, const float* b, float* y) {
    MP_GRID_LOOP(i, n) {
        long long off[2];
        mp_offsets(d, i, off, 2);
        y[i] = mp_binary(op, a[off[0]], b[off[1]]);
    }
}

// Gradient of operand `slot` at the broadcast shape (binary_backward's `full`;
// the caller sums it back to the operand's shape with reduce_f32).
// d.st[0]: a, d.st[1]: b, d.st[2]: y (the saved output, Pow's exponent gradient).
// Operands the rule does not save for `slot` may be null.
extern "C" __global__ void binary_bwd_f32(int op, int slot, long long n, Strided d, const float* g, const float* a, const float* b, const float* y, float* out) {
    MP_GRID_LOOP(i, n) {
        long long off[3];
        mp_offsets(d, i, off, 3);
        float A = a ? a[off[0]] : 0.0f, B = b ? b[off[1]] : 0.0f, Y = y ? y[off[2]] : 0.0f;
        out[i] = mp_binary_d(op, slot, g[i], A, B, Y);
    }
}

// Comparisons of floats to bool (one byte per element).
extern "C" __global__ void compare_f32(int op, long long n, Strided d, const float* a, const float* b, unsigned char* y) {
    MP_GRID_LOOP(i, n) {
        long long off[2];
        mp_offsets(d, i, off, 2);
        y[i] = mp_compare(op, a[off[0]], b[off[1]]) ? 1 : 0;
    }
}

// Where(c, x, y) over the broadcast shape: d.st[0] c, d.st[1] x, d.st[2] y.
extern "C" __global__ void where_f32(long long n, Strided d, const unsigned char* c, const float* x, const float* y, float* out) {
    MP_GRID_LOOP(i, n) {
        long long off[3];
        mp_offsets(d, i, off, 3);
        out[i] = c[off[0]] ? x[off[1]] : y[off[2]];
    }
}

// Where backward: the gradient of x (`slot` 1) or y (`slot` 2) at the broadcast
// shape, zero where the other branch was taken. d.st[0] strides of c.
extern "C" __global__ void where_bwd_f32(int slot, long long n, Strided d, const unsigned char* c, const float* g, float* out) {
    MP_GRID_LOOP(i, n) {
        long long off[1];
        mp_offsets(d, i, off, 1);
        bool take = c[off[0]] != 0;
        out[i] = (slot == 1) == take ? g[i] : 0.0f;
    }
}

extern "C" __global__ void clip_fwd_f32(long long n, const float* x, float* y, float lo, float hi) {
    MP_GRID_LOOP(i, n) y[i] = fminf(fmaxf(x[i], lo), hi);
}

extern "C" __global__ void clip_bwd_f32(long long n, const float* g, const float* x, float* dx, float lo, float hi) {
    MP_GRID_LOOP(i, n) dx[i] = (x[i] >= lo && x[i] <= hi) ? g[i] : 0.0f;
}

// Training Dropout: keep element i iff rng::unit_f32(seed, i) >= ratio (compared
// in f64 as the CPU), y = x * scale where kept; mask one byte per element.
extern "C" __global__ void dropout_fwd_f32(long long n, unsigned long long seed, double ratio, float scale, const float* x, float* y, unsigned char* mask) {
    MP_GRID_LOOP(i, n) {
        bool keep = (double)mp_unit_f32(seed, (unsigned long long)i) >= ratio;
        mask[i] = keep ? 1 : 0;
        y[i] = keep ? x[i] * scale : 0.0f;
    }
}

extern "C" __global__ void dropout_bwd_f32(long long n, float scale, const float* g, const unsigned char* mask, float* dx) {
    MP_GRID_LOOP(i, n) dx[i] = mask[i] ? g[i] * scale : 0.0f;
}

extern "C" __global__ void fill_f32(long long n, float v, float* y) {
    MP_GRID_LOOP(i, n) y[i] = v;
}

// In-place y += x (gradient accumulation of a tensor read by several nodes).
extern "C" __global__ void accumulate_f32(long long n, const float* x, float* y) {
    MP_GRID_LOOP(i, n) y[i] += x[i];
}

// y -= lr * g (the SGD step of exec::train).
extern "C" __global__ void sgd_f32(long long n, float lr, const float* g, float* y) {
    MP_GRID_LOOP(i, n) y[i] -= lr * g[i];
}

// y = s * x.
extern "C" __global__ void scale_f32(long long n, float s, const float* x, float* y) {
    MP_GRID_LOOP(i, n) y[i] = s * x[i];
}

// Cast between float32 (0), int64 (1), int32 (2) and bool (3), as Tensor::cast:
// integers and bools through i64, floats to integers truncated and saturated
// (NaN to 0, Rust's `as`), to bool `!= 0`.
extern "C" __global__ void cast_any(int from, int to, long long n, const void* src, void* dst) {
    MP_GRID_LOOP(i, n) {
        if (from == 0) {
            float v = ((const float*)src)[i];
            if (to == 0) ((float*)dst)[i] = v;
            else if (to == 3) ((unsigned char*)dst)[i] = v != 0.0f ? 1 : 0;
            else {
                double d = (double)v;
                if (to == 1) {
                    long long r = d != d ? 0LL
                        : d >= 9223372036854775807.0 ? 9223372036854775807LL
                        : d <= -9223372036854775808.0 ? (-9223372036854775807LL - 1) : (long long)d;
                    ((long long*)dst)[i] = r;
                } else {
                    int r = d != d ? 0 : d >= 2147483647.0 ? 2147483647
                        : d <= -2147483648.0 ? (-2147483647 - 1) : (int)d;
                    ((int*)dst)[i] = r;
                }
            }
        } else {
            long long v = from == 1 ? ((const long long*)src)[i]
                : from == 2 ? (long long)((const int*)src)[i]
                : (long long)(((const unsigned char*)src)[i] != 0);
            if (to == 0) ((float*)dst)[i] = (float)v;
            else if (to == 1) ((long long*)dst)[i] = v;
            else if (to == 2) ((int*)dst)[i] = (int)v;
            else ((unsigned char*)dst)[i] = v != 0 ? 1 : 0;
        }
    }
}
