//! Convolutions and pooling over `[N, C, spatial...]` tensors.

use rayon::prelude::*;

use super::{
    dim, no_backward_kernel, numel, Arity, Autocast, Backward, BackwardCx, CudaKernels, Cx, Fact,
    Grad, KernelCx, Launch, Op, Registry, RuleResult, Saved, Storage, CUBLAS_SGEMM,
};
use crate::ir::{Attrs, DType};
use crate::numeric::gemm::{sgemm, Mat};
use crate::numeric::Tensor;

/// A sliding window's attributes (Conv, the pools, and the ops that share their
/// window).
struct WindowAttrs<'a> {
    /// `strides` (default 1 per axis).
    strides: Option<&'a [i64]>,
    /// `dilations` (default 1 per axis).
    dilations: Option<&'a [i64]>,
    /// `pads` (begins then ends; default 0).
    pads: Option<&'a [i64]>,
    /// `auto_pad` (default "NOTSET").
    auto_pad: &'a str,
}

impl WindowAttrs<'_> {
    fn of(attrs: &Attrs) -> WindowAttrs<'_> {
        WindowAttrs {
            strides: attrs.ints("strides"),
            dilations: attrs.ints("dilations"),
            pads: attrs.ints("pads"),
            auto_pad: attrs.string("auto_pad").unwrap_or("NOTSET"),
        }
    }
}

/// Output spatial size of a sliding window (Conv, MaxPool, AveragePool), following
/// ONNX `auto_pad`, `pads`, `strides`, `dilations` and `ceil_mode`.
pub fn window_out(
    input: &[usize],
    kernel: &[usize],
    attrs: &Attrs,
    ceil_mode: bool,
) -> RuleResult<Vec<usize>> {
    let nd = input.len();
    let at = WindowAttrs::of(attrs);
    let list = |name: &str, given: Option<&[i64]>, default: i64| -> RuleResult<Vec<i64>> {
        match given {
            Some(v) if v.len() == nd => Ok(v.to_vec()),
            Some(v) => Err(format!(
                "attribute '{name}' has {} values for {nd} spatial dims",
                v.len()
            )
            .into()),
            None => Ok(vec![default; nd]),
        }
    };
    let strides = list("strides", at.strides, 1)?;
    let dil = list("dilations", at.dilations, 1)?;
    if strides.iter().chain(&dil).any(|&s| s < 1) {
        return Err("strides and dilations must be >= 1".into());
    }
    let pads = match at.pads {
        Some(p) if p.len() == 2 * nd => p.to_vec(),
        Some(p) => {
            return Err(format!(
                "attribute 'pads' has {} values for {nd} spatial dims",
                p.len()
            )
            .into())
        }
        None => vec![0; 2 * nd],
    };
    if pads.iter().any(|&p| p < 0) {
        return Err(format!("negative pads {pads:?}").into());
    }
    let auto = at.auto_pad;
    let mut out = Vec::with_capacity(nd);
    for i in 0..nd {
        // i128: attribute values can be anything a file says; nothing here may overflow.
        let (x, s, d) = (input[i] as i128, strides[i] as i128, dil[i] as i128);
        let (pb, pe) = (pads[i] as i128, pads[i + nd] as i128);
        let span = d * (kernel[i] as i128 - 1) + 1;
        let o = match auto {
            "SAME_UPPER" | "SAME_LOWER" => (x + s - 1) / s,
            "VALID" => {
                if x < span {
                    0
                } else {
                    (x - span) / s + 1
                }
            }
            "NOTSET" | "" => {
                let padded = x + pb + pe;
                if padded < span {
                    return Err(format!(
                        "window {span} is larger than padded input {padded} on spatial dim {i}"
                    )
                    .into());
                }
                if ceil_mode {
                    let mut o = (padded - span + s - 1) / s + 1;
                    // The last window must start inside the input or left padding.
                    if (o - 1) * s >= x + pb {
                        o -= 1;
                    }
                    o
                } else {
                    (padded - span) / s + 1
                }
            }
            other => return Err(format!("unknown auto_pad '{other}'").into()),
        };
        let o = i64::try_from(o).map_err(|_| format!("output size {o} is too large"))?;
        out.push(dim(o, "output size")?);
    }
    Ok(out)
}

pub(super) fn check_nc(x: &Fact, what: &str) -> RuleResult<()> {
    if x.rank() < 3 {
        return Err(format!("{what} input must be [N, C, spatial...], got {:?}", x.shape).into());
    }
    Ok(())
}

/// Backward of Conv and ConvTranspose. The input's gradient reads the weight, the
/// weight's the input, the bias's nothing; but PyTorch computes all three in one
/// `convolution_backward` and its autograd node saves input and weight whenever any
/// of them is wanted (measured with `saved_tensors_hooks`: a conv whose weight is an
/// activation, e.g. fake-quantized, and whose input needs no gradient still saves
/// that weight), so each gradient here needs both. The forward's FLOPs per gradient.
pub(super) fn conv_backward(forward_flops: u64) -> Backward {
    Backward::each(
        &[0, 1, 2],
        &[Saved::Input(0), Saved::Input(1)],
        forward_flops.saturating_mul(2),
    )
}

