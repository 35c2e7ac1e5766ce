//! `Resize` (opsets 10, 11, 13, 18, 19): nearest, N-linear and cubic interpolation,
//! separable over the resized axes, as the ONNX reference implementation computes
//! it (onnx/reference/ops/op_resize.py) and PyTorch's `F.interpolate` exports it.

use rayon::prelude::*;

use super::{
    axis, Arity, Autocast, Backward, BackwardCx, CudaKernels, Cx, Fact, KernelCx, Op, Registry,
    RuleResult, Saved, Storage,
};
use crate::ir::Attrs;
use crate::numeric::broadcast::strides;
use crate::numeric::Tensor;

/// Interpolation mode (`mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Nearest,
    Linear,
    Cubic,
}

/// `coordinate_transformation_mode` (tf_crop_and_resize: [`Axis::roi`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Coord {
    HalfPixel,
    HalfPixelSymmetric,
    PytorchHalfPixel,
    AlignCorners,
    Asymmetric,
    TfHalfPixelForNn,
}

/// `nearest_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Round {
    PreferFloor,
    PreferCeil,
    Floor,
    Ceil,
}

/// The attributes that decide the arithmetic.
#[derive(Debug, Clone, Copy)]
struct Config {
    mode: Mode,
    coord: Coord,
    round: Round,
    /// `cubic_coeff_a`.
    a: f64,
    exclude_outside: bool,
    antialias: bool,
    /// `tf_crop_and_resize`: coordinates inside each axis's `roi` (see
    /// [`Axis::roi`]), positions outside the input take [`Self::extrapolation`].
    crop_and_resize: bool,
    /// `extrapolation_value` (tf_crop_and_resize; default 0).
    extrapolation: f32,
}

/// Resize's (and Upsample's) attributes, with their defaults.
struct ResizeAttrs<'a> {
    /// `mode` (default "nearest").
    mode: &'a str,
    /// `coordinate_transformation_mode` (default "half_pixel").
    coord: &'a str,
    /// `nearest_mode` (default "round_prefer_floor").
    nearest_mode: &'a str,
    /// `cubic_coeff_a` (default -0.75).
    cubic_coeff_a: f64,
    /// `exclude_outside` (default 0).
    exclude_outside: bool,
    /// `antialias` (default 0; opset 18 on).
    antialias: bool,
    /// `extrapolation_value` (default 0).
    extrapolation_value: f32,
    /// `axes` (opset 18 on; default every axis).
    axes: Option<&'a [i64]>,
    /// `keep_aspect_ratio_policy` (opset 18 on; default "stretch").
    keep_aspect_ratio_policy: &'a str,
    /// `scales` (Upsample before opset 9).
    scales: Option<&'a [f32]>,
}

impl ResizeAttrs<'_> {
    fn of(attrs: &Attrs) -> ResizeAttrs<'_> {
        ResizeAttrs {
            mode: attrs.string("mode").unwrap_or("nearest"),
            coord: attrs
                .string("coordinate_transformation_mode")
                .unwrap_or("half_pixel"),
            nearest_mode: attrs.string("nearest_mode").unwrap_or("round_prefer_floor"),
            cubic_coeff_a: attrs.float("cubic_coeff_a").unwrap_or(-0.75) as f64,
            exclude_outside: attrs.int_or("exclude_outside", 0) != 0,
            antialias: attrs.int_or("antialias", 0) != 0,
            extrapolation_value: attrs.float("extrapolation_value").unwrap_or(0.0),
            axes: attrs.ints("axes"),
            keep_aspect_ratio_policy: attrs
                .string("keep_aspect_ratio_policy")
                .unwrap_or("stretch"),
            scales: attrs.floats("scales"),
        }
    }
}

fn config(at: &ResizeAttrs, opset: i64) -> RuleResult<Config> {
    let mode = match at.mode {
        "nearest" => Mode::Nearest,
        "linear" => Mode::Linear,
        "cubic" if opset >= 11 => Mode::Cubic,
        m => return Err(format!("unknown mode '{m}' (opset {opset})").into()),
    };
    if opset < 11 {
        // Resize-10 is Upsample-9 with scales as an input: asymmetric coordinates
        // (onnxruntime's rule for opset 10), nearest rounds down.
        return Ok(Config {
            mode,
            coord: Coord::Asymmetric,
            round: Round::Floor,
            a: -0.75,
            exclude_outside: false,
            antialias: false,
            crop_and_resize: false,
            extrapolation: 0.0,
        });
    }
    let coord = match at.coord {
        "half_pixel" => Coord::HalfPixel,
        "half_pixel_symmetric" => Coord::HalfPixelSymmetric,
        "pytorch_half_pixel" => Coord::PytorchHalfPixel,
        "align_corners" => Coord::AlignCorners,
        "asymmetric" => Coord::Asymmetric,
        "tf_half_pixel_for_nn" if opset < 13 => Coord::TfHalfPixelForNn,
        "tf_crop_and_resize" => Coord::Asymmetric,
        m => return Err(format!("unknown coordinate_transformation_mode '{m}'").into()),
    };
    let round = match at.nearest_mode {
        "round_prefer_floor" => Round::PreferFloor,
        "round_prefer_ceil" => Round::PreferCeil,
        "floor" => Round::Floor,
        "ceil" => Round::Ceil,
        m => return Err(format!("unknown nearest_mode '{m}'").into()),
    };
    Ok(Config {
        mode,
        coord,
        round,
        a: at.cubic_coeff_a,
        exclude_outside: at.exclude_outside,
        antialias: opset >= 18 && at.antialias,
        crop_and_resize: at.coord == "tf_crop_and_resize",
        extrapolation: at.extrapolation_value,
    })
}

