//! Normalizations that PyTorch runs as compositions, with no fused kernel:
//! LRN (`F.local_response_norm`) and MeanVarianceNormalization (an ONNX
//! function). Their backward rules save what the composition's autograd nodes
//! save.

use super::{
    axis, Arity, Autocast, Backward, BackwardCx, CudaKernels, Cx, Fact, Grad, KernelCx, Op,
    Registry, RuleResult, Saved, Storage,
};
use crate::numeric::broadcast::for_each;
use crate::numeric::Tensor;

/// `LRN(X)` over channels (`[N, C, ...]`): `Y = X / (bias + α/size · Σ X²)^β`,
/// the sum over channels `c − ⌊(size−1)/2⌋ ..= c + ⌈(size−1)/2⌉` within range.
/// FLOPs: `size + 5` per element (square, window sum, scale, bias, power, divide).
struct Lrn;

impl Lrn {
    /// `(size, alpha, beta, bias)`.
    fn params(a: &crate::ir::Attrs) -> RuleResult<(usize, f64, f64, f64)> {
        let size = a.int("size").ok_or("attribute 'size' is required")?;
        if size < 1 {
            return Err(format!("size {size} must be positive").into());
        }
        Ok((
            size as usize,
            a.float("alpha").unwrap_or(1e-4) as f64,
            a.float("beta").unwrap_or(0.75) as f64,
            a.float("bias").unwrap_or(1.0) as f64,
        ))
    }

    /// The channel window of `c`, within `0..ch`.
    fn window(c: usize, size: usize, ch: usize) -> std::ops::RangeInclusive<usize> {
        let (lo, hi) = ((size - 1) / 2, size / 2);
        c.saturating_sub(lo)..=(c + hi).min(ch - 1)
    }
}

