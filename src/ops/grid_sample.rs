//! `GridSample` (opsets 16 and 20): samples `X` at the normalized coordinates of
//! `grid`, as the ONNX spec defines it
//! (<https://onnx.ai/onnx/operators/onnx__GridSample.html>) and PyTorch's
//! `F.grid_sample` computes it (aten/src/ATen/native/GridSampler.h:
//! `grid_sampler_compute_source_index`, reflection and border clipping, bicubic
//! with A = -0.75), which the TorchScript exporter writes as GridSample-16.

use rayon::prelude::*;

use super::{
    Arity, Autocast, Backward, BackwardCx, CudaKernels, Cx, Fact, KernelCx, Op, Registry,
    RuleResult, Saved, Storage,
};
use crate::ir::Attrs;
use crate::numeric::Tensor;

/// Interpolation (`mode`: bilinear|nearest|bicubic at opset 16, linear|nearest|cubic
/// at opset 20).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Linear,
    Nearest,
    Cubic,
}

/// `padding_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pad {
    Zeros,
    Border,
    Reflection,
}

#[derive(Debug, Clone, Copy)]
struct Config {
    mode: Mode,
    pad: Pad,
    align: bool,
}

fn config(attrs: &Attrs, opset: i64) -> RuleResult<Config> {
    let new = opset >= 20;
    let mode = match (attrs.string("mode"), new) {
        (None, _) => Mode::Linear,
        (Some("bilinear"), false) | (Some("linear"), true) => Mode::Linear,
        (Some("nearest"), _) => Mode::Nearest,
        (Some("bicubic"), false) | (Some("cubic"), true) => Mode::Cubic,
        (Some(m), _) => {
            return Err(format!(
                "unknown mode '{m}' (opset {opset} takes {})",
                if new {
                    "linear, nearest or cubic"
                } else {
                    "bilinear, nearest or bicubic"
                }
            )
            .into())
        }
    };
    let pad = match attrs.string("padding_mode").unwrap_or("zeros") {
        "zeros" => Pad::Zeros,
        "border" => Pad::Border,
        "reflection" => Pad::Reflection,
        p => return Err(format!("unknown padding_mode '{p}'").into()),
    };
    let align = match attrs.int_or("align_corners", 0) {
        0 => false,
        1 => true,
        a => return Err(format!("align_corners must be 0 or 1, got {a}").into()),
    };
    Ok(Config { mode, pad, align })
}

/// Most spatial axes supported (linear: 2^8 taps per point).
const MAX_AXES: usize = 8;

/// Sizes: `X [n, c, ins..]`, `grid [n, outs.., r]`, output `[n, c, outs..]`.
#[derive(Debug, Clone, PartialEq)]
struct Geo {
    n: usize,
    c: usize,
    /// Spatial input sizes `D1..Dr` (grid component `d` indexes `ins[r-1-d]`).
    ins: Vec<usize>,
    /// Spatial output sizes.
    outs: Vec<usize>,
}

impl Geo {
    fn r(&self) -> usize {
        self.ins.len()
    }
    /// Output points per batch element.
    fn points(&self) -> usize {
        self.outs.iter().product()
    }
    /// Input elements per channel.
    fn plane(&self) -> usize {
        self.ins.iter().product()
    }
    fn out_shape(&self) -> Vec<usize> {
        let mut s = vec![self.n, self.c];
        s.extend(&self.outs);
        s
    }
}

fn geometry(cfg: &Config, x: &[usize], grid: &[usize], opset: i64) -> RuleResult<Geo> {
    if opset < 20 && x.len() != 4 {
        return Err(format!(
            "X {x:?} must be 4-D [N, C, H, W] at opset {opset} (N-D needs opset 20)"
        )
        .into());
    }
    if x.len() < 3 {
        return Err(format!("X {x:?} must have rank >= 3 [N, C, D1, ...]").into());
    }
    let r = x.len() - 2;
    if grid.len() != r + 2 || grid[0] != x[0] || grid[r + 1] != r {
        let mut want = vec!["N".to_string()];
        want.extend((1..=r).map(|i| format!("D{i}_out")));
        want.push(r.to_string());
        return Err(format!("grid {grid:?} must be [{}] for X {x:?}", want.join(", ")).into());
    }
    if r > MAX_AXES {
        return Err(format!(
            "GridSample over {r} spatial axes is not supported (at most {MAX_AXES})"
        )
        .into());
    }
    if cfg.mode == Mode::Cubic && r != 2 {
        return Err(format!(
            "cubic GridSample is supported for 4-D X only (as PyTorch's bicubic), got X {x:?}"
        )
        .into());
    }
    Ok(Geo {
        n: x[0],
        c: x[1],
        ins: x[2..].to_vec(),
        outs: grid[1..=r].to_vec(),
    })
}

