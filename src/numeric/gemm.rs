//! f32 matrix multiplication on the `matrixmultiply` crate, split into row or
//! column blocks run in parallel with rayon.
//!
//! The split depends only on the matrix sizes (never on the thread count), and an
//! element's sum over `k` is accumulated the same way whichever block it falls in,
//! so results are bitwise reproducible across runs and machines with the same CPU
//! features.

use rayon::prelude::*;

/// A strided read-only `rows × cols` matrix: element `(i, j)` is
/// `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    /// The elements.
    pub data: &'a [f32],
    /// Row count.
    pub rows: usize,
    /// Column count.
    pub cols: usize,
    /// Row stride.
    pub rs: usize,
    /// Column stride.
    pub cs: usize,
}

impl<'a> Mat<'a> {
    /// A `rows × cols` matrix stored contiguously row-major, or (`transposed`) the
    /// transpose of a contiguous row-major `cols × rows` matrix.
    pub fn new(data: &'a [f32], rows: usize, cols: usize, transposed: bool) -> Mat<'a> {
        let (rs, cs) = if transposed { (1, rows) } else { (cols, 1) };
        Mat {
            data,
            rows,
            cols,
            rs,
            cs,
        }
    }
}

/// Raw pointer that may cross threads: each task writes a disjoint block of C.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: tasks write disjoint column blocks of C; the pointer outlives them (scope).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// Minimum multiply-adds per parallel task.
const TASK_WORK: usize = 1 << 20;
/// Most tasks per product.
const MAX_TASKS: usize = 32;

/// `C = alpha · A · B + beta · C` for `A: m×k`, `B: k×n` and a contiguous row-major
/// `C: m×n` (`beta = 0` ignores C's old contents, NaN included).
pub fn sgemm(alpha: f32, a: Mat, b: Mat, beta: f32, c: &mut [f32]) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "inner dimensions differ");
    assert_eq!(c.len(), m * n, "C has the wrong size");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.iter_mut()
            .for_each(|x| *x = if beta == 0.0 { 0.0 } else { *x * beta });
        return;
    }
    check(a, m, k);
    check(b, k, n);
    let tasks = (m * n * k / TASK_WORK).clamp(1, MAX_TASKS);
    let run = |rows: usize, cols: usize, a_off: usize, b_off: usize, c_ptr: *mut f32| {
        // SAFETY: the offsets and strides were checked against the slices above, and
        // `c_ptr` addresses a `rows × cols` block of C with row stride `n`.
        unsafe {
            matrixmultiply::sgemm(
                rows,
                k,
                cols,
                alpha,
                a.data.as_ptr().add(a_off),
                a.rs as isize,
                a.cs as isize,
                b.data.as_ptr().add(b_off),
                b.rs as isize,
                b.cs as isize,
                beta,
                c_ptr,
                n as isize,
                1,
            )
        }
    };
    if tasks == 1 {
        run(m, n, 0, 0, c.as_mut_ptr());
    } else if m >= n {
        let block = m.div_ceil(tasks).next_multiple_of(8);
        c.par_chunks_mut(block * n).enumerate().for_each(|(i, cb)| {
            let r0 = i * block;
            run(cb.len() / n, n, r0 * a.rs, 0, cb.as_mut_ptr());
        });
    } else {
        let block = n.div_ceil(tasks).next_multiple_of(8);
        let ptr = SendPtr(c.as_mut_ptr());
        (0..n.div_ceil(block)).into_par_iter().for_each(|i| {
            let p = ptr;
            let c0 = i * block;
            let cols = block.min(n - c0);
            // SAFETY: column block [c0, c0 + cols) of C is written by this task only.
            run(m, cols, 0, c0 * b.cs, unsafe { p.0.add(c0) });
        });
    }
}

/// Asserts that every element of a `rows × cols` strided matrix is inside its slice.
fn check(x: Mat, rows: usize, cols: usize) {
    let last = (rows - 1) * x.rs + (cols - 1) * x.cs;
    assert!(last < x.data.len(), "matrix view out of bounds");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(m: usize, k: usize, n: usize, a: Mat, b: Mat) -> Vec<f32> {
        let mut c = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f64;
                for p in 0..k {
                    s += a.data[i * a.rs + p * a.cs] as f64 * b.data[p * b.rs + j * b.cs] as f64;
                }
                c[i * n + j] = s as f32;
            }
        }
        c
    }

    #[test]
    fn matches_naive_with_transposes_and_splits() {
        for &(m, k, n) in &[(3, 4, 5), (1, 7, 1), (300, 70, 90), (40, 300, 200)] {
            let av: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 13) as f32) - 6.0).collect();
            let bv: Vec<f32> = (0..k * n).map(|i| ((i * 5 % 11) as f32) * 0.5).collect();
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let a = Mat::new(&av, m, k, ta);
                let b = Mat::new(&bv, k, n, tb);
                let mut c = vec![f32::NAN; m * n];
                sgemm(1.0, a, b, 0.0, &mut c);
                let want = naive(m, k, n, a, b);
                for (x, y) in c.iter().zip(&want) {
                    assert!((x - y).abs() <= 1e-3 * y.abs().max(1.0), "{x} vs {y}");
                }
            }
        }
    }
}
