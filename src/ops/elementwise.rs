//! Element-wise ops: unary maps, broadcasting binary ops, comparisons, variadic
//! reductions over inputs (Max, Min, Sum, Mean), Where, Cast, Clip and Dropout.
//!
//! FLOPs: `flops_per_elem` × output elements, listed per op in [`register`]
//! (1 for arithmetic, comparisons and single transcendental functions; more for
//! composite activations, e.g. Gelu 8 for its erf/tanh polynomial).

use rayon::prelude::*;

use super::{
    broadcast, dtype_attr, no_backward_kernel, no_gradient, Arity, Backward, BackwardCx,
    CudaKernels, Cx, Fact, Grad, KernelCx, Op, Registry, RuleResult, Saved, Storage,
};
use crate::ir::value::MAX_FOLD_ELEMS;
use crate::ir::{Attrs, DType, Data, Value};
use crate::numeric::broadcast::{for_each, zip2};
use crate::numeric::grad::sum_to;
use crate::numeric::{rng, Elems, Tensor};

/// What a unary op's backward reads (PyTorch's saved tensor).
#[derive(Clone, Copy)]
enum Keeps {
    /// Gradient needs nothing saved (Neg, Identity; zero gradients of Floor, Sign...).
    Nothing,
    /// `self`: the derivative is a function of the input (Erf, Log, Abs, Gelu...).
    Input,
    /// `result`: the derivative is cheapest from the output (Relu, Sigmoid, Tanh, Exp...).
    Output,
    /// Not differentiable (boolean results).
    NonDiff,
}

/// A unary map `y = f(x)`, same shape; `bool_out` ops (IsNaN, Not...) yield bool.
struct Unary {
    flops_per_elem: u64,
    bool_out: bool,
    fold: Option<fn(f64) -> f64>,
    keeps: Keeps,
}

impl Op for Unary {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let dtype = if self.bool_out { DType::Bool } else { x.dtype };
        let value = match (&x.value, self.fold) {
            (Some(v), Some(f)) => Some(map_value(v, x.dtype.is_float(), f)),
            _ => None,
        };
        Ok(vec![Fact {
            dtype,
            shape: x.shape.clone(),
            value,
        }])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        self.flops_per_elem.saturating_mul(out[0].numel())
    }
    /// Backward FLOPs: one multiply by the derivative per element, plus computing it.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let needs: &[Saved] = match self.keeps {
            Keeps::NonDiff => return Ok(None),
            Keeps::Nothing => &[],
            Keeps::Input => &[Saved::Input(0)],
            Keeps::Output => &[Saved::Output(0)],
        };
        let flops = (self.flops_per_elem + 1).saturating_mul(out[0].numel());
        Ok(Some(Backward::each(&[0], needs, flops)))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        if self.flops_per_elem == 0 {
            Storage::View
        } else {
            Storage::New
        }
    }
    /// TensorIterator's output layout.
    fn out_strides(
        &self,
        cx: &Cx,
        _k: usize,
        out: &Fact,
        strides: &[Option<&[usize]>],
    ) -> Vec<usize> {
        super::elementwise_strides(cx, out, strides)
    }
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        unary_kernel(cx, self.bool_out)
    }
    /// `g · f'(x)`, the derivative from the saved input or output as the rule says.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        unary_backward(cx, self.keeps)
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, op_type: &str) -> CudaKernels {
        match op_type {
            "Identity" | "Relu" | "Neg" | "Abs" | "Sqrt" | "Reciprocal" | "Exp" | "Log" | "Erf"
            | "Tanh" | "Sigmoid" | "Gelu" | "LeakyRelu" | "Sin" | "Cos" | "Floor" | "Ceil"
            | "Softplus" | "HardSigmoid" | "HardSwish" | "Elu" => {
                CudaKernels::new(&["unary_fwd_f32"], &["unary_bwd_f32"])
            }
            _ => CudaKernels::HOST,
        }
    }
}

fn map_value(v: &Value, float: bool, f: fn(f64) -> f64) -> Value {
    let n = v.data.len();
    let data = if float {
        Data::Float((0..n).map(|i| f(v.data.float(i))).collect())
    } else {
        Data::Int((0..n).map(|i| f(v.data.float(i)) as i64).collect())
    };
    Value {
        shape: v.shape.clone(),
        data,
    }
}

/// How a binary op combines elements and what type it yields.
#[derive(Clone, Copy)]
enum BinKind {
    /// Same type as the inputs.
    Arith(fn(i64, i64) -> Option<i64>, fn(f64, f64) -> f64),
    /// Yields bool.
    Compare(fn(f64, f64) -> bool),
}

/// A broadcasting binary op.
struct Binary {
    flops_per_elem: u64,
    kind: BinKind,
}

/// Folds an element-wise op over broadcast inputs when all values are known.
fn fold_broadcast(
    vals: &[&Value],
    out_shape: &[usize],
    f: impl Fn(&[usize]) -> Option<FoldElem>,
) -> Option<Data> {
    let n: usize = out_shape.iter().product();
    if n > MAX_FOLD_ELEMS {
        return None;
    }
    let rank = out_shape.len();
    let mut idx = vec![0usize; vals.len()];
    let mut ints = Vec::new();
    let mut floats = Vec::new();
    let mut coord = vec![0usize; rank];
    for _ in 0..n {
        for (k, v) in vals.iter().enumerate() {
            let off = rank - v.shape.len();
            let mut flat = 0;
            for (i, &d) in v.shape.iter().enumerate() {
                flat = flat * d + if d == 1 { 0 } else { coord[off + i] };
            }
            idx[k] = flat;
        }
        match f(&idx)? {
            FoldElem::I(x) => ints.push(x),
            FoldElem::F(x) => floats.push(x),
        }
        for i in (0..rank).rev() {
            coord[i] += 1;
            if coord[i] < out_shape[i] {
                break;
            }
            coord[i] = 0;
        }
    }
    Some(if floats.is_empty() {
        Data::Int(ints)
    } else if ints.is_empty() {
        Data::Float(floats)
    } else {
        return None;
    })
}

