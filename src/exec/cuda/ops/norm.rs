//! BatchNorm, LayerNorm, Softmax.

#[allow(unused_imports)]
use super::*;

/// BatchNormalization in training mode (inference mode runs on the host), as
/// batch_norm_kernel: y, the running statistics, (opset < 14) the batch mean and
/// variance, truncated to the declared outputs; then the extras (mean, invstd).
pub(super) fn bn_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let x = cx.input(0)?;
    let [scale, bias, rm, rv] = [1, 2, 3, 4].map(|i| cx.input(i));
    let (scale, bias, rm, rv) = (scale?, bias?, rm?, rv?);
    for t in [scale, bias, rm, rv] {
        t.expect_f32("a BatchNormalization parameter")?;
    }
    let (n, c) = (x.shape[0], x.shape[1]);
    let plane: usize = x.shape[2..].iter().product();
    let eps = cx.attrs().float("epsilon").unwrap_or(1e-5) as f64;
    let momentum = cx.attrs().float("momentum").unwrap_or(0.9) as f64;
    // 2c doubles of statistics.
    let stats = dev.workspace(4 * c)?;
    if c > 0 {
        dev.launch_cfg(
            "bn_stats_f32",
            per_block(c),
            &[
                Arg::n(n),
                Arg::n(c),
                Arg::n(plane),
                Arg::t(x),
                Arg::Ptr(stats.ptr()),
            ],
        )?;
    }
    let y = dev.zeros(DType::F32, &x.shape)?;
    dev.launch(
        "bn_apply_f32",
        y.numel(),
        &[
            Arg::n(n),
            Arg::n(c),
            Arg::n(plane),
            Arg::t(x),
            Arg::t(scale),
            Arg::t(bias),
            Arg::Ptr(stats.ptr()),
            Arg::F64(eps),
            Arg::t(&y),
        ],
    )?;
    let n_out = cx.outputs.len().max(1);
    let mk = |want: bool| -> Result<Option<DeviceTensor>> {
        if want {
            Ok(Some(dev.zeros(DType::F32, &[c])?))
        } else {
            Ok(None)
        }
    };
    let new_mean = mk(n_out > 1)?;
    let new_var = mk(n_out > 2)?;
    let batch_mean = mk(cx.opset < 14 && n_out > 3)?;
    let batch_var = mk(cx.opset < 14 && n_out > 4)?;
    let mean = mk(cx.extras)?;
    let invstd = mk(cx.extras)?;
    dev.launch(
        "bn_finish_f32",
        c,
        &[
            Arg::n(c),
            Arg::Ptr(stats.ptr()),
            Arg::F64(eps),
            Arg::F64(momentum),
            Arg::t(rm),
            Arg::t(rv),
            Arg::opt(new_mean.as_ref()),
            Arg::opt(new_var.as_ref()),
            Arg::opt(mean.as_ref()),
            Arg::opt(invstd.as_ref()),
            Arg::opt(batch_mean.as_ref()),
            Arg::opt(batch_var.as_ref()),
        ],
    )?;
    let mut outs = vec![y];
    outs.extend(
        [new_mean, new_var, batch_mean, batch_var]
            .into_iter()
            .flatten(),
    );
    outs.extend([mean, invstd].into_iter().flatten());
    Ok(outs)
}