impl Op for Lrn {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        if x.rank() < 3 || !x.dtype.is_float() {
            return Err(format!(
                "input must be floating [N, C, ...], got {} {:?}",
                x.dtype, x.shape
            )
            .into());
        }
        Self::params(cx.attrs())?;
        Ok(vec![Fact::new(x.dtype, x.shape.clone())])
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let size = Self::params(cx.attrs()).map_or(0, |p| p.0 as u64);
        out[0].numel().saturating_mul(size + 5)
    }
    /// As `F.local_response_norm` runs it (it is composite in PyTorch): the square
    /// saves the input, the channel average pool its zero-padded input
    /// (`[N, 1, C + size − 1, ...]`), the power its base `bias + α·avg` and the
    /// division the input and the divisor. Backward FLOPs: twice the forward's.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let x = cx.input(0)?;
        let (size, ..) = Self::params(cx.attrs())?;
        let mut padded = vec![x.shape[0], 1, x.shape[1] + size - 1];
        padded.extend_from_slice(&x.shape[2..]);
        let like = Fact::new(x.dtype, x.shape.clone());
        Ok(Some(Backward {
            grads: vec![Grad {
                input: 0,
                needs: vec![
                    Saved::Input(0),
                    Saved::Extra(0),
                    Saved::Extra(1),
                    Saved::Extra(2),
                ],
            }],
            extras: vec![Fact::new(x.dtype, padded), like.clone(), like],
            flops: self.flops(cx, out).saturating_mul(2),
        }))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// Per position, the window's sum of squares in f64; with
    /// [`KernelCx::extras`], the padded squares, the base and the divisor follow.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let (size, alpha, beta, bias) = Self::params(cx.attrs())?;
        let (n, ch) = (x.shape[0], x.shape[1]);
        let plane: usize = x.shape[2..].iter().product();
        let xs = x.to_f32()?;
        let mut base = vec![0f32; xs.len()];
        for b in 0..n {
            for c in 0..ch {
                for p in 0..plane {
                    let sq: f64 = Self::window(c, size, ch)
                        .map(|k| (xs[(b * ch + k) * plane + p] as f64).powi(2))
                        .sum();
                    base[(b * ch + c) * plane + p] = (bias + alpha / size as f64 * sq) as f32;
                }
            }
        }
        let div: Vec<f32> = base.iter().map(|&v| (v as f64).powf(beta) as f32).collect();
        let y = xs.iter().zip(&div).map(|(&a, &d)| a / d).collect();
        let mut out = vec![Tensor::from_f32(x.dtype(), x.shape.clone(), y)?];
        if cx.extras {
            let lo = (size - 1) / 2;
            let cp = ch + size - 1;
            let mut padded = vec![0f32; n * cp * plane];
            for b in 0..n {
                for c in 0..ch {
                    for p in 0..plane {
                        padded[(b * cp + c + lo) * plane + p] =
                            xs[(b * ch + c) * plane + p].powi(2);
                    }
                }
            }
            let mut shape = vec![n, 1, cp];
            shape.extend_from_slice(&x.shape[2..]);
            out.push(Tensor::from_f32(x.dtype(), shape, padded)?);
            out.push(Tensor::from_f32(x.dtype(), x.shape.clone(), base)?);
            out.push(Tensor::from_f32(x.dtype(), x.shape.clone(), div)?);
        }
        Ok(out)
    }
    /// With `b` the saved base: `dx_j = g_j·b_j^−β − (2αβ/size)·x_j·Σ_c g_c·x_c·b_c^(−β−1)`
    /// over the channels `c` whose window holds `j`.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let f = cx.input(0)?;
        let (size, alpha, beta, _) = Self::params(cx.attrs())?;
        let (n, ch) = (f.shape[0], f.shape[1]);
        let plane: usize = f.shape[2..].iter().product();
        let xs = cx.saved(Saved::Input(0))?.to_f32()?;
        let base = cx.saved(Saved::Extra(1))?.to_f32()?;
        let g = cx.grad(0)?;
        let at = |b: usize, c: usize, p: usize| (b * ch + c) * plane + p;
        // t_c = g_c·x_c·b_c^(−β−1).
        let t: Vec<f64> = (0..xs.len())
            .map(|i| g[i] as f64 * xs[i] as f64 * (base[i] as f64).powf(-beta - 1.0))
            .collect();
        let (lo, hi) = ((size - 1) / 2, size / 2);
        let mut dx = vec![0f32; xs.len()];
        for b in 0..n {
            for j in 0..ch {
                // Channels c with j in window(c): j − hi ≤ c ≤ j + lo.
                let cs = j.saturating_sub(hi)..=(j + lo).min(ch - 1);
                for p in 0..plane {
                    let i = at(b, j, p);
                    let s: f64 = cs.clone().map(|c| t[at(b, c, p)]).sum();
                    let v = g[i] as f64 * (base[i] as f64).powf(-beta)
                        - 2.0 * alpha * beta / size as f64 * xs[i] as f64 * s;
                    dx[i] = v as f32;
                }
            }
        }
        cx.answer(vec![(0, dx)])
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// `MeanVarianceNormalization(X)` over `axes` (default `[0, 2, 3]`):
/// `(X − mean) / (√var + 1e-9)`, as the ONNX function body. FLOPs: 8 per element.
struct Mvn;

impl Mvn {
    fn axes(cx_attrs: &crate::ir::Attrs, rank: usize) -> RuleResult<Vec<usize>> {
        let a = cx_attrs.ints("axes").map_or(vec![0, 2, 3], |v| v.to_vec());
        let mut v = a
            .iter()
            .map(|&a| axis(a, rank))
            .collect::<RuleResult<Vec<_>>>()?;
        v.sort_unstable();
        v.dedup();
        Ok(v)
    }
}

