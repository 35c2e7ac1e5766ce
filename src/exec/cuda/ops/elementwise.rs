//! Element-wise launchers: unary, binary, comparisons, Where, Clip, Dropout.

#[allow(unused_imports)]
use super::*;
use crate::ops::elementwise::{binary_row, compare_row, unary_row, UnaryRow};

/// kernels/elementwise.cu's op code of unary op `op` (its row of
/// [`ops::elementwise::UNARY`](crate::ops::elementwise)) and its parameters;
/// `None` for ops the table gives no device code.
pub(super) fn unary_code(
    op: &str,
    a: &Attrs,
) -> Result<Option<(i32, &'static UnaryRow, [f32; 3])>> {
    let Some((code, row)) = unary_row(op).filter(|(_, r)| r.cuda.is_some()) else {
        return Ok(None);
    };
    let p = row.params(a).map_err(CudaError::from)?;
    Ok(Some((code, row, p)))
}

pub(super) fn unary_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (code, _, [al, be, ga]) =
        unary_code(&cx.node.op_type, cx.attrs())?.expect("checked by forward");
    let x = cx.input(0)?;
    let y = dev.zeros(DType::F32, &x.shape)?;
    let n = x.numel();
    dev.launch(
        "unary_fwd_f32",
        n,
        &[
            Arg::I32(code),
            Arg::n(n),
            Arg::t(x),
            Arg::t(&y),
            Arg::F32(al),
            Arg::F32(be),
            Arg::F32(ga),
        ],
    )?;
    Ok(vec![y])
}

pub(super) fn unary_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let op = cx.node.op_type.as_str();
    let (code, row, [al, be, ga]) = unary_code(op, cx.attrs())?.expect("checked by backward");
    let s = row.keeps.saved().map(|s| cx.saved(s)).transpose()?;
    let g = cx.grad(dev, 0)?;
    let dx = dev.zeros(DType::F32, &cx.input(0)?.shape)?;
    let n = dx.numel();
    dev.launch(
        "unary_bwd_f32",
        n,
        &[
            Arg::I32(code),
            Arg::n(n),
            Arg::t(&g),
            Arg::opt(s),
            Arg::t(&dx),
            Arg::F32(al),
            Arg::F32(be),
            Arg::F32(ga),
        ],
    )?;
    Ok(vec![(0, dx)])
}

/// kernels/elementwise.cu's code of arithmetic op `op` (its row of `BINARY`).
pub(super) fn binary_code(op: &str) -> Result<i32> {
    binary_row(op)
        .filter(|(_, r)| r.on_device())
        .map(|(c, _)| c)
        .ok_or_else(|| CudaError::Kernel(format!("no device kernel for {op}")))
}

/// kernels/elementwise.cu's code of comparison `op` (its row of `COMPARE`).
pub(super) fn compare_code(op: &str) -> Result<i32> {
    compare_row(op)
        .map(|(c, _)| c)
        .ok_or_else(|| CudaError::Kernel(format!("no device kernel for {op}")))
}

pub(super) fn binary_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (a, b) = (cx.input(0)?, cx.input(1)?);
    let out = &cx.out(0)?.shape;
    let y = dev.zeros(DType::F32, out)?;
    let n = y.numel();
    let d = Strided::broadcast(out, &[&a.shape, &b.shape])?;
    dev.launch(
        "binary_fwd_f32",
        n,
        &[
            Arg::I32(binary_code(&cx.node.op_type)?),
            Arg::n(n),
            Arg::Strided(Box::new(d)),
            Arg::t(a),
            Arg::t(b),
            Arg::t(&y),
        ],
    )?;
    Ok(vec![y])
}

