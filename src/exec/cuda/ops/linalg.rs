//! Matrix products on cuBLAS: MatMul and Gemm.

#[allow(unused_imports)]
use super::*;

/// Row-major, strided batched: `C[p] = α·op(A[p])·op(B[p]) + β·C[p]`, `op(A)`
/// `[m, k]` (A stored `[k, m]` when `ta`), `op(B)` `[k, n]`, C `[m, n]`;
/// pointers in bytes, strides in elements (0: shared by the batch).
#[allow(clippy::too_many_arguments)]
pub(super) fn sgemm(
    dev: &Device,
    (ta, tb): (bool, bool),
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    (a, sa): (u64, usize),
    (b, sb): (u64, usize),
    beta: f32,
    (c, sc): (u64, usize),
    batch: usize,
) -> Result<()> {
    use cudarc::cublas::sys::cublasOperation_t as Op;
    if m == 0 || n == 0 || batch == 0 {
        return Ok(());
    }
    let lda = if ta { m } else { k };
    let ldb = if tb { k } else { n };
    let op = |t: bool| if t { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N };
    let int = |v: usize| -> Result<i32> {
        i32::try_from(v).map_err(|_| CudaError::Blas(format!("dimension {v} exceeds cuBLAS's int")))
    };
    if let crate::exec::cuda::Backend::Emulated(_) = dev.backend() {
        // SAFETY: as below, host buffers of the emulated backend.
        unsafe {
            host_sgemm(
                (ta, tb),
                (m, n, k),
                alpha,
                (a, sa),
                (b, sb),
                beta,
                (c, sc),
                batch,
            )
        };
        return Ok(());
    }
    // Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ: swap the operands.
    // SAFETY: the pointers are live device allocations holding `batch` matrices
    // of the given strides (callers size them from the same shapes).
    unsafe {
        cudarc::cublas::result::sgemm_strided_batched(
            *dev.blas()?.handle(),
            op(tb),
            op(ta),
            int(n)?,
            int(m)?,
            int(k)?,
            &alpha,
            b as *const f32,
            int(ldb.max(1))?,
            sb as i64,
            a as *const f32,
            int(lda.max(1))?,
            sa as i64,
            &beta,
            c as *mut f32,
            int(n)?,
            sc as i64,
            int(batch)?,
        )?;
    }
    Ok(())
}

/// [`sgemm`] on host memory (the emulated backend): a naive loop, f32 sums.
///
/// # Safety
/// The addresses are live host buffers holding `batch` matrices of the strides.
#[allow(clippy::too_many_arguments)]
unsafe fn host_sgemm(
    (ta, tb): (bool, bool),
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    (a, sa): (u64, usize),
    (b, sb): (u64, usize),
    beta: f32,
    (c, sc): (u64, usize),
    batch: usize,
) {
    let (a, b, c) = (a as *const f32, b as *const f32, c as *mut f32);
    for p in 0..batch {
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0f32;
                for l in 0..k {
                    // SAFETY: the caller's contract.
                    let (x, y) = unsafe {
                        (
                            *a.add(p * sa + if ta { l * m + i } else { i * k + l }),
                            *b.add(p * sb + if tb { j * k + l } else { l * n + j }),
                        )
                    };
                    acc += x * y;
                }
                // SAFETY: the caller's contract.
                let o = unsafe { &mut *c.add(p * sc + i * n + j) };
                *o = alpha * acc + if beta == 0.0 { 0.0 } else { beta * *o };
            }
        }
    }
}

/// MatMul's operands as batched matrices: (`[.., m, k]`, `[.., k, n]`), batch
/// shapes, and the broadcast batch.
pub(super) struct MatDims {
    a2: Vec<usize>,
    b2: Vec<usize>,
    m: usize,
    k: usize,
    n: usize,
    batch: Vec<usize>,
}

pub(super) fn mat_dims(a: &[usize], b: &[usize]) -> Result<MatDims> {
    let (a2, b2) = ops::linalg::promoted(a, b);
    let (ra, rb) = (a2.len(), b2.len());
    let (m, k, n) = (a2[ra - 2], a2[ra - 1], b2[rb - 1]);
    let batch = ops::broadcast(&[&a2[..ra - 2], &b2[..rb - 2]])?;
    Ok(MatDims {
        a2,
        b2,
        m,
        k,
        n,
        batch,
    })
}

/// An operand broadcast to the full batch: its batch stride (0 when it has a
/// single matrix) and, when its batch shape differs otherwise, an expanded copy.
pub(super) fn batched<'t>(
    dev: &Device,
    x: &'t DeviceTensor,
    x2: &[usize],
    batch: &[usize],
) -> Result<(Held<'t>, usize)> {
    let r = x2.len();
    let mat = x2[r - 2] * x2[r - 1];
    let xb: usize = x2[..r - 2].iter().product();
    if xb == 1 {
        return Ok((Held::B(x), 0));
    }
    if x2[..r - 2] == *batch {
        return Ok((Held::B(x), mat));
    }
    let mut full = batch.to_vec();
    full.extend_from_slice(&x2[r - 2..]);
    let d = Strided::broadcast(&full, &[x2])?;
    Ok((Held::O(strided_new(dev, x, &full, d)?), mat))
}

pub(super) fn matmul_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (a, b) = (cx.input(0)?, cx.input(1)?);
    let d = mat_dims(&a.shape, &b.shape)?;
    let y = dev.zeros(DType::F32, &cx.out(0)?.shape)?;
    let nb: usize = d.batch.iter().product();
    let (ae, sa) = batched(dev, a, &d.a2, &d.batch)?;
    let (be, sb) = batched(dev, b, &d.b2, &d.batch)?;
    sgemm(
        dev,
        (false, false),
        (d.m, d.n, d.k),
        1.0,
        (ae.ptr(), sa),
        (be.ptr(), sb),
        0.0,
        (y.ptr(), d.m * d.n),
        nb,
    )?;
    Ok(vec![y])
}

