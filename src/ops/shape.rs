//! Shape and data-movement ops, including the shape-computation subgraphs exporters
//! emit (Shape → Gather → Unsqueeze → Concat → Reshape, Range, ConstantOfShape,
//! Expand ...). When inputs carry constant values these ops fold them, so later
//! Reshape/Expand/Slice nodes see concrete shapes.
//!
//! FLOPs: all ops here move or select data and count 0.

use super::{
    axis, broadcast, dim, dtype_attr, layout, no_backward_kernel, no_gradient, numel, Arity,
    Backward, BackwardCx, CudaKernels, Cx, Fact, KernelCx, Op, Registry, RuleResult, Saved,
    Storage,
};
use crate::ir::value::MAX_FOLD_ELEMS;
use crate::ir::{DType, Data, TensorData, Value};
use crate::numeric::broadcast::{affine_offsets, for_each};
use crate::numeric::grad::sum_to;
use crate::numeric::Tensor;

/// Row-major strides of a shape.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Builds the value of an output whose element `k` (row-major over `out_shape`) is
/// element `src(coord)` of `v`. `None` when the output is too large to fold.
fn remap(v: &Value, out_shape: &[usize], src: impl Fn(&[usize]) -> usize) -> Option<Value> {
    let n: usize = out_shape.iter().product();
    if n > MAX_FOLD_ELEMS {
        return None;
    }
    let mut coord = vec![0usize; out_shape.len()];
    let mut idx = Vec::with_capacity(n);
    for _ in 0..n {
        idx.push(src(&coord));
        for i in (0..coord.len()).rev() {
            coord[i] += 1;
            if coord[i] < out_shape[i] {
                break;
            }
            coord[i] = 0;
        }
    }
    Some(Value {
        shape: out_shape.to_vec(),
        data: v.data.gather(idx.into_iter()),
    })
}

fn with_shape(v: &Value, shape: Vec<usize>) -> Value {
    Value {
        shape,
        data: v.data.clone(),
    }
}

/// Every op here costs 0 FLOPs; this macro writes the `flops` method.
macro_rules! no_flops {
    () => {
        fn flops(&self, _cx: &Cx, _out: &[Fact]) -> u64 {
            0
        }
    };
}

/// `Constant`: from `value` (tensor), `value_float(s)` or `value_int(s)`.
struct Constant;

/// The fact for a literal tensor: its value when small and present in the file.
pub fn literal_fact(t: &TensorData) -> Fact {
    Fact {
        dtype: t.dtype,
        shape: t.dims.clone(),
        value: t.value(),
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
        } else if let Some(crate::ir::Attr::Floats(v)) = a.0.get("value_floats") {
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
    /// Constant or shape-valued: no gradient.
    fn backward(&self, _cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(None)
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// The literal from the attributes.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let a = cx.attrs();
        let f = cx.out(0)?;
        let t = if let Some(t) = a.tensor("value") {
            Tensor::from_data(t)?
        } else if let Some(crate::ir::Attr::Floats(v)) = a.0.get("value_floats") {
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
    /// No gradient flows through it.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        no_gradient(cx)
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
}

/// `Shape(x)` with optional `start`/`end` (opset 15): int64 vector, always folded.
struct ShapeOp;

impl Op for ShapeOp {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let r = x.rank() as i64;
        let clamp = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
        let start = clamp(cx.attrs().int_or("start", 0));
        let end = clamp(cx.attrs().int_or("end", r));
        let dims = x.shape[start..end.max(start)]
            .iter()
            .map(|&d| d as i64)
            .collect();
        Ok(vec![Fact::with_value(DType::I64, Value::vec(dims))])
    }
    no_flops!();
    /// Constant or shape-valued: no gradient.
    fn backward(&self, _cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(None)
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// The input's dims (from `start` to `end`) as int64.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let r = x.rank() as i64;
        let clamp = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
        let start = clamp(cx.attrs().int_or("start", 0));
        let end = clamp(cx.attrs().int_or("end", r)).max(start);
        let dims: Vec<i64> = x.shape[start..end].iter().map(|&d| d as i64).collect();
        Ok(vec![Tensor::i64(vec![dims.len()], dims)])
    }
    /// No gradient flows through it.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        no_gradient(cx)
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
}

/// `Size(x)`: int64 scalar, folded.
struct Size;

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
    /// Constant or shape-valued: no gradient.
    fn backward(&self, _cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(None)
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// The element count as an int64 scalar.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        Ok(vec![Tensor::i64(vec![], vec![cx.input(0)?.numel() as i64])])
    }
    /// No gradient flows through it.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        no_gradient(cx)
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
}

/// `Reshape(data, shape)`: 0 copies the input dim (unless `allowzero`), -1 is inferred.
struct Reshape;

/// Resolves a Reshape target against the input shape.
pub fn reshape_target(input: &[usize], target: &[i64], allowzero: bool) -> RuleResult<Vec<usize>> {
    let mut out = Vec::with_capacity(target.len());
    let mut infer_at = None;
    for (i, &t) in target.iter().enumerate() {
        match t {
            -1 if infer_at.is_none() => {
                infer_at = Some(i);
                out.push(1);
            }
            -1 => return Err(format!("shape {target:?} has more than one -1")),
            0 if !allowzero => out.push(*input.get(i).ok_or_else(|| {
                format!(
                    "shape {target:?} copies dim {i} of a rank-{} input",
                    input.len()
                )
            })?),
            t => out.push(dim(t, "target dimension")?),
        }
    }
    let total = numel(input);
    let known = numel(&out);
    if let Some(i) = infer_at {
        if known == 0 || total % known != 0 {
            return Err(format!(
                "cannot reshape {input:?} ({total} elements) to {target:?}"
            ));
        }
        out[i] = (total / known) as usize;
    } else if known != total {
        return Err(format!(
            "cannot reshape {input:?} ({total} elements) to {target:?} ({known} elements)"
        ));
    }
    Ok(out)
}

impl Op for Reshape {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let target = cx.value(1)?.to_ints();
        let shape = reshape_target(&x.shape, &target, cx.attrs().int_or("allowzero", 0) != 0)?;
        let value = x.value.as_ref().map(|v| with_shape(v, shape.clone()));
        Ok(vec![Fact {
            dtype: x.dtype,
            shape,
            value,
        }])
    }
    no_flops!();
    /// A view: the gradient is reshaped back; nothing saved.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if !out[0].dtype.is_float() {
            return Ok(None);
        }
        let _ = cx;
        Ok(Some(Backward::each(&[0], &[], out[0].numel())))
    }
    fn storage(&self, cx: &Cx) -> Storage {
        let _ = cx;
        Storage::Reshape
    }
    /// A view where PyTorch's `computeStride` finds one, else a copy.
    fn view_strides(
        &self,
        cx: &Cx,
        _k: usize,
        out: &Fact,
        strides: &[usize],
    ) -> Option<Vec<usize>> {
        layout::view(&cx.inputs[0]?.shape, strides, &out.shape)
    }
    /// The same elements under the inferred shape.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        Ok(vec![cx.input(0)?.reshaped(cx.out(0)?.shape.clone())?])
    }
    /// The gradient under the input's shape.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        cx.answer(vec![(0, cx.grad(0)?.into_owned())])
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(COPIES, &["strided_copy_b4"])
    }
}

