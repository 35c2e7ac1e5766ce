//! Reductions along axes (ReduceSum, ReduceMean, ...), ArgMax/ArgMin, TopK, CumSum.

use super::{
    axis, dim, no_backward_kernel, no_gradient, no_kernel, nothing_saved_backward, Arity, Autocast,
    Backward, BackwardCx, CudaKernels, Cx, Fact, KernelCx, Launch, Op, Registry, RuleResult, Saved,
    Storage,
};
use crate::ir::value::MAX_FOLD_ELEMS;
use crate::ir::{Attrs, DType, Data, Value};
use crate::numeric::broadcast::for_each;
use crate::numeric::Tensor;

/// Output shape and, per input element, whether each axis is reduced.
fn reduced_shape(shape: &[usize], axes: &[usize], keep: bool) -> Vec<usize> {
    let mut out = Vec::with_capacity(shape.len());
    for (i, &d) in shape.iter().enumerate() {
        if axes.contains(&i) {
            if keep {
                out.push(1);
            }
        } else {
            out.push(d);
        }
    }
    out
}

/// Folding of a reduction: the initial accumulator and the combining function.
type Fold = (f64, fn(f64, f64) -> f64);

/// `Reduce*(data, axes?)`: axes from the attribute (older opsets) or input 1
/// (ReduceSum from opset 13, the others from 18); empty axes reduce all unless
/// `noop_with_empty_axes`. FLOPs: `flops_per_elem` per input element.
struct Reduce {
    kind: ReduceKind,
    axes_input_from: i64,
    flops_per_elem: u64,
    fold: Option<Fold>,
    autocast: Autocast,
}

/// Which reduction a [`Reduce`] is (given at registration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReduceKind {
    Sum,
    Mean,
    Max,
    Min,
    Prod,
    L1,
    L2,
    SumSquare,
    LogSum,
    LogSumExp,
}

impl ReduceKind {
    /// The ONNX op type.
    fn name(self) -> &'static str {
        match self {
            ReduceKind::Sum => "ReduceSum",
            ReduceKind::Mean => "ReduceMean",
            ReduceKind::Max => "ReduceMax",
            ReduceKind::Min => "ReduceMin",
            ReduceKind::Prod => "ReduceProd",
            ReduceKind::L1 => "ReduceL1",
            ReduceKind::L2 => "ReduceL2",
            ReduceKind::SumSquare => "ReduceSumSquare",
            ReduceKind::LogSum => "ReduceLogSum",
            ReduceKind::LogSumExp => "ReduceLogSumExp",
        }
    }
}

/// A reduction's attributes.
struct ReduceAttrs {
    /// `axes` (the attribute of older opsets).
    axes: Option<Vec<i64>>,
    /// `keepdims` (default 1).
    keepdims: bool,
    /// `noop_with_empty_axes` (default 0).
    noop_with_empty_axes: bool,
}

impl ReduceAttrs {
    fn of(attrs: &Attrs) -> ReduceAttrs {
        ReduceAttrs {
            axes: attrs.ints("axes").map(<[i64]>::to_vec),
            keepdims: attrs.int_or("keepdims", 1) != 0,
            noop_with_empty_axes: attrs.int_or("noop_with_empty_axes", 0) != 0,
        }
    }

    /// The reduced axes, from `raw` (input 1 or the attribute).
    fn resolve(&self, raw: Option<Vec<i64>>, rank: usize) -> RuleResult<Vec<usize>> {
        match raw {
            Some(a) if !a.is_empty() => a.iter().map(|&x| axis(x, rank)).collect(),
            _ if self.noop_with_empty_axes => Ok(Vec::new()),
            _ => Ok((0..rank).collect()),
        }
    }
}

impl Reduce {
    fn axes(&self, cx: &Cx, at: &ReduceAttrs, rank: usize) -> RuleResult<Vec<usize>> {
        let raw = if cx.opset >= self.axes_input_from {
            cx.opt_ints(1)?
        } else {
            at.axes.clone()
        };
        at.resolve(raw, rank)
    }
}

