//! Signal processing: DFT, STFT, the window generators (HannWindow,
//! HammingWindow, BlackmanWindow) and MelWeightMatrix.
//!
//! Shape rules, FLOPs and CPU kernels as the ONNX reference implementation
//! (onnx/reference/ops) computes them, every transform in f64
//! ([`crate::numeric::fft`]). DFT and STFT are linear in the signal: their
//! backward is the adjoint transform (PyTorch's `fft_*` backward, which saves
//! nothing but sizes; `stft`'s window multiply saves the window). The
//! generators read no float input and have no gradient. On the device all of
//! them run on the host (`CudaKernels::HOST`).

use rayon::prelude::*;

use super::{
    axis, dim, Arity, Autocast, Backward, BackwardCx, CudaKernels, Cx, Fact, KernelCx, Op,
    Registry, RuleResult, Saved, Storage,
};
use crate::ir::DType;
use crate::numeric::fft::{Fft, C64};
use crate::numeric::Tensor;

/// FLOPs of one complex transform of length `n`: `5·n·log2(n)`, the usual
/// radix-2 FFT count (a length-1 transform is free).
fn fft_flops(n: usize) -> u64 {
    if n < 2 {
        return 0;
    }
    (5.0 * n as f64 * (n as f64).log2()).round() as u64
}

/// A scalar constant integer input, which the shape needs.
fn scalar(cx: &Cx, i: usize, what: &str) -> RuleResult<i64> {
    cx.value(i)?
        .scalar_int()
        .ok_or_else(|| format!("{what} (input {i}) must be a scalar").into())
}

/// `DFT(input, dft_length?, axis?) -> output`: input `[batch, ..., n, 1 | 2]`
/// (real or complex); the output is complex (`.., 2`), `dft_length` (default n)
/// long on the axis, or `dft_length/2 + 1` with `onesided`; with `onesided` and
/// `inverse` (irfft) it is real (`.., 1`), `dft_length` (default `2·(n − 1)`) long. The axis is an
/// attribute before opset 20 (default 1) and input 2 from it (default -2).
/// FLOPs: one [`fft_flops`] transform per signal.
struct Dft;

/// What one DFT node computes along its axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `X[k] = Σ_t x[t]·e^{−2πi·kt/n}`, the first `out_len` bins.
    Forward,
    /// `x[t] = (1/n)·Σ_k X[k]·e^{2πi·kt/n}`.
    Inverse,
    /// `inverse` and `onesided`: half a Hermitian spectrum to a real signal.
    Irfft,
}

/// One DFT node's transform: the axis, the transform length `n`, the output
/// length on the axis, and the kind.
#[derive(Debug, Clone, Copy)]
struct DftShape {
    ax: usize,
    n: usize,
    out_len: usize,
    kind: Kind,
}

impl DftShape {
    /// From the input shape, the axis and `dft_length` (given as values) and the
    /// attributes.
    fn new(
        shape: &[usize],
        a: i64,
        given: Option<i64>,
        onesided: bool,
        inverse: bool,
    ) -> RuleResult<DftShape> {
        let rank = shape.len();
        if rank < 2 || !matches!(shape.last(), Some(1 | 2)) {
            return Err(format!("input must be [.., n, 1 or 2], got {shape:?}").into());
        }
        // The last dimension holds real and imaginary parts, not an axis.
        let ax = axis(a, rank)?;
        if ax == rank - 1 {
            return Err(format!("axis {a} is the real/imaginary dimension").into());
        }
        let given = given.map(|v| dim(v, "dft_length")).transpose()?;
        if onesided && inverse {
            // irfft: half a spectrum in, a real signal of length n out.
            let n = given.unwrap_or(2 * shape[ax].saturating_sub(1));
            if n == 0 {
                return Err("the transform length is 0".into());
            }
            return Ok(DftShape {
                ax,
                n,
                out_len: n,
                kind: Kind::Irfft,
            });
        }
        let n = given.unwrap_or(shape[ax]);
        if n == 0 {
            return Err("the transform length is 0".into());
        }
        Ok(DftShape {
            ax,
            n,
            out_len: if onesided { n / 2 + 1 } else { n },
            kind: if inverse {
                Kind::Inverse
            } else {
                Kind::Forward
            },
        })
    }