enum FoldElem {
    I(i64),
    F(f64),
}

impl Op for Binary {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (a, b) = (cx.input(0)?, cx.input(1)?);
        let shape = broadcast(&[&a.shape, &b.shape])?;
        let dtype = match self.kind {
            BinKind::Arith(..) => a.dtype,
            BinKind::Compare(_) => DType::Bool,
        };
        let value = match (&a.value, &b.value) {
            (Some(va), Some(vb)) => {
                let float = a.dtype.is_float();
                let kind = self.kind;
                fold_broadcast(&[va, vb], &shape, |i| match kind {
                    BinKind::Arith(fi, ff) => Some(if float {
                        FoldElem::F(ff(va.data.float(i[0]), vb.data.float(i[1])))
                    } else {
                        FoldElem::I(fi(va.data.int(i[0]), vb.data.int(i[1]))?)
                    }),
                    BinKind::Compare(fc) => Some(FoldElem::I(fc(
                        va.data.float(i[0]),
                        vb.data.float(i[1]),
                    ) as i64)),
                })
                .map(|data| Value {
                    shape: shape.clone(),
                    data,
                })
            }
            _ => None,
        };
        Ok(vec![Fact {
            dtype,
            shape,
            value,
        }])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        self.flops_per_elem.saturating_mul(out[0].numel())
    }
    /// Add/Sub save nothing; Mul saves the other operand for each gradient; Div saves
    /// the divisor (and the dividend for the divisor's gradient); Pow and PRelu save
    /// both. Comparisons have no gradient. Backward FLOPs: 2 per element per gradient.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let name = cx.node.op_type.as_str();
        let (a, b): (Vec<Saved>, Vec<Saved>) = match (self.kind, name) {
            (BinKind::Compare(_), _) | (_, "BitShift") => return Ok(None),
            (_, "Mod") if out[0].dtype.is_float() => {
                return Err("the gradient of a floating-point Mod is not modelled".into())
            }
            (_, "Mod") => return Ok(None),
            (_, "Add" | "Sub") => (vec![], vec![]),
            (_, "Mul") => (vec![Saved::Input(1)], vec![Saved::Input(0)]),
            (_, "Div") => (
                vec![Saved::Input(1)],
                vec![Saved::Input(0), Saved::Input(1)],
            ),
            // PowBackward: self and exponent (and the result for the exponent's gradient).
            (_, "Pow") => (
                vec![Saved::Input(0), Saved::Input(1)],
                vec![Saved::Input(0), Saved::Output(0)],
            ),
            _ => (
                vec![Saved::Input(0), Saved::Input(1)],
                vec![Saved::Input(0), Saved::Input(1)],
            ),
        };
        Ok(Some(Backward {
            grads: vec![Grad { input: 0, needs: a }, Grad { input: 1, needs: b }],
            extras: Vec::new(),
            flops: out[0].numel().saturating_mul(4),
        }))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// TensorIterator's output layout.
    fn out_strides(
        &self,
        cx: &Cx,
        _k: usize,
        out: &Fact,
        strides: &[Option<&[usize]>],
    ) -> Vec<usize> {
        super::elementwise_strides(cx, out, strides)
    }
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        binary_kernel(cx, matches!(self.kind, BinKind::Compare(_)))
    }
    /// Each operand's gradient computed at the broadcast shape, then summed back
    /// over the axes it was broadcast along.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        if matches!(self.kind, BinKind::Compare(_)) {
            return no_gradient(cx);
        }
        binary_backward(cx)
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, op_type: &str) -> CudaKernels {
        match op_type {
            "Add" | "Sub" | "Mul" | "Div" | "Pow" => {
                CudaKernels::new(&["binary_fwd_f32"], &["binary_bwd_f32", "reduce_f32"])
            }
            "Equal" | "Less" | "LessOrEqual" | "Greater" | "GreaterOrEqual" => {
                CudaKernels::new(&["compare_f32"], &[])
            }
            _ => CudaKernels::HOST,
        }
    }
}

/// Max, Min, Sum, Mean over 1+ broadcast inputs. FLOPs: one per output element per
/// extra input (Mean adds one division per element).
struct Variadic {
    mean: bool,
    fold: fn(f64, f64) -> f64,
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
        let vals: Option<Vec<&Value>> = ins.iter().map(|f| f.value.as_ref()).collect();
        let float = ins[0].dtype.is_float();
        let value = vals.filter(|_| !self.mean).and_then(|vals| {
            let f = self.fold;
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
            value,
        }])
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let extra = cx.inputs.len().saturating_sub(1) as u64 + self.mean as u64;
        extra.saturating_mul(out[0].numel())
    }
    /// Sum/Mean save nothing; Max/Min save their inputs (the gradient goes to the
    /// selected one). Backward FLOPs: 1 per element per input.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let n = cx.inputs.len();
        let needs: Vec<Saved> = if matches!(cx.node.op_type.as_str(), "Max" | "Min") {
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
        variadic_kernel(cx, self.mean)
    }
    /// Sum/Mean: the gradient (divided by the count for Mean) summed back to each
    /// input's shape. Max/Min: to the input the forward's left fold selected.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        variadic_backward(cx, self.mean)
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
}

/// `Where(cond, x, y)`: broadcast of three. FLOPs: 1 select per output element.
struct Where;

