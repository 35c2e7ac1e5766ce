//! Variadic Max/Min/Sum/Mean, Where, Cast, Clip and Dropout.

#[allow(unused_imports)]
use super::*;

/// Max, Min, Sum, Mean over 1+ broadcast inputs. FLOPs: one per output element per
/// extra input (Mean adds one division per element).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Variadic {
    Max,
    Min,
    Sum,
    Mean,
}

impl Variadic {
    /// Whether it divides by the count (Mean).
    fn mean(self) -> bool {
        self == Variadic::Mean
    }

    /// Max or Min: the gradient goes to the selected input.
    fn selects(self) -> bool {
        matches!(self, Variadic::Max | Variadic::Min)
    }

    /// The fold that constant folding applies.
    fn fold(self) -> fn(f64, f64) -> f64 {
        match self {
            Variadic::Max => f64::max,
            Variadic::Min => f64::min,
            Variadic::Sum | Variadic::Mean => |a, b| a + b,
        }
    }
}

impl Op for Variadic {
    fn arity(&self) -> Arity {
        Arity::new(1, usize::MAX, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let ins = (0..cx.inputs.len())
            .map(|i| cx.input(i))
            .collect::<RuleResult<Vec<_>>>()?;
        let shapes: Vec<&[usize]> = ins.iter().map(|f| f.shape.as_slice()).collect();
        let shape = broadcast(&shapes)?;
        let vals: Option<Vec<&Value>> = ins.iter().map(|f| f.value.as_deref()).collect();
        let float = ins[0].dtype.is_float();
        let value = vals.filter(|_| !self.mean()).and_then(|vals| {
            let f = self.fold();
            fold_broadcast(&vals, &shape, |i| {
                let mut acc = vals[0].data.float(i[0]);
                for (k, v) in vals.iter().enumerate().skip(1) {
                    acc = f(acc, v.data.float(i[k]));
                }
                Some(if float {
                    FoldElem::F(acc)
                } else {
                    FoldElem::I(acc as i64)
                })
            })
            .map(|data| Value {
                shape: shape.clone(),
                data,
            })
        });
        Ok(vec![Fact {
            dtype: ins[0].dtype,
            shape,
            value: value.map(Box::new),
        }])
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let extra = cx.inputs.len().saturating_sub(1) as u64 + self.mean() as u64;
        extra.saturating_mul(out[0].numel())
    }
    /// Sum/Mean save nothing; Max/Min save their inputs (the gradient goes to the
    /// selected one). Backward FLOPs: 1 per element per input.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let n = cx.inputs.len();
        let needs: Vec<Saved> = if self.selects() {
            (0..n).map(Saved::Input).collect()
        } else {
            Vec::new()
        };
        let inputs: Vec<usize> = (0..n).collect();
        Ok(Some(Backward::each(
            &inputs,
            &needs,
            out[0].numel().saturating_mul(n as u64),
        )))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        variadic_kernel(cx, *self)
    }
    /// Sum/Mean: the gradient (divided by the count for Mean) summed back to each
    /// input's shape. Max/Min: to the input the forward's left fold selected.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        variadic_backward(cx, *self)
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// `Where(cond, x, y)`: broadcast of three. FLOPs: 1 select per output element.
pub(super) struct Where;

impl Op for Where {
    fn arity(&self) -> Arity {
        Arity::new(3, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (c, x, y) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
        if x.dtype != y.dtype {
            return Err(format!("X is {} but Y is {}", x.dtype, y.dtype).into());
        }
        let shape = broadcast(&[&c.shape, &x.shape, &y.shape])?;
        let value = match (&c.value, &x.value, &y.value) {
            (Some(vc), Some(vx), Some(vy)) => {
                let float = x.dtype.is_float();
                fold_broadcast(&[vc, vx, vy], &shape, |i| {
                    let pick = if vc.data.int(i[0]) != 0 {
                        (vx, i[1])
                    } else {
                        (vy, i[2])
                    };
                    Some(if float {
                        FoldElem::F(pick.0.data.float(pick.1))
                    } else {
                        FoldElem::I(pick.0.data.int(pick.1))
                    })
                })
                .map(|data| Value {
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
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel()
    }
    /// Both branches' gradients are masked by the saved condition.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(Some(Backward::each(
            &[1, 2],
            &[Saved::Input(0)],
            out[0].numel().saturating_mul(2),
        )))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    elementwise_layout!();
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        where_kernel(cx)
    }
    /// `g` where the saved condition picks the branch, 0 elsewhere, summed back to
    /// each branch's shape.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let out = cx.output(0)?.shape.clone();
        let c = cx.saved(Saved::Input(0))?;
        let cond: Vec<bool> = match &c.elems {
            Elems::Bool(b) => b.clone(),
            _ => c.to_i64s().iter().map(|&v| v != 0).collect(),
        };
        let g = cx.grad(0)?;
        let mut res = Vec::new();
        for (slot, take) in [(1, true), (2, false)] {
            if !cx.wants(slot) {
                continue;
            }
            let masked = zip2(&out, (&g, &out), (&cond, &c.shape), |g, c| {
                if c == take {
                    g
                } else {
                    0.0
                }
            });
            res.push((slot, sum_to(&masked, &out, &cx.input(slot)?.shape)));
        }
        cx.answer(res)
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(
            Launch::Where,
            &["where_f32"],
            &["where_bwd_f32", "reduce_f32"],
        )
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// `Cast` (attribute `to`) and `CastLike` (type of input 1). Data movement: 0 FLOPs.
pub(super) struct Cast {
    pub(super) like: bool,
}

/// Cast's attributes.
struct CastAttrs {
    /// `to` (required by Cast).
    to: Option<i64>,
}

impl CastAttrs {
    fn of(attrs: &crate::ir::Attrs) -> CastAttrs {
        CastAttrs {
            to: attrs.int("to"),
        }
    }
}

impl Op for Cast {
    fn arity(&self) -> Arity {
        if self.like {
            Arity::new(2, 2, 1, 1)
        } else {
            Arity::new(1, 1, 1, 1)
        }
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let to = if self.like {
            cx.input(1)?.dtype
        } else {
            dtype_attr(
                CastAttrs::of(cx.attrs())
                    .to
                    .ok_or("missing attribute 'to'")?,
            )?
        };
        let value = x.value.as_ref().map(|v| {
            let n = v.data.len();
            let data = if to.is_float() {
                Data::Float((0..n).map(|i| v.data.float(i)).collect())
            } else if to == DType::Bool {
                Data::Int((0..n).map(|i| (v.data.float(i) != 0.0) as i64).collect())
            } else {
                Data::Int((0..n).map(|i| v.data.int(i)).collect())
            };
            Value {
                shape: v.shape.clone(),
                data,
            }
        });
        Ok(vec![Fact {
            dtype: to,
            shape: x.shape.clone(),
            value: value.map(Box::new),
        }])
    }
    fn flops(&self, _cx: &Cx, _out: &[Fact]) -> u64 {
        0
    }
    /// Float-to-float casts pass the gradient back (cast again), saving nothing; casts
    /// to or from integers have no gradient.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let from_float = cx.inputs[0].is_some_and(|f| f.dtype.is_float());
        if !(from_float && out[0].dtype.is_float()) {
            return Ok(None);
        }
        Ok(Some(Backward::each(&[0], &[], out[0].numel())))
    }
    /// A cast to the same type is the input itself; otherwise a new tensor.
    fn storage(&self, cx: &Cx) -> Storage {
        let to = CastAttrs::of(cx.attrs())
            .to
            .and_then(|c| dtype_attr(c).ok());
        match (cx.inputs[0], to) {
            (Some(x), Some(t)) if !self.like && x.dtype == t => Storage::View,
            _ => Storage::New,
        }
    }
    elementwise_layout!();
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        Ok(vec![cx.input(0)?.cast(cx.out(0)?.dtype)?])
    }
    /// The gradient cast back to the input's type.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let (x, y) = (cx.input(0)?, cx.output(0)?);
        if !(x.dtype.is_float() && y.dtype.is_float()) {
            return no_gradient(cx);
        }
        cx.answer(vec![(0, cx.grad(0)?.into_owned())])
    }
    /// Device kernels (exec::cuda::ops; float32, int64, int32, bool); the
    /// float32 gradient is copied back.
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(Launch::Cast, &["cast_any"], &["strided_copy_b4"])
    }
    /// `Cast` writes the type it names (under autocast, `.float()` of a half tensor
    /// is a float32 copy: OLMo2's RMSNorm on a projection's output); `CastLike`
    /// follows its input.
    fn autocast(&self, _op_type: &str) -> Autocast {
        if self.like {
            Autocast::Promote
        } else {
            Autocast::AsWritten
        }
    }
}