// ---------------------------------------------------------------------------
// PyTorch's coordinate arithmetic (GridSampler.h), in f32 as there.

/// Unnormalized coordinate and its derivative w.r.t. the grid value.
fn unnormalize(g: f32, size: usize, align: bool) -> (f32, f32) {
    let s = size as f32;
    if align {
        ((g + 1.0) / 2.0 * (s - 1.0), (s - 1.0) / 2.0)
    } else {
        (((g + 1.0) * s - 1.0) / 2.0, s / 2.0)
    }
}

/// `clip_coordinates_set_grad`: clamped to `[0, size-1]`, derivative 0 or 1.
fn clip(c: f32, size: usize) -> (f32, f32) {
    let max = size as f32 - 1.0;
    if c <= 0.0 {
        (0.0, 0.0)
    } else if c >= max {
        (max, 0.0)
    } else {
        (c, 1.0)
    }
}

/// `reflect_coordinates_set_grad` between `twice_low / 2` and `twice_high / 2`.
fn reflect(c: f32, twice_low: i64, twice_high: i64) -> (f32, f32) {
    if twice_low == twice_high {
        return (0.0, 0.0);
    }
    let min = twice_low as f32 / 2.0;
    let span = (twice_high - twice_low) as f32 / 2.0;
    let (mut x, mult) = (c - min, 1.0f32);
    let mult = if x < 0.0 {
        x = -x;
        -mult
    } else {
        mult
    };
    let extra = x % span;
    let flips = (x / span).floor() as i64;
    if flips % 2 == 0 {
        (extra + min, mult)
    } else {
        (span - extra + min, -mult)
    }
}

/// `safe_downgrade_to_int_range`: non-finite or huge coordinates become -100
/// (out of bounds).
fn safe(c: f32) -> f32 {
    if !c.is_finite() || (c as f64).abs() > i32::MAX as f64 - 1.0 {
        -100.0
    } else {
        c
    }
}

/// `compute_coordinates` (padding only, for bicubic's taps) with its derivative.
fn pad_coord(cfg: &Config, c: f32, size: usize) -> (f32, f32) {
    let (c, g) = match cfg.pad {
        Pad::Zeros => (c, 1.0),
        Pad::Border => clip(c, size),
        Pad::Reflection => {
            let s = size as i64;
            let (c, gr) = if cfg.align {
                reflect(c, 0, 2 * (s - 1))
            } else {
                reflect(c, -1, 2 * s - 1)
            };
            let (c, gc) = clip(c, size);
            (c, gr * gc)
        }
    };
    (safe(c), g)
}

/// `grid_sampler_compute_source_index_set_grad`: source coordinate and its
/// derivative w.r.t. the grid value.
fn source(cfg: &Config, g: f32, size: usize) -> (f32, f32) {
    let (c, gu) = unnormalize(g, size, cfg.align);
    let (c, gp) = pad_coord(cfg, c, size);
    (c, gu * gp)
}

/// Cubic convolution coefficients (A = -0.75) at fraction `t` and their
/// derivatives w.r.t. `t` (`get_cubic_upsample_coefficients`).
fn cubic_coeffs(t: f32) -> ([f32; 4], [f32; 4]) {
    const A: f32 = -0.75;
    let c1 = |x: f32| ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0;
    let c2 = |x: f32| ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A;
    let d1 = |x: f32| (3.0 * (A + 2.0) * x - 2.0 * (A + 3.0)) * x;
    let d2 = |x: f32| (3.0 * A * x - 10.0 * A) * x + 8.0 * A;
    (
        [c2(t + 1.0), c1(t), c1(1.0 - t), c2(2.0 - t)],
        [d2(t + 1.0), d1(t), -d1(1.0 - t), -d2(2.0 - t)],
    )
}

/// The taps of one output point: flat in-plane offsets of the in-bounds input
/// elements it reads, their weights, each weight's derivative w.r.t. the source
/// coordinate of every grid component, and each component's d(source)/d(grid).
#[derive(Debug, Default)]
struct Taps {
    off: Vec<usize>,
    w: Vec<f32>,
    /// `dw[k * r + d]`: d(w_k) / d(source_d).
    dw: Vec<f32>,
    mult: Vec<f32>,
}