impl Op for Reduce {
    fn arity(&self) -> Arity {
        Arity::new(1, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let at = ReduceAttrs::of(cx.attrs());
        let axes = self.axes(cx, &at, x.rank())?;
        let shape = reduced_shape(&x.shape, &axes, at.keepdims);
        let value = match (&x.value, self.fold) {
            (Some(v), Some((init, f))) => {
                let n_out: usize = shape.iter().product();
                let mut acc = vec![init; n_out];
                let rank = x.rank();
                let mut coord = vec![0usize; rank];
                for i in 0..v.data.len() {
                    let mut o = 0;
                    for (a, &c) in coord.iter().enumerate() {
                        if !axes.contains(&a) {
                            o = o * x.shape[a] + c;
                        }
                    }
                    acc[o] = f(acc[o], v.data.float(i));
                    for a in (0..rank).rev() {
                        coord[a] += 1;
                        if coord[a] < x.shape[a] {
                            break;
                        }
                        coord[a] = 0;
                    }
                }
                if self.kind == ReduceKind::Mean {
                    let count: usize = axes.iter().map(|&a| x.shape[a]).product();
                    acc.iter_mut().for_each(|a| *a /= count.max(1) as f64);
                }
                let data = if x.dtype.is_float() {
                    Data::Float(acc)
                } else {
                    Data::Int(acc.into_iter().map(|a| a as i64).collect())
                };
                Some(Value {
                    shape: shape.clone(),
                    data,
                })
            }
            _ => None,
        };
        Ok(vec![Fact {
            dtype: x.dtype,
            shape,
            value: value.map(Box::new),
        }])
    }
    fn flops(&self, cx: &Cx, _out: &[Fact]) -> u64 {
        self.flops_per_elem
            .saturating_mul(cx.inputs[0].map_or(0, Fact::numel))
    }
    /// Sum and mean need only shapes; max/min/prod/L2/log-sum-exp save input and
    /// output, L1 and sum-of-squares the input. Backward FLOPs: 2 per input element.
    fn backward(&self, cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        let x = cx.input(0)?;
        if !x.dtype.is_float() {
            return Ok(None);
        }
        let needs: &[Saved] = match self.kind {
            ReduceKind::Sum | ReduceKind::Mean => &[],
            ReduceKind::L1 | ReduceKind::SumSquare => &[Saved::Input(0)],
            ReduceKind::LogSum => &[Saved::Output(0)],
            _ => &[Saved::Input(0), Saved::Output(0)],
        };
        Ok(Some(Backward::each(
            &[0],
            needs,
            x.numel().saturating_mul(2),
        )))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// Floats accumulated in f64 (LogSumExp shifted by the maximum); integers in
    /// i64 for Sum, Mean (truncating), Max, Min and Prod.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let r = x.rank();
        let at = ReduceAttrs::of(cx.attrs());
        let raw = if cx.opset >= self.axes_input_from {
            cx.opt(1).map(Tensor::to_i64s)
        } else {
            at.axes.clone()
        };
        let axes = at.resolve(raw, r)?;
        let out = cx.out(0)?.shape.clone();
        let kept = reduced_shape(&x.shape, &axes, true);
        let n_out: usize = kept.iter().product();
        let count: usize = axes.iter().map(|&a| x.shape[a]).product();
        let op = self.kind;
        if !x.dtype().is_float() {
            let (init, f): (i64, fn(i64, i64) -> i64) = match op {
                ReduceKind::Sum | ReduceKind::Mean => (0, i64::wrapping_add),
                ReduceKind::Max => (i64::MIN, i64::max),
                ReduceKind::Min => (i64::MAX, i64::min),
                ReduceKind::Prod => (1, i64::wrapping_mul),
                other => {
                    return Err(
                        format!("{} on {} is not supported", other.name(), x.dtype()).into(),
                    )
                }
            };
            let xs = x.to_i64s();
            let mut acc = vec![init; n_out];
            for_each(&x.shape, [&kept[..]], |i, [o]| acc[o] = f(acc[o], xs[i]));
            if op == ReduceKind::Mean {
                acc.iter_mut().for_each(|v| *v /= count.max(1) as i64);
            }
            return Ok(vec![Tensor::from_i64(x.dtype(), out, acc)?]);
        }
        let xs = x.to_f32()?;
        let fold = |init: f64, f: &dyn Fn(f64, f64) -> f64| {
            let mut acc = vec![init; n_out];
            for_each(&x.shape, [&kept[..]], |i, [o]| {
                acc[o] = f(acc[o], xs[i] as f64)
            });
            acc
        };
        let acc: Vec<f64> = match op {
            ReduceKind::Sum => fold(0.0, &|a, v| a + v),
            ReduceKind::Mean => fold(0.0, &|a, v| a + v)
                .into_iter()
                .map(|s| s / count as f64)
                .collect(),
            ReduceKind::Max => fold(f64::NEG_INFINITY, &f64::max),
            ReduceKind::Min => fold(f64::INFINITY, &f64::min),
            ReduceKind::Prod => fold(1.0, &|a, v| a * v),
            ReduceKind::L1 => fold(0.0, &|a, v| a + v.abs()),
            ReduceKind::L2 => fold(0.0, &|a, v| a + v * v)
                .into_iter()
                .map(f64::sqrt)
                .collect(),
            ReduceKind::SumSquare => fold(0.0, &|a, v| a + v * v),
            ReduceKind::LogSum => fold(0.0, &|a, v| a + v).into_iter().map(f64::ln).collect(),
            ReduceKind::LogSumExp => {
                let max = fold(f64::NEG_INFINITY, &f64::max);
                let mut sum = vec![0f64; n_out];
                for_each(&x.shape, [&kept[..]], |i, [o]| {
                    sum[o] += (xs[i] as f64 - max[o]).exp()
                });
                sum.iter().zip(&max).map(|(s, m)| s.ln() + m).collect()
            }
        };
        let v = acc.into_iter().map(|a| a as f32).collect();
        Ok(vec![Tensor::from_f32(x.dtype(), out, v)?])
    }
    /// `dx_i = g_o · ∂y_o/∂x_i` for the output element `o` that input element `i`
    /// reduces into: Sum 1, Mean 1/count (nothing saved); SumSquare 2x, L1 sign(x)
    /// (input); LogSum `e^(−y)` (output); L2 `x/y`, LogSumExp `e^(x−y)`, Prod `y/x`,
    /// Max/Min `[x = y]/ties` (PyTorch's amax/amin spread the gradient evenly over
    /// ties) (input and output). Axes are constants (folded facts or attributes).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let f = cx.input(0)?;
        if !f.dtype.is_float() {
            return no_gradient(cx);
        }
        let axes = self.axes(&cx.rule_cx(), &ReduceAttrs::of(cx.attrs()), f.rank())?;
        let kept = reduced_shape(&f.shape, &axes, true);
        let count: usize = axes.iter().map(|&a| f.shape[a]).product();
        let g = cx.grad(0)?;
        let op = self.kind;
        let input =
            || -> RuleResult<Vec<f32>> { Ok(cx.saved(Saved::Input(0))?.to_f32()?.into_owned()) };
        let output =
            || -> RuleResult<Vec<f32>> { Ok(cx.saved(Saved::Output(0))?.to_f32()?.into_owned()) };
        let n: usize = f.shape.iter().product();
        let mut dx = Vec::with_capacity(n);
        match op {
            ReduceKind::Sum | ReduceKind::Mean => {
                let k = if op == ReduceKind::Mean {
                    1.0 / count.max(1) as f32
                } else {
                    1.0
                };
                for_each(&f.shape, [&kept[..]], |_, [o]| dx.push(g[o] * k));
            }
            ReduceKind::SumSquare | ReduceKind::L1 => {
                let x = input()?;
                let sq = op == ReduceKind::SumSquare;
                for_each(&f.shape, [&kept[..]], |i, [o]| {
                    let d = if sq {
                        2.0 * x[i]
                    } else if x[i] == 0.0 {
                        0.0
                    } else {
                        x[i].signum()
                    };
                    dx.push(g[o] * d)
                });
            }
            ReduceKind::LogSum => {
                let y = output()?;
                for_each(&f.shape, [&kept[..]], |_, [o]| {
                    dx.push(g[o] * (-y[o]).exp())
                });
            }
            ReduceKind::L2 | ReduceKind::LogSumExp | ReduceKind::Prod => {
                let (x, y) = (input()?, output()?);
                for_each(&f.shape, [&kept[..]], |i, [o]| {
                    let d = match op {
                        ReduceKind::L2 if y[o] == 0.0 => 0.0,
                        ReduceKind::L2 => x[i] / y[o],
                        ReduceKind::LogSumExp => (x[i] - y[o]).exp(),
                        _ => y[o] / x[i],
                    };
                    dx.push(g[o] * d)
                });
            }
            ReduceKind::Max | ReduceKind::Min => {
                let (x, y) = (input()?, output()?);
                let mut ties = vec![0usize; y.len()];
                for_each(&f.shape, [&kept[..]], |i, [o]| {
                    ties[o] += (x[i] == y[o]) as usize
                });
                for_each(&f.shape, [&kept[..]], |i, [o]| {
                    dx.push(if x[i] == y[o] {
                        g[o] / ties[o] as f32
                    } else {
                        0.0
                    })
                });
            }
        }
        cx.answer(vec![(0, dx)])
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        match self.kind {
            ReduceKind::Sum | ReduceKind::Mean => CudaKernels::new(
                Launch::Reduce,
                &["reduce_f32"],
                &["strided_copy_b4", "scale_f32"],
            ),
            ReduceKind::Max | ReduceKind::Min => {
                CudaKernels::new(Launch::Reduce, &["reduce_f32"], &[])
            }
            ReduceKind::Prod
            | ReduceKind::L1
            | ReduceKind::L2
            | ReduceKind::SumSquare
            | ReduceKind::LogSum
            | ReduceKind::LogSumExp => CudaKernels::HOST,
        }
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        self.autocast
    }
}