pub(super) fn binary_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let out = cx.output(0)?.shape.clone();
    let (sa, sb) = (cx.input(0)?.shape.clone(), cx.input(1)?.shape.clone());
    let g = cx.grad(dev, 0)?;
    let code = binary_code(&cx.node.op_type)?;
    let d = Strided::broadcast(&out, &[&sa, &sb, &out])?;
    let mut res = Vec::new();
    for slot in [0usize, 1] {
        if !cx.wants(slot) {
            continue;
        }
        let full = dev.zeros(DType::F32, &out)?;
        let n = full.numel();
        dev.launch(
            "binary_bwd_f32",
            n,
            &[
                Arg::I32(code),
                Arg::I32(slot as i32),
                Arg::n(n),
                Arg::Strided(Box::new(d)),
                Arg::t(&g),
                Arg::opt(cx.saved_opt(Saved::Input(0))),
                Arg::opt(cx.saved_opt(Saved::Input(1))),
                Arg::opt(cx.saved_opt(Saved::Output(0))),
                Arg::t(&full),
            ],
        )?;
        let target = if slot == 0 { &sa } else { &sb };
        let r = if target == &out {
            full
        } else {
            sum_to(dev, &full, target, 1.0)?
        };
        res.push((slot, r));
    }
    Ok(res)
}

pub(super) fn compare_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (a, b) = (cx.input(0)?, cx.input(1)?);
    let out = &cx.out(0)?.shape;
    let code = compare_code(&cx.node.op_type)?;
    let y = dev.zeros(DType::Bool, out)?;
    let n = y.numel();
    let d = Strided::broadcast(out, &[&a.shape, &b.shape])?;
    dev.launch(
        "compare_f32",
        n,
        &[
            Arg::I32(code),
            Arg::n(n),
            Arg::Strided(Box::new(d)),
            Arg::t(a),
            Arg::t(b),
            Arg::t(&y),
        ],
    )?;
    Ok(vec![y])
}

pub(super) fn where_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (c, x, y) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
    if c.dtype() != DType::Bool {
        return Err(CudaError::Kernel("Where's condition must be bool".into()));
    }
    let out = &cx.out(0)?.shape;
    let o = dev.zeros(DType::F32, out)?;
    let n = o.numel();
    let d = Strided::broadcast(out, &[&c.shape, &x.shape, &y.shape])?;
    dev.launch(
        "where_f32",
        n,
        &[
            Arg::n(n),
            Arg::Strided(Box::new(d)),
            Arg::t(c),
            Arg::t(x),
            Arg::t(y),
            Arg::t(&o),
        ],
    )?;
    Ok(vec![o])
}

pub(super) fn where_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let c = cx.saved(Saved::Input(0))?;
    let out = cx.output(0)?.shape.clone();
    let g = cx.grad(dev, 0)?;
    let d = Strided::broadcast(&out, &[&c.shape])?;
    let mut res = Vec::new();
    for slot in [1usize, 2] {
        if !cx.wants(slot) {
            continue;
        }
        let full = dev.zeros(DType::F32, &out)?;
        let n = full.numel();
        dev.launch(
            "where_bwd_f32",
            n,
            &[
                Arg::I32(slot as i32),
                Arg::n(n),
                Arg::Strided(Box::new(d)),
                Arg::t(c),
                Arg::t(&g),
                Arg::t(&full),
            ],
        )?;
        let target = &cx.input(slot)?.shape;
        let r = if target == &out {
            full
        } else {
            sum_to(dev, &full, target, 1.0)?
        };
        res.push((slot, r));
    }
    Ok(res)
}

/// Clip's bounds from the input facts (opset 11+, folded scalars) or attributes.
pub(super) fn clip_bounds(
    inputs: &[Option<&Fact>],
    attrs: &Attrs,
    opset: i64,
) -> Result<(f32, f32)> {
    let bound = |i: usize, attr: &str| -> Result<Option<f32>> {
        if opset >= 11 {
            match inputs.get(i).copied().flatten() {
                None => Ok(None),
                Some(f) => f
                    .value
                    .as_ref()
                    .and_then(|v| v.scalar_float())
                    .map(|v| Some(v as f32))
                    .ok_or_else(|| CudaError::Kernel(format!("Clip bound {i} is not a constant"))),
            }
        } else {
            Ok(attrs.float(attr))
        }
    };
    Ok((
        bound(1, "min")?.unwrap_or(f32::NEG_INFINITY),
        bound(2, "max")?.unwrap_or(f32::INFINITY),
    ))
}

