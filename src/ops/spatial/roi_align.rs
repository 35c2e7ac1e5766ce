//! RoiAlign's CPU kernels, as torchvision's `roi_align` computes it
//! (torchvision/csrc/ops/cpu/roi_align_kernel.cpp; onnxruntime's and the ONNX
//! reference's RoiAlign are the same Caffe2 code): each output bin averages
//! (`avg`) a grid of bilinear samples, `sampling_ratio²` of them, or
//! `ceil(roi size / output size)` per axis when it is 0.
//!
//! - A sample's position: `roi_start + bin · bin_size + (i + ½) · bin_size /
//!   grid`, the roi's corners scaled by `spatial_scale` and moved by −½ under
//!   `half_pixel` (torchvision's `aligned=True`; opset 16's default).
//!   `output_half_pixel` (`aligned=False`, the only behaviour of opset 10)
//!   keeps the corners and makes every roi at least 1 × 1.
//! - A sample outside `[-1, size]` on either axis is 0; inside, it is clamped
//!   to the image and interpolated from its 4 neighbours.
//! - `max` (ONNX only; torchvision has no max RoiAlign) takes, as onnxruntime
//!   and the ONNX reference do, the largest of every sample's 4 weighted taps,
//!   not the largest interpolated value; it has no backward (the rule refuses).
//! - Backward (avg): each bin's gradient, divided by the sample count, goes
//!   back to the 4 taps of each of its samples with their bilinear weights
//!   (torchvision's `roi_align_backward`), from the saved rois and batch
//!   indices and X's shape alone.

use rayon::prelude::*;

use crate::ir::Attrs;
use crate::numeric::RuleResult;

/// The refusal of max's gradient (rule and kernel).
pub(in crate::ops) const MAX_HAS_NO_GRADIENT: &str =
    "RoiAlign mode 'max' has no gradient in PyTorch (torchvision's roi_align averages only)";

/// RoiAlign's attributes.
#[derive(Debug, Clone, Copy)]
pub(in crate::ops) struct Config {
    /// `mode` is `max` (else `avg`).
    pub(in crate::ops) max: bool,
    /// `coordinate_transformation_mode` is `half_pixel`.
    half_pixel: bool,
    spatial_scale: f32,
    /// Samples per bin and axis; 0: adaptive.
    pub(in crate::ops) sampling_ratio: usize,
    pub(in crate::ops) out_h: usize,
    pub(in crate::ops) out_w: usize,
}

/// The attributes with the ONNX defaults: `output_half_pixel` before opset 16
/// (RoiAlign-10 has no `coordinate_transformation_mode`), `half_pixel` from it.
pub(in crate::ops) fn config(a: &Attrs, opset: i64) -> RuleResult<Config> {
    let max = match a.string("mode").unwrap_or("avg") {
        "avg" => false,
        "max" => true,
        m => return Err(format!("unknown mode '{m}' (avg or max)").into()),
    };
    let half_pixel = match (opset >= 16, a.string("coordinate_transformation_mode")) {
        (false, _) | (true, Some("output_half_pixel")) => false,
        (true, None | Some("half_pixel")) => true,
        (true, Some(m)) => {
            return Err(format!(
                "unknown coordinate_transformation_mode '{m}' (half_pixel or output_half_pixel)"
            )
            .into())
        }
    };
    let sampling_ratio = a.int_or("sampling_ratio", 0);
    let spatial_scale = a.float("spatial_scale").unwrap_or(1.0);
    let (oh, ow) = (a.int_or("output_height", 1), a.int_or("output_width", 1));
    if sampling_ratio < 0 || oh < 1 || ow < 1 || !spatial_scale.is_finite() {
        return Err(format!(
            "sampling_ratio {sampling_ratio}, output {oh}x{ow} and spatial_scale {spatial_scale} \
             must be >= 0, >= 1 and finite"
        )
        .into());
    }
    Ok(Config {
        max,
        half_pixel,
        spatial_scale,
        sampling_ratio: sampling_ratio as usize,
        out_h: oh as usize,
        out_w: ow as usize,
    })
}

/// One roi's bilinear taps: per output bin, `count` samples of 4 `(flat
/// position in the H × W plane, weight)` taps, bins in row-major order.
struct Taps {
    /// Samples per bin (0 when the grid is empty).
    count: usize,
    /// What avg divides by: `max(count, 1)`.
    divisor: f32,
    taps: Vec<(usize, f32)>,
}