    /// `[outer, len, inner, c]`: the input as lines along the axis.
    fn lines(&self, shape: &[usize]) -> [usize; 4] {
        let r = shape.len();
        [
            shape[..self.ax].iter().product(),
            shape[self.ax],
            shape[self.ax + 1..r - 1].iter().product(),
            shape[r - 1],
        ]
    }

    /// Output channels: real for irfft, else complex.
    fn c_out(&self) -> usize {
        if self.kind == Kind::Irfft {
            1
        } else {
            2
        }
    }

    /// The transform of one line (`len` values, zero-padded or truncated).
    fn forward(&self, fft: &Fft, line: &[C64]) -> Vec<C64> {
        let n = self.n;
        let mut buf = vec![C64::default(); n];
        match self.kind {
            Kind::Forward | Kind::Inverse => {
                let k = line.len().min(n);
                buf[..k].copy_from_slice(&line[..k]);
            }
            Kind::Irfft => {
                // The Hermitian spectrum of the first n/2 + 1 bins.
                let m = (n / 2 + 1).min(line.len());
                buf[..m].copy_from_slice(&line[..m]);
                for k in 1..m {
                    if n - k > n / 2 {
                        buf[n - k] = line[k].conj();
                    }
                }
            }
        }
        let mut y = vec![C64::default(); n];
        fft.run(&buf, &mut y);
        if self.kind != Kind::Forward {
            let s = 1.0 / n as f64;
            y.iter_mut().for_each(|v| *v = v.scale(s));
        }
        y.truncate(self.out_len);
        y
    }

    /// The adjoint of [`DftShape::forward`] (as a real-linear map of real and
    /// imaginary parts): from one output line's gradient to the input line's
    /// (`len` values).
    fn adjoint(&self, fft: &Fft, g: &[C64], len: usize) -> Vec<C64> {
        let n = self.n;
        let mut buf = vec![C64::default(); n];
        buf[..g.len()].copy_from_slice(g);
        let mut y = vec![C64::default(); n];
        fft.run(&buf, &mut y);
        let mut dx = vec![C64::default(); len];
        match self.kind {
            Kind::Forward => {
                let k = len.min(n);
                dx[..k].copy_from_slice(&y[..k]);
            }
            Kind::Inverse => {
                let s = 1.0 / n as f64;
                for (d, v) in dx.iter_mut().zip(&y) {
                    *d = v.scale(s);
                }
            }
            Kind::Irfft => {
                // Bins other than DC and Nyquist appear twice in the spectrum.
                let m = n / 2 + 1;
                for (k, d) in dx.iter_mut().enumerate().take(m) {
                    let twice = k != 0 && !(n % 2 == 0 && k == n / 2);
                    *d = y[k].scale(if twice { 2.0 } else { 1.0 } / n as f64);
                }
            }
        }
        dx
    }

    /// The transform (forward: `inverse` false) whose run [`DftShape::forward`]
    /// (`adjoint` false) or [`DftShape::adjoint`] needs.
    fn plan(&self, adjoint: bool) -> Fft {
        let inverse = self.kind != Kind::Forward;
        Fft::new(self.n, inverse != adjoint)
    }
}

/// DFT's attributes.
struct DftAttrs {
    /// `axis` (before opset 20; an input since; default 1).
    axis: i64,
    /// `onesided` (default 0).
    onesided: bool,
    /// `inverse` (default 0).
    inverse: bool,
}

impl DftAttrs {
    fn of(attrs: &crate::ir::Attrs) -> DftAttrs {
        DftAttrs {
            axis: attrs.int_or("axis", 1),
            onesided: attrs.int_or("onesided", 0) != 0,
            inverse: attrs.int_or("inverse", 0) != 0,
        }
    }
}