/// `Clip(x, min?, max?)` (opset 11+ inputs; older `min`/`max` attributes).
/// FLOPs: 2 comparisons per element.
pub(super) struct Clip;

/// Clip's attributes (before opset 11; inputs since).
struct ClipAttrs {
    /// `min` (default: none).
    min: Option<f32>,
    /// `max` (default: none).
    max: Option<f32>,
}

impl ClipAttrs {
    fn of(attrs: &crate::ir::Attrs) -> ClipAttrs {
        ClipAttrs {
            min: attrs.float("min"),
            max: attrs.float("max"),
        }
    }
}

impl Op for Clip {
    fn arity(&self) -> Arity {
        Arity::new(1, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        Ok(vec![Fact::new(x.dtype, x.shape.clone())])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel().saturating_mul(2)
    }
    /// clamp/hardtanh save their input to mask the gradient.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(Some(Backward::each(
            &[0],
            &[Saved::Input(0)],
            out[0].numel().saturating_mul(2),
        )))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    elementwise_layout!();
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        clip_kernel(cx)
    }
    /// `g` where `min ≤ x ≤ max` (PyTorch's clamp backward), 0 elsewhere. The
    /// bounds are constants (folded facts or attributes): the rule saves only `x`.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let at = ClipAttrs::of(cx.attrs());
        let bound = |i: usize, attr: Option<f32>| -> RuleResult<Option<f32>> {
            if cx.opset >= 11 {
                match cx.inputs.get(i).copied().flatten() {
                    None => Ok(None),
                    Some(f) => Ok(f
                        .value
                        .as_ref()
                        .and_then(|v| v.scalar_float())
                        .map(|v| Some(v as f32))
                        .ok_or_else(|| {
                            format!("bound {i} is not a constant, and the rule saves only x")
                        })?),
                }
            } else {
                Ok(attr)
            }
        };
        let lo = bound(1, at.min)?.unwrap_or(f32::NEG_INFINITY);
        let hi = bound(2, at.max)?.unwrap_or(f32::INFINITY);
        let x = cx.saved(Saved::Input(0))?.to_f32()?;
        let g = cx.grad(0)?;
        let v = x
            .iter()
            .zip(g.iter())
            .map(|(&x, &g)| if x >= lo && x <= hi { g } else { 0.0 })
            .collect();
        cx.answer(vec![(0, v)])
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(Launch::Clip, &["clip_fwd_f32"], &["clip_bwd_f32"])
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// `Dropout(x, ratio?, training_mode?) -> (y, mask?)`. The mask is bool, same shape.
/// Training mode comes from the `training_mode` input (opset 12+) when it is a known
/// constant. FLOPs: training 2 per element (draw/compare and scale), inference 0.
pub(crate) struct Dropout;

