//! [`Tensor`]: a concrete shape and contiguous, row-major, typed elements.
//!
//! Element storage per dtype: `float32` as `f32`; `float16`/`bfloat16` as the `half`
//! crate's types (kernels compute in f32 and round on store, the precision policy of
//! mixed-precision training); `int64` as `i64`; `int32` as `i32`; `bool` as `bool`.
//! Other ONNX dtypes are rejected with a message naming them.

use std::borrow::Cow;

use half::{bf16, f16};

use super::RuleResult;
use crate::ir::{DType, Data, Payload, TensorData};

/// Typed, contiguous, row-major elements.
#[derive(Debug, Clone, PartialEq)]
pub enum Elems {
    /// `float32`.
    F32(Vec<f32>),
    /// `float16`.
    F16(Vec<f16>),
    /// `bfloat16`.
    BF16(Vec<bf16>),
    /// `int64`.
    I64(Vec<i64>),
    /// `int32`.
    I32(Vec<i32>),
    /// `bool`.
    Bool(Vec<bool>),
}

/// Runs `$body` with `$v` bound to the variant's vector, whatever its element type,
/// rebuilding the same variant from the result (`map_elems!(e, v => expr)`).
macro_rules! map_elems {
    ($e:expr, $v:ident => $body:expr) => {
        match $e {
            $crate::numeric::Elems::F32($v) => $crate::numeric::Elems::F32($body),
            $crate::numeric::Elems::F16($v) => $crate::numeric::Elems::F16($body),
            $crate::numeric::Elems::BF16($v) => $crate::numeric::Elems::BF16($body),
            $crate::numeric::Elems::I64($v) => $crate::numeric::Elems::I64($body),
            $crate::numeric::Elems::I32($v) => $crate::numeric::Elems::I32($body),
            $crate::numeric::Elems::Bool($v) => $crate::numeric::Elems::Bool($body),
        }
    };
}

/// Runs `$body` with `$v: Vec<&[T]>` bound to the elements of every tensor in
/// `$ts` (which must share one element type), rebuilding that variant from the
/// result; an error names the mismatching dtypes.
macro_rules! with_same_elems {
    ($ts:expr, $v:ident => $body:expr) => {{
        let ts: &[&$crate::numeric::Tensor] = $ts;
        let first = ts.first().ok_or("no tensors")?.dtype();
        macro_rules! arm {
            ($var:ident) => {{
                let $v = ts
                    .iter()
                    .map(|t| match &t.elems {
                        $crate::numeric::Elems::$var(x) => Ok(&x[..]),
                        e => Err(format!("inputs mix {} and {}", first, e.dtype())),
                    })
                    .collect::<Result<Vec<_>, String>>()?;
                $crate::numeric::Elems::$var($body)
            }};
        }
        match &ts[0].elems {
            $crate::numeric::Elems::F32(_) => arm!(F32),
            $crate::numeric::Elems::F16(_) => arm!(F16),
            $crate::numeric::Elems::BF16(_) => arm!(BF16),
            $crate::numeric::Elems::I64(_) => arm!(I64),
            $crate::numeric::Elems::I32(_) => arm!(I32),
            $crate::numeric::Elems::Bool(_) => arm!(Bool),
        }
    }};
}
pub(crate) use with_same_elems;