impl Dft {
    /// The node's transform, from the facts (constant `dft_length` and axis).
    fn dims(cx: &Cx) -> RuleResult<DftShape> {
        let x = cx.input(0)?;
        let at = DftAttrs::of(cx.attrs());
        let a = if cx.opset >= 20 {
            match cx.opt(2) {
                Some(_) => scalar(cx, 2, "axis")?,
                None => -2,
            }
        } else {
            at.axis
        };
        let given = match cx.opt(1) {
            Some(_) => Some(scalar(cx, 1, "dft_length")?),
            None => None,
        };
        DftShape::new(&x.shape, a, given, at.onesided, at.inverse)
    }

    /// The node's transform, from the kernel's runtime inputs.
    fn runtime(cx: &KernelCx) -> RuleResult<DftShape> {
        let x = cx.input(0)?;
        let at = DftAttrs::of(cx.attrs());
        let a = match (cx.opset >= 20, cx.opt(2)) {
            (true, Some(t)) => one_int(t, "axis")?,
            (true, None) => -2,
            (false, _) => at.axis,
        };
        let given = cx.opt(1).map(|t| one_int(t, "dft_length")).transpose()?;
        DftShape::new(&x.shape, a, given, at.onesided, at.inverse)
    }
}

/// The single element of an integer input.
fn one_int(t: &Tensor, what: &str) -> RuleResult<i64> {
    match t.to_i64s()[..] {
        [v] => Ok(v),
        _ => Err(format!("{what} must be a scalar, got shape {:?}", t.shape).into()),
    }
}

/// Maps every line of `x` (`[outer, len, inner, c]`, `c` 1: real, 2: real and
/// imaginary parts) along its axis with `f` (one line of `len` complex values
/// to `out_len`); the result is `[outer, out_len, inner, c_out]` (`c_out` 1
/// keeps the real parts). Lines run in parallel; each is computed alone.
fn map_lines(
    x: &[f32],
    [outer, len, inner, c]: [usize; 4],
    out_len: usize,
    c_out: usize,
    f: impl Fn(&[C64]) -> Vec<C64> + Sync,
) -> Vec<f64> {
    let lines: Vec<Vec<C64>> = (0..outer * inner)
        .into_par_iter()
        .map(|l| {
            let (o, i) = (l / inner, l % inner);
            let line: Vec<C64> = (0..len)
                .map(|t| {
                    let at = ((o * len + t) * inner + i) * c;
                    C64::new(x[at] as f64, if c == 2 { x[at + 1] as f64 } else { 0.0 })
                })
                .collect();
            f(&line)
        })
        .collect();
    let mut y = vec![0f64; outer * out_len * inner * c_out];
    for (l, v) in lines.iter().enumerate() {
        let (o, i) = (l / inner, l % inner);
        for (k, z) in v.iter().enumerate().take(out_len) {
            let at = ((o * out_len + k) * inner + i) * c_out;
            y[at] = z.re;
            if c_out == 2 {
                y[at + 1] = z.im;
            }
        }
    }
    y
}