/// Dropout's attributes (before opset 12; inputs since).
struct DropoutAttrs {
    /// `is_test` (default 0).
    is_test: bool,
    /// `ratio` (default 0.5).
    ratio: f64,
}

impl DropoutAttrs {
    fn of(attrs: &crate::ir::Attrs) -> DropoutAttrs {
        DropoutAttrs {
            is_test: attrs.int_or("is_test", 0) != 0,
            ratio: attrs.float("ratio").map_or(0.5, f64::from),
        }
    }
}

impl Dropout {
    /// Whether this Dropout drops (training mode).
    pub(crate) fn training(cx: &Cx) -> bool {
        if cx.opset >= 12 {
            cx.opt(2)
                .and_then(|f| f.value.as_ref())
                .and_then(|v| v.scalar_int())
                .is_some_and(|t| t != 0)
        } else {
            !DropoutAttrs::of(cx.attrs()).is_test
        }
    }

    /// The drop ratio (default 0.5), when known.
    pub(crate) fn ratio(cx: &Cx) -> f64 {
        if cx.opset >= 12 {
            cx.opt(1)
                .and_then(|f| f.value.as_ref())
                .and_then(|v| v.scalar_float())
                .unwrap_or(0.5)
        } else {
            DropoutAttrs::of(cx.attrs()).ratio
        }
    }

