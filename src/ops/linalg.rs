//! Matrix products: MatMul (numpy semantics, batched, broadcast) and Gemm;
//! the determinant, Det (`torch.linalg.det`: LU with partial pivoting, as
//! LAPACK's `getrf`, in f64; on the device the host path).

use rayon::prelude::*;

use super::{
    broadcast, layout, Arity, Autocast, Backward, BackwardCx, CudaKernels, Cx, Fact, Grad,
    KernelCx, Launch, Op, Registry, RuleResult, Saved, Storage, CUBLAS_SGEMM,
};
use crate::ir::DType;
use crate::numeric::broadcast::for_each;
use crate::numeric::gemm::{sgemm, Mat};
use crate::numeric::grad::sum_to;
use crate::numeric::Tensor;

/// One batch element's product accumulated into a gradient block:
/// `(pair index, (A batch, B batch), destination)`.
type PairProduct<'a> = dyn Fn(usize, (usize, usize), &mut [f32]) + Sync + 'a;

/// `MatMul(A, B)`: numpy `matmul`, 1-D operands promoted and the added dim dropped.
/// FLOPs: 2·M·K·N per broadcast batch element (a multiply-add counts 2).
struct MatMul;

/// The operands of a numpy matmul with 1-D ones promoted: `[k]` on the left is
/// `[1, k]`, on the right `[k, 1]`.
pub fn promoted(a: &[usize], b: &[usize]) -> (Vec<usize>, Vec<usize>) {
    let a2 = if a.len() == 1 {
        vec![1, a[0]]
    } else {
        a.to_vec()
    };
    let b2 = if b.len() == 1 {
        vec![b[0], 1]
    } else {
        b.to_vec()
    };
    (a2, b2)
}