/// `Conv(X, W, B?)`, W = `[M, C/group, k...]`.
/// FLOPs: 2·(C/group)·prod(k) per output element (multiply-adds), + 1 per element for bias.
struct Conv;

/// Conv's own attributes (the window's: [`WindowAttrs`]).
struct ConvAttrs<'a> {
    /// `group` (default 1).
    group: i64,
    /// `kernel_shape` (default: the weight's).
    kernel_shape: Option<&'a [i64]>,
}

impl ConvAttrs<'_> {
    fn of(attrs: &Attrs) -> ConvAttrs<'_> {
        ConvAttrs {
            group: attrs.int_or("group", 1),
            kernel_shape: attrs.ints("kernel_shape"),
        }
    }
}

impl Op for Conv {
    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (x, w) = (cx.input(0)?, cx.input(1)?);
        check_nc(x, "Conv")?;
        if w.rank() != x.rank() {
            return Err(format!("weight {:?} does not match input {:?}", w.shape, x.shape).into());
        }
        let attrs = cx.attrs();
        let at = ConvAttrs::of(attrs);
        let group = at.group;
        if group < 1 || x.shape[1] as i64 % group != 0 || w.shape[0] as i64 % group != 0 {
            return Err(format!("group {group} does not divide the channels").into());
        }
        if w.shape[1] as i128 * group as i128 != x.shape[1] as i128 {
            return Err(format!(
                "input has {} channels, weight {:?} with group {group} expects {}",
                x.shape[1],
                w.shape,
                w.shape[1] as i128 * group as i128
            )
            .into());
        }
        if let Some(b) = cx.opt(2) {
            if b.shape != [w.shape[0]] {
                return Err(format!("bias {:?} must be [{}]", b.shape, w.shape[0]).into());
            }
        }
        let kernel = &w.shape[2..];
        if let Some(ks) = at.kernel_shape {
            if ks.iter().map(|&k| k as usize).ne(kernel.iter().copied()) {
                return Err(
                    format!("kernel_shape {ks:?} differs from weight {:?}", w.shape).into(),
                );
            }
        }
        let mut shape = vec![x.shape[0], w.shape[0]];
        shape.extend(window_out(&x.shape[2..], kernel, attrs, false)?);
        Ok(vec![Fact::new(x.dtype, shape)])
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let Some(w) = cx.inputs[1] else { return 0 };
        let per = numel(&w.shape[1..]).saturating_mul(2);
        let bias = cx.opt(2).is_some() as u64;
        per.saturating_add(bias).saturating_mul(out[0].numel())
    }
    /// ConvolutionBackward saves the input (for the weight's gradient) and the weight
    /// (for the input's). Backward FLOPs: the forward's multiply-adds once per gradient.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(Some(conv_backward(self.flops(cx, out))))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// 1-D to 3-D, f32: im2col then one GEMM per (image, group), images and groups
    /// in parallel; a 1×1, stride-1, unpadded convolution multiplies the input directly.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        conv_kernel(cx)
    }
    /// Per (image, group): `dcol = W_gᵀ·G` scattered back by col2im (reads W);
    /// per group, over images in order: `dW_g += G·colᵀ` (reads X); `dB` sums G
    /// over images and positions (reads nothing).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        conv_backward_kernel(cx)
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(
            Launch::Conv,
            &["im2col_f32", CUBLAS_SGEMM, "conv_bias_f32"],
            &["im2col_f32", "col2im_f32", CUBLAS_SGEMM, "channel_sum_f32"],
        )
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Half
    }
}

/// `MaxPool` / `AveragePool` / `LpPool`. MaxPool's optional second output is int64
/// indices. FLOPs: prod(kernel) per output element (compares or adds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pool {
    /// `MaxPool`.
    Max,
    /// `AveragePool`.
    Average,
    /// `LpPool`.
    Lp,
}

/// The pools' own attributes (the window's: [`WindowAttrs`]).
struct PoolAttrs<'a> {
    /// `kernel_shape` (required by the windowed pools).
    kernel_shape: Option<&'a [i64]>,
    /// `ceil_mode` (default 0).
    ceil_mode: bool,
    /// `count_include_pad` (AveragePool; default 0).
    count_include_pad: bool,
    /// `p` (LpPool, GlobalLpPool; default 2).
    p: i32,
    /// `storage_order` (MaxPool's indices; default 0, row-major).
    storage_order: bool,
}

impl PoolAttrs<'_> {
    fn of(attrs: &Attrs) -> PoolAttrs<'_> {
        PoolAttrs {
            kernel_shape: attrs.ints("kernel_shape"),
            ceil_mode: attrs.int_or("ceil_mode", 0) != 0,
            count_include_pad: attrs.int_or("count_include_pad", 0) != 0,
            p: attrs.int_or("p", 2) as i32,
            storage_order: attrs.int_or("storage_order", 0) != 0,
        }
    }

    /// `kernel_shape`, required.
    fn kernel_shape(&self) -> RuleResult<&[i64]> {
        Ok(self
            .kernel_shape
            .ok_or("missing attribute 'kernel_shape'")?)
    }
}