impl Op for Dft {
    fn arity(&self) -> Arity {
        Arity::new(1, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        if !x.dtype.is_float() {
            return Err(format!("input must be floating point, got {}", x.dtype).into());
        }
        let d = Self::dims(cx)?;
        let mut shape = x.shape.clone();
        shape[d.ax] = d.out_len;
        *shape.last_mut().unwrap() = d.c_out();
        Ok(vec![Fact::new(x.dtype, shape)])
    }
    fn flops(&self, cx: &Cx, _out: &[Fact]) -> u64 {
        let (Ok(x), Ok(d)) = (cx.input(0), Self::dims(cx)) else {
            return 0;
        };
        let signals = x.numel() / (x.shape[d.ax] as u64 * *x.shape.last().unwrap() as u64).max(1);
        signals.saturating_mul(fft_flops(d.n))
    }
    /// Linear: the gradient is the adjoint transform, saving nothing (PyTorch's
    /// `fft_r2c`/`fft_c2c`/`fft_c2r` backward keep only sizes).
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(Some(Backward::each(&[0], &[], self.flops(cx, out))))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// Each line along the axis transformed in f64 ([`DftShape::forward`]).
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let d = Self::runtime(cx)?;
        let out = cx.out(0)?;
        let fft = d.plan(false);
        let v = x.to_f32()?;
        let y = map_lines(&v, d.lines(&x.shape), d.out_len, d.c_out(), |line| {
            d.forward(&fft, line)
        });
        Ok(vec![Tensor::from_f64(x.dtype(), out.shape.clone(), y)?])
    }
    /// The adjoint transform of the output gradient ([`DftShape::adjoint`]);
    /// a real input keeps the real parts.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let d = Self::dims(&cx.rule_cx())?;
        let (x, out) = (cx.input(0)?, cx.output(0)?);
        let g = cx.grad(0)?;
        let fft = d.plan(true);
        let [outer, len, inner, c] = d.lines(&x.shape);
        let lines = [outer, d.out_len, inner, d.c_out()];
        debug_assert_eq!(out.shape[d.ax], d.out_len);
        let dx = map_lines(&g, lines, len, c, |gl| d.adjoint(&fft, gl, len));
        cx.answer(vec![(0, dx.into_iter().map(|v| v as f32).collect())])
    }
    /// No device kernel: the host path.
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    /// PyTorch's fft ops are on autocast's fp32 list.
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Full
    }
}

/// `STFT(signal, frame_step, window?, frame_length?) -> output`: signal
/// `[batch, length, 1 | 2]`; output `[batch, frames, bins, 2]` with
/// `frames = (length − frame_length)/frame_step + 1` and `bins = frame_length/2 +
/// 1` when `onesided` (the default) else `frame_length`. The frame length is
/// input 3, else the window's, else the signal's length (the ONNX reference);
/// no window is a rectangular one. FLOPs: one transform per frame, plus the
/// window multiply.
struct Stft;

impl Stft {
    /// `(batch, frames, bins, frame_length)`.
    fn dims(cx: &Cx) -> RuleResult<(usize, usize, usize, usize)> {
        let x = cx.input(0)?;
        if x.rank() != 3 || !matches!(x.shape[2], 1 | 2) {
            return Err(
                format!("signal must be [batch, length, 1 or 2], got {:?}", x.shape).into(),
            );
        }
        let step = dim(scalar(cx, 1, "frame_step")?, "frame_step")?;
        let len = match (cx.opt(3), cx.opt(2)) {
            (Some(_), _) => dim(scalar(cx, 3, "frame_length")?, "frame_length")?,
            (None, Some(w)) if w.rank() == 1 => w.shape[0],
            (None, Some(w)) => return Err(format!("window must be 1-D, got {:?}", w.shape).into()),
            (None, None) => x.shape[1],
        };
        if let Some(w) = cx.opt(2) {
            if w.shape != [len] {
                return Err(format!("window is {:?}, frame_length {len}", w.shape).into());
            }
        }
        if step == 0 || len == 0 || len > x.shape[1] {
            return Err(format!(
                "frame_length {len} and frame_step {step} do not fit a signal of {}",
                x.shape[1]
            )
            .into());
        }
        let frames = (x.shape[1] - len) / step + 1;
        let onesided = cx.attrs().int_or("onesided", 1) != 0;
        let bins = if onesided { len / 2 + 1 } else { len };
        Ok((x.shape[0], frames, bins, len))
    }
}

