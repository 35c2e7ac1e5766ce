//! `ConvTranspose`: its rules and its CPU kernels (any spatial rank).

use rayon::prelude::*;

use super::conv::{check_nc, conv_backward};
use super::{
    dim, numel, Arity, Autocast, Backward, BackwardCx, CudaKernels, Cx, Fact, KernelCx, Op,
    Registry, RuleResult, Saved, Storage,
};
use crate::ir::Attrs;
use crate::numeric::gemm::{sgemm, Mat};
use crate::numeric::Tensor;

/// `ConvTranspose(X, W, B?)`, W = `[C, M/group, k...]`.
/// FLOPs: 2·(M/group)·prod(k) per input element, + 1 per output element for bias.
struct ConvTranspose;

impl Op for ConvTranspose {
    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (x, w) = (cx.input(0)?, cx.input(1)?);
        check_nc(x, "ConvTranspose")?;
        if w.rank() != x.rank() || w.shape[0] != x.shape[1] {
            return Err(format!("weight {:?} does not match input {:?}", w.shape, x.shape).into());
        }
        let group = cx.attrs().int_or("group", 1).max(1) as usize;
        if x.shape[1] % group != 0 {
            return Err(
                format!("group {group} does not divide the {} channels", x.shape[1]).into(),
            );
        }
        let nd = x.rank() - 2;
        let a = cx.attrs();
        let get =
            |n: &str, d: i64, len: usize| a.ints(n).map(|v| v.to_vec()).unwrap_or(vec![d; len]);
        let (s, d, op, p) = (
            get("strides", 1, nd),
            get("dilations", 1, nd),
            get("output_padding", 0, nd),
            get("pads", 0, 2 * nd),
        );
        if s.len() != nd || d.len() != nd || op.len() != nd || p.len() != 2 * nd {
            return Err("strides/dilations/pads do not match the spatial rank".into());
        }
        let w_shape = &w.shape;
        let out_channels = w.shape[1]
            .checked_mul(group)
            .ok_or_else(|| format!("group {group} is out of range"))?;
        if let Some(b) = cx.opt(2) {
            if b.shape != [out_channels] {
                return Err(format!("bias {:?} must be [{out_channels}]", b.shape).into());
            }
        }
        let mut shape = vec![x.shape[0], out_channels];
        if let Some(os) = a.ints("output_shape") {
            if os.len() < nd {
                return Err(format!("output_shape {os:?} has fewer than {nd} values").into());
            }
            let os = &os[os.len() - nd..];
            for &v in os {
                shape.push(dim(v, "output_shape")?);
            }
        } else if matches!(a.string("auto_pad"), Some("SAME_UPPER" | "SAME_LOWER")) {
            // The spec: the output is the input times the stride, pads chosen to fit.
            for (&xi, &si) in x.shape[2..].iter().zip(&s) {
                let o = xi as i128 * si as i128;
                let o = i64::try_from(o).map_err(|_| format!("output size {o} is too large"))?;
                shape.push(dim(o, "output size")?);
            }
        } else {
            // VALID: no padding.
            let valid = a.string("auto_pad") == Some("VALID");
            for i in 0..nd {
                let w = |v: i64| v as i128;
                let pad = |k: usize| if valid { 0 } else { w(p[k]) };
                let o = w(s[i]) * (x.shape[2 + i] as i128 - 1)
                    + w(op[i])
                    + (w_shape[2 + i] as i128 - 1) * w(d[i])
                    + 1
                    - pad(i)
                    - pad(i + nd);
                let o = i64::try_from(o).map_err(|_| format!("output size {o} is too large"))?;
                shape.push(dim(o, "output size")?);
            }
        }
        Ok(vec![Fact::new(x.dtype, shape)])
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let (Some(x), Some(w)) = (cx.inputs[0], cx.inputs[1]) else {
            return 0;
        };
        numel(&w.shape[1..])
            .saturating_mul(2)
            .saturating_mul(x.numel())
            .saturating_add(cx.opt(2).map_or(0, |_| out[0].numel()))
    }
    /// As Conv: input for the weight's gradient, weight for the input's.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(Some(conv_backward(self.flops(cx, out))))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// Any spatial rank, f32, the adjoint of Conv's input gradient: per (image,
    /// group), `col = W_gᵀ·X_g` (one GEMM) scattered into the output by col2im,
    /// then the bias; images and groups in parallel. The leading pads are `pads`,
    /// or, with `output_shape` or `auto_pad` SAME_*, the spec's: `total = s·(in −
    /// 1) + output_padding + (k − 1)·d + 1 − out`, SAME_UPPER `⌊total/2⌋` at the
    /// start, otherwise `total − ⌊total/2⌋` (negative pads widen the output).
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        conv_transpose_kernel(cx)
    }
    /// Per (image, group): `dX_g = W_g·im2col(G_g)` (reads W, the convolution of G
    /// by W); per group, over images in order: `dW_g += X_g·im2col(G_g)ᵀ` (reads
    /// X); `dB` sums G over images and positions (reads nothing).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        conv_transpose_backward(cx)
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Half
    }
}