impl Op for Pool {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, if *self == Pool::Max { 2 } else { 1 })
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        check_nc(x, "pooling")?;
        let attrs = cx.attrs();
        let at = PoolAttrs::of(attrs);
        let ks = at.kernel_shape()?;
        if ks.len() != x.rank() - 2 || ks.iter().any(|&k| k < 1) {
            return Err(format!("kernel_shape {ks:?} does not fit input {:?}", x.shape).into());
        }
        let kernel: Vec<usize> = ks.iter().map(|&k| k as usize).collect();
        let mut shape = x.shape[..2].to_vec();
        shape.extend(window_out(&x.shape[2..], &kernel, attrs, at.ceil_mode)?);
        let mut out = vec![Fact::new(x.dtype, shape.clone())];
        if cx.n_outputs() > 1 {
            out.push(Fact::new(DType::I64, shape));
        }
        Ok(out)
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let k: u64 = PoolAttrs::of(cx.attrs()).kernel_shape.map_or(1, |ks| {
            ks.iter()
                .fold(1u64, |a, &k| a.saturating_mul(k.max(0) as u64))
        });
        k.saturating_mul(out[0].numel())
    }
    /// MaxPool saves its input and the int64 argmax indices (shaped like the output).
    /// AveragePool's gradient needs only shapes, but PyTorch's `avg_pool2d` backward
    /// (`AvgPool2DBackward0`, also what `AdaptiveAvgPool2d` to a size other than 1
    /// runs) keeps its input all the same (`_saved_self`; measured in the census:
    /// DenseNet's transition layers). LpPool saves nothing. Backward FLOPs: one per
    /// input element.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let n = cx.inputs[0].map_or(0, Fact::numel);
        Ok(Some(match self {
            Pool::Average => Backward::each(&[0], &[Saved::Input(0)], n),
            Pool::Max => Backward {
                grads: vec![Grad {
                    input: 0,
                    needs: vec![Saved::Input(0), Saved::Extra(0)],
                }],
                extras: vec![Fact::new(DType::I64, out[0].shape.clone())],
                flops: n,
            },
            Pool::Lp => Backward::each(&[0], &[], n),
        }))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// 1-D to 3-D windows, one (image, channel) plane per task. MaxPool's indices
    /// are flat offsets into the input (`storage_order` 0; with 1, each channel's
    /// offset column-major, as the ONNX reference); AveragePool divides by
    /// the window positions inside the input (`count_include_pad` 0) or inside the
    /// padded input (1); LpPool is `(Σ|x|^p)^(1/p)`.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        pool_kernel(*self, cx)
    }
    /// MaxPool: the gradient scattered (added) to the saved argmax indices, the
    /// input's shape from its fact. AveragePool: each window's gradient spread over
    /// its positions inside the input, divided as the forward divided. LpPool's
    /// gradient needs its input and output, which its rule does not save: an error.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        pool_backward(*self, cx)
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        match self {
            Pool::Max => CudaKernels::new(
                Launch::Pool,
                &["maxpool2d_fwd_f32", "strided_copy_b8"],
                &["maxpool2d_bwd_f32"],
            ),
            Pool::Average => {
                CudaKernels::new(Launch::Pool, &["avgpool2d_fwd_f32"], &["avgpool2d_bwd_f32"])
            }
            Pool::Lp => CudaKernels::HOST,
        }
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// `GlobalAveragePool` / `GlobalMaxPool` / `GlobalLpPool`: `[N, C, 1, ...]`.
/// FLOPs: one add or compare per input element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GlobalPool {
    /// `GlobalAveragePool`.
    Average,
    /// `GlobalMaxPool`.
    Max,
    /// `GlobalLpPool`.
    Lp,
}

