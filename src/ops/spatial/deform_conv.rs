//! DeformConv's CPU kernels, as torchvision's `deform_conv2d` computes them
//! (torchvision/csrc/ops/cpu/deform_conv2d_kernel.cpp), 2-D only (what
//! torchvision has).
//!
//! - Kernel tap `(i, j)` of output `(oy, ox)` samples input channel `ch` at
//!   `(oy·stride − pad + i·dilation + Δy, ox·stride − pad + j·dilation + Δx)`,
//!   `(Δy, Δx)` the offsets of `ch`'s offset group (offset channels laid out
//!   `[offset_group, kh, kw, (y, x)]`), bilinearly with zeros outside the
//!   image (a point at or beyond −1 or the size is 0), times the mask of that
//!   tap and group when there is one. The columns `[C·kh·kw, oh·ow]` of those
//!   samples times each group's weights, plus the bias, are the output.
//! - Backward, from the column gradient `Wᵀ · dY` per group: dX scatters it
//!   with the bilinear weights (times the mask); dOffset sums over the group's
//!   channels the mask times the interpolation's slope along the axis
//!   (`get_coordinate_weight`); dMask the sampled values; dW is `dY ·
//!   columnsᵀ`; dB sums dY. Exact derivatives away from integer sample
//!   positions, where the interpolation has kinks (torchvision's one-sided
//!   choice there is kept: the slope of the cell `floor` selects).

use std::ops::Range;

use rayon::prelude::*;

use crate::ir::Attrs;
use crate::numeric::gemm::{sgemm, Mat};
use crate::numeric::RuleResult;
use crate::ops::conv::window;

/// The sizes of one 2-D deformable convolution.
#[derive(Debug, Clone)]
pub(in crate::ops) struct Geom {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    /// Output channels.
    m: usize,
    group: usize,
    offset_group: usize,
    kh: usize,
    kw: usize,
    oh: usize,
    ow: usize,
    stride: [usize; 2],
    dilation: [usize; 2],
    /// Leading pads (top, left); the trailing ones only shape the output.
    pad: [usize; 2],
}

/// DeformConv's own attributes (the window's are Conv's).
pub(in crate::ops) struct DeformAttrs<'a> {
    /// `group` (default 1; at least 1).
    pub(in crate::ops) group: usize,
    /// `offset_group` (default 1; at least 1).
    pub(in crate::ops) offset_group: usize,
    /// `kernel_shape` (default: W's).
    pub(in crate::ops) kernel_shape: Option<&'a [i64]>,
}

impl DeformAttrs<'_> {
    pub(in crate::ops) fn of(a: &Attrs) -> DeformAttrs<'_> {
        DeformAttrs {
            group: a.int_or("group", 1).max(1) as usize,
            offset_group: a.int_or("offset_group", 1).max(1) as usize,
            kernel_shape: a.ints("kernel_shape"),
        }
    }
}

impl Geom {
    /// From X's and W's shapes, the inferred output shape and the attributes;
    /// refuses anything but 2-D.
    pub(in crate::ops) fn new(
        a: &Attrs,
        x: &[usize],
        wt: &[usize],
        out: &[usize],
    ) -> RuleResult<Geom> {
        if x.len() != 4 {
            return Err(format!(
                "the CPU kernels of DeformConv are 2-D (torchvision's deform_conv2d), X {x:?} \
                 is {}-D",
                x.len().saturating_sub(2)
            )
            .into());
        }
        let win = window(a, &x[2..], &wt[2..], &out[2..])?;
        let at = DeformAttrs::of(a);
        Ok(Geom {
            n: x[0],
            c: x[1],
            h: x[2],
            w: x[3],
            m: wt[0],
            group: at.group,
            offset_group: at.offset_group,
            // A 2-D window is the last two of the window's three axes.
            kh: win.kernel[1],
            kw: win.kernel[2],
            oh: win.output[1],
            ow: win.output[2],
            stride: [win.strides[1], win.strides[2]],
            dilation: [win.dilations[1], win.dilations[2]],
            pad: [win.pads[1], win.pads[2]],
        })
    }
    /// Kernel taps.
    fn k(&self) -> usize {
        self.kh * self.kw
    }
    /// Output positions per channel.
    fn p(&self) -> usize {
        self.oh * self.ow
    }
    /// Input channels per group.
    fn cg(&self) -> usize {
        self.c / self.group
    }
    /// Output channels per group.
    fn mg(&self) -> usize {
        self.m / self.group
    }
    /// Input channels per offset group.
    fn co(&self) -> usize {
        self.c / self.offset_group
    }
    fn plane(&self) -> usize {
        self.h * self.w
    }
}