/// Output shape and contraction size `K` of a numpy matmul.
pub fn matmul_shape(a: &[usize], b: &[usize]) -> RuleResult<(Vec<usize>, usize)> {
    if a.is_empty() || b.is_empty() {
        return Err("MatMul operands must have rank >= 1".into());
    }
    let (a2, b2) = promoted(a, b);
    let (m, k) = (a2[a2.len() - 2], a2[a2.len() - 1]);
    let (k2, n) = (b2[b2.len() - 2], b2[b2.len() - 1]);
    if k != k2 {
        return Err(format!("inner dimensions differ: {a:?} × {b:?} ({k} vs {k2})").into());
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

/// One `torch.matmul` operand: shape, strides (`None`: unknown, taken as not
/// viewable) and requires_grad.
pub type MatMulOperand<'a> = (&'a [usize], Option<&'a [usize]>, bool);

/// The operands `torch.matmul` copies, with the copy's shape, following
/// `_matmul_impl` (aten/src/ATen/native/LinearAlgebra.cpp): 1-D and 2-D operands go
/// to dot/mv/mm as they are; a ≥3-D operand against a ≤2-D one is folded to 2-D
/// (`should_fold`: always when the smaller operand requires grad, else when the
/// larger one's leading dims are contiguous), everything else is expanded to the
/// broadcast batch and reshaped to 3-D for `bmm`. A reshape that is no view
/// ([`layout::view`]) copies, and `MmBackward0`/`BmmBackward0` save the copy.
/// (The 2-D @ ≥3-D fold also makes the output contiguous through a transposed
/// temporary: an output-sized transient not modelled.)
pub fn matmul_copies(a: MatMulOperand, b: MatMulOperand) -> Vec<(usize, Vec<usize>)> {
    let ((ash, ast, areq), (bsh, bst, breq)) = (a, b);
    let (da, db) = (ash.len(), bsh.len());
    if da == 0 || db == 0 || (da <= 2 && db <= 2) {
        return Vec::new();
    }
    // should_fold.
    let a_larger = da >= db;
    let (t1sh, t1st): (Vec<usize>, Option<Vec<usize>>) = if a_larger {
        (ash.to_vec(), ast.map(<[usize]>::to_vec))
    } else {
        // b.mT: the last two dims swapped.
        let mut sh = bsh.to_vec();
        sh.swap(db - 1, db - 2);
        let st = bst.map(|st| {
            let mut st = st.to_vec();
            st.swap(db - 1, db - 2);
            st
        });
        (sh, st)
    };
    let (dim_t1, dim_t2) = if a_larger { (da, db) } else { (db, da) };
    let fold = dim_t1 >= 3 && dim_t2 <= 2 && {
        let t2_req = if a_larger { breq } else { areq };
        t2_req
            || (da != 2
                && (t1sh.contains(&0)
                    || t1st.as_ref().is_some_and(|st| {
                        (0..dim_t1 - 2).all(|i| st[i] == st[i + 1].saturating_mul(t1sh[i + 1]))
                    })))
    };
    if fold {
        let last = t1sh[dim_t1 - 1];
        let folded = vec![t1sh[..dim_t1 - 1].iter().product(), last];
        let slot = if a_larger { 0 } else { 1 };
        return expanded_copy(&t1sh, t1st.as_deref(), &t1sh, &folded)
            .map(|c| vec![(slot, c)])
            .unwrap_or_default();
    }
    // 3-D @ 3-D with one batch of 1 that requires grad: squeezed, then folded.
    if da == 3 && db == 3 && ash[0] != bsh[0] {
        let squeeze =
            |sh: &[usize], st: Option<&[usize]>| (sh[1..].to_vec(), st.map(|st| st[1..].to_vec()));
        if ash[0] == 1 && areq {
            let (sh, st) = squeeze(ash, ast);
            return matmul_copies((&sh, st.as_deref(), areq), b);
        }
        if bsh[0] == 1 && breq {
            let (sh, st) = squeeze(bsh, bst);
            return matmul_copies(a, (&sh, st.as_deref(), breq));
        }
    }
    // bmm: expand to the broadcast batch, reshape to 3-D.
    let batch_of = |sh: &[usize]| sh[..sh.len().saturating_sub(2)].to_vec();
    let Ok(batch) = broadcast(&[&batch_of(ash), &batch_of(bsh)]) else {
        return Vec::new();
    };
    let prod: usize = batch.iter().product();
    let mut out = Vec::new();
    let n = if da > 1 { ash[da - 2] } else { 1 };
    let m1 = ash[da - 1];
    let mut a_to = batch.clone();
    a_to.extend([n, m1]);
    let a_src = if da == 1 { vec![1, m1] } else { ash.to_vec() };
    let a_src_st = ast.map(|st| {
        if da == 1 {
            vec![m1, st[0]]
        } else {
            st.to_vec()
        }
    });
    if let Some(c) = expanded_copy(&a_src, a_src_st.as_deref(), &a_to, &[prod, n, m1]) {
        out.push((0, c));
    }
    let b_to: Vec<usize>;
    let b_new: Vec<usize>;
    if db == 1 {
        b_to = batch.iter().copied().chain([bsh[0]]).collect();
        b_new = vec![prod, bsh[0]];
    } else {
        b_to = batch
            .iter()
            .copied()
            .chain([bsh[db - 2], bsh[db - 1]])
            .collect();
        b_new = vec![prod, bsh[db - 2], bsh[db - 1]];
    }
    if let Some(c) = expanded_copy(bsh, bst, &b_to, &b_new) {
        out.push((1, c));
    }
    out
}

/// `x.expand(to).reshape(new)`: the copy's shape where the reshape copies.
fn expanded_copy(
    sh: &[usize],
    st: Option<&[usize]>,
    to: &[usize],
    new: &[usize],
) -> Option<Vec<usize>> {
    if to == new {
        return None;
    }
    let copies = match st {
        Some(st) => layout::view(to, &layout::expand(sh, st, to), new).is_none(),
        None => true,
    };
    copies.then(|| new.to_vec())
}

/// MatMul's operands as batches of matrices (a 1-D A is a row `[1, K]`, a 1-D B
/// a column `[K, 1]`), as its forward and backward kernels walk them.
struct BatchedMats {
    /// A's rows.
    m: usize,
    /// The shared inner dimension.
    k: usize,
    /// B's columns.
    n: usize,
    /// Per broadcast batch element, in order: A's and B's batch element.
    pairs: Vec<(usize, usize)>,
    /// A's batch dims.
    ba: Vec<usize>,
    /// B's batch dims.
    bb: Vec<usize>,
}

impl BatchedMats {
    fn of(a: &[usize], b: &[usize]) -> RuleResult<BatchedMats> {
        let (a2, b2) = promoted(a, b);
        let (ra, rb) = (a2.len(), b2.len());
        let (m, k, n) = (a2[ra - 2], a2[ra - 1], b2[rb - 1]);
        if b2[rb - 2] != k {
            return Err(format!("inner dimensions differ: {a:?} × {b:?}").into());
        }
        let (ba, bb) = (a2[..ra - 2].to_vec(), b2[..rb - 2].to_vec());
        let batch = broadcast(&[&ba, &bb])?;
        let mut pairs = Vec::new();
        for_each(&batch, [&ba[..], &bb[..]], |_, [i, j]| pairs.push((i, j)));
        Ok(BatchedMats {
            m,
            k,
            n,
            pairs,
            ba,
            bb,
        })
    }
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
    /// `torch.matmul`'s reshapes to `mm`/`bmm` operands ([`matmul_copies`]).
    fn saved_copies(
        &self,
        cx: &Cx,
        strides: &[Option<&[usize]>],
        requires: &[bool],
    ) -> Vec<(usize, Vec<usize>)> {
        let (Some(Some(a)), Some(Some(b))) = (cx.inputs.first(), cx.inputs.get(1)) else {
            return Vec::new();
        };
        let st = |k: usize| strides.get(k).copied().flatten();
        let req = |k: usize| requires.get(k).copied().unwrap_or(false);
        matmul_copies((&a.shape, st(0), req(0)), (&b.shape, st(1), req(1)))
    }
    /// f32 (half types widened, result rounded back); each broadcast batch element
    /// is one GEMM, run in parallel.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let (a, b) = (cx.input(0)?, cx.input(1)?);
        let out = cx.out(0)?.shape.clone();
        let BatchedMats { m, k, n, pairs, .. } = BatchedMats::of(&a.shape, &b.shape)?;
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
        let BatchedMats {
            m,
            k,
            n,
            pairs,
            ba,
            bb,
        } = BatchedMats::of(&fa.shape, &fb.shape)?;
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
            Launch::MatMul,
            &[CUBLAS_SGEMM, "strided_copy_b4"],
            &[CUBLAS_SGEMM, "strided_copy_b4", "reduce_f32"],
        )
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Half
    }
}

