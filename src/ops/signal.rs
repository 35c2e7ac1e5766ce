//! Signal processing: DFT, STFT, the window generators (HannWindow,
//! HammingWindow, BlackmanWindow) and MelWeightMatrix.
//!
//! Shape rules and FLOPs; no CPU kernels yet (each says so). DFT and STFT are
//! linear: their backward (PyTorch's `fft_*` and `stft`) saves nothing and costs
//! one more transform; the generators read no float input.

use super::{axis, dim, Arity, Autocast, Backward, Cx, Fact, Op, Registry, RuleResult};

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

impl Dft {
    /// The transformed axis and its output length, and the transform length.
    fn dims(cx: &Cx) -> RuleResult<(usize, usize, usize)> {
        let x = cx.input(0)?;
        if x.rank() < 2 || !matches!(x.shape.last(), Some(1 | 2)) {
            return Err(format!("input must be [.., n, 1 or 2], got {:?}", x.shape).into());
        }
        let a = if cx.opset >= 20 {
            match cx.opt(2) {
                Some(_) => scalar(cx, 2, "axis")?,
                None => -2,
            }
        } else {
            cx.attrs().int_or("axis", 1)
        };
        // The last dimension holds real and imaginary parts, not an axis.
        let ax = axis(a, x.rank())?;
        if ax == x.rank() - 1 {
            return Err(format!("axis {a} is the real/imaginary dimension").into());
        }
        let onesided = cx.attrs().int_or("onesided", 0) != 0;
        let inverse = cx.attrs().int_or("inverse", 0) != 0;
        let given = match cx.opt(1) {
            Some(_) => Some(dim(scalar(cx, 1, "dft_length")?, "dft_length")?),
            None => None,
        };
        if onesided && inverse {
            // irfft: half a spectrum in, a real signal of length n out.
            let n = given.unwrap_or(2 * x.shape[ax].saturating_sub(1));
            return Ok((ax, n, n));
        }
        let n = given.unwrap_or(x.shape[ax]);
        Ok((ax, if onesided { n / 2 + 1 } else { n }, n))
    }
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
        let (ax, len, _) = Self::dims(cx)?;
        let mut shape = x.shape.clone();
        shape[ax] = len;
        let irfft = cx.attrs().int_or("onesided", 0) != 0 && cx.attrs().int_or("inverse", 0) != 0;
        *shape.last_mut().unwrap() = if irfft { 1 } else { 2 };
        Ok(vec![Fact::new(x.dtype, shape)])
    }
    fn flops(&self, cx: &Cx, _out: &[Fact]) -> u64 {
        let (Ok(x), Ok((ax, _, n))) = (cx.input(0), Self::dims(cx)) else {
            return 0;
        };
        let signals = x.numel() / (x.shape[ax] as u64 * *x.shape.last().unwrap() as u64).max(1);
        signals.saturating_mul(fft_flops(n))
    }
    /// Linear: the gradient is the adjoint transform, saving nothing.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(Some(Backward::each(&[0], &[], self.flops(cx, out))))
    }
    shape_only!(no_backward_kernel);
    /// PyTorch's fft ops are on autocast's fp32 list.
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Full
    }
}

/// `STFT(signal, frame_step, window?, frame_length?) -> output`: signal
/// `[batch, length, 1 | 2]`; output `[batch, frames, bins, 2]` with
/// `frames = (length − frame_length)/frame_step + 1` and `bins = frame_length/2 +
/// 1` when `onesided` (the default) else `frame_length`. The frame length is
/// input 3, else the window's. FLOPs: one transform per frame, plus the window
/// multiply.
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
            _ => return Err("STFT needs a window or a frame_length".into()),
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
    /// Linear in the signal: the gradient saves nothing (the window, when it
    /// requires none, is a constant of the backward).
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(Some(Backward::each(&[0], &[], self.flops(cx, out))))
    }
    shape_only!(no_backward_kernel);
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Full
    }
}

/// The generators: `HannWindow(size)`, `HammingWindow(size)`,
/// `BlackmanWindow(size)` give `[size]`; `MelWeightMatrix(num_mel_bins,
/// dft_length, sample_rate, lower_edge_hertz, upper_edge_hertz)` gives
/// `[dft_length/2 + 1, num_mel_bins]`; of `output_datatype` (default float).
/// FLOPs: 3 per element (a cosine or two and their weighting).
struct Generator;

impl Op for Generator {
    fn arity(&self) -> Arity {
        Arity::new(1, 5, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let shape = if cx.node.op_type == "MelWeightMatrix" {
            if cx.inputs.len() != 5 {
                return Err("MelWeightMatrix takes 5 inputs".into());
            }
            let bins = dim(scalar(cx, 0, "num_mel_bins")?, "num_mel_bins")?;
            let n = dim(scalar(cx, 1, "dft_length")?, "dft_length")?;
            vec![n / 2 + 1, bins]
        } else {
            if cx.inputs.len() != 1 {
                return Err(format!("{} takes 1 input", cx.node.op_type).into());
            }
            vec![dim(scalar(cx, 0, "size")?, "size")?]
        };
        let dtype = super::dtype_attr(cx.attrs().int_or("output_datatype", 1))?;
        Ok(vec![Fact::new(dtype, shape)])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel().saturating_mul(3)
    }
    /// No float inputs: nothing to differentiate.
    fn backward(&self, _cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(None)
    }
    shape_only!(no_gradient);
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

pub(super) fn register(r: &mut Registry) {
    r.add("DFT", Dft);
    r.add("STFT", Stft);
    for op in [
        "HannWindow",
        "HammingWindow",
        "BlackmanWindow",
        "MelWeightMatrix",
    ] {
        r.add(op, Generator);
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