impl Op for Mvn {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        if !x.dtype.is_float() {
            return Err(format!("input must be floating point, got {}", x.dtype).into());
        }
        Self::axes(cx.attrs(), x.rank())?;
        Ok(vec![Fact::new(x.dtype, x.shape.clone())])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel().saturating_mul(8)
    }
    /// No PyTorch op: its decomposition saves the input and the centred input
    /// (the subtraction's result, read by the square and the division) and the
    /// divisor (`[reduced]`); modelled as those. Backward FLOPs: 8 per element.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let x = cx.input(0)?;
        let axes = Self::axes(cx.attrs(), x.rank())?;
        let stat: Vec<usize> = (0..x.rank())
            .map(|i| if axes.contains(&i) { 1 } else { x.shape[i] })
            .collect();
        Ok(Some(Backward {
            grads: vec![Grad {
                input: 0,
                needs: vec![Saved::Input(0), Saved::Extra(0), Saved::Extra(1)],
            }],
            extras: vec![
                Fact::new(x.dtype, x.shape.clone()),
                Fact::new(x.dtype, stat),
            ],
            flops: out[0].numel().saturating_mul(8),
        }))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// Mean and biased variance over the axes (f64); with
    /// [`KernelCx::extras`], the centred input and the divisor follow.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let axes = Self::axes(cx.attrs(), x.rank())?;
        let stat: Vec<usize> = (0..x.rank())
            .map(|i| if axes.contains(&i) { 1 } else { x.shape[i] })
            .collect();
        let xs = x.to_f32()?;
        let groups: usize = stat.iter().product();
        let count = (xs.len() / groups.max(1)).max(1) as f64;
        let (mut sum, mut sq) = (vec![0f64; groups], vec![0f64; groups]);
        let mut group = Vec::with_capacity(xs.len());
        for_each(&x.shape, [&stat[..]], |i, [k]| {
            sum[k] += xs[i] as f64;
            sq[k] += (xs[i] as f64).powi(2);
            group.push(k);
        });
        let mean: Vec<f64> = sum.iter().map(|s| s / count).collect();
        let div: Vec<f64> = (0..groups)
            .map(|k| (sq[k] / count - mean[k] * mean[k]).max(0.0).sqrt() + 1e-9)
            .collect();
        let centred: Vec<f32> = xs
            .iter()
            .zip(&group)
            .map(|(&v, &k)| (v as f64 - mean[k]) as f32)
            .collect();
        let y = centred
            .iter()
            .zip(&group)
            .map(|(&c, &k)| (c as f64 / div[k]) as f32)
            .collect();
        let mut out = vec![Tensor::from_f32(x.dtype(), x.shape.clone(), y)?];
        if cx.extras {
            out.push(Tensor::from_f32(x.dtype(), x.shape.clone(), centred)?);
            out.push(Tensor::from_f32(
                x.dtype(),
                stat,
                div.iter().map(|&d| d as f32).collect(),
            )?);
        }
        Ok(out)
    }
    /// With `c` the centred input, `d = σ + ε` and `M` elements per group:
    /// `dx = g/d − mean(g)/d − c·mean(g·c)/(σ·d²)`.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let f = cx.input(0)?;
        let axes = Self::axes(cx.attrs(), f.rank())?;
        let _ = cx.saved(Saved::Input(0))?;
        let c = cx.saved(Saved::Extra(0))?.to_f32()?;
        let dt = cx.saved(Saved::Extra(1))?;
        let d = dt.to_f32()?;
        let g = cx.grad(0)?;
        let groups = d.len();
        let count = (c.len() / groups.max(1)).max(1) as f64;
        let (mut sg, mut sgc) = (vec![0f64; groups], vec![0f64; groups]);
        let mut group = Vec::with_capacity(c.len());
        for_each(&f.shape, [&dt.shape[..]], |i, [k]| {
            sg[k] += g[i] as f64;
            sgc[k] += g[i] as f64 * c[i] as f64;
            group.push(k);
        });
        let _ = axes;
        let dx = (0..c.len())
            .map(|i| {
                let k = group[i];
                let (dk, sigma) = (d[k] as f64, d[k] as f64 - 1e-9);
                let v = g[i] as f64 / dk
                    - sg[k] / count / dk
                    - if sigma > 0.0 {
                        c[i] as f64 * sgc[k] / count / (sigma * dk * dk)
                    } else {
                        0.0
                    };
                v as f32
            })
            .collect();
        cx.answer(vec![(0, dx)])
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Full
    }
}

pub(super) fn register(r: &mut Registry) {
    r.add("LRN", Lrn);
    r.add("MeanVarianceNormalization", Mvn);
}
