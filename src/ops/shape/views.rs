//! Ops that are views in PyTorch: Reshape, Flatten, Transpose, Squeeze, Unsqueeze,
//! Expand (with their strides, `ops::layout`).

#[allow(unused_imports)]
use super::*;

/// The ops that keep input 0's elements in order under a new shape, and differ
/// only in how they compute it (their kind, given at registration):
/// `Reshape(data, shape)`: 0 copies the input dim (unless `allowzero`), -1 is inferred;
/// `Flatten(x)` to 2-D at `axis` (default 1);
/// `Squeeze(x, axes?)`: drops the listed size-1 axes (all size-1 axes if none);
/// `Unsqueeze(x, axes)`: inserts size-1 axes at positions of the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum View {
    Reshape,
    Flatten,
    Squeeze,
    Unsqueeze,
}

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
            -1 => return Err(format!("shape {target:?} has more than one -1").into()),
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
            return Err(
                format!("cannot reshape {input:?} ({total} elements) to {target:?}").into(),
            );
        }
        out[i] = (total / known) as usize;
    } else if known != total {
        return Err(format!(
            "cannot reshape {input:?} ({total} elements) to {target:?} ({known} elements)"
        )
        .into());
    }
    Ok(out)
}

impl View {
    /// The output shape for input `x`.
    fn shape(self, cx: &Cx, x: &Fact) -> RuleResult<Vec<usize>> {
        match self {
            View::Reshape => {
                let target = cx.value(1)?.to_ints();
                reshape_target(&x.shape, &target, cx.attrs().int_or("allowzero", 0) != 0)
            }
            View::Flatten => {
                let a = cx.attrs().int_or("axis", 1);
                let a = if a == x.rank() as i64 {
                    x.rank()
                } else {
                    axis(a, x.rank())?
                };
                Ok(vec![
                    numel(&x.shape[..a]) as usize,
                    numel(&x.shape[a..]) as usize,
                ])
            }
            View::Squeeze => squeezed(cx, x),
            View::Unsqueeze => unsqueezed(cx, x),
        }
    }
}

/// Squeeze's output shape.
fn squeezed(cx: &Cx, x: &Fact) -> RuleResult<Vec<usize>> {
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
        )
        .into());
    }
    Ok((0..x.rank())
        .filter(|i| !axes.contains(i))
        .map(|i| x.shape[i])
        .collect())
}

/// Unsqueeze's output shape.
fn unsqueezed(cx: &Cx, x: &Fact) -> RuleResult<Vec<usize>> {
    let raw = axes_arg(cx)?.ok_or("missing axes")?;
    let r = x.rank() + raw.len();
    let mut axes: Vec<usize> = raw.iter().map(|&a| axis(a, r)).collect::<RuleResult<_>>()?;
    axes.sort_unstable();
    if axes.windows(2).any(|w| w[0] == w[1]) {
        return Err(format!("repeated axes {raw:?}").into());
    }
    let mut src = x.shape.iter();
    Ok((0..r)
        .map(|i| {
            if axes.contains(&i) {
                1
            } else {
                *src.next().expect("rank matches")
            }
        })
        .collect())
}