/// One axis of the resize: sizes and the scale `num / den` its coordinates use
/// (the `scales` value, or `output / input` when `sizes` is given).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Axis {
    n_in: usize,
    n_out: usize,
    num: f64,
    den: f64,
    /// tf_crop_and_resize: the axis's `(start, end)` of the roi, as fractions of
    /// `n_in − 1`.
    roi: Option<(f64, f64)>,
}

impl Axis {
    /// Whether the axis maps every output position to the same input position
    /// (same length, scale 1): every coordinate mode is then the identity.
    fn identity(&self) -> bool {
        self.n_in == self.n_out
            && self.num == self.den
            && self.roi.is_none_or(|(a, b)| a == 0.0 && b == 1.0)
    }
}

/// The per-axis plan from the input shape and the `scales` or `sizes` values
/// (`None`: absent or empty), following `axes` and `keep_aspect_ratio_policy`.
fn plan(
    cfg: &Config,
    at: &ResizeAttrs,
    opset: i64,
    x: &[usize],
    scales: Option<Vec<f64>>,
    sizes: Option<Vec<i64>>,
) -> RuleResult<Vec<Axis>> {
    let r = x.len();
    let axes: Vec<usize> = match at.axes.filter(|_| opset >= 18) {
        Some(a) => {
            let v = a
                .iter()
                .map(|&a| axis(a, r))
                .collect::<RuleResult<Vec<_>>>()?;
            let mut s = v.clone();
            s.sort_unstable();
            s.dedup();
            if s.len() != v.len() {
                return Err(format!("attribute 'axes' {a:?} repeats an axis").into());
            }
            v
        }
        None => (0..r).collect(),
    };
    let mut out: Vec<Axis> = x
        .iter()
        .map(|&n| Axis {
            n_in: n,
            n_out: n,
            num: 1.0,
            den: 1.0,
            roi: None,
        })
        .collect();
    match (scales, sizes) {
        (Some(_), Some(_)) => return Err("only one of 'scales' and 'sizes' may be given".into()),
        (None, None) => return Err("one of 'scales' and 'sizes' must be given".into()),
        (Some(s), None) => {
            if s.len() != axes.len() {
                return Err(format!(
                    "'scales' has {} values for {} axes of input {x:?}",
                    s.len(),
                    axes.len()
                )
                .into());
            }
            for (&a, &sc) in axes.iter().zip(&s) {
                if !(sc > 0.0 && sc.is_finite()) {
                    return Err(format!("scale {sc} must be positive and finite").into());
                }
                // floor(input · scale) in f64, as the ONNX reference computes it.
                let o = (x[a] as f64 * sc).floor();
                if o > (1u64 << 40) as f64 {
                    return Err(format!("scale {sc} gives an output dimension too large").into());
                }
                out[a] = Axis {
                    n_in: x[a],
                    n_out: o as usize,
                    num: sc,
                    den: 1.0,
                    roi: None,
                };
            }
        }
        (None, Some(sz)) => {
            if sz.len() != axes.len() {
                return Err(format!(
                    "'sizes' has {} values for {} axes of input {x:?}",
                    sz.len(),
                    axes.len()
                )
                .into());
            }
            let sz = sz
                .iter()
                .map(|&v| super::dim(v, "size"))
                .collect::<RuleResult<Vec<_>>>()?;
            for (&a, &n) in axes.iter().zip(&sz) {
                if x[a] == 0 && n > 0 {
                    return Err(format!("axis {a} of length 0 cannot be resized to {n}").into());
                }
            }
            let policy = if opset >= 18 {
                at.keep_aspect_ratio_policy
            } else {
                "stretch"
            };
            match policy {
                "stretch" => {
                    for (&a, &n) in axes.iter().zip(&sz) {
                        out[a] = Axis {
                            n_in: x[a],
                            n_out: n,
                            num: n as f64,
                            den: x[a].max(1) as f64,
                            roi: None,
                        };
                    }
                }
                "not_larger" | "not_smaller" => {
                    // One scale for every axis: the smallest (largest) ratio, as a
                    // fraction size/input of the axis that gives it; output lengths
                    // round half up.
                    let mut best: Option<(usize, usize)> = None;
                    for (&a, &n) in axes.iter().zip(&sz) {
                        let (n, d) = (n, x[a].max(1));
                        let better = match best {
                            None => true,
                            Some((bn, bd)) => {
                                let (l, rr) = ((n as u128) * bd as u128, (bn as u128) * d as u128);
                                if policy == "not_larger" {
                                    l < rr
                                } else {
                                    l > rr
                                }
                            }
                        };
                        if better {
                            best = Some((n, d));
                        }
                    }
                    if let Some((n, d)) = best {
                        for &a in &axes {
                            let o = (n as f64 / d as f64 * x[a] as f64 + 0.5).floor() as usize;
                            out[a] = Axis {
                                n_in: x[a],
                                n_out: o,
                                num: n as f64,
                                den: d as f64,
                                roi: None,
                            };
                        }
                    }
                }
                p => return Err(format!("unknown keep_aspect_ratio_policy '{p}'").into()),
            }
        }
    }
    if cfg.coord == Coord::Asymmetric && cfg.mode == Mode::Nearest && opset < 11 {
        if let Some(a) = out.iter().find(|a| !a.identity() && a.num < a.den) {
            return Err(format!(
                "Resize-10 nearest downsampling ({} to {}) has no exact rounding rule; use opset 11+",
                a.n_in, a.n_out
            ).into());
        }
    }
    Ok(out)
}