fn taps(cfg: &Config, ins: &[usize], strides: &[usize], g: &[f32], t: &mut Taps) {
    let r = ins.len();
    t.off.clear();
    t.w.clear();
    t.dw.clear();
    t.mult.clear();
    // Grid component d indexes spatial axis r-1-d (x is the last axis).
    let size = |d: usize| ins[r - 1 - d];
    let stride = |d: usize| strides[r - 1 - d];
    match cfg.mode {
        Mode::Nearest => {
            let mut off = 0;
            let mut inb = true;
            for (d, &gd) in g.iter().enumerate() {
                let (c, m) = source(cfg, gd, size(d));
                t.mult.push(m);
                let i = c.round_ties_even();
                if i < 0.0 || i >= size(d) as f32 {
                    inb = false;
                } else {
                    off += i as usize * stride(d);
                }
            }
            if inb {
                t.off.push(off);
                t.w.push(1.0);
                t.dw.extend(std::iter::repeat_n(0.0, r));
            }
        }
        Mode::Linear => {
            // r <= MAX_AXES (geometry checks it).
            let mut src = [(0f32, 0f32); MAX_AXES];
            let mut lo = [0f32; MAX_AXES];
            for (d, &gd) in g.iter().enumerate() {
                src[d] = source(cfg, gd, size(d));
                lo[d] = src[d].0.floor();
                t.mult.push(src[d].1);
            }
            let mut fac = [0f32; MAX_AXES];
            'corner: for m in 0..1usize << r {
                let mut off = 0;
                for d in 0..r {
                    let bit = (m >> d) & 1 == 1;
                    let c = lo[d] + bit as u8 as f32;
                    if c < 0.0 || c >= size(d) as f32 {
                        continue 'corner;
                    }
                    off += c as usize * stride(d);
                    fac[d] = if bit {
                        src[d].0 - lo[d]
                    } else {
                        lo[d] + 1.0 - src[d].0
                    };
                }
                let mut w = 1.0f32;
                for &f in &fac[..r] {
                    w *= f;
                }
                t.off.push(off);
                t.w.push(w);
                for d in 0..r {
                    let mut p = if (m >> d) & 1 == 1 { 1.0f32 } else { -1.0 };
                    for (e, &f) in fac[..r].iter().enumerate() {
                        if e != d {
                            p *= f;
                        }
                    }
                    t.dw.push(p);
                }
            }
        }
        Mode::Cubic => {
            // 4-D only: g = (x, y). Unnormalized without padding; every tap's
            // integer coordinate padded (get_value_bounded).
            let (ix, mx) = unnormalize(g[0], size(0), cfg.align);
            let (iy, my) = unnormalize(g[1], size(1), cfg.align);
            t.mult.extend([mx, my]);
            let (fx, fy) = (ix.floor(), iy.floor());
            let (wx, dwx) = cubic_coeffs(ix - fx);
            let (wy, dwy) = cubic_coeffs(iy - fy);
            for j in 0..4 {
                let (cy, _) = pad_coord(cfg, fy - 1.0 + j as f32, size(1));
                let cy = cy as i64;
                for i in 0..4 {
                    let (cx, _) = pad_coord(cfg, fx - 1.0 + i as f32, size(0));
                    let cx = cx as i64;
                    if cx < 0 || cx >= size(0) as i64 || cy < 0 || cy >= size(1) as i64 {
                        continue;
                    }
                    t.off
                        .push(cx as usize * stride(0) + cy as usize * stride(1));
                    t.w.push(wx[i] * wy[j]);
                    t.dw.extend([dwx[i] * wy[j], wx[i] * dwy[j]]);
                }
            }
        }
    }
}

fn plane_strides(ins: &[usize]) -> Vec<usize> {
    let mut s = vec![1; ins.len()];
    for i in (0..ins.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * ins[i + 1];
    }
    s
}

/// Output elements per parallel task, at least.
const PAR_MIN: usize = 1 << 14;