/// `Flatten(x)` to 2-D at `axis` (default 1).
struct Flatten;

impl Op for Flatten {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let a = cx.attrs().int_or("axis", 1);
        let a = if a == x.rank() as i64 {
            x.rank()
        } else {
            axis(a, x.rank())?
        };
        let shape = vec![numel(&x.shape[..a]) as usize, numel(&x.shape[a..]) as usize];
        let value = x.value.as_ref().map(|v| with_shape(v, shape.clone()));
        Ok(vec![Fact {
            dtype: x.dtype,
            shape,
            value,
        }])
    }
    no_flops!();
    /// A view: the gradient is reshaped back; nothing saved.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if !out[0].dtype.is_float() {
            return Ok(None);
        }
        let _ = cx;
        Ok(Some(Backward::each(&[0], &[], out[0].numel())))
    }
    fn storage(&self, cx: &Cx) -> Storage {
        let _ = cx;
        Storage::Reshape
    }
    /// A view where PyTorch's `computeStride` finds one, else a copy.
    fn view_strides(
        &self,
        cx: &Cx,
        _k: usize,
        out: &Fact,
        strides: &[usize],
    ) -> Option<Vec<usize>> {
        layout::view(&cx.inputs[0]?.shape, strides, &out.shape)
    }
    /// The same elements under the inferred shape.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        Ok(vec![cx.input(0)?.reshaped(cx.out(0)?.shape.clone())?])
    }
    /// The gradient under the input's shape.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        cx.answer(vec![(0, cx.grad(0)?.into_owned())])
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(COPIES, &["strided_copy_b4"])
    }
}

/// `Transpose(x)` by `perm` (default: reverse).
struct Transpose;

impl Op for Transpose {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let r = x.rank();
        let perm: Vec<usize> = match cx.attrs().ints("perm") {
            Some(p) => p.iter().map(|&a| axis(a, r)).collect::<RuleResult<_>>()?,
            None => (0..r).rev().collect(),
        };
        let mut seen = vec![false; r];
        if perm.len() != r || perm.iter().any(|&p| std::mem::replace(&mut seen[p], true)) {
            return Err(format!("perm {perm:?} is not a permutation of rank {r}"));
        }
        let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
        let st = strides(&x.shape);
        let value = x.value.as_ref().and_then(|v| {
            remap(v, &shape, |c| {
                c.iter().zip(&perm).map(|(&ci, &p)| ci * st[p]).sum()
            })
        });
        Ok(vec![Fact {
            dtype: x.dtype,
            shape,
            value,
        }])
    }
    no_flops!();
    /// A strided view: the gradient is transposed back; nothing saved.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if !out[0].dtype.is_float() {
            return Ok(None);
        }
        let _ = cx;
        Ok(Some(Backward::each(&[0], &[], out[0].numel())))
    }
    fn storage(&self, cx: &Cx) -> Storage {
        let _ = cx;
        Storage::StridedView
    }
    /// Output dim `j` is input dim `perm[j]`.
    fn view_strides(
        &self,
        cx: &Cx,
        _k: usize,
        _out: &Fact,
        strides: &[usize],
    ) -> Option<Vec<usize>> {
        let r = strides.len();
        match cx.attrs().ints("perm") {
            Some(p) => p
                .iter()
                .map(|&a| axis(a, r).ok().map(|a| strides[a]))
                .collect(),
            None => Some(strides.iter().rev().copied().collect()),
        }
    }
    /// A copy in the permuted order.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let r = x.rank();
        let perm: Vec<usize> = match cx.attrs().ints("perm") {
            Some(p) => p.iter().map(|&a| axis(a, r)).collect::<RuleResult<_>>()?,
            None => (0..r).rev().collect(),
        };
        let st = strides(&x.shape);
        let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
        let pst: Vec<isize> = perm.iter().map(|&p| st[p] as isize).collect();
        Ok(vec![x.select(&affine_offsets(&shape, 0, &pst), shape)])
    }
    /// The gradient transposed back (the inverse permutation).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let x = cx.input(0)?;
        let r = x.rank();
        let perm: Vec<usize> = match cx.attrs().ints("perm") {
            Some(p) => p.iter().map(|&a| axis(a, r)).collect::<RuleResult<_>>()?,
            None => (0..r).rev().collect(),
        };
        let gst = strides(&cx.output(0)?.shape);
        // Input dim perm[j] is output dim j.
        let mut st = vec![0isize; r];
        for (j, &p) in perm.iter().enumerate() {
            st[p] = gst[j] as isize;
        }
        let g = cx.grad(0)?;
        let dx = affine_offsets(&x.shape, 0, &st)
            .into_iter()
            .map(|o| g[o])
            .collect();
        cx.answer(vec![(0, dx)])
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(COPIES, &["strided_copy_b4"])
    }
}

/// Axes of Squeeze/Unsqueeze: attribute before opset 13, input 1 from 13.
fn axes_arg(cx: &Cx) -> RuleResult<Option<Vec<i64>>> {
    if cx.opset >= 13 {
        cx.opt_ints(1)
    } else {
        Ok(cx.attrs().ints("axes").map(|v| v.to_vec()))
    }
}

/// `Squeeze(x, axes?)`: drops the listed size-1 axes (all size-1 axes if none).
struct Squeeze;

impl Op for Squeeze {
    fn arity(&self) -> Arity {
        Arity::new(1, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let axes: Vec<usize> = match axes_arg(cx)? {
            Some(a) => a
                .iter()
                .map(|&a| axis(a, x.rank()))
                .collect::<RuleResult<_>>()?,
            None => (0..x.rank()).filter(|&i| x.shape[i] == 1).collect(),
        };
        if let Some(&a) = axes.iter().find(|&&a| x.shape[a] != 1) {
            return Err(format!(
                "cannot squeeze axis {a} of size {} in {:?}",
                x.shape[a], x.shape
            ));
        }
        let shape: Vec<usize> = (0..x.rank())
            .filter(|i| !axes.contains(i))
            .map(|i| x.shape[i])
            .collect();
        let value = x.value.as_ref().map(|v| with_shape(v, shape.clone()));
        Ok(vec![Fact {
            dtype: x.dtype,
            shape,
            value,
        }])
    }
    no_flops!();
    /// A view; nothing saved.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if !out[0].dtype.is_float() {
            return Ok(None);
        }
        let _ = cx;
        Ok(Some(Backward::each(&[0], &[], out[0].numel())))
    }
    fn storage(&self, cx: &Cx) -> Storage {
        let _ = cx;
        Storage::View
    }
    /// A view where PyTorch's `computeStride` finds one, else a copy.
    fn view_strides(
        &self,
        cx: &Cx,
        _k: usize,
        out: &Fact,
        strides: &[usize],
    ) -> Option<Vec<usize>> {
        layout::view(&cx.inputs[0]?.shape, strides, &out.shape)
    }
    /// The same elements under the inferred shape.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        Ok(vec![cx.input(0)?.reshaped(cx.out(0)?.shape.clone())?])
    }
    /// The gradient under the input's shape.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        cx.answer(vec![(0, cx.grad(0)?.into_owned())])
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(COPIES, &["strided_copy_b4"])
    }
}