impl Elems {
    /// Element count.
    pub fn len(&self) -> usize {
        match self {
            Elems::F32(v) => v.len(),
            Elems::F16(v) => v.len(),
            Elems::BF16(v) => v.len(),
            Elems::I64(v) => v.len(),
            Elems::I32(v) => v.len(),
            Elems::Bool(v) => v.len(),
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The ONNX dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self {
            Elems::F32(_) => DType::F32,
            Elems::F16(_) => DType::F16,
            Elems::BF16(_) => DType::BF16,
            Elems::I64(_) => DType::I64,
            Elems::I32(_) => DType::I32,
            Elems::Bool(_) => DType::Bool,
        }
    }

    /// Elements at flat positions `idx`, same type.
    pub fn select(&self, idx: &[usize]) -> Elems {
        map_elems!(self, v => idx.iter().map(|&i| v[i]).collect())
    }

    /// `n` default (zero / false) elements of `dtype`.
    pub fn zeros(dtype: DType, n: usize) -> RuleResult<Elems> {
        Ok(match dtype {
            DType::F32 => Elems::F32(vec![0.0; n]),
            DType::F16 => Elems::F16(vec![f16::ZERO; n]),
            DType::BF16 => Elems::BF16(vec![bf16::ZERO; n]),
            DType::I64 => Elems::I64(vec![0; n]),
            DType::I32 => Elems::I32(vec![0; n]),
            DType::Bool => Elems::Bool(vec![false; n]),
            other => return Err(unsupported(other).into()),
        })
    }
}

fn unsupported(d: DType) -> String {
    format!("the CPU executor does not support {d} tensors")
}

/// A tensor value: shape and elements (`elems.len()` is the product of `shape`).
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Concrete shape (empty for a scalar).
    pub shape: Vec<usize>,
    /// Row-major elements.
    pub elems: Elems,
}

impl Tensor {
    /// A tensor from shape and elements; panics if the count differs (a kernel bug).
    pub fn new(shape: Vec<usize>, elems: Elems) -> Tensor {
        assert_eq!(
            shape.iter().product::<usize>(),
            elems.len(),
            "tensor of shape {shape:?} built with {} elements",
            elems.len()
        );
        Tensor { shape, elems }
    }

    /// A float32 tensor.
    pub fn f32(shape: Vec<usize>, v: Vec<f32>) -> Tensor {
        Tensor::new(shape, Elems::F32(v))
    }

    /// An int64 tensor.
    pub fn i64(shape: Vec<usize>, v: Vec<i64>) -> Tensor {
        Tensor::new(shape, Elems::I64(v))
    }

    /// A bool tensor.
    pub fn bool(shape: Vec<usize>, v: Vec<bool>) -> Tensor {
        Tensor::new(shape, Elems::Bool(v))
    }

    /// Zeros (false) of `dtype`.
    pub fn zeros(dtype: DType, shape: Vec<usize>) -> RuleResult<Tensor> {
        let n = shape.iter().product();
        Ok(Tensor::new(shape, Elems::zeros(dtype, n)?))
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.elems.dtype()
    }

    /// Element count.
    pub fn numel(&self) -> usize {
        self.elems.len()
    }

    /// Rank.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Elements at flat positions `idx`, as a tensor of shape `shape`.
    pub fn select(&self, idx: &[usize], shape: Vec<usize>) -> Tensor {
        Tensor::new(shape, self.elems.select(idx))
    }

    /// The same elements under another shape of equal element count.
    pub fn reshaped(&self, shape: Vec<usize>) -> RuleResult<Tensor> {
        if shape.iter().product::<usize>() != self.numel() {
            return Err(format!(
                "cannot view {:?} as {shape:?}: element counts differ",
                self.shape
            )
            .into());
        }
        Ok(Tensor {
            shape,
            elems: self.elems.clone(),
        })
    }

    /// The float32 elements, borrowed; an error for any other dtype.
    pub fn as_f32(&self) -> RuleResult<&[f32]> {
        match &self.elems {
            Elems::F32(v) => Ok(v),
            e => Err(format!("expected a float32 tensor, got {}", e.dtype()).into()),
        }
    }