/// Source coordinate of output position `j` on an axis.
fn source(cfg: &Config, ax: &Axis, j: usize) -> f64 {
    let x = j as f64;
    let (n_in, n_out) = (ax.n_in as f64, ax.n_out as f64);
    // v / scale, exact for sizes (v·input/output).
    let inv = |v: f64| v * ax.den / ax.num;
    // The corner-aligned modes divide by the resized length as the scale gives it,
    // before flooring (`input · scale`; the size itself when sizes are given), as
    // the ONNX reference does.
    let scaled = n_in * ax.num / ax.den;
    if let Some((start, end)) = ax.roi {
        // tf_crop_and_resize: the output spans the roi, corners aligned.
        let span = n_in - 1.0;
        return if scaled != 1.0 {
            start * span + x * (end - start) * span / (scaled - 1.0)
        } else {
            0.5 * (start + end) * span
        };
    }
    match cfg.coord {
        Coord::HalfPixel => inv(x + 0.5) - 0.5,
        Coord::PytorchHalfPixel => {
            if ax.n_out > 1 {
                inv(x + 0.5) - 0.5
            } else {
                0.0
            }
        }
        Coord::AlignCorners => {
            if scaled != 1.0 {
                x * (n_in - 1.0) / (scaled - 1.0)
            } else {
                0.0
            }
        }
        Coord::Asymmetric => inv(x),
        Coord::TfHalfPixelForNn => inv(x + 0.5),
        Coord::HalfPixelSymmetric => {
            let adjustment = n_out / (n_in * ax.num / ax.den);
            let offset = n_in / 2.0 * (1.0 - adjustment);
            offset + inv(x + 0.5) - 0.5
        }
    }
}

/// Interpolation taps of one axis: `t` (index, weight) pairs per output position.
struct Taps {
    t: usize,
    idx: Vec<usize>,
    w: Vec<f32>,
    /// tf_crop_and_resize: output positions outside the input, which take
    /// [`Self::fill`] (their taps weigh 0, so no gradient flows from them).
    outside: Vec<bool>,
    fill: f32,
}

/// The cubic convolution kernel with coefficient `a` at distance `s`.
fn cubic(a: f64, s: f64) -> f64 {
    let s = s.abs();
    if s <= 1.0 {
        ((a + 2.0) * s - (a + 3.0)) * s * s + 1.0
    } else if s < 2.0 {
        ((a * s - 5.0 * a) * s + 8.0 * a) * s - 4.0 * a
    } else {
        0.0
    }
}

/// Antialiased downsampling ([`Config::antialias`], linear and cubic, scale
/// below 1): the filter stretched by `1 / scale`, as the ONNX reference does
/// (`_linear_coeffs_antialias`, `_cubic_coeffs_antialias`): the first tap's
/// offset from the left pixel and the number of taps.
fn antialias_window(cfg: &Config, ax: &Axis) -> Option<(i64, usize)> {
    let s = ax.num / ax.den;
    if !cfg.antialias || cfg.mode == Mode::Nearest || s >= 1.0 || ax.identity() {
        return None;
    }
    let support = if cfg.mode == Mode::Linear { 1.0 } else { 2.0 };
    let start = (-support / s).floor() as i64 + 1;
    Some((start, (2 * (support as i64) - 2 * start) as usize))
}

/// Taps per output position of an axis.
fn tap_width(cfg: &Config, ax: &Axis) -> usize {
    match (cfg.mode, antialias_window(cfg, ax)) {
        (_, Some((_, n))) => n,
        (Mode::Nearest, None) => 1,
        (Mode::Linear, None) => 2,
        (Mode::Cubic, None) => 4,
    }
}