impl Op for GlobalPool {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        check_nc(x, "global pooling")?;
        let mut shape = x.shape[..2].to_vec();
        shape.resize(x.rank(), 1);
        Ok(vec![Fact::new(x.dtype, shape)])
    }
    fn flops(&self, cx: &Cx, _out: &[Fact]) -> u64 {
        cx.inputs[0].map_or(0, Fact::numel)
    }
    /// Global average pooling needs only shapes; global max pooling saves input and
    /// indices (adaptive max pool). Backward FLOPs: one per input element.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let n = cx.inputs[0].map_or(0, Fact::numel);
        if *self == GlobalPool::Max {
            return Ok(Some(Backward {
                grads: vec![Grad {
                    input: 0,
                    needs: vec![Saved::Input(0), Saved::Extra(0)],
                }],
                extras: vec![Fact::new(DType::I64, out[0].shape.clone())],
                flops: n,
            }));
        }
        Ok(Some(Backward::each(&[0], &[], n)))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// Mean, max or L2 (`p`) over each (image, channel) plane.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let xs = x.to_f32()?;
        let plane: usize = x.shape[2..].iter().product();
        let p = PoolAttrs::of(cx.attrs()).p;
        let v: Vec<f32> = xs
            .chunks(plane.max(1))
            .map(|c| match self {
                GlobalPool::Max => c.iter().copied().fold(f32::NEG_INFINITY, f32::max),
                GlobalPool::Lp => c
                    .iter()
                    .map(|v| (v.abs() as f64).powi(p))
                    .sum::<f64>()
                    .powf(1.0 / p as f64) as f32,
                GlobalPool::Average => {
                    (c.iter().map(|&v| v as f64).sum::<f64>() / plane as f64) as f32
                }
            })
            .collect();
        Ok(vec![Tensor::from_f32(
            x.dtype(),
            cx.out(0)?.shape.clone(),
            v,
        )?])
    }
    /// GlobalAveragePool: `g / plane` to every position (reads nothing). Global
    /// max pooling has no forward indices yet; GlobalLpPool's gradient needs its
    /// input and output, which its rule does not save: errors.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        match self {
            GlobalPool::Average => {
                let x = cx.input(0)?;
                let plane: usize = x.shape[2..].iter().product();
                let g = cx.grad(0)?;
                let mut v = Vec::with_capacity(g.len() * plane);
                for &gv in g.iter() {
                    v.extend(std::iter::repeat_n(gv / plane as f32, plane));
                }
                cx.answer(vec![(0, v)])
            }
            GlobalPool::Lp => Err(
                "GlobalLpPool's gradient needs its input and output, which its backward rule does not save"
                    .into(),
            ),
            GlobalPool::Max => no_backward_kernel(cx),
        }
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        match self {
            GlobalPool::Average => CudaKernels::new(
                Launch::GlobalAveragePool,
                &["global_avgpool_fwd_f32"],
                &["global_avgpool_bwd_f32"],
            ),
            GlobalPool::Max | GlobalPool::Lp => CudaKernels::HOST,
        }
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// A 1-, 2- or 3-D sliding window as 3-D (depth, height, width): sizes, kernel,
/// strides, dilations and the leading pads (front, top, left). A 2-D window has
/// depth 1 and a 1-D one also height 1 (kernel, stride and dilation 1, no pad), so
/// the loops over the leading axes run once and 1-D and 2-D results are those of
/// a planar window.
pub(crate) struct Window {
    /// How many spatial axes the op has (1 to 3); the rest are leading 1s. The
    /// device's planar kernels refuse a 3-D window by it (`exec::cuda`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) rank: usize,
    pub(crate) input: [usize; 3],
    pub(crate) output: [usize; 3],
    pub(crate) kernel: [usize; 3],
    pub(crate) strides: [usize; 3],
    pub(crate) dilations: [usize; 3],
    pub(crate) pads: [usize; 3],
    /// Input size plus both pads (AveragePool's `count_include_pad`).
    pub(crate) padded: [usize; 3],
}

impl Window {
    /// Elements of one input channel (`d·h·w`).
    pub(crate) fn input_len(&self) -> usize {
        self.input.iter().product()
    }
    /// Positions of the window over one channel (`od·oh·ow`).
    pub(crate) fn output_len(&self) -> usize {
        self.output.iter().product()
    }
    /// Taps of the kernel (`kd·kh·kw`).
    pub(crate) fn kernel_len(&self) -> usize {
        self.kernel.iter().product()
    }
    /// A 1×1(×1), stride-1, unpadded window: im2col's columns are the input itself.
    pub(crate) fn is_direct(&self) -> bool {
        self.kernel == [1; 3]
            && self.strides == [1; 3]
            && self.pads == [0; 3]
            && self.padded == self.input
    }
    /// The input coordinate of tap `k` of the window at output position `o` on
    /// axis `a` (negative or past the end in the padding).
    fn at(&self, a: usize, o: usize, k: usize) -> isize {
        (o * self.strides[a] + k * self.dilations[a]) as isize - self.pads[a] as isize
    }
    /// Visits the taps of the window at output position `o`, in row-major kernel
    /// order: `f(offset)` for each tap inside the input (its offset in one input
    /// channel). Returns how many taps lie inside the padded input (those past it,
    /// `ceil_mode`'s, excluded): AveragePool's `count_include_pad` divisor.
    fn taps(&self, o: [usize; 3], mut f: impl FnMut(usize)) -> usize {
        let [d, h, wd] = self.input.map(|v| v as isize);
        let [pd, ph, pw] = self.padded.map(|v| v as isize);
        let [bd, bh, bw] = self.pads.map(|v| v as isize);
        let mut in_pad = 0;
        for ka in 0..self.kernel[0] {
            let iz = self.at(0, o[0], ka);
            for ki in 0..self.kernel[1] {
                let ih = self.at(1, o[1], ki);
                for kj in 0..self.kernel[2] {
                    let iw = self.at(2, o[2], kj);
                    if iz + bd < pd && ih + bh < ph && iw + bw < pw {
                        in_pad += 1;
                    }
                    if iz < 0 || ih < 0 || iw < 0 || iz >= d || ih >= h || iw >= wd {
                        continue;
                    }
                    f(((iz * h + ih) * wd + iw) as usize);
                }
            }
        }
        in_pad
    }
    /// The output positions over one channel, row-major.
    fn positions(&self) -> impl Iterator<Item = [usize; 3]> + '_ {
        let [od, oh, ow] = self.output;
        (0..od).flat_map(move |z| (0..oh).flat_map(move |y| (0..ow).map(move |x| [z, y, x])))
    }
}