/// `Unsqueeze(x, axes)`: inserts size-1 axes at positions of the output.
struct Unsqueeze;

impl Op for Unsqueeze {
    fn arity(&self) -> Arity {
        Arity::new(1, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let raw = axes_arg(cx)?.ok_or("missing axes")?;
        let r = x.rank() + raw.len();
        let mut axes: Vec<usize> = raw.iter().map(|&a| axis(a, r)).collect::<RuleResult<_>>()?;
        axes.sort_unstable();
        if axes.windows(2).any(|w| w[0] == w[1]) {
            return Err(format!("repeated axes {raw:?}"));
        }
        let mut src = x.shape.iter();
        let shape: Vec<usize> = (0..r)
            .map(|i| {
                if axes.contains(&i) {
                    1
                } else {
                    *src.next().expect("rank matches")
                }
            })
            .collect();
        let value = x.value.as_ref().map(|v| with_shape(v, shape.clone()));
        Ok(vec![Fact {
            dtype: x.dtype,
            shape,
            value,
        }])
    }
    no_flops!();
    /// A view; nothing saved.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if !out[0].dtype.is_float() {
            return Ok(None);
        }
        let _ = cx;
        Ok(Some(Backward::each(&[0], &[], out[0].numel())))
    }
    fn storage(&self, cx: &Cx) -> Storage {
        let _ = cx;
        Storage::View
    }
    /// A view where PyTorch's `computeStride` finds one, else a copy.
    fn view_strides(
        &self,
        cx: &Cx,
        _k: usize,
        out: &Fact,
        strides: &[usize],
    ) -> Option<Vec<usize>> {
        layout::view(&cx.inputs[0]?.shape, strides, &out.shape)
    }
    /// The same elements under the inferred shape.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        Ok(vec![cx.input(0)?.reshaped(cx.out(0)?.shape.clone())?])
    }
    /// The gradient under the input's shape.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        cx.answer(vec![(0, cx.grad(0)?.into_owned())])
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(COPIES, &["strided_copy_b4"])
    }
}

/// `Concat(inputs...)` along `axis`.
struct Concat;

impl Op for Concat {
    fn arity(&self) -> Arity {
        Arity::new(1, usize::MAX, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let ins = (0..cx.inputs.len())
            .map(|i| cx.input(i))
            .collect::<RuleResult<Vec<_>>>()?;
        let first = ins[0];
        let a = axis(
            cx.attrs().int("axis").ok_or("missing attribute 'axis'")?,
            first.rank(),
        )?;
        let mut shape = first.shape.clone();
        shape[a] = 0;
        for f in &ins {
            if f.rank() != first.rank()
                || f.shape
                    .iter()
                    .enumerate()
                    .any(|(i, &d)| i != a && d != first.shape[i])
            {
                return Err(format!(
                    "inputs {:?} and {:?} differ outside axis {a}",
                    first.shape, f.shape
                ));
            }
            shape[a] = shape[a]
                .checked_add(f.shape[a])
                .ok_or("concatenated size overflows")?;
        }
        let vals: Option<Vec<&Value>> = ins.iter().map(|f| f.value.as_ref()).collect();
        let value = vals
            .filter(|_| numel(&shape) as usize <= MAX_FOLD_ELEMS)
            .map(|vals| {
                let outer: usize = shape[..a].iter().product();
                let float = first.dtype.is_float();
                let mut ints = Vec::new();
                let mut floats = Vec::new();
                for o in 0..outer {
                    for v in &vals {
                        let chunk: usize = v.shape[a..].iter().product();
                        for k in o * chunk..(o + 1) * chunk {
                            if float {
                                floats.push(v.data.float(k));
                            } else {
                                ints.push(v.data.int(k));
                            }
                        }
                    }
                }
                Value {
                    shape: shape.clone(),
                    data: if float {
                        Data::Float(floats)
                    } else {
                        Data::Int(ints)
                    },
                }
            });
        Ok(vec![Fact {
            dtype: first.dtype,
            shape,
            value,
        }])
    }
    no_flops!();
    /// The gradient is sliced back per input; nothing saved.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if !out[0].dtype.is_float() {
            return Ok(None);
        }
        let _ = cx;
        Ok(Some(Backward::each(
            &(0..cx.inputs.len()).collect::<Vec<_>>(),
            &[],
            out[0].numel(),
        )))
    }
    fn storage(&self, cx: &Cx) -> Storage {
        let _ = cx;
        Storage::New
    }
    /// Inputs (one element type) joined along `axis`.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let ins = (0..cx.inputs.len())
            .map(|i| cx.input(i))
            .collect::<RuleResult<Vec<_>>>()?;
        let out = cx.out(0)?.shape.clone();
        let a = axis(
            cx.attrs().int("axis").ok_or("missing attribute 'axis'")?,
            out.len(),
        )?;
        let outer: usize = out[..a].iter().product();
        let chunks: Vec<usize> = ins.iter().map(|t| t.shape[a..].iter().product()).collect();
        let total: usize = out.iter().product();
        let elems = crate::numeric::tensor::with_same_elems!(&ins, parts => {
            let mut v = Vec::with_capacity(total);
            for o in 0..outer {
                for (p, &c) in parts.iter().zip(&chunks) {
                    v.extend_from_slice(&p[o * c..(o + 1) * c]);
                }
            }
            v
        });
        Ok(vec![Tensor::new(out, elems)])
    }
    /// Each input's part of the gradient, cut along `axis`.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let out = cx.output(0)?.shape.clone();
        let a = axis(
            cx.attrs().int("axis").ok_or("missing attribute 'axis'")?,
            out.len(),
        )?;
        let outer: usize = out[..a].iter().product();
        let row: usize = out[a..].iter().product();
        let g = cx.grad(0)?;
        let mut res = Vec::new();
        let mut start = 0;
        for i in 0..cx.node.inputs.len() {
            let chunk: usize = cx.input(i)?.shape[a..].iter().product();
            if cx.wants(i) {
                let mut v = Vec::with_capacity(outer * chunk);
                for o in 0..outer {
                    v.extend_from_slice(&g[o * row + start..o * row + start + chunk]);
                }
                res.push((i, v));
            }
            start += chunk;
        }
        cx.answer(res)
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(COPIES, &["strided_copy_b4"])
    }
}

/// `Split(x, split?)` along `axis`: sizes from input 1 (opset 13+) or the `split`
/// attribute, else `num_outputs` / the output count, ceil-divided (opset 18).
struct Split;

