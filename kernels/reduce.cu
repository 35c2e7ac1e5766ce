// reduce.cu: reductions over axes (ReduceSum/ReduceMean/ReduceMax, and the
// gradient sum back to a broadcast operand's shape, exec::grad::sum_to).
// Reference: src/ops/reduce.rs and src/exec/grad.rs.

#define R_SUM 0
#define R_MAX 1
#define R_MIN 2

// One thread per output element. `keep` spans the kept axes (shape of the output,
// keep.st[0] the input strides of those axes); `red` spans the reduced axes
// (red.st[0] their input strides), walked in row-major order and summed in f64:
// the order of the CPU's sequential sums, so results agree to the last bits.
// R_SUM multiplies by `scale` (1/count for a mean) before rounding to f32.
extern "C" __global__ void reduce_f32(int op, long long n_out, Strided keep, long long n_red, Strided red, const float* x, float* y, double scale) {
    MP_GRID_LOOP(o, n_out) {
        long long base[1];
        mp_offsets(keep, o, base, 1);
        if (op == R_SUM) {
            double acc = 0.0;
            for (long long r = 0; r < n_red; ++r) {
                long long off[1];
                mp_offsets(red, r, off, 1);
                acc += (double)x[base[0] + off[0]];
            }
            y[o] = (float)(acc * scale);
        } else {
            float best = op == R_MAX ? __int_as_float(0xff800000) : __int_as_float(0x7f800000);
            for (long long r = 0; r < n_red; ++r) {
                long long off[1];
                mp_offsets(red, r, off, 1);
                float v = x[base[0] + off[0]];
                best = op == R_MAX ? fmaxf(best, v) : fminf(best, v);
            }
            y[o] = best;
        }
    }
}