/// Where each tap of a ConvTranspose lands: for kernel offset `k` and input
/// position `p` (row-major over the spatial dims), the output position
/// `p·s + k·d − pad` per dim, flattened, or [`Taps::NONE`] outside the output.
/// The same table is the im2col of the equivalent Conv (output → input).
struct Taps {
    /// Kernel offsets.
    kk: usize,
    /// Input positions per channel.
    small: usize,
    /// Output positions per channel.
    big: usize,
    /// `[kk, small]` flat output positions.
    map: Vec<usize>,
    /// Every tap lands where it starts (1×1 kernel, stride 1, no pads, same sizes).
    direct: bool,
}

impl Taps {
    const NONE: usize = usize::MAX;

    /// From the attributes, the input's and output's spatial shapes and the kernel.
    fn new(attrs: &Attrs, input: &[usize], kernel: &[usize], output: &[usize]) -> RuleResult<Taps> {
        let nd = input.len();
        let list = |name: &str, default: i64| -> RuleResult<Vec<i64>> {
            match attrs.ints(name) {
                Some(v) if v.len() == nd => Ok(v.to_vec()),
                Some(v) => {
                    Err(format!("'{name}' has {} values for {nd} spatial dims", v.len()).into())
                }
                None => Ok(vec![default; nd]),
            }
        };
        let (s, d, op) = (
            list("strides", 1)?,
            list("dilations", 1)?,
            list("output_padding", 0)?,
        );
        if s.iter().chain(&d).any(|&v| v < 1) {
            return Err("strides and dilations must be >= 1".into());
        }
        let auto = attrs.string("auto_pad").unwrap_or("NOTSET");
        // i128: attribute values can be anything a file says; nothing here may overflow.
        let w = |v: i64| v as i128;
        let begin: Vec<i128> = if attrs.ints("output_shape").is_some()
            || matches!(auto, "SAME_UPPER" | "SAME_LOWER")
        {
            (0..nd)
                .map(|i| {
                    let total = w(s[i]) * (input[i] as i128 - 1)
                        + w(op[i])
                        + (kernel[i] as i128 - 1) * w(d[i])
                        + 1
                        - output[i] as i128;
                    if auto == "SAME_UPPER" {
                        total.div_euclid(2)
                    } else {
                        total - total.div_euclid(2)
                    }
                })
                .collect()
        } else if auto == "VALID" {
            vec![0; nd]
        } else {
            match attrs.ints("pads") {
                Some(p) if p.len() == 2 * nd => p[..nd].iter().map(|&v| w(v)).collect(),
                Some(p) => {
                    return Err(
                        format!("'pads' has {} values for {nd} spatial dims", p.len()).into(),
                    )
                }
                None => vec![0; nd],
            }
        };
        let (s, d): (Vec<i128>, Vec<i128>) = (
            s.iter().map(|&v| w(v)).collect(),
            d.iter().map(|&v| w(v)).collect(),
        );
        let (kk, small, big) = (
            kernel.iter().product::<usize>(),
            input.iter().product::<usize>(),
            output.iter().product::<usize>(),
        );
        let mut map = vec![Taps::NONE; kk * small];
        let mut ko = vec![0usize; nd];
        let mut po = vec![0usize; nd];
        for k in 0..kk {
            let mut r = k;
            for i in (0..nd).rev() {
                ko[i] = r % kernel[i];
                r /= kernel[i];
            }
            for p in 0..small {
                let mut r = p;
                for i in (0..nd).rev() {
                    po[i] = r % input[i];
                    r /= input[i];
                }
                let mut at = 0usize;
                let mut inside = true;
                for i in 0..nd {
                    let o = po[i] as i128 * s[i] + ko[i] as i128 * d[i] - begin[i];
                    if o < 0 || o >= output[i] as i128 {
                        inside = false;
                        break;
                    }
                    at = at * output[i] + o as usize;
                }
                if inside {
                    map[k * small + p] = at;
                }
            }
        }
        let direct = kk == 1 && small == big && map.iter().enumerate().all(|(p, &o)| o == p);
        Ok(Taps {
            kk,
            small,
            big,
            map,
            direct,
        })
    }

