//! Normalizations: BatchNormalization, LayerNormalization, InstanceNormalization,
//! GroupNormalization, and the softmax family (normalization along an axis).

use rayon::prelude::*;

use super::{
    axis, no_backward_kernel, no_gradient, Arity, Autocast, Backward, BackwardCx, CudaKernels, Cx,
    Fact, Grad, KernelCx, Launch, Op, Registry, RuleResult, Saved, Storage,
};
use crate::ir::{Attrs, DType};
use crate::numeric::broadcast::for_each;
use crate::numeric::grad::sum_to;
use crate::numeric::Tensor;

/// `BatchNormalization(X, scale, B, mean, var)`.
/// Opset ≥ 14: optional outputs running_mean, running_var (`training_mode`=1);
/// opset < 14: optional outputs mean, var, saved_mean, saved_var. All extra outputs are `[C]`.
/// FLOPs: 4 per element to normalize and scale; training mode adds 4 per element
/// for the batch mean (1) and variance (3).
struct BatchNorm;

/// BatchNormalization's attributes.
struct BatchNormAttrs {
    /// `epsilon` (default 1e-5).
    epsilon: f64,
    /// `momentum` (default 0.9).
    momentum: f64,
    /// `training_mode` (default 0; opset 14 on).
    training_mode: bool,
}

impl BatchNormAttrs {
    fn of(attrs: &Attrs) -> BatchNormAttrs {
        BatchNormAttrs {
            epsilon: attrs.float("epsilon").unwrap_or(1e-5) as f64,
            momentum: attrs.float("momentum").unwrap_or(0.9) as f64,
            training_mode: attrs.int_or("training_mode", 0) != 0,
        }
    }

    /// See [`batch_norm_training_mode`].
    fn training(&self, opset: i64, n_outputs: usize) -> bool {
        if opset >= 14 {
            self.training_mode
        } else {
            n_outputs > 1
        }
    }
}

/// Whether a BatchNormalization node normalizes with its batch's statistics
/// (training mode): the `training_mode` attribute from opset 14 on, the extra
/// outputs before it. An exporter writes inference mode for a model in eval mode.
/// memplan's training step runs every BatchNorm in training mode whatever this says.
pub fn batch_norm_training_mode(opset: i64, attrs: &Attrs, n_outputs: usize) -> bool {
    BatchNormAttrs::of(attrs).training(opset, n_outputs)
}

impl Op for BatchNorm {
    fn arity(&self) -> Arity {
        Arity::new(5, 5, 1, 5)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let c = channels(x)?;
        check_params(cx, &[(1, "scale"), (2, "B"), (3, "mean"), (4, "var")], c)?;
        let stat = cx.input(3)?.dtype;
        let mut out = vec![Fact::new(x.dtype, x.shape.clone())];
        for _ in 1..cx.n_outputs() {
            out.push(Fact::new(stat, vec![c]));
        }
        Ok(out)
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let training = BatchNormAttrs::of(cx.attrs()).training(cx.opset, cx.n_outputs());
        let per: u64 = if training { 8 } else { 4 };
        per.saturating_mul(out[0].numel())
    }
    /// Training BN (NativeBatchNormBackward) saves the input, scale, running stats
    /// and the batch mean and inverse std it computed ([C] each, float32). Memplan's
    /// training step always runs BN in training mode. Backward FLOPs: 8 per element.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let _ = cx;
        let stat = Fact::new(DType::F32, vec![out[0].shape[1]]);
        Ok(Some(stats_backward(vec![stat.clone(), stat], true, out, 8)))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// Inference: `scale·(x − mean)/√(var + ε) + B` with the running statistics.
    /// Training mode (attribute `training_mode`, or extra outputs before opset 14):
    /// the batch mean and biased variance per channel normalize, and the running
    /// statistics come out updated as `stat·momentum + batch_stat·(1 − momentum)`
    /// (the ONNX reference; opset < 14 adds the batch mean and variance as outputs
    /// 3 and 4). Statistics are accumulated in f64.
    ///
    /// With [`KernelCx::extras`] it runs in training mode whatever the attribute
    /// says, and appends the batch mean and inverse std (`1/√(var + ε)`, float32
    /// `[C]`) that the backward rule saves.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        batch_norm_kernel(cx)
    }
    /// Training-mode BatchNorm backward from the saved x, scale, batch mean and
    /// inverse std, per channel over `M = N·spatial` elements, `x̂ = (x − μ)·r`:
    /// `dx = γ·r·(g − mean(g) − x̂·mean(g·x̂))`, `dγ = Σ g·x̂`, `dβ = Σ g`
    /// (sums in f64).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        batch_norm_backward(cx)
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(
            Launch::BatchNorm,
            &["bn_stats_f32", "bn_apply_f32", "bn_finish_f32"],
            &["bn_bwd_reduce_f32", "bn_bwd_dx_f32", "bn_bwd_params_f32"],
        )
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// `LayerNormalization(X, Scale, B?) -> (Y, Mean?, InvStdDev?)` over axes `axis..`.
/// Mean and InvStdDev are `X.shape[..axis] + [1; rank-axis]`, of `stash_type` (float).
/// FLOPs: 8 per element (mean, center, square, variance sum, scale by 1/σ, γ, β, and
/// the reductions' adds).
struct LayerNorm;