    /// Floating-point elements as f32 (borrowed for float32, widened for the half
    /// types); an error for integer and bool tensors.
    pub fn to_f32(&self) -> RuleResult<Cow<'_, [f32]>> {
        Ok(match &self.elems {
            Elems::F32(v) => Cow::Borrowed(v),
            Elems::F16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
            Elems::BF16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
            e => return Err(format!("expected a floating-point tensor, got {}", e.dtype()).into()),
        })
    }

    /// Any numeric elements as f64 (bools as 0/1), for scalars and small operands.
    pub fn to_f64s(&self) -> Vec<f64> {
        match &self.elems {
            Elems::F32(v) => v.iter().map(|&x| x as f64).collect(),
            Elems::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
            Elems::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
            Elems::I64(v) => v.iter().map(|&x| x as f64).collect(),
            Elems::I32(v) => v.iter().map(|&x| x as f64).collect(),
            Elems::Bool(v) => v.iter().map(|&x| x as u8 as f64).collect(),
        }
    }

    /// Integer or bool elements as i64 (shape operands, indices); floats truncate.
    pub fn to_i64s(&self) -> Vec<i64> {
        match &self.elems {
            Elems::I64(v) => v.clone(),
            Elems::I32(v) => v.iter().map(|&x| x as i64).collect(),
            Elems::Bool(v) => v.iter().map(|&x| x as i64).collect(),
            _ => self.to_f64s().into_iter().map(|x| x as i64).collect(),
        }
    }

    /// Builds a floating-point tensor of `dtype` from f32 values (rounding to
    /// nearest-even for the half types).
    pub fn from_f32(dtype: DType, shape: Vec<usize>, v: Vec<f32>) -> RuleResult<Tensor> {
        let elems = match dtype {
            DType::F32 => Elems::F32(v),
            DType::F16 => Elems::F16(v.into_iter().map(f16::from_f32).collect()),
            DType::BF16 => Elems::BF16(v.into_iter().map(bf16::from_f32).collect()),
            other => {
                return Err(format!("expected a floating-point result type, got {other}").into())
            }
        };
        Ok(Tensor::new(shape, elems))
    }

    /// Builds a tensor of `dtype` from f64 values: floats round, integers truncate
    /// toward zero, bools are `x != 0`.
    pub fn from_f64(dtype: DType, shape: Vec<usize>, v: Vec<f64>) -> RuleResult<Tensor> {
        let elems = match dtype {
            DType::F32 | DType::F16 | DType::BF16 => {
                return Tensor::from_f32(dtype, shape, v.into_iter().map(|x| x as f32).collect())
            }
            DType::I64 => Elems::I64(v.into_iter().map(|x| x as i64).collect()),
            DType::I32 => Elems::I32(v.into_iter().map(|x| x as i32).collect()),
            DType::Bool => Elems::Bool(v.into_iter().map(|x| x != 0.0).collect()),
            other => return Err(unsupported(other).into()),
        };
        Ok(Tensor::new(shape, elems))
    }

    /// Builds a tensor of `dtype` from i64 values (exact for the integer types).
    pub fn from_i64(dtype: DType, shape: Vec<usize>, v: Vec<i64>) -> RuleResult<Tensor> {
        let elems = match dtype {
            DType::I64 => Elems::I64(v),
            DType::I32 => Elems::I32(v.into_iter().map(|x| x as i32).collect()),
            DType::Bool => Elems::Bool(v.into_iter().map(|x| x != 0).collect()),
            _ => return Tensor::from_f64(dtype, shape, v.into_iter().map(|x| x as f64).collect()),
        };
        Ok(Tensor::new(shape, elems))
    }

    /// Converts to `dtype` (ONNX Cast: float to integer truncates toward zero,
    /// anything to bool is `x != 0`, int64 to float rounds).
    pub fn cast(&self, dtype: DType) -> RuleResult<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let shape = self.shape.clone();
        match (&self.elems, dtype) {
            (Elems::I64(_) | Elems::I32(_) | Elems::Bool(_), _) => {
                Tensor::from_i64(dtype, shape, self.to_i64s())
            }
            (_, DType::F32 | DType::F16 | DType::BF16) => {
                Tensor::from_f32(dtype, shape, self.to_f32()?.into_owned())
            }
            _ => Tensor::from_f64(dtype, shape, self.to_f64s()),
        }
    }

    /// The data of an initializer or Constant attribute (raw little-endian bytes or
    /// typed fields). Shape-only data, and external data the loader could not map
    /// (`onnx::load`), are errors here (see the CPU executor for seeded
    /// parameters).
    pub fn from_data(t: &TensorData) -> RuleResult<Tensor> {
        let n: usize = t.dims.iter().product();
        let shape = t.dims.clone();
        let tensor = match &t.payload {
            Payload::Raw(raw) => {
                let elems = decode_raw(t.dtype, raw, n)?;
                Tensor::new(shape, elems)
            }
            Payload::Typed(Data::Int(v)) if v.len() == n => {
                Tensor::from_i64(t.dtype, shape, v.clone())?
            }
            Payload::Typed(Data::Float(v)) if v.len() == n => {
                Tensor::from_f64(t.dtype, shape, v.clone())?
            }
            Payload::Typed(d) => {
                return Err(format!("has {} values for shape {:?}", d.len(), t.dims).into())
            }
            Payload::External { location, .. } => {
                return Err(format!(
                    "its data is in external file '{location}', which could not be read (missing, outside the model's directory, or shorter than its range)"
                )
                .into())
            }
            Payload::ShapeOnly => return Err("has no data (shape-only)".into()),
        };
        Ok(tensor)
    }
}