/// `ArgMax` / `ArgMin` along `axis`: int64. FLOPs: 1 compare per input element.
struct ArgReduce {
    /// ArgMax (else ArgMin).
    max: bool,
}

/// ArgMax/ArgMin's attributes.
struct ArgAttrs {
    axis: i64,
    keepdims: bool,
    select_last_index: bool,
}

impl ArgAttrs {
    fn of(attrs: &Attrs) -> ArgAttrs {
        ArgAttrs {
            axis: attrs.int_or("axis", 0),
            keepdims: attrs.int_or("keepdims", 1) != 0,
            select_last_index: attrs.int_or("select_last_index", 0) != 0,
        }
    }
}

impl Op for ArgReduce {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let at = ArgAttrs::of(cx.attrs());
        let a = axis(at.axis, x.rank())?;
        Ok(vec![Fact::new(
            DType::I64,
            reduced_shape(&x.shape, &[a], at.keepdims),
        )])
    }
    fn flops(&self, cx: &Cx, _out: &[Fact]) -> u64 {
        cx.inputs[0].map_or(0, Fact::numel)
    }
    /// Indices have no gradient.
    fn backward(&self, _cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(None)
    }
    /// Indices have no gradient.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        no_gradient(cx)
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// The first extreme along `axis` (the last with `select_last_index`).
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let at = ArgAttrs::of(cx.attrs());
        let a = axis(at.axis, x.rank())?;
        let (last, max) = (at.select_last_index, self.max);
        let xs = x.to_f64s();
        let outer: usize = x.shape[..a].iter().product();
        let n = x.shape[a];
        let inner: usize = x.shape[a + 1..].iter().product();
        let mut v = Vec::with_capacity(outer * inner);
        for o in 0..outer {
            for i in 0..inner {
                let mut best = 0;
                for k in 1..n {
                    let (c, b) = (xs[(o * n + k) * inner + i], xs[(o * n + best) * inner + i]);
                    let better = if max { c > b } else { c < b };
                    if better || (last && c == b) {
                        best = k;
                    }
                }
                v.push(best as i64);
            }
        }
        Ok(vec![Tensor::i64(cx.out(0)?.shape.clone(), v)])
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// `TopK(X, K) -> (values, indices)`; K must be a constant.
/// FLOPs: about log2(K)+1 compares per input element (heap selection).
struct TopK;

