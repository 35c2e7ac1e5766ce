//! Matrix products: MatMul (numpy semantics, batched, broadcast) and Gemm.

use rayon::prelude::*;

use super::{
    broadcast, Arity, Backward, BackwardCx, CudaKernels, Cx, Fact, Grad, KernelCx, Op, Registry,
    RuleResult, Saved, Storage, CUBLAS_SGEMM,
};
use crate::exec::broadcast::for_each;
use crate::exec::gemm::{sgemm, Mat};
use crate::exec::grad::sum_to;
use crate::exec::Tensor;

/// One batch element's product accumulated into a gradient block:
/// `(pair index, (A batch, B batch), destination)`.
type PairProduct<'a> = dyn Fn(usize, (usize, usize), &mut [f32]) + Sync + 'a;

/// `MatMul(A, B)`: numpy `matmul`, 1-D operands promoted and the added dim dropped.
/// FLOPs: 2·M·K·N per broadcast batch element (a multiply-add counts 2).
struct MatMul;

/// Output shape and contraction size `K` of a numpy matmul.
pub fn matmul_shape(a: &[usize], b: &[usize]) -> RuleResult<(Vec<usize>, usize)> {
    if a.is_empty() || b.is_empty() {
        return Err("MatMul operands must have rank >= 1".into());
    }
    let a2: Vec<usize> = if a.len() == 1 {
        vec![1, a[0]]
    } else {
        a.to_vec()
    };
    let b2: Vec<usize> = if b.len() == 1 {
        vec![b[0], 1]
    } else {
        b.to_vec()
    };
    let (m, k) = (a2[a2.len() - 2], a2[a2.len() - 1]);
    let (k2, n) = (b2[b2.len() - 2], b2[b2.len() - 1]);
    if k != k2 {
        return Err(format!(
            "inner dimensions differ: {a:?} × {b:?} ({k} vs {k2})"
        ));
    }
    let mut out = broadcast(&[&a2[..a2.len() - 2], &b2[..b2.len() - 2]])?;
    if a.len() > 1 {
        out.push(m);
    }
    if b.len() > 1 {
        out.push(n);
    }
    Ok((out, k))
}

