//! Ops that select or join parts of tensors: Concat, Split, Slice, Gather,
//! GatherElements.

#[allow(unused_imports)]
use super::*;

/// `Concat(inputs...)` along `axis`.
pub(super) struct Concat;

/// Concat's attributes.
struct ConcatAttrs {
    /// `axis` (required).
    axis: Option<i64>,
}

impl ConcatAttrs {
    fn of(attrs: &crate::ir::Attrs) -> ConcatAttrs {
        ConcatAttrs {
            axis: attrs.int("axis"),
        }
    }

    /// The joined axis of rank-`rank` inputs.
    fn axis(&self, rank: usize) -> RuleResult<usize> {
        axis(self.axis.ok_or("missing attribute 'axis'")?, rank)
    }
}

impl Op for Concat {
    fn arity(&self) -> Arity {
        Arity::new(1, usize::MAX, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let ins = (0..cx.inputs.len())
            .map(|i| cx.input(i))
            .collect::<RuleResult<Vec<_>>>()?;
        let first = ins[0];
        let a = ConcatAttrs::of(cx.attrs()).axis(first.rank())?;
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
                )
                .into());
            }
            shape[a] = shape[a]
                .checked_add(f.shape[a])
                .ok_or("concatenated size overflows")?;
        }
        let vals: Option<Vec<&Value>> = ins.iter().map(|f| f.value.as_deref()).collect();
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
            value: value.map(Box::new),
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
    /// A new tensor, as `torch.cat` makes even of one tensor (DenseNet's first
    /// layer of a block), but for one integer input: the dynamo exporter writes
    /// `x[idx]` as `GatherND` over a Concat of the one index unsqueezed, which
    /// PyTorch never makes (its IndexBackward saves the index itself), so a view
    /// like Identity.
    fn storage(&self, cx: &Cx) -> Storage {
        match cx.inputs.as_slice() {
            [Some(only)] if only.dtype.is_int() => Storage::View,
            _ => Storage::New,
        }
    }
    /// Inputs (one element type) joined along `axis`.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let ins = (0..cx.inputs.len())
            .map(|i| cx.input(i))
            .collect::<RuleResult<Vec<_>>>()?;
        let out = cx.out(0)?.shape.clone();
        let a = ConcatAttrs::of(cx.attrs()).axis(out.len())?;
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
        let a = ConcatAttrs::of(cx.attrs()).axis(out.len())?;
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
        CudaKernels::new(Launch::Concat, COPIES, &["strided_copy_b4"])
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// `Split(x, split?)` along `axis`: sizes from input 1 (opset 13+) or the `split`
/// attribute, else `num_outputs` / the output count, ceil-divided (opset 18).
pub(super) struct Split;

/// Split's attributes.
struct SplitAttrs {
    /// `axis` (default 0).
    axis: i64,
    /// `split` (the sizes, before opset 13; an input since).
    split: Option<Vec<i64>>,
}

impl SplitAttrs {
    fn of(attrs: &crate::ir::Attrs) -> SplitAttrs {
        SplitAttrs {
            axis: attrs.int_or("axis", 0),
            split: attrs.ints("split").map(<[i64]>::to_vec),
        }
    }
}

impl Op for Split {
    fn arity(&self) -> Arity {
        Arity::new(1, 2, 1, usize::MAX)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let at = SplitAttrs::of(cx.attrs());
        let a = axis(at.axis, x.rank())?;
        let n = cx.n_outputs();
        let total = x.shape[a];
        let sizes: Vec<usize> = match if cx.opset >= 13 {
            cx.opt_ints(1)?
        } else {
            at.split
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
            )
            .into());
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
            let a = SplitAttrs::of(cx.attrs()).axis;
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
        let a = axis(SplitAttrs::of(cx.attrs()).axis, x.rank())?;
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
        let a = axis(SplitAttrs::of(cx.attrs()).axis, x.rank())?;
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
        CudaKernels::new(Launch::Split, COPIES, &["strided_copy_b4"])
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// `Slice(data, starts, ends, axes?, steps?)` (opset 10+; attributes before).
pub(super) struct Slice;

/// Slice's attributes (before opset 10; inputs since).
struct SliceAttrs {
    /// `starts` (required).
    starts: Option<Vec<i64>>,
    /// `ends` (required).
    ends: Option<Vec<i64>>,
    /// `axes` (default: the first ones).
    axes: Option<Vec<i64>>,
}

impl SliceAttrs {
    fn of(attrs: &crate::ir::Attrs) -> SliceAttrs {
        let list = |name| attrs.ints(name).map(<[i64]>::to_vec);
        SliceAttrs {
            starts: list("starts"),
            ends: list("ends"),
            axes: list("axes"),
        }
    }