/// LayerNormalization's and RMSNormalization's attributes.
struct LayerNormAttrs {
    /// `axis` (default -1): the first normalized axis.
    axis: i64,
    /// `epsilon` (default 1e-5).
    epsilon: f64,
    /// `stash_type` (default 1, float).
    stash_type: i64,
}

impl LayerNormAttrs {
    fn of(attrs: &Attrs) -> LayerNormAttrs {
        LayerNormAttrs {
            axis: attrs.int_or("axis", -1),
            epsilon: attrs.float("epsilon").unwrap_or(1e-5) as f64,
            stash_type: attrs.int_or("stash_type", 1),
        }
    }

    /// The first normalized axis of a rank-`rank` input.
    fn axis(&self, rank: usize) -> RuleResult<usize> {
        axis(self.axis, rank)
    }
}

impl Op for LayerNorm {
    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 3)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let at = LayerNormAttrs::of(cx.attrs());
        let ax = at.axis(x.rank())?;
        let normalized = &x.shape[ax..];
        for i in 1..cx.inputs.len() {
            if let Some(f) = cx.opt(i) {
                super::broadcast(&[&f.shape, normalized])
                    .ok()
                    .filter(|b| b == normalized)
                    .ok_or_else(|| {
                        format!(
                            "input {i} {:?} does not broadcast to the normalized shape {normalized:?}",
                            f.shape
                        )
                    })?;
            }
        }
        let stash = super::dtype_attr(at.stash_type)?;
        let stat = row_stat_shape(&x.shape, ax);
        let mut out = vec![Fact::new(x.dtype, x.shape.clone())];
        for _ in 1..cx.n_outputs() {
            out.push(Fact::new(stash, stat.clone()));
        }
        Ok(out)
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel().saturating_mul(8)
    }
    /// NativeLayerNormBackward saves the input, γ, β, and the per-row mean and rstd
    /// (float32, one per normalized row). Backward FLOPs: 8 per element.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let x = cx.input(0)?;
        let ax = LayerNormAttrs::of(cx.attrs()).axis(x.rank())?;
        let stat = Fact::new(DType::F32, row_stat_shape(&x.shape, ax));
        Ok(Some(stats_backward(vec![stat.clone(), stat], true, out, 8)))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// Per row of the normalized axes: mean and biased variance (f64 accumulation),
    /// `(x − mean)·InvStdDev·Scale + B`; Mean and InvStdDev outputs when declared.
    /// With [`KernelCx::extras`], the mean and InvStdDev the backward rule saves
    /// (float32, shaped as those outputs) follow the declared outputs.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        layer_norm_kernel(cx, true)
    }
    /// Per normalized row, from the saved x, Scale, mean and inverse std,
    /// `x̂ = (x − μ)·r`, `h = g·γ`: `dx = r·(h − mean(h) − x̂·mean(h·x̂))`;
    /// `dγ = Σ_rows g·x̂` and `dB = Σ_rows g`, summed back to their shapes.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        layer_norm_backward(cx, true)
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(
            Launch::LayerNorm,
            &["ln_fwd_f32", "strided_copy_b4"],
            &[
                "ln_bwd_dx_f32",
                "ln_bwd_params_f32",
                "strided_copy_b4",
                "reduce_f32",
            ],
        )
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Full
    }
}

/// `RMSNormalization(X, scale) -> Y` (opset 23) over axes `axis..`:
/// `Y = X / √(mean(X²) + ε) · scale`, scale broadcasting to the normalized shape.
/// FLOPs: 5 per element (square, sum, scale by 1/rms, scale).
struct RmsNorm;

impl Op for RmsNorm {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let at = LayerNormAttrs::of(cx.attrs());
        let ax = at.axis(x.rank())?;
        let normalized = &x.shape[ax..];
        let s = cx.input(1)?;
        super::broadcast(&[&s.shape, normalized])
            .ok()
            .filter(|b| b == normalized)
            .ok_or_else(|| {
                format!(
                    "scale {:?} does not broadcast to the normalized shape {normalized:?}",
                    s.shape
                )
            })?;
        super::dtype_attr(at.stash_type)?;
        Ok(vec![Fact::new(x.dtype, x.shape.clone())])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel().saturating_mul(5)
    }
    /// As PyTorch's fused `rms_norm` (`_fused_rms_norm`): saves the input, the
    /// scale and the per-row inverse RMS (float32). Backward FLOPs: 6 per element.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let x = cx.input(0)?;
        let ax = LayerNormAttrs::of(cx.attrs()).axis(x.rank())?;
        let stat = Fact::new(DType::F32, row_stat_shape(&x.shape, ax));
        Ok(Some(stats_backward(vec![stat], false, out, 6)))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// Per row: `r = 1/√(mean(x²) + ε)` (f64), `x·r·scale`; with
    /// [`KernelCx::extras`], `r` (float32) follows.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        layer_norm_kernel(cx, false)
    }
    /// From the saved x, scale and `r`, `x̂ = x·r`, `h = g·scale`:
    /// `dx = r·(h − x̂·mean(h·x̂))`, `dscale = Σ_rows g·x̂` summed to its shape.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        layer_norm_backward(cx, false)
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Full
    }
}

/// `InstanceNormalization(X, scale, B)` and `GroupNormalization(X, scale, B)`: Y like X.
/// Statistics per (image, group) over the group's channels and all spatial
/// positions; instance norm is group norm with one group per channel. Scale and B
/// are `[C]`, except GroupNormalization before opset 21, where they are
/// `[num_groups]` (one per group, as the opset 18 spec says; opset 21 made them
/// per channel, as PyTorch's `GroupNorm`).
/// FLOPs: 8 per element, as LayerNormalization.
struct SameShapeNorm {
    /// GroupNormalization (else InstanceNormalization).
    group: bool,
}