fn forward(cfg: &Config, geo: &Geo, x: &[f32], grid: &[f32]) -> Vec<f32> {
    let (r, p, plane, c) = (geo.r(), geo.points(), geo.plane(), geo.c);
    let st = plane_strides(&geo.ins);
    let mut out = vec![0f32; geo.n * c * p];
    let block = |n: usize, o: &mut [f32]| {
        let mut t = Taps::default();
        let xn = &x[n * c * plane..(n + 1) * c * plane];
        for q in 0..p {
            let g = &grid[(n * p + q) * r..(n * p + q + 1) * r];
            taps(cfg, &geo.ins, &st, g, &mut t);
            for ch in 0..c {
                let xc = &xn[ch * plane..(ch + 1) * plane];
                let mut acc = 0f32;
                for (&off, &w) in t.off.iter().zip(&t.w) {
                    acc += xc[off] * w;
                }
                o[ch * p + q] = acc;
            }
        }
    };
    if out.is_empty() {
        return out;
    }
    if out.len() >= PAR_MIN && geo.n > 1 {
        out.par_chunks_mut(c * p)
            .enumerate()
            .for_each(|(n, o)| block(n, o));
    } else {
        out.chunks_mut(c * p)
            .enumerate()
            .for_each(|(n, o)| block(n, o));
    }
    out
}

/// Gradients of input and grid: `dx[tap] += w · g`, `dgrid_d = mult_d · Σ_c Σ_k
/// x[tap_k] · dw_k,d · g`, points in order per batch element (deterministic).
fn backward(cfg: &Config, geo: &Geo, x: &[f32], grid: &[f32], gy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (r, p, plane, c) = (geo.r(), geo.points(), geo.plane(), geo.c);
    let st = plane_strides(&geo.ins);
    let mut dx = vec![0f32; geo.n * c * plane];
    let mut dg = vec![0f32; geo.n * p * r];
    let block = |n: usize, dxn: &mut [f32], dgn: &mut [f32]| {
        let mut t = Taps::default();
        let xn = &x[n * c * plane..(n + 1) * c * plane];
        let gn = &gy[n * c * p..(n + 1) * c * p];
        let mut acc = vec![0f32; r];
        for q in 0..p {
            let g = &grid[(n * p + q) * r..(n * p + q + 1) * r];
            taps(cfg, &geo.ins, &st, g, &mut t);
            acc.iter_mut().for_each(|a| *a = 0.0);
            for ch in 0..c {
                let go = gn[ch * p + q];
                let xc = &xn[ch * plane..(ch + 1) * plane];
                let dxc = &mut dxn[ch * plane..(ch + 1) * plane];
                for (k, (&off, &w)) in t.off.iter().zip(&t.w).enumerate() {
                    dxc[off] += w * go;
                    let v = xc[off] * go;
                    for (a, &dw) in acc.iter_mut().zip(&t.dw[k * r..(k + 1) * r]) {
                        *a += v * dw;
                    }
                }
            }
            for d in 0..r {
                dgn[q * r + d] = if cfg.mode == Mode::Nearest {
                    0.0
                } else {
                    t.mult[d] * acc[d]
                };
            }
        }
    };
    if dx.is_empty() || dg.is_empty() {
        return (dx, dg);
    }
    if geo.n * c * p >= PAR_MIN && geo.n > 1 {
        dx.par_chunks_mut(c * plane)
            .zip(dg.par_chunks_mut(p * r))
            .enumerate()
            .for_each(|(n, (a, b))| block(n, a, b));
    } else {
        dx.chunks_mut(c * plane)
            .zip(dg.chunks_mut(p * r))
            .enumerate()
            .for_each(|(n, (a, b))| block(n, a, b));
    }
    (dx, dg)
}

/// Taps per output point and weight FLOPs per point of a mode over `r` axes.
fn cost(cfg: &Config, r: u32) -> (u64, u64) {
    match cfg.mode {
        Mode::Nearest => (1, 0),
        Mode::Linear => (1 << r, (1u64 << r) * r as u64),
        Mode::Cubic => (16, 80),
    }
}

/// `GridSample(X, grid)`.
///
/// Shapes: `X [N, C, D1..Dr]` (r = 2 at opset 16; any r ≥ 1 at opset 20),
/// `grid [N, D1_out..Dr_out, r]` (component 0 is x, the last axis), output
/// `[N, C, D1_out..Dr_out]` of X's type. Modes linear (bilinear at opset 16: 2ʳ
/// taps), nearest (round half to even, as PyTorch's `nearbyint`) and cubic
/// (bicubic: 4-D only, as PyTorch; A = -0.75, each tap padded); padding zeros,
/// border or reflection, align_corners 0/1, all as PyTorch's `grid_sampler_*`.
///
/// FLOPs, for P = N·ΠD_out output points and E = P·C output elements, T taps
/// (2ʳ linear, 1 nearest, 16 cubic): coordinates `4r` per point (unnormalize)
/// plus weights per point (linear `T·r` products, cubic 80: 4 coefficients of
/// about 8 operations per axis and 16 products), plus a multiply-add per tap per
/// element (`2T·E`; nearest 0, a gather).
struct GridSample;

