//! Data movement: copies, transposes, concat/split/slice, gather, sums over broadcast axes.

#[allow(unused_imports)]
use super::*;

pub(super) fn copy_kernel(dtype: DType) -> Result<&'static str> {
    Ok(match crate::exec::cuda::tensor::elem_size(dtype)? {
        1 => "strided_copy_b1",
        2 => "strided_copy_b2",
        8 => "strided_copy_b8",
        _ => "strided_copy_b4",
    })
}

/// `dst[dst_base + Σ c·dst_st] = src[src_base + Σ c·src_st]` over `d` (its
/// operand 0 the source strides, operand 1 the destination's).
pub(super) fn strided_copy(
    dev: &Device,
    src: &DeviceTensor,
    src_base: usize,
    dst: &DeviceTensor,
    dst_base: usize,
    n: usize,
    d: Strided,
) -> Result<()> {
    dev.launch(
        copy_kernel(src.dtype())?,
        n,
        &[
            Arg::n(n),
            Arg::Strided(Box::new(d)),
            Arg::n(src_base),
            Arg::t(src),
            Arg::n(dst_base),
            Arg::t(dst),
        ],
    )
}

/// A new contiguous tensor of `shape` read from `src` with `d`'s operand-0 strides.
pub(super) fn strided_new(
    dev: &Device,
    src: &DeviceTensor,
    shape: &[usize],
    d: Strided,
) -> Result<DeviceTensor> {
    let out = dev.zeros(src.dtype(), shape)?;
    let n: usize = shape.iter().product();
    let mut d = d;
    let cont = Strided::contiguous(shape);
    let src_st = (0..shape.len()).map(|i| d_st(&d, 0, i)).collect::<Vec<_>>();
    d = Strided::new(shape, &[src_st, cont])?;
    strided_copy(dev, src, 0, &out, 0, n, d)?;
    Ok(out)
}

pub(super) fn d_st(d: &Strided, k: usize, i: usize) -> i64 {
    // Strided's fields are private to keep the C layout in one place; read back
    // through its Debug-free accessor.
    d.stride(k, i)
}

/// A contiguous copy of `x` with the same elements and another shape.
pub(super) fn copy_as(dev: &Device, x: &DeviceTensor, shape: &[usize]) -> Result<DeviceTensor> {
    let n = x.numel();
    if shape.iter().product::<usize>() != n {
        return Err(CudaError::Kernel(format!(
            "cannot view {:?} as {shape:?}",
            x.shape
        )));
    }
    let out = dev.zeros(x.dtype(), shape)?;
    let d = Strided::new(&[n], &[vec![1], vec![1]])?;
    strided_copy(dev, x, 0, &out, 0, n, d)?;
    Ok(out)
}

/// A copy of `x` (same shape and elements) in a new allocation made for `alloc`'s
/// element count: an expanded operand's copy is larger than `x` (counted in full, the
/// elements past `x`'s stay zero and unread); a summed one is smaller, and then `x`
/// is kept whole with only `alloc`'s bytes counted as a tensor, the rest as
/// workspace (memory the executor holds beyond what PyTorch saves).
pub(crate) fn copy_into(dev: &Device, x: &DeviceTensor, alloc: &[usize]) -> Result<DeviceTensor> {
    let n = x.numel();
    let want: usize = alloc.iter().product();
    let mut out = dev.zeros(x.dtype(), if want >= n { alloc } else { &x.shape })?;
    let d = Strided::new(&[n], &[vec![1], vec![1]])?;
    strided_copy(dev, x, 0, &out, 0, n, d)?;
    out.shape = x.shape.clone();
    if want < n {
        out.count_as((want * crate::exec::cuda::tensor::elem_size(x.dtype())?) as u64);
    }
    Ok(out)
}

/// `src`'s elements copied into `dst` in place (same type and element count; a
/// device-to-device copy by the strided copy kernel): `dst` keeps its memory and
/// its count.
pub(crate) fn write_values(dev: &Device, dst: &DeviceTensor, src: &DeviceTensor) -> Result<()> {
    let n = src.numel();
    if dst.dtype() != src.dtype() || dst.numel() != n {
        return Err(CudaError::Kernel(format!(
            "writing a {} {:?} tensor into a {} {:?} one",
            src.dtype(),
            src.shape,
            dst.dtype(),
            dst.shape
        )));
    }
    if n == 0 {
        return Ok(());
    }
    let d = Strided::new(&[n], &[vec![1], vec![1]])?;
    strided_copy(dev, src, 0, dst, 0, n, d)
}