impl Op for Where {
    fn arity(&self) -> Arity {
        Arity::new(3, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (c, x, y) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
        if x.dtype != y.dtype {
            return Err(format!("X is {} but Y is {}", x.dtype, y.dtype));
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
            value,
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
    /// TensorIterator's output layout.
    fn out_strides(
        &self,
        cx: &Cx,
        _k: usize,
        out: &Fact,
        strides: &[Option<&[usize]>],
    ) -> Vec<usize> {
        super::elementwise_strides(cx, out, strides)
    }
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
        CudaKernels::new(&["where_f32"], &["where_bwd_f32", "reduce_f32"])
    }
}

/// `Cast` (attribute `to`) and `CastLike` (type of input 1). Data movement: 0 FLOPs.
struct Cast {
    like: bool,
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
            dtype_attr(cx.attrs().int("to").ok_or("missing attribute 'to'")?)?
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
            value,
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
        let to = cx.attrs().int("to").and_then(|c| dtype_attr(c).ok());
        match (cx.inputs[0], to) {
            (Some(x), Some(t)) if !self.like && x.dtype == t => Storage::View,
            _ => Storage::New,
        }
    }
    /// TensorIterator's output layout.
    fn out_strides(
        &self,
        cx: &Cx,
        _k: usize,
        out: &Fact,
        strides: &[Option<&[usize]>],
    ) -> Vec<usize> {
        super::elementwise_strides(cx, out, strides)
    }
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
        CudaKernels::new(&["cast_any"], &["strided_copy_b4"])
    }
}

/// `Clip(x, min?, max?)` (opset 11+ inputs; older `min`/`max` attributes).
/// FLOPs: 2 comparisons per element.
struct Clip;

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
    /// TensorIterator's output layout.
    fn out_strides(
        &self,
        cx: &Cx,
        _k: usize,
        out: &Fact,
        strides: &[Option<&[usize]>],
    ) -> Vec<usize> {
        super::elementwise_strides(cx, out, strides)
    }
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        clip_kernel(cx)
    }
    /// `g` where `min ≤ x ≤ max` (PyTorch's clamp backward), 0 elsewhere. The
    /// bounds are constants (folded facts or attributes): the rule saves only `x`.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let bound = |i: usize, attr: &str| -> RuleResult<Option<f32>> {
            if cx.opset >= 11 {
                match cx.inputs.get(i).copied().flatten() {
                    None => Ok(None),
                    Some(f) => f
                        .value
                        .as_ref()
                        .and_then(|v| v.scalar_float())
                        .map(|v| Some(v as f32))
                        .ok_or_else(|| {
                            format!("bound {i} is not a constant, and the rule saves only x")
                        }),
                }
            } else {
                Ok(cx.attrs().float(attr))
            }
        };
        let lo = bound(1, "min")?.unwrap_or(f32::NEG_INFINITY);
        let hi = bound(2, "max")?.unwrap_or(f32::INFINITY);
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
        CudaKernels::new(&["clip_fwd_f32"], &["clip_bwd_f32"])
    }
}

/// `Dropout(x, ratio?, training_mode?) -> (y, mask?)`. The mask is bool, same shape.
/// Training mode comes from the `training_mode` input (opset 12+) when it is a known
/// constant. FLOPs: training 2 per element (draw/compare and scale), inference 0.
pub(crate) struct Dropout;

impl Dropout {
    /// Whether this Dropout drops (training mode).
    pub(crate) fn training(cx: &Cx) -> bool {
        if cx.opset >= 12 {
            cx.opt(2)
                .and_then(|f| f.value.as_ref())
                .and_then(|v| v.scalar_int())
                .is_some_and(|t| t != 0)
        } else {
            cx.attrs().int("is_test").unwrap_or(0) == 0
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
            cx.attrs().float("ratio").map_or(0.5, f64::from)
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
            e => return Err(format!("the mask is {}, expected bool", e.dtype())),
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
            &["dropout_fwd_f32", "strided_copy_b1", "strided_copy_b4"],
            &["dropout_bwd_f32", "strided_copy_b4"],
        )
    }
}

/// Element count above which element-wise kernels run in parallel.
const PAR_ELEMS: usize = 1 << 15;

/// `f` over every element, in parallel for large tensors.
pub(crate) fn map_f32(x: &[f32], f: impl Fn(f32) -> f32 + Sync + Send) -> Vec<f32> {
    if x.len() >= PAR_ELEMS {
        x.par_iter().map(|&v| f(v)).collect()
    } else {
        x.iter().map(|&v| f(v)).collect()
    }
}