/// The forward's data: X `[n, c, h, w]`, offsets `[n, og·2k, p]`, the mask
/// `[n, og·k, p]` when given.
pub(in crate::ops) struct Sampled<'a> {
    pub(in crate::ops) geo: &'a Geom,
    pub(in crate::ops) offset: &'a [f32],
    pub(in crate::ops) mask: Option<&'a [f32]>,
}

impl Sampled<'_> {
    /// Where tap `kk` of position `pp` in image `img`, offset group `og`,
    /// samples, and its mask.
    fn point(&self, img: usize, og: usize, kk: usize, pp: usize) -> (f32, f32, f32) {
        let g = self.geo;
        let (k, p) = (g.k(), g.p());
        let (i, j) = (kk / g.kw, kk % g.kw);
        let (oy, ox) = (pp / g.ow, pp % g.ow);
        let base = |o: usize, s: usize, t: usize, d: usize, pad: usize| {
            (o * s + t * d) as i64 - pad as i64
        };
        let by = base(oy, g.stride[0], i, g.dilation[0], g.pad[0]);
        let bx = base(ox, g.stride[1], j, g.dilation[1], g.pad[1]);
        let o = ((img * g.offset_group + og) * k + kk) * 2 * p + pp;
        let m = self.mask.map_or(1.0, |mk| {
            mk[((img * g.offset_group + og) * k + kk) * p + pp]
        });
        (
            by as f32 + self.offset[o],
            bx as f32 + self.offset[o + p],
            m,
        )
    }

    /// Columns `[chs.len()·k, p]` of image `img` over X's channels `chs`:
    /// mask · sample.
    fn columns(&self, x: &[f32], img: usize, chs: Range<usize>) -> Vec<f32> {
        let g = self.geo;
        let (k, p, hw) = (g.k(), g.p(), g.plane());
        let mut col = vec![0f32; chs.len() * k * p];
        if k * p == 0 {
            return col;
        }
        col.par_chunks_mut(k * p).enumerate().for_each(|(i, cc)| {
            let ch = chs.start + i;
            let plane = &x[(img * g.c + ch) * hw..(img * g.c + ch + 1) * hw];
            let og = ch / g.co();
            for kk in 0..k {
                for pp in 0..p {
                    let (y, xx, m) = self.point(img, og, kk, pp);
                    cc[kk * p + pp] = m * sample(plane, g.h, g.w, y, xx);
                }
            }
        });
        col
    }
}

/// The four taps around `(y, x)`: rows `yl, yl + 1`, columns `xl, xl + 1`, and
/// the fractions `(ly, lx)`; `None` where `(y, x)` is too far out to touch
/// the image (NaN included).
fn cell(h: usize, w: usize, y: f32, x: f32) -> Option<(i64, i64, f32, f32)> {
    if !(y > -2.0 && y < h as f32 + 1.0 && x > -2.0 && x < w as f32 + 1.0) {
        return None;
    }
    let (yl, xl) = (y.floor(), x.floor());
    Some((yl as i64, xl as i64, y - yl, x - xl))
}

/// The value at `(y, x)` of an `h × w` plane, 0 outside.
fn at(plane: &[f32], h: usize, w: usize, y: i64, x: i64) -> f32 {
    if y >= 0 && x >= 0 && (y as usize) < h && (x as usize) < w {
        plane[y as usize * w + x as usize]
    } else {
        0.0
    }
}