    fn starts(&self) -> RuleResult<Vec<i64>> {
        Ok(self.starts.clone().ok_or("missing starts")?)
    }

    fn ends(&self) -> RuleResult<Vec<i64>> {
        Ok(self.ends.clone().ok_or("missing ends")?)
    }
}

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
            let a = SliceAttrs::of(cx.attrs());
            (a.starts()?, a.ends()?, a.axes, None)
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
        Ok(vec![remapped_fact(x, shape, |c| {
            c.iter()
                .enumerate()
                .map(|(i, &ci)| (begin[i] + ci as i64 * step[i]) as usize * st[i])
                .sum()
        })])
    }
    no_flops!();
    /// A strided view (`narrow`/basic indexing); nothing saved.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        nothing_saved_backward(out)
    }
    fn storage(&self, _cx: &Cx) -> Storage {
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
            let a = SliceAttrs::of(cx.attrs());
            (a.starts()?, a.ends()?, a.axes, None)
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
                Some(f) => Ok(f
                    .value
                    .as_ref()
                    .map(|v| Some(v.to_ints()))
                    .ok_or_else(|| format!("input {i} must be a constant"))?),
            }
        };
        let (starts, axes, steps) = if cx.opset >= 10 {
            (konst(1)?.ok_or("missing starts")?, konst(3)?, konst(4)?)
        } else {
            let a = SliceAttrs::of(cx.attrs());
            (a.starts()?, a.axes, None)
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
        CudaKernels::new(Launch::Slice, COPIES, &["strided_copy_b4"])
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// Flat source offsets of a slice of a `shape` tensor, as `out` (its inferred
/// shape) orders them.
pub(super) fn slice_offsets(
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
pub(super) struct Gather;

/// Gather's and GatherElements' attributes.
struct GatherAttrs {
    /// `axis` (default 0).
    axis: i64,
}

impl GatherAttrs {
    fn of(attrs: &crate::ir::Attrs) -> GatherAttrs {
        GatherAttrs {
            axis: attrs.int_or("axis", 0),
        }
    }

    /// The gathered axis of a rank-`rank` input.
    fn axis(&self, rank: usize) -> RuleResult<usize> {
        axis(self.axis, rank)
    }
}

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
            return Err(format!("indices must be integers, got {}", ind.dtype).into());
        }
        let a = GatherAttrs::of(cx.attrs()).axis(x.rank())?;
        let mut shape = x.shape[..a].to_vec();
        shape.extend(&ind.shape);
        shape.extend(&x.shape[a + 1..]);
        let d = x.shape[a] as i64;
        let value = match (&x.value, &ind.value) {
            (Some(v), Some(iv)) => {
                let idx: Vec<i64> = iv.to_ints();
                if let Some(bad) = idx.iter().find(|&&i| i < -d || i >= d) {
                    return Err(format!("index {bad} out of range for axis of size {d}").into());
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
            value: value.map(Box::new),
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
        let a = GatherAttrs::of(cx.attrs()).axis(strides.len()).ok()?;
        let mut st = strides.to_vec();
        st.remove(a);
        Some(st)
    }
    /// Rows of `data` along `axis` picked by the runtime indices (negative ones
    /// count from the end; out of range is an error).
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let (x, ind) = (cx.input(0)?, cx.input(1)?);
        let a = GatherAttrs::of(cx.attrs()).axis(x.rank())?;
        let outer: usize = x.shape[..a].iter().product();
        let inner: usize = x.shape[a + 1..].iter().product();
        let d = x.shape[a] as i64;
        let idx = ind.to_i64s();
        let rows = idx
            .iter()
            .map(|&i| {
                if i < -d || i >= d {
                    Err(RuleError::from(format!(
                        "index {i} out of range for axis of size {d}"
                    )))
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
        let a = GatherAttrs::of(cx.attrs()).axis(x.rank())?;
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
                    return Err(format!("index {i} out of range for axis of size {d}").into());
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
        CudaKernels::new(Launch::Gather, &["gather_f32"], &["gather_bwd_f32"])
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// `GatherElements(data, indices)`: the shape of `indices`.
pub(super) struct GatherElements;

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
            )
            .into());
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
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// `out[c] = data[c with c[axis] = indices[c]]`.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let (x, ind) = (cx.input(0)?, cx.input(1)?);
        let a = GatherAttrs::of(cx.attrs()).axis(x.rank())?;
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
                    return Err(RuleError::from(format!(
                        "index {i} out of range for axis of size {d}"
                    )));
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
        let a = GatherAttrs::of(cx.attrs()).axis(x.rank())?;
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
                return Err(format!("index {i} out of range for axis of size {d}").into());
            }
            let i = if i < 0 { i + d } else { i } as usize;
            dx[b - c * xst[a] + i * xst[a]] += g[k];
        }
        cx.answer(vec![(0, dx)])
    }
    /// Device kernels (exec::cuda::ops, forward); the backward runs on the host.
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::new(
            Launch::GatherElements,
            &[
                "gather_elements_b1",
                "gather_elements_b4",
                "gather_elements_b8",
            ],
            &[],
        )
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// `Compress(input, condition)`: the slices along `axis` (the flattened input
/// without one) where the constant boolean `condition` holds; a shorter
/// condition selects among the leading slices.
pub(super) struct Compress;

/// Compress's attributes.
struct CompressAttrs {
    /// `axis` (default: the input flattened).
    axis: Option<i64>,
}

impl CompressAttrs {
    fn of(attrs: &crate::ir::Attrs) -> CompressAttrs {
        CompressAttrs {
            axis: attrs.int("axis"),
        }
    }
}

impl Compress {
    /// The selected positions and the axis (`None`: flattened).
    fn picks(cx: &Cx) -> RuleResult<(Vec<usize>, Option<usize>)> {
        let x = cx.input(0)?;
        let cond = cx.value(1)?.to_ints();
        let ax = match CompressAttrs::of(cx.attrs()).axis {
            Some(a) => Some(axis(a, x.rank())?),
            None => None,
        };
        let len = ax.map_or(x.numel() as usize, |a| x.shape[a]);
        if cond.len() > len {
            return Err(format!("condition has {} values for {len} slices", cond.len()).into());
        }
        let picks = cond
            .iter()
            .enumerate()
            .filter(|(_, &c)| c != 0)
            .map(|(i, _)| i)
            .collect();
        Ok((picks, ax))
    }
}

impl Op for Compress {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let (picks, ax) = Self::picks(cx)?;
        let shape = match ax {
            Some(a) => {
                let mut s = x.shape.clone();
                s[a] = picks.len();
                s
            }
            None => vec![picks.len()],
        };
        Ok(vec![Fact::new(x.dtype, shape)])
    }
    no_flops!();
    /// As `index_select` (or `masked_select` flattened): the gradient scatters
    /// back by the selection, a constant here; nothing saved.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        nothing_saved_backward(out)
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// A gather of the selected slices.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let f = cx.out(0)?;
        let cond = cx.input(1)?.to_i64s();
        let picks: Vec<usize> = (0..cond.len()).filter(|&i| cond[i] != 0).collect();
        let idx: Vec<usize> = match CompressAttrs::of(cx.attrs()).axis {
            None => picks,
            Some(a) => {
                let a = axis(a, x.rank())?;
                let (outer, n) = (x.shape[..a].iter().product::<usize>(), x.shape[a]);
                let inner: usize = x.shape[a + 1..].iter().product();
                let mut v = Vec::with_capacity(f.shape.iter().product());
                for o in 0..outer {
                    for &p in &picks {
                        v.extend((0..inner).map(|i| (o * n + p) * inner + i));
                    }
                }
                v
            }
        };
        Ok(vec![x.select(&idx, f.shape.clone())])
    }
    /// The gradient added back at the selected elements, zeros elsewhere.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let x = cx.input(0)?;
        let (picks, ax) = Self::picks(&cx.rule_cx())?;
        let g = cx.grad(0)?;
        let mut dx = vec![0f32; x.numel() as usize];
        match ax {
            None => {
                for (k, &p) in picks.iter().enumerate() {
                    dx[p] = g[k];
                }
            }
            Some(a) => {
                let (outer, n) = (x.shape[..a].iter().product::<usize>(), x.shape[a]);
                let inner: usize = x.shape[a + 1..].iter().product();
                let mut k = 0;
                for o in 0..outer {
                    for &p in &picks {
                        for i in 0..inner {
                            dx[(o * n + p) * inner + i] = g[k];
                            k += 1;
                        }
                    }
                }
            }
        }
        cx.answer(vec![(0, dx)])
    }
    /// Runs on the host on the GPU backend.
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// `ReverseSequence(input, sequence_lens)`: along `time_axis` (default 0), the
/// first `sequence_lens[b]` steps of each batch entry (`batch_axis`, default 1)
/// reversed; shaped as the input.
pub(super) struct ReverseSequence;