fn taps(cfg: &Config, ax: &Axis) -> Taps {
    let t = tap_width(cfg, ax);
    let aa = antialias_window(cfg, ax);
    let last = ax.n_in.saturating_sub(1) as i64;
    let mut idx = Vec::with_capacity(ax.n_out * t);
    let mut w = Vec::with_capacity(ax.n_out * t);
    let mut outside = vec![false; ax.n_out];
    for (j, out) in outside.iter_mut().enumerate() {
        let xo = source(cfg, ax, j);
        if ax.roi.is_some() && !(0.0..=last as f64).contains(&xo) {
            *out = true;
            idx.extend(std::iter::repeat_n(0, t));
            w.extend(std::iter::repeat_n(0.0, t));
            continue;
        }
        let f = xo.floor();
        let r = xo - f;
        let f = f as i64;
        match cfg.mode {
            Mode::Nearest => {
                let i = if r == 0.0 {
                    f
                } else {
                    match cfg.round {
                        Round::PreferFloor => f + (r > 0.5) as i64,
                        Round::PreferCeil => f + (r >= 0.5) as i64,
                        Round::Floor => f,
                        Round::Ceil => f + 1,
                    }
                };
                idx.push(i.clamp(0, last) as usize);
                w.push(1.0);
            }
            Mode::Linear | Mode::Cubic => {
                let (first, ws): (i64, Vec<f64>) = if let Some((start, n)) = aa {
                    // The reference's ratio is 1 at an integer position (the
                    // left pixel one before it).
                    let (r, left) = if r == 0.0 { (1.0, f - 1) } else { (r, f) };
                    let s = ax.num / ax.den;
                    let ws: Vec<f64> = (0..n as i64)
                        .map(|k| {
                            let d = (start + k) as f64 - r;
                            if cfg.mode == Mode::Linear {
                                (1.0 - (d * s).abs()).clamp(0.0, 1.0)
                            } else {
                                cubic(cfg.a, d * s)
                            }
                        })
                        .collect();
                    let sum: f64 = ws.iter().sum();
                    (left + start, ws.into_iter().map(|w| w / sum).collect())
                } else if cfg.mode == Mode::Linear {
                    (f, vec![1.0 - r, r])
                } else {
                    (
                        f - 1,
                        vec![
                            cubic(cfg.a, r + 1.0),
                            cubic(cfg.a, r),
                            cubic(cfg.a, 1.0 - r),
                            cubic(cfg.a, 2.0 - r),
                        ],
                    )
                };
                let mut ws = ws;
                if cfg.exclude_outside {
                    for (k, wk) in ws.iter_mut().enumerate() {
                        let i = first + k as i64;
                        if i < 0 || i > last {
                            *wk = 0.0;
                        }
                    }
                    let s: f64 = ws.iter().sum();
                    if s != 0.0 {
                        ws.iter_mut().for_each(|wk| *wk /= s);
                    }
                }
                for (k, wk) in ws.into_iter().enumerate() {
                    idx.push((first + k as i64).clamp(0, last) as usize);
                    w.push(wk as f32);
                }
            }
        }
    }
    Taps {
        t,
        idx,
        w,
        outside,
        fill: cfg.extrapolation,
    }
}

/// Elements per parallel task, at least.
const PAR_MIN: usize = 1 << 14;

/// One axis forward: `[outer, n_in, inner]` to `[outer, n_out, inner]`,
/// `dst[o, j, :] = Σ_k w[j,k] · src[o, idx[j,k], :]`.
fn apply_axis(src: &[f32], outer: usize, n_in: usize, inner: usize, tp: &Taps) -> Vec<f32> {
    let n_out = tp.idx.len() / tp.t;
    let mut dst = vec![0f32; outer * n_out * inner];
    if dst.is_empty() {
        return dst;
    }
    let block = |o: usize, d: &mut [f32]| {
        let s = &src[o * n_in * inner..(o + 1) * n_in * inner];
        for j in 0..n_out {
            let row = &mut d[j * inner..(j + 1) * inner];
            if tp.outside[j] {
                row.fill(tp.fill);
                continue;
            }
            for k in 0..tp.t {
                let (i, w) = (tp.idx[j * tp.t + k], tp.w[j * tp.t + k]);
                for (a, &b) in row.iter_mut().zip(&s[i * inner..(i + 1) * inner]) {
                    *a += w * b;
                }
            }
        }
    };
    if dst.len() >= PAR_MIN && outer > 1 {
        dst.par_chunks_mut(n_out * inner)
            .enumerate()
            .for_each(|(o, d)| block(o, d));
    } else {
        dst.chunks_mut(n_out * inner)
            .enumerate()
            .for_each(|(o, d)| block(o, d));
    }
    dst
}

/// The adjoint of [`apply_axis`]: `dx[o, idx[j,k], :] += w[j,k] · g[o, j, :]`,
/// output positions in order (deterministic).
fn adjoint_axis(g: &[f32], outer: usize, n_in: usize, inner: usize, tp: &Taps) -> Vec<f32> {
    let n_out = tp.idx.len() / tp.t;
    let mut dst = vec![0f32; outer * n_in * inner];
    if dst.is_empty() {
        return dst;
    }
    let block = |o: usize, d: &mut [f32]| {
        let s = &g[o * n_out * inner..(o + 1) * n_out * inner];
        for j in 0..n_out {
            let row = &s[j * inner..(j + 1) * inner];
            for k in 0..tp.t {
                let (i, w) = (tp.idx[j * tp.t + k], tp.w[j * tp.t + k]);
                for (a, &b) in d[i * inner..(i + 1) * inner].iter_mut().zip(row) {
                    *a += w * b;
                }
            }
        }
    };
    if dst.len() >= PAR_MIN && outer > 1 {
        dst.par_chunks_mut(n_in * inner)
            .enumerate()
            .for_each(|(o, d)| block(o, d));
    } else {
        dst.chunks_mut(n_in * inner)
            .enumerate()
            .for_each(|(o, d)| block(o, d));
    }
    dst
}

