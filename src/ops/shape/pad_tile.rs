//! Tile and Pad.

#[allow(unused_imports)]
use super::*;

/// `Tile(x, repeats)`.
pub(super) struct Tile;

impl Op for Tile {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let reps = cx.value(1)?.to_ints();
        if reps.len() != x.rank() {
            return Err(format!("repeats {reps:?} do not match rank {}", x.rank()).into());
        }
        let shape = x
            .shape
            .iter()
            .zip(&reps)
            .map(|(&d, &r)| {
                d.checked_mul(dim(r, "repeat")?)
                    .ok_or_else(|| RuleError::from(format!("tiling {d} by {r} overflows")))
            })
            .collect::<RuleResult<Vec<_>>>()?;
        let st = strides(&x.shape);
        Ok(vec![remapped_fact(x, shape, |c| {
            c.iter()
                .enumerate()
                .map(|(i, &ci)| (ci % x.shape[i].max(1)) * st[i])
                .sum()
        })])
    }
    no_flops!();
    /// The gradient is summed over the repeats; nothing saved.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        nothing_saved_backward(out)
    }
    fn storage(&self, _cx: &Cx) -> Storage {
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
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// `Pad(x, pads, constant_value?, axes?)` (pads input from opset 11, attribute before).
pub(super) struct Pad;

/// Pad's attributes.
struct PadAttrs<'a> {
    /// `pads` (before opset 11; an input since).
    pads: Option<&'a [i64]>,
    /// `mode` (default "constant").
    mode: &'a str,
    /// `value` (before opset 11; default 0).
    value: f32,
}

