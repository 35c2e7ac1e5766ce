// conv.cu: the data movement of Conv through GEMM (cuBLAS does the products):
// im2col, its adjoint col2im, the bias add and the bias gradient.
// Reference: src/ops/conv.rs (im2col, col2im, conv_kernel, conv_backward_kernel).

// col [c * kh * kw, oh * ow] from one image-group x [c, h, w].
extern "C" __global__ void im2col_f32(long long c, Win k, const float* x, float* col) {
    long long plane = k.oh * k.ow;
    MP_GRID_LOOP(t, c * k.kh * k.kw * plane) {
        long long row = t / plane, p = t % plane;
        long long ch = row / (k.kh * k.kw), ki = (row / k.kw) % k.kh, kj = row % k.kw;
        long long yo = p / k.ow, xo = p % k.ow;
        long long ih = yo * k.sh + ki * k.dh - k.ph;
        long long iw = xo * k.sw + kj * k.dw - k.pw;
        col[t] = (ih < 0 || iw < 0 || ih >= k.h || iw >= k.w) ? 0.0f : x[(ch * k.h + ih) * k.w + iw];
    }
}

// dx [c, h, w] = col2im(col): one thread per input element gathers its
// contributions in (ki, kj) order, the order of the CPU's scatter.
extern "C" __global__ void col2im_f32(long long c, Win k, const float* col, float* dx) {
    long long plane = k.oh * k.ow;
    MP_GRID_LOOP(t, c * k.h * k.w) {
        long long ch = t / (k.h * k.w), ih = (t / k.w) % k.h, iw = t % k.w;
        float acc = 0.0f;
        for (long long ki = 0; ki < k.kh; ++ki) {
            long long ty = ih + k.ph - ki * k.dh;
            if (ty < 0 || ty % k.sh != 0 || ty / k.sh >= k.oh) continue;
            long long yo = ty / k.sh;
            for (long long kj = 0; kj < k.kw; ++kj) {
                long long tx = iw + k.pw - kj * k.dw;
                if (tx < 0 || tx % k.sw != 0 || tx / k.sw >= k.ow) continue;
                long long xo = tx / k.sw;
                long long row = (ch * k.kh + ki) * k.kw + kj;
                acc += col[row * plane + yo * k.ow + xo];
            }
        }
        dx[t] = acc;
    }
}

// y [n, m, plane] += bias[m].
extern "C" __global__ void conv_bias_f32(long long n, long long m, long long plane, const float* bias, float* y) {
    MP_GRID_LOOP(t, n * m * plane) y[t] += bias[(t / plane) % m];
}

// db[o] = Σ_img (Σ_plane g) in f64, images in order (conv_backward_kernel's order).
extern "C" __global__ void channel_sum_f32(long long n, long long m, long long plane, const float* g, float* db) {
    MP_GRID_LOOP(o, m) {
        double acc = 0.0;
        for (long long img = 0; img < n; ++img) {
            const float* row = g + (img * m + o) * plane;
            double s = 0.0;
            for (long long p = 0; p < plane; ++p) s += (double)row[p];
            acc += s;
        }
        db[o] = (float)acc;
    }
}