/// `Gemm(A, B, C?) = alpha·A'·B' + beta·C`, A' = transA ? Aᵀ : A.
/// FLOPs: 2·M·K·N, plus M·N for adding C, plus M·N when alpha ≠ 1.
struct Gemm;

/// Gemm's attributes.
struct GemmAttrs {
    /// `transA` (default 0).
    trans_a: bool,
    /// `transB` (default 0).
    trans_b: bool,
    /// `alpha` (default 1).
    alpha: f32,
    /// `beta` (default 1).
    beta: f32,
}

impl GemmAttrs {
    fn of(attrs: &crate::ir::Attrs) -> GemmAttrs {
        GemmAttrs {
            trans_a: attrs.int_or("transA", 0) != 0,
            trans_b: attrs.int_or("transB", 0) != 0,
            alpha: attrs.float("alpha").unwrap_or(1.0),
            beta: attrs.float("beta").unwrap_or(1.0),
        }
    }
}

impl Op for Gemm {
    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (a, b) = (cx.input(0)?, cx.input(1)?);
        if a.rank() != 2 || b.rank() != 2 {
            return Err(format!("A and B must be 2-D, got {:?} and {:?}", a.shape, b.shape).into());
        }
        let at = GemmAttrs::of(cx.attrs());
        let (ta, tb) = (at.trans_a, at.trans_b);
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
            )
            .into());
        }
        if let Some(c) = cx.opt(2) {
            let bc = broadcast(&[&c.shape, &[m, n]])?;
            if bc != [m, n] {
                return Err(format!("C {:?} does not broadcast to [{m}, {n}]", c.shape).into());
            }
        }
        Ok(vec![Fact::new(a.dtype, vec![m, n])])
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let Some(a) = cx.inputs[0] else { return 0 };
        let at = GemmAttrs::of(cx.attrs());
        let k = if at.trans_a { a.shape[0] } else { a.shape[1] } as u64;
        let mn = out[0].numel();
        let alpha = at.alpha;
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
        let at = GemmAttrs::of(cx.attrs());
        let (ta, tb, alpha, beta) = (at.trans_a, at.trans_b, at.alpha, at.beta);
        let k = if ta { a.shape[0] } else { a.shape[1] };
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
        let at = GemmAttrs::of(cx.attrs());
        let (ta, tb, alpha, beta) = (at.trans_a, at.trans_b, at.alpha, at.beta);
        let k = if ta { fa.shape[0] } else { fa.shape[1] };
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
            Launch::Gemm,
            &[CUBLAS_SGEMM, "strided_copy_b4"],
            &[CUBLAS_SGEMM, "reduce_f32", "strided_copy_b4"],
        )
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Half
    }
}