/// Instance/GroupNormalization's attributes.
struct GroupNormAttrs {
    /// `num_groups` (GroupNormalization; required there).
    num_groups: Option<i64>,
    /// `epsilon` (default 1e-5).
    epsilon: f64,
}

impl GroupNormAttrs {
    fn of(attrs: &Attrs) -> GroupNormAttrs {
        GroupNormAttrs {
            num_groups: attrs.int("num_groups"),
            epsilon: attrs.float("epsilon").unwrap_or(1e-5) as f64,
        }
    }
}

impl SameShapeNorm {
    /// Groups over `c` channels, and whether the scale and bias are one per group
    /// (GroupNormalization before opset 21) rather than one per channel.
    fn groups(&self, at: &GroupNormAttrs, opset: i64, c: usize) -> RuleResult<(usize, bool)> {
        if !self.group {
            return Ok((c, false));
        }
        let g = at.num_groups.ok_or("missing attribute 'num_groups'")?;
        if g < 1 || c as i64 % g != 0 {
            return Err(format!("num_groups {g} does not divide the {c} channels").into());
        }
        Ok((g as usize, opset < 21))
    }
}

impl Op for SameShapeNorm {
    fn arity(&self) -> Arity {
        Arity::new(3, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let c = channels(x)?;
        let (groups, per_group) = self.groups(&GroupNormAttrs::of(cx.attrs()), cx.opset, c)?;
        check_params(
            cx,
            &[(1, "scale"), (2, "B")],
            if per_group { groups } else { c },
        )?;
        Ok(vec![Fact::new(x.dtype, x.shape.clone())])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel().saturating_mul(8)
    }
    /// As `native_group_norm` (NativeGroupNormBackward), which PyTorch's GroupNorm
    /// runs (instance norm: one group per channel): saves the input, the scale and
    /// the per-(image, group) mean and rstd (float32 `[N, groups]`). The bias's
    /// gradient reads nothing. Backward FLOPs: 8 per element.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let x = cx.input(0)?;
        let (groups, _) = self.groups(&GroupNormAttrs::of(cx.attrs()), cx.opset, x.shape[1])?;
        let stat = Fact::new(DType::F32, vec![x.shape[0], groups]);
        Ok(Some(stats_backward(vec![stat.clone(), stat], true, out, 8)))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// Per (image, group), one task each: mean and biased variance in f64,
    /// `(x − μ)/√(var + ε)·scale + B` (ε: `epsilon`, default 1e-5), scale and B
    /// per channel or per group. With [`KernelCx::extras`], the mean and inverse
    /// std (float32 `[N, groups]`) that the backward rule saves follow.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        group_norm_kernel(self, cx)
    }
    /// As `native_group_norm_backward`, from the saved x, scale, mean and inverse
    /// std: per (image, group) of `M` elements, `x̂ = (x − μ)·r`, `h = g·γ`:
    /// `dx = r·(h − Σh/M − x̂·Σ(h·x̂)/M)`; `dγ = Σ g·x̂` and `dB = Σ g` over images
    /// and positions (and the group's channels, for per-group scale and B); sums in f64.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        group_norm_backward(self, cx)
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Full
    }
}

/// `Softmax` / `LogSoftmax` / `Hardmax` along `axis` (default -1 from opset 13, 1 before).
/// FLOPs: 5 per element (max, subtract, exp, sum, divide or log-subtract).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Softmax {
    /// `Softmax`.
    Soft,
    /// `LogSoftmax`.
    Log,
    /// `Hardmax`.
    Hard,
}

/// The softmax family's `axis` (default -1 from opset 13, 1 before).
fn softmax_axis(attrs: &Attrs, opset: i64, rank: usize) -> RuleResult<usize> {
    let default = if opset >= 13 { -1 } else { 1 };
    axis(attrs.int_or("axis", default), rank)
}