/// A unary op's f32 function, with its attributes (defaults from the ONNX spec).
fn unary_fn(op: &str, a: &Attrs) -> RuleResult<Box<dyn Fn(f32) -> f32 + Sync + Send>> {
    let alpha = |d: f32| a.float("alpha").unwrap_or(d);
    Ok(match op {
        "Relu" => Box::new(|x: f32| x.max(0.0)),
        "Neg" => Box::new(|x: f32| -x),
        "Abs" => Box::new(f32::abs),
        "Floor" => Box::new(f32::floor),
        "Ceil" => Box::new(f32::ceil),
        "Round" => Box::new(f32::round_ties_even),
        "Sign" => Box::new(|x: f32| if x == 0.0 { 0.0 } else { x.signum() }),
        "Sqrt" => Box::new(f32::sqrt),
        "Reciprocal" => Box::new(|x: f32| 1.0 / x),
        "Exp" => Box::new(f32::exp),
        "Log" => Box::new(f32::ln),
        "Erf" => Box::new(libm::erff),
        "Sin" => Box::new(f32::sin),
        "Cos" => Box::new(f32::cos),
        "Tan" => Box::new(f32::tan),
        "Tanh" => Box::new(f32::tanh),
        "Atan" => Box::new(f32::atan),
        "LeakyRelu" => {
            let al = alpha(0.01);
            Box::new(move |x: f32| if x < 0.0 { al * x } else { x })
        }
        "ThresholdedRelu" => {
            let al = alpha(1.0);
            Box::new(move |x: f32| if x > al { x } else { 0.0 })
        }
        "Sigmoid" => Box::new(sigmoid),
        "HardSigmoid" => {
            let (al, be) = (alpha(0.2), a.float("beta").unwrap_or(0.5));
            Box::new(move |x: f32| (al * x + be).clamp(0.0, 1.0))
        }
        "HardSwish" => Box::new(|x: f32| x * (x / 6.0 + 0.5).clamp(0.0, 1.0)),
        "Softplus" => Box::new(softplus),
        "Softsign" => Box::new(|x: f32| x / (1.0 + x.abs())),
        "Elu" => {
            let al = alpha(1.0);
            Box::new(move |x: f32| if x < 0.0 { al * x.exp_m1() } else { x })
        }
        "Selu" => {
            let al = alpha(1.673_263_2);
            let g = a.float("gamma").unwrap_or(1.050_701);
            Box::new(move |x: f32| g * if x > 0.0 { x } else { al * x.exp_m1() })
        }
        "Celu" => {
            let al = alpha(1.0);
            Box::new(move |x: f32| x.max(0.0) + (al * (x / al).exp_m1()).min(0.0))
        }
        "Mish" => Box::new(|x: f32| x * softplus(x).tanh()),
        "Gelu" => match a.string("approximate").unwrap_or("none") {
            "none" => {
                Box::new(|x: f32| 0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2)))
            }
            "tanh" => Box::new(|x: f32| {
                let c = (2.0 / std::f32::consts::PI).sqrt();
                0.5 * x * (1.0 + (c * (x + 0.044_715 * x * x * x)).tanh())
            }),
            other => return Err(format!("unknown approximate '{other}'")),
        },
        other => return Err(format!("no f32 kernel for {other}")),
    })
}