/// `scale · Σ` of `g` (shape `from`) over the axes broadcast to it from `target`
/// (numpy rules), in row-major order in f64 (exec::grad::sum_to).
pub(super) fn sum_to(
    dev: &Device,
    g: &DeviceTensor,
    target: &[usize],
    scale: f64,
) -> Result<DeviceTensor> {
    let from = g.shape.clone();
    if from.as_slice() == target && scale == 1.0 {
        return copy_as(dev, g, target);
    }
    let r = from.len();
    let mut t2 = vec![1usize; r - target.len()];
    t2.extend_from_slice(target);
    let st = strides(&from);
    let reduced: Vec<usize> = (0..r).filter(|&i| t2[i] == 1 && from[i] != 1).collect();
    let keep_st: Vec<i64> = (0..r)
        .map(|i| {
            if reduced.contains(&i) {
                0
            } else {
                st[i] as i64
            }
        })
        .collect();
    let keep = Strided::new(&t2, &[keep_st])?;
    let red_shape: Vec<usize> = reduced.iter().map(|&i| from[i]).collect();
    let red = Strided::new(
        &red_shape,
        &[reduced.iter().map(|&i| st[i] as i64).collect()],
    )?;
    reduce_launch(
        dev,
        0,
        g,
        target,
        keep,
        red_shape.iter().product(),
        red,
        scale,
    )
}

#[allow(clippy::too_many_arguments)]
pub(super) fn reduce_launch(
    dev: &Device,
    op: i32,
    x: &DeviceTensor,
    out_shape: &[usize],
    keep: Strided,
    n_red: usize,
    red: Strided,
    scale: f64,
) -> Result<DeviceTensor> {
    let y = dev.zeros(DType::F32, out_shape)?;
    let n_out = y.numel();
    dev.launch(
        "reduce_f32",
        n_out,
        &[
            Arg::I32(op),
            Arg::n(n_out),
            Arg::Strided(Box::new(keep)),
            Arg::n(n_red),
            Arg::Strided(Box::new(red)),
            Arg::t(x),
            Arg::t(&y),
            Arg::F64(scale),
        ],
    )?;
    Ok(y)
}

pub(super) fn transpose_perm(attrs: &Attrs, rank: usize) -> Vec<usize> {
    match attrs.ints("perm") {
        Some(p) => p.iter().map(|&v| v.max(0) as usize).collect(),
        None => (0..rank).rev().collect(),
    }
}

pub(super) fn permuted(dev: &Device, x: &DeviceTensor, perm: &[usize]) -> Result<DeviceTensor> {
    let st = strides(&x.shape);
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    let pst: Vec<i64> = perm.iter().map(|&p| st[p] as i64).collect();
    let d = Strided::new(&shape, &[pst])?;
    strided_new(dev, x, &shape, d)
}

pub(super) fn transpose_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let x = cx.input(0)?;
    let perm = transpose_perm(cx.attrs(), x.shape.len());
    Ok(vec![permuted(dev, x, &perm)?])
}

pub(super) fn transpose_bwd(
    dev: &Device,
    cx: &DevBackwardCx,
) -> Result<Vec<(usize, DeviceTensor)>> {
    let rank = cx.input(0)?.shape.len();
    let perm = transpose_perm(cx.attrs(), rank);
    let mut inv = vec![0; rank];
    for (i, &p) in perm.iter().enumerate() {
        inv[p] = i;
    }
    let g = cx.grad(dev, 0)?;
    Ok(vec![(0, permuted(dev, &g, &inv)?)])
}

