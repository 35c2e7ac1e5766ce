//! Ops that make tensors from attributes or from shapes: Constant, Shape, Size,
//! ConstantOfShape, Range, NonZero, and the ops shaped like their input (Trilu,
//! ScatterND, ScatterElements, EyeLike).

#[allow(unused_imports)]
use super::*;

/// `Constant`: from `value` (tensor), `value_float(s)` or `value_int(s)`.
pub(super) struct Constant;

/// The fact for a literal tensor: its value when small and present in the file.
pub fn literal_fact(t: &TensorData) -> Fact {
    Fact {
        dtype: t.dtype,
        shape: t.dims.clone(),
        value: t.value().map(Box::new),
    }
}

impl Op for Constant {
    fn arity(&self) -> Arity {
        Arity::new(0, 0, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let a = cx.attrs();
        let fact = if let Some(t) = a.tensor("value") {
            literal_fact(t)
        } else if let Some(f) = a.float("value_float") {
            Fact::with_value(
                DType::F32,
                Value {
                    shape: vec![],
                    data: Data::Float(vec![f as f64]),
                },
            )
        } else if let Some(i) = a.int("value_int") {
            Fact::with_value(DType::I64, Value::ints(vec![], vec![i]))
        } else if let Some(v) = a.ints("value_ints") {
            Fact::with_value(DType::I64, Value::vec(v.to_vec()))
        } else if let Some(crate::ir::Attr::Floats(v)) = a.get("value_floats") {
            Fact::with_value(
                DType::F32,
                Value {
                    shape: vec![v.len()],
                    data: Data::Float(v.iter().map(|&x| x as f64).collect()),
                },
            )
        } else {
            return Err(
                "no supported value attribute (value, value_float(s), value_int(s))".into(),
            );
        };
        Ok(vec![fact])
    }
    no_flops!();
    no_gradient_source!();
    /// The literal from the attributes.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let a = cx.attrs();
        let f = cx.out(0)?;
        let t = if let Some(t) = a.tensor("value") {
            Tensor::from_data(t)?
        } else if let Some(crate::ir::Attr::Floats(v)) = a.get("value_floats") {
            Tensor::f32(vec![v.len()], v.clone())
        } else if let Some(v) = a.float("value_float") {
            Tensor::f32(vec![], vec![v])
        } else if let Some(v) = a.ints("value_ints") {
            Tensor::i64(vec![v.len()], v.to_vec())
        } else if let Some(v) = a.int("value_int") {
            Tensor::i64(vec![], vec![v])
        } else {
            return Err("no supported value attribute".into());
        };
        Ok(vec![t.cast(f.dtype)?])
    }
}

/// `Shape(x)` with optional `start`/`end` (opset 15): int64 vector, always folded.
pub(super) struct ShapeOp;

/// Shape's attributes.
struct ShapeAttrs {
    /// `start` (default 0).
    start: i64,
    /// `end` (default: the rank).
    end: Option<i64>,
}

impl ShapeAttrs {
    fn of(attrs: &crate::ir::Attrs) -> ShapeAttrs {
        ShapeAttrs {
            start: attrs.int_or("start", 0),
            end: attrs.int("end"),
        }
    }

    /// The dims taken of a rank-`r` input: `start..end`, clamped (empty when
    /// `end` is before `start`).
    fn bounds(&self, r: usize) -> (usize, usize) {
        let r = r as i64;
        let clamp = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
        let start = clamp(self.start);
        (start, clamp(self.end.unwrap_or(r)).max(start))
    }
}

impl Op for ShapeOp {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let (start, end) = ShapeAttrs::of(cx.attrs()).bounds(x.rank());
        let dims = x.shape[start..end].iter().map(|&d| d as i64).collect();
        Ok(vec![Fact::with_value(DType::I64, Value::vec(dims))])
    }
    no_flops!();
    no_gradient_source!();
    /// The input's dims (from `start` to `end`) as int64.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let (start, end) = ShapeAttrs::of(cx.attrs()).bounds(x.rank());
        let dims: Vec<i64> = x.shape[start..end].iter().map(|&d| d as i64).collect();
        Ok(vec![Tensor::i64(vec![dims.len()], dims)])
    }
}