/// The taps of one roi `[x1, y1, x2, y2]` over an `h × w` plane.
fn taps(cfg: &Config, h: usize, w: usize, roi: &[f32]) -> Taps {
    let offset = if cfg.half_pixel { 0.5 } else { 0.0 };
    let s = cfg.spatial_scale;
    let (x1, y1) = (roi[0] * s - offset, roi[1] * s - offset);
    let (x2, y2) = (roi[2] * s - offset, roi[3] * s - offset);
    let (mut rw, mut rh) = (x2 - x1, y2 - y1);
    if !cfg.half_pixel {
        rw = rw.max(1.0);
        rh = rh.max(1.0);
    }
    let (ph, pw) = (cfg.out_h as f32, cfg.out_w as f32);
    let (bin_h, bin_w) = (rh / ph, rw / pw);
    let grid = |size: f32, bins: f32| -> usize {
        if cfg.sampling_ratio > 0 {
            cfg.sampling_ratio
        } else {
            // A negative or NaN extent (x2 < x1 under half_pixel) samples nothing.
            let g = (size / bins).ceil();
            if g >= 1.0 {
                g as usize
            } else {
                0
            }
        }
    };
    let (gh, gw) = (grid(rh, ph), grid(rw, pw));
    let count = gh * gw;
    let mut taps = Vec::with_capacity(cfg.out_h * cfg.out_w * count * 4);
    let (hf, wf) = (h as f32, w as f32);
    for by in 0..cfg.out_h {
        for bx in 0..cfg.out_w {
            for iy in 0..gh {
                let y = y1 + by as f32 * bin_h + (iy as f32 + 0.5) * bin_h / gh as f32;
                for ix in 0..gw {
                    let x = x1 + bx as f32 * bin_w + (ix as f32 + 0.5) * bin_w / gw as f32;
                    // Outside (NaN included): four zero-weight taps at 0.
                    if !(y >= -1.0 && y <= hf && x >= -1.0 && x <= wf) || h == 0 || w == 0 {
                        taps.extend([(0, 0.0); 4]);
                        continue;
                    }
                    let (yl, yh, ly) = axis(y.max(0.0), h);
                    let (xl, xh, lx) = axis(x.max(0.0), w);
                    let (hy, hx) = (1.0 - ly, 1.0 - lx);
                    taps.extend([
                        (yl * w + xl, hy * hx),
                        (yl * w + xh, hy * lx),
                        (yh * w + xl, ly * hx),
                        (yh * w + xh, ly * lx),
                    ]);
                }
            }
        }
    }
    Taps {
        count,
        divisor: count.max(1) as f32,
        taps,
    }
}

/// The low and high neighbours of `v` (≥ 0) on an axis of `n` and the high
/// one's weight; at or past the last index both are the last, weight 0.
fn axis(v: f32, n: usize) -> (usize, usize, f32) {
    let low = v as usize;
    if low >= n - 1 {
        (n - 1, n - 1, 0.0)
    } else {
        (low, low + 1, v - low as f32)
    }
}

/// Checks the batch indices against `n` images.
fn batch_of(idx: &[i64], n: usize) -> RuleResult<Vec<usize>> {
    idx.iter()
        .map(|&b| {
            if b < 0 || b as usize >= n {
                Err(format!("batch index {b} is outside the {n} images of X").into())
            } else {
                Ok(b as usize)
            }
        })
        .collect()
}

/// The forward: `x [n, c, h, w]`, `rois [r, 4]`, batch indices `[r]`, output
/// `[r, c, out_h, out_w]`.
pub(in crate::ops) fn forward(
    cfg: &Config,
    x: &[f32],
    shape: &[usize],
    rois: &[f32],
    idx: &[i64],
) -> RuleResult<Vec<f32>> {
    let (n, c, h, w) = (shape[0], shape[1], shape[2], shape[3]);
    let batch = batch_of(idx, n)?;
    let bins = cfg.out_h * cfg.out_w;
    let mut y = vec![0f32; batch.len() * c * bins];
    if bins * c * h * w == 0 {
        // No bins, or an empty image: every sample is 0.
        return Ok(y);
    }
    y.par_chunks_mut(c * bins).enumerate().for_each(|(r, out)| {
        let t = taps(cfg, h, w, &rois[r * 4..r * 4 + 4]);
        for (ch, yc) in out.chunks_mut(bins).enumerate() {
            let plane = &x[(batch[r] * c + ch) * h * w..(batch[r] * c + ch + 1) * h * w];
            for (bin, v) in yc.iter_mut().enumerate() {
                let samples = &t.taps[bin * t.count * 4..(bin + 1) * t.count * 4];
                *v = if cfg.max {
                    samples
                        .chunks(4)
                        .map(|s| {
                            s.iter()
                                .map(|&(p, wt)| wt * plane[p])
                                .fold(f32::NEG_INFINITY, f32::max)
                        })
                        .fold(None, |m: Option<f32>, s| Some(m.map_or(s, |m| m.max(s))))
                        .unwrap_or(0.0)
                } else {
                    let sum: f32 = samples
                        .chunks(4)
                        .map(|s| s.iter().map(|&(p, wt)| wt * plane[p]).sum::<f32>())
                        .sum();
                    sum / t.divisor
                };
            }
        }
    });
    Ok(y)
}

/// The backward of avg: `dY [r, c, out_h, out_w]` scattered back to `dX` of
/// `shape`, each image's channel planes in parallel, the rois in order.
pub(in crate::ops) fn backward(
    cfg: &Config,
    shape: &[usize],
    rois: &[f32],
    idx: &[i64],
    g: &[f32],
) -> RuleResult<Vec<f32>> {
    let (n, c, h, w) = (shape[0], shape[1], shape[2], shape[3]);
    let batch = batch_of(idx, n)?;
    let bins = cfg.out_h * cfg.out_w;
    let all: Vec<Taps> = (0..batch.len())
        .into_par_iter()
        .map(|r| taps(cfg, h, w, &rois[r * 4..r * 4 + 4]))
        .collect();
    let mut dx = vec![0f32; n * c * h * w];
    if h * w == 0 {
        return Ok(dx);
    }
    dx.par_chunks_mut(h * w)
        .enumerate()
        .for_each(|(plane_idx, d)| {
            let (img, ch) = (plane_idx / c, plane_idx % c);
            for (r, t) in all.iter().enumerate().filter(|(r, _)| batch[*r] == img) {
                let gr = &g[(r * c + ch) * bins..(r * c + ch + 1) * bins];
                for (bin, &gv) in gr.iter().enumerate() {
                    let gv = gv / t.divisor;
                    for &(p, wt) in &t.taps[bin * t.count * 4..(bin + 1) * t.count * 4] {
                        d[p] += gv * wt;
                    }
                }
            }
        });
    Ok(dx)
}