impl Op for View {
    fn arity(&self) -> Arity {
        match self {
            View::Reshape => Arity::new(2, 2, 1, 1),
            View::Flatten => Arity::new(1, 1, 1, 1),
            View::Squeeze | View::Unsqueeze => Arity::new(1, 2, 1, 1),
        }
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let shape = self.shape(cx, x)?;
        let value = x.value.as_ref().map(|v| with_shape(v, shape.clone()));
        Ok(vec![Fact {
            dtype: x.dtype,
            shape,
            value: value.map(Box::new),
        }])
    }
    no_flops!();
    /// A view: the gradient is reshaped back; nothing saved.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        nothing_saved_backward(out)
    }
    /// Reshape and Flatten copy a strided input; Squeeze and Unsqueeze are views.
    fn storage(&self, _cx: &Cx) -> Storage {
        match self {
            View::Reshape | View::Flatten => Storage::Reshape,
            View::Squeeze | View::Unsqueeze => Storage::View,
        }
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
        CudaKernels::new(Launch::Reshape, COPIES, &["strided_copy_b4"])
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// `Transpose(x)` by `perm` (default: reverse).
pub(super) struct Transpose;

/// Transpose's `perm` against rank `r` (default: reverse), checked to be a permutation.
fn perm(attrs: &crate::ir::Attrs, r: usize) -> RuleResult<Vec<usize>> {
    let perm: Vec<usize> = match attrs.ints("perm") {
        Some(p) => p.iter().map(|&a| axis(a, r)).collect::<RuleResult<_>>()?,
        None => (0..r).rev().collect(),
    };
    let mut seen = vec![false; r];
    if perm.len() != r || perm.iter().any(|&p| std::mem::replace(&mut seen[p], true)) {
        return Err(format!("perm {perm:?} is not a permutation of rank {r}").into());
    }
    Ok(perm)
}

impl Op for Transpose {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let perm = perm(cx.attrs(), x.rank())?;
        let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
        let st = strides(&x.shape);
        Ok(vec![remapped_fact(x, shape, |c| {
            c.iter().zip(&perm).map(|(&ci, &p)| ci * st[p]).sum()
        })])
    }
    no_flops!();
    /// A strided view: the gradient is transposed back; nothing saved.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        nothing_saved_backward(out)
    }
    fn storage(&self, _cx: &Cx) -> Storage {
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
        let perm = perm(cx.attrs(), x.rank())?;
        let st = strides(&x.shape);
        let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
        let pst: Vec<isize> = perm.iter().map(|&p| st[p] as isize).collect();
        Ok(vec![x.select(&affine_offsets(&shape, 0, &pst), shape)])
    }
    /// The gradient transposed back (the inverse permutation).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let x = cx.input(0)?;
        let r = x.rank();
        let perm = perm(cx.attrs(), r)?;
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
        CudaKernels::new(Launch::Transpose, COPIES, &["strided_copy_b4"])
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// Axes of Squeeze/Unsqueeze: attribute before opset 13, input 1 from 13.
pub(super) fn axes_arg(cx: &Cx) -> RuleResult<Option<Vec<i64>>> {
    if cx.opset >= 13 {
        cx.opt_ints(1)
    } else {
        Ok(cx.attrs().ints("axes").map(|v| v.to_vec()))
    }
}

/// `Expand(x, shape)`: broadcast of `x` to `shape`.
pub(super) struct Expand;

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
        let st = strides(&x.shape);
        let off = shape.len() - x.rank();
        Ok(vec![remapped_fact(x, shape, |c| {
            (0..x.rank())
                .map(|i| {
                    if x.shape[i] == 1 {
                        0
                    } else {
                        c[off + i] * st[i]
                    }
                })
                .sum()
        })])
    }
    no_flops!();
    /// A broadcast view; the gradient is summed back; nothing saved.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        nothing_saved_backward(out)
    }
    fn storage(&self, _cx: &Cx) -> Storage {
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
        CudaKernels::new(Launch::Expand, COPIES, &["reduce_f32", "strided_copy_b4"])
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// `BitCast(x)` (opset 26): the same bytes read as `to`. Equal widths keep the
/// shape; a wider input gains a last dimension of the width ratio, a narrower one
/// loses its last dimension, which must equal the ratio (as
/// `torch.Tensor.view(dtype)`, a view).
pub(super) struct BitCast;

impl Op for BitCast {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let to = dtype_attr(cx.attrs().int("to").ok_or("attribute 'to' is required")?)?;
        let (from_bits, to_bits) = (x.dtype.bits(), to.bits());
        if from_bits % 8 != 0 || to_bits % 8 != 0 || from_bits == 0 || to_bits == 0 {
            return Err(format!("cannot reinterpret {} as {to}", x.dtype).into());
        }
        let mut shape = x.shape.clone();
        if from_bits > to_bits {
            shape.push((from_bits / to_bits) as usize);
        } else if from_bits < to_bits {
            let k = (to_bits / from_bits) as usize;
            if shape.last() != Some(&k) {
                return Err(format!(
                    "reinterpreting {} {:?} as {to} needs a last dimension of {k}",
                    x.dtype, x.shape
                )
                .into());
            }
            shape.pop();
        }
        Ok(vec![Fact::new(to, shape)])
    }
    no_flops!();
    /// A reinterpretation of bits: no gradient.
    fn backward(&self, _cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(None)
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::View
    }
    /// float32 ↔ int32 (the widths the executor holds both of); any type to itself.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let to = cx.out(0)?.dtype;
        match (x.dtype(), to) {
            (a, b) if a == b => Ok(vec![x.clone()]),
            (DType::F32, DType::I32) => {
                let v = x
                    .as_f32()?
                    .iter()
                    .map(|f| f.to_bits() as i32 as i64)
                    .collect();
                Ok(vec![Tensor::from_i64(to, x.shape.clone(), v)?])
            }
            (DType::I32, DType::F32) => {
                let v = x
                    .to_i64s()
                    .into_iter()
                    .map(|i| f32::from_bits(i as i32 as u32))
                    .collect();
                Ok(vec![Tensor::f32(x.shape.clone(), v)])
            }
            _ => crate::ops::no_kernel(cx),
        }
    }
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        no_gradient(cx)
    }
    /// Runs on the host on the GPU backend.
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}