/// `Size(x)`: int64 scalar, folded.
pub(super) struct Size;

impl Op for Size {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let n = cx.input(0)?.numel();
        Ok(vec![Fact::with_value(
            DType::I64,
            Value::ints(vec![], vec![n as i64]),
        )])
    }
    no_flops!();
    no_gradient_source!();
    /// The element count as an int64 scalar.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        Ok(vec![Tensor::i64(vec![], vec![cx.input(0)?.numel() as i64])])
    }
}

/// `ConstantOfShape(shape)`, filled with `value` (default float32 0).
pub(super) struct ConstantOfShape;

impl Op for ConstantOfShape {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let shape: Vec<usize> = cx
            .value(0)?
            .to_ints()
            .iter()
            .map(|&d| dim(d, "dimension"))
            .collect::<RuleResult<_>>()?;
        let fill = cx.attrs().tensor("value").map(literal_fact);
        let dtype = fill.as_ref().map_or(DType::F32, |f| f.dtype);
        let n = numel(&shape) as usize;
        let value = (n <= MAX_FOLD_ELEMS).then_some(()).and_then(|_| {
            let data = match fill.as_ref().map(|f| f.value.as_ref()) {
                None => Data::Float(vec![0.0; n]),
                Some(Some(v)) if v.data.len() == 1 => v.data.gather(std::iter::repeat_n(0, n)),
                Some(_) => return None,
            };
            Some(Value {
                shape: shape.clone(),
                data,
            })
        });
        Ok(vec![Fact {
            dtype,
            shape,
            value: value.map(Box::new),
        }])
    }
    no_flops!();
    no_gradient_source!();
    /// The inferred shape filled with the `value` attribute (float32 0 by default).
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let f = cx.out(0)?;
        let fill = match cx.attrs().tensor("value") {
            Some(t) => Tensor::from_data(t)?,
            None => Tensor::f32(vec![1], vec![0.0]),
        };
        if fill.numel() != 1 {
            return Err("value must hold one element".into());
        }
        let n: usize = f.shape.iter().product();
        Ok(vec![fill
            .select(&vec![0; n], f.shape.clone())
            .cast(f.dtype)?])
    }
}

/// `Range(start, limit, delta)`: 1-D of `max(ceil((limit-start)/delta), 0)` elements.
pub(super) struct Range;

/// An integer `Range`, counted exactly (in 128 bits: float arithmetic loses the
/// difference of two int64 values near the extremes, and gave `[0]` where ONNX
/// gives `[1]`).
fn range_of_ints(cx: &Cx, dtype: DType) -> RuleResult<Vec<Fact>> {
    let get = |i| -> RuleResult<i128> {
        let v = cx.value(i)?;
        if v.data.len() != 1 {
            return Err(format!("input {i} must be a scalar").into());
        }
        Ok(v.data.int(0) as i128)
    };
    let (s, l, d) = (get(0)?, get(1)?, get(2)?);
    if d == 0 {
        return Err("delta is 0".into());
    }
    let diff = l - s;
    let n = if diff == 0 || (diff > 0) != (d > 0) {
        0
    } else {
        (diff.abs() + d.abs() - 1) / d.abs()
    };
    if n > u32::MAX as i128 {
        return Err(format!("range of {n} elements is too large").into());
    }
    let n = n as usize;
    let value = (n <= MAX_FOLD_ELEMS).then(|| Value {
        shape: vec![n],
        data: Data::Int((0..n).map(|i| (s + i as i128 * d) as i64).collect()),
    });
    Ok(vec![Fact {
        dtype,
        shape: vec![n],
        value: value.map(Box::new),
    }])
}