/// Flat input offset of every output element for nearest mode (any dtype).
fn nearest_offsets(cfg: &Config, axes: &[Axis]) -> Vec<usize> {
    let mut offs = vec![0usize];
    let stride = strides(&axes.iter().map(|a| a.n_in).collect::<Vec<_>>());
    for (a, ax) in axes.iter().enumerate() {
        let map = taps(cfg, ax).idx;
        let mut next = Vec::with_capacity(offs.len() * ax.n_out);
        for &o in &offs {
            for &i in &map {
                next.push(o + i * stride[a]);
            }
        }
        offs = next;
    }
    offs
}

/// Where `scales` and `sizes` are among the inputs (opset 10: scales only).
fn slots(opset: i64) -> (usize, Option<usize>) {
    if opset < 11 {
        (1, None)
    } else {
        (2, Some(3))
    }
}

/// tf_crop_and_resize: each resized axis's `(start, end)` from `roi` (starts then
/// ends, over `axes` from opset 18, else over every axis). Other modes ignore the
/// roi, as the spec says.
fn crop_roi(
    cfg: &Config,
    at: &ResizeAttrs,
    opset: i64,
    axes: &mut [Axis],
    roi: Option<Vec<f64>>,
) -> RuleResult<()> {
    if !cfg.crop_and_resize {
        return Ok(());
    }
    let roi = roi.ok_or("tf_crop_and_resize needs its roi input")?;
    let r = axes.len();
    let which: Vec<usize> = match at.axes.filter(|_| opset >= 18) {
        Some(a) => a.iter().map(|&a| axis(a, r)).collect::<RuleResult<_>>()?,
        None => (0..r).collect(),
    };
    if roi.len() != 2 * which.len() || roi.iter().any(|v| !v.is_finite()) {
        return Err(format!(
            "roi {roi:?} must hold a finite start and end for each of {} axes",
            which.len()
        )
        .into());
    }
    for (k, &a) in which.iter().enumerate() {
        axes[a].roi = Some((roi[k], roi[k + which.len()]));
    }
    Ok(())
}

impl Resize {
    /// The opset whose Resize rules apply: Upsample is Resize-10's arithmetic at
    /// any opset it appears in.
    fn opset(&self, opset: i64) -> i64 {
        if self.upsample {
            opset.min(10)
        } else {
            opset
        }
    }

    /// Upsample before opset 9 gives its scales as an attribute.
    fn attr_scales(&self, at: &ResizeAttrs, opset: i64) -> Option<Vec<f64>> {
        (self.upsample && opset < 9)
            .then(|| at.scales.map(|v| v.iter().map(|&f| f as f64).collect()))
            .flatten()
    }
}

/// The plan from the input facts (their folded values).
fn plan_facts(op: &Resize, at: &ResizeAttrs, cx: &Cx) -> RuleResult<(Config, Vec<Axis>)> {
    let opset = op.opset(cx.opset);
    let cfg = config(at, opset)?;
    let x = cx.input(0)?;
    let (si, zi) = slots(opset);
    let present = |i: usize| cx.opt(i).is_some_and(|f| f.numel() > 0);
    let scales = if let Some(s) = op.attr_scales(at, opset) {
        Some(s)
    } else if present(si) {
        let v = cx.value(si).map_err(|e| format!("scales: {e}"))?;
        Some((0..v.data.len()).map(|k| v.data.float(k)).collect())
    } else {
        None
    };
    let sizes = match zi {
        Some(zi) if present(zi) => Some(cx.value(zi).map_err(|e| format!("sizes: {e}"))?.to_ints()),
        _ => None,
    };
    let axes = plan(&cfg, at, opset, &x.shape, scales, sizes)?;
    Ok((cfg, axes))
}

/// Number of taps per resized axis (0 for nearest: no arithmetic) and how many
/// axes are resized.
/// Taps of the N-D filter per output element: the product of the resized axes'
/// (0 for nearest, or with no axis resized: no arithmetic).
fn tap_count(cfg: &Config, axes: &[Axis]) -> u64 {
    if cfg.mode == Mode::Nearest || axes.iter().all(Axis::identity) {
        return 0;
    }
    axes.iter()
        .filter(|a| !a.identity())
        .fold(1u64, |p, a| p.saturating_mul(tap_width(cfg, a) as u64))
}

/// `Resize(X, roi?, scales?, sizes?)` (opset 10: `Resize(X, scales)`).
///
/// Output shape: `sizes` when given (over `axes`, with `keep_aspect_ratio_policy`:
/// one scale, lengths rounded half up), else `floor(input · scale)` in f64. Empty
/// `roi`/`scales`/`sizes` inputs are absent; the given one must be constant.
/// Coordinates per `coordinate_transformation_mode` (align_corners uses the integer
/// output length; pytorch_half_pixel maps a length-1 output to 0, as the spec says),
/// then nearest (`nearest_mode`, index clamped), linear (2 taps) or cubic (4 taps,
/// `cubic_coeff_a`), out-of-range taps clamped to the edge or, with
/// `exclude_outside`, dropped and the rest renormalized. tf_crop_and_resize maps the
/// output onto each axis's roi (`start·(n−1) + j·(end − start)·(n−1)/(out − 1)`) and
/// fills positions outside the input with `extrapolation_value`. antialias=1
/// stretches the linear and cubic filters by `1 / scale` when downsampling, as the
/// ONNX reference does (upsampling and nearest are unchanged). PyTorch's
/// `antialias=True` places its taps otherwise: up to 0.13 apart on a random
/// 9×11 → 4×5 input (measured with torch 2.15 against the reference).
///
/// FLOPs: nearest 0 (a gather); linear and cubic a multiply-add per tap of the
/// N-D filter: `2 · Tᵏ` per output element, T = 2 (linear) or 4 (cubic), k the
/// number of resized axes (length or scale changes).
struct Resize {
    /// Upsample (Resize-10's arithmetic at any opset).
    upsample: bool,
}