/// `Det(X [*, M, M]) -> [*]`. FLOPs: an LU factorization per matrix,
/// `⌈2·M³/3⌉`, and `M` multiplies for the product of the pivots.
///
/// The kernel factors each matrix's transpose, as PyTorch's `_linalg_det` does
/// for a contiguous real input (LAPACK works on columns), with partial
/// pivoting in f64: the determinant is the product of `U`'s diagonal, negated
/// per row swap. The extras are the packed factors (unit `L` below the
/// diagonal, `U` on and above) and LAPACK's 1-based int32 pivots.
struct Det;

/// The LU factorization with partial pivoting of the `m × m` row-major `a`, in
/// place (LAPACK `getrf`: the first largest magnitude pivots; a zero column
/// is skipped), returning the 1-based pivots and the determinant.
fn lu_in_place(a: &mut [f64], m: usize) -> (Vec<i32>, f64) {
    let mut piv = vec![0i32; m];
    let mut det = 1.0;
    for j in 0..m {
        let mut p = j;
        for i in j + 1..m {
            if a[i * m + j].abs() > a[p * m + j].abs() {
                p = i;
            }
        }
        piv[j] = p as i32 + 1;
        if p != j {
            for k in 0..m {
                a.swap(j * m + k, p * m + k);
            }
            det = -det;
        }
        let d = a[j * m + j];
        det *= d;
        if d == 0.0 {
            continue;
        }
        for i in j + 1..m {
            let l = a[i * m + j] / d;
            a[i * m + j] = l;
            for k in j + 1..m {
                a[i * m + k] -= l * a[j * m + k];
            }
        }
    }
    (piv, det)
}

/// Solves `P·L·U·X = B` for the `m × m` row-major `b` in place, from packed
/// factors and 1-based pivots; a zero on `U`'s diagonal counts as `eps`
/// (PyTorch's `linalg_det_backward` perturbs a singular factorization so).
fn lu_solve(lu: &[f64], piv: &[i32], b: &mut [f64], m: usize, eps: f64) {
    for (i, &p) in piv.iter().enumerate() {
        let p = (p - 1) as usize;
        if p != i {
            for k in 0..m {
                b.swap(i * m + k, p * m + k);
            }
        }
    }
    for i in 0..m {
        for r in 0..i {
            let l = lu[i * m + r];
            for k in 0..m {
                b[i * m + k] -= l * b[r * m + k];
            }
        }
    }
    for i in (0..m).rev() {
        for r in i + 1..m {
            let u = lu[i * m + r];
            for k in 0..m {
                b[i * m + k] -= u * b[r * m + k];
            }
        }
        let d = match lu[i * m + i] {
            0.0 => eps,
            d => d,
        };
        for k in 0..m {
            b[i * m + k] /= d;
        }
    }
}