    /// Adds `col` (`[c·kk, small]`) into `dst` (`[c, big]`).
    fn col2im(&self, col: &[f32], c: usize, dst: &mut [f32]) {
        for ch in 0..c {
            let out = &mut dst[ch * self.big..(ch + 1) * self.big];
            for k in 0..self.kk {
                let row = ch * self.kk + k;
                let src = &col[row * self.small..(row + 1) * self.small];
                let taps = &self.map[k * self.small..(k + 1) * self.small];
                for (&v, &o) in src.iter().zip(taps) {
                    if o != Taps::NONE {
                        out[o] += v;
                    }
                }
            }
        }
    }

    /// Fills `col` (`[c·kk, small]`) from `src` (`[c, big]`): the adjoint of col2im.
    fn im2col(&self, src: &[f32], c: usize, col: &mut [f32]) {
        for ch in 0..c {
            let plane = &src[ch * self.big..(ch + 1) * self.big];
            for k in 0..self.kk {
                let row = ch * self.kk + k;
                let dst = &mut col[row * self.small..(row + 1) * self.small];
                let taps = &self.map[k * self.small..(k + 1) * self.small];
                for (v, &o) in dst.iter_mut().zip(taps) {
                    *v = if o == Taps::NONE { 0.0 } else { plane[o] };
                }
            }
        }
    }
}

/// The sizes of one ConvTranspose: images, input channels, output channels per
/// group, groups, and its taps.
struct Shapes {
    n: usize,
    c: usize,
    mg: usize,
    group: usize,
    taps: Taps,
}

impl Shapes {
    fn new(attrs: &Attrs, x: &[usize], w: &[usize], out: &[usize]) -> RuleResult<Shapes> {
        let group = attrs.int_or("group", 1).max(1) as usize;
        let (n, c, mg) = (x[0], x[1], w[1]);
        if w[0] != c || c % group != 0 || out[1] != mg * group {
            return Err(format!(
                "weight {w:?} and group {group} do not fit input {x:?} and output {out:?}"
            )
            .into());
        }
        let taps = Taps::new(attrs, &x[2..], &w[2..], &out[2..])?;
        Ok(Shapes {
            n,
            c,
            mg,
            group,
            taps,
        })
    }
    /// Input channels per group.
    fn cg(&self) -> usize {
        self.c / self.group
    }
    /// Rows of a group's columns: output channels per group × kernel offsets.
    fn rows(&self) -> usize {
        self.mg * self.taps.kk
    }
}

/// ConvTranspose on the CPU; see [`ConvTranspose`]'s `forward_cpu`.
fn conv_transpose_kernel(cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
    let (x, wt) = (cx.input(0)?, cx.input(1)?);
    let out = cx.out(0)?.shape.clone();
    let sh = Shapes::new(cx.attrs(), &x.shape, &wt.shape, &out)?;
    let (cg, mg, rows, group) = (sh.cg(), sh.mg, sh.rows(), sh.group);
    let (small, big) = (sh.taps.small, sh.taps.big);
    let (xs, ws) = (x.to_f32()?, wt.to_f32()?);
    let bias = cx.opt(2).map(|b| b.to_f32()).transpose()?;
    let mut y = vec![0f32; sh.n * mg * group * big];
    if mg * big > 0 {
        y.par_chunks_mut(mg * big)
            .enumerate()
            .for_each(|(job, yg)| {
                let (img, g) = (job / group, job % group);
                let xg = &xs[(img * sh.c + g * cg) * small..(img * sh.c + (g + 1) * cg) * small];
                let wg = Mat::new(&ws[g * cg * rows..(g + 1) * cg * rows], rows, cg, true);
                let xm = Mat::new(xg, cg, small, false);
                if sh.taps.direct {
                    sgemm(1.0, wg, xm, 0.0, yg);
                } else if small > 0 {
                    let mut col = vec![0f32; rows * small];
                    sgemm(1.0, wg, xm, 0.0, &mut col);
                    sh.taps.col2im(&col, mg, yg);
                }
                if let Some(b) = &bias {
                    for (o, row) in yg.chunks_mut(big).enumerate() {
                        let bv = b[g * mg + o];
                        row.iter_mut().for_each(|v| *v += bv);
                    }
                }
            });
    }
    Ok(vec![Tensor::from_f32(x.dtype(), out, y)?])
}