impl Op for Split {
    fn arity(&self) -> Arity {
        Arity::new(1, 2, 1, usize::MAX)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let a = axis(cx.attrs().int_or("axis", 0), x.rank())?;
        let n = cx.n_outputs();
        let total = x.shape[a];
        let sizes: Vec<usize> = match if cx.opset >= 13 {
            cx.opt_ints(1)?
        } else {
            cx.attrs().ints("split").map(|v| v.to_vec())
        } {
            Some(s) => s
                .iter()
                .map(|&v| dim(v, "split size"))
                .collect::<RuleResult<_>>()?,
            None => {
                let chunk = total.div_ceil(n.max(1));
                (0..n)
                    .map(|i| chunk.min(total.saturating_sub(i * chunk)))
                    .collect()
            }
        };
        let covered = sizes.iter().try_fold(0usize, |a, &s| a.checked_add(s));
        if sizes.len() != n || covered != Some(total) {
            return Err(format!(
                "split sizes {sizes:?} do not cover axis {a} of size {total} with {n} outputs"
            ));
        }
        Ok(sizes
            .iter()
            .map(|&s| {
                let mut shape = x.shape.clone();
                shape[a] = s;
                Fact::new(x.dtype, shape)
            })
            .collect())
    }
    no_flops!();
    /// Views (`split`/`chunk`); the gradient is concatenated back; nothing saved.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if !out[0].dtype.is_float() {
            return Ok(None);
        }
        Ok(Some(Backward::each(
            &[0],
            &[],
            out.iter().map(Fact::numel).sum(),
        )))
    }
    /// Splitting the leading axis keeps each piece contiguous; any other axis does not.
    fn storage(&self, cx: &Cx) -> Storage {
        let leading = cx.inputs[0].is_some_and(|x| {
            let a = cx.attrs().int_or("axis", 0);
            let a = if a < 0 { a + x.rank() as i64 } else { a };
            x.shape[..a.max(0) as usize].iter().all(|&d| d == 1)
        });
        if leading {
            Storage::View
        } else {
            Storage::StridedView
        }
    }
    /// Each piece keeps the input's strides.
    fn view_strides(
        &self,
        _cx: &Cx,
        _k: usize,
        _out: &Fact,
        strides: &[usize],
    ) -> Option<Vec<usize>> {
        Some(strides.to_vec())
    }
    /// Consecutive pieces along `axis`, sized as inference gave them.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let a = axis(cx.attrs().int_or("axis", 0), x.rank())?;
        let outer: usize = x.shape[..a].iter().product();
        let inner: usize = x.shape[a + 1..].iter().product();
        let d = x.shape[a];
        let mut start = 0;
        let mut outs = Vec::with_capacity(cx.n_outputs());
        for i in 0..cx.n_outputs() {
            let shape = cx.out(i)?.shape.clone();
            let len = shape[a];
            let mut idx = Vec::with_capacity(outer * len * inner);
            for o in 0..outer {
                let base = (o * d + start) * inner;
                idx.extend(base..base + len * inner);
            }
            outs.push(x.select(&idx, shape));
            start += len;
        }
        Ok(outs)
    }
    /// The outputs' gradients joined along `axis` (zeros for an output without one).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let x = cx.input(0)?;
        let a = axis(cx.attrs().int_or("axis", 0), x.rank())?;
        let outer: usize = x.shape[..a].iter().product();
        let grads = (0..cx.outputs.len())
            .map(|i| {
                let len: usize = cx.output(i)?.shape[a..].iter().product();
                Ok((cx.grad(i)?, len))
            })
            .collect::<RuleResult<Vec<_>>>()?;
        let mut v = Vec::with_capacity(x.shape.iter().product());
        for o in 0..outer {
            for (g, len) in &grads {
                v.extend_from_slice(&g[o * len..(o + 1) * len]);
            }
        }
        cx.answer(vec![(0, v)])
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(COPIES, &["strided_copy_b4"])
    }
}

/// `Slice(data, starts, ends, axes?, steps?)` (opset 10+; attributes before).
struct Slice;

impl Slice {
    /// The output shape, and per input dim the first index and the step, from the
    /// starts, ends, axes and steps (runtime inputs; attributes before opset 10),
    /// clamped as the spec says.
    fn plan(cx: &Cx) -> RuleResult<(Vec<usize>, Vec<i64>, Vec<i64>)> {
        let x = cx.input(0)?;
        let r = x.rank();
        let (starts, ends, axes, steps) = if cx.opset >= 10 {
            (
                cx.value(1)?.to_ints(),
                cx.value(2)?.to_ints(),
                cx.opt_ints(3)?,
                cx.opt_ints(4)?,
            )
        } else {
            let a = cx.attrs();
            (
                a.ints("starts").ok_or("missing starts")?.to_vec(),
                a.ints("ends").ok_or("missing ends")?.to_vec(),
                a.ints("axes").map(|v| v.to_vec()),
                None,
            )
        };
        let axes: Vec<usize> = match axes {
            Some(a) => a.iter().map(|&v| axis(v, r)).collect::<RuleResult<_>>()?,
            None => (0..starts.len()).collect(),
        };
        let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
        if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
            return Err("starts, ends, axes and steps differ in length".into());
        }
        let mut shape = x.shape.clone();
        let mut begin = vec![0i64; r];
        let mut step = vec![1i64; r];
        for i in 0..starts.len() {
            let (a, s) = (axes[i], steps[i]);
            if s == 0 {
                return Err("slice step 0".into());
            }
            let d = x.shape[a] as i64;
            let norm = |v: i64| if v < 0 { v.saturating_add(d) } else { v };
            let (b, e) = if s > 0 {
                (norm(starts[i]).clamp(0, d), norm(ends[i]).clamp(0, d))
            } else {
                (
                    norm(starts[i]).clamp(0, d - 1),
                    norm(ends[i]).clamp(-1, d - 1),
                )
            };
            let (b2, e2, s2) = (b as i128, e as i128, s as i128);
            let len = if s > 0 {
                (e2 - b2 + s2 - 1) / s2
            } else {
                (b2 - e2 - s2 - 1) / -s2
            };
            shape[a] = len.max(0) as usize;
            begin[a] = b;
            step[a] = s;
        }
        Ok((shape, begin, step))
    }
}