impl Op for TopK {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 2, 2)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let a = axis(cx.attrs().int_or("axis", -1), x.rank())?;
        let k = dim(cx.value(1)?.scalar_int().ok_or("K must be one value")?, "K")?;
        if k > x.shape[a] {
            return Err(format!("K = {k} exceeds axis size {}", x.shape[a]).into());
        }
        let mut shape = x.shape.clone();
        shape[a] = k;
        Ok(vec![
            Fact::new(x.dtype, shape.clone()),
            Fact::new(DType::I64, shape),
        ])
    }
    /// `floor(log2 K) + 1` compares per input element, K read along the axis.
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let rank = out[0].shape.len();
        let k = axis(cx.attrs().int_or("axis", -1), rank)
            .ok()
            .map_or(1, |a| out[0].shape[a].max(1)) as u64;
        (k.ilog2() as u64 + 1).saturating_mul(cx.inputs[0].map_or(0, Fact::numel))
    }
    /// TopkBackward scatters the gradient through the saved indices (output 1).
    fn backward(&self, cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        let n = cx.inputs[0].map_or(0, Fact::numel);
        Ok(Some(Backward::each(&[0], &[Saved::Output(1)], n)))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// No model in models/ uses it yet.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        no_kernel(cx)
    }
    /// No forward kernel yet, hence none backward.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        no_backward_kernel(cx)
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// The axis of a CumSum or CumProd backward: input 1, a constant (folded fact).
fn cumulative_axis(cx: &BackwardCx, rank: usize) -> RuleResult<usize> {
    let a = cx
        .input(1)?
        .value
        .as_ref()
        .and_then(|v| v.scalar_int())
        .ok_or("axis must be a constant")?;
    axis(a, rank)
}

