//! Image ops beside convolution: Col2Im (`torch.nn.Fold`), DeformConv
//! (torchvision's `deform_conv2d`), RoiAlign (torchvision's `roi_align`) and
//! MaxUnpool (`torch.nn.MaxUnpool2d`).
//!
//! Shape rules, FLOPs, backward rules and CPU kernels (forward and backward)
//! as PyTorch/torchvision run them, all four on the host on the device.
//! RoiAlign's kernels are in `spatial/roi_align.rs` (opsets 10 and 16:
//! `half_pixel` / `output_half_pixel`, avg and max, adaptive sampling; max has
//! no backward, as torchvision has no max RoiAlign), DeformConv's in
//! `spatial/deform_conv.rs` (2-D: groups, offset groups, strides, pads,
//! dilations, optional bias and mask).

mod deform_conv;
mod roi_align;

use super::{
    conv::{col2im, im2col, window, window_out},
    dim, Arity, Autocast, Backward, BackwardCx, CudaKernels, Cx, Fact, Grad, KernelCx, Op,
    Registry, RuleResult, Saved, Storage,
};
use crate::numeric::Tensor;
use deform_conv::{DeformAttrs, Geom, Sampled};

/// `Col2Im(input [N, C·∏block, L], image_shape, block_shape) -> [N, C,
/// image...]`: the blocks summed back into an image (`strides`, `pads`,
/// `dilations` as Conv). L must equal the number of block positions. FLOPs: 1
/// per input element (the adds).
struct Col2Im;

impl Op for Col2Im {
    fn arity(&self) -> Arity {
        Arity::new(3, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let image = cx.sizes(1, "image_shape")?;
        let block = cx.sizes(2, "block_shape")?;
        if x.rank() != 3 || image.len() != block.len() || image.is_empty() {
            return Err(format!(
                "input {:?}, image_shape {image:?} and block_shape {block:?} do not fit",
                x.shape
            )
            .into());
        }
        let per = block
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| format!("block_shape {block:?} is too large"))?;
        if per == 0 || x.shape[1] % per != 0 {
            return Err(format!(
                "{} channels are not a multiple of the block's {per}",
                x.shape[1]
            )
            .into());
        }
        let positions = window_out(&image, &block, cx.attrs(), false)?
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| format!("image_shape {image:?} has too many block positions"))?;
        if positions != x.shape[2] {
            return Err(format!(
                "{} blocks given, the image has {positions} block positions",
                x.shape[2]
            )
            .into());
        }
        let mut shape = vec![x.shape[0], x.shape[1] / per];
        shape.extend(image);
        Ok(vec![Fact::new(x.dtype, shape)])
    }
    fn flops(&self, cx: &Cx, _out: &[Fact]) -> u64 {
        cx.input(0).map_or(0, |x| x.numel())
    }
    /// `fold`'s backward is `unfold` of the gradient: nothing saved.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(Some(Backward::each(&[0], &[], self.flops(cx, out))))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// 1-D to 3-D, f32: each image's columns summed back by Conv's col2im.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let to = |t: &Tensor| {
            t.to_i64s()
                .into_iter()
                .map(|v| v as usize)
                .collect::<Vec<_>>()
        };
        let (image, block) = (to(cx.input(1)?), to(cx.input(2)?));
        let out = cx.out(0)?;
        let w = fold_window(cx.attrs(), &image, &block)?;
        let (n, c) = (out.shape[0], out.shape[1]);
        let per_in = x.shape[1] * x.shape[2];
        let per_out: usize = c * image.iter().product::<usize>();
        let v = x.to_f32()?;
        let mut y = vec![0f32; n * per_out];
        for b in 0..n {
            col2im(
                &v[b * per_in..(b + 1) * per_in],
                c,
                &w,
                &mut y[b * per_out..(b + 1) * per_out],
            );
        }
        Ok(vec![Tensor::from_f32(x.dtype(), out.shape.clone(), y)?])
    }
    /// `unfold` of the gradient (Conv's im2col).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let rcx = cx.rule_cx();
        let (image, block) = (rcx.sizes(1, "image_shape")?, rcx.sizes(2, "block_shape")?);
        let (x, out) = (cx.input(0)?, cx.output(0)?);
        let w = fold_window(cx.attrs(), &image, &block)?;
        let (n, c) = (out.shape[0], out.shape[1]);
        let per_in = x.shape[1] * x.shape[2];
        let per_out: usize = c * image.iter().product::<usize>();
        let g = cx.grad(0)?;
        let mut dx = vec![0f32; n * per_in];
        for b in 0..n {
            im2col(
                &g[b * per_out..(b + 1) * per_out],
                c,
                &w,
                &mut dx[b * per_in..(b + 1) * per_in],
            );
        }
        cx.answer(vec![(0, dx)])
    }
    /// No device kernel: the host path.
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// `DeformConv(X, W, offset, B?, mask?) -> Y`, shaped as Conv (`group`,
/// `offset_group`). FLOPs: Conv's 2 per multiply-add, plus per sampled point
/// its bilinear interpolation (4 taps, 2 each) and the mask multiply.
struct DeformConv;