/// torchvision's `bilinear_interpolate`: 0 at or beyond −1 and the size,
/// zeros outside the image.
fn sample(plane: &[f32], h: usize, w: usize, y: f32, x: f32) -> f32 {
    if y <= -1.0 || h as f32 <= y || x <= -1.0 || w as f32 <= x {
        return 0.0;
    }
    let Some((yl, xl, ly, lx)) = cell(h, w, y, x) else {
        return 0.0;
    };
    let (hy, hx) = (1.0 - ly, 1.0 - lx);
    hy * hx * at(plane, h, w, yl, xl)
        + hy * lx * at(plane, h, w, yl, xl + 1)
        + ly * hx * at(plane, h, w, yl + 1, xl)
        + ly * lx * at(plane, h, w, yl + 1, xl + 1)
}

/// torchvision's `get_coordinate_weight`: the slope of the interpolation at
/// `(y, x)` along y and along x, from the cell `floor` selects.
fn slopes(plane: &[f32], h: usize, w: usize, y: f32, x: f32) -> (f32, f32) {
    let Some((yl, xl, ly, lx)) = cell(h, w, y, x) else {
        return (0.0, 0.0);
    };
    let v = |dy: i64, dx: i64| at(plane, h, w, yl + dy, xl + dx);
    let (v00, v01, v10, v11) = (v(0, 0), v(0, 1), v(1, 0), v(1, 1));
    (
        lx * (v11 - v01) + (1.0 - lx) * (v10 - v00),
        ly * (v11 - v10) + (1.0 - ly) * (v01 - v00),
    )
}

/// `v` scattered to the taps of `(y, x)` with their bilinear weights (the
/// transpose of [`sample`]).
fn scatter(plane: &mut [f32], h: usize, w: usize, y: f32, x: f32, v: f32) {
    if y <= -1.0 || h as f32 <= y || x <= -1.0 || w as f32 <= x {
        return;
    }
    let Some((yl, xl, ly, lx)) = cell(h, w, y, x) else {
        return;
    };
    for (ty, wy) in [(yl, 1.0 - ly), (yl + 1, ly)] {
        for (tx, wx) in [(xl, 1.0 - lx), (xl + 1, lx)] {
            if ty >= 0 && tx >= 0 && (ty as usize) < h && (tx as usize) < w {
                plane[ty as usize * w + tx as usize] += v * wy * wx;
            }
        }
    }
}

/// The forward: `[n, m, oh, ow]` from X, W `[m, cg·k]` and the bias `[m]`.
pub(in crate::ops) fn forward(
    s: &Sampled,
    x: &[f32],
    wt: &[f32],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let g = s.geo;
    let (p, kk, mg) = (g.p(), g.cg() * g.k(), g.mg());
    let mut y = vec![0f32; g.n * g.m * p];
    if g.m * p == 0 {
        return y;
    }
    y.par_chunks_mut(g.m * p).enumerate().for_each(|(img, yi)| {
        let col = s.columns(x, img, 0..g.c);
        for gr in 0..g.group {
            let yg = &mut yi[gr * mg * p..(gr + 1) * mg * p];
            sgemm(
                1.0,
                Mat::new(&wt[gr * mg * kk..(gr + 1) * mg * kk], mg, kk, false),
                Mat::new(&col[gr * kk * p..(gr + 1) * kk * p], kk, p, false),
                0.0,
                yg,
            );
            if let Some(b) = bias {
                for (o, row) in yg.chunks_mut(p).enumerate() {
                    let bv = b[gr * mg + o];
                    row.iter_mut().for_each(|v| *v += bv);
                }
            }
        }
    });
    y
}

/// The gradients of X, the offsets and the mask (each `None` unless wanted).
#[derive(Default)]
pub(in crate::ops) struct InputGrads {
    pub(in crate::ops) x: Option<Vec<f32>>,
    pub(in crate::ops) offset: Option<Vec<f32>>,
    pub(in crate::ops) mask: Option<Vec<f32>>,
}