impl Op for Stft {
    fn arity(&self) -> Arity {
        Arity::new(2, 4, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        if !x.dtype.is_float() {
            return Err(format!("signal must be floating point, got {}", x.dtype).into());
        }
        let (b, frames, bins, _) = Self::dims(cx)?;
        Ok(vec![Fact::new(x.dtype, vec![b, frames, bins, 2])])
    }
    fn flops(&self, cx: &Cx, _out: &[Fact]) -> u64 {
        let Ok((b, frames, _, len)) = Self::dims(cx) else {
            return 0;
        };
        ((b * frames) as u64).saturating_mul(fft_flops(len) + len as u64)
    }
    /// Linear in the signal: PyTorch's `stft` multiplies the frames by the
    /// window (saving the window for the signal's gradient) and runs
    /// `fft_r2c`/`fft_c2c` (saving nothing). The backward is the adjoint: each
    /// frame's gradient transformed back, weighted by the window and added
    /// into the signal.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let needs: &[Saved] = if cx.opt(2).is_some() {
            &[Saved::Input(2)]
        } else {
            &[]
        };
        Ok(Some(Backward::each(&[0], needs, self.flops(cx, out))))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// Frame by frame as the ONNX reference: window, transform, the first
    /// `bins` values.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let out = cx.out(0)?;
        let step = dim(one_int(cx.input(1)?, "frame_step")?, "frame_step")?;
        let len = match (cx.opt(3), cx.opt(2)) {
            (Some(t), _) => dim(one_int(t, "frame_length")?, "frame_length")?,
            (None, Some(w)) => w.numel(),
            (None, None) => x.shape[1],
        };
        let window = match cx.opt(2) {
            Some(w) if w.numel() == len => Some(w.to_f32()?),
            Some(w) => return Err(format!("window is {:?}, frame_length {len}", w.shape).into()),
            None => None,
        };
        let (b, frames, bins) = (out.shape[0], out.shape[1], out.shape[2]);
        let (n, c) = (x.shape[1], x.shape[2]);
        if frames > 0 && (frames - 1) * step + len > n {
            return Err(
                format!("{frames} frames of {len} by {step} overrun a signal of {n}").into(),
            );
        }
        let v = x.to_f32()?;
        let fft = Fft::new(len, false);
        let w = |t: usize| window.as_ref().map_or(1.0, |w| w[t] as f64);
        let y: Vec<f64> = (0..b * frames)
            .into_par_iter()
            .flat_map_iter(|bf| {
                let (bi, f) = (bf / frames, bf % frames);
                let frame: Vec<C64> = (0..len)
                    .map(|t| {
                        let at = (bi * n + f * step + t) * c;
                        let im = if c == 2 { v[at + 1] as f64 } else { 0.0 };
                        C64::new(v[at] as f64, im).scale(w(t))
                    })
                    .collect();
                let mut z = vec![C64::default(); len];
                fft.run(&frame, &mut z);
                z.truncate(bins);
                z.into_iter().flat_map(|z| [z.re, z.im])
            })
            .collect();
        Ok(vec![Tensor::from_f64(x.dtype(), out.shape.clone(), y)?])
    }
    /// Each frame's gradient through the inverse transform (unnormalized: the
    /// adjoint), times the window, added into the signal frame by frame.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let rcx = cx.rule_cx();
        let (b, frames, bins, len) = Self::dims(&rcx)?;
        let step = dim(scalar(&rcx, 1, "frame_step")?, "frame_step")?;
        let window = match cx.inputs.get(2).copied().flatten() {
            Some(_) => Some(cx.saved(Saved::Input(2))?.to_f32()?),
            None => None,
        };
        let x = cx.input(0)?;
        let (n, c) = (x.shape[1], x.shape[2]);
        let g = cx.grad(0)?;
        let fft = Fft::new(len, true);
        let w = |t: usize| window.as_ref().map_or(1.0, |w| w[t] as f64);
        let parts: Vec<Vec<C64>> = (0..b * frames)
            .into_par_iter()
            .map(|bf| {
                let mut buf = vec![C64::default(); len];
                for (k, z) in buf.iter_mut().enumerate().take(bins) {
                    let at = (bf * bins + k) * 2;
                    *z = C64::new(g[at] as f64, g[at + 1] as f64);
                }
                let mut y = vec![C64::default(); len];
                fft.run(&buf, &mut y);
                y.iter().enumerate().map(|(t, z)| z.scale(w(t))).collect()
            })
            .collect();
        let mut dx = vec![0f64; b * n * c];
        for (bf, part) in parts.iter().enumerate() {
            let (bi, f) = (bf / frames, bf % frames);
            for (t, z) in part.iter().enumerate() {
                let at = (bi * n + f * step + t) * c;
                dx[at] += z.re;
                if c == 2 {
                    dx[at + 1] += z.im;
                }
            }
        }
        cx.answer(vec![(0, dx.into_iter().map(|v| v as f32).collect())])
    }
    /// No device kernel: the host path.
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Full
    }
}