impl Op for MatMul {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (a, b) = (cx.input(0)?, cx.input(1)?);
        let (shape, _) = matmul_shape(&a.shape, &b.shape)?;
        Ok(vec![Fact::new(a.dtype, shape)])
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let k = cx.inputs[0].map_or(0, |a| *a.shape.last().unwrap_or(&0) as u64);
        k.saturating_mul(2).saturating_mul(out[0].numel())
    }
    /// MmBackward saves both operands: A for B's gradient, B for A's.
    /// Backward FLOPs: the forward's once per gradient.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(Some(Backward {
            grads: vec![
                Grad {
                    input: 0,
                    needs: vec![Saved::Input(1)],
                },
                Grad {
                    input: 1,
                    needs: vec![Saved::Input(0)],
                },
            ],
            extras: Vec::new(),
            flops: self.flops(cx, out).saturating_mul(2),
        }))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// f32 (half types widened, result rounded back); each broadcast batch element
    /// is one GEMM, run in parallel.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let (a, b) = (cx.input(0)?, cx.input(1)?);
        let out = cx.out(0)?.shape.clone();
        let a2: Vec<usize> = if a.rank() == 1 {
            vec![1, a.shape[0]]
        } else {
            a.shape.clone()
        };
        let b2: Vec<usize> = if b.rank() == 1 {
            vec![b.shape[0], 1]
        } else {
            b.shape.clone()
        };
        let (ra, rb) = (a2.len(), b2.len());
        let (m, k, n) = (a2[ra - 2], a2[ra - 1], b2[rb - 1]);
        if b2[rb - 2] != k {
            return Err(format!(
                "inner dimensions differ: {:?} × {:?}",
                a.shape, b.shape
            ));
        }
        let batch = broadcast(&[&a2[..ra - 2], &b2[..rb - 2]])?;
        let mut pairs = Vec::new();
        for_each(&batch, [&a2[..ra - 2], &b2[..rb - 2]], |_, [i, j]| {
            pairs.push((i, j))
        });
        let (av, bv) = (a.to_f32()?, b.to_f32()?);
        let mut c = vec![0f32; pairs.len() * m * n];
        let one = |(i, j): (usize, usize), cm: &mut [f32]| {
            let am = Mat::new(&av[i * m * k..(i + 1) * m * k], m, k, false);
            let bm = Mat::new(&bv[j * k * n..(j + 1) * k * n], k, n, false);
            sgemm(1.0, am, bm, 0.0, cm);
        };
        if m * n > 0 {
            if pairs.len() == 1 {
                one(pairs[0], &mut c);
            } else {
                c.par_chunks_mut(m * n)
                    .zip(pairs.par_iter())
                    .for_each(|(cm, &p)| one(p, cm));
            }
        }
        Ok(vec![Tensor::from_f32(a.dtype(), out, c)?])
    }
    /// Per broadcast batch element `p = (i, j)`: `dA_i += G_p·B_jᵀ` (reads B) and
    /// `dB_j += A_iᵀ·G_p` (reads A), batch elements that share an operand summed in
    /// order (the broadcast reduction); 1-D operands as in the forward.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let (fa, fb) = (cx.input(0)?, cx.input(1)?);
        let a2: Vec<usize> = if fa.rank() == 1 {
            vec![1, fa.shape[0]]
        } else {
            fa.shape.clone()
        };
        let b2: Vec<usize> = if fb.rank() == 1 {
            vec![fb.shape[0], 1]
        } else {
            fb.shape.clone()
        };
        let (ra, rb) = (a2.len(), b2.len());
        let (m, k, n) = (a2[ra - 2], a2[ra - 1], b2[rb - 1]);
        let (ba, bb) = (&a2[..ra - 2], &b2[..rb - 2]);
        let batch = broadcast(&[ba, bb])?;
        let mut pairs = Vec::new();
        for_each(&batch, [ba, bb], |_, [i, j]| pairs.push((i, j)));
        let g = cx.grad(0)?;
        let mut res = Vec::new();
        // `dst[t] = Σ_{pairs p with target t} prod(p)`, targets in parallel.
        let accumulate = |targets: usize,
                          size: usize,
                          of: &dyn Fn((usize, usize)) -> usize,
                          prod: &PairProduct|
         -> Vec<f32> {
            let mut dst = vec![0f32; targets * size];
            if size == 0 {
                return dst;
            }
            let mut by_target: Vec<Vec<usize>> = vec![Vec::new(); targets];
            for (p, &ij) in pairs.iter().enumerate() {
                by_target[of(ij)].push(p);
            }
            dst.par_chunks_mut(size)
                .zip(by_target.par_iter())
                .for_each(|(d, ps)| {
                    for &p in ps {
                        prod(p, pairs[p], d);
                    }
                });
            dst
        };
        if cx.wants(0) {
            let b = cx.saved(Saved::Input(1))?.to_f32()?;
            let targets = ba.iter().product::<usize>();
            let v = accumulate(targets, m * k, &|(i, _)| i, &|p, (_, j), d| {
                let gm = Mat::new(&g[p * m * n..(p + 1) * m * n], m, n, false);
                let bt = Mat::new(&b[j * k * n..(j + 1) * k * n], n, k, true);
                sgemm(1.0, gm, bt, 1.0, d);
            });
            res.push((0, v));
        }
        if cx.wants(1) {
            let a = cx.saved(Saved::Input(0))?.to_f32()?;
            let targets = bb.iter().product::<usize>();
            let v = accumulate(targets, k * n, &|(_, j)| j, &|p, (i, _), d| {
                let at = Mat::new(&a[i * m * k..(i + 1) * m * k], k, m, true);
                let gm = Mat::new(&g[p * m * n..(p + 1) * m * n], m, n, false);
                sgemm(1.0, at, gm, 1.0, d);
            });
            res.push((1, v));
        }
        cx.answer(res)
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(
            &[CUBLAS_SGEMM, "strided_copy_b4"],
            &[CUBLAS_SGEMM, "strided_copy_b4", "reduce_f32"],
        )
    }
}