impl Op for Slice {
    fn arity(&self) -> Arity {
        Arity::new(1, 5, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let (shape, begin, step) = Slice::plan(cx)?;
        let st = strides(&x.shape);
        let value = x.value.as_ref().and_then(|v| {
            remap(v, &shape, |c| {
                c.iter()
                    .enumerate()
                    .map(|(i, &ci)| (begin[i] + ci as i64 * step[i]) as usize * st[i])
                    .sum()
            })
        });
        Ok(vec![Fact {
            dtype: x.dtype,
            shape,
            value,
        }])
    }
    no_flops!();
    /// A strided view (`narrow`/basic indexing); nothing saved.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if !out[0].dtype.is_float() {
            return Ok(None);
        }
        let _ = cx;
        Ok(Some(Backward::each(&[0], &[], out[0].numel())))
    }
    fn storage(&self, cx: &Cx) -> Storage {
        let _ = cx;
        Storage::StridedView
    }
    /// A stepped axis multiplies its stride (a negative step is not followed).
    fn view_strides(
        &self,
        cx: &Cx,
        _k: usize,
        _out: &Fact,
        strides: &[usize],
    ) -> Option<Vec<usize>> {
        let (_, _, step) = Slice::plan(cx).ok()?;
        strides
            .iter()
            .zip(&step)
            .map(|(&st, &s)| usize::try_from(s).ok().map(|s| st.saturating_mul(s)))
            .collect()
    }
    /// Starts, ends, axes and steps read from the runtime inputs (attributes
    /// before opset 10), clamped as the spec says; negative steps walk backwards.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let r = x.rank();
        let (starts, ends, axes, steps) = if cx.opset >= 10 {
            (
                cx.input(1)?.to_i64s(),
                cx.input(2)?.to_i64s(),
                cx.opt(3).map(Tensor::to_i64s),
                cx.opt(4).map(Tensor::to_i64s),
            )
        } else {
            let a = cx.attrs();
            (
                a.ints("starts").ok_or("missing starts")?.to_vec(),
                a.ints("ends").ok_or("missing ends")?.to_vec(),
                a.ints("axes").map(|v| v.to_vec()),
                None,
            )
        };
        let _ = r;
        if ends.len() != starts.len() {
            return Err("starts and ends differ in length".into());
        }
        let shape = cx.out(0)?.shape.clone();
        let offs = slice_offsets(&x.shape, &starts, axes, steps, &shape)?;
        Ok(vec![x.select(&offs, shape)])
    }
    /// The gradient written back where the slice read, zeros elsewhere; starts,
    /// axes and steps are constants (folded facts or attributes).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let x = cx.input(0)?;
        let konst = |i: usize| -> RuleResult<Option<Vec<i64>>> {
            match cx.inputs.get(i).copied().flatten() {
                None => Ok(None),
                Some(f) => f
                    .value
                    .as_ref()
                    .map(|v| Some(v.to_ints()))
                    .ok_or_else(|| format!("input {i} must be a constant")),
            }
        };
        let (starts, axes, steps) = if cx.opset >= 10 {
            (konst(1)?.ok_or("missing starts")?, konst(3)?, konst(4)?)
        } else {
            let a = cx.attrs();
            (
                a.ints("starts").ok_or("missing starts")?.to_vec(),
                a.ints("axes").map(|v| v.to_vec()),
                None,
            )
        };
        let out = cx.output(0)?.shape.clone();
        let offs = slice_offsets(&x.shape, &starts, axes, steps, &out)?;
        let g = cx.grad(0)?;
        let mut dx = vec![0f32; x.shape.iter().product()];
        for (&o, &gv) in offs.iter().zip(g.iter()) {
            dx[o] += gv;
        }
        cx.answer(vec![(0, dx)])
    }
    /// On the device one block along one axis with step 1 (`x[..., a:b]`, as
    /// rotary embeddings slice); any other slice runs on the host there.
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(COPIES, &["strided_copy_b4"])
    }
}

/// Flat source offsets of a slice of a `shape` tensor, as `out` (its inferred
/// shape) orders them.
fn slice_offsets(
    shape: &[usize],
    starts: &[i64],
    axes: Option<Vec<i64>>,
    steps: Option<Vec<i64>>,
    out: &[usize],
) -> RuleResult<Vec<usize>> {
    let r = shape.len();
    let axes: Vec<usize> = match axes {
        Some(a) => a.iter().map(|&v| axis(v, r)).collect::<RuleResult<_>>()?,
        None => (0..starts.len()).collect(),
    };
    let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
    if axes.len() != starts.len() || steps.len() != starts.len() {
        return Err("starts, axes and steps differ in length".into());
    }
    let st = strides(shape);
    let mut base = 0isize;
    let mut vst: Vec<isize> = st.iter().map(|&s| s as isize).collect();
    for i in 0..starts.len() {
        let (a, s) = (axes[i], steps[i]);
        if s == 0 {
            return Err("slice step 0".into());
        }
        let d = shape[a] as i64;
        let norm = |v: i64| if v < 0 { v.saturating_add(d) } else { v };
        let b = if s > 0 {
            norm(starts[i]).clamp(0, d)
        } else {
            norm(starts[i]).clamp(0, d - 1)
        };
        base += b as isize * st[a] as isize;
        vst[a] = s as isize * st[a] as isize;
    }
    Ok(affine_offsets(out, base, &vst))
}

/// `Gather(data, indices)` along `axis`: `data[:axis] + indices + data[axis+1:]`.
struct Gather;

impl Gather {
    /// A scalar constant index: PyTorch's `x[:, i]`.
    fn is_select(cx: &Cx) -> bool {
        cx.opt(1)
            .is_some_and(|i| i.rank() == 0 && i.value.is_some())
    }
}

impl Op for Gather {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (x, ind) = (cx.input(0)?, cx.input(1)?);
        if !ind.dtype.is_int() {
            return Err(format!("indices must be integers, got {}", ind.dtype));
        }
        let a = axis(cx.attrs().int_or("axis", 0), x.rank())?;
        let mut shape = x.shape[..a].to_vec();
        shape.extend(&ind.shape);
        shape.extend(&x.shape[a + 1..]);
        let d = x.shape[a] as i64;
        let value = match (&x.value, &ind.value) {
            (Some(v), Some(iv)) => {
                let idx: Vec<i64> = iv.to_ints();
                if let Some(bad) = idx.iter().find(|&&i| i < -d || i >= d) {
                    return Err(format!("index {bad} out of range for axis of size {d}"));
                }
                let st = strides(&x.shape);
                let ir = ind.rank();
                remap(v, &shape, |c| {
                    let mut flat_i = 0;
                    for (k, &ck) in c[a..a + ir].iter().enumerate() {
                        flat_i = flat_i * ind.shape[k] + ck;
                    }
                    let i = idx[flat_i];
                    let i = if i < 0 { i + d } else { i } as usize;
                    let mut off = i * st[a];
                    for (k, &ck) in c[..a].iter().enumerate() {
                        off += ck * st[k];
                    }
                    for (k, &ck) in c[a + ir..].iter().enumerate() {
                        off += ck * st[a + 1 + k];
                    }
                    off
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
    no_flops!();
    /// A constant scalar index is `select` (a view, nothing saved); otherwise
    /// index_select/embedding, which save the indices.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if !out[0].dtype.is_float() {
            return Ok(None);
        }
        let needs: &[Saved] = if Self::is_select(cx) {
            &[]
        } else {
            &[Saved::Input(1)]
        };
        Ok(Some(Backward::each(&[0], needs, out[0].numel())))
    }
    fn storage(&self, cx: &Cx) -> Storage {
        if Self::is_select(cx) {
            Storage::StridedView
        } else {
            Storage::New
        }
    }
    /// A select drops its axis.
    fn view_strides(
        &self,
        cx: &Cx,
        _k: usize,
        _out: &Fact,
        strides: &[usize],
    ) -> Option<Vec<usize>> {
        let a = axis(cx.attrs().int_or("axis", 0), strides.len()).ok()?;
        let mut st = strides.to_vec();
        st.remove(a);
        Some(st)
    }
    /// Rows of `data` along `axis` picked by the runtime indices (negative ones
    /// count from the end; out of range is an error).
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let (x, ind) = (cx.input(0)?, cx.input(1)?);
        let a = axis(cx.attrs().int_or("axis", 0), x.rank())?;
        let outer: usize = x.shape[..a].iter().product();
        let inner: usize = x.shape[a + 1..].iter().product();
        let d = x.shape[a] as i64;
        let idx = ind.to_i64s();
        let rows = idx
            .iter()
            .map(|&i| {
                if i < -d || i >= d {
                    Err(format!("index {i} out of range for axis of size {d}"))
                } else {
                    Ok((if i < 0 { i + d } else { i }) as usize)
                }
            })
            .collect::<RuleResult<Vec<_>>>()?;
        let mut flat = Vec::with_capacity(outer * rows.len() * inner);
        for o in 0..outer {
            for &row in &rows {
                let base = (o * d as usize + row) * inner;
                flat.extend(base..base + inner);
            }
        }
        Ok(vec![x.select(&flat, cx.out(0)?.shape.clone())])
    }
    /// The gradient rows added into zeros at the indices: the saved indices, or
    /// the constant scalar index of a `select` (which saves nothing).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let x = cx.input(0)?;
        let a = axis(cx.attrs().int_or("axis", 0), x.rank())?;
        let idx = if Self::is_select(&cx.rule_cx()) {
            cx.input(1)?.value.as_ref().expect("select").to_ints()
        } else {
            cx.saved(Saved::Input(1))?.to_i64s()
        };
        let outer: usize = x.shape[..a].iter().product();
        let inner: usize = x.shape[a + 1..].iter().product();
        let d = x.shape[a];
        let g = cx.grad(0)?;
        let mut dx = vec![0f32; x.shape.iter().product()];
        let mut k = 0;
        for o in 0..outer {
            for &i in &idx {
                let row = if i < 0 { i + d as i64 } else { i };
                if row < 0 || row >= d as i64 {
                    return Err(format!("index {i} out of range for axis of size {d}"));
                }
                let base = (o * d + row as usize) * inner;
                for (t, &gv) in dx[base..base + inner].iter_mut().zip(&g[k..k + inner]) {
                    *t += gv;
                }
                k += inner;
            }
        }
        cx.answer(vec![(0, dx)])
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(&["gather_f32"], &["gather_bwd_f32"])
    }
}