impl Op for DeformConv {
    fn arity(&self) -> Arity {
        Arity::new(3, 5, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (x, w, off) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
        if x.rank() < 3 || w.rank() != x.rank() || off.rank() != x.rank() {
            return Err(format!(
                "X {:?}, W {:?} and offset {:?} do not fit",
                x.shape, w.shape, off.shape
            )
            .into());
        }
        let attrs = cx.attrs();
        let at = DeformAttrs::of(attrs);
        let group = at.group;
        if w.shape[1] * group != x.shape[1] {
            return Err(format!(
                "input has {} channels, weight {:?} with group {group} expects {}",
                x.shape[1],
                w.shape,
                w.shape[1] * group
            )
            .into());
        }
        let kernel = &w.shape[2..];
        let mut shape = vec![x.shape[0], w.shape[0]];
        shape.extend(window_out(&x.shape[2..], kernel, attrs, false)?);
        if w.shape[0] % group != 0 {
            return Err(format!(
                "{} output channels are not a multiple of group {group}",
                w.shape[0]
            )
            .into());
        }
        if let Some(ks) = at.kernel_shape {
            if ks.iter().map(|&v| v as usize).ne(kernel.iter().copied()) {
                return Err(format!("kernel_shape {ks:?} differs from W {:?}", w.shape).into());
            }
        }
        let og = at.offset_group;
        if x.shape[1] % og != 0 {
            return Err(format!(
                "{} input channels are not a multiple of offset_group {og}",
                x.shape[1]
            )
            .into());
        }
        let k: usize = kernel.iter().product();
        let mut want_off = vec![x.shape[0], og * k * kernel.len()];
        want_off.extend_from_slice(&shape[2..]);
        if off.shape != want_off {
            return Err(format!("offset is {:?}, expected {want_off:?}", off.shape).into());
        }
        if let Some(b) = cx.opt(3) {
            if b.shape != [w.shape[0]] {
                return Err(format!("B is {:?}, expected [{}]", b.shape, w.shape[0]).into());
            }
        }
        if let Some(m) = cx.opt(4) {
            let mut want = vec![x.shape[0], og * k];
            want.extend_from_slice(&shape[2..]);
            if m.shape != want {
                return Err(format!("mask is {:?}, expected {want:?}", m.shape).into());
            }
        }
        Ok(vec![Fact::new(x.dtype, shape)])
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let (Ok(x), Ok(w)) = (cx.input(0), cx.input(1)) else {
            return 0;
        };
        let k: u64 = w.shape[2..].iter().product::<usize>() as u64;
        let macs = out[0].numel().saturating_mul(w.shape[1] as u64 * k);
        let points =
            (out[0].numel() / w.shape[0].max(1) as u64).saturating_mul(x.shape[1] as u64 * k);
        macs.saturating_mul(2)
            .saturating_add(points.saturating_mul(9))
    }
    /// torchvision's DeformConv2dFunction saves the input, weight, offset, mask
    /// and bias; gradients for all of them. Backward FLOPs: twice the forward's.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let present: Vec<usize> = (0..5).filter(|&i| cx.opt(i).is_some()).collect();
        let needs: Vec<Saved> = present.iter().map(|&i| Saved::Input(i)).collect();
        Ok(Some(Backward {
            grads: present
                .iter()
                .map(|&input| Grad {
                    input,
                    needs: needs.clone(),
                })
                .collect(),
            extras: Vec::new(),
            flops: self.flops(cx, out).saturating_mul(2),
        }))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// 2-D (torchvision's `deform_conv2d`; other ranks refused in one line),
    /// f32: see `spatial/deform_conv.rs`.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let (x, w, off) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
        let out = cx.out(0)?;
        let geo = Geom::new(cx.attrs(), &x.shape, &w.shape, &out.shape)?;
        let (off, mask) = (off.to_f32()?, cx.opt(4).map(|m| m.to_f32()).transpose()?);
        let s = Sampled {
            geo: &geo,
            offset: &off,
            mask: mask.as_deref(),
        };
        let bias = cx.opt(3).map(|b| b.to_f32()).transpose()?;
        let y = deform_conv::forward(&s, &x.to_f32()?, &w.to_f32()?, bias.as_deref());
        Ok(vec![Tensor::from_f32(x.dtype(), out.shape.clone(), y)?])
    }
    /// torchvision's backward: dX, dOffset and dMask from `Wᵀ · dY` (dOffset and
    /// dMask also read X), dW from X's sampled columns, dB the sum of dY; each
    /// reads only the saved tensors it needs.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let (fx, fw, out) = (cx.input(0)?, cx.input(1)?, cx.output(0)?);
        let geo = Geom::new(cx.attrs(), &fx.shape, &fw.shape, &out.shape)?;
        let g = cx.grad(0)?;
        let has_mask = cx.input(4).is_ok();
        let sampled = [0, 1, 2, 4].iter().any(|&i| cx.wants(i));
        let mut res = Vec::new();
        if sampled {
            let off = cx.saved(Saved::Input(2))?.to_f32()?;
            let mask = if has_mask {
                Some(cx.saved(Saved::Input(4))?.to_f32()?)
            } else {
                None
            };
            let s = Sampled {
                geo: &geo,
                offset: &off,
                mask: mask.as_deref(),
            };
            let coords = cx.wants(2) || cx.wants(4);
            let x = if coords || cx.wants(1) {
                Some(cx.saved(Saved::Input(0))?.to_f32()?)
            } else {
                None
            };
            if cx.wants(0) || coords {
                let w = cx.saved(Saved::Input(1))?.to_f32()?;
                let xs = x.as_deref().filter(|_| coords);
                let d = deform_conv::input_grads(&s, xs, &w, &g, cx.wants(0));
                for (i, v) in [(0, d.x), (2, d.offset), (4, d.mask)] {
                    if let (true, Some(v)) = (cx.wants(i), v) {
                        res.push((i, v));
                    }
                }
            }
            if let (true, Some(x)) = (cx.wants(1), x.as_deref()) {
                res.push((1, deform_conv::weight_grad(&s, x, &g)));
            }
        }
        if cx.wants(3) {
            let (n, m) = (out.shape[0], out.shape[1]);
            res.push((
                3,
                super::conv::bias_grad(&g, n, m, out.shape[2..].iter().product()),
            ));
        }
        cx.answer(res)
    }
    /// No device kernel: the host path.
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    /// Not on autocast's lists (torchvision registers it to run in float32).
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Full
    }
}