fn sigmoid(x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

fn softplus(x: f32) -> f32 {
    // log(1 + e^x) without overflow.
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// Unary ops: floats computed in f32 (half types widened and rounded back);
/// Identity on any type; Neg/Abs/Sign/Relu on integers; Not/IsNaN/IsInf to bool.
fn unary_kernel(cx: &KernelCx, bool_out: bool) -> RuleResult<Vec<Tensor>> {
    let x = cx.input(0)?;
    let op = cx.node.op_type.as_str();
    let shape = x.shape.clone();
    if op == "Identity" {
        return Ok(vec![x.clone()]);
    }
    if bool_out {
        let v: Vec<bool> = match op {
            "Not" => match &x.elems {
                Elems::Bool(b) => b.iter().map(|&b| !b).collect(),
                e => return Err(format!("Not takes bool, got {}", e.dtype())),
            },
            "IsNaN" => x.to_f32()?.iter().map(|v| v.is_nan()).collect(),
            "IsInf" => {
                let (pos, neg) = (
                    cx.attrs().int_or("detect_positive", 1) != 0,
                    cx.attrs().int_or("detect_negative", 1) != 0,
                );
                x.to_f32()?
                    .iter()
                    .map(|&v| v.is_infinite() && ((v > 0.0 && pos) || (v < 0.0 && neg)))
                    .collect()
            }
            other => return Err(format!("no kernel for {other}")),
        };
        return Ok(vec![Tensor::bool(shape, v)]);
    }
    if !x.dtype().is_float() {
        let f: fn(i64) -> i64 = match op {
            "Neg" => i64::wrapping_neg,
            "Abs" => i64::wrapping_abs,
            "Sign" => i64::signum,
            "Relu" => |v| v.max(0),
            other => return Err(format!("{other} on {} is not supported", x.dtype())),
        };
        let v = x.to_i64s().into_iter().map(f).collect();
        return Ok(vec![Tensor::from_i64(x.dtype(), shape, v)?]);
    }
    let f = unary_fn(op, cx.attrs())?;
    let v = map_f32(&x.to_f32()?, f);
    Ok(vec![Tensor::from_f32(x.dtype(), shape, v)?])
}

/// Python's `%` (the result has the sign of the divisor): ONNX `Mod` with `fmod = 0`.
fn py_mod(a: i64, b: i64) -> i64 {
    if b == 0 {
        return 0;
    }
    let r = a.wrapping_rem(b);
    if r != 0 && ((r < 0) != (b < 0)) {
        r + b
    } else {
        r
    }
}

/// Broadcasting binary ops. Arithmetic keeps input 0's type (floats in f32,
/// integers in wrapping i64, integer Div truncating); comparisons yield bool
/// (integers compared exactly, floats in f32, bools logically).
fn binary_kernel(cx: &KernelCx, compare: bool) -> RuleResult<Vec<Tensor>> {
    let (a, b) = (cx.input(0)?, cx.input(1)?);
    let op = cx.node.op_type.as_str();
    let out = cx.out(0)?.shape.clone();
    let (sa, sb) = (&a.shape[..], &b.shape[..]);
    if compare {
        let v: Vec<bool> = match (&a.elems, &b.elems) {
            (Elems::Bool(x), Elems::Bool(y)) => {
                let f: fn(bool, bool) -> bool = match op {
                    "And" => |x, y| x && y,
                    "Or" => |x, y| x || y,
                    "Xor" => |x, y| x != y,
                    "Equal" => |x, y| x == y,
                    other => return Err(format!("{other} on bool is not supported")),
                };
                zip2(&out, (x, sa), (y, sb), f)
            }
            _ if !a.dtype().is_float() && !b.dtype().is_float() => {
                let f: fn(i64, i64) -> bool = match op {
                    "Equal" => |x, y| x == y,
                    "Less" => |x, y| x < y,
                    "LessOrEqual" => |x, y| x <= y,
                    "Greater" => |x, y| x > y,
                    "GreaterOrEqual" => |x, y| x >= y,
                    other => return Err(format!("{other} on integers is not supported")),
                };
                zip2(&out, (&a.to_i64s(), sa), (&b.to_i64s(), sb), f)
            }
            _ => {
                let f: fn(f32, f32) -> bool = match op {
                    "Equal" => |x, y| x == y,
                    "Less" => |x, y| x < y,
                    "LessOrEqual" => |x, y| x <= y,
                    "Greater" => |x, y| x > y,
                    "GreaterOrEqual" => |x, y| x >= y,
                    other => return Err(format!("{other} on floats is not supported")),
                };
                zip2(&out, (&float_operand(a)?, sa), (&float_operand(b)?, sb), f)
            }
        };
        return Ok(vec![Tensor::bool(out, v)]);
    }
    let dtype = a.dtype();
    if dtype.is_float() {
        let fmod = cx.attrs().int_or("fmod", 0) != 0;
        let f: fn(f32, f32) -> f32 = match op {
            "Add" => |x, y| x + y,
            "Sub" => |x, y| x - y,
            "Mul" => |x, y| x * y,
            "Div" => |x, y| x / y,
            "Pow" => pow_f32,
            "PRelu" => |x, s| if x < 0.0 { x * s } else { x },
            "Mod" if fmod => |x, y| x % y,
            "Mod" => return Err("Mod on floats needs fmod = 1".into()),
            other => return Err(format!("{other} on floats is not supported")),
        };
        let (x, y) = (a.to_f32()?, float_operand(b)?);
        let v = if sa == out.as_slice() && sb == out.as_slice() && x.len() >= PAR_ELEMS {
            x.par_iter()
                .zip(y.par_iter())
                .map(|(&p, &q)| f(p, q))
                .collect()
        } else {
            zip2(&out, (&x, sa), (&y, sb), f)
        };
        return Ok(vec![Tensor::from_f32(dtype, out, v)?]);
    }
    let f: fn(i64, i64) -> i64 = match op {
        "Add" => i64::wrapping_add,
        "Sub" => i64::wrapping_sub,
        "Mul" => i64::wrapping_mul,
        "Div" => |x, y| if y == 0 { 0 } else { x.wrapping_div(y) },
        "Mod" if cx.attrs().int_or("fmod", 0) != 0 => {
            |x, y| if y == 0 { 0 } else { x.wrapping_rem(y) }
        }
        "Mod" => py_mod,
        "Pow" => |x, y| x.wrapping_pow(y.clamp(0, u32::MAX as i64) as u32),
        "BitShift" => {
            if cx.attrs().string("direction") == Some("LEFT") {
                |x, y| ((x as u64) << (y & 63)) as i64
            } else {
                |x, y| ((x as u64) >> (y & 63)) as i64
            }
        }
        other => return Err(format!("{other} on {dtype} is not supported")),
    };
    let v = zip2(&out, (&a.to_i64s(), sa), (&b.to_i64s(), sb), f);
    Ok(vec![Tensor::from_i64(dtype, out, v)?])
}

/// `x^y` in f32, with integer exponents exact for small powers (ONNX Pow of a float
/// by 2 or 3 is common in GELU approximations).
fn pow_f32(x: f32, y: f32) -> f32 {
    if y == 2.0 {
        x * x
    } else if y == 3.0 {
        x * x * x
    } else {
        x.powf(y)
    }
}

/// A float operand, any numeric type converted (Pow's exponent may be an integer).
fn float_operand(t: &Tensor) -> RuleResult<std::borrow::Cow<'_, [f32]>> {
    if t.dtype().is_float() {
        t.to_f32()
    } else {
        Ok(std::borrow::Cow::Owned(
            t.to_f64s().into_iter().map(|v| v as f32).collect(),
        ))
    }
}

/// Max/Min/Sum/Mean over broadcast inputs, folded left to right.
fn variadic_kernel(cx: &KernelCx, mean: bool) -> RuleResult<Vec<Tensor>> {
    let op = cx.node.op_type.as_str();
    let first = cx.input(0)?;
    let dtype = first.dtype();
    let out = cx.out(0)?.shape.clone();
    let n = cx.inputs.len();
    if dtype.is_float() {
        let f: fn(f32, f32) -> f32 = match op {
            "Max" => |x: f32, y: f32| if x.is_nan() || x >= y { x } else { y },
            "Min" => |x: f32, y: f32| if x.is_nan() || x <= y { x } else { y },
            _ => |x, y| x + y,
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
        "Max" => i64::max,
        "Min" => i64::min,
        _ => i64::wrapping_add,
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
fn where_kernel(cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
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
                _ => return Err(format!("X is {} but Y is {}", x.dtype(), y.dtype())),
            }
        };
    }
    let elems = pick!(F32, F16, BF16, I64, I32, Bool);
    Ok(vec![Tensor::new(out, elems)])
}

/// `Clip(x, min?, max?)`: bounds from inputs (opset 11+) or attributes.
fn clip_kernel(cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
    let x = cx.input(0)?;
    let bound = |i: usize, attr: &str| -> RuleResult<Option<f64>> {
        if cx.opset >= 11 {
            match cx.opt(i) {
                None => Ok(None),
                Some(t) if t.numel() == 1 => Ok(Some(t.to_f64s()[0])),
                Some(t) => Err(format!("input {i} must be a scalar, got {:?}", t.shape)),
            }
        } else {
            Ok(cx.attrs().float(attr).map(f64::from))
        }
    };
    let (lo, hi) = (bound(1, "min")?, bound(2, "max")?);
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
fn dropout_training(cx: &KernelCx) -> RuleResult<(bool, f64)> {
    let (training, ratio) = if cx.opset >= 12 {
        let t = cx
            .opt(2)
            .is_some_and(|t| t.to_i64s().first().is_some_and(|&v| v != 0));
        let r = cx
            .opt(1)
            .map_or(0.5, |t| t.to_f64s().first().copied().unwrap_or(0.5));
        (t, r)
    } else {
        (
            cx.attrs().int_or("is_test", 0) == 0,
            cx.attrs().float("ratio").map_or(0.5, f64::from),
        )
    };
    if !(0.0..=1.0).contains(&ratio) {
        return Err(format!("ratio {ratio} is outside [0, 1]"));
    }
    Ok((training && ratio != 0.0, ratio))
}

/// Dropout; see [`Dropout`]'s `forward_cpu`. Gives `[y, mask]` whatever the
/// declared outputs.
fn dropout_kernel(cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
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

/// An element function (a unary op's derivative).
type ElemFn = Box<dyn Fn(f32) -> f32 + Sync + Send>;

/// A unary op's derivative: `d(s)` with `s` the saved input or output element, or
/// `None` for ops without a CPU backward kernel.
fn unary_derivative(op: &str, a: &Attrs) -> RuleResult<Option<ElemFn>> {
    let alpha = |d: f32| a.float("alpha").unwrap_or(d);
    let sig = |x: f32| sigmoid(x);
    Ok(Some(match op {
        // Nothing saved.
        "Identity" => Box::new(|_| 1.0),
        "Neg" => Box::new(|_| -1.0),
        "Floor" | "Ceil" | "Round" | "Sign" => Box::new(|_| 0.0),
        // From the input x.
        "Abs" => Box::new(|x: f32| if x == 0.0 { 0.0 } else { x.signum() }),
        "Log" => Box::new(|x: f32| 1.0 / x),
        "Erf" => Box::new(|x: f32| std::f32::consts::FRAC_2_SQRT_PI * (-x * x).exp()),
        "Sin" => Box::new(f32::cos),
        "Cos" => Box::new(|x: f32| -x.sin()),
        "Atan" => Box::new(|x: f32| 1.0 / (1.0 + x * x)),
        "LeakyRelu" => {
            let al = alpha(0.01);
            Box::new(move |x: f32| if x > 0.0 { 1.0 } else { al })
        }
        "ThresholdedRelu" => {
            let al = alpha(1.0);
            Box::new(move |x: f32| if x > al { 1.0 } else { 0.0 })
        }
        "HardSigmoid" => {
            let (al, be) = (alpha(0.2), a.float("beta").unwrap_or(0.5));
            Box::new(move |x: f32| {
                let v = al * x + be;
                if v > 0.0 && v < 1.0 {
                    al
                } else {
                    0.0
                }
            })
        }
        "HardSwish" => Box::new(|x: f32| {
            if x < -3.0 {
                0.0
            } else if x > 3.0 {
                1.0
            } else {
                x / 3.0 + 0.5
            }
        }),
        "Softplus" => Box::new(sig),
        "Softsign" => Box::new(|x: f32| 1.0 / (1.0 + x.abs()).powi(2)),
        "Mish" => Box::new(move |x: f32| {
            let t = softplus(x).tanh();
            t + x * (1.0 - t * t) * sig(x)
        }),
        "Gelu" => match a.string("approximate").unwrap_or("none") {
            "none" => Box::new(|x: f32| {
                let cdf = 0.5 * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2));
                let pdf = (-0.5 * x * x).exp()
                    * (0.5 * std::f32::consts::FRAC_2_SQRT_PI)
                    * std::f32::consts::FRAC_1_SQRT_2;
                cdf + x * pdf
            }),
            "tanh" => Box::new(|x: f32| {
                let c = (2.0 / std::f32::consts::PI).sqrt();
                let t = (c * (x + 0.044_715 * x * x * x)).tanh();
                0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044_715 * x * x)
            }),
            other => return Err(format!("unknown approximate '{other}'")),
        },
        // From the output y.
        "Relu" => Box::new(|y: f32| if y > 0.0 { 1.0 } else { 0.0 }),
        "Sqrt" => Box::new(|y: f32| 0.5 / y),
        "Reciprocal" => Box::new(|y: f32| -y * y),
        "Exp" => Box::new(|y: f32| y),
        "Tan" => Box::new(|y: f32| 1.0 + y * y),
        "Tanh" => Box::new(|y: f32| 1.0 - y * y),
        "Sigmoid" => Box::new(|y: f32| y * (1.0 - y)),
        "Elu" => {
            let al = alpha(1.0);
            Box::new(move |y: f32| if y > 0.0 { 1.0 } else { y + al })
        }
        "Selu" => {
            let al = alpha(1.673_263_2);
            let g = a.float("gamma").unwrap_or(1.050_701);
            Box::new(move |y: f32| if y > 0.0 { g } else { y + al * g })
        }
        "Celu" => {
            let al = alpha(1.0);
            Box::new(move |y: f32| if y > 0.0 { 1.0 } else { y / al + 1.0 })
        }
        _ => return Ok(None),
    }))
}