impl Op for Det {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let r = x.rank();
        if r < 2 || x.shape[r - 1] != x.shape[r - 2] || !x.dtype.is_float() {
            return Err(format!(
                "input must be floating square matrices [*, M, M], got {} {:?}",
                x.dtype, x.shape
            )
            .into());
        }
        Ok(vec![Fact::new(x.dtype, x.shape[..r - 2].to_vec())])
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let m = cx
            .input(0)
            .map_or(0, |x| *x.shape.last().unwrap_or(&0) as u64);
        let lu = (2 * m.saturating_pow(3)).div_ceil(3);
        out[0].numel().saturating_mul(lu + m)
    }
    /// `linalg_det`'s backward (`_linalg_det`) saves the input, the determinant,
    /// and the LU factors and pivots the forward made (`[*, M, M]` and int32
    /// `[*, M]`). Backward FLOPs: an LU solve per matrix, `2·M³`.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let x = cx.input(0)?;
        let r = x.rank();
        let m = x.shape[r - 1] as u64;
        Ok(Some(Backward {
            grads: vec![Grad {
                input: 0,
                needs: vec![
                    Saved::Input(0),
                    Saved::Output(0),
                    Saved::Extra(0),
                    Saved::Extra(1),
                ],
            }],
            extras: vec![
                Fact::new(x.dtype, x.shape.clone()),
                Fact::new(crate::ir::DType::I32, x.shape[..r - 1].to_vec()),
            ],
            flops: out[0].numel().saturating_mul(2 * m.saturating_pow(3)),
        }))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// Each matrix's transpose factored ([`lu_in_place`]); with extras, the
    /// factors and pivots the backward reads.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let r = x.rank();
        let m = x.shape[r - 1];
        let batch: usize = x.shape[..r - 2].iter().product();
        let v = x.to_f32()?;
        let per: Vec<(Vec<f64>, Vec<i32>, f64)> = (0..batch)
            .into_par_iter()
            .map(|b| {
                let a = &v[b * m * m..(b + 1) * m * m];
                let mut t: Vec<f64> = (0..m * m).map(|k| a[(k % m) * m + k / m] as f64).collect();
                let (piv, det) = lu_in_place(&mut t, m);
                (t, piv, det)
            })
            .collect();
        let dt = x.dtype();
        let det = per.iter().map(|p| p.2).collect();
        let mut outs = vec![Tensor::from_f64(dt, x.shape[..r - 2].to_vec(), det)?];
        if cx.extras {
            let lu = per.iter().flat_map(|p| p.0.iter().copied()).collect();
            let piv = per
                .iter()
                .flat_map(|p| p.1.iter().map(|&q| q as i64))
                .collect();
            outs.push(Tensor::from_f64(dt, x.shape.clone(), lu)?);
            outs.push(Tensor::from_i64(
                DType::I32,
                x.shape[..r - 1].to_vec(),
                piv,
            )?);
        }
        Ok(outs)
    }
    /// PyTorch's `linalg_det_backward`: `dA = g·det·A^{-T}`, solved from the
    /// saved factors of `Aᵀ` (`Aᵀ·X = g·det·I`), a zero pivot replaced by the
    /// dtype's epsilon (an exactly singular matrix gets 0, as in PyTorch).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let x = cx.input(0)?;
        let m = *x.shape.last().unwrap_or(&0);
        let det = cx.saved(Saved::Output(0))?.to_f32()?;
        let lu = cx.saved(Saved::Extra(0))?.to_f32()?;
        let piv: Vec<i32> = cx
            .saved(Saved::Extra(1))?
            .to_i64s()
            .into_iter()
            .map(|p| p as i32)
            .collect();
        let g = cx.grad(0)?;
        let eps = match x.dtype {
            DType::F16 => f64::from(half::f16::EPSILON),
            DType::BF16 => f64::from(half::bf16::EPSILON),
            _ => f64::from(f32::EPSILON),
        };
        if piv.iter().any(|&p| p < 1 || p as usize > m) {
            return Err("Det's saved pivots are out of range".into());
        }
        let dx: Vec<f32> = (0..det.len())
            .into_par_iter()
            .flat_map_iter(|b| {
                let f: Vec<f64> = lu[b * m * m..(b + 1) * m * m]
                    .iter()
                    .map(|&v| v as f64)
                    .collect();
                let s = g[b] as f64 * det[b] as f64;
                let mut rhs = vec![0f64; m * m];
                (0..m).for_each(|i| rhs[i * m + i] = s);
                lu_solve(&f, &piv[b * m..(b + 1) * m], &mut rhs, m, eps);
                rhs.into_iter().map(|v| v as f32)
            })
            .collect();
        cx.answer(vec![(0, dx)])
    }
    /// No device kernel: the host path.
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    /// linalg ops run in float32 under autocast.
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Full
    }
}