/// `RoiAlign(X [N, C, H, W], rois [R, 4], batch_indices [R]) -> [R, C,
/// output_height, output_width]`. FLOPs: per output element, `sampling_ratio²`
/// samples (4 when adaptive, 0) of 4 bilinear taps at 2 each, plus their average.
struct RoiAlign;

impl Op for RoiAlign {
    fn arity(&self) -> Arity {
        Arity::new(3, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (x, rois, idx) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
        if x.rank() != 4 || rois.rank() != 2 || rois.shape[1] != 4 || idx.shape != [rois.shape[0]] {
            return Err(format!(
                "X {:?}, rois {:?} and batch_indices {:?} do not fit",
                x.shape, rois.shape, idx.shape
            )
            .into());
        }
        let cfg = roi_align::config(cx.attrs(), cx.opset)?;
        Ok(vec![Fact::new(
            x.dtype,
            vec![rois.shape[0], x.shape[1], cfg.out_h, cfg.out_w],
        )])
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        // Inference has checked the attributes.
        let sr = roi_align::config(cx.attrs(), cx.opset).map_or(0, |c| c.sampling_ratio) as u64;
        // Saturating: u64::MAX is the overflow inference refuses in one line.
        let samples = if sr == 0 { 4 } else { sr.saturating_mul(sr) };
        out[0].numel().saturating_mul(samples.saturating_mul(9))
    }
    /// torchvision's RoIAlignFunction saves the rois (here rois and batch
    /// indices, its `[K, 5]` rois split in two) and the input's shape; the
    /// gradient goes to X only. Backward FLOPs: the forward's. `mode` max has
    /// no PyTorch equivalent (torchvision's roi_align averages): refused.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if roi_align::config(cx.attrs(), cx.opset)?.max {
            return Err(roi_align::MAX_HAS_NO_GRADIENT.into());
        }
        Ok(Some(Backward::each(
            &[0],
            &[Saved::Input(1), Saved::Input(2)],
            self.flops(cx, out),
        )))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// f32: see `spatial/roi_align.rs`.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let (x, rois, idx) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
        let cfg = roi_align::config(cx.attrs(), cx.opset)?;
        let y = roi_align::forward(
            &cfg,
            &x.to_f32()?,
            &x.shape,
            &rois.to_f32()?,
            &idx.to_i64s(),
        )?;
        let out = cx.out(0)?;
        Ok(vec![Tensor::from_f32(x.dtype(), out.shape.clone(), y)?])
    }
    /// avg: the bilinear weights of every sample scattered back (torchvision's
    /// `roi_align_backward`), from the saved rois and batch indices and X's
    /// shape; max refuses (as its rule).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let cfg = roi_align::config(cx.attrs(), cx.opset)?;
        if cfg.max {
            return Err(roi_align::MAX_HAS_NO_GRADIENT.into());
        }
        let rois = cx.saved(Saved::Input(1))?.to_f32()?;
        let idx = cx.saved(Saved::Input(2))?.to_i64s();
        let dx = roi_align::backward(&cfg, &cx.input(0)?.shape, &rois, &idx, &cx.grad(0)?)?;
        cx.answer(vec![(0, dx)])
    }
    /// No device kernel: the host path.
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    /// torchvision runs roi_align in float32 under autocast.
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Full
    }
}

