//! float16 and bfloat16 on the device (kernels/half.cu): a half-precision
//! policy's values are held in their storage's type, 2 bytes an element, and
//! computed in f32 (exec::train's module doc). [`Device::convert`] widens a half
//! tensor to f32 (exactly) or rounds an f32 one to a half type (to nearest even),
//! bit for bit as the CPU's `Tensor::cast` (the `half` crate).

use super::tensor::Arg;
use super::{CudaError, Device, DeviceTensor, Result};
use crate::ir::DType;

/// kernels/half.cu's `kind` of a half type.
fn kind(dt: DType) -> Option<i32> {
    match dt {
        DType::F16 => Some(1),
        DType::BF16 => Some(2),
        _ => None,
    }
}

impl Device {
    /// `x` converted to the float type `to` in a new tensor (counted where new
    /// tensors count now): float32 to float16/bfloat16 rounds to nearest even, a
    /// half type to float32 is exact, one half type to the other goes through
    /// f32 (as `Tensor::cast`). Other types are an error.
    pub fn convert(&self, x: &DeviceTensor, to: DType) -> Result<DeviceTensor> {
        let n = x.numel();
        match (x.dtype(), kind(x.dtype()), kind(to)) {
            (DType::F32, None, Some(k)) => {
                let y = self.zeros(to, &x.shape)?;
                self.launch(
                    "f32_to_half",
                    n,
                    &[Arg::I32(k), Arg::n(n), Arg::t(x), Arg::t(&y)],
                )?;
                Ok(y)
            }
            (_, Some(k), None) if to == DType::F32 => {
                let y = self.zeros(DType::F32, &x.shape)?;
                self.launch(
                    "half_to_f32",
                    n,
                    &[Arg::I32(k), Arg::n(n), Arg::t(x), Arg::t(&y)],
                )?;
                Ok(y)
            }
            (_, Some(_), Some(_)) => {
                let wide = self.convert(x, DType::F32)?;
                self.convert(&wide, to)
            }
            (from, _, _) => Err(CudaError::Kernel(format!(
                "the device converts between float32, float16 and bfloat16, not {from} to {to}"
            ))),
        }
    }

    /// `x` as float32 when it is float16 or bfloat16 (a kernel input widened),
    /// else `None`.
    pub fn widened(&self, x: &DeviceTensor) -> Result<Option<DeviceTensor>> {
        match kind(x.dtype()) {
            Some(_) => self.convert(x, DType::F32).map(Some),
            None => Ok(None),
        }
    }

    /// In place `acc = round(acc + d)`, added in f32 (`acc` and `d` of one half
    /// type), as the CPU accumulates a half-precision gradient.
    pub fn accumulate_half(&self, acc: &DeviceTensor, d: &DeviceTensor) -> Result<()> {
        let k = kind(acc.dtype())
            .filter(|_| d.dtype() == acc.dtype() && d.numel() == acc.numel())
            .ok_or_else(|| {
                CudaError::Kernel(format!(
                    "adding a {} {:?} gradient into a {} {:?} one",
                    d.dtype(),
                    d.shape,
                    acc.dtype(),
                    acc.shape
                ))
            })?;
        let n = acc.numel();
        self.launch(
            "accumulate_half",
            n,
            &[Arg::I32(k), Arg::n(n), Arg::t(d), Arg::t(acc)],
        )
    }

    /// In place `p = round(p − lr·g)` computed in f32 (`p` and `g` of one half
    /// type): the CPU's SGD of a pure-bf16 parameter.
    pub fn sgd_half(&self, p: &DeviceTensor, g: &DeviceTensor, lr: f32) -> Result<()> {
        let k = kind(p.dtype())
            .filter(|_| g.dtype() == p.dtype() && g.numel() == p.numel())
            .ok_or_else(|| CudaError::Kernel("a gradient does not match its parameter".into()))?;
        let n = p.numel();
        self.launch(
            "sgd_half",
            n,
            &[Arg::I32(k), Arg::n(n), Arg::F32(lr), Arg::t(g), Arg::t(p)],
        )
    }
}