/// The window of a Conv or pool from its attributes; `output` is the inferred
/// spatial output shape (which fixes the SAME padding).
pub(crate) fn window(
    attrs: &Attrs,
    input: &[usize],
    kernel: &[usize],
    output: &[usize],
) -> RuleResult<Window> {
    let nd = input.len();
    if nd == 0 || nd > 3 {
        return Err(format!("the CPU kernel handles 1-D to 3-D windows, not {nd}-D").into());
    }
    if kernel.len() != nd || output.len() != nd {
        return Err(format!(
            "kernel {kernel:?} and output {output:?} do not fit a {nd}-D input {input:?}"
        )
        .into());
    }
    let at = WindowAttrs::of(attrs);
    let list = |name: &str, given: Option<&[i64]>| -> RuleResult<Vec<usize>> {
        match given {
            None => Ok(vec![1; nd]),
            Some(v) if v.len() == nd => Ok(v.iter().map(|&x| x.max(1) as usize).collect()),
            Some(v) => Err(format!(
                "attribute '{name}' has {} values for {nd} spatial dims",
                v.len()
            )
            .into()),
        }
    };
    let (strides, dil) = (
        list("strides", at.strides)?,
        list("dilations", at.dilations)?,
    );
    let mut begin = vec![0usize; nd];
    let mut end = vec![0usize; nd];
    match at.auto_pad {
        "SAME_UPPER" | "SAME_LOWER" => {
            let upper = at.auto_pad == "SAME_UPPER";
            for i in 0..nd {
                let need =
                    (output[i].saturating_sub(1)) * strides[i] + (kernel[i] - 1) * dil[i] + 1;
                let total = need.saturating_sub(input[i]);
                let small = total / 2;
                (begin[i], end[i]) = if upper {
                    (small, total - small)
                } else {
                    (total - small, small)
                };
            }
        }
        "VALID" => {}
        _ => {
            if let Some(p) = at.pads {
                if p.len() != 2 * nd {
                    return Err(format!(
                        "attribute 'pads' has {} values for {nd} spatial dims",
                        p.len()
                    )
                    .into());
                }
                for i in 0..nd {
                    begin[i] = p[i].max(0) as usize;
                    end[i] = p[i + nd].max(0) as usize;
                }
            }
        }
    }
    // Leading axes of size 1 (kernel, stride, dilation 1; no pad) up to three.
    let three = |v: &[usize], fill: usize| -> [usize; 3] {
        let mut a = [fill; 3];
        a[3 - nd..].copy_from_slice(v);
        a
    };
    let padded: Vec<usize> = (0..nd).map(|i| input[i] + begin[i] + end[i]).collect();
    Ok(Window {
        rank: nd,
        input: three(input, 1),
        output: three(output, 1),
        kernel: three(kernel, 1),
        strides: three(&strides, 1),
        dilations: three(&dil, 1),
        pads: three(&begin, 0),
        padded: three(&padded, 1),
    })
}