pub(super) fn matmul_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let (fa, fb) = (cx.input(0)?, cx.input(1)?);
    let d = mat_dims(&fa.shape, &fb.shape)?;
    let g = cx.grad(dev, 0)?;
    let nb: usize = d.batch.iter().product();
    let (m, k, n) = (d.m, d.k, d.n);
    let mut res = Vec::new();
    // The gradient of an operand at the full batch, summed back to its shape.
    let back = |full: DeviceTensor, x2: &[usize], shape: &[usize]| -> Result<DeviceTensor> {
        let r = if full.shape.as_slice() == x2 {
            full
        } else {
            sum_to(dev, &full, x2, 1.0)?
        };
        copy_as(dev, &r, shape)
    };
    let full_of = |rows: usize, cols: usize| -> Result<DeviceTensor> {
        let mut s = d.batch.clone();
        s.extend([rows, cols]);
        dev.zeros(DType::F32, &s)
    };
    if cx.wants(0) {
        let b = cx.saved(Saved::Input(1))?;
        let (be, sb) = batched(dev, b, &d.b2, &d.batch)?;
        let full = full_of(m, k)?;
        // dA = G·Bᵀ per matrix.
        sgemm(
            dev,
            (false, true),
            (m, k, n),
            1.0,
            (g.ptr(), m * n),
            (be.ptr(), sb),
            0.0,
            (full.ptr(), m * k),
            nb,
        )?;
        res.push((0, back(full, &d.a2, &fa.shape)?));
    }
    if cx.wants(1) {
        let a = cx.saved(Saved::Input(0))?;
        let (ae, sa) = batched(dev, a, &d.a2, &d.batch)?;
        let full = full_of(k, n)?;
        // dB = Aᵀ·G per matrix.
        sgemm(
            dev,
            (true, false),
            (k, n, m),
            1.0,
            (ae.ptr(), sa),
            (g.ptr(), m * n),
            0.0,
            (full.ptr(), k * n),
            nb,
        )?;
        res.push((1, back(full, &d.b2, &fb.shape)?));
    }
    Ok(res)
}

pub(super) fn gemm_attrs(a: &Attrs) -> (bool, bool, f32, f32) {
    (
        a.int_or("transA", 0) != 0,
        a.int_or("transB", 0) != 0,
        a.float("alpha").unwrap_or(1.0),
        a.float("beta").unwrap_or(1.0),
    )
}

pub(super) fn gemm_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (a, b) = (cx.input(0)?, cx.input(1)?);
    let out = cx.out(0)?.shape.clone();
    let (m, n) = (out[0], out[1]);
    let (ta, tb, alpha, beta) = gemm_attrs(cx.attrs());
    let k = if ta { a.shape[0] } else { a.shape[1] };
    let (y, beta_in) = match cx.opt(2) {
        Some(c) if beta != 0.0 => {
            let d = Strided::broadcast(&out, &[&c.shape])?;
            (strided_new(dev, c, &out, d)?, beta)
        }
        _ => (dev.zeros(DType::F32, &out)?, 0.0),
    };
    sgemm(
        dev,
        (ta, tb),
        (m, n, k),
        alpha,
        (a.ptr(), 0),
        (b.ptr(), 0),
        beta_in,
        (y.ptr(), 0),
        1,
    )?;
    Ok(vec![y])
}

pub(super) fn gemm_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let fa = cx.input(0)?;
    let out = cx.output(0)?.shape.clone();
    let (m, n) = (out[0], out[1]);
    let (ta, tb, alpha, beta) = gemm_attrs(cx.attrs());
    let k = if ta { fa.shape[0] } else { fa.shape[1] };
    let g = cx.grad(dev, 0)?;
    let mut res = Vec::new();
    if cx.wants(0) {
        let b = cx.saved(Saved::Input(1))?;
        let d = dev.zeros(DType::F32, &fa.shape)?;
        if ta {
            // dA = α·B'·Gᵀ, [k, m].
            sgemm(
                dev,
                (tb, true),
                (k, m, n),
                alpha,
                (b.ptr(), 0),
                (g.ptr(), 0),
                0.0,
                (d.ptr(), 0),
                1,
            )?;
        } else {
            // dA = α·G·B'ᵀ, [m, k].
            sgemm(
                dev,
                (false, !tb),
                (m, k, n),
                alpha,
                (g.ptr(), 0),
                (b.ptr(), 0),
                0.0,
                (d.ptr(), 0),
                1,
            )?;
        }
        res.push((0, d));
    }
    if cx.wants(1) {
        let a = cx.saved(Saved::Input(0))?;
        let d = dev.zeros(DType::F32, &cx.input(1)?.shape)?;
        if tb {
            // dB = α·Gᵀ·A', [n, k].
            sgemm(
                dev,
                (true, ta),
                (n, k, m),
                alpha,
                (g.ptr(), 0),
                (a.ptr(), 0),
                0.0,
                (d.ptr(), 0),
                1,
            )?;
        } else {
            // dB = α·A'ᵀ·G, [k, n].
            sgemm(
                dev,
                (!ta, false),
                (k, n, m),
                alpha,
                (a.ptr(), 0),
                (g.ptr(), 0),
                0.0,
                (d.ptr(), 0),
                1,
            )?;
        }
        res.push((1, d));
    }
    if cx.wants(2) {
        res.push((2, sum_to(dev, &g, &cx.input(2)?.shape, beta as f64)?));
    }
    Ok(res)
}
