//! Convolution and pooling.

#[allow(unused_imports)]
use super::*;

/// The device's planar window (kernels/common.cuh `Win`) of a 1-D or 2-D
/// window: its height and width axes. A 3-D window is refused (its ops take the
/// host path, [`super::forward_path`]), never cut down to its last two axes.
pub(super) fn to_win(w: &ops::conv::Window) -> Result<Win> {
    if w.rank > 2 {
        return Err(CudaError::Kernel(format!(
            "the device kernels handle 1-D and 2-D windows, not {}-D",
            w.rank
        )));
    }
    Ok(Win {
        h: w.input[1] as i64,
        w: w.input[2] as i64,
        oh: w.output[1] as i64,
        ow: w.output[2] as i64,
        kh: w.kernel[1] as i64,
        kw: w.kernel[2] as i64,
        sh: w.strides[1] as i64,
        sw: w.strides[2] as i64,
        dh: w.dilations[1] as i64,
        dw: w.dilations[2] as i64,
        ph: w.pads[1] as i64,
        pw: w.pads[2] as i64,
        padded_h: w.padded[1] as i64,
        padded_w: w.padded[2] as i64,
    })
}

/// Conv's geometry: (n, c, m, group, window, direct 1×1).
pub(super) fn conv_geom(
    attrs: &Attrs,
    x: &[usize],
    w: &[usize],
    out: &[usize],
) -> Result<(usize, usize, usize, usize, ops::conv::Window, bool)> {
    let group = attrs.int_or("group", 1).max(1) as usize;
    let win = ops::conv::window(attrs, &x[2..], &w[2..], &out[2..])?;
    let direct = win.is_direct();
    Ok((x[0], x[1], w[0], group, win, direct))
}

pub(super) fn conv_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (x, wt) = (cx.input(0)?, cx.input(1)?);
    let out = cx.out(0)?.shape.clone();
    let (n, c, m, group, win, direct) = conv_geom(cx.attrs(), &x.shape, &wt.shape, &out)?;
    let (cg, mg) = (c / group, m / group);
    let k = to_win(&win)?;
    let plane = win.output_len();
    let hw = win.input_len();
    let kk = cg * win.kernel_len();
    let y = dev.zeros(DType::F32, &out)?;
    let col: Option<Workspace> = if direct {
        None
    } else {
        Some(dev.workspace(kk * plane)?)
    };
    for img in 0..n {
        for g in 0..group {
            let xg = x.ptr() + 4 * ((img * c + g * cg) * hw) as u64;
            let src = match &col {
                None => xg,
                Some(col) => {
                    dev.launch(
                        "im2col_f32",
                        kk * plane,
                        &[Arg::n(cg), Arg::Win(k), Arg::Ptr(xg), Arg::Ptr(col.ptr())],
                    )?;
                    col.ptr()
                }
            };
            let wg = wt.ptr() + 4 * (g * mg * kk) as u64;
            let yg = y.ptr() + 4 * ((img * m + g * mg) * plane) as u64;
            sgemm(
                dev,
                (false, false),
                (mg, plane, kk),
                1.0,
                (wg, 0),
                (src, 0),
                0.0,
                (yg, 0),
                1,
            )?;
        }
    }
    if let Some(b) = cx.opt(2) {
        dev.launch(
            "conv_bias_f32",
            n * m * plane,
            &[Arg::n(n), Arg::n(m), Arg::n(plane), Arg::t(b), Arg::t(&y)],
        )?;
    }
    Ok(vec![y])
}

pub(super) fn conv_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let (fx, fw) = (cx.input(0)?, cx.input(1)?);
    let out = cx.output(0)?.shape.clone();
    let (n, c, m, group, win, direct) = conv_geom(cx.attrs(), &fx.shape, &fw.shape, &out)?;
    let (cg, mg) = (c / group, m / group);
    let k = to_win(&win)?;
    let plane = win.output_len();
    let hw = win.input_len();
    let kk = cg * win.kernel_len();
    let g = cx.grad(dev, 0)?;
    let g_of = |img: usize, gr: usize| g.ptr() + 4 * ((img * m + gr * mg) * plane) as u64;
    let col: Option<Workspace> = if direct || !(cx.wants(0) || cx.wants(1)) {
        None
    } else {
        Some(dev.workspace(kk * plane)?)
    };
    let mut res = Vec::new();
    if cx.wants(0) {
        let w = cx.saved(Saved::Input(1))?;
        let dx = dev.zeros(DType::F32, &fx.shape)?;
        for img in 0..n {
            for gr in 0..group {
                let wg = w.ptr() + 4 * (gr * mg * kk) as u64;
                let dxg = dx.ptr() + 4 * ((img * c + gr * cg) * hw) as u64;
                match &col {
                    None => sgemm(
                        dev,
                        (true, false),
                        (kk, plane, mg),
                        1.0,
                        (wg, 0),
                        (g_of(img, gr), 0),
                        0.0,
                        (dxg, 0),
                        1,
                    )?,
                    Some(col) => {
                        sgemm(
                            dev,
                            (true, false),
                            (kk, plane, mg),
                            1.0,
                            (wg, 0),
                            (g_of(img, gr), 0),
                            0.0,
                            (col.ptr(), 0),
                            1,
                        )?;
                        dev.launch(
                            "col2im_f32",
                            cg * hw,
                            &[Arg::n(cg), Arg::Win(k), Arg::Ptr(col.ptr()), Arg::Ptr(dxg)],
                        )?;
                    }
                }
            }
        }
        res.push((0, dx));
    }
    if cx.wants(1) {
        let x = cx.saved(Saved::Input(0))?;
        let dw = dev.zeros(DType::F32, &fw.shape)?;
        for gr in 0..group {
            let dwg = dw.ptr() + 4 * (gr * mg * kk) as u64;
            for img in 0..n {
                let xg = x.ptr() + 4 * ((img * c + gr * cg) * hw) as u64;
                let src = match &col {
                    None => xg,
                    Some(col) => {
                        dev.launch(
                            "im2col_f32",
                            kk * plane,
                            &[Arg::n(cg), Arg::Win(k), Arg::Ptr(xg), Arg::Ptr(col.ptr())],
                        )?;
                        col.ptr()
                    }
                };
                let beta = if img == 0 { 0.0 } else { 1.0 };
                sgemm(
                    dev,
                    (false, true),
                    (mg, kk, plane),
                    1.0,
                    (g_of(img, gr), 0),
                    (src, 0),
                    beta,
                    (dwg, 0),
                    1,
                )?;
            }
        }
        res.push((1, dw));
    }
    if cx.wants(2) {
        let db = dev.zeros(DType::F32, &[m])?;
        dev.launch(
            "channel_sum_f32",
            m,
            &[Arg::n(n), Arg::n(m), Arg::n(plane), Arg::t(&g), Arg::t(&db)],
        )?;
        res.push((2, db));
    }
    Ok(res)
}