/// Fills `col` (`[c·kd·kh·kw, od·oh·ow]`) from one image's `c` channels
/// (`[c, d, h, w]`).
pub(super) fn im2col(x: &[f32], c: usize, w: &Window, col: &mut [f32]) {
    let [d, h, wd] = w.input;
    let [od, oh, ow] = w.output;
    let [kd, kh, kw] = w.kernel;
    let (vol, out_plane) = (w.input_len(), oh * ow);
    let mut row = 0;
    for ch in 0..c {
        let chan = &x[ch * vol..(ch + 1) * vol];
        for ka in 0..kd {
            for ki in 0..kh {
                for kj in 0..kw {
                    let dst = &mut col[row * od * out_plane..(row + 1) * od * out_plane];
                    row += 1;
                    for z in 0..od {
                        let dz = &mut dst[z * out_plane..(z + 1) * out_plane];
                        let iz = w.at(0, z, ka);
                        if iz < 0 || iz >= d as isize {
                            dz.fill(0.0);
                            continue;
                        }
                        let plane = &chan[iz as usize * h * wd..(iz as usize + 1) * h * wd];
                        for y in 0..oh {
                            let dy = &mut dz[y * ow..(y + 1) * ow];
                            let ih = w.at(1, y, ki);
                            if ih < 0 || ih >= h as isize {
                                dy.fill(0.0);
                                continue;
                            }
                            let src = &plane[ih as usize * wd..(ih as usize + 1) * wd];
                            for (xo, v) in dy.iter_mut().enumerate() {
                                let iw = w.at(2, xo, kj);
                                *v = if iw < 0 || iw >= wd as isize {
                                    0.0
                                } else {
                                    src[iw as usize]
                                };
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A Conv's sizes, as its CPU kernels (forward and backward) walk them.
struct ConvGeom {
    /// `group` (at least 1).
    group: usize,
    /// Images, input channels, output channels.
    n: usize,
    c: usize,
    m: usize,
    /// Input and output channels per group.
    cg: usize,
    mg: usize,
    /// The window ([`window`]).
    win: Window,
    /// One input channel's spatial size.
    vol: usize,
    /// One output channel's GEMM depth: `cg` times the kernel's size.
    kk: usize,
    /// One output channel's spatial size.
    plane: usize,
    /// Whether the input serves as its own im2col ([`Window::is_direct`]).
    direct: bool,
}

impl ConvGeom {
    fn of(attrs: &Attrs, x: &[usize], w: &[usize], out: &[usize]) -> RuleResult<ConvGeom> {
        let group = ConvAttrs::of(attrs).group.max(1) as usize;
        let (n, c, m) = (x[0], x[1], w[0]);
        let (cg, mg) = (c / group, m / group);
        let win = window(attrs, &x[2..], &w[2..], &out[2..])?;
        Ok(ConvGeom {
            group,
            n,
            c,
            m,
            cg,
            mg,
            vol: win.input_len(),
            kk: cg * win.kernel_len(),
            plane: win.output_len(),
            direct: win.is_direct(),
            win,
        })
    }

    /// Image `img`'s input channels of group `g` (`[cg, vol]`, contiguous).
    fn x_group(&self, img: usize, g: usize) -> std::ops::Range<usize> {
        let first = img * self.c + g * self.cg;
        first * self.vol..(first + self.cg) * self.vol
    }

    /// Group `g`'s weights (`[mg, kk]`, contiguous).
    fn w_group(&self, g: usize) -> std::ops::Range<usize> {
        g * self.mg * self.kk..(g + 1) * self.mg * self.kk
    }

    /// Image `img`'s output channels of group `g` (`[mg, plane]`, contiguous).
    fn y_group(&self, img: usize, g: usize) -> std::ops::Range<usize> {
        let first = img * self.m + g * self.mg;
        first * self.plane..(first + self.mg) * self.plane
    }
}

/// `Conv` on the CPU; see [`Conv`]'s `forward_cpu`.
fn conv_kernel(cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
    let (x, wt) = (cx.input(0)?, cx.input(1)?);
    let out = cx.out(0)?.shape.clone();
    let geo = ConvGeom::of(cx.attrs(), &x.shape, &wt.shape, &out)?;
    let (xs, ws) = (x.to_f32()?, wt.to_f32()?);
    let bias = cx.opt(2).map(|b| b.to_f32()).transpose()?;
    let mut y = vec![0f32; geo.n * geo.m * geo.plane];
    if geo.plane > 0 {
        y.par_chunks_mut(geo.mg * geo.plane)
            .enumerate()
            .for_each(|(job, yg)| {
                let (img, g) = (job / geo.group, job % geo.group);
                let (xg, wg) = (&xs[geo.x_group(img, g)], &ws[geo.w_group(g)]);
                let col_buf;
                let col: &[f32] = if geo.direct {
                    xg
                } else {
                    let mut b = vec![0f32; geo.kk * geo.plane];
                    im2col(xg, geo.cg, &geo.win, &mut b);
                    col_buf = b;
                    &col_buf
                };
                sgemm(
                    1.0,
                    Mat::new(wg, geo.mg, geo.kk, false),
                    Mat::new(col, geo.kk, geo.plane, false),
                    0.0,
                    yg,
                );
                if let Some(b) = &bias {
                    for (o, row) in yg.chunks_mut(geo.plane).enumerate() {
                        let bv = b[g * geo.mg + o];
                        row.iter_mut().for_each(|v| *v += bv);
                    }
                }
            });
    }
    Ok(vec![Tensor::from_f32(x.dtype(), out, y)?])
}

/// A pool's window from its `kernel_shape`.
fn pool_window(attrs: &Attrs, x: &[usize], out: &[usize]) -> RuleResult<Window> {
    let ks: Vec<usize> = PoolAttrs::of(attrs)
        .kernel_shape()?
        .iter()
        .map(|&k| k.max(1) as usize)
        .collect();
    window(attrs, &x[2..], &ks, &out[2..])
}

/// Pooling on the CPU; see [`Pool`]'s `forward_cpu`.
fn pool_kernel(op: Pool, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
    let x = cx.input(0)?;
    let out = cx.out(0)?.shape.clone();
    let attrs = cx.attrs();
    let win = pool_window(attrs, &x.shape, &out)?;
    let at = PoolAttrs::of(attrs);
    let (include_pad, p) = (at.count_include_pad, at.p);
    let (vol, positions) = (win.input_len(), win.output_len());
    let xs = x.to_f32()?;
    let planes = x.shape[0] * x.shape[1];
    let res: Vec<(Vec<f32>, Vec<i64>)> = (0..planes)
        .into_par_iter()
        .map(|pl| {
            let src = &xs[pl * vol..(pl + 1) * vol];
            let mut vals = Vec::with_capacity(positions);
            let mut idx = Vec::new();
            for o in win.positions() {
                let (mut best, mut arg) = (f32::NEG_INFINITY, 0usize);
                let (mut sum, mut count) = (0f64, 0usize);
                let in_pad = win.taps(o, |off| {
                    let v = src[off];
                    count += 1;
                    match op {
                        Pool::Max => {
                            if v > best || best.is_nan() {
                                (best, arg) = (v, off);
                            }
                        }
                        Pool::Lp => sum += (v.abs() as f64).powi(p),
                        Pool::Average => sum += v as f64,
                    }
                });
                match op {
                    Pool::Max => {
                        vals.push(best);
                        idx.push((pl * vol + arg) as i64);
                    }
                    Pool::Lp => vals.push(sum.powf(1.0 / p as f64) as f32),
                    Pool::Average => {
                        let d = if include_pad { in_pad } else { count };
                        vals.push((sum / d.max(1) as f64) as f32);
                    }
                }
            }
            (vals, idx)
        })
        .collect();
    let mut vals = Vec::with_capacity(planes * positions);
    let mut idx = Vec::new();
    for (v, i) in res {
        vals.extend(v);
        idx.extend(i);
    }
    let mut outs = vec![Tensor::from_f32(x.dtype(), out.clone(), vals)?];
    if cx.n_outputs() > 1 {
        // Output 1 indexes each channel column-major with `storage_order` 1, as
        // the ONNX reference does (the backward's own indices stay row-major).
        let declared = if at.storage_order {
            let [d, h, wd] = win.input;
            let vol = vol as i64;
            let (d, h, wd) = (d as i64, h as i64, wd as i64);
            idx.iter()
                .map(|&i| {
                    let (base, off) = (i - i % vol, i % vol);
                    let (z, y, x) = (off / (h * wd), off / wd % h, off % wd);
                    base + z + y * d + x * d * h
                })
                .collect()
        } else {
            idx.clone()
        };
        outs.push(Tensor::i64(out.clone(), declared));
    }
    if cx.extras && op == Pool::Max {
        // The argmax indices the backward rule saves.
        outs.push(Tensor::i64(out, idx));
    }
    Ok(outs)
}

/// Adds one image-group's `dcol` (`[c·kd·kh·kw, od·oh·ow]`) back into its input
/// gradient (`[c, d, h, w]`): the adjoint of [`im2col`].
pub(super) fn col2im(col: &[f32], c: usize, w: &Window, dx: &mut [f32]) {
    let [d, h, wd] = w.input;
    let [od, oh, ow] = w.output;
    let [kd, kh, kw] = w.kernel;
    let (vol, out_plane) = (w.input_len(), oh * ow);
    let mut row = 0;
    for ch in 0..c {
        let chan = &mut dx[ch * vol..(ch + 1) * vol];
        for ka in 0..kd {
            for ki in 0..kh {
                for kj in 0..kw {
                    let src = &col[row * od * out_plane..(row + 1) * od * out_plane];
                    row += 1;
                    for z in 0..od {
                        let iz = w.at(0, z, ka);
                        if iz < 0 || iz >= d as isize {
                            continue;
                        }
                        let plane = &mut chan[iz as usize * h * wd..(iz as usize + 1) * h * wd];
                        let sz = &src[z * out_plane..(z + 1) * out_plane];
                        for y in 0..oh {
                            let ih = w.at(1, y, ki);
                            if ih < 0 || ih >= h as isize {
                                continue;
                            }
                            let dst = &mut plane[ih as usize * wd..(ih as usize + 1) * wd];
                            for (xo, &v) in sz[y * ow..(y + 1) * ow].iter().enumerate() {
                                let iw = w.at(2, xo, kj);
                                if iw >= 0 && iw < wd as isize {
                                    dst[iw as usize] += v;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Conv backward; see [`Conv`]'s `backward_cpu`.
fn conv_backward_kernel(cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
    let (fx, fw) = (cx.input(0)?, cx.input(1)?);
    let out = cx.output(0)?.shape.clone();
    let geo = ConvGeom::of(cx.attrs(), &fx.shape, &fw.shape, &out)?;
    let g = cx.grad(0)?;
    // G of (image, group): `[mg, plane]`, contiguous.
    let g_of = |img: usize, gr: usize| &g[geo.y_group(img, gr)];
    let mut res = Vec::new();
    if cx.wants(0) {
        let ws = cx.saved(Saved::Input(1))?.to_f32()?;
        let mut dx = vec![0f32; geo.n * geo.c * geo.vol];
        if geo.cg * geo.vol > 0 && geo.plane > 0 {
            dx.par_chunks_mut(geo.cg * geo.vol)
                .enumerate()
                .for_each(|(job, dxg)| {
                    let (img, gr) = (job / geo.group, job % geo.group);
                    let wg = Mat::new(&ws[geo.w_group(gr)], geo.kk, geo.mg, true);
                    let gm = Mat::new(g_of(img, gr), geo.mg, geo.plane, false);
                    if geo.direct {
                        sgemm(1.0, wg, gm, 0.0, dxg);
                    } else {
                        let mut col = vec![0f32; geo.kk * geo.plane];
                        sgemm(1.0, wg, gm, 0.0, &mut col);
                        col2im(&col, geo.cg, &geo.win, dxg);
                    }
                });
        }
        res.push((0, dx));
    }
    if cx.wants(1) {
        let xs = cx.saved(Saved::Input(0))?.to_f32()?;
        let mut dw = vec![0f32; geo.m * geo.kk];
        if geo.mg * geo.kk > 0 && geo.plane > 0 {
            dw.par_chunks_mut(geo.mg * geo.kk)
                .enumerate()
                .for_each(|(gr, dwg)| {
                    let mut col = if geo.direct {
                        Vec::new()
                    } else {
                        vec![0f32; geo.kk * geo.plane]
                    };
                    for img in 0..geo.n {
                        let xg = &xs[geo.x_group(img, gr)];
                        let colv: &[f32] = if geo.direct {
                            xg
                        } else {
                            im2col(xg, geo.cg, &geo.win, &mut col);
                            &col
                        };
                        sgemm(
                            1.0,
                            Mat::new(g_of(img, gr), geo.mg, geo.plane, false),
                            Mat::new(colv, geo.plane, geo.kk, true),
                            1.0,
                            dwg,
                        );
                    }
                });
        }
        res.push((1, dw));
    }
    if cx.wants(2) {
        res.push((2, bias_grad(&g, geo.n, geo.m, geo.plane)));
    }
    cx.answer(res)
}

/// The bias gradient of a convolution (or its transpose): the output gradient
/// `[n, m, plane]` summed over images and positions per channel, in f64.
pub(super) fn bias_grad(g: &[f32], n: usize, m: usize, plane: usize) -> Vec<f32> {
    let mut db = vec![0f64; m];
    for img in 0..n {
        for (o, acc) in db.iter_mut().enumerate() {
            let row = &g[(img * m + o) * plane..(img * m + o + 1) * plane];
            *acc += row.iter().map(|&v| v as f64).sum::<f64>();
        }
    }
    db.into_iter().map(|v| v as f32).collect()
}

/// Pooling backward; see [`Pool`]'s `backward_cpu`.
fn pool_backward(op: Pool, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
    let x = cx.input(0)?;
    let g = cx.grad(0)?;
    let mut dx = vec![0f32; x.shape.iter().product()];
    match op {
        Pool::Max => {
            let idx = cx.saved(Saved::Extra(0))?.to_i64s();
            if idx.len() != g.len() {
                return Err("the saved indices and the gradient differ in size".into());
            }
            for (&i, &gv) in idx.iter().zip(g.iter()) {
                *dx.get_mut(i as usize)
                    .ok_or("a saved index is out of range")? += gv;
            }
        }
        Pool::Average => {
            let out = cx.output(0)?.shape.clone();
            let attrs = cx.attrs();
            let win = pool_window(attrs, &x.shape, &out)?;
            let include_pad = PoolAttrs::of(attrs).count_include_pad;
            let (vol, positions) = (win.input_len(), win.output_len());
            let mut inside = Vec::with_capacity(win.kernel_len());
            for pl in 0..x.shape[0] * x.shape[1] {
                let dxp = &mut dx[pl * vol..(pl + 1) * vol];
                for (at, o) in win.positions().enumerate() {
                    inside.clear();
                    let in_pad = win.taps(o, |off| inside.push(off));
                    let d = if include_pad { in_pad } else { inside.len() };
                    let gv = g[pl * positions + at] / d.max(1) as f32;
                    for &off in &inside {
                        dxp[off] += gv;
                    }
                }
            }
        }
        Pool::Lp => return Err(
            "LpPool's gradient needs its input and output, which its backward rule does not save"
                .into(),
        ),
    }
    cx.answer(vec![(0, dx)])
}

/// Registers convolution and pooling ops.
pub fn register(r: &mut Registry) {
    r.add("Conv", Conv);
    r.add("MaxPool", Pool::Max);
    r.add("AveragePool", Pool::Average);
    r.add("LpPool", Pool::Lp);
    r.add("GlobalAveragePool", GlobalPool::Average);
    r.add("GlobalMaxPool", GlobalPool::Max);
    r.add("GlobalLpPool", GlobalPool::Lp);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Attr;

    fn attrs(v: &[(&str, Attr)]) -> Attrs {
        Attrs::from_iter(v.iter().map(|(k, a)| (k.to_string(), a.clone())))
    }

    #[test]
    fn resnet_stem() {
        // 224 → conv 7x7 s2 p3 → 112 → maxpool 3x3 s2 p1 → 56
        let a = attrs(&[
            ("strides", Attr::Ints(vec![2, 2])),
            ("pads", Attr::Ints(vec![3, 3, 3, 3])),
        ]);
        assert_eq!(
            window_out(&[224, 224], &[7, 7], &a, false).unwrap(),
            vec![112, 112]
        );
        let a = attrs(&[
            ("strides", Attr::Ints(vec![2, 2])),
            ("pads", Attr::Ints(vec![1, 1, 1, 1])),
        ]);
        assert_eq!(
            window_out(&[112, 112], &[3, 3], &a, false).unwrap(),
            vec![56, 56]
        );
    }

    #[test]
    fn ceil_mode_and_same() {
        let a = attrs(&[("strides", Attr::Ints(vec![2]))]);
        assert_eq!(window_out(&[5], &[2], &a, false).unwrap(), vec![2]);
        assert_eq!(window_out(&[5], &[2], &a, true).unwrap(), vec![3]);
        let a = attrs(&[
            ("strides", Attr::Ints(vec![2])),
            ("auto_pad", Attr::String("SAME_UPPER".into())),
        ]);
        assert_eq!(window_out(&[5], &[3], &a, false).unwrap(), vec![3]);
    }

    #[test]
    fn window_too_large_is_an_error() {
        assert!(window_out(&[2], &[3], &Attrs::default(), false).is_err());
    }
}