impl GridSample {
    fn plan(cx: &Cx) -> RuleResult<(Config, Geo)> {
        let (x, g) = (cx.input(0)?, cx.input(1)?);
        let cfg = config(cx.attrs(), cx.opset)?;
        Ok((cfg, geometry(&cfg, &x.shape, &g.shape, cx.opset)?))
    }
}

impl Op for GridSample {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (x, g) = (cx.input(0)?, cx.input(1)?);
        let (_, geo) = Self::plan(cx)?;
        if !x.dtype.is_float() || !g.dtype.is_float() {
            return Err(format!(
                "X ({}) and grid ({}) must be floating point",
                x.dtype, g.dtype
            )
            .into());
        }
        Ok(vec![Fact::new(x.dtype, geo.out_shape())])
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let Ok((cfg, geo)) = Self::plan(cx) else {
            return 0;
        };
        let r = geo.r() as u64;
        let (t, wf) = cost(&cfg, r as u32);
        let pts = super::numel(&[geo.n]).saturating_mul(super::numel(&geo.outs));
        let per_elem = if cfg.mode == Mode::Nearest { 0 } else { 2 * t };
        pts.saturating_mul(4 * r + wf)
            .saturating_add(out[0].numel().saturating_mul(per_elem))
    }
    /// PyTorch's GridSampler2DBackward (and 3D, cuDNN's) saves input and grid for
    /// either gradient: the input's scatters the weights (needs the grid), the
    /// grid's differentiates them (needs both). Nearest: zero grid gradient.
    /// Backward FLOPs: per element a multiply-add per tap for the input
    /// (`2T·E`) and `r` more per tap for the grid (`2T·r·E`), plus the coordinate
    /// and weight work per point twice (weights and their derivatives); nearest:
    /// one add per element.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let (cfg, geo) = Self::plan(cx)?;
        let needs = vec![Saved::Input(0), Saved::Input(1)];
        let r = geo.r() as u64;
        let (t, wf) = cost(&cfg, r as u32);
        let e = out[0].numel();
        let pts = super::numel(&[geo.n]).saturating_mul(super::numel(&geo.outs));
        let flops = if cfg.mode == Mode::Nearest {
            e.saturating_add(pts.saturating_mul(4 * r))
        } else {
            e.saturating_mul(2 * t * (1 + r))
                .saturating_add(pts.saturating_mul(4 * r + 2 * wf))
        };
        Ok(Some(Backward::each(&[0, 1], &needs, flops)))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// f32 (half types widened), per batch element in parallel when large: each
    /// point's taps computed once, applied to every channel.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let (x, g) = (cx.input(0)?, cx.input(1)?);
        let cfg = config(cx.attrs(), cx.opset)?;
        let geo = geometry(&cfg, &x.shape, &g.shape, cx.opset)?;
        let y = forward(&cfg, &geo, &x.to_f32()?, &g.to_f32()?);
        Ok(vec![Tensor::from_f32(x.dtype(), geo.out_shape(), y)?])
    }
    /// Both gradients from the saved input and grid, as PyTorch's
    /// `grid_sampler_2d_backward` computes them (the grid's through the padding's
    /// derivative: 0 where border/reflection clip, ±1 per reflection).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let rcx = cx.rule_cx();
        let (cfg, geo) = Self::plan(&rcx)?;
        let x = cx.saved(Saved::Input(0))?;
        let g = cx.saved(Saved::Input(1))?;
        let gy = cx.grad(0)?;
        let (dx, dg) = backward(&cfg, &geo, &x.to_f32()?, &g.to_f32()?, &gy);
        let mut ans = Vec::new();
        if cx.wants(0) {
            ans.push((0, dx));
        }
        if cx.wants(1) {
            ans.push((1, dg));
        }
        cx.answer(ans)
    }
    /// No device kernel: the host path (downloaded inputs, the CPU kernels).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// Registers GridSample.
pub fn register(r: &mut Registry) {
    r.add("GridSample", GridSample);
    r.add("AffineGrid", AffineGrid);
}

/// `AffineGrid(theta [N, 2, 3] | [N, 3, 4], size [N, C, H, W] | [N, C, D, H, W])
/// -> grid [N, H, W, 2] | [N, D, H, W, 3]`: the sampling grid of an affine map,
/// `size` a constant (GridSample's companion, `F.affine_grid`). FLOPs: 2 per
/// multiply-add of each output coordinate (3 or 4 per coordinate).
struct AffineGrid;