/// Copies `part` (its own contiguous layout) into / out of the block of `whole`
/// starting at `offset` along `ax`.
pub(super) fn block_copy(
    dev: &Device,
    whole: &DeviceTensor,
    part: &DeviceTensor,
    ax: usize,
    offset: usize,
    into_whole: bool,
) -> Result<()> {
    let wst: Vec<i64> = Strided::contiguous(&whole.shape);
    let pst: Vec<i64> = Strided::contiguous(&part.shape);
    let base = offset * strides(&whole.shape)[ax];
    let n = part.numel();
    if into_whole {
        strided_copy(
            dev,
            part,
            0,
            whole,
            base,
            n,
            Strided::new(&part.shape, &[pst, wst])?,
        )
    } else {
        strided_copy(
            dev,
            whole,
            base,
            part,
            0,
            n,
            Strided::new(&part.shape, &[wst, pst])?,
        )
    }
}

pub(super) fn concat_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let out = &cx.out(0)?.shape;
    let ax = axis(cx.attrs().int_or("axis", 0), out.len())?;
    let y = dev.zeros(cx.input(0)?.dtype(), out)?;
    let mut off = 0;
    for t in cx.inputs.iter().flatten() {
        block_copy(dev, &y, t, ax, off, true)?;
        off += t.shape[ax];
    }
    Ok(vec![y])
}

pub(super) fn concat_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let out = &cx.output(0)?.shape;
    let ax = axis(cx.attrs().int_or("axis", 0), out.len())?;
    let g = cx.grad(dev, 0)?;
    let mut res = Vec::new();
    let mut off = 0;
    for (slot, f) in cx.inputs.iter().enumerate() {
        let Some(f) = f else { continue };
        if cx.wants(slot) {
            let part = dev.zeros(DType::F32, &f.shape)?;
            block_copy(dev, &g, &part, ax, off, false)?;
            res.push((slot, part));
        }
        off += f.shape[ax];
    }
    Ok(res)
}

pub(super) fn split_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let x = cx.input(0)?;
    let ax = axis(cx.attrs().int_or("axis", 0), x.shape.len())?;
    let mut res = Vec::new();
    let mut off = 0;
    for f in cx.outputs.iter() {
        let f = f.ok_or_else(|| CudaError::Kernel("Split output without a fact".into()))?;
        let part = dev.zeros(x.dtype(), &f.shape)?;
        block_copy(dev, x, &part, ax, off, false)?;
        off += f.shape[ax];
        res.push(part);
    }
    Ok(res)
}

pub(super) fn split_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let f = cx.input(0)?;
    let ax = axis(cx.attrs().int_or("axis", 0), f.shape.len())?;
    let dx = dev.zeros(DType::F32, &f.shape)?;
    let mut off = 0;
    for (i, of) in cx.outputs.iter().enumerate() {
        let of = of.ok_or_else(|| CudaError::Kernel("Split output without a fact".into()))?;
        if let Some(g) = cx.grads.get(i).copied().flatten() {
            block_copy(dev, &dx, g, ax, off, true)?;
        }
        off += of.shape[ax];
    }
    Ok(vec![(0, dx)])
}

/// A Slice (opset 10+, every argument a folded constant) that takes one
/// contiguous block along at most one axis with step 1 (`x[..., a:b]`, as
/// rotary embeddings' `rotate_half` does): that axis and the block's start.
/// Anything else (steps, several sliced axes) runs on the host.
pub(super) fn slice_block(facts: &[Option<&Fact>], opset: i64) -> Option<(usize, usize)> {
    if opset < 10 {
        return None;
    }
    let x = facts
        .first()
        .copied()
        .flatten()
        .filter(|x| !x.shape.is_empty())?;
    let ints = |i: usize| -> Option<Option<Vec<i64>>> {
        match facts.get(i).copied().flatten() {
            None => Some(None),
            Some(f) => Some(Some(f.value.as_ref()?.to_ints())),
        }
    };
    let (starts, ends) = (ints(1)??, ints(2)??);
    let r = x.shape.len() as i64;
    let axes = match ints(3)? {
        Some(a) => a
            .iter()
            .map(|&v| usize::try_from(if v < 0 { v + r } else { v }).ok())
            .collect::<Option<Vec<_>>>()?,
        None => (0..starts.len()).collect(),
    };
    let steps = ints(4)?.unwrap_or_else(|| vec![1; starts.len()]);
    if steps.iter().any(|&s| s != 1) || axes.len() != starts.len() || ends.len() != starts.len() {
        return None;
    }
    let mut block = None;
    for (k, &a) in axes.iter().enumerate() {
        let d = *x.shape.get(a)? as i64;
        let norm = |v: i64| if v < 0 { v.saturating_add(d) } else { v }.clamp(0, d);
        let (b, e) = (norm(starts[k]), norm(ends[k]));
        if b == 0 && e >= d {
            continue;
        }
        if block.is_some() {
            return None;
        }
        block = Some((a, b as usize));
    }
    Some(block.unwrap_or((0, 0)))
}