impl Op for Resize {
    /// Upsample before opset 9 has one input (its scales an attribute).
    fn arity(&self) -> Arity {
        Arity::new(1, 4, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let (cfg, axes) = plan_facts(self, &ResizeAttrs::of(cx.attrs()), cx)?;
        if cfg.mode != Mode::Nearest && !x.dtype.is_float() {
            return Err(format!(
                "{:?} interpolation of a {} tensor is not supported",
                cfg.mode, x.dtype
            )
            .into());
        }
        Ok(vec![Fact::new(
            x.dtype,
            axes.iter().map(|a| a.n_out).collect(),
        )])
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let Ok((cfg, axes)) = plan_facts(self, &ResizeAttrs::of(cx.attrs()), cx) else {
            return 0;
        };
        tap_count(&cfg, &axes)
            .saturating_mul(2)
            .saturating_mul(out[0].numel())
    }
    /// PyTorch's upsample_nearest*/upsample_(bi|tri)linear/upsample_bicubic2d
    /// backward keep only the sizes and scales: nothing is saved. tf_crop_and_resize
    /// (no PyTorch op; TensorFlow's crop_and_resize) keeps its roi, which may be
    /// computed in the graph (boxes). Backward FLOPs: the forward's (the same
    /// weights scattered).
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let cfg = config(&ResizeAttrs::of(cx.attrs()), self.opset(cx.opset))?;
        let saved: &[Saved] = if cfg.crop_and_resize {
            &[Saved::Input(1)]
        } else {
            &[]
        };
        Ok(Some(Backward::each(&[0], saved, self.flops(cx, out))))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// Nearest: a gather of the input (any dtype). Linear and cubic: f32, one axis
    /// at a time (separable, as the ONNX reference), each axis's taps computed once.
    /// tf_crop_and_resize (float only, nearest too): the same taps over the roi,
    /// positions outside the input filled with `extrapolation_value`.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let at = ResizeAttrs::of(cx.attrs());
        let opset = self.opset(cx.opset);
        let cfg = config(&at, opset)?;
        let (si, zi) = slots(opset);
        let present = |i: usize| cx.opt(i).filter(|t| t.numel() > 0);
        let scales = self
            .attr_scales(&at, opset)
            .or_else(|| present(si).map(|t| t.to_f64s()));
        let sizes = zi.and_then(present).map(|t| t.to_i64s());
        let mut axes = plan(&cfg, &at, opset, &x.shape, scales, sizes)?;
        let roi = present(1).map(|t| t.to_f64s());
        crop_roi(&cfg, &at, cx.opset, &mut axes, roi)?;
        let shape: Vec<usize> = axes.iter().map(|a| a.n_out).collect();
        if shape != cx.out(0)?.shape {
            return Err(format!(
                "the runtime scales/sizes give {shape:?}, inference {:?}",
                cx.out(0)?.shape
            )
            .into());
        }
        if cfg.mode == Mode::Nearest && !cfg.crop_and_resize {
            let offs = nearest_offsets(&cfg, &axes);
            return Ok(vec![x.select(&offs, shape)]);
        }
        let mut cur = x.to_f32()?.into_owned();
        let mut cur_shape = x.shape.clone();
        for (a, ax) in axes.iter().enumerate() {
            if ax.identity() {
                continue;
            }
            let outer: usize = cur_shape[..a].iter().product();
            let inner: usize = cur_shape[a + 1..].iter().product();
            cur = apply_axis(&cur, outer, ax.n_in, inner, &taps(&cfg, ax));
            cur_shape[a] = ax.n_out;
        }
        Ok(vec![Tensor::from_f32(x.dtype(), shape, cur)?])
    }
    /// The adjoint of the forward, from shapes and the folded scales/sizes only
    /// (and tf_crop_and_resize's saved roi): nearest scatters (adds) each output
    /// gradient to its source element; linear and cubic apply each axis's transposed
    /// taps, axes in reverse order. Extrapolated positions pass no gradient.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let at = ResizeAttrs::of(cx.attrs());
        let (cfg, mut axes) = plan_facts(self, &at, &cx.rule_cx())?;
        if cfg.crop_and_resize {
            let roi = cx.saved(Saved::Input(1))?.to_f64s();
            crop_roi(&cfg, &at, cx.opset, &mut axes, Some(roi))?;
        }
        let x = cx.input(0)?;
        let g = cx.grad(0)?;
        let dx = if cfg.mode == Mode::Nearest && !cfg.crop_and_resize {
            let offs = nearest_offsets(&cfg, &axes);
            let mut dx = vec![0f32; x.numel() as usize];
            for (&o, &gv) in offs.iter().zip(g.iter()) {
                dx[o] += gv;
            }
            dx
        } else {
            let mut cur = g.into_owned();
            let mut cur_shape: Vec<usize> = axes.iter().map(|a| a.n_out).collect();
            for (a, ax) in axes.iter().enumerate().rev() {
                if ax.identity() {
                    continue;
                }
                let outer: usize = cur_shape[..a].iter().product();
                let inner: usize = cur_shape[a + 1..].iter().product();
                cur = adjoint_axis(&cur, outer, ax.n_in, inner, &taps(&cfg, ax));
                cur_shape[a] = ax.n_in;
            }
            cur
        };
        cx.answer(vec![(0, dx)])
    }
    /// No device kernel: the host path (downloaded input, the CPU kernel).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// Registers Resize.