/// Unary backward: `g · f'(s)`, `s` the saved tensor the rule names.
fn unary_backward(cx: &BackwardCx, keeps: Keeps) -> RuleResult<Vec<Option<Tensor>>> {
    let saved = match keeps {
        Keeps::NonDiff => return no_gradient(cx),
        Keeps::Nothing => None,
        Keeps::Input => Some(cx.saved(Saved::Input(0))?),
        Keeps::Output => Some(cx.saved(Saved::Output(0))?),
    };
    let Some(d) = unary_derivative(&cx.node.op_type, cx.attrs())? else {
        return no_backward_kernel(cx);
    };
    let g = cx.grad(0)?;
    let v: Vec<f32> = match saved {
        None => {
            let k = d(0.0);
            g.iter().map(|&g| g * k).collect()
        }
        Some(s) => {
            let s = s.to_f32()?;
            if s.len() != g.len() {
                return Err("the saved tensor and the gradient differ in size".into());
            }
            if g.len() >= PAR_ELEMS {
                g.par_iter()
                    .zip(s.par_iter())
                    .map(|(&g, &s)| g * d(s))
                    .collect()
            } else {
                g.iter().zip(s.iter()).map(|(&g, &s)| g * d(s)).collect()
            }
        }
    };
    cx.answer(vec![(0, v)])
}