/// `Gemm(A, B, C?) = alpha·A'·B' + beta·C`, A' = transA ? Aᵀ : A.
/// FLOPs: 2·M·K·N, plus M·N for adding C, plus M·N when alpha ≠ 1.
struct Gemm;

impl Op for Gemm {
    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (a, b) = (cx.input(0)?, cx.input(1)?);
        if a.rank() != 2 || b.rank() != 2 {
            return Err(format!(
                "A and B must be 2-D, got {:?} and {:?}",
                a.shape, b.shape
            ));
        }
        let ta = cx.attrs().int_or("transA", 0) != 0;
        let tb = cx.attrs().int_or("transB", 0) != 0;
        let (m, k) = if ta {
            (a.shape[1], a.shape[0])
        } else {
            (a.shape[0], a.shape[1])
        };
        let (k2, n) = if tb {
            (b.shape[1], b.shape[0])
        } else {
            (b.shape[0], b.shape[1])
        };
        if k != k2 {
            return Err(format!(
                "inner dimensions differ: A {:?} (transA={ta}) × B {:?} (transB={tb})",
                a.shape, b.shape
            ));
        }
        if let Some(c) = cx.opt(2) {
            let bc = broadcast(&[&c.shape, &[m, n]])?;
            if bc != [m, n] {
                return Err(format!("C {:?} does not broadcast to [{m}, {n}]", c.shape));
            }
        }
        Ok(vec![Fact::new(a.dtype, vec![m, n])])
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let Some(a) = cx.inputs[0] else { return 0 };
        let ta = cx.attrs().int_or("transA", 0) != 0;
        let k = if ta { a.shape[0] } else { a.shape[1] } as u64;
        let mn = out[0].numel();
        let alpha = cx.attrs().float("alpha").unwrap_or(1.0);
        let extra = (cx.opt(2).is_some() as u64 + (alpha != 1.0) as u64).saturating_mul(mn);
        k.saturating_mul(2).saturating_mul(mn).saturating_add(extra)
    }
    /// AddmmBackward saves A (for B's gradient) and B (for A's); C's gradient is a sum.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(Some(Backward {
            grads: vec![
                Grad {
                    input: 0,
                    needs: vec![Saved::Input(1)],
                },
                Grad {
                    input: 1,
                    needs: vec![Saved::Input(0)],
                },
                Grad {
                    input: 2,
                    needs: vec![],
                },
            ],
            extras: Vec::new(),
            flops: self.flops(cx, out).saturating_mul(2),
        }))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// f32: the output starts as `beta·C` broadcast, then one strided GEMM adds
    /// `alpha·A'·B'` (transposes are strides, never copies).
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let (a, b) = (cx.input(0)?, cx.input(1)?);
        let out = cx.out(0)?.shape.clone();
        let (m, n) = (out[0], out[1]);
        let ta = cx.attrs().int_or("transA", 0) != 0;
        let tb = cx.attrs().int_or("transB", 0) != 0;
        let k = if ta { a.shape[0] } else { a.shape[1] };
        let alpha = cx.attrs().float("alpha").unwrap_or(1.0);
        let beta = cx.attrs().float("beta").unwrap_or(1.0);
        let (mut c, beta_in) = match cx.opt(2) {
            Some(ct) if beta != 0.0 => {
                let cv = ct.to_f32()?;
                let mut c = Vec::with_capacity(m * n);
                for_each(&out, [&ct.shape[..]], |_, [i]| c.push(beta * cv[i]));
                (c, 1.0)
            }
            _ => (vec![0f32; m * n], 0.0),
        };
        let (av, bv) = (a.to_f32()?, b.to_f32()?);
        sgemm(
            alpha,
            Mat::new(&av, m, k, ta),
            Mat::new(&bv, k, n, tb),
            beta_in,
            &mut c,
        );
        Ok(vec![Tensor::from_f32(a.dtype(), out, c)?])
    }
    /// With `A' = op(A)`, `B' = op(B)`: `dA' = α·G·B'ᵀ` (reads B), `dB' = α·A'ᵀ·G`
    /// (reads A), transposed back when the operand was; `dC = β·G` summed back to
    /// C's shape (reads nothing).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let fa = cx.input(0)?;
        let out = cx.output(0)?.shape.clone();
        let (m, n) = (out[0], out[1]);
        let ta = cx.attrs().int_or("transA", 0) != 0;
        let tb = cx.attrs().int_or("transB", 0) != 0;
        let k = if ta { fa.shape[0] } else { fa.shape[1] };
        let alpha = cx.attrs().float("alpha").unwrap_or(1.0);
        let beta = cx.attrs().float("beta").unwrap_or(1.0);
        let g = cx.grad(0)?;
        let gm = Mat::new(&g, m, n, false);
        let mut res = Vec::new();
        if cx.wants(0) {
            let b = cx.saved(Saved::Input(1))?.to_f32()?;
            let mut d = vec![0f32; m * k];
            if ta {
                // dA = α·B'·Gᵀ, [k, m].
                sgemm(
                    alpha,
                    Mat::new(&b, k, n, tb),
                    Mat::new(&g, n, m, true),
                    0.0,
                    &mut d,
                );
            } else {
                // dA = α·G·B'ᵀ, [m, k].
                sgemm(alpha, gm, Mat::new(&b, n, k, !tb), 0.0, &mut d);
            }
            res.push((0, d));
        }
        if cx.wants(1) {
            let a = cx.saved(Saved::Input(0))?.to_f32()?;
            let mut d = vec![0f32; k * n];
            if tb {
                // dB = α·Gᵀ·A', [n, k].
                sgemm(
                    alpha,
                    Mat::new(&g, n, m, true),
                    Mat::new(&a, m, k, ta),
                    0.0,
                    &mut d,
                );
            } else {
                // dB = α·A'ᵀ·G, [k, n].
                sgemm(alpha, Mat::new(&a, k, m, !ta), gm, 0.0, &mut d);
            }
            res.push((1, d));
        }
        if cx.wants(2) {
            let gc: Vec<f32> = g.iter().map(|&v| v * beta).collect();
            res.push((2, sum_to(&gc, &out, &cx.input(2)?.shape)));
        }
        cx.answer(res)
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(
            &[CUBLAS_SGEMM, "strided_copy_b4"],
            &[CUBLAS_SGEMM, "reduce_f32", "strided_copy_b4"],
        )
    }
}

/// Registers MatMul and Gemm.
pub fn register(r: &mut Registry) {
    r.add("MatMul", MatMul);
    r.add("Gemm", Gemm);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_shapes() {
        assert_eq!(matmul_shape(&[2, 3, 4], &[4, 5]).unwrap().0, vec![2, 3, 5]);
        assert_eq!(matmul_shape(&[4], &[4, 5]).unwrap().0, vec![5]);
        assert_eq!(matmul_shape(&[3, 4], &[4]).unwrap().0, vec![3]);
        assert_eq!(matmul_shape(&[4], &[4]).unwrap().0, Vec::<usize>::new());
        assert_eq!(
            matmul_shape(&[8, 1, 3, 4], &[6, 4, 5]).unwrap().0,
            vec![8, 6, 3, 5]
        );
        assert!(matmul_shape(&[2, 3], &[4, 5]).is_err());
    }
}