impl Op for Softmax {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        softmax_axis(cx.attrs(), cx.opset, x.rank())?;
        if !x.dtype.is_float() {
            return Err(format!("input must be floating point, got {}", x.dtype).into());
        }
        Ok(vec![Fact::new(x.dtype, x.shape.clone())])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel().saturating_mul(5)
    }
    /// SoftmaxBackward / LogSoftmaxBackward save the output. Hardmax has no gradient.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if *self == Softmax::Hard {
            return Ok(None);
        }
        Ok(Some(Backward::each(
            &[0],
            &[Saved::Output(0)],
            out[0].numel().saturating_mul(3),
        )))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// Along one axis (opset 13+) or over the axes from `axis` on, flattened (before
    /// 13): subtract the maximum, exponentiate, normalize (LogSoftmax: `x − max −
    /// ln Σ`); Hardmax marks the first maximum.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        softmax_kernel(*self, cx)
    }
    /// From the saved output along the same axes as the forward: Softmax
    /// `dx = y·(g − Σ g·y)`, LogSoftmax `dx = g − eʸ·Σ g`.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        if *self == Softmax::Hard {
            return no_gradient(cx);
        }
        let log = *self == Softmax::Log;
        let f = cx.input(0)?;
        let a = softmax_axis(cx.attrs(), cx.opset, f.rank())?;
        let (_, n, inner) = softmax_dims(&f.shape, a, cx.opset);
        let y = cx.saved(Saved::Output(0))?.to_f32()?;
        let g = cx.grad(0)?;
        let block = n * inner;
        let mut dx = vec![0f32; y.len()];
        if block > 0 {
            dx.par_chunks_mut(block).enumerate().for_each(|(o, db)| {
                let (yb, gb) = (
                    &y[o * block..(o + 1) * block],
                    &g[o * block..(o + 1) * block],
                );
                for i in 0..inner {
                    let at = |k: usize| k * inner + i;
                    if log {
                        let s: f64 = (0..n).map(|k| gb[at(k)] as f64).sum();
                        for k in 0..n {
                            db[at(k)] = gb[at(k)] - yb[at(k)].exp() * s as f32;
                        }
                    } else {
                        let s: f64 = (0..n).map(|k| gb[at(k)] as f64 * yb[at(k)] as f64).sum();
                        for k in 0..n {
                            db[at(k)] = yb[at(k)] * (gb[at(k)] - s as f32);
                        }
                    }
                }
            });
        }
        cx.answer(vec![(0, dx)])
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        match self {
            Softmax::Soft | Softmax::Log => {
                CudaKernels::new(Launch::Softmax, &["softmax_fwd_f32"], &["softmax_bwd_f32"])
            }
            Softmax::Hard => CudaKernels::HOST,
        }
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        match self {
            Softmax::Hard => Autocast::Promote,
            Softmax::Soft | Softmax::Log => Autocast::Full,
        }
    }
}

/// `LpNormalization(X)` along `axis`: Y like X. FLOPs: 3 per element.
struct LpNorm;

/// LpNormalization's attributes.
struct LpNormAttrs {
    /// `axis` (default -1).
    axis: i64,
    /// `p` (default 2).
    p: i64,
}

impl LpNormAttrs {
    fn of(attrs: &Attrs) -> LpNormAttrs {
        LpNormAttrs {
            axis: attrs.int_or("axis", -1),
            p: attrs.int_or("p", 2),
        }
    }
}

impl Op for LpNorm {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        axis(LpNormAttrs::of(cx.attrs()).axis, x.rank())?;
        Ok(vec![Fact::new(x.dtype, x.shape.clone())])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel().saturating_mul(3)
    }
    /// Normalizing by the norm needs the input and the output.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(Some(Backward::each(
            &[0],
            &[Saved::Input(0), Saved::Output(0)],
            out[0].numel().saturating_mul(4),
        )))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// `x / ‖x‖_p` along `axis` (`p` 1 or 2; a zero norm gives 0).
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let at = LpNormAttrs::of(cx.attrs());
        let (a, p) = (axis(at.axis, x.rank())?, at.p);
        if p != 1 && p != 2 {
            return Err(format!("p must be 1 or 2, got {p}").into());
        }
        let (outer, n, inner) = split_axis(&x.shape, a);
        let xs = x.to_f32()?;
        let mut y = xs.to_vec();
        for o in 0..outer {
            for i in 0..inner {
                let at = |k: usize| (o * n + k) * inner + i;
                let norm = if p == 1 {
                    (0..n).map(|k| xs[at(k)].abs() as f64).sum::<f64>()
                } else {
                    (0..n)
                        .map(|k| (xs[at(k)] as f64).powi(2))
                        .sum::<f64>()
                        .sqrt()
                };
                for k in 0..n {
                    y[at(k)] = if norm == 0.0 {
                        0.0
                    } else {
                        (xs[at(k)] as f64 / norm) as f32
                    };
                }
            }
        }
        Ok(vec![Tensor::from_f32(x.dtype(), x.shape.clone(), y)?])
    }
    /// Not needed by any model in models/ yet.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        no_backward_kernel(cx)
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Full
    }
}

/// `(outer, n, inner)` of a softmax along axis `a`: opset 13+ one axis, before it
/// the axes from `a` on, flattened.
fn softmax_dims(shape: &[usize], a: usize, opset: i64) -> (usize, usize, usize) {
    if opset >= 13 {
        split_axis(shape, a)
    } else {
        (shape[..a].iter().product(), shape[a..].iter().product(), 1)
    }
}

/// `(outer, n, inner)`: the sizes before, at and after axis `a`.
fn split_axis(shape: &[usize], a: usize) -> (usize, usize, usize) {
    (
        shape[..a].iter().product(),
        shape[a],
        shape[a + 1..].iter().product(),
    )
}

/// The channels `C` of an `[N, C, ...]` input.
fn channels(x: &Fact) -> RuleResult<usize> {
    if x.rank() < 2 {
        return Err(format!("input must be [N, C, ...], got {:?}", x.shape).into());
    }
    Ok(x.shape[1])
}

/// Checks that each named parameter input is `[want]`.
fn check_params(cx: &Cx, params: &[(usize, &str)], want: usize) -> RuleResult<()> {
    for &(i, name) in params {
        let f = cx.input(i)?;
        if f.shape != [want] {
            return Err(format!("{name} is {:?}, expected [{want}]", f.shape).into());
        }
    }
    Ok(())
}

/// The shape of a Layer/RMSNormalization statistic over axes `ax..` of `shape`:
/// `shape[..ax]` then ones to the input's rank.
fn row_stat_shape(shape: &[usize], ax: usize) -> Vec<usize> {
    let mut stat = shape[..ax].to_vec();
    stat.resize(shape.len(), 1);
    stat
}