impl PadAttrs<'_> {
    fn of(attrs: &crate::ir::Attrs) -> PadAttrs<'_> {
        PadAttrs {
            pads: attrs.ints("pads"),
            mode: attrs.string("mode").unwrap_or("constant"),
            value: attrs.float("value").unwrap_or(0.0),
        }
    }

    /// The `pads` attribute, required before opset 11.
    fn pads(&self) -> RuleResult<Vec<i64>> {
        Ok(self.pads.ok_or("missing pads")?.to_vec())
    }
}

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
            PadAttrs::of(cx.attrs()).pads()?
        };
        let axes: Vec<usize> = match cx.opt_ints(3)? {
            Some(a) => a.iter().map(|&v| axis(v, r)).collect::<RuleResult<_>>()?,
            None => (0..r).collect(),
        };
        if pads.len() != 2 * axes.len() {
            return Err(format!("pads {pads:?} do not match {} axes", axes.len()).into());
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
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        nothing_saved_backward(out)
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// `constant` (value from input 2, default 0; attribute `value` before opset
    /// 11), `edge` and `reflect` modes.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let at = PadAttrs::of(cx.attrs());
        let pads = if cx.opset >= 11 {
            cx.input(1)?.to_i64s()
        } else {
            at.pads()?
        };
        let mode = at.mode;
        let shape = cx.out(0)?.shape.clone();
        let src = pad_sources(
            &x.shape,
            &shape,
            &pads,
            cx.opt(3).map(Tensor::to_i64s),
            mode,
        )?;
        let fill = match cx.opt(2) {
            Some(v) if v.numel() == 1 && cx.opset >= 11 => v.cast(x.dtype())?,
            // Before opset 11 the value is an attribute.
            _ if cx.opset < 11 => Tensor::from_f64(x.dtype(), vec![1], vec![at.value as f64])?,
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
                Some(f) => Ok(f
                    .value
                    .as_ref()
                    .map(|v| Some(v.to_ints()))
                    .ok_or_else(|| format!("input {i} must be a constant"))?),
            }
        };
        let at = PadAttrs::of(cx.attrs());
        let pads = if cx.opset >= 11 {
            konst(1)?.ok_or("missing pads")?
        } else {
            at.pads()?
        };
        let mode = at.mode;
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
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// For every element of the padded output (`out`), the flat offset of the input
/// element it copies, `None` for the constant fill.
pub(super) fn pad_sources(
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
        return Err(format!("pads {pads:?} do not match {} axes", axes.len()).into());
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
                        return Err(
                            format!("pad mode '{other}' on size {d} is not supported").into()
                        )
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

/// `CenterCropPad(input, shape)`: each of `axes` (default all) centre-cropped or
/// zero-padded to the constant `shape`: a crop starts at `(in − out)/2`, a pad
/// puts `(out − in)/2` zeros first (floors).
pub(super) struct CenterCropPad;

impl CenterCropPad {
    /// The output shape and, per axis, the source offset (`src = dst + offset`).
    fn plan(
        x: &[usize],
        target: &[i64],
        axes: Option<&[i64]>,
    ) -> RuleResult<(Vec<usize>, Vec<i64>)> {
        let axes: Vec<usize> = match axes {
            Some(a) => a
                .iter()
                .map(|&v| axis(v, x.len()))
                .collect::<RuleResult<_>>()?,
            None => (0..x.len()).collect(),
        };
        if target.len() != axes.len() {
            return Err(format!("shape {target:?} does not match {} axes", axes.len()).into());
        }
        let mut shape = x.to_vec();
        let mut off = vec![0i64; x.len()];
        for (&a, &t) in axes.iter().zip(target) {
            let t = dim(t, "target size")?;
            off[a] = (x[a] as i64 - t as i64).div_euclid(2);
            if t > x[a] {
                off[a] = -(((t - x[a]) / 2) as i64);
            }
            shape[a] = t;
        }
        Ok((shape, off))
    }

    /// The source element of each output element (`None`: padding).
    fn sources(x: &[usize], out: &[usize], off: &[i64]) -> Vec<Option<usize>> {
        let n: usize = out.iter().product();
        (0..n)
            .map(|mut i| {
                let mut src = 0usize;
                let mut stride = 1usize;
                for a in (0..out.len()).rev() {
                    let o = (i % out[a]) as i64 + off[a];
                    i /= out[a];
                    if o < 0 || o >= x[a] as i64 {
                        return None;
                    }
                    src += o as usize * stride;
                    stride *= x[a];
                }
                Some(src)
            })
            .collect()
    }
}

impl Op for CenterCropPad {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let target = cx.value(1)?.to_ints();
        let (shape, _) = Self::plan(&x.shape, &target, cx.attrs().ints("axes"))?;
        Ok(vec![Fact::new(x.dtype, shape)])
    }
    no_flops!();
    /// A slice and a pad: the gradient is the matching region; nothing saved.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        nothing_saved_backward(out)
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// A gather with zeros where padded.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let (shape, off) = Self::plan(&x.shape, &cx.input(1)?.to_i64s(), cx.attrs().ints("axes"))?;
        let src = Self::sources(&x.shape, &shape, &off);
        let zero = Tensor::zeros(x.dtype(), vec![1])?;
        let both = [x, &zero];
        let joined = crate::numeric::tensor::with_same_elems!(&both, p => {
            src.iter().map(|o| match o { Some(o) => p[0][*o], None => p[1][0] }).collect()
        });
        Ok(vec![Tensor::new(shape, joined)])
    }
    /// The gradient added back to the source of each output element.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let x = cx.input(0)?;
        let target = match cx
            .inputs
            .get(1)
            .copied()
            .flatten()
            .and_then(|f| f.value.as_ref())
        {
            Some(v) => v.to_ints(),
            None => return Err(RuleError::NotConstant(1)),
        };
        let (shape, off) = Self::plan(&x.shape, &target, cx.attrs().ints("axes"))?;
        let g = cx.grad(0)?;
        let mut dx = vec![0f32; x.numel() as usize];
        for (k, s) in Self::sources(&x.shape, &shape, &off)
            .into_iter()
            .enumerate()
        {
            if let Some(s) = s {
                dx[s] += g[k];
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
