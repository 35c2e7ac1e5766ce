// softmax.cu: Softmax and LogSoftmax along one axis, forward and backward.
// Reference: src/ops/norm.rs (softmax_kernel, Softmax::backward_cpu).
// The tensor is viewed as [outer, n, inner]; one thread per (outer, inner) line,
// reading it sequentially in the CPU's order (max, then f32 sum of exp).

extern "C" __global__ void softmax_fwd_f32(int log_softmax, long long outer, long long n, long long inner, const float* x, float* y) {
    MP_GRID_LOOP(t, outer * inner) {
        long long o = t / inner, i = t % inner;
        const float* xb = x + o * n * inner + i;
        float* yb = y + o * n * inner + i;
        float mx = __int_as_float(0xff800000);
        for (long long k = 0; k < n; ++k) if (xb[k * inner] > mx) mx = xb[k * inner];
        float sum = 0.0f;
        for (long long k = 0; k < n; ++k) {
            float e = expf(xb[k * inner] - mx);
            yb[k * inner] = e;
            sum += e;
        }
        if (log_softmax) {
            float ls = logf(sum);
            for (long long k = 0; k < n; ++k) yb[k * inner] = xb[k * inner] - mx - ls;
        } else {
            float inv = 1.0f / sum;
            for (long long k = 0; k < n; ++k) yb[k * inner] *= inv;
        }
    }
}

// Softmax: dx = y (g - Σ g y); LogSoftmax: dx = g - exp(y) Σ g (sums in f64).
extern "C" __global__ void softmax_bwd_f32(int log_softmax, long long outer, long long n, long long inner, const float* y, const float* g, float* dx) {
    MP_GRID_LOOP(t, outer * inner) {
        long long o = t / inner, i = t % inner;
        long long base = o * n * inner + i;
        double s = 0.0;
        for (long long k = 0; k < n; ++k) {
            long long at = base + k * inner;
            s += log_softmax ? (double)g[at] : (double)g[at] * (double)y[at];
        }
        float sf = (float)s;
        for (long long k = 0; k < n; ++k) {
            long long at = base + k * inner;
            dx[at] = log_softmax ? g[at] - expf(y[at]) * sf : y[at] * (g[at] - sf);
        }
    }
}
