// norm.cu: BatchNormalization (training statistics) and LayerNormalization,
// forward and backward. Reference: src/ops/norm.rs (batch_norm_kernel,
// batch_norm_backward, layer_norm_kernel, layer_norm_backward).
// Statistics are f64 as on the CPU; per-channel / per-row sums are block
// reductions (a different summation order than the CPU's sequential one, so
// results agree to rounding, well inside 1e-4 relative).
// Launch the block-reduction kernels with a power-of-two blockDim.x and
// blockDim.x * 8 bytes of dynamic shared memory.

// BatchNorm statistics of x [n, c, plane]: one block per channel;
// stats[2ch] = mean, stats[2ch + 1] = biased variance (two passes, f64).
extern "C" __global__ void bn_stats_f32(long long n, long long c, long long plane, const float* x, double* stats) {
    extern __shared__ double sh[];
    long long ch = blockIdx.x;
    long long count = n * plane;
    double s = 0.0;
    for (long long j = threadIdx.x; j < count; j += blockDim.x) {
        long long img = j / plane, p = j % plane;
        s += (double)x[(img * c + ch) * plane + p];
    }
    double mu = mp_block_sum(s, sh) / (double)(count > 0 ? count : 1);
    double v = 0.0;
    for (long long j = threadIdx.x; j < count; j += blockDim.x) {
        long long img = j / plane, p = j % plane;
        double d = (double)x[(img * c + ch) * plane + p] - mu;
        v += d * d;
    }
    double var = mp_block_sum(v, sh) / (double)(count > 0 ? count : 1);
    if (threadIdx.x == 0) {
        stats[2 * ch] = mu;
        stats[2 * ch + 1] = var;
    }
}

// y = x k + b per channel, k = scale / sqrt(var + eps), b = bias - mu k (f64, then f32).
extern "C" __global__ void bn_apply_f32(long long n, long long c, long long plane, const float* x, const float* scale, const float* bias, const double* stats, double eps, float* y) {
    MP_GRID_LOOP(i, n * c * plane) {
        long long ch = (i / plane) % c;
        double mu = stats[2 * ch], v = stats[2 * ch + 1];
        double k = (double)scale[ch] / sqrt(v + eps);
        double b = (double)bias[ch] - mu * k;
        y[i] = x[i] * (float)k + (float)b;
    }
}

// Per channel: the extras (mean, 1/sqrt(var + eps)) and the running statistics
// `old * momentum + batch * (1 - momentum)`; any output pointer may be null.
extern "C" __global__ void bn_finish_f32(long long c, const double* stats, double eps, double momentum, const float* run_mean, const float* run_var, float* new_mean, float* new_var, float* mean, float* invstd, float* batch_mean, float* batch_var) {
    MP_GRID_LOOP(ch, c) {
        double mu = stats[2 * ch], v = stats[2 * ch + 1];
        if (new_mean) new_mean[ch] = (float)((double)run_mean[ch] * momentum + mu * (1.0 - momentum));
        if (new_var) new_var[ch] = (float)((double)run_var[ch] * momentum + v * (1.0 - momentum));
        if (mean) mean[ch] = (float)mu;
        if (invstd) invstd[ch] = (float)(1.0 / sqrt(v + eps));
        if (batch_mean) batch_mean[ch] = (float)mu;
        if (batch_var) batch_var[ch] = (float)v;
    }
}

// Backward sums per channel (one block each): sums[2ch] = Σ g,
// sums[2ch + 1] = Σ g (x - mean) invstd (skipped when x is null).
extern "C" __global__ void bn_bwd_reduce_f32(long long n, long long c, long long plane, const float* g, const float* x, const float* mean, const float* invstd, double* sums) {
    extern __shared__ double sh[];
    long long ch = blockIdx.x;
    long long count = n * plane;
    double mu = x ? (double)mean[ch] : 0.0, r = x ? (double)invstd[ch] : 0.0;
    double sg = 0.0, sgx = 0.0;
    for (long long j = threadIdx.x; j < count; j += blockDim.x) {
        long long at = ((j / plane) * c + ch) * plane + j % plane;
        double gv = (double)g[at];
        sg += gv;
        if (x) sgx += gv * ((double)x[at] - mu) * r;
    }
    sg = mp_block_sum(sg, sh);
    sgx = mp_block_sum(sgx, sh);
    if (threadIdx.x == 0) {
        sums[2 * ch] = sg;
        sums[2 * ch + 1] = sgx;
    }
}