/// `MaxUnpool(X, I, output_shape?) -> Y`: each value written where its index
/// says, zeros elsewhere; `[N, C, (in − 1)·stride + kernel − pads...]` or
/// `output_shape` (a constant). FLOPs: 0 (data movement).
struct MaxUnpool;

impl Op for MaxUnpool {
    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (x, i) = (cx.input(0)?, cx.input(1)?);
        if i.shape != x.shape || x.rank() < 3 {
            return Err(format!("X {:?} and I {:?} do not fit", x.shape, i.shape).into());
        }
        if cx.opt(2).is_some() {
            let s = cx.sizes(2, "output_shape")?;
            if s.len() != x.rank() || s[..2] != x.shape[..2] {
                return Err(format!("output_shape {s:?} does not fit X {:?}", x.shape).into());
            }
            return Ok(vec![Fact::new(x.dtype, s)]);
        }
        Ok(vec![Fact::new(x.dtype, unpooled(&x.shape, cx.attrs())?)])
    }
    fn flops(&self, _cx: &Cx, _out: &[Fact]) -> u64 {
        0
    }
    /// `max_unpool`'s backward gathers the gradient at the saved indices.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let _ = out;
        Ok(Some(Backward::each(
            &[0],
            &[Saved::Input(1)],
            cx.input(0)?.numel(),
        )))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// As the ONNX reference: each value at its index (flat over the whole
    /// unpooled tensor, as MaxPool's indices), then that tensor placed at the
    /// origin of `output_shape`, zeros elsewhere. A later duplicate index wins.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let (x, i) = (cx.input(0)?, cx.input(1)?);
        let out = cx.out(0)?;
        let map = unpool_map(&x.shape, &i.to_i64s(), cx.attrs(), &out.shape)?;
        let v = x.to_f32()?;
        let mut y = vec![0f32; out.numel() as usize];
        for (e, &o) in map.iter().enumerate() {
            y[o] = v[e];
        }
        Ok(vec![Tensor::from_f32(x.dtype(), out.shape.clone(), y)?])
    }
    /// `dX[e] = dY[I[e]]`.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let x = cx.input(0)?;
        let out = cx.output(0)?;
        let i = cx.saved(Saved::Input(1))?;
        let map = unpool_map(&x.shape, &i.to_i64s(), cx.attrs(), &out.shape)?;
        let g = cx.grad(0)?;
        cx.answer(vec![(0, map.iter().map(|&o| g[o]).collect())])
    }
    /// No device kernel: the host path.
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// Col2Im's sliding window: the block over the image, its positions the
/// "output" of Conv's window.
fn fold_window(
    a: &crate::ir::Attrs,
    image: &[usize],
    block: &[usize],
) -> RuleResult<super::conv::Window> {
    let positions = window_out(image, block, a, false)?;
    window(a, image, block, &positions)
}