/// The backward rule the normalizations share: the input's and the scale's
/// (inputs 0 and 1) gradients read the input, the scale and the saved
/// statistics `stats` (extras, in order); the bias's (input 2, when `bias`)
/// reads nothing. Backward FLOPs: `per` per output element.
fn stats_backward(stats: Vec<Fact>, bias: bool, out: &[Fact], per: u64) -> Backward {
    let mut needs = vec![Saved::Input(0), Saved::Input(1)];
    needs.extend((0..stats.len()).map(Saved::Extra));
    let mut grads = vec![
        Grad {
            input: 0,
            needs: needs.clone(),
        },
        Grad { input: 1, needs },
    ];
    if bias {
        grads.push(Grad {
            input: 2,
            needs: vec![],
        });
    }
    Backward {
        grads,
        extras: stats,
        flops: out[0].numel().saturating_mul(per),
    }
}

/// BatchNormalization on the CPU; see [`BatchNorm`]'s `forward_cpu`.
fn batch_norm_kernel(cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
    let x = cx.input(0)?;
    let (n, c) = (x.shape[0], x.shape[1]);
    let plane: usize = x.shape[2..].iter().product();
    let at = BatchNormAttrs::of(cx.attrs());
    let (eps, momentum) = (at.epsilon, at.momentum);
    let training = cx.extras || at.training(cx.opset, cx.n_outputs());
    let xs = x.to_f32()?;
    let [scale, bias, mean, var] = [1, 2, 3, 4].map(|i| cx.input(i).and_then(|t| t.to_f32()));
    let (scale, bias, mean, var) = (scale?, bias?, mean?, var?);
    // Per channel: the mean and variance that normalize.
    let stats: Vec<(f64, f64)> = if training {
        (0..c)
            .into_par_iter()
            .map(|ch| {
                let vals =
                    || (0..n).flat_map(|i| &xs[(i * c + ch) * plane..(i * c + ch + 1) * plane]);
                let count = (n * plane).max(1) as f64;
                let mu = vals().map(|&v| v as f64).sum::<f64>() / count;
                let var = vals().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / count;
                (mu, var)
            })
            .collect()
    } else {
        (0..c).map(|ch| (mean[ch] as f64, var[ch] as f64)).collect()
    };
    let mut y = vec![0f32; xs.len()];
    if plane > 0 {
        y.par_chunks_mut(plane).enumerate().for_each(|(job, yp)| {
            let ch = job % c;
            let (mu, v) = stats[ch];
            let k = scale[ch] as f64 / (v + eps).sqrt();
            let b = bias[ch] as f64 - mu * k;
            let (k, b) = (k as f32, b as f32);
            for (o, &xi) in yp.iter_mut().zip(&xs[job * plane..(job + 1) * plane]) {
                *o = xi * k + b;
            }
        });
    }
    let dt = x.dtype();
    let mut outs = vec![Tensor::from_f32(dt, x.shape.clone(), y)?];
    if training {
        let stat_dt = cx.input(3)?.dtype();
        let run = |old: &[f32], pick: fn(&(f64, f64)) -> f64| -> Vec<f32> {
            old.iter()
                .zip(&stats)
                .map(|(&o, s)| (o as f64 * momentum + pick(s) * (1.0 - momentum)) as f32)
                .collect()
        };
        outs.push(Tensor::from_f32(stat_dt, vec![c], run(&mean, |s| s.0))?);
        outs.push(Tensor::from_f32(stat_dt, vec![c], run(&var, |s| s.1))?);
        if cx.opset < 14 {
            outs.push(Tensor::from_f32(
                stat_dt,
                vec![c],
                stats.iter().map(|s| s.0 as f32).collect(),
            )?);
            outs.push(Tensor::from_f32(
                stat_dt,
                vec![c],
                stats.iter().map(|s| s.1 as f32).collect(),
            )?);
        }
    } else {
        // Inference mode with the statistics outputs declared: they pass unchanged.
        for i in 1..cx.n_outputs() {
            let src = cx.input(if i % 2 == 1 { 3 } else { 4 })?;
            outs.push(src.clone());
        }
    }
    outs.truncate(cx.n_outputs().max(1));
    if cx.extras {
        outs.push(Tensor::f32(
            vec![c],
            stats.iter().map(|s| s.0 as f32).collect(),
        ));
        outs.push(Tensor::f32(
            vec![c],
            stats
                .iter()
                .map(|s| (1.0 / (s.1 + eps).sqrt()) as f32)
                .collect(),
        ));
    }
    Ok(outs)
}