impl Op for AffineGrid {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let t = cx.input(0)?;
        let size = cx.sizes(1, "size")?;
        let nd = size.len().saturating_sub(2);
        if !(nd == 2 || nd == 3) || t.shape != [size[0], nd, nd + 1] {
            return Err(format!("theta {:?} does not fit size {size:?}", t.shape).into());
        }
        let mut shape = vec![size[0]];
        shape.extend_from_slice(&size[2..]);
        shape.push(nd);
        Ok(vec![Fact::new(t.dtype, shape)])
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let k = cx
            .input(0)
            .map_or(0, |t| *t.shape.last().unwrap_or(&0) as u64);
        out[0].numel().saturating_mul(2 * k)
    }
    /// `affine_grid_generator`'s backward multiplies the gradient by the base
    /// grid it rebuilds: nothing saved. Backward FLOPs: the forward's.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(Some(Backward::each(&[0], &[], self.flops(cx, out))))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// `grid[n, p, i] = Σ_j theta[n, i, j] · base[p, j]`, `base` the homogeneous
    /// coordinates `(x, y[, z], 1)` of each output position (x along the last
    /// spatial axis), in f32.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let theta = cx.input(0)?;
        let out = cx.out(0)?;
        let (n, nd) = (theta.shape[0], theta.shape[1]);
        let spatial = &out.shape[1..out.shape.len() - 1];
        let base = affine_base(spatial, cx.attrs().int_or("align_corners", 0) != 0);
        let t = theta.to_f32()?;
        let (k, positions) = (nd + 1, base.len() / (nd + 1));
        let mut grid = vec![0f32; n * positions * nd];
        for b in 0..n {
            let tb = &t[b * nd * k..(b + 1) * nd * k];
            for p in 0..positions {
                let bp = &base[p * k..(p + 1) * k];
                for i in 0..nd {
                    grid[(b * positions + p) * nd + i] =
                        (0..k).map(|j| tb[i * k + j] * bp[j]).sum();
                }
            }
        }
        Ok(vec![Tensor::from_f32(
            theta.dtype(),
            out.shape.clone(),
            grid,
        )?])
    }
    /// `dtheta[n, i, j] = Σ_p dgrid[n, p, i] · base[p, j]` (the base rebuilt).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let theta = cx.input(0)?;
        let out = cx.output(0)?;
        let (n, nd) = (theta.shape[0], theta.shape[1]);
        let spatial = &out.shape[1..out.shape.len() - 1];
        let base = affine_base(spatial, cx.attrs().int_or("align_corners", 0) != 0);
        let g = cx.grad(0)?;
        let (k, positions) = (nd + 1, base.len() / (nd + 1));
        let mut dt = vec![0f32; n * nd * k];
        for b in 0..n {
            for p in 0..positions {
                let bp = &base[p * k..(p + 1) * k];
                for i in 0..nd {
                    let gi = g[(b * positions + p) * nd + i];
                    for j in 0..k {
                        dt[(b * nd + i) * k + j] += gi * bp[j];
                    }
                }
            }
        }
        cx.answer(vec![(0, dt)])
    }
    /// No device kernel: the host path (downloaded theta, the CPU kernels).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// The homogeneous base grid of `F.affine_grid` over `spatial` ([H, W] or