/// Registers MatMul, Gemm and Det.
pub fn register(r: &mut Registry) {
    r.add("MatMul", MatMul);
    r.add("Gemm", Gemm);
    r.add("Det", Det);
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

    #[test]
    fn matmul_copies_follow_torch_matmul() {
        use super::super::layout::{contiguous, permuted};
        let c = |sh: &[usize]| contiguous(sh);
        // Contiguous 4-D operands: bmm views, nothing copied.
        let (a, b) = ([2, 4, 6, 8], [2, 4, 8, 6]);
        assert!(matmul_copies((&a, Some(&c(&a)), true), (&b, Some(&c(&b)), true)).is_empty());
        // k^T of a [B, N, H, D] tensor: B and H cannot merge, the copy is saved...
        let kt = [2, 4, 8, 6];
        let kt_st = permuted(&kt, &[0, 3, 1, 2]);
        assert_eq!(
            matmul_copies((&a, Some(&c(&a)), true), (&kt, Some(&kt_st), true)),
            vec![(1, vec![8, 8, 6])]
        );
        // ... but a batch of one merges with anything.
        let (a1, kt1) = ([1, 4, 6, 8], [1, 4, 8, 6]);
        let kt1_st = permuted(&kt1, &[0, 3, 1, 2]);
        assert!(matmul_copies((&a1, Some(&c(&a1)), true), (&kt1, Some(&kt1_st), true)).is_empty());
        // An operand broadcast over heads is copied at the expanded size.
        let kv = [2, 1, 8, 6];
        assert_eq!(
            matmul_copies((&a, Some(&c(&a)), true), (&kv, Some(&c(&kv)), true)),
            vec![(1, vec![8, 8, 6])]
        );
        // A Linear on a transposed input (the weight requires grad): folded, copied.
        let (x, w) = ([2, 16, 6], [6, 5]);
        let x_st = permuted(&x, &[0, 2, 1]);
        assert_eq!(
            matmul_copies((&x, Some(&x_st), false), (&w, Some(&[1, 6]), true)),
            vec![(0, vec![32, 6])]
        );
        // A frozen weight against the same input: no fold (leading dims not
        // contiguous), a 3-D bmm of the same shape, nothing copied.
        assert!(matmul_copies((&x, Some(&x_st), false), (&w, Some(&[1, 6]), false)).is_empty());
        // Unknown strides reshape by copy.
        assert_eq!(
            matmul_copies((&a, None, true), (&b, Some(&c(&b)), true)),
            vec![(0, vec![8, 6, 8])]
        );
    }
}