/// BatchNormalization backward; see [`BatchNorm`]'s `backward_cpu`.
fn batch_norm_backward(cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
    let f = cx.input(0)?;
    let (n, c) = (f.shape[0], f.shape[1]);
    let plane: usize = f.shape[2..].iter().product();
    let g = cx.grad(0)?;
    let count = (n * plane).max(1) as f64;
    // Σ g per channel (all that dβ reads).
    let channel = |ch: usize| (0..n).map(move |i| (i * c + ch) * plane..(i * c + ch + 1) * plane);
    let sum_g: Vec<f64> = (0..c)
        .map(|ch| {
            channel(ch)
                .map(|r| g[r].iter().map(|&v| v as f64).sum::<f64>())
                .sum()
        })
        .collect();
    let mut res = Vec::new();
    if cx.wants(0) || cx.wants(1) {
        let xs = cx.saved(Saved::Input(0))?.to_f32()?;
        let mean = cx.saved(Saved::Extra(0))?.to_f32()?;
        let inv = cx.saved(Saved::Extra(1))?.to_f32()?;
        // Σ g·x̂ per channel.
        let sum_gx: Vec<f64> = (0..c)
            .map(|ch| {
                let (mu, r) = (mean[ch] as f64, inv[ch] as f64);
                channel(ch)
                    .map(|rg| {
                        g[rg.clone()]
                            .iter()
                            .zip(&xs[rg])
                            .map(|(&gv, &xv)| gv as f64 * (xv as f64 - mu) * r)
                            .sum::<f64>()
                    })
                    .sum()
            })
            .collect();
        if cx.wants(0) {
            let scale = cx.saved(Saved::Input(1))?.to_f32()?;
            let mut dx = vec![0f32; xs.len()];
            if plane > 0 {
                dx.par_chunks_mut(plane).enumerate().for_each(|(job, d)| {
                    let ch = job % c;
                    let (mu, r) = (mean[ch] as f64, inv[ch] as f64);
                    let (mg, mgx) = (sum_g[ch] / count, sum_gx[ch] / count);
                    let k = scale[ch] as f64 * r;
                    let (gp, xp) = (
                        &g[job * plane..(job + 1) * plane],
                        &xs[job * plane..(job + 1) * plane],
                    );
                    for ((o, &gv), &xv) in d.iter_mut().zip(gp).zip(xp) {
                        let xh = (xv as f64 - mu) * r;
                        *o = (k * (gv as f64 - mg - xh * mgx)) as f32;
                    }
                });
            }
            res.push((0, dx));
        }
        if cx.wants(1) {
            res.push((1, sum_gx.iter().map(|&v| v as f32).collect()));
        }
    }
    if cx.wants(2) {
        res.push((2, sum_g.iter().map(|&v| v as f32).collect()));
    }
    cx.answer(res)
}

/// LayerNormalization on the CPU; see [`LayerNorm`]'s `forward_cpu`.
fn layer_norm_kernel(cx: &KernelCx, centered: bool) -> RuleResult<Vec<Tensor>> {
    let x = cx.input(0)?;
    let at = LayerNormAttrs::of(cx.attrs());
    let a = at.axis(x.rank())?;
    let eps = at.epsilon;
    let norm_shape = &x.shape[a..];
    let cols: usize = norm_shape.iter().product();
    let rows: usize = x.shape[..a].iter().product();
    // Scale and B broadcast to the normalized shape.
    let full = |t: Option<&Tensor>, default: f32| -> RuleResult<Vec<f32>> {
        match t {
            None => Ok(vec![default; cols]),
            Some(t) => {
                let v = t.to_f32()?;
                let mut out = Vec::with_capacity(cols);
                for_each(norm_shape, [&t.shape[..]], |_, [i]| out.push(v[i]));
                Ok(out)
            }
        }
    };
    let (scale, bias) = (full(cx.opt(1), 1.0)?, full(cx.opt(2), 0.0)?);
    let xs = x.to_f32()?;
    let mut y = vec![0f32; xs.len()];
    let mut stats = vec![(0f32, 0f32); rows];
    if cols > 0 {
        y.par_chunks_mut(cols)
            .zip(stats.par_iter_mut())
            .enumerate()
            .for_each(|(r, (yr, st))| {
                let xr = &xs[r * cols..(r + 1) * cols];
                let mu = if centered {
                    xr.iter().map(|&v| v as f64).sum::<f64>() / cols as f64
                } else {
                    0.0
                };
                let var = xr.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / cols as f64;
                let inv = 1.0 / (var + eps).sqrt();
                for (k, o) in yr.iter_mut().enumerate() {
                    *o = (((xr[k] as f64 - mu) * inv) as f32) * scale[k] + bias[k];
                }
                *st = (mu as f32, inv as f32);
            });
    }
    let mut outs = vec![Tensor::from_f32(x.dtype(), x.shape.clone(), y)?];
    let stat_outputs: &[(usize, usize)] = if centered { &[(1, 0), (2, 1)] } else { &[] };
    for &(i, pick) in stat_outputs {
        if let Some(Some(f)) = cx.outputs.get(i) {
            let v = stats
                .iter()
                .map(|s| if pick == 0 { s.0 } else { s.1 })
                .collect();
            outs.push(Tensor::from_f32(f.dtype, f.shape.clone(), v)?);
        } else if i < cx.n_outputs() {
            outs.push(Tensor::f32(vec![0], vec![]));
        }
    }
    if cx.extras {
        let shape = row_stat_shape(&x.shape, a);
        if centered {
            outs.push(Tensor::f32(
                shape.clone(),
                stats.iter().map(|s| s.0).collect(),
            ));
        }
        outs.push(Tensor::f32(shape, stats.iter().map(|s| s.1).collect()));
    }
    Ok(outs)
}