/// ConvTranspose backward; see [`ConvTranspose`]'s `backward_cpu`.
fn conv_transpose_backward(cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
    let (fx, fw) = (cx.input(0)?, cx.input(1)?);
    let out = cx.output(0)?.shape.clone();
    let sh = Shapes::new(cx.attrs(), &fx.shape, &fw.shape, &out)?;
    let (n, c, cg, mg, rows, group) = (sh.n, sh.c, sh.cg(), sh.mg, sh.rows(), sh.group);
    let (small, big) = (sh.taps.small, sh.taps.big);
    let m = mg * group;
    let g = cx.grad(0)?;
    // G of (image, group): `[mg, big]`, contiguous.
    let g_of =
        |img: usize, gr: usize| &g[(img * m + gr * mg) * big..(img * m + (gr + 1) * mg) * big];
    // im2col of G of (image, group) into `buf` (G itself when direct).
    let cols = |img: usize, gr: usize, buf: &'_ mut Vec<f32>| {
        if !sh.taps.direct {
            buf.resize(rows * small, 0.0);
            sh.taps.im2col(g_of(img, gr), mg, buf);
        }
    };
    let mut res = Vec::new();
    if cx.wants(0) {
        let ws = cx.saved(Saved::Input(1))?.to_f32()?;
        let mut dx = vec![0f32; n * c * small];
        if cg * small > 0 {
            dx.par_chunks_mut(cg * small)
                .enumerate()
                .for_each(|(job, dxg)| {
                    let (img, gr) = (job / group, job % group);
                    let mut buf = Vec::new();
                    cols(img, gr, &mut buf);
                    let colv: &[f32] = if sh.taps.direct { g_of(img, gr) } else { &buf };
                    sgemm(
                        1.0,
                        Mat::new(&ws[gr * cg * rows..(gr + 1) * cg * rows], cg, rows, false),
                        Mat::new(colv, rows, small, false),
                        0.0,
                        dxg,
                    );
                });
        }
        res.push((0, dx));
    }
    if cx.wants(1) {
        let xs = cx.saved(Saved::Input(0))?.to_f32()?;
        let mut dw = vec![0f32; c * rows];
        if cg * rows > 0 && small > 0 {
            dw.par_chunks_mut(cg * rows)
                .enumerate()
                .for_each(|(gr, dwg)| {
                    let mut buf = Vec::new();
                    for img in 0..n {
                        cols(img, gr, &mut buf);
                        let colv: &[f32] = if sh.taps.direct { g_of(img, gr) } else { &buf };
                        let xg =
                            &xs[(img * c + gr * cg) * small..(img * c + (gr + 1) * cg) * small];
                        sgemm(
                            1.0,
                            Mat::new(xg, cg, small, false),
                            Mat::new(colv, small, rows, true),
                            1.0,
                            dwg,
                        );
                    }
                });
        }
        res.push((1, dw));
    }
    if cx.wants(2) {
        res.push((2, super::conv::bias_grad(&g, n, m, big)));
    }
    cx.answer(res)
}

/// Registers ConvTranspose.
pub fn register(r: &mut Registry) {
    r.add("ConvTranspose", ConvTranspose);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attr, DType};

    fn attrs(v: &[(&str, Attr)]) -> Attrs {
        Attrs::from_iter(v.iter().map(|(k, a)| (k.to_string(), a.clone())))
    }

    /// ConvTranspose: SAME_* gives input × stride, VALID no padding, whatever `pads` say.
    #[test]
    fn conv_transpose_auto_pad() {
        let out = |auto: &str| {
            let node = crate::ir::Node {
                name: "ct".into(),
                op_type: "ConvTranspose".into(),
                domain: Default::default(),
                inputs: vec![Some(0), Some(1)].into(),
                outputs: vec![Some(2)].into(),
                attrs: attrs(&[
                    ("strides", Attr::Ints(vec![2, 2])),
                    ("pads", Attr::Ints(vec![1, 1, 1, 1])),
                    ("auto_pad", Attr::String(auto.into())),
                ]),
            };
            let (x, w) = (
                Fact::new(DType::F32, vec![1, 1, 3, 3]),
                Fact::new(DType::F32, vec![1, 2, 3, 3]),
            );
            let cx = Cx {
                node: &node,
                inputs: smallvec::smallvec![Some(&x), Some(&w)],
                opset: 17,
            };
            ConvTranspose.infer(&cx).unwrap()[0].shape.clone()
        };
        assert_eq!(out("SAME_UPPER"), vec![1, 2, 6, 6]);
        assert_eq!(out("SAME_LOWER"), vec![1, 2, 6, 6]);
        // 2·(3 − 1) + (3 − 1) + 1 = 7 without pads.
        assert_eq!(out("VALID"), vec![1, 2, 7, 7]);
        assert_eq!(out("NOTSET"), vec![1, 2, 5, 5]);
    }
}