    /// True when it changes nothing: inference mode or ratio 0 (PyTorch returns the
    /// input itself).
    pub(crate) fn is_identity(cx: &Cx) -> bool {
        !Self::training(cx) || Self::ratio(cx) == 0.0
    }
}

impl Op for Dropout {
    fn arity(&self) -> Arity {
        Arity::new(1, 3, 1, 2)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let mut out = vec![Fact::new(x.dtype, x.shape.clone())];
        if cx.n_outputs() > 1 {
            out.push(Fact::new(DType::Bool, x.shape.clone()));
        }
        Ok(out)
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        if Self::training(cx) {
            out[0].numel().saturating_mul(2)
        } else {
            0
        }
    }
    /// Training: the gradient is masked by a 1-byte mask per element (CUDA's
    /// native_dropout saves a bool mask). Identity dropout saves nothing.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if Self::is_identity(cx) {
            return Ok(Some(Backward::each(&[0], &[], 0)));
        }
        Ok(Some(Backward {
            grads: vec![Grad {
                input: 0,
                needs: vec![Saved::Extra(0)],
            }],
            extras: vec![Fact::new(DType::Bool, out[0].shape.clone())],
            flops: out[0].numel().saturating_mul(2),
        }))
    }
    fn storage(&self, cx: &Cx) -> Storage {
        if Self::is_identity(cx) {
            Storage::View
        } else {
            Storage::New
        }
    }
    /// Training mode (read from the runtime `training_mode` input) with
    /// [`KernelCx::dropout`] set: keep each element with probability `1 - ratio`
    /// (mask from the node's SplitMix64 stream) and scale kept ones by `1/(1-ratio)`.
    /// Otherwise the identity with an all-true mask.
    /// With [`KernelCx::extras`] and the rule saving a mask (training mode), the
    /// mask follows the declared outputs.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let mut outs = dropout_kernel(cx)?;
        let mask = outs.pop().expect("y and mask");
        if cx.n_outputs() > 1 {
            outs.push(mask.clone());
        }
        if cx.extras && dropout_training(cx)?.0 {
            outs.push(mask);
        }
        Ok(outs)
    }
    /// Identity dropout: `g`. Training: `g · mask / (1 − ratio)` from the saved mask
    /// (`g` itself when the run's [`BackwardCx::dropout`] is off, as the forward was).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let rcx = cx.rule_cx();
        let g = cx.grad(0)?;
        if Self::is_identity(&rcx) || !cx.dropout {
            return cx.answer(vec![(0, g.into_owned())]);
        }
        let ratio = Self::ratio(&rcx);
        let mask = match &cx.saved(Saved::Extra(0))?.elems {
            Elems::Bool(m) => m,
            e => return Err(format!("the mask is {}, expected bool", e.dtype()).into()),
        };
        let scale = if ratio < 1.0 {
            (1.0 / (1.0 - ratio)) as f32
        } else {
            0.0
        };
        let v = g
            .iter()
            .zip(mask)
            .map(|(&g, &k)| if k { g * scale } else { 0.0 })
            .collect();
        cx.answer(vec![(0, v)])
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(
            Launch::Dropout,
            &["dropout_fwd_f32", "strided_copy_b1", "strided_copy_b4"],
            &["dropout_bwd_f32", "strided_copy_b4"],
        )
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// Max/Min/Sum/Mean over broadcast inputs, folded left to right.
pub(super) fn variadic_kernel(cx: &KernelCx, op: Variadic) -> RuleResult<Vec<Tensor>> {
    let mean = op.mean();
    let first = cx.input(0)?;
    let dtype = first.dtype();
    let out = cx.out(0)?.shape.clone();
    let n = cx.inputs.len();
    if dtype.is_float() {
        let f: fn(f32, f32) -> f32 = match op {
            Variadic::Max => |x: f32, y: f32| if x.is_nan() || x >= y { x } else { y },
            Variadic::Min => |x: f32, y: f32| if x.is_nan() || x <= y { x } else { y },
            Variadic::Sum | Variadic::Mean => |x, y| x + y,
        };
        let (mut acc, mut shape) = (first.to_f32()?.into_owned(), first.shape.clone());
        for i in 1..n {
            let t = cx.input(i)?;
            let s = broadcast(&[&shape, &t.shape])?;
            acc = zip2(&s, (&acc, &shape), (&t.to_f32()?, &t.shape), f);
            shape = s;
        }
        if shape != out {
            acc = zip2(&out, (&acc, &shape), (&[0.0f32][..], &[]), |x, _| x);
        }
        if mean {
            let k = n as f32;
            acc.iter_mut().for_each(|v| *v /= k);
        }
        return Ok(vec![Tensor::from_f32(dtype, out, acc)?]);
    }
    let f: fn(i64, i64) -> i64 = match op {
        Variadic::Max => i64::max,
        Variadic::Min => i64::min,
        Variadic::Sum | Variadic::Mean => i64::wrapping_add,
    };
    let (mut acc, mut shape) = (first.to_i64s(), first.shape.clone());
    for i in 1..n {
        let t = cx.input(i)?;
        let s = broadcast(&[&shape, &t.shape])?;
        acc = zip2(&s, (&acc, &shape), (&t.to_i64s(), &t.shape), f);
        shape = s;
    }
    if shape != out {
        acc = zip2(&out, (&acc, &shape), (&[0i64][..], &[]), |x, _| x);
    }
    if mean {
        acc.iter_mut().for_each(|v| *v /= n as i64);
    }
    Ok(vec![Tensor::from_i64(dtype, out, acc)?])
}