/// LayerNormalization backward; see [`LayerNorm`]'s `backward_cpu`.
fn layer_norm_backward(cx: &BackwardCx, centered: bool) -> RuleResult<Vec<Option<Tensor>>> {
    let f = cx.input(0)?;
    let a = LayerNormAttrs::of(cx.attrs()).axis(f.rank())?;
    let norm_shape = f.shape[a..].to_vec();
    let cols: usize = norm_shape.iter().product();
    let g = cx.grad(0)?;
    let mut res = Vec::new();
    // Σ over rows of a per-column quantity, in f64, in row order.
    let col_sum = |v: &dyn Fn(usize, usize) -> f64| -> Vec<f32> {
        let rows = g.len() / cols.max(1);
        let mut acc = vec![0f64; cols];
        for r in 0..rows {
            for (k, s) in acc.iter_mut().enumerate() {
                *s += v(r, k);
            }
        }
        acc.into_iter().map(|v| v as f32).collect()
    };
    if cx.wants(0) || cx.wants(1) {
        let xs = cx.saved(Saved::Input(0))?.to_f32()?;
        let (mean, inv) = if centered {
            (
                cx.saved(Saved::Extra(0))?.to_f32()?,
                cx.saved(Saved::Extra(1))?.to_f32()?,
            )
        } else {
            let inv = cx.saved(Saved::Extra(0))?.to_f32()?;
            (std::borrow::Cow::Owned(vec![0.0; inv.len()]), inv)
        };
        let xhat = |r: usize, k: usize| (xs[r * cols + k] as f64 - mean[r] as f64) * inv[r] as f64;
        if cx.wants(0) {
            let st = cx.saved(Saved::Input(1))?;
            let sv = st.to_f32()?;
            let mut scale = Vec::with_capacity(cols);
            for_each(&norm_shape, [&st.shape[..]], |_, [i]| scale.push(sv[i]));
            let mut dx = vec![0f32; xs.len()];
            if cols > 0 {
                dx.par_chunks_mut(cols).enumerate().for_each(|(r, d)| {
                    let gr = &g[r * cols..(r + 1) * cols];
                    let (mut sh, mut shx) = (0f64, 0f64);
                    for k in 0..cols {
                        let h = gr[k] as f64 * scale[k] as f64;
                        sh += h;
                        shx += h * xhat(r, k);
                    }
                    let mh = if centered { sh / cols as f64 } else { 0.0 };
                    let mhx = shx / cols as f64;
                    let rs = inv[r] as f64;
                    for k in 0..cols {
                        let h = gr[k] as f64 * scale[k] as f64;
                        d[k] = (rs * (h - mh - xhat(r, k) * mhx)) as f32;
                    }
                });
            }
            res.push((0, dx));
        }
        if cx.wants(1) {
            let full = col_sum(&|r, k| g[r * cols + k] as f64 * xhat(r, k));
            res.push((1, sum_to(&full, &norm_shape, &cx.input(1)?.shape)));
        }
    }
    if cx.wants(2) {
        let full = col_sum(&|r, k| g[r * cols + k] as f64);
        res.push((2, sum_to(&full, &norm_shape, &cx.input(2)?.shape)));
    }
    cx.answer(res)
}

/// Instance/GroupNormalization on the CPU; see [`SameShapeNorm`]'s `forward_cpu`.
fn group_norm_kernel(op: &SameShapeNorm, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
    let x = cx.input(0)?;
    let (n, c) = (x.shape[0], x.shape[1]);
    let at = GroupNormAttrs::of(cx.attrs());
    let (groups, per_group) = op.groups(&at, cx.opset, c)?;
    let cg = c / groups;
    let plane: usize = x.shape[2..].iter().product();
    let len = cg * plane;
    let eps = at.epsilon;
    let xs = x.to_f32()?;
    let (scale, bias) = (cx.input(1)?.to_f32()?, cx.input(2)?.to_f32()?);
    let want = if per_group { groups } else { c };
    if scale.len() != want || bias.len() != want {
        return Err(format!("scale and B must have {want} elements").into());
    }
    let mut y = vec![0f32; xs.len()];
    let mut stats = vec![(0f32, 0f32); n * groups];
    if len > 0 {
        y.par_chunks_mut(len)
            .zip(stats.par_iter_mut())
            .enumerate()
            .for_each(|(job, (yg, st))| {
                let gr = job % groups;
                let xg = &xs[job * len..(job + 1) * len];
                let mu = xg.iter().map(|&v| v as f64).sum::<f64>() / len as f64;
                let var = xg.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / len as f64;
                let inv = 1.0 / (var + eps).sqrt();
                for ch in 0..cg {
                    let k = if per_group { gr } else { gr * cg + ch };
                    let (s, b) = (scale[k] as f64, bias[k] as f64);
                    let r = ch * plane..(ch + 1) * plane;
                    for (o, &v) in yg[r.clone()].iter_mut().zip(&xg[r]) {
                        *o = ((v as f64 - mu) * inv * s + b) as f32;
                    }
                }
                *st = (mu as f32, inv as f32);
            });
    }
    let mut outs = vec![Tensor::from_f32(x.dtype(), x.shape.clone(), y)?];
    if cx.extras {
        outs.push(Tensor::f32(
            vec![n, groups],
            stats.iter().map(|s| s.0).collect(),
        ));
        outs.push(Tensor::f32(
            vec![n, groups],
            stats.iter().map(|s| s.1).collect(),
        ));
    }
    Ok(outs)
}