/// The generators: `HannWindow(size)`, `HammingWindow(size)`,
/// `BlackmanWindow(size)` give `[size]`; `MelWeightMatrix(num_mel_bins,
/// dft_length, sample_rate, lower_edge_hertz, upper_edge_hertz)` gives
/// `[dft_length/2 + 1, num_mel_bins]`; of `output_datatype` (default float).
/// FLOPs: 3 per element (a cosine or two and their weighting). The kernels
/// follow the ONNX reference: `periodic` (default 1) divides by `size`, else
/// by `size − 1`; Hamming's coefficients are 25/46 and 21/46.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Generator {
    Hann,
    Hamming,
    Blackman,
    Mel,
}

impl Generator {
    /// The ONNX op type.
    fn name(self) -> &'static str {
        match self {
            Generator::Hann => "HannWindow",
            Generator::Hamming => "HammingWindow",
            Generator::Blackman => "BlackmanWindow",
            Generator::Mel => "MelWeightMatrix",
        }
    }
}

/// The generators' attributes.
struct GeneratorAttrs {
    /// `output_datatype` (default 1, float).
    output_datatype: i64,
    /// `periodic` (the windows; default 1).
    periodic: bool,
}

impl GeneratorAttrs {
    fn of(attrs: &crate::ir::Attrs) -> GeneratorAttrs {
        GeneratorAttrs {
            output_datatype: attrs.int_or("output_datatype", 1),
            periodic: attrs.int_or("periodic", 1) != 0,
        }
    }
}

/// The window `op` of `size` values, in f64.
fn window(op: Generator, size: usize, periodic: bool) -> RuleResult<Vec<f64>> {
    use std::f64::consts::PI;
    let d = if periodic {
        size
    } else {
        size.saturating_sub(1)
    } as f64;
    let f: fn(f64) -> f64 = match op {
        Generator::Hann => |a| (a / 2.0).sin().powi(2),
        Generator::Hamming => |a| 25.0 / 46.0 - a.cos() * (21.0 / 46.0),
        Generator::Blackman => |a| 0.42 - 0.5 * a.cos() + 0.08 * (2.0 * a).cos(),
        Generator::Mel => return Err(format!("{} is not a window", op.name()).into()),
    };
    // `a` is 2πn/N (Hann's sin²(πn/N) is written with it).
    Ok((0..size).map(|n| f(2.0 * PI * n as f64 / d)).collect())
}

/// numpy's `floor_divide` of floats (`npy_divmod`): `(a − fmod(a, b)) / b`,
/// stepped down when the remainder's sign differs from `b`'s, and rounded.
fn floor_divide(a: f64, b: f64) -> f64 {
    let m = a % b;
    let mut div = (a - m) / b;
    if m != 0.0 && (b < 0.0) != (m < 0.0) {
        div -= 1.0;
    }
    if div == 0.0 {
        return (0.0f64).copysign(a / b);
    }
    let fl = div.floor();
    if div - fl > 0.5 {
        fl + 1.0
    } else {
        fl
    }
}