/// `GatherElements(data, indices)`: the shape of `indices`.
struct GatherElements;

impl Op for GatherElements {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (x, ind) = (cx.input(0)?, cx.input(1)?);
        if x.rank() != ind.rank() {
            return Err(format!(
                "data {:?} and indices {:?} differ in rank",
                x.shape, ind.shape
            ));
        }
        Ok(vec![Fact::new(x.dtype, ind.shape.clone())])
    }
    no_flops!();
    /// GatherBackward scatters through the saved indices.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if !out[0].dtype.is_float() {
            return Ok(None);
        }
        let _ = cx;
        Ok(Some(Backward::each(
            &[0],
            &[Saved::Input(1)],
            out[0].numel(),
        )))
    }
    fn storage(&self, cx: &Cx) -> Storage {
        let _ = cx;
        Storage::New
    }
    /// `out[c] = data[c with c[axis] = indices[c]]`.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let (x, ind) = (cx.input(0)?, cx.input(1)?);
        let a = axis(cx.attrs().int_or("axis", 0), x.rank())?;
        let xst = strides(&x.shape);
        let ist: Vec<isize> = xst.iter().map(|&s| s as isize).collect();
        let base = affine_offsets(&ind.shape, 0, &ist);
        let inner: usize = ind.shape[a + 1..].iter().product();
        let d = x.shape[a] as i64;
        let idx = ind.to_i64s();
        let flat = base
            .iter()
            .enumerate()
            .map(|(k, &b)| {
                let c = (k / inner.max(1)) % ind.shape[a].max(1);
                let i = idx[k];
                if i < -d || i >= d {
                    return Err(format!("index {i} out of range for axis of size {d}"));
                }
                let i = if i < 0 { i + d } else { i } as usize;
                Ok(b - c * xst[a] + i * xst[a])
            })
            .collect::<RuleResult<Vec<_>>>()?;
        Ok(vec![x.select(&flat, ind.shape.clone())])
    }
    /// The gradient added into zeros at the saved indices.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let x = cx.input(0)?;
        let ind = cx.saved(Saved::Input(1))?;
        let a = axis(cx.attrs().int_or("axis", 0), x.rank())?;
        let xst = strides(&x.shape);
        let ist: Vec<isize> = xst.iter().map(|&s| s as isize).collect();
        let base = affine_offsets(&ind.shape, 0, &ist);
        let inner: usize = ind.shape[a + 1..].iter().product();
        let d = x.shape[a] as i64;
        let idx = ind.to_i64s();
        let g = cx.grad(0)?;
        let mut dx = vec![0f32; x.shape.iter().product()];
        for (k, &b) in base.iter().enumerate() {
            let c = (k / inner.max(1)) % ind.shape[a].max(1);
            let i = idx[k];
            if i < -d || i >= d {
                return Err(format!("index {i} out of range for axis of size {d}"));
            }
            let i = if i < 0 { i + d } else { i } as usize;
            dx[b - c * xst[a] + i * xst[a]] += g[k];
        }
        cx.answer(vec![(0, dx)])
    }
    /// Device kernels (exec::cuda::ops, forward); the backward runs on the host.
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(
            &[
                "gather_elements_b1",
                "gather_elements_b4",
                "gather_elements_b8",
            ],
            &[],
        )
    }
}

/// `ConstantOfShape(shape)`, filled with `value` (default float32 0).
struct ConstantOfShape;

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
            value,
        }])
    }
    no_flops!();
    /// Constant or shape-valued: no gradient.
    fn backward(&self, _cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(None)
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
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
    /// No gradient flows through it.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        no_gradient(cx)
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
}

/// `Range(start, limit, delta)`: 1-D of `max(ceil((limit-start)/delta), 0)` elements.
struct Range;