/// `Where(c, x, y)` on any element type.
pub(super) fn where_kernel(cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
    let (c, x, y) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
    let out = cx.out(0)?.shape.clone();
    let cond: Vec<bool> = match &c.elems {
        Elems::Bool(b) => b.clone(),
        _ => c.to_i64s().iter().map(|&v| v != 0).collect(),
    };
    let mut picks = Vec::with_capacity(out.iter().product());
    for_each(&out, [&c.shape[..], &x.shape, &y.shape], |_, [i, j, k]| {
        picks.push((cond[i], j, k));
    });
    macro_rules! pick {
        ($($var:ident),*) => {
            match (&x.elems, &y.elems) {
                $((Elems::$var(a), Elems::$var(b)) => Elems::$var(
                    picks.iter().map(|&(c, j, k)| if c { a[j] } else { b[k] }).collect(),
                ),)*
                _ => return Err(format!("X is {} but Y is {}", x.dtype(), y.dtype()).into()),
            }
        };
    }
    let elems = pick!(F32, F16, BF16, I64, I32, Bool);
    Ok(vec![Tensor::new(out, elems)])
}

/// `Clip(x, min?, max?)`: bounds from inputs (opset 11+) or attributes.
pub(super) fn clip_kernel(cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
    let x = cx.input(0)?;
    let at = ClipAttrs::of(cx.attrs());
    let bound = |i: usize, attr: Option<f32>| -> RuleResult<Option<f64>> {
        if cx.opset >= 11 {
            match cx.opt(i) {
                None => Ok(None),
                Some(t) if t.numel() == 1 => Ok(Some(t.to_f64s()[0])),
                Some(t) => Err(format!("input {i} must be a scalar, got {:?}", t.shape).into()),
            }
        } else {
            Ok(attr.map(f64::from))
        }
    };
    let (lo, hi) = (bound(1, at.min)?, bound(2, at.max)?);
    if x.dtype().is_float() {
        let (lo, hi) = (
            lo.map_or(f32::NEG_INFINITY, |v| v as f32),
            hi.map_or(f32::INFINITY, |v| v as f32),
        );
        let v = map_f32(&x.to_f32()?, move |v| v.max(lo).min(hi));
        return Ok(vec![Tensor::from_f32(x.dtype(), x.shape.clone(), v)?]);
    }
    let (lo, hi) = (
        lo.map_or(i64::MIN, |v| v as i64),
        hi.map_or(i64::MAX, |v| v as i64),
    );
    let v = x.to_i64s().into_iter().map(|v| v.max(lo).min(hi)).collect();
    Ok(vec![Tensor::from_i64(x.dtype(), x.shape.clone(), v)?])
}