impl Op for Range {
    fn arity(&self) -> Arity {
        Arity::new(3, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let dtype = cx.input(0)?.dtype;
        let get = |i| -> RuleResult<f64> {
            Ok(cx
                .value(i)?
                .scalar_float()
                .ok_or_else(|| format!("input {i} must be a scalar"))?)
        };
        if !dtype.is_float() {
            return range_of_ints(cx, dtype);
        }
        let (s, l, d) = (get(0)?, get(1)?, get(2)?);
        if d == 0.0 {
            return Err("delta is 0".into());
        }
        let n = ((l - s) / d).ceil().max(0.0);
        if n.is_nan() || n > u32::MAX as f64 {
            return Err(format!("range of {n} elements is too large").into());
        }
        let n = n as usize;
        let value = (n <= MAX_FOLD_ELEMS).then(|| Value {
            shape: vec![n],
            data: Data::Float((0..n).map(|i| s + i as f64 * d).collect()),
        });
        Ok(vec![Fact {
            dtype,
            shape: vec![n],
            value: value.map(Box::new),
        }])
    }
    no_flops!();
    no_gradient_source!();
    /// `start + i·delta` for the inferred length, in the input type.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let f = cx.out(0)?;
        let n = f.shape[0];
        let get = |i: usize| -> RuleResult<&Tensor> {
            let t = cx.input(i)?;
            if t.numel() != 1 {
                return Err(format!("input {i} must be a scalar").into());
            }
            Ok(t)
        };
        if f.dtype.is_float() {
            let (s, d) = (get(0)?.to_f64s()[0], get(2)?.to_f64s()[0]);
            let v = (0..n).map(|i| s + i as f64 * d).collect();
            Ok(vec![Tensor::from_f64(f.dtype, vec![n], v)?])
        } else {
            let (s, d) = (get(0)?.to_i64s()[0], get(2)?.to_i64s()[0]);
            let v = (0..n as i64).map(|i| s + i * d).collect();
            Ok(vec![Tensor::from_i64(f.dtype, vec![n], v)?])
        }
    }
}

/// Ops whose output is shaped like input 0: Trilu, ScatterND, ScatterElements
/// (and Scatter, its name in opsets 9-10), EyeLike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LikeInput {
    /// `Trilu`.
    Trilu,
    /// `ScatterND`.
    ScatterNd,
    /// `ScatterElements` and `Scatter`.
    ScatterElements,
    /// `EyeLike`.
    EyeLike,
}

/// The attributes of the [`LikeInput`] ops.
struct LikeAttrs<'a> {
    /// `upper` (Trilu; default 1).
    upper: bool,
    /// `reduction` (the scatters; default "none").
    reduction: &'a str,
    /// `axis` (ScatterElements; default 0).
    axis: i64,
    /// `dtype` (EyeLike; default the input's).
    dtype: Option<i64>,
    /// `k` (EyeLike's diagonal; default 0).
    k: i64,
}

impl LikeAttrs<'_> {
    fn of(attrs: &crate::ir::Attrs) -> LikeAttrs<'_> {
        LikeAttrs {
            upper: attrs.int_or("upper", 1) != 0,
            reduction: attrs.string("reduction").unwrap_or("none"),
            axis: attrs.int_or("axis", 0),
            dtype: attrs.int("dtype"),
            k: attrs.int_or("k", 0),
        }
    }
}