// dx = scale invstd (g - mean(g) - x̂ mean(g x̂)), in f64.
extern "C" __global__ void bn_bwd_dx_f32(long long n, long long c, long long plane, const float* g, const float* x, const float* mean, const float* invstd, const float* scale, const double* sums, float* dx) {
    double count = (double)(n * plane > 0 ? n * plane : 1);
    MP_GRID_LOOP(i, n * c * plane) {
        long long ch = (i / plane) % c;
        double mu = mean[ch], r = invstd[ch];
        double mg = sums[2 * ch] / count, mgx = sums[2 * ch + 1] / count;
        double k = (double)scale[ch] * r;
        double xh = ((double)x[i] - mu) * r;
        dx[i] = (float)(k * ((double)g[i] - mg - xh * mgx));
    }
}

// dscale = Σ g x̂, dbias = Σ g, from bn_bwd_reduce_f32's sums (either may be null).
extern "C" __global__ void bn_bwd_params_f32(long long c, const double* sums, float* dscale, float* dbias) {
    MP_GRID_LOOP(ch, c) {
        if (dscale) dscale[ch] = (float)sums[2 * ch + 1];
        if (dbias) dbias[ch] = (float)sums[2 * ch];
    }
}

// LayerNorm over rows of `cols` (one block per row): y = ((x - mu) inv as f32)
// * scale + bias, scale/bias given at full [cols] (null: 1 and 0); mean and
// invstd per row (f32, the extras), either may be null.
extern "C" __global__ void ln_fwd_f32(long long rows, long long cols, const float* x, const float* scale, const float* bias, double eps, float* y, float* mean, float* invstd) {
    extern __shared__ double sh[];
    long long r = blockIdx.x;
    const float* xr = x + r * cols;
    double s = 0.0;
    for (long long k = threadIdx.x; k < cols; k += blockDim.x) s += (double)xr[k];
    double mu = mp_block_sum(s, sh) / (double)cols;
    double v = 0.0;
    for (long long k = threadIdx.x; k < cols; k += blockDim.x) {
        double d = (double)xr[k] - mu;
        v += d * d;
    }
    double var = mp_block_sum(v, sh) / (double)cols;
    double inv = 1.0 / sqrt(var + eps);
    for (long long k = threadIdx.x; k < cols; k += blockDim.x) {
        float xh = (float)(((double)xr[k] - mu) * inv);
        y[r * cols + k] = xh * (scale ? scale[k] : 1.0f) + (bias ? bias[k] : 0.0f);
    }
    if (threadIdx.x == 0) {
        if (mean) mean[r] = (float)mu;
        if (invstd) invstd[r] = (float)inv;
    }
}

// dx per row (one block each): h = g scale, dx = inv (h - mean(h) - x̂ mean(h x̂)).
extern "C" __global__ void ln_bwd_dx_f32(long long rows, long long cols, const float* g, const float* x, const float* mean, const float* invstd, const float* scale, float* dx) {
    extern __shared__ double sh[];
    long long r = blockIdx.x;
    double mu = mean[r], rs = invstd[r];
    double a = 0.0, b = 0.0;
    for (long long k = threadIdx.x; k < cols; k += blockDim.x) {
        double h = (double)g[r * cols + k] * (double)scale[k];
        a += h;
        b += h * (((double)x[r * cols + k] - mu) * rs);
    }
    double mh = mp_block_sum(a, sh) / (double)cols;
    double mhx = mp_block_sum(b, sh) / (double)cols;
    for (long long k = threadIdx.x; k < cols; k += blockDim.x) {
        double h = (double)g[r * cols + k] * (double)scale[k];
        double xh = ((double)x[r * cols + k] - mu) * rs;
        dx[r * cols + k] = (float)(rs * (h - mh - xh * mhx));
    }
}

// Per column (one thread each, rows in order as the CPU): dscale = Σ g x̂,
// dbias = Σ g (either may be null; x, mean, invstd unused when dscale is null).
extern "C" __global__ void ln_bwd_params_f32(long long rows, long long cols, const float* g, const float* x, const float* mean, const float* invstd, float* dscale, float* dbias) {
    MP_GRID_LOOP(k, cols) {
        double a = 0.0, b = 0.0;
        for (long long r = 0; r < rows; ++r) {
            double gv = (double)g[r * cols + k];
            if (dscale) a += gv * (((double)x[r * cols + k] - (double)mean[r]) * (double)invstd[r]);
            b += gv;
        }
        if (dscale) dscale[k] = (float)a;
        if (dbias) dbias[k] = (float)b;
    }
}
