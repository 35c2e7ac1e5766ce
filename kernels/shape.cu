// shape.cu: data movement of the shape ops on the device: strided copies
// (Transpose, Slice, Expand, Concat, Split, contiguous copies of views), Gather
// along an axis and its backward. Reference: src/ops/shape.rs.
// Copies are by element size (1, 2, 4 and 8 bytes), so every dtype is covered.

// dst[dst_base + Σ c_i d.st[1][i]] = src[src_base + Σ c_i d.st[0][i]] for every
// coordinate c of d.shape (row-major index t).
#define MP_STRIDED_COPY(NAME, T) \
extern "C" __global__ void NAME(long long n, Strided d, long long src_base, const T* src, long long dst_base, T* dst) { \
    MP_GRID_LOOP(t, n) { \
        long long off[2]; \
        mp_offsets(d, t, off, 2); \
        dst[dst_base + off[1]] = src[src_base + off[0]]; \
    } \
}
MP_STRIDED_COPY(strided_copy_b1, unsigned char)
MP_STRIDED_COPY(strided_copy_b2, unsigned short)
MP_STRIDED_COPY(strided_copy_b4, unsigned int)
MP_STRIDED_COPY(strided_copy_b8, unsigned long long)

// Gather along an axis: x [outer, axis_dim, inner], idx [n_idx] (negative
// counts from the end) -> y [outer, n_idx, inner]. An out-of-range index
// writes NaN (the CPU kernel rejects it before running).
extern "C" __global__ void gather_f32(long long outer, long long axis_dim, long long n_idx, long long inner, const long long* idx, const float* x, float* y) {
    MP_GRID_LOOP(t, outer * n_idx * inner) {
        long long o = t / (n_idx * inner), i = (t / inner) % n_idx, k = t % inner;
        long long j = idx[i];
        if (j < 0) j += axis_dim;
        y[t] = (j < 0 || j >= axis_dim) ? __int_as_float(0x7fc00000) : x[(o * axis_dim + j) * inner + k];
    }
}

// Gather backward: dx [outer, axis_dim, inner] (zeroed by the caller) +=
// g [outer, n_idx, inner] at the gathered rows; one thread per (outer, inner)
// column walks the indices in order: deterministic, repeated indices summed in
// the CPU's order.
extern "C" __global__ void gather_bwd_f32(long long outer, long long axis_dim, long long n_idx, long long inner, const long long* idx, const float* g, float* dx) {
    MP_GRID_LOOP(t, outer * inner) {
        long long o = t / inner, k = t % inner;
        for (long long i = 0; i < n_idx; ++i) {
            long long j = idx[i];
            if (j < 0) j += axis_dim;
            if (j < 0 || j >= axis_dim) continue;
            dx[(o * axis_dim + j) * inner + k] += g[(o * n_idx + i) * inner + k];
        }
    }
}

// GatherElements: for every element t of idx (contiguous, shape d.shape),
// dst[t] = src[off + j * axis_stride], off the source offset of t's coordinate
// with the axis coordinate dropped (d.st[0]: source strides, 0 on the axis),
// j = idx[t] (negative from the end; out of range: 0, the CPU rejects it first).
#define MP_GATHER_ELEMENTS(NAME, T) \
extern "C" __global__ void NAME(long long n, Strided d, long long axis_stride, long long axis_dim, const long long* idx, const T* src, T* dst) { \
    MP_GRID_LOOP(t, n) { \
        long long off[1]; \
        mp_offsets(d, t, off, 1); \
        long long j = idx[t]; \
        if (j < 0) j += axis_dim; \
        dst[t] = (j < 0 || j >= axis_dim) ? (T)0 : src[off[0] + j * axis_stride]; \
    } \
}
MP_GATHER_ELEMENTS(gather_elements_b1, unsigned char)
MP_GATHER_ELEMENTS(gather_elements_b4, unsigned int)
MP_GATHER_ELEMENTS(gather_elements_b8, unsigned long long)