impl Op for LikeInput {
    fn arity(&self) -> Arity {
        match self {
            LikeInput::Trilu => Arity::new(1, 2, 1, 1),
            LikeInput::ScatterNd | LikeInput::ScatterElements => Arity::new(3, 3, 1, 1),
            LikeInput::EyeLike => Arity::new(1, 1, 1, 1),
        }
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let dtype = match LikeAttrs::of(cx.attrs()).dtype {
            Some(code) if *self == LikeInput::EyeLike => dtype_attr(code)?,
            _ => x.dtype,
        };
        Ok(vec![Fact::new(dtype, x.shape.clone())])
    }
    no_flops!();
    /// Trilu masks by position (nothing saved); scatters save their indices and pass
    /// gradients to data and updates; EyeLike is constant.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if !out[0].dtype.is_float() {
            return Ok(None);
        }
        let n = out[0].numel();
        let adds = LikeAttrs::of(cx.attrs()).reduction == "add";
        Ok(match self {
            LikeInput::EyeLike => None,
            LikeInput::Trilu => Some(Backward::each(&[0], &[], n)),
            // torch.onnx writes `index_add_` (a mixture-of-experts layer's combine) as
            // a ScatterND add, and PyTorch's IndexAddBackward0 keeps its source for
            // `expand_as(source)`: saved here too (measured: tests/llm.rs, mixtral).
            LikeInput::ScatterNd if adds => Some(Backward::each(
                &[0, 2],
                &[Saved::Input(1), Saved::Input(2)],
                n,
            )),
            LikeInput::ScatterNd | LikeInput::ScatterElements => {
                Some(Backward::each(&[0, 2], &[Saved::Input(1)], n))
            }
        })
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// Trilu (keeps the upper or lower triangle from diagonal `k`) and EyeLike
    /// (ones on diagonal `k`); the scatters write each update where its index
    /// says (`reduction` none, add, mul, max or min), in index order.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let f = cx.out(0)?;
        let at = LikeAttrs::of(cx.attrs());
        if matches!(self, LikeInput::ScatterNd | LikeInput::ScatterElements) {
            return scatter_kernel(*self, &at, cx);
        }
        let r = x.rank();
        if r < 2 {
            return crate::ops::no_kernel(cx);
        }
        let (h, w) = (x.shape[r - 2], x.shape[r - 1]);
        match self {
            LikeInput::Trilu => {
                let k = cx
                    .opt(1)
                    .map_or(0, |t| t.to_i64s().first().copied().unwrap_or(0));
                let upper = at.upper;
                let keep = |i: usize| {
                    let (row, col) = (((i / w) % h) as i64, (i % w) as i64);
                    if upper {
                        col - row >= k
                    } else {
                        col - row <= k
                    }
                };
                let zero = Tensor::zeros(x.dtype(), vec![1])?;
                let both = [x, &zero];
                let elems = crate::numeric::tensor::with_same_elems!(&both, p => {
                    (0..x.numel()).map(|i| if keep(i) { p[0][i] } else { p[1][0] }).collect()
                });
                Ok(vec![Tensor::new(x.shape.clone(), elems)])
            }
            LikeInput::EyeLike => {
                let k = at.k;
                let v = (0..x.numel())
                    .map(|i| ((i % w) as i64 - ((i / w) % h) as i64 == k) as i64)
                    .collect();
                Ok(vec![Tensor::from_i64(f.dtype, x.shape.clone(), v)?])
            }
            LikeInput::ScatterNd | LikeInput::ScatterElements => crate::ops::no_kernel(cx),
        }
    }
    /// Trilu: the gradient masked by the same triangle (`k` a constant). EyeLike
    /// has no gradient; the scatters (reduction none or add) pass the gradient at
    /// the indices to the updates and the rest (all, for add) to the data.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let at = LikeAttrs::of(cx.attrs());
        match self {
            LikeInput::EyeLike => no_gradient(cx),
            LikeInput::Trilu => {
                let x = cx.input(0)?;
                let r = x.rank();
                if r < 2 {
                    return no_backward_kernel(cx);
                }
                let (h, w) = (x.shape[r - 2], x.shape[r - 1]);
                let k = match cx.inputs.get(1).copied().flatten() {
                    None => 0,
                    Some(f) => f
                        .value
                        .as_ref()
                        .and_then(|v| v.scalar_int())
                        .ok_or("k must be a constant")?,
                };
                let upper = at.upper;
                let g = cx.grad(0)?;
                let dx = g
                    .iter()
                    .enumerate()
                    .map(|(i, &gv)| {
                        let (row, col) = (((i / w) % h) as i64, (i % w) as i64);
                        let keep = if upper {
                            col - row >= k
                        } else {
                            col - row <= k
                        };
                        if keep {
                            gv
                        } else {
                            0.0
                        }
                    })
                    .collect();
                cx.answer(vec![(0, dx)])
            }
            LikeInput::ScatterNd | LikeInput::ScatterElements => {
                let x = cx.input(0)?;
                let red = at.reduction;
                if red != "none" && red != "add" {
                    return no_backward_kernel(cx);
                }
                let idx = cx.saved(Saved::Input(1))?;
                let plan = scatter_plan(*self, &at, &x.shape, idx)?;
                let g = cx.grad(0)?;
                let n_upd: usize = cx.input(2)?.shape.iter().product();
                let per = n_upd / plan.len().max(1);
                let mut res = Vec::new();
                if cx.wants(2) {
                    let du = plan
                        .iter()
                        .flat_map(|&dst| (0..per).map(move |j| dst + j))
                        .map(|i| g[i])
                        .collect();
                    res.push((2, du));
                }
                if cx.wants(0) {
                    // Replaced elements take no gradient; added-to ones pass it.
                    let mut dx = g.to_vec();
                    if red == "none" {
                        for &dst in &plan {
                            dx[dst..dst + per].iter_mut().for_each(|v| *v = 0.0);
                        }
                    }
                    res.push((0, dx));
                }
                cx.answer(res)
            }
        }
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// `NonZero(x)`: only when `x` is a known constant (its output shape depends on data).
pub(super) struct NonZero;