/// MaxUnpool's shape without `output_shape`: `(in − 1)·stride + kernel − pads`.
fn unpooled(x: &[usize], a: &crate::ir::Attrs) -> RuleResult<Vec<usize>> {
    let nd = x.len() - 2;
    let ks = a
        .ints("kernel_shape")
        .ok_or("missing attribute 'kernel_shape'")?;
    let get = |n: &str, d: i64, len: usize| a.ints(n).map_or(vec![d; len], |v| v.to_vec());
    let (st, pads) = (get("strides", 1, nd), get("pads", 0, 2 * nd));
    if ks.len() != nd || st.len() != nd || pads.len() != 2 * nd {
        return Err("kernel_shape, strides and pads do not match the spatial rank".into());
    }
    let mut shape = x[..2].to_vec();
    for k in 0..nd {
        let v = (x[k + 2] as i64 - 1) * st[k] + ks[k] - pads[k] - pads[k + nd];
        shape.push(dim(v, "output size")?);
    }
    Ok(shape)
}

/// For each element of X, its flat position in the output: its index unravelled
/// in the unpooled shape, ravelled in `out` (which must hold the unpooled shape).
fn unpool_map(
    x: &[usize],
    idx: &[i64],
    a: &crate::ir::Attrs,
    out: &[usize],
) -> RuleResult<Vec<usize>> {
    let inner = unpooled(x, a)?;
    if inner.iter().zip(out).any(|(i, o)| i > o) {
        return Err(
            format!("output_shape {out:?} is smaller than the unpooled shape {inner:?}").into(),
        );
    }
    let total: usize = inner.iter().product();
    idx.iter()
        .map(|&f| {
            if f < 0 || f as usize >= total {
                return Err(format!("index {f} is outside the unpooled {inner:?}").into());
            }
            let (mut f, mut o, mut stride) = (f as usize, 0usize, 1usize);
            for k in (0..inner.len()).rev() {
                o += (f % inner[k]) * stride;
                f /= inner[k];
                stride *= out[k];
            }
            Ok(o)
        })
        .collect()
}

pub(super) fn register(r: &mut Registry) {
    r.add("Col2Im", Col2Im);
    r.add("DeformConv", DeformConv);
    r.add("RoiAlign", RoiAlign);
    r.add("MaxUnpool", MaxUnpool);
}