/// MelWeightMatrix as the ONNX reference computes it (`[dft_length/2 + 1,
/// num_mel_bins]`, row-major): triangles between mel-spaced DFT bins. A float32
/// edge frequency's `log1p` is taken in float32, as numpy does.
fn mel_weights(cx: &KernelCx) -> RuleResult<Vec<f64>> {
    let int = |i: usize, what: &str| one_int(cx.input(i)?, what);
    let bins = dim(int(0, "num_mel_bins")?, "num_mel_bins")?;
    let dft_length = int(1, "dft_length")?;
    let sample_rate = int(2, "sample_rate")?;
    let mel = |i: usize| -> RuleResult<f64> {
        let t = cx.input(i)?;
        let hz = match t.to_f64s()[..] {
            [v] => v,
            _ => return Err(format!("input {i} must be a scalar, got {:?}", t.shape).into()),
        };
        let l = if t.dtype() == DType::F64 {
            2595.0 * (hz / 700.0).ln_1p()
        } else {
            (2595.0 * (hz as f32 / 700.0).ln_1p()) as f64
        };
        Ok(l / std::f64::consts::LN_10)
    };
    let (low, high) = (mel(3)?, mel(4)?);
    let step = (high - low) / (bins + 2) as f64;
    let points: Vec<i64> = (0..bins + 2)
        .map(|i| {
            let hz = 700.0 * ((i as f64 * step + low) / 2595.0 * std::f64::consts::LN_10).exp_m1();
            floor_divide((dft_length + 1) as f64 * hz, sample_rate as f64) as i64
        })
        .collect();
    let rows = dim(dft_length, "dft_length")? / 2 + 1;
    let mut out = vec![0f64; rows * bins];
    let mut set = |j: i64, i: usize, v: f64| -> RuleResult<()> {
        let r = usize::try_from(j)
            .ok()
            .filter(|&r| r < rows)
            .ok_or_else(|| format!("mel point {j} falls outside the {rows} DFT bins"))?;
        out[r * bins + i] = v;
        Ok(())
    };
    for i in 0..bins {
        let (lo, mid, hi) = (points[i], points[i + 1], points[i + 2]);
        if mid == lo {
            set(mid, i, 1.0)?;
        } else {
            for j in lo..=mid {
                set(j, i, (j - lo) as f64 / (mid - lo) as f64)?;
            }
        }
        if hi > mid {
            for j in mid..hi {
                set(j, i, (hi - j) as f64 / (hi - mid) as f64)?;
            }
        }
    }
    Ok(out)
}

impl Op for Generator {
    fn arity(&self) -> Arity {
        Arity::new(1, 5, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let shape = if *self == Generator::Mel {
            if cx.inputs.len() != 5 {
                return Err("MelWeightMatrix takes 5 inputs".into());
            }
            let bins = dim(scalar(cx, 0, "num_mel_bins")?, "num_mel_bins")?;
            let n = dim(scalar(cx, 1, "dft_length")?, "dft_length")?;
            vec![n / 2 + 1, bins]
        } else {
            if cx.inputs.len() != 1 {
                return Err(format!("{} takes 1 input", self.name()).into());
            }
            vec![dim(scalar(cx, 0, "size")?, "size")?]
        };
        let dtype = super::dtype_attr(GeneratorAttrs::of(cx.attrs()).output_datatype)?;
        Ok(vec![Fact::new(dtype, shape)])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel().saturating_mul(3)
    }
    /// No float inputs: nothing to differentiate.
    fn backward(&self, _cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(None)
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// In f64, rounded (or truncated, for an integer `output_datatype`) once.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let out = cx.out(0)?;
        let v = match self {
            Generator::Mel => mel_weights(cx)?,
            Generator::Hann | Generator::Hamming | Generator::Blackman => {
                let size = dim(one_int(cx.input(0)?, "size")?, "size")?;
                window(*self, size, GeneratorAttrs::of(cx.attrs()).periodic)?
            }
        };
        if v.len() != out.numel() as usize {
            return Err(format!("{} values for an output of {:?}", v.len(), out.shape).into());
        }
        Ok(vec![Tensor::from_f64(out.dtype, out.shape.clone(), v)?])
    }
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        super::no_gradient(cx)
    }
    /// No device kernel: the host path.
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

pub(super) fn register(r: &mut Registry) {
    r.add("DFT", Dft);
    r.add("STFT", Stft);
    for op in [
        Generator::Hann,
        Generator::Hamming,
        Generator::Blackman,
        Generator::Mel,
    ] {
        r.add(op.name(), op);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fft_counts() {
        assert_eq!(fft_flops(1), 0);
        assert_eq!(fft_flops(8), 120);
    }
}