impl ReverseSequence {
    fn axes(cx_attrs: &crate::ir::Attrs, rank: usize) -> RuleResult<(usize, usize)> {
        let b = axis(cx_attrs.int_or("batch_axis", 1), rank)?;
        let t = axis(cx_attrs.int_or("time_axis", 0), rank)?;
        if b == t || b > 1 || t > 1 {
            return Err("batch_axis and time_axis must be 0 and 1".into());
        }
        Ok((b, t))
    }

    /// The source of each element, by flat index.
    fn sources(shape: &[usize], lens: &[i64], (b, t): (usize, usize)) -> Vec<usize> {
        let inner: usize = shape[2..].iter().product();
        let n: usize = shape.iter().product();
        (0..n)
            .map(|i| {
                let (d0, d1, r) = (i / (shape[1] * inner), (i / inner) % shape[1], i % inner);
                let mut pos = [d0, d1];
                let (bi, ti) = (pos[b], pos[t]);
                let len = (lens.get(bi).copied().unwrap_or(0).max(0) as usize).min(shape[t]);
                if ti < len {
                    pos[t] = len - 1 - ti;
                }
                (pos[0] * shape[1] + pos[1]) * inner + r
            })
            .collect()
    }
}

impl Op for ReverseSequence {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        if x.rank() < 2 {
            return Err(format!("input must have rank 2 or more, got {:?}", x.shape).into());
        }
        let (b, _) = Self::axes(cx.attrs(), x.rank())?;
        let l = cx.input(1)?;
        if l.shape != [x.shape[b]] {
            return Err(
                format!("sequence_lens is {:?}, expected [{}]", l.shape, x.shape[b]).into(),
            );
        }
        Ok(vec![Fact::new(x.dtype, x.shape.clone())])
    }
    no_flops!();
    /// `flip` of each sequence: the gradient reversed the same way, reading the
    /// lengths.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        input0_backward(out, &[Saved::Input(1)])
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// A gather by the reversed positions.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let ax = Self::axes(cx.attrs(), x.rank())?;
        let src = Self::sources(&x.shape, &cx.input(1)?.to_i64s(), ax);
        Ok(vec![x.select(&src, x.shape.clone())])
    }
    /// The reversal is its own inverse: the gradient gathered the same way.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let x = cx.input(0)?;
        let ax = Self::axes(cx.attrs(), x.rank())?;
        let lens = cx.saved(Saved::Input(1))?.to_i64s();
        let src = Self::sources(&x.shape, &lens, ax);
        let g = cx.grad(0)?;
        cx.answer(vec![(0, src.iter().map(|&s| g[s]).collect())])
    }
    /// Runs on the host on the GPU backend.
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}