pub(super) fn pool_window(attrs: &Attrs, x: &[usize], out: &[usize]) -> Result<ops::conv::Window> {
    let ks: Vec<usize> = attrs
        .ints("kernel_shape")
        .ok_or_else(|| CudaError::Kernel("missing attribute 'kernel_shape'".into()))?
        .iter()
        .map(|&k| k.max(1) as usize)
        .collect();
    Ok(ops::conv::window(attrs, &x[2..], &ks, &out[2..])?)
}

pub(super) fn pool_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let x = cx.input(0)?;
    let out = cx.out(0)?.shape.clone();
    let win = pool_window(cx.attrs(), &x.shape, &out)?;
    let k = to_win(&win)?;
    let planes = x.shape[0] * x.shape[1];
    let y = dev.zeros(DType::F32, &out)?;
    let n = y.numel();
    if cx.node.op_type == "MaxPool" {
        let idx = dev.zeros(DType::I64, &out)?;
        dev.launch(
            "maxpool2d_fwd_f32",
            n,
            &[
                Arg::n(planes),
                Arg::Win(k),
                Arg::t(x),
                Arg::t(&y),
                Arg::t(&idx),
            ],
        )?;
        let mut outs = vec![y];
        // Declared indices output, then the extra the backward rule saves.
        if cx.outputs.len() > 1 && cx.extras {
            outs.push(copy_as(dev, &idx, &out)?);
        }
        if cx.outputs.len() > 1 || cx.extras {
            outs.push(idx);
        }
        Ok(outs)
    } else {
        let include_pad = cx.attrs().int_or("count_include_pad", 0) != 0;
        dev.launch(
            "avgpool2d_fwd_f32",
            n,
            &[
                Arg::n(planes),
                Arg::Win(k),
                Arg::I32(include_pad as i32),
                Arg::t(x),
                Arg::t(&y),
            ],
        )?;
        Ok(vec![y])
    }
}

pub(super) fn pool_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let f = cx.input(0)?;
    let out = cx.output(0)?.shape.clone();
    let win = pool_window(cx.attrs(), &f.shape, &out)?;
    let k = to_win(&win)?;
    let planes = f.shape[0] * f.shape[1];
    let g = cx.grad(dev, 0)?;
    let dx = dev.zeros(DType::F32, &f.shape)?;
    let n = dx.numel();
    if cx.node.op_type == "MaxPool" {
        let idx = cx.saved(Saved::Extra(0))?;
        dev.launch(
            "maxpool2d_bwd_f32",
            n,
            &[
                Arg::n(planes),
                Arg::Win(k),
                Arg::t(&g),
                Arg::t(idx),
                Arg::t(&dx),
            ],
        )?;
    } else {
        let include_pad = cx.attrs().int_or("count_include_pad", 0) != 0;
        dev.launch(
            "avgpool2d_bwd_f32",
            n,
            &[
                Arg::n(planes),
                Arg::Win(k),
                Arg::I32(include_pad as i32),
                Arg::t(&g),
                Arg::t(&dx),
            ],
        )?;
    }
    Ok(vec![(0, dx)])
}

pub(super) fn gap_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let x = cx.input(0)?;
    let planes = x.shape[0] * x.shape[1];
    let plane: usize = x.shape[2..].iter().product();
    let y = dev.zeros(DType::F32, &cx.out(0)?.shape)?;
    if planes > 0 {
        dev.launch_cfg(
            "global_avgpool_fwd_f32",
            per_block(planes),
            &[Arg::n(planes), Arg::n(plane), Arg::t(x), Arg::t(&y)],
        )?;
    }
    Ok(vec![y])
}