impl Op for NonZero {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let v = cx.value(0)?;
        let st = strides(&x.shape);
        let hits: Vec<usize> = (0..v.data.len())
            .filter(|&i| v.data.float(i) != 0.0)
            .collect();
        let mut out = vec![0i64; x.rank() * hits.len()];
        for (j, &h) in hits.iter().enumerate() {
            for (d, &s) in st.iter().enumerate() {
                out[d * hits.len() + j] = ((h / s) % x.shape[d]) as i64;
            }
        }
        Ok(vec![Fact::with_value(
            DType::I64,
            Value::ints(vec![x.rank(), hits.len()], out),
        )])
    }
    no_flops!();
    no_gradient_source!();
    /// Coordinates of the non-zero elements, `[rank, count]`.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let st = strides(&x.shape);
        let hits: Vec<usize> = x
            .to_f64s()
            .iter()
            .enumerate()
            .filter(|(_, &v)| v != 0.0)
            .map(|(i, _)| i)
            .collect();
        let mut out = vec![0i64; x.rank() * hits.len()];
        for (j, &h) in hits.iter().enumerate() {
            for (d, &s) in st.iter().enumerate() {
                out[d * hits.len() + j] = ((h / s) % x.shape[d]) as i64;
            }
        }
        Ok(vec![Tensor::i64(vec![x.rank(), hits.len()], out)])
    }
}

/// The scatters' forward: `data` with each update written where its index says
/// (`reduction` none, add, mul, max or min), in index order.
fn scatter_kernel(op: LikeInput, at: &LikeAttrs, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
    let x = cx.input(0)?;
    let f = cx.out(0)?;
    let plan = scatter_plan(op, at, &x.shape, cx.input(1)?)?;
    let red = at.reduction;
    let (mut out, upd) = (x.to_f64s(), cx.input(2)?.to_f64s());
    let per = upd.len() / plan.len().max(1);
    for (k, &dst) in plan.iter().enumerate() {
        for j in 0..per {
            let (o, u) = (&mut out[dst + j], upd[k * per + j]);
            *o = match red {
                "add" => *o + u,
                "mul" => *o * u,
                "max" => o.max(u),
                "min" => o.min(u),
                _ => u,
            };
        }
    }
    Ok(vec![Tensor::from_f64(f.dtype, x.shape.clone(), out)?])
}

