// common.cuh: prepended by memplan to every kernels/*.cu before NVRTC compiles it.
// Strided-index descriptor (numpy broadcasting, transposes, slices, reductions),
// SplitMix64 (src/exec/rng.rs, bit for bit) and f64 block reductions.
// No host headers: NVRTC compiles this without a CUDA toolkit installed.

#define MP_MAX_RANK 8
#define MP_MAX_OPS 3

// A row-major iteration space `shape[rank]` and, for up to three operands, the
// element stride of each axis (0 along broadcast axes). Mirrors
// `exec::cuda::Strided` (#[repr(C)]).
struct Strided {
    int rank;
    int pad_;
    long long shape[MP_MAX_RANK];
    long long st[MP_MAX_OPS][MP_MAX_RANK];
};
static_assert(sizeof(Strided) == 264, "Strided must match exec::cuda::Strided");

// Offsets of the `nops` operands at row-major index `o` of the iteration space.
__device__ __forceinline__ void mp_offsets(const Strided& d, long long o, long long* off, int nops) {
    for (int k = 0; k < nops; ++k) off[k] = 0;
    for (int i = d.rank - 1; i >= 0; --i) {
        long long n = d.shape[i];
        long long c = o % n;
        o /= n;
        for (int k = 0; k < nops; ++k) off[k] += c * d.st[k][i];
    }
}

#define MP_GRID_LOOP(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)blockDim.x * gridDim.x)

// SplitMix64, as src/exec/rng.rs.
__device__ __forceinline__ unsigned long long mp_mix(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}
__device__ __forceinline__ unsigned long long mp_at(unsigned long long seed, unsigned long long i) {
    return mp_mix(seed + (i + 1ULL) * 0x9E3779B97F4A7C15ULL);
}
// rng::unit_f32: 24 random bits times 2^-24 (exact in f32).
__device__ __forceinline__ float mp_unit_f32(unsigned long long seed, unsigned long long i) {
    return (float)(mp_at(seed, i) >> 40) * (1.0f / 16777216.0f);
}

// Sum of `v` over the block (blockDim.x a power of two, at most 1024); every
// thread gets the result. `sh` holds blockDim.x doubles.
__device__ __forceinline__ double mp_block_sum(double v, double* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    double r = sh[0];
    __syncthreads();
    return r;
}

// A 1-D or 2-D sliding window as 2-D (src/ops/conv.rs `Window`); mirrors
// `exec::cuda::Win` (#[repr(C)]).
struct Win {
    long long h, w, oh, ow, kh, kw, sh, sw, dh, dw, ph, pw, padded_h, padded_w;
};
static_assert(sizeof(Win) == 112, "Win must match exec::cuda::Win");