/// [D, H, W]): per position, row-major, `(x, y[, z], 1)`, each coordinate
/// `-1 + 2i/(L-1)` with corners aligned (0 when L = 1, as PyTorch's
/// `linspace_from_neg_one`), else `(2i + 1)/L - 1`.
fn affine_base(spatial: &[usize], align: bool) -> Vec<f32> {
    let coord = |i: usize, l: usize| -> f32 {
        if align {
            if l <= 1 {
                0.0
            } else {
                -1.0 + 2.0 * i as f32 / (l - 1) as f32
            }
        } else {
            (2 * i + 1) as f32 / l as f32 - 1.0
        }
    };
    let nd = spatial.len();
    let positions: usize = spatial.iter().product();
    let mut base = Vec::with_capacity(positions * (nd + 1));
    let mut idx = vec![0usize; nd];
    for _ in 0..positions {
        // x is the last spatial axis, then y, then z.
        for a in (0..nd).rev() {
            base.push(coord(idx[a], spatial[a]));
        }
        base.push(1.0);
        for a in (0..nd).rev() {
            idx[a] += 1;
            if idx[a] < spatial[a] {
                break;
            }
            idx[a] = 0;
        }
    }
    base
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attr, DType, Node};

    fn node(attrs: &[(&str, &str)], align: Option<i64>) -> Node {
        let mut a: Vec<(String, Attr)> = attrs
            .iter()
            .map(|(k, v)| (k.to_string(), Attr::String(v.to_string())))
            .collect();
        if let Some(v) = align {
            a.push(("align_corners".into(), Attr::Int(v)));
        }
        Node {
            name: "gs".into(),
            op_type: "GridSample".into(),
            domain: Default::default(),
            inputs: vec![Some(0), Some(1)].into(),
            outputs: vec![Some(100)].into(),
            attrs: Attrs::from_iter(a),
        }
    }

    /// Output shape, forward FLOPs and backward FLOPs, or the error.
    fn run(
        attrs: &[(&str, &str)],
        opset: i64,
        x: &[usize],
        g: &[usize],
    ) -> RuleResult<(Vec<usize>, u64, u64)> {
        let n = node(attrs, Some(0));
        let (xf, gf) = (
            Fact::new(DType::F32, x.to_vec()),
            Fact::new(DType::F32, g.to_vec()),
        );
        let cx = Cx {
            node: &n,
            inputs: smallvec::smallvec![Some(&xf), Some(&gf)],
            opset,
        };
        let out = GridSample.infer(&cx)?;
        let fl = GridSample.flops(&cx, &out);
        let bw = GridSample.backward(&cx, &out)?.unwrap();
        assert_eq!(bw.grads.len(), 2);
        for gr in &bw.grads {
            assert_eq!(gr.needs, vec![Saved::Input(0), Saved::Input(1)]);
        }
        Ok((out[0].shape.clone(), fl, bw.flops))
    }

    #[test]
    fn shapes_and_flops_of_every_opset_form() {
        // Opset 16, default bilinear: P = 2·5·6 = 60 points, E = 3·60.
        let (sh, fl, bf) = run(&[], 16, &[2, 3, 7, 8], &[2, 5, 6, 2]).unwrap();
        assert_eq!(sh, vec![2, 3, 5, 6]);
        assert_eq!(fl, 60 * (8 + 4 * 2) + 180 * 2 * 4);
        assert_eq!(bf, 180 * 2 * 4 * 3 + 60 * (8 + 2 * 8));
        let (_, fl, bf) = run(&[("mode", "nearest")], 16, &[2, 3, 7, 8], &[2, 5, 6, 2]).unwrap();
        assert_eq!((fl, bf), (60 * 8, 180 + 60 * 8));
        let (_, fl, _) = run(
            &[("mode", "bicubic"), ("padding_mode", "reflection")],
            16,
            &[2, 3, 7, 8],
            &[2, 5, 6, 2],
        )
        .unwrap();
        assert_eq!(fl, 60 * (8 + 80) + 180 * 2 * 16);
        // Opset 20: new mode names, N-D.
        let (sh, fl, _) = run(
            &[("mode", "linear")],
            20,
            &[1, 2, 3, 4, 5],
            &[1, 6, 7, 8, 3],
        )
        .unwrap();
        assert_eq!(sh, vec![1, 2, 6, 7, 8]);
        assert_eq!(fl, 336 * (12 + 8 * 3) + 672 * 2 * 8);
        let (sh, _, _) = run(&[("mode", "cubic")], 20, &[1, 2, 3, 4], &[1, 6, 7, 2]).unwrap();
        assert_eq!(sh, vec![1, 2, 6, 7]);
        let (sh, _, _) = run(&[("mode", "nearest")], 20, &[1, 2, 9], &[1, 4, 1]).unwrap();
        assert_eq!(sh, vec![1, 2, 4]);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let err = |attrs: &[(&str, &str)], opset, x: &[usize], g: &[usize]| {
            run(attrs, opset, x, g).unwrap_err()
        };
        assert!(err(&[], 16, &[1, 2, 3, 4, 5], &[1, 2, 3, 4, 3])
            .to_string()
            .contains("opset 20"));
        assert!(err(&[], 16, &[2, 3, 4, 5], &[1, 6, 7, 2])
            .to_string()
            .contains("[N, D1_out, D2_out, 2]"));
        assert!(err(&[], 16, &[2, 3, 4, 5], &[2, 6, 7, 3])
            .to_string()
            .contains("must be"));
        assert!(err(&[], 20, &[2, 3, 4, 5], &[2, 6, 7])
            .to_string()
            .contains("must be"));
        assert!(err(&[], 20, &[2, 3], &[2, 1])
            .to_string()
            .contains("rank >= 3"));
        assert!(err(&[("mode", "linear")], 16, &[1, 1, 2, 2], &[1, 1, 1, 2])
            .to_string()
            .contains("bilinear, nearest or bicubic"));
        assert!(
            err(&[("mode", "bilinear")], 20, &[1, 1, 2, 2], &[1, 1, 1, 2])
                .to_string()
                .contains("linear, nearest or cubic")
        );
        assert!(
            err(&[("mode", "cubic")], 20, &[1, 1, 2, 2, 2], &[1, 1, 1, 1, 3])
                .to_string()
                .contains("4-D X only")
        );
        assert!(err(
            &[("padding_mode", "wrap")],
            16,
            &[1, 1, 2, 2],
            &[1, 1, 1, 2]
        )
        .to_string()
        .contains("padding_mode"));
        // Integer X, and align_corners out of range.
        let n = node(&[], Some(2));
        let (xf, gf) = (
            Fact::new(DType::F32, vec![1, 1, 2, 2]),
            Fact::new(DType::F32, vec![1, 1, 1, 2]),
        );
        let cx = Cx {
            node: &n,
            inputs: smallvec::smallvec![Some(&xf), Some(&gf)],
            opset: 16,
        };
        assert!(GridSample
            .infer(&cx)
            .unwrap_err()
            .to_string()
            .contains("0 or 1"));
        let n = node(&[], None);
        let xi = Fact::new(DType::I64, vec![1, 1, 2, 2]);
        let cx = Cx {
            node: &n,
            inputs: smallvec::smallvec![Some(&xi), Some(&gf)],
            opset: 16,
        };
        assert!(GridSample
            .infer(&cx)
            .unwrap_err()
            .to_string()
            .contains("floating point"));
    }

    #[test]
    fn coordinates_match_pytorch() {
        // align_corners: -1 → 0, 1 → size-1; otherwise -1 → -0.5, 1 → size-0.5.
        assert_eq!(unnormalize(-1.0, 5, true), (0.0, 2.0));
        assert_eq!(unnormalize(1.0, 5, false), (4.5, 2.5));
        // Reflection (align_corners=0) about -0.5 and size-0.5, then clipped.
        let c = Config {
            mode: Mode::Linear,
            pad: Pad::Reflection,
            align: false,
        };
        assert_eq!(pad_coord(&c, -1.25, 4), (0.25, -1.0));
        assert_eq!(
            pad_coord(&c, -1.0, 4),
            (0.0, 0.0),
            "clipped at 0: no gradient"
        );
        assert_eq!(pad_coord(&c, 4.25, 4), (2.75, -1.0));
        assert_eq!(pad_coord(&c, 9.0, 4), (1.0, 1.0));
        let c = Config { align: true, ..c };
        assert_eq!(pad_coord(&c, -1.5, 4), (1.5, -1.0));
        assert_eq!(pad_coord(&c, 0.3, 1), (0.0, 0.0), "size 1");
        let c = Config {
            pad: Pad::Border,
            ..c
        };
        assert_eq!(pad_coord(&c, 7.0, 4), (3.0, 0.0));
        assert_eq!(pad_coord(&c, f32::NAN, 4).0, -100.0);
        // Cubic coefficients sum to 1, their derivatives to 0.
        for t in [0.0f32, 0.25, 0.5, 0.9] {
            let (w, d) = cubic_coeffs(t);
            assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
            assert!(d.iter().sum::<f32>().abs() < 1e-5);
        }
    }

    #[test]
    fn runs_on_the_host_on_cuda() {
        assert_eq!(GridSample.cuda_kernels("GridSample"), CudaKernels::HOST);
    }

    /// F.affine_grid's base (torch 2.15): the identity map of a 2x3 image gives
    /// x over the width, then y; corners aligned or pixel centres.
    #[test]
    fn affine_base_is_pytorchs() {
        let b = affine_base(&[2, 3], false);
        let xy: Vec<(f32, f32)> = b.chunks(3).map(|c| (c[0], c[1])).collect();
        let third = 1.0 / 3.0;
        let want = [
            (-1.0 + third, -0.5),
            (0.0, -0.5),
            (1.0 - third, -0.5),
            (-1.0 + third, 0.5),
            (0.0, 0.5),
            (1.0 - third, 0.5),
        ];
        for (g, w) in xy.iter().zip(want) {
            assert!(
                (g.0 - w.0).abs() < 1e-6 && (g.1 - w.1).abs() < 1e-6,
                "{xy:?}"
            );
        }
        let b = affine_base(&[2, 1], true);
        assert_eq!(b, vec![0.0, -1.0, 1.0, 0.0, 1.0, 1.0]);
    }
}