/// Whether a Dropout runs in training mode with a non-zero ratio (it then saves a
/// mask for backward), and the ratio, from the runtime inputs.
pub(super) fn dropout_training(cx: &KernelCx) -> RuleResult<(bool, f64)> {
    let (training, ratio) = if cx.opset >= 12 {
        let t = cx
            .opt(2)
            .is_some_and(|t| t.to_i64s().first().is_some_and(|&v| v != 0));
        let r = cx
            .opt(1)
            .map_or(0.5, |t| t.to_f64s().first().copied().unwrap_or(0.5));
        (t, r)
    } else {
        let at = DropoutAttrs::of(cx.attrs());
        (!at.is_test, at.ratio)
    };
    if !(0.0..=1.0).contains(&ratio) {
        return Err(format!("ratio {ratio} is outside [0, 1]").into());
    }
    Ok((training && ratio != 0.0, ratio))
}

/// Dropout; see [`Dropout`]'s `forward_cpu`. Gives `[y, mask]` whatever the
/// declared outputs.
pub(super) fn dropout_kernel(cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
    let x = cx.input(0)?;
    let (training, ratio) = dropout_training(cx)?;
    let n = x.numel();
    let shape = x.shape.clone();
    if !training || !cx.dropout {
        return Ok(vec![x.clone(), Tensor::bool(shape, vec![true; n])]);
    }
    let seed = cx.seed;
    let keep: Vec<bool> = (0..n as u64)
        .into_par_iter()
        .map(|i| rng::unit_f32(seed, i) as f64 >= ratio)
        .collect();
    let scale = if ratio < 1.0 {
        (1.0 / (1.0 - ratio)) as f32
    } else {
        0.0
    };
    let xs = x.to_f32()?;
    let y: Vec<f32> = xs
        .iter()
        .zip(&keep)
        .map(|(&v, &k)| if k { v * scale } else { 0.0 })
        .collect();
    Ok(vec![
        Tensor::from_f32(x.dtype(), shape.clone(), y)?,
        Tensor::bool(shape, keep),
    ])
}

/// Sum/Mean/Max/Min backward; see [`Variadic`]'s `backward_cpu`.
pub(super) fn variadic_backward(cx: &BackwardCx, op: Variadic) -> RuleResult<Vec<Option<Tensor>>> {
    let out = cx.output(0)?.shape.clone();
    let n = cx.node.inputs.len();
    let g = cx.grad(0)?;
    let mut res = Vec::new();
    if op.selects() {
        // The winner of the forward's left fold at every output element.
        let ins = (0..n)
            .map(|i| {
                let t = cx.saved(Saved::Input(i))?;
                Ok((t.to_f32()?.into_owned(), t.shape.clone()))
            })
            .collect::<RuleResult<Vec<_>>>()?;
        let max = op == Variadic::Max;
        let mut win = vec![0usize; g.len()];
        let strides: Vec<Vec<usize>> = ins
            .iter()
            .map(|(_, s)| crate::numeric::broadcast::bcast_strides(s, &out))
            .collect();
        let ost = crate::numeric::broadcast::strides(&out);
        for (o, w) in win.iter_mut().enumerate() {
            let at = |k: usize| -> f32 {
                let off: usize = (0..out.len())
                    .map(|d| (o / ost[d]) % out[d] * strides[k][d])
                    .sum();
                ins[k].0[off]
            };
            let mut best = at(0);
            for k in 1..n {
                let v = at(k);
                let keep = if max {
                    best.is_nan() || best >= v
                } else {
                    best.is_nan() || best <= v
                };
                if !keep {
                    (best, *w) = (v, k);
                }
            }
        }
        for &i in &cx.wanted {
            let full: Vec<f32> = g
                .iter()
                .zip(&win)
                .map(|(&g, &w)| if w == i { g } else { 0.0 })
                .collect();
            res.push((i, sum_to(&full, &out, &cx.input(i)?.shape)));
        }
        return cx.answer(res);
    }
    let k = if op.mean() { 1.0 / n as f32 } else { 1.0 };
    let full: Vec<f32> = g.iter().map(|&v| v * k).collect();
    for &i in &cx.wanted {
        res.push((i, sum_to(&full, &out, &cx.input(i)?.shape)));
    }
    cx.answer(res)
}