impl Op for Range {
    fn arity(&self) -> Arity {
        Arity::new(3, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let dtype = cx.input(0)?.dtype;
        let get = |i| -> RuleResult<f64> {
            cx.value(i)?
                .scalar_float()
                .ok_or_else(|| format!("input {i} must be a scalar"))
        };
        let (s, l, d) = (get(0)?, get(1)?, get(2)?);
        if d == 0.0 {
            return Err("delta is 0".into());
        }
        let n = ((l - s) / d).ceil().max(0.0);
        if n > u32::MAX as f64 {
            return Err(format!("range of {n} elements is too large"));
        }
        let n = n as usize;
        let value = (n <= MAX_FOLD_ELEMS).then(|| Value {
            shape: vec![n],
            data: if dtype.is_float() {
                Data::Float((0..n).map(|i| s + i as f64 * d).collect())
            } else {
                Data::Int((0..n).map(|i| (s + i as f64 * d) as i64).collect())
            },
        });
        Ok(vec![Fact {
            dtype,
            shape: vec![n],
            value,
        }])
    }
    no_flops!();
    /// Constant or shape-valued: no gradient.
    fn backward(&self, _cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(None)
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// `start + i·delta` for the inferred length, in the input type.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let f = cx.out(0)?;
        let n = f.shape[0];
        let get = |i: usize| -> RuleResult<&Tensor> {
            let t = cx.input(i)?;
            if t.numel() != 1 {
                return Err(format!("input {i} must be a scalar"));
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
    /// No gradient flows through it.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        no_gradient(cx)
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
}

/// `Expand(x, shape)`: broadcast of `x` to `shape`.
struct Expand;

impl Op for Expand {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let target: Vec<usize> = cx
            .value(1)?
            .to_ints()
            .iter()
            .map(|&d| dim(d, "dimension"))
            .collect::<RuleResult<_>>()?;
        let shape = broadcast(&[&x.shape, &target])?;
        let value = x.value.as_ref().and_then(|v| {
            let st = strides(&x.shape);
            let off = shape.len() - x.rank();
            remap(v, &shape, |c| {
                (0..x.rank())
                    .map(|i| {
                        if x.shape[i] == 1 {
                            0
                        } else {
                            c[off + i] * st[i]
                        }
                    })
                    .sum()
            })
        });
        Ok(vec![Fact {
            dtype: x.dtype,
            shape,
            value,
        }])
    }
    no_flops!();
    /// A broadcast view; the gradient is summed back; nothing saved.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if !out[0].dtype.is_float() {
            return Ok(None);
        }
        let _ = cx;
        Ok(Some(Backward::each(&[0], &[], out[0].numel())))
    }
    fn storage(&self, cx: &Cx) -> Storage {
        let _ = cx;
        Storage::StridedView
    }
    /// Broadcast dims get stride 0.
    fn view_strides(
        &self,
        cx: &Cx,
        _k: usize,
        out: &Fact,
        strides: &[usize],
    ) -> Option<Vec<usize>> {
        Some(layout::expand(&cx.inputs[0]?.shape, strides, &out.shape))
    }
    /// A copy broadcast to the inferred shape.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let shape = cx.out(0)?.shape.clone();
        let mut idx = Vec::with_capacity(shape.iter().product());
        for_each(&shape, [&x.shape[..]], |_, [i]| idx.push(i));
        Ok(vec![x.select(&idx, shape)])
    }
    /// The gradient summed back over the broadcast axes.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let g = cx.grad(0)?;
        let dx = sum_to(&g, &cx.output(0)?.shape, &cx.input(0)?.shape);
        cx.answer(vec![(0, dx)])
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(COPIES, &["reduce_f32", "strided_copy_b4"])
    }
}

/// `Tile(x, repeats)`.
struct Tile;

impl Op for Tile {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let reps = cx.value(1)?.to_ints();
        if reps.len() != x.rank() {
            return Err(format!("repeats {reps:?} do not match rank {}", x.rank()));
        }
        let shape = x
            .shape
            .iter()
            .zip(&reps)
            .map(|(&d, &r)| {
                d.checked_mul(dim(r, "repeat")?)
                    .ok_or_else(|| format!("tiling {d} by {r} overflows"))
            })
            .collect::<RuleResult<Vec<_>>>()?;
        let st = strides(&x.shape);
        let value = x.value.as_ref().and_then(|v| {
            remap(v, &shape, |c| {
                c.iter()
                    .enumerate()
                    .map(|(i, &ci)| (ci % x.shape[i].max(1)) * st[i])
                    .sum()
            })
        });
        Ok(vec![Fact {
            dtype: x.dtype,
            shape,
            value,
        }])
    }
    no_flops!();
    /// The gradient is summed over the repeats; nothing saved.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if !out[0].dtype.is_float() {
            return Ok(None);
        }
        let _ = cx;
        Ok(Some(Backward::each(&[0], &[], out[0].numel())))
    }
    fn storage(&self, cx: &Cx) -> Storage {
        let _ = cx;
        Storage::New
    }
    /// Output coordinate `c` reads input coordinate `c mod dims`.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let shape = cx.out(0)?.shape.clone();
        let st = strides(&x.shape);
        let n: usize = shape.iter().product();
        let ost = strides(&shape);
        let idx: Vec<usize> = (0..n)
            .map(|k| {
                (0..shape.len())
                    .map(|i| ((k / ost[i]) % shape[i]) % x.shape[i].max(1) * st[i])
                    .sum()
            })
            .collect();
        Ok(vec![x.select(&idx, shape)])
    }
    /// The gradient summed over the repeats.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let x = cx.input(0)?;
        let shape = cx.output(0)?.shape.clone();
        let st = strides(&x.shape);
        let ost = strides(&shape);
        let g = cx.grad(0)?;
        let mut dx = vec![0f64; x.shape.iter().product()];
        for (k, &gv) in g.iter().enumerate() {
            let i: usize = (0..shape.len())
                .map(|d| ((k / ost[d]) % shape[d]) % x.shape[d].max(1) * st[d])
                .sum();
            dx[i] += gv as f64;
        }
        cx.answer(vec![(0, dx.into_iter().map(|v| v as f32).collect())])
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
}

/// `Pad(x, pads, constant_value?, axes?)` (pads input from opset 11, attribute before).
struct Pad;

impl Op for Pad {
    fn arity(&self) -> Arity {
        Arity::new(1, 4, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let r = x.rank();
        let pads = if cx.opset >= 11 {
            cx.value(1)?.to_ints()
        } else {
            cx.attrs().ints("pads").ok_or("missing pads")?.to_vec()
        };
        let axes: Vec<usize> = match cx.opt_ints(3)? {
            Some(a) => a.iter().map(|&v| axis(v, r)).collect::<RuleResult<_>>()?,
            None => (0..r).collect(),
        };
        if pads.len() != 2 * axes.len() {
            return Err(format!("pads {pads:?} do not match {} axes", axes.len()));
        }
        let mut shape = x.shape.clone();
        for (k, &a) in axes.iter().enumerate() {
            let d = shape[a] as i128 + pads[k] as i128 + pads[k + axes.len()] as i128;
            shape[a] =
                usize::try_from(d).map_err(|_| format!("padded size {d} is out of range"))?;
        }
        Ok(vec![Fact::new(x.dtype, shape)])
    }
    no_flops!();
    /// The gradient is the un-padded slice; nothing saved.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if !out[0].dtype.is_float() {
            return Ok(None);
        }
        let _ = cx;
        Ok(Some(Backward::each(&[0], &[], out[0].numel())))
    }
    fn storage(&self, cx: &Cx) -> Storage {
        let _ = cx;
        Storage::New
    }
    /// `constant` (value from input 2, default 0), `edge` and `reflect` modes.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let r = x.rank();
        let pads = if cx.opset >= 11 {
            cx.input(1)?.to_i64s()
        } else {
            cx.attrs().ints("pads").ok_or("missing pads")?.to_vec()
        };
        let _ = r;
        let mode = cx.attrs().string("mode").unwrap_or("constant");
        let shape = cx.out(0)?.shape.clone();
        let src = pad_sources(
            &x.shape,
            &shape,
            &pads,
            cx.opt(3).map(Tensor::to_i64s),
            mode,
        )?;
        let fill = match cx.opt(2) {
            Some(v) if v.numel() == 1 => v.cast(x.dtype())?,
            _ => Tensor::zeros(x.dtype(), vec![1])?,
        };
        let both = [x, &fill];
        let joined = crate::numeric::tensor::with_same_elems!(&both, p => {
            src.iter().map(|o| match o { Some(o) => p[0][*o], None => p[1][0] }).collect()
        });
        Ok(vec![Tensor::new(shape, joined)])
    }
    /// The gradient added back to the input element each output element read
    /// (the un-padded slice for `constant`); pads and axes are constants.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let x = cx.input(0)?;
        let konst = |i: usize| -> RuleResult<Option<Vec<i64>>> {
            match cx.inputs.get(i).copied().flatten() {
                None => Ok(None),
                Some(f) => f
                    .value
                    .as_ref()
                    .map(|v| Some(v.to_ints()))
                    .ok_or_else(|| format!("input {i} must be a constant")),
            }
        };
        let pads = if cx.opset >= 11 {
            konst(1)?.ok_or("missing pads")?
        } else {
            cx.attrs().ints("pads").ok_or("missing pads")?.to_vec()
        };
        let mode = cx.attrs().string("mode").unwrap_or("constant");
        let src = pad_sources(&x.shape, &cx.output(0)?.shape, &pads, konst(3)?, mode)?;
        let g = cx.grad(0)?;
        let mut dx = vec![0f32; x.shape.iter().product()];
        for (s, &gv) in src.iter().zip(g.iter()) {
            if let Some(s) = s {
                dx[*s] += gv;
            }
        }
        cx.answer(vec![(0, dx)])
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
}