/// dX (`want_x`), and dOffset and dMask (when `x` is given: they read it),
/// from the column gradient `Wᵀ · dY`, image by image.
pub(in crate::ops) fn input_grads(
    s: &Sampled,
    x: Option<&[f32]>,
    wt: &[f32],
    gy: &[f32],
    want_x: bool,
) -> InputGrads {
    let g = s.geo;
    let (k, p, hw, kk, mg) = (g.k(), g.p(), g.plane(), g.cg() * g.k(), g.mg());
    let (og, co) = (g.offset_group, g.co());
    let mut dx = want_x.then(|| vec![0f32; g.n * g.c * hw]);
    let mut doff = x.map(|_| vec![0f32; g.n * og * 2 * k * p]);
    let mut dmask = x.map(|_| vec![0f32; g.n * og * k * p]);
    let images = if k * p * hw == 0 { 0 } else { g.n };
    for img in 0..images {
        let mut dcol = vec![0f32; g.c * k * p];
        for gr in 0..g.group {
            sgemm(
                1.0,
                Mat::new(&wt[gr * mg * kk..(gr + 1) * mg * kk], kk, mg, true),
                Mat::new(
                    &gy[(img * g.m + gr * mg) * p..(img * g.m + (gr + 1) * mg) * p],
                    mg,
                    p,
                    false,
                ),
                0.0,
                &mut dcol[gr * kk * p..(gr + 1) * kk * p],
            );
        }
        if let Some(dx) = dx.as_mut() {
            dx[img * g.c * hw..(img + 1) * g.c * hw]
                .par_chunks_mut(hw)
                .enumerate()
                .for_each(|(ch, plane)| {
                    let o = ch / co;
                    for t in 0..k {
                        for pp in 0..p {
                            let (y, xx, m) = s.point(img, o, t, pp);
                            let v = m * dcol[(ch * k + t) * p + pp];
                            scatter(plane, g.h, g.w, y, xx, v);
                        }
                    }
                });
        }
        if let (Some(x), Some(doff), Some(dmask)) = (x, doff.as_mut(), dmask.as_mut()) {
            let x = &x[img * g.c * hw..(img + 1) * g.c * hw];
            doff[img * og * 2 * k * p..(img + 1) * og * 2 * k * p]
                .par_chunks_mut(2 * k * p)
                .zip(dmask[img * og * k * p..(img + 1) * og * k * p].par_chunks_mut(k * p))
                .enumerate()
                .for_each(|(o, (doff, dmask))| {
                    for t in 0..k {
                        for pp in 0..p {
                            let (y, xx, m) = s.point(img, o, t, pp);
                            let (mut gy, mut gx, mut gm) = (0f32, 0f32, 0f32);
                            for ch in o * co..(o + 1) * co {
                                let plane = &x[ch * hw..(ch + 1) * hw];
                                let d = dcol[(ch * k + t) * p + pp];
                                let (sy, sx) = slopes(plane, g.h, g.w, y, xx);
                                gy += m * sy * d;
                                gx += m * sx * d;
                                gm += d * sample(plane, g.h, g.w, y, xx);
                            }
                            doff[2 * t * p + pp] = gy;
                            doff[(2 * t + 1) * p + pp] = gx;
                            dmask[t * p + pp] = gm;
                        }
                    }
                });
        }
    }
    InputGrads {
        x: dx,
        offset: doff,
        mask: dmask,
    }
}

/// dW `[m, cg·k]`: per group, `dY · columnsᵀ` summed over the images in order.
pub(in crate::ops) fn weight_grad(s: &Sampled, x: &[f32], gy: &[f32]) -> Vec<f32> {
    let g = s.geo;
    let (p, kk, mg, cg) = (g.p(), g.cg() * g.k(), g.mg(), g.cg());
    let mut dw = vec![0f32; g.m * kk];
    if mg * kk == 0 || p == 0 {
        return dw;
    }
    dw.par_chunks_mut(mg * kk)
        .enumerate()
        .for_each(|(gr, dwg)| {
            for img in 0..g.n {
                let col = s.columns(x, img, gr * cg..(gr + 1) * cg);
                sgemm(
                    1.0,
                    Mat::new(
                        &gy[(img * g.m + gr * mg) * p..(img * g.m + (gr + 1) * mg) * p],
                        mg,
                        p,
                        false,
                    ),
                    Mat::new(&col, p, kk, true),
                    1.0,
                    dwg,
                );
            }
        });
    dw
}