/// Binary backward at the broadcast shape, each gradient summed back to its
/// operand's shape. Reads only the saved operands of the wanted gradients.
fn binary_backward(cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
    let op = cx.node.op_type.as_str();
    let out = cx.output(0)?.shape.clone();
    let (sa, sb) = (cx.input(0)?.shape.clone(), cx.input(1)?.shape.clone());
    let g = cx.grad(0)?;
    let val = |s: Saved| -> RuleResult<(Vec<f32>, Vec<usize>)> {
        let t = cx.saved(s)?;
        Ok((float_operand(t)?.into_owned(), t.shape.clone()))
    };
    // `g ⊙ f(p)` at the broadcast shape for an operand `p` read at its own shape.
    let times = |(p, sp): (Vec<f32>, Vec<usize>), f: &dyn Fn(f32, f32) -> f32| -> Vec<f32> {
        zip2(&out, (&g[..], &out[..]), (&p[..], &sp[..]), f)
    };
    let mut res = Vec::new();
    for slot in [0, 1] {
        if !cx.wants(slot) {
            continue;
        }
        let full: Vec<f32> = match (op, slot) {
            ("Add", _) => g.to_vec(),
            ("Sub", 0) => g.to_vec(),
            ("Sub", _) => g.iter().map(|&v| -v).collect(),
            ("Mul", 0) => times(val(Saved::Input(1))?, &|g, b| g * b),
            ("Mul", _) => times(val(Saved::Input(0))?, &|g, a| g * a),
            ("Div", 0) => times(val(Saved::Input(1))?, &|g, b| g / b),
            ("Div", _) => {
                let (a, b) = (val(Saved::Input(0))?, val(Saved::Input(1))?);
                let mut v = Vec::with_capacity(g.len());
                for_each(&out, [&a.1[..], &b.1[..]], |o, [i, j]| {
                    v.push(-g[o] * a.0[i] / (b.0[j] * b.0[j]))
                });
                v
            }
            // d/da a^b = b·a^(b−1); d/db a^b = a^b·ln a (0 where a = 0, as PyTorch).
            ("Pow", 0) => {
                let (a, b) = (val(Saved::Input(0))?, val(Saved::Input(1))?);
                let mut v = Vec::with_capacity(g.len());
                for_each(&out, [&a.1[..], &b.1[..]], |o, [i, j]| {
                    let (x, e) = (a.0[i], b.0[j]);
                    let d = if e == 0.0 {
                        0.0
                    } else if e == 2.0 {
                        2.0 * x
                    } else {
                        e * x.powf(e - 1.0)
                    };
                    v.push(g[o] * d)
                });
                v
            }
            ("Pow", _) => {
                let (a, y) = (val(Saved::Input(0))?, val(Saved::Output(0))?);
                let mut v = Vec::with_capacity(g.len());
                for_each(&out, [&a.1[..], &y.1[..]], |o, [i, k]| {
                    let x = a.0[i];
                    v.push(if x == 0.0 {
                        0.0
                    } else {
                        g[o] * y.0[k] * x.ln()
                    })
                });
                v
            }
            ("PRelu", _) => {
                let (a, b) = (val(Saved::Input(0))?, val(Saved::Input(1))?);
                let mut v = Vec::with_capacity(g.len());
                for_each(&out, [&a.1[..], &b.1[..]], |o, [i, j]| {
                    let (x, sl) = (a.0[i], b.0[j]);
                    v.push(match (slot, x > 0.0) {
                        (0, true) => g[o],
                        (0, false) => g[o] * sl,
                        (_, true) => 0.0,
                        (_, false) => g[o] * x,
                    })
                });
                v
            }
            _ => return no_backward_kernel(cx),
        };
        let target = if slot == 0 { &sa } else { &sb };
        res.push((slot, sum_to(&full, &out, target)));
    }
    cx.answer(res)
}

/// Sum/Mean/Max/Min backward; see [`Variadic`]'s `backward_cpu`.
fn variadic_backward(cx: &BackwardCx, mean: bool) -> RuleResult<Vec<Option<Tensor>>> {
    let op = cx.node.op_type.as_str();
    let out = cx.output(0)?.shape.clone();
    let n = cx.node.inputs.len();
    let g = cx.grad(0)?;
    let mut res = Vec::new();
    if matches!(op, "Max" | "Min") {
        // The winner of the forward's left fold at every output element.
        let ins = (0..n)
            .map(|i| {
                let t = cx.saved(Saved::Input(i))?;
                Ok((t.to_f32()?.into_owned(), t.shape.clone()))
            })
            .collect::<RuleResult<Vec<_>>>()?;
        let max = op == "Max";
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
    let k = if mean { 1.0 / n as f32 } else { 1.0 };
    let full: Vec<f32> = g.iter().map(|&v| v * k).collect();
    for &i in &cx.wanted {
        res.push((i, sum_to(&full, &out, &cx.input(i)?.shape)));
    }
    cx.answer(res)
}

fn erf(x: f64) -> f64 {
    // Abramowitz-Stegun 7.1.26; folding an Erf on constants is rare and only needs
    // to be close.
    let t = 1.0 / (1.0 + 0.3275911 * x.abs());
    let y = 1.0
        - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
            + 0.254829592)
            * t
            * (-x * x).exp();
    y.copysign(x)
}