pub(super) fn bn_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let f = cx.input(0)?;
    let (n, c) = (f.shape[0], f.shape[1]);
    let plane: usize = f.shape[2..].iter().product();
    let g = cx.grad(dev, 0)?;
    let need_x = cx.wants(0) || cx.wants(1);
    let (x, mean, invstd) = if need_x {
        (
            Some(cx.saved(Saved::Input(0))?),
            Some(cx.saved(Saved::Extra(0))?),
            Some(cx.saved(Saved::Extra(1))?),
        )
    } else {
        (None, None, None)
    };
    let sums = dev.workspace(4 * c)?;
    if c > 0 {
        dev.launch_cfg(
            "bn_bwd_reduce_f32",
            per_block(c),
            &[
                Arg::n(n),
                Arg::n(c),
                Arg::n(plane),
                Arg::t(&g),
                Arg::opt(x),
                Arg::opt(mean),
                Arg::opt(invstd),
                Arg::Ptr(sums.ptr()),
            ],
        )?;
    }
    let mut res = Vec::new();
    if cx.wants(0) {
        let scale = cx.saved(Saved::Input(1))?;
        let dx = dev.zeros(DType::F32, &f.shape)?;
        dev.launch(
            "bn_bwd_dx_f32",
            dx.numel(),
            &[
                Arg::n(n),
                Arg::n(c),
                Arg::n(plane),
                Arg::t(&g),
                Arg::opt(x),
                Arg::opt(mean),
                Arg::opt(invstd),
                Arg::t(scale),
                Arg::Ptr(sums.ptr()),
                Arg::t(&dx),
            ],
        )?;
        res.push((0, dx));
    }
    let ds = if cx.wants(1) {
        Some(dev.zeros(DType::F32, &[c])?)
    } else {
        None
    };
    let db = if cx.wants(2) {
        Some(dev.zeros(DType::F32, &[c])?)
    } else {
        None
    };
    dev.launch(
        "bn_bwd_params_f32",
        c,
        &[
            Arg::n(c),
            Arg::Ptr(sums.ptr()),
            Arg::opt(ds.as_ref()),
            Arg::opt(db.as_ref()),
        ],
    )?;
    res.extend(ds.map(|t| (1, t)));
    res.extend(db.map(|t| (2, t)));
    Ok(res)
}

/// A LayerNormalization parameter broadcast to the normalized shape (a copy only
/// when its shape differs).
pub(super) fn ln_param<'t>(dev: &Device, t: &'t DeviceTensor, norm: &[usize]) -> Result<Held<'t>> {
    if t.shape == norm {
        return Ok(Held::B(t));
    }
    let d = Strided::broadcast(norm, &[&t.shape])?;
    Ok(Held::O(strided_new(dev, t, norm, d)?))
}

pub(super) fn ln_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let x = cx.input(0)?;
    let a = axis(cx.attrs().int_or("axis", -1), x.shape.len())?;
    let eps = cx.attrs().float("epsilon").unwrap_or(1e-5) as f64;
    let norm = x.shape[a..].to_vec();
    let (rows, cols): (usize, usize) = (x.shape[..a].iter().product(), norm.iter().product());
    let scale = cx.opt(1).map(|t| ln_param(dev, t, &norm)).transpose()?;
    let bias = cx.opt(2).map(|t| ln_param(dev, t, &norm)).transpose()?;
    let y = dev.zeros(DType::F32, &x.shape)?;
    let mut stat_shape = x.shape[..a].to_vec();
    stat_shape.resize(x.shape.len(), 1);
    let mean = dev.zeros(DType::F32, &stat_shape)?;
    let invstd = dev.zeros(DType::F32, &stat_shape)?;
    if rows > 0 && cols > 0 {
        dev.launch_cfg(
            "ln_fwd_f32",
            per_block(rows),
            &[
                Arg::n(rows),
                Arg::n(cols),
                Arg::t(x),
                Arg::opt(scale.as_deref()),
                Arg::opt(bias.as_deref()),
                Arg::F64(eps),
                Arg::t(&y),
                Arg::t(&mean),
                Arg::t(&invstd),
            ],
        )?;
    }
    let mut outs = vec![y];
    for (i, src) in [(1usize, &mean), (2, &invstd)] {
        if let Some(Some(f)) = cx.outputs.get(i) {
            outs.push(copy_as(dev, src, &f.shape)?);
        } else if i < cx.outputs.len() {
            outs.push(dev.zeros(DType::F32, &[0])?);
        }
    }
    if cx.extras {
        outs.push(mean);
        outs.push(invstd);
    }
    Ok(outs)
}