/// The flat offset in `data` (of `shape`) each update goes to: one per update
/// element (ScatterElements, Scatter: the index replaces the coordinate along
/// `axis`), or one per update slice (ScatterND: the first `k` coordinates,
/// the slice contiguous after them). Negative indices count from the end.
fn scatter_plan(
    op: LikeInput,
    at: &LikeAttrs,
    shape: &[usize],
    idx: &Tensor,
) -> RuleResult<Vec<usize>> {
    let ids = idx.to_i64s();
    let strides = crate::ops::layout::contiguous(shape);
    let fix = |v: i64, d: usize| -> RuleResult<usize> {
        let u = if v < 0 { v + d as i64 } else { v };
        if u < 0 || u as usize >= d {
            return Err(format!("index {v} is out of range for a dimension of {d}").into());
        }
        Ok(u as usize)
    };
    if op == LikeInput::ScatterNd {
        let k = *idx.shape.last().ok_or("indices must have rank 1 or more")?;
        if k > shape.len() {
            return Err(format!("index tuples of {k} for a rank-{} data", shape.len()).into());
        }
        return ids
            .chunks(k.max(1))
            .map(|t| {
                t.iter()
                    .enumerate()
                    .map(|(a, &v)| Ok(fix(v, shape[a])? * strides[a]))
                    .sum()
            })
            .collect();
    }
    let ax = axis(at.axis, shape.len())?;
    let istr = crate::ops::layout::contiguous(&idx.shape);
    (0..ids.len())
        .map(|p| {
            let mut off = 0;
            for a in 0..shape.len() {
                let c = (p / istr[a]) % idx.shape[a];
                let c = if a == ax { fix(ids[p], shape[a])? } else { c };
                off += c * strides[a];
            }
            Ok(off)
        })
        .collect()
}

/// `OneHot(indices, depth, values) -> output`: `indices`' shape with `depth`
/// (a constant) inserted at `axis` (default -1, counting the new axis), of
/// `values`' type: `values[1]` where the index (negative ones count from
/// `depth`) equals the position, `values[0]` elsewhere and for indices out of
/// range.
/// PyTorch's `one_hot` has no gradient (its values are constants).
pub(super) struct OneHot;

impl OneHot {
    /// The new axis (attribute `axis`, default -1) of an output of rank `rank`.
    fn axis(attrs: &crate::ir::Attrs, rank: usize) -> RuleResult<usize> {
        axis(attrs.int_or("axis", -1), rank)
    }

    fn depth(cx: &Cx) -> RuleResult<usize> {
        let v = cx.value(1)?;
        if v.data.len() != 1 {
            return Err(format!("depth must hold one value, got shape {:?}", v.shape).into());
        }
        let d = v.data.float(0);
        if !(d >= 1.0 && d <= (1u64 << 40) as f64) {
            return Err(format!("depth {d} is not a positive count").into());
        }
        Ok(d as usize)
    }
}

impl Op for OneHot {
    fn arity(&self) -> Arity {
        Arity::new(3, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let values = cx.input(2)?;
        if values.numel() != 2 {
            return Err(format!("values must be [off, on], got {:?}", values.shape).into());
        }
        let depth = Self::depth(cx)?;
        let ax = Self::axis(cx.attrs(), x.rank() + 1)?;
        let mut shape = x.shape.clone();
        shape.insert(ax, depth);
        Ok(vec![Fact::new(values.dtype, shape)])
    }
    no_flops!();
    no_gradient_source!();
    /// As the module documents, in the values' type.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let f = cx.out(0)?;
        let vals = cx.input(2)?.to_f64s();
        let ax = Self::axis(cx.attrs(), x.rank() + 1)?;
        let depth = f.shape[ax];
        let idx = x.to_f64s();
        let inner: usize = x.shape[ax..].iter().product();
        let mut out = vec![vals[0]; idx.len() * depth];
        for (j, &i) in idx.iter().enumerate() {
            let i = if i < 0.0 { i + depth as f64 } else { i };
            if i >= 0.0 && (i as usize) < depth {
                let (o, r) = (j / inner, j % inner);
                out[(o * depth + i as usize) * inner + r] = vals[1];
            }
        }
        Ok(vec![Tensor::from_f64(f.dtype, f.shape.clone(), out)?])
    }
}