pub fn register(r: &mut Registry) {
    r.add("Resize", Resize { upsample: false });
    // Upsample (opsets 7-9) is Resize-10 under its old name: asymmetric
    // coordinates, nearest rounding down; scales an attribute before opset 9.
    r.add("Upsample", Resize { upsample: true });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attr, DType, Data, Node, Value};

    fn node(attrs: &[(&str, Attr)], n_in: usize) -> Node {
        Node {
            name: "r".into(),
            op_type: "Resize".into(),
            domain: Default::default(),
            inputs: (0..n_in).map(Some).collect(),
            outputs: vec![Some(100)].into(),
            attrs: Attrs::from_iter(attrs.iter().map(|(k, a)| (k.to_string(), a.clone()))),
        }
    }

    fn floats(v: &[f64]) -> Fact {
        Fact::with_value(
            DType::F32,
            Value {
                shape: vec![v.len()],
                data: Data::Float(v.to_vec()),
            },
        )
    }

    fn ints(v: &[i64]) -> Fact {
        Fact::with_value(DType::I64, Value::vec(v.to_vec()))
    }

    fn s(v: &str) -> Attr {
        Attr::String(v.into())
    }

    /// Inferred shape and FLOPs, or the error.
    fn run(
        attrs: &[(&str, Attr)],
        opset: i64,
        inputs: Vec<Option<Fact>>,
    ) -> RuleResult<(Vec<usize>, u64)> {
        let n = node(attrs, inputs.len());
        let cx = Cx {
            node: &n,
            inputs: inputs.iter().map(|f| f.as_ref()).collect(),
            opset,
        };
        let op = Resize { upsample: false };
        let out = op.infer(&cx)?;
        let fl = op.flops(&cx, &out);
        Ok((out[0].shape.clone(), fl))
    }

    fn x() -> Option<Fact> {
        Some(Fact::new(DType::F32, vec![2, 3, 5, 7]))
    }

    #[test]
    fn shapes_of_every_opset_form() {
        // Opset 10: Resize(X, scales).
        let (sh, fl) = run(&[], 10, vec![x(), Some(floats(&[1., 1., 2., 2.]))]).unwrap();
        assert_eq!(sh, vec![2, 3, 10, 14]);
        assert_eq!(fl, 0, "nearest is a gather");
        // Opset 11/13: scales, floor(in·scale).
        let lin = [("mode", s("linear"))];
        let (sh, fl) = run(
            &lin,
            11,
            vec![x(), Some(floats(&[])), Some(floats(&[1., 1., 1.5, 0.5]))],
        )
        .unwrap();
        assert_eq!(sh, vec![2, 3, 7, 3]);
        assert_eq!(fl, 2 * 4 * (2 * 3 * 7 * 3), "two resized axes: 4 taps");
        // Sizes with an empty scales (what exporters write), omitted roi.
        let (sh, _) = run(
            &lin,
            13,
            vec![x(), None, Some(floats(&[])), Some(ints(&[2, 3, 9, 7]))],
        )
        .unwrap();
        assert_eq!(sh, vec![2, 3, 9, 7]);
        // Opset 13: scales only, sizes omitted.
        let (sh, fl) = run(
            &[("mode", s("cubic"))],
            13,
            vec![x(), None, Some(floats(&[1., 1., 2., 1.]))],
        )
        .unwrap();
        assert_eq!(sh, vec![2, 3, 10, 7]);
        assert_eq!(
            fl,
            2 * 4 * (2 * 3 * 10 * 7),
            "one resized axis: 4 cubic taps"
        );
        // Opset 18: axes and keep_aspect_ratio_policy.
        let (sh, _) = run(
            &[("axes", Attr::Ints(vec![2, -1]))],
            18,
            vec![x(), None, None, Some(ints(&[10, 21]))],
        )
        .unwrap();
        assert_eq!(sh, vec![2, 3, 10, 21]);
        let (sh, _) = run(
            &[
                ("axes", Attr::Ints(vec![2, 3])),
                ("keep_aspect_ratio_policy", s("not_larger")),
            ],
            18,
            vec![x(), None, None, Some(ints(&[10, 10]))],
        )
        .unwrap();
        assert_eq!(sh, vec![2, 3, 7, 10], "scale 10/7: 5·10/7 = 7.14 → 7");
        let (sh, _) = run(
            &[
                ("axes", Attr::Ints(vec![2, 3])),
                ("keep_aspect_ratio_policy", s("not_smaller")),
            ],
            18,
            vec![x(), None, None, Some(ints(&[10, 10]))],
        )
        .unwrap();
        assert_eq!(sh, vec![2, 3, 10, 14], "scale 2: 7·2 = 14");
        let (sh, _) = run(
            &[
                ("axes", Attr::Ints(vec![3])),
                ("coordinate_transformation_mode", s("half_pixel_symmetric")),
            ],
            19,
            vec![x(), None, Some(floats(&[0.6]))],
        )
        .unwrap();
        assert_eq!(sh, vec![2, 3, 5, 4]);
        // Floor in f64: 10 · 0.7f32 = 6.99999988 → 6 (the ONNX reference; PyTorch too).
        let (sh, _) = run(
            &[],
            13,
            vec![
                Some(Fact::new(DType::F32, vec![1, 10])),
                None,
                Some(floats(&[1.0, 0.7f32 as f64])),
            ],
        )
        .unwrap();
        assert_eq!(sh, vec![1, 6]);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let err = |attrs: &[(&str, Attr)], opset, inputs| run(attrs, opset, inputs).unwrap_err();
        assert!(err(&[], 13, vec![x(), None, None, None])
            .to_string()
            .contains("one of"));
        assert!(err(
            &[],
            13,
            vec![
                x(),
                None,
                Some(floats(&[1., 1., 2., 2.])),
                Some(ints(&[2, 3, 4, 4]))
            ]
        )
        .to_string()
        .contains("only one"));
        assert!(err(&[], 13, vec![x(), None, Some(floats(&[2., 2.]))])
            .to_string()
            .contains("2 values"));
        assert!(
            err(&[], 13, vec![x(), None, Some(floats(&[1., 1., 0., 2.]))])
                .to_string()
                .contains("positive")
        );
        assert!(
            err(&[], 13, vec![x(), None, None, Some(ints(&[2, 3, -1, 4]))])
                .to_string()
                .contains("negative")
        );
        // A data-dependent scales input.
        let dynamic = Some(Fact::new(DType::F32, vec![4]));
        assert!(err(&[], 13, vec![x(), None, dynamic])
            .to_string()
            .contains("constant"));
        // tf_crop_and_resize: its shape (the roi does not change it).
        let crop = run(
            &[("coordinate_transformation_mode", s("tf_crop_and_resize"))],
            13,
            vec![x(), None, Some(floats(&[1., 1., 2., 2.]))],
        )
        .unwrap();
        let x0 = x().unwrap();
        assert_eq!(crop.0[2..], [x0.shape[2] * 2, x0.shape[3] * 2]);
        assert!(err(
            &[("mode", s("area"))],
            13,
            vec![x(), None, Some(floats(&[1., 1., 2., 2.]))]
        )
        .to_string()
        .contains("unknown mode"));
        assert!(err(
            &[("axes", Attr::Ints(vec![2, 2]))],
            18,
            vec![x(), None, Some(floats(&[2., 2.]))]
        )
        .to_string()
        .contains("repeats"));
        assert!(err(
            &[("mode", s("linear"))],
            13,
            vec![
                Some(Fact::new(DType::I64, vec![1, 4])),
                None,
                Some(floats(&[1., 2.]))
            ]
        )
        .to_string()
        .contains("not supported"));
        assert!(err(&[], 10, vec![x(), Some(floats(&[1., 1., 0.5, 0.5]))])
            .to_string()
            .contains("opset 11"));
    }

    #[test]
    fn taps_match_the_definitions() {
        let cfg = |mode, coord| Config {
            mode,
            coord,
            round: Round::PreferFloor,
            a: -0.75,
            exclude_outside: false,
            antialias: false,
            crop_and_resize: false,
            extrapolation: 0.0,
        };
        let ax = Axis {
            n_in: 4,
            n_out: 8,
            num: 2.0,
            den: 1.0,
            roi: None,
        };
        // half_pixel linear, position 0: x = -0.25, clamped at the edge.
        let tp = taps(&cfg(Mode::Linear, Coord::HalfPixel), &ax);
        assert_eq!(&tp.idx[..4], &[0, 0, 0, 1]);
        assert_eq!(&tp.w[..4], &[0.25, 0.75, 0.75, 0.25]);
        // align_corners: x = j·3/7.
        let tp = taps(&cfg(Mode::Linear, Coord::AlignCorners), &ax);
        assert_eq!(tp.idx[14..], [3, 3]);
        // Cubic weights sum to 1.
        let tp = taps(&cfg(Mode::Cubic, Coord::HalfPixel), &ax);
        for j in 0..8 {
            let s: f32 = tp.w[j * 4..j * 4 + 4].iter().sum();
            assert!((s - 1.0).abs() < 1e-6);
        }
        // Nearest, asymmetric + floor (F.interpolate's nearest).
        let mut c = cfg(Mode::Nearest, Coord::Asymmetric);
        c.round = Round::Floor;
        assert_eq!(taps(&c, &ax).idx, vec![0, 0, 1, 1, 2, 2, 3, 3]);
        // half_pixel + round_prefer_floor: x = j/2 - 0.25.
        let c = cfg(Mode::Nearest, Coord::HalfPixel);
        assert_eq!(taps(&c, &ax).idx, vec![0, 0, 1, 1, 2, 2, 3, 3]);
    }

    #[test]
    fn runs_on_the_host_on_cuda() {
        let op = Resize { upsample: false };
        assert_eq!(op.cuda_kernels("Resize"), CudaKernels::HOST);
    }
}