/// Decodes little-endian `raw_data` of `n` elements.
fn decode_raw(dtype: DType, raw: &[u8], n: usize) -> RuleResult<Elems> {
    let width = (dtype.bits() / 8) as usize;
    if width == 0 || raw.len() != n * width {
        return Err(format!(
            "raw data of {} bytes does not hold {n} {dtype} elements",
            raw.len()
        )
        .into());
    }
    fn words<const W: usize>(raw: &[u8]) -> impl Iterator<Item = [u8; W]> + '_ {
        raw.chunks_exact(W)
            .map(|c| <[u8; W]>::try_from(c).expect("exact chunk"))
    }
    Ok(match dtype {
        DType::F32 => Elems::F32(words::<4>(raw).map(f32::from_le_bytes).collect()),
        DType::F16 => Elems::F16(words::<2>(raw).map(f16::from_le_bytes).collect()),
        DType::BF16 => Elems::BF16(words::<2>(raw).map(bf16::from_le_bytes).collect()),
        DType::I64 => Elems::I64(words::<8>(raw).map(i64::from_le_bytes).collect()),
        DType::I32 => Elems::I32(words::<4>(raw).map(i32::from_le_bytes).collect()),
        DType::Bool => Elems::Bool(raw.iter().map(|&b| b != 0).collect()),
        other => return Err(unsupported(other).into()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn raw_f32_decodes() {
        let raw: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let t = TensorData {
            dtype: DType::F32,
            dims: vec![2],
            payload: Payload::Raw(Bytes::from(raw)),
        };
        assert_eq!(
            Tensor::from_data(&t).unwrap(),
            Tensor::f32(vec![2], vec![1.5, -2.0])
        );
    }

    #[test]
    fn casts() {
        let t = Tensor::f32(vec![3], vec![-1.7, 0.0, 2.9]);
        assert_eq!(t.cast(DType::I64).unwrap().to_i64s(), vec![-1, 0, 2]);
        assert_eq!(
            t.cast(DType::Bool).unwrap().elems,
            Elems::Bool(vec![true, false, true])
        );
        let h = t.cast(DType::F16).unwrap();
        assert_eq!(h.dtype(), DType::F16);
        assert!((h.to_f32().unwrap()[2] - 2.9).abs() < 2e-3);
    }

    #[test]
    fn shape_only_is_an_error() {
        let t = TensorData {
            dtype: DType::F32,
            dims: vec![2],
            payload: Payload::ShapeOnly,
        };
        assert!(Tensor::from_data(&t).is_err());
    }
}