/// CumSum/CumProd's axis (input 1) on the CPU.
fn kernel_axis(cx: &KernelCx, rank: usize) -> RuleResult<usize> {
    axis(
        *cx.input(1)?
            .to_i64s()
            .first()
            .ok_or("axis must be one value")?,
        rank,
    )
}

/// CumSum/CumProd's axis (input 1) when it is a constant, checked.
fn constant_axis(cx: &Cx, rank: usize) -> RuleResult<Option<usize>> {
    match &cx.input(1)?.value {
        Some(v) => Ok(Some(axis(
            v.scalar_int().ok_or("axis must be one value")?,
            rank,
        )?)),
        None => Ok(None),
    }
}

/// Running sums (f64) of `get(i)` along axis `a` of `shape` ([`scan_lines`]):
/// each element's sum holds it unless `excl`.
fn running_sums(
    shape: &[usize],
    a: usize,
    excl: bool,
    rev: bool,
    get: impl Fn(usize) -> f64,
) -> Vec<f64> {
    let n = shape[a];
    let mut y = vec![0f64; shape.iter().product()];
    scan_lines(shape, a, rev, |at| {
        let mut acc = 0f64;
        for k in 0..n {
            if excl {
                y[at(k)] = acc;
                acc += get(at(k));
            } else {
                acc += get(at(k));
                y[at(k)] = acc;
            }
        }
    });
    y
}

/// `CumSum(x, axis)`: same shape. FLOPs: 1 add per element.
struct CumSum;

/// CumSum/CumProd's attributes: `exclusive`, `reverse` (default 0).
struct CumAttrs {
    exclusive: bool,
    reverse: bool,
}