pub(super) fn ln_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let f = cx.input(0)?;
    let a = axis(cx.attrs().int_or("axis", -1), f.shape.len())?;
    let norm = f.shape[a..].to_vec();
    let (rows, cols): (usize, usize) = (f.shape[..a].iter().product(), norm.iter().product());
    let g = cx.grad(dev, 0)?;
    let mut res = Vec::new();
    let need_x = cx.wants(0) || cx.wants(1);
    let (x, mean, invstd) = if need_x {
        (
            Some(cx.saved(Saved::Input(0))?),
            Some(cx.saved(Saved::Extra(0))?),
            Some(cx.saved(Saved::Extra(1))?),
        )
    } else {
        (None, None, None)
    };
    if cx.wants(0) {
        let scale = ln_param(dev, cx.saved(Saved::Input(1))?, &norm)?;
        let dx = dev.zeros(DType::F32, &f.shape)?;
        if rows > 0 && cols > 0 {
            dev.launch_cfg(
                "ln_bwd_dx_f32",
                per_block(rows),
                &[
                    Arg::n(rows),
                    Arg::n(cols),
                    Arg::t(&g),
                    Arg::opt(x),
                    Arg::opt(mean),
                    Arg::opt(invstd),
                    Arg::t(&scale),
                    Arg::t(&dx),
                ],
            )?;
        }
        res.push((0, dx));
    }
    if cx.wants(1) || cx.wants(2) {
        let ds = if cx.wants(1) {
            Some(dev.zeros(DType::F32, &norm)?)
        } else {
            None
        };
        let db = if cx.wants(2) {
            Some(dev.zeros(DType::F32, &norm)?)
        } else {
            None
        };
        dev.launch(
            "ln_bwd_params_f32",
            cols,
            &[
                Arg::n(rows),
                Arg::n(cols),
                Arg::t(&g),
                Arg::opt(x),
                Arg::opt(mean),
                Arg::opt(invstd),
                Arg::opt(ds.as_ref()),
                Arg::opt(db.as_ref()),
            ],
        )?;
        for (slot, t) in [(1usize, ds), (2, db)] {
            if let Some(t) = t {
                res.push((slot, sum_to(dev, &t, &cx.input(slot)?.shape, 1.0)?));
            }
        }
    }
    Ok(res)
}

/// `(outer, n, inner)` of Softmax along `axis` (norm.rs softmax_dims).
pub(super) fn softmax_dims(
    shape: &[usize],
    attrs: &Attrs,
    opset: i64,
) -> Result<(usize, usize, usize)> {
    let default = if opset >= 13 { -1 } else { 1 };
    let a = axis(attrs.int_or("axis", default), shape.len())?;
    Ok(if opset >= 13 {
        (
            shape[..a].iter().product(),
            shape[a],
            shape[a + 1..].iter().product(),
        )
    } else {
        (shape[..a].iter().product(), shape[a..].iter().product(), 1)
    })
}

pub(super) fn softmax_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let x = cx.input(0)?;
    let (outer, n, inner) = softmax_dims(&x.shape, cx.attrs(), cx.opset)?;
    let log = (cx.node.op_type == "LogSoftmax") as i32;
    let y = dev.zeros(DType::F32, &x.shape)?;
    dev.launch(
        "softmax_fwd_f32",
        outer * inner,
        &[
            Arg::I32(log),
            Arg::n(outer),
            Arg::n(n),
            Arg::n(inner),
            Arg::t(x),
            Arg::t(&y),
        ],
    )?;
    Ok(vec![y])
}

pub(super) fn softmax_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let f = cx.input(0)?;
    let (outer, n, inner) = softmax_dims(&f.shape, cx.attrs(), cx.opset)?;
    let log = (cx.node.op_type == "LogSoftmax") as i32;
    let y = cx.saved(Saved::Output(0))?;
    let g = cx.grad(dev, 0)?;
    let dx = dev.zeros(DType::F32, &f.shape)?;
    dev.launch(
        "softmax_bwd_f32",
        outer * inner,
        &[
            Arg::I32(log),
            Arg::n(outer),
            Arg::n(n),
            Arg::n(inner),
            Arg::t(y),
            Arg::t(&g),
            Arg::t(&dx),
        ],
    )?;
    Ok(vec![(0, dx)])
}