pub(super) fn gather_dims(data: &[usize], n_idx: usize, ax: usize) -> [usize; 4] {
    [
        data[..ax].iter().product(),
        data[ax],
        n_idx,
        data[ax + 1..].iter().product(),
    ]
}

pub(super) fn gather_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (x, idx) = (cx.input(0)?, cx.input(1)?);
    let ax = axis(cx.attrs().int_or("axis", 0), x.shape.len())?;
    let [outer, ad, ni, inner] = gather_dims(&x.shape, idx.numel(), ax);
    let y = dev.zeros(DType::F32, &cx.out(0)?.shape)?;
    dev.launch(
        "gather_f32",
        outer * ni * inner,
        &[
            Arg::n(outer),
            Arg::n(ad),
            Arg::n(ni),
            Arg::n(inner),
            Arg::t(idx),
            Arg::t(x),
            Arg::t(&y),
        ],
    )?;
    Ok(vec![y])
}

pub(super) fn cast_code_ok(d: DType) -> bool {
    matches!(d, DType::F32 | DType::I64 | DType::I32 | DType::Bool)
}

/// kernels/elementwise.cu `cast_any`'s type codes.
pub(super) fn cast_code(d: DType) -> i32 {
    match d {
        DType::F32 => 0,
        DType::I64 => 1,
        DType::I32 => 2,
        _ => 3,
    }
}

pub(super) fn gather_elements_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (x, idx) = (cx.input(0)?, cx.input(1)?);
    let a = axis(cx.attrs().int_or("axis", 0), x.shape.len())?;
    let xst = strides(&x.shape);
    let st: Vec<i64> = (0..x.shape.len())
        .map(|i| if i == a { 0 } else { xst[i] as i64 })
        .collect();
    let y = dev.zeros(x.dtype(), &idx.shape)?;
    let n = y.numel();
    let name = match crate::exec::cuda::tensor::elem_size(x.dtype())? {
        1 => "gather_elements_b1",
        8 => "gather_elements_b8",
        4 => "gather_elements_b4",
        _ => {
            return Err(CudaError::Kernel(format!(
                "GatherElements of {} on the device",
                x.dtype()
            )))
        }
    };
    dev.launch(
        name,
        n,
        &[
            Arg::n(n),
            Arg::Strided(Box::new(Strided::new(&idx.shape, &[st])?)),
            Arg::n(xst[a]),
            Arg::n(x.shape[a]),
            Arg::t(idx),
            Arg::t(x),
            Arg::t(&y),
        ],
    )?;
    Ok(vec![y])
}

pub(super) fn gather_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let f = cx.input(0)?;
    // A constant scalar index (a `select`) is not saved: its value, uploaded (a
    // launch temporary).
    let held;
    let idx = match cx.saved_opt(Saved::Input(1)) {
        Some(i) => i,
        None => {
            let v = cx
                .input(1)?
                .value
                .as_ref()
                .ok_or_else(|| {
                    CudaError::Kernel(
                        "the backward kernel reads Input(1), which was not saved for it".into(),
                    )
                })?
                .to_ints();
            let t = Tensor::from_i64(DType::I64, vec![v.len()], v).map_err(CudaError::from)?;
            held = dev.upload(&t)?;
            &held
        }
    };
    let ax = axis(cx.attrs().int_or("axis", 0), f.shape.len())?;
    let [outer, ad, ni, inner] = gather_dims(&f.shape, idx.numel(), ax);
    let g = cx.grad(dev, 0)?;
    let dx = dev.zeros(DType::F32, &f.shape)?;
    dev.launch(
        "gather_bwd_f32",
        outer * inner,
        &[
            Arg::n(outer),
            Arg::n(ad),
            Arg::n(ni),
            Arg::n(inner),
            Arg::t(idx),
            Arg::t(&g),
            Arg::t(&dx),
        ],
    )?;
    Ok(vec![(0, dx)])
}