impl CumAttrs {
    fn of(attrs: &Attrs) -> CumAttrs {
        CumAttrs {
            exclusive: attrs.int_or("exclusive", 0) != 0,
            reverse: attrs.int_or("reverse", 0) != 0,
        }
    }
}

impl Op for CumSum {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    /// The shape is the input's whatever the axis; a constant axis is checked, and
    /// a 1-D integer constant folds.
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let a = constant_axis(cx, x.rank())?;
        let value = x
            .value
            .as_ref()
            .filter(|v| v.data.len() <= MAX_FOLD_ELEMS && x.rank() == 1 && a == Some(0))
            .map(|v| {
                let mut acc = 0i64;
                Value::ints(
                    v.shape.clone(),
                    (0..v.data.len())
                        .map(|i| {
                            acc += v.data.int(i);
                            acc
                        })
                        .collect(),
                )
            });
        let at = CumAttrs::of(cx.attrs());
        let value = value.filter(|_| !x.dtype.is_float() && !at.exclusive && !at.reverse);
        Ok(vec![Fact {
            dtype: x.dtype,
            shape: x.shape.clone(),
            value: value.map(Box::new),
        }])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel()
    }
    /// The gradient is a reversed cumulative sum: nothing saved.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        nothing_saved_backward(out)
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// Running sums along the axis (`exclusive`, `reverse`), f64 for floats.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let a = kernel_axis(cx, x.rank())?;
        let at = CumAttrs::of(cx.attrs());
        let xs = x.to_f64s();
        let y = running_sums(&x.shape, a, at.exclusive, at.reverse, |i| xs[i]);
        Ok(vec![Tensor::from_f64(x.dtype(), x.shape.clone(), y)?])
    }
    /// A cumulative sum of `g` the other way along the axis (same `exclusive`);
    /// the axis is a constant (folded fact).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let f = cx.input(0)?;
        if !f.dtype.is_float() {
            return no_gradient(cx);
        }
        let a = cumulative_axis(cx, f.rank())?;
        let at = CumAttrs::of(cx.attrs());
        let g = cx.grad(0)?;
        let dx = running_sums(&f.shape, a, at.exclusive, !at.reverse, |i| g[i] as f64);
        cx.answer(vec![(0, dx.into_iter().map(|v| v as f32).collect())])
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Full
    }
}

/// `CumProd(x, axis)` (opset 26): same shape, running products (`exclusive`,
/// `reverse`). FLOPs: 1 multiply per element.
struct CumProd;

/// One line of `n` elements of a cumulative op along an axis: `at(k)` is the flat
/// index of its `k`-th element in scan order.
fn scan_lines(shape: &[usize], a: usize, rev: bool, mut f: impl FnMut(&dyn Fn(usize) -> usize)) {
    let outer: usize = shape[..a].iter().product();
    let n = shape[a];
    let inner: usize = shape[a + 1..].iter().product();
    for o in 0..outer {
        for i in 0..inner {
            let at = |k: usize| {
                let k = if rev { n - 1 - k } else { k };
                (o * n + k) * inner + i
            };
            f(&at);
        }
    }
}