/// For every element of the padded output (`out`), the flat offset of the input
/// element it copies, `None` for the constant fill.
fn pad_sources(
    xshape: &[usize],
    shape: &[usize],
    pads: &[i64],
    axes: Option<Vec<i64>>,
    mode: &str,
) -> RuleResult<Vec<Option<usize>>> {
    let r = xshape.len();
    let axes: Vec<usize> = match axes {
        Some(a) => a.iter().map(|&v| axis(v, r)).collect::<RuleResult<_>>()?,
        None => (0..r).collect(),
    };
    if pads.len() < axes.len() {
        return Err(format!("pads {pads:?} do not match {} axes", axes.len()));
    }
    let mut begin = vec![0i64; r];
    for (k, &a) in axes.iter().enumerate() {
        begin[a] = pads[k];
    }
    let ost = strides(shape);
    let st = strides(xshape);
    let n: usize = shape.iter().product();
    let mut src: Vec<Option<usize>> = Vec::with_capacity(n);
    for k in 0..n {
        let mut off = Some(0usize);
        for i in 0..r {
            let d = xshape[i] as i64;
            let c = ((k / ost[i]) % shape[i]) as i64 - begin[i];
            let c = if (0..d).contains(&c) {
                Some(c)
            } else {
                match mode {
                    "edge" if d > 0 => Some(c.clamp(0, d - 1)),
                    "reflect" if d > 1 => {
                        let period = 2 * (d - 1);
                        let m = c.rem_euclid(period);
                        Some(if m < d { m } else { period - m })
                    }
                    "constant" => None,
                    other => {
                        return Err(format!("pad mode '{other}' on size {d} is not supported"))
                    }
                }
            };
            off = match (off, c) {
                (Some(o), Some(c)) => Some(o + c as usize * st[i]),
                _ => None,
            };
        }
        src.push(off);
    }
    Ok(src)
}

/// Ops whose output is shaped like input 0: Trilu, ScatterND, ScatterElements, EyeLike.
struct LikeInput {
    arity: Arity,
}

impl Op for LikeInput {
    fn arity(&self) -> Arity {
        self.arity
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let dtype = match cx.attrs().int("dtype") {
            Some(code) if cx.node.op_type == "EyeLike" => dtype_attr(code)?,
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
        Ok(match cx.node.op_type.as_str() {
            "EyeLike" => None,
            "Trilu" => Some(Backward::each(&[0], &[], n)),
            _ => Some(Backward::each(&[0, 2], &[Saved::Input(1)], n)),
        })
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// Trilu (keeps the upper or lower triangle from diagonal `k`) and EyeLike
    /// (ones on diagonal `k`); the scatters have no kernel yet.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let f = cx.out(0)?;
        let r = x.rank();
        if r < 2 {
            return super::no_kernel(cx);
        }
        let (h, w) = (x.shape[r - 2], x.shape[r - 1]);
        match cx.node.op_type.as_str() {
            "Trilu" => {
                let k = cx
                    .opt(1)
                    .map_or(0, |t| t.to_i64s().first().copied().unwrap_or(0));
                let upper = cx.attrs().int_or("upper", 1) != 0;
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
            "EyeLike" => {
                let k = cx.attrs().int_or("k", 0);
                let v = (0..x.numel())
                    .map(|i| ((i % w) as i64 - ((i / w) % h) as i64 == k) as i64)
                    .collect();
                Ok(vec![Tensor::from_i64(f.dtype, x.shape.clone(), v)?])
            }
            _ => super::no_kernel(cx),
        }
    }
    /// Trilu: the gradient masked by the same triangle (`k` a constant). EyeLike
    /// has no gradient; the scatters have no kernel yet.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        match cx.node.op_type.as_str() {
            "EyeLike" => no_gradient(cx),
            "Trilu" => {
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
                let upper = cx.attrs().int_or("upper", 1) != 0;
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
            _ => no_backward_kernel(cx),
        }
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
}

/// `NonZero(x)`: only when `x` is a known constant (its output shape depends on data).
struct NonZero;

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
    /// Constant or shape-valued: no gradient.
    fn backward(&self, _cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(None)
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
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
    /// No gradient flows through it.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        no_gradient(cx)
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
}

/// The strided copies of the data-movement ops, one per element size.
const COPIES: &[&str] = &["strided_copy_b1", "strided_copy_b4", "strided_copy_b8"];

/// Registers shape and data-movement ops.
pub fn register(r: &mut Registry) {
    r.add("Constant", Constant);
    r.add("Shape", ShapeOp);
    r.add("Size", Size);
    r.add("Reshape", Reshape);
    r.add("Flatten", Flatten);
    r.add("Transpose", Transpose);
    r.add("Squeeze", Squeeze);
    r.add("Unsqueeze", Unsqueeze);
    r.add("Concat", Concat);
    r.add("Split", Split);
    r.add("Slice", Slice);
    r.add("Gather", Gather);
    r.add("GatherElements", GatherElements);
    r.add("ConstantOfShape", ConstantOfShape);
    r.add("Range", Range);
    r.add("Expand", Expand);
    r.add("Tile", Tile);
    r.add("Pad", Pad);
    r.add("NonZero", NonZero);
    r.add(
        "Trilu",
        LikeInput {
            arity: Arity::new(1, 2, 1, 1),
        },
    );
    r.add(
        "ScatterND",
        LikeInput {
            arity: Arity::new(3, 3, 1, 1),
        },
    );
    r.add(
        "ScatterElements",
        LikeInput {
            arity: Arity::new(3, 3, 1, 1),
        },
    );
    r.add(
        "EyeLike",
        LikeInput {
            arity: Arity::new(1, 1, 1, 1),
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reshape_rules() {
        assert_eq!(
            reshape_target(&[2, 3, 4], &[0, -1], false).unwrap(),
            vec![2, 12]
        );
        assert_eq!(
            reshape_target(&[2, 3, 4], &[4, 0, 2], false).unwrap(),
            vec![4, 3, 2]
        );
        assert!(reshape_target(&[2, 3, 4], &[5, -1], false).is_err());
        assert!(reshape_target(&[2, 3, 4], &[-1, -1], false).is_err());
        assert!(reshape_target(&[8, 768], &[1, 768], false).is_err());
    }
}