pub(super) fn clip_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (lo, hi) = clip_bounds(&cx.input_facts, cx.attrs(), cx.opset)?;
    let x = cx.input(0)?;
    let y = dev.zeros(DType::F32, &x.shape)?;
    let n = x.numel();
    dev.launch(
        "clip_fwd_f32",
        n,
        &[Arg::n(n), Arg::t(x), Arg::t(&y), Arg::F32(lo), Arg::F32(hi)],
    )?;
    Ok(vec![y])
}

pub(super) fn clip_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let (lo, hi) = clip_bounds(&cx.inputs, cx.attrs(), cx.opset)?;
    let x = cx.saved(Saved::Input(0))?;
    let g = cx.grad(dev, 0)?;
    let dx = dev.zeros(DType::F32, &x.shape)?;
    let n = x.numel();
    dev.launch(
        "clip_bwd_f32",
        n,
        &[
            Arg::n(n),
            Arg::t(&g),
            Arg::t(x),
            Arg::t(&dx),
            Arg::F32(lo),
            Arg::F32(hi),
        ],
    )?;
    Ok(vec![(0, dx)])
}

pub(super) fn dropout_scale(ratio: f64) -> f32 {
    if ratio < 1.0 {
        (1.0 / (1.0 - ratio)) as f32
    } else {
        0.0
    }
}

/// Dropout as dropout_kernel: `[y, mask]` for the declared outputs, then the mask
/// as extra in training. Training mode and ratio come from the folded input
/// facts (the CPU reads the runtime inputs; they agree whenever those are
/// constants, as in every exported model).
pub(super) fn dropout_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let rcx = cx.rule_cx();
    let x = cx.input(0)?;
    let n = x.numel();
    let training = !ops::elementwise::Dropout::is_identity(&rcx);
    let ratio = ops::elementwise::Dropout::ratio(&rcx);
    let y = dev.zeros(DType::F32, &x.shape)?;
    let mask = dev.zeros(DType::Bool, &x.shape)?;
    if training && cx.dropout {
        dev.launch(
            "dropout_fwd_f32",
            n,
            &[
                Arg::n(n),
                Arg::U64(cx.seed),
                Arg::F64(ratio),
                Arg::F32(dropout_scale(ratio)),
                Arg::t(x),
                Arg::t(&y),
                Arg::t(&mask),
            ],
        )?;
    } else {
        let d = Strided::new(&[n], &[vec![1], vec![1]])?;
        strided_copy(dev, x, 0, &y, 0, n, d)?;
        let ones = Tensor::bool(x.shape.clone(), vec![true; n]);
        let m = dev.upload(&ones)?;
        drop(mask);
        // Training with dropping switched off still saves its (all-true) mask,
        // as the CPU kernel does.
        return finish_dropout(dev, cx, y, m, training);
    }
    finish_dropout(dev, cx, y, mask, training)
}

pub(super) fn finish_dropout(
    dev: &Device,
    cx: &DevKernelCx,
    y: DeviceTensor,
    mask: DeviceTensor,
    training: bool,
) -> Result<Vec<DeviceTensor>> {
    let mut outs = vec![y];
    let extra = cx.extras && training;
    if cx.outputs.len() > 1 {
        if extra {
            outs.push(copy_as(dev, &mask, &mask.shape.clone())?);
        } else {
            outs.push(mask);
            return Ok(outs);
        }
    }
    if extra {
        outs.push(mask);
    }
    Ok(outs)
}

pub(super) fn dropout_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let rcx = cx.rule_cx();
    let g = cx.grad(dev, 0)?;
    if ops::elementwise::Dropout::is_identity(&rcx) || !cx.dropout {
        return Ok(vec![(0, copy_as(dev, &g, &g.shape.clone())?)]);
    }
    let ratio = ops::elementwise::Dropout::ratio(&rcx);
    let mask = cx.saved(Saved::Extra(0))?;
    let dx = dev.zeros(DType::F32, &g.shape)?;
    let n = dx.numel();
    dev.launch(
        "dropout_bwd_f32",
        n,
        &[
            Arg::n(n),
            Arg::F32(dropout_scale(ratio)),
            Arg::t(&g),
            Arg::t(mask),
            Arg::t(&dx),
        ],
    )?;
    Ok(vec![(0, dx)])
}