impl Op for CumProd {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    /// The shape is the input's whatever the axis; a constant axis is checked.
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        constant_axis(cx, x.rank())?;
        Ok(vec![Fact::new(x.dtype, x.shape.clone())])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel()
    }
    /// CumprodBackward saves the input and the result.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if !out[0].dtype.is_float() {
            return Ok(None);
        }
        let n = out[0].numel();
        Ok(Some(Backward::each(
            &[0],
            &[Saved::Input(0), Saved::Output(0)],
            n.saturating_mul(3),
        )))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// Running products along the axis, f64 for floats.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let a = kernel_axis(cx, x.rank())?;
        let CumAttrs {
            exclusive: excl,
            reverse: rev,
        } = CumAttrs::of(cx.attrs());
        let xs = x.to_f64s();
        let n = x.shape[a];
        let mut y = vec![0f64; xs.len()];
        scan_lines(&x.shape, a, rev, |at| {
            let mut acc = 1f64;
            for k in 0..n {
                if excl {
                    y[at(k)] = acc;
                    acc *= xs[at(k)];
                } else {
                    acc *= xs[at(k)];
                    y[at(k)] = acc;
                }
            }
        });
        if x.dtype().is_float() {
            Ok(vec![Tensor::from_f64(x.dtype(), x.shape.clone(), y)?])
        } else {
            let v = y.into_iter().map(|v| v as i64).collect();
            Ok(vec![Tensor::from_i64(x.dtype(), x.shape.clone(), v)?])
        }
    }
    /// `dx_k = Σ_p g_p · Π_{q ∈ S_p, q ≠ k} x_q` over the outputs `p` whose product
    /// `S_p` holds element `k`: exact with zeros in the input (O(n²) per line).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let f = cx.input(0)?;
        if !f.dtype.is_float() {
            return no_gradient(cx);
        }
        let a = cumulative_axis(cx, f.rank())?;
        let CumAttrs {
            exclusive: excl,
            reverse: rev,
        } = CumAttrs::of(cx.attrs());
        let xs = cx.saved(Saved::Input(0))?.to_f64s();
        let g = cx.grad(0)?;
        let n = f.shape[a];
        let mut dx = vec![0f32; g.len()];
        scan_lines(&f.shape, a, rev, |at| {
            let mut prefix = 1f64;
            for k in 0..n {
                // Outputs holding k: p ≥ k (inclusive) or p > k (exclusive).
                let mut run = prefix;
                let mut acc = 0f64;
                let first = if excl { k + 1 } else { k };
                for p in first..n {
                    if p > first {
                        run *= xs[at(p - usize::from(excl))];
                    }
                    acc += g[at(p)] as f64 * run;
                }
                dx[at(k)] = acc as f32;
                prefix *= xs[at(k)];
            }
        });
        cx.answer(vec![(0, dx)])
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    /// On autocast's fp32 list.
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Full
    }
}

/// Registers reductions.
pub fn register(r: &mut Registry) {
    // Autocast runs every sum-like reduction in float32, max and min in the input type.
    let red = |kind, from, flops, fold| Reduce {
        kind,
        axes_input_from: from,
        flops_per_elem: flops,
        fold,
        autocast: Autocast::Full,
    };
    let order = |kind, fold| Reduce {
        autocast: Autocast::Promote,
        ..red(kind, 18, 1, Some(fold))
    };
    use ReduceKind as K;
    r.add("ReduceSum", red(K::Sum, 13, 1, Some((0.0, |a, b| a + b))));
    r.add("ReduceMean", red(K::Mean, 18, 1, Some((0.0, |a, b| a + b))));
    r.add("ReduceMax", order(K::Max, (f64::NEG_INFINITY, f64::max)));
    r.add("ReduceMin", order(K::Min, (f64::INFINITY, f64::min)));
    r.add("ReduceProd", red(K::Prod, 18, 1, Some((1.0, |a, b| a * b))));
    // `torch.norm` / `linalg.vector_norm` take `dtype=float32` under autocast:
    // float32 from the input as it is, no copy of it.
    let norm = |kind| Reduce {
        autocast: Autocast::Widen,
        ..red(kind, 18, 2, None)
    };
    r.add("ReduceL1", norm(K::L1));
    r.add("ReduceL2", norm(K::L2));
    r.add("ReduceSumSquare", red(K::SumSquare, 18, 2, None));
    r.add("ReduceLogSum", red(K::LogSum, 18, 1, None));
    r.add("ReduceLogSumExp", red(K::LogSumExp, 18, 3, None));
    r.add("ArgMax", ArgReduce { max: true });
    r.add("ArgMin", ArgReduce { max: false });
    r.add("TopK", TopK);
    r.add("CumSum", CumSum);
    r.add("CumProd", CumProd);
}
