// pool.cu: MaxPool (with the flat argmax indices the backward rule saves),
// AveragePool, GlobalAveragePool, forward and backward.
// Reference: src/ops/conv.rs (pool_kernel, pool_backward, GlobalPool).
// Backward kernels gather (one thread per input element, outputs visited in
// row-major order as the CPU's scatter), so results are deterministic.

// x [planes, h, w] -> y [planes, oh, ow]; idx = plane * h * w + argmax (i64),
// the first maximum in window order, NaN-propagating as the CPU.
extern "C" __global__ void maxpool2d_fwd_f32(long long planes, Win k, const float* x, float* y, long long* idx) {
    MP_GRID_LOOP(t, planes * k.oh * k.ow) {
        long long pl = t / (k.oh * k.ow), yo = (t / k.ow) % k.oh, xo = t % k.ow;
        const float* src = x + pl * k.h * k.w;
        float best = __int_as_float(0xff800000);
        long long arg = 0;
        for (long long ki = 0; ki < k.kh; ++ki) {
            long long ih = yo * k.sh + ki * k.dh - k.ph;
            for (long long kj = 0; kj < k.kw; ++kj) {
                long long iw = xo * k.sw + kj * k.dw - k.pw;
                if (ih < 0 || iw < 0 || ih >= k.h || iw >= k.w) continue;
                long long off = ih * k.w + iw;
                float v = src[off];
                if (v > best || best != best) { best = v; arg = off; }
            }
        }
        y[t] = best;
        if (idx) idx[t] = pl * k.h * k.w + arg;
    }
}

// Output positions along one axis whose window can cover input position `i`.
__device__ __forceinline__ void mp_cover(long long i, long long p, long long s, long long kk, long long d, long long o, long long* lo, long long* hi) {
    long long top = i + p;                 // = out * s + k * d
    long long reach = (kk - 1) * d;
    long long l = top - reach;
    *lo = l <= 0 ? 0 : (l + s - 1) / s;
    long long h = top / s;
    *hi = h < o - 1 ? h : o - 1;
}

extern "C" __global__ void maxpool2d_bwd_f32(long long planes, Win k, const float* g, const long long* idx, float* dx) {
    MP_GRID_LOOP(t, planes * k.h * k.w) {
        long long pl = t / (k.h * k.w), ih = (t / k.w) % k.h, iw = t % k.w;
        long long ylo, yhi, xlo, xhi;
        mp_cover(ih, k.ph, k.sh, k.kh, k.dh, k.oh, &ylo, &yhi);
        mp_cover(iw, k.pw, k.sw, k.kw, k.dw, k.ow, &xlo, &xhi);
        float acc = 0.0f;
        for (long long yo = ylo; yo <= yhi; ++yo)
            for (long long xo = xlo; xo <= xhi; ++xo) {
                long long o = (pl * k.oh + yo) * k.ow + xo;
                if (idx[o] == t) acc += g[o];
            }
        dx[t] = acc;
    }
}

// Window statistics of output (yo, xo): count inside the input and inside the padding.
__device__ __forceinline__ void mp_avg_counts(const Win& k, long long yo, long long xo, long long* inside, long long* in_pad) {
    *inside = 0;
    *in_pad = 0;
    for (long long ki = 0; ki < k.kh; ++ki) {
        long long ih = yo * k.sh + ki * k.dh - k.ph;
        for (long long kj = 0; kj < k.kw; ++kj) {
            long long iw = xo * k.sw + kj * k.dw - k.pw;
            if (ih + k.ph < k.padded_h && iw + k.pw < k.padded_w) *in_pad += 1;
            if (ih >= 0 && iw >= 0 && ih < k.h && iw < k.w) *inside += 1;
        }
    }
}

extern "C" __global__ void avgpool2d_fwd_f32(long long planes, Win k, int include_pad, const float* x, float* y) {
    MP_GRID_LOOP(t, planes * k.oh * k.ow) {
        long long pl = t / (k.oh * k.ow), yo = (t / k.ow) % k.oh, xo = t % k.ow;
        const float* src = x + pl * k.h * k.w;
        double sum = 0.0;
        for (long long ki = 0; ki < k.kh; ++ki) {
            long long ih = yo * k.sh + ki * k.dh - k.ph;
            for (long long kj = 0; kj < k.kw; ++kj) {
                long long iw = xo * k.sw + kj * k.dw - k.pw;
                if (ih < 0 || iw < 0 || ih >= k.h || iw >= k.w) continue;
                sum += (double)src[ih * k.w + iw];
            }
        }
        long long inside, in_pad;
        mp_avg_counts(k, yo, xo, &inside, &in_pad);
        long long d = include_pad ? in_pad : inside;
        y[t] = (float)(sum / (double)(d > 0 ? d : 1));
    }
}

extern "C" __global__ void avgpool2d_bwd_f32(long long planes, Win k, int include_pad, const float* g, float* dx) {
    MP_GRID_LOOP(t, planes * k.h * k.w) {
        long long pl = t / (k.h * k.w), ih = (t / k.w) % k.h, iw = t % k.w;
        long long ylo, yhi, xlo, xhi;
        mp_cover(ih, k.ph, k.sh, k.kh, k.dh, k.oh, &ylo, &yhi);
        mp_cover(iw, k.pw, k.sw, k.kw, k.dw, k.ow, &xlo, &xhi);
        float acc = 0.0f;
        for (long long yo = ylo; yo <= yhi; ++yo) {
            long long ry = ih + k.ph - yo * k.sh;
            if (ry < 0 || ry % k.dh != 0 || ry / k.dh >= k.kh) continue;
            for (long long xo = xlo; xo <= xhi; ++xo) {
                long long rx = iw + k.pw - xo * k.sw;
                if (rx < 0 || rx % k.dw != 0 || rx / k.dw >= k.kw) continue;
                long long inside, in_pad;
                mp_avg_counts(k, yo, xo, &inside, &in_pad);
                long long d = include_pad ? in_pad : inside;
                acc += g[(pl * k.oh + yo) * k.ow + xo] / (float)(d > 0 ? d : 1);
            }
        }
        dx[t] = acc;
    }
}

// GlobalAveragePool: one block per plane, f64 sum / plane.
extern "C" __global__ void global_avgpool_fwd_f32(long long planes, long long plane, const float* x, float* y) {
    extern __shared__ double sh[];
    long long pl = blockIdx.x;
    double s = 0.0;
    for (long long j = threadIdx.x; j < plane; j += blockDim.x) s += (double)x[pl * plane + j];
    s = mp_block_sum(s, sh);
    if (threadIdx.x == 0) y[pl] = (float)(s / (double)plane);
}

extern "C" __global__ void global_avgpool_bwd_f32(long long planes, long long plane, const float* g, float* dx) {
    MP_GRID_LOOP(t, planes * plane) dx[t] = g[t / plane] / (float)plane;
}