/// Instance/GroupNormalization backward; see [`SameShapeNorm`]'s `backward_cpu`.
fn group_norm_backward(op: &SameShapeNorm, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
    let f = cx.input(0)?;
    let (n, c) = (f.shape[0], f.shape[1]);
    let (groups, per_group) = op.groups(&GroupNormAttrs::of(cx.attrs()), cx.opset, c)?;
    let cg = c / groups;
    let plane: usize = f.shape[2..].iter().product();
    let len = (cg * plane) as f64;
    let g = cx.grad(0)?;
    // Σ g per (image, channel) row; the row's group is `row / cg`.
    let rows = n * c;
    let row = |r: usize| r * plane..(r + 1) * plane;
    let sum_g: Vec<f64> = (0..rows)
        .into_par_iter()
        .map(|r| g[row(r)].iter().map(|&v| v as f64).sum())
        .collect();
    // A per-row sum reduced over images to the scale's or bias's shape.
    let to_param = |per_row: &[f64]| -> Vec<f32> {
        let mut acc = vec![0f64; if per_group { groups } else { c }];
        for (r, &v) in per_row.iter().enumerate() {
            let ch = r % c;
            acc[if per_group { ch / cg } else { ch }] += v;
        }
        acc.into_iter().map(|v| v as f32).collect()
    };
    let mut res = Vec::new();
    if cx.wants(0) || cx.wants(1) {
        let xs = cx.saved(Saved::Input(0))?.to_f32()?;
        let mean = cx.saved(Saved::Extra(0))?.to_f32()?;
        let inv = cx.saved(Saved::Extra(1))?.to_f32()?;
        if mean.len() != n * groups || inv.len() != n * groups {
            return Err("the saved statistics are not [N, groups]".into());
        }
        let xhat = |r: usize, v: f32| (v as f64 - mean[r / cg] as f64) * inv[r / cg] as f64;
        // Σ g·x̂ per row.
        let sum_gx: Vec<f64> = (0..rows)
            .into_par_iter()
            .map(|r| {
                g[row(r)]
                    .iter()
                    .zip(&xs[row(r)])
                    .map(|(&gv, &xv)| gv as f64 * xhat(r, xv))
                    .sum()
            })
            .collect();
        if cx.wants(0) {
            let scale = cx.saved(Saved::Input(1))?.to_f32()?;
            let gamma = |r: usize| {
                let ch = r % c;
                scale[if per_group { ch / cg } else { ch }] as f64
            };
            let mut dx = vec![0f32; xs.len()];
            let chunk = cg * plane;
            if chunk > 0 {
                dx.par_chunks_mut(chunk).enumerate().for_each(|(job, d)| {
                    let first = job * cg;
                    let (mut sh, mut shx) = (0f64, 0f64);
                    for r in first..first + cg {
                        sh += gamma(r) * sum_g[r];
                        shx += gamma(r) * sum_gx[r];
                    }
                    let (mh, mhx, rs) = (sh / len, shx / len, inv[job] as f64);
                    for r in first..first + cg {
                        let k = gamma(r);
                        let at = (r - first) * plane;
                        for (i, (&gv, &xv)) in g[row(r)].iter().zip(&xs[row(r)]).enumerate() {
                            d[at + i] = (rs * (k * gv as f64 - mh - xhat(r, xv) * mhx)) as f32;
                        }
                    }
                });
            }
            res.push((0, dx));
        }
        if cx.wants(1) {
            res.push((1, to_param(&sum_gx)));
        }
    }
    if cx.wants(2) {
        res.push((2, to_param(&sum_g)));
    }
    cx.answer(res)
}

/// Softmax, LogSoftmax and Hardmax on the CPU; see [`Softmax`]'s `forward_cpu`.
fn softmax_kernel(op: Softmax, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
    let x = cx.input(0)?;
    let a = softmax_axis(cx.attrs(), cx.opset, x.rank())?;
    let (outer, n, inner) = softmax_dims(&x.shape, a, cx.opset);
    let xs = x.to_f32()?;
    let mut y = vec![0f32; xs.len()];
    let block = n * inner;
    if block > 0 {
        y.par_chunks_mut(block).enumerate().for_each(|(o, yb)| {
            let xb = &xs[o * block..(o + 1) * block];
            for i in 0..inner {
                let at = |k: usize| k * inner + i;
                let mut max = f32::NEG_INFINITY;
                let mut arg = 0;
                for k in 0..n {
                    if xb[at(k)] > max {
                        (max, arg) = (xb[at(k)], k);
                    }
                }
                match op {
                    Softmax::Hard => yb[at(arg)] = 1.0,
                    Softmax::Soft | Softmax::Log => {
                        let mut sum = 0f32;
                        for k in 0..n {
                            let e = (xb[at(k)] - max).exp();
                            yb[at(k)] = e;
                            sum += e;
                        }
                        if op == Softmax::Log {
                            let ls = sum.ln();
                            for k in 0..n {
                                yb[at(k)] = xb[at(k)] - max - ls;
                            }
                        } else {
                            let inv = 1.0 / sum;
                            for k in 0..n {
                                yb[at(k)] *= inv;
                            }
                        }
                    }
                }
            }
        });
    }
    let _ = outer;
    Ok(vec![Tensor::from_f32(x.dtype(), x.shape.clone(), y)?])
}

/// Registers the normalization family.
pub fn register(r: &mut Registry) {
    r.add("BatchNormalization", BatchNorm);
    r.add("LayerNormalization", LayerNorm);
    r.add("RMSNormalization", RmsNorm);
    r.add("InstanceNormalization", SameShapeNorm { group: false });
    r.add("GroupNormalization", SameShapeNorm { group: true });
    r.add("Softmax", Softmax::Soft);
    r.add("LogSoftmax", Softmax::Log);
    r.add("Hardmax", Softmax::Hard);
    r.add("LpNormalization", LpNorm);
}