/// Registers the element-wise family.
pub fn register(r: &mut Registry) {
    let unary = |flops_per_elem, fold, keeps| Unary {
        flops_per_elem,
        bool_out: false,
        fold,
        keeps,
    };
    use Keeps::{Input as In, Nothing as No, Output as Out};
    // Data movement.
    r.add("Identity", unary(0, Some(|x| x), No));
    // One arithmetic operation or one transcendental function per element.
    r.add("Relu", unary(1, Some(|x: f64| x.max(0.0)), Out));
    r.add("Neg", unary(1, Some(|x: f64| -x), No));
    r.add("Abs", unary(1, Some(f64::abs), In));
    r.add("Floor", unary(1, Some(f64::floor), No));
    r.add("Ceil", unary(1, Some(f64::ceil), No));
    r.add("Round", unary(1, Some(f64::round_ties_even), No));
    r.add(
        "Sign",
        unary(
            1,
            Some(|x: f64| if x == 0.0 { 0.0 } else { x.signum() }),
            No,
        ),
    );
    r.add("Sqrt", unary(1, Some(f64::sqrt), Out));
    r.add("Reciprocal", unary(1, Some(|x: f64| 1.0 / x), Out));
    r.add("Exp", unary(1, Some(f64::exp), Out));
    r.add("Log", unary(1, Some(f64::ln), In));
    r.add("Erf", unary(1, Some(erf), In));
    r.add("Sin", unary(1, Some(f64::sin), In));
    r.add("Cos", unary(1, Some(f64::cos), In));
    r.add("Tan", unary(1, Some(f64::tan), Out));
    r.add("Tanh", unary(1, Some(f64::tanh), Out));
    r.add("Atan", unary(1, Some(f64::atan), In));
    r.add("LeakyRelu", unary(1, None, In));
    r.add("ThresholdedRelu", unary(1, None, In));
    // A few operations per element (exp + add + divide, or polynomial approximations).
    r.add("Sigmoid", unary(3, None, Out));
    r.add("HardSigmoid", unary(3, None, In));
    r.add("HardSwish", unary(4, None, In));
    r.add("Softplus", unary(3, None, In));
    r.add("Softsign", unary(3, None, In));
    r.add("Elu", unary(3, None, Out));
    r.add("Selu", unary(4, None, Out));
    r.add("Celu", unary(4, None, Out));
    r.add("Mish", unary(6, None, In));
    r.add("Gelu", unary(8, None, In));
    let pred = |fold| Unary {
        flops_per_elem: 1,
        bool_out: true,
        fold,
        keeps: Keeps::NonDiff,
    };
    r.add("Not", pred(Some(|x: f64| (x == 0.0) as i64 as f64)));
    r.add("IsNaN", pred(Some(|x: f64| x.is_nan() as i64 as f64)));
    r.add("IsInf", pred(Some(|x: f64| x.is_infinite() as i64 as f64)));

    let arith = |fi, ff| Binary {
        flops_per_elem: 1,
        kind: BinKind::Arith(fi, ff),
    };
    r.add("Add", arith(|a, b| a.checked_add(b), |a, b| a + b));
    r.add("Sub", arith(|a, b| a.checked_sub(b), |a, b| a - b));
    r.add("Mul", arith(|a, b| a.checked_mul(b), |a, b| a * b));
    // Integer Div truncates, as ONNX does for integer tensors.
    r.add("Div", arith(|a, b| a.checked_div(b), |a, b| a / b));
    r.add(
        "Mod",
        arith(|a, b| a.checked_rem_euclid(b), |a, b| a.rem_euclid(b)),
    );
    r.add(
        "Pow",
        arith(
            |a, b| u32::try_from(b).ok().and_then(|b| a.checked_pow(b)),
            f64::powf,
        ),
    );
    r.add(
        "PRelu",
        Binary {
            flops_per_elem: 2,
            kind: BinKind::Arith(|_, _| None, |x, s| if x < 0.0 { x * s } else { x }),
        },
    );
    r.add(
        "BitShift",
        Binary {
            flops_per_elem: 1,
            kind: BinKind::Arith(|_, _| None, |a, _| a),
        },
    );
    let cmp = |f| Binary {
        flops_per_elem: 1,
        kind: BinKind::Compare(f),
    };
    r.add("Equal", cmp(|a, b| a == b));
    r.add("Less", cmp(|a, b| a < b));
    r.add("LessOrEqual", cmp(|a, b| a <= b));
    r.add("Greater", cmp(|a, b| a > b));
    r.add("GreaterOrEqual", cmp(|a, b| a >= b));
    r.add("And", cmp(|a, b| a != 0.0 && b != 0.0));
    r.add("Or", cmp(|a, b| a != 0.0 || b != 0.0));
    r.add("Xor", cmp(|a, b| (a != 0.0) != (b != 0.0)));

    r.add(
        "Max",
        Variadic {
            mean: false,
            fold: f64::max,
        },
    );
    r.add(
        "Min",
        Variadic {
            mean: false,
            fold: f64::min,
        },
    );
    r.add(
        "Sum",
        Variadic {
            mean: false,
            fold: |a, b| a + b,
        },
    );
    r.add(
        "Mean",
        Variadic {
            mean: true,
            fold: |a, b| a + b,
        },
    );
    r.add("Where", Where);
    r.add("Cast", Cast { like: false });
    r.add("CastLike", Cast { like: true });
    r.add("Clip", Clip);
    r.add("Dropout", Dropout);
}
