//! The tensor table: every named value in the graph, what kind it is, and what
//! the model declares about it.

use bytes::Bytes;
use petgraph::stable_graph::NodeIndex;

use super::dtype::DType;
use super::value::{Data, Value, MAX_FOLD_ELEMS};

/// Index of a tensor in [`crate::ir::Graph::tensors`].
pub type TensorId = usize;

/// What a tensor is, for memory accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorKind {
    /// A graph input fed by the user (not an initializer).
    Input,
    /// A floating-point initializer: a weight or a buffer (BatchNorm statistics).
    Parameter,
    /// A non-floating initializer or the output of a `Constant` node.
    Constant,
    /// Produced by a node and consumed inside the graph.
    Activation,
    /// Produced by a node and listed as a graph output.
    Output,
}

/// A declared dimension, as written in the model (graph inputs/outputs, value_info).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DimDecl {
    /// `dim_value`.
    Fixed(i64),
    /// `dim_param`: a named symbolic dimension.
    Named(String),
    /// Neither given.
    Unknown,
}

/// Where an initializer's bytes are.
#[derive(Debug, Clone)]
pub enum Payload {
    /// `raw_data`, a slice of the memory-mapped file (never copied).
    Raw(Bytes),
    /// One of the typed repeated fields (`int64_data`, `float_data`, ...), already decoded.
    Typed(Data),
    /// `data_location = EXTERNAL`: described, not read.
    External {
        /// `location` relative to the model file.
        location: String,
        /// Byte offset in that file.
        offset: u64,
        /// Byte length, if given.
        length: Option<u64>,
    },
    /// No data at all: a "shape-only" initializer (dims and type kept, data cleared).
    ShapeOnly,
}

/// An initializer or a `Constant` node's tensor attribute.
#[derive(Debug, Clone)]
pub struct TensorData {
    /// Element type.
    pub dtype: DType,
    /// Dimensions (all non-negative; checked at load).
    pub dims: Vec<usize>,
    /// The data, wherever it lives.
    pub payload: Payload,
}

impl TensorData {
    /// Number of elements, `None` on overflow.
    pub fn numel(&self) -> Option<u64> {
        self.dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
    }

    /// The value, when it is small and its data is in the file (used for folding).
    pub fn value(&self) -> Option<Value> {
        let n = usize::try_from(self.numel()?).ok()?;
        if n > MAX_FOLD_ELEMS {
            return None;
        }
        let data = match &self.payload {
            Payload::Typed(d) => d.clone(),
            Payload::Raw(raw) => decode_raw(self.dtype, raw, n)?,
            Payload::External { .. } | Payload::ShapeOnly => return None,
        };
        (data.len() == n).then(|| Value {
            shape: self.dims.clone(),
            data,
        })
    }
}

/// Decodes little-endian `raw_data` of `n` elements.
fn decode_raw(dtype: DType, raw: &[u8], n: usize) -> Option<Data> {
    fn chunks<const W: usize>(raw: &[u8], n: usize) -> Option<impl Iterator<Item = [u8; W]> + '_> {
        (raw.len() == n * W).then(|| {
            raw.chunks_exact(W)
                .map(|c| <[u8; W]>::try_from(c).expect("exact chunk"))
        })
    }
    Some(match dtype {
        DType::I64 => Data::Int(chunks::<8>(raw, n)?.map(i64::from_le_bytes).collect()),
        DType::U64 => Data::Int(
            chunks::<8>(raw, n)?
                .map(|b| u64::from_le_bytes(b) as i64)
                .collect(),
        ),
        DType::I32 => Data::Int(
            chunks::<4>(raw, n)?
                .map(|b| i32::from_le_bytes(b) as i64)
                .collect(),
        ),
        DType::U32 => Data::Int(
            chunks::<4>(raw, n)?
                .map(|b| u32::from_le_bytes(b) as i64)
                .collect(),
        ),
        DType::I16 => Data::Int(
            chunks::<2>(raw, n)?
                .map(|b| i16::from_le_bytes(b) as i64)
                .collect(),
        ),
        DType::U16 => Data::Int(
            chunks::<2>(raw, n)?
                .map(|b| u16::from_le_bytes(b) as i64)
                .collect(),
        ),
        DType::I8 => Data::Int(chunks::<1>(raw, n)?.map(|b| b[0] as i8 as i64).collect()),
        DType::U8 | DType::Bool => Data::Int(chunks::<1>(raw, n)?.map(|b| b[0] as i64).collect()),
        DType::F32 => Data::Float(
            chunks::<4>(raw, n)?
                .map(|b| f32::from_le_bytes(b) as f64)
                .collect(),
        ),
        DType::F64 => Data::Float(chunks::<8>(raw, n)?.map(f64::from_le_bytes).collect()),
        DType::F16 => Data::Float(
            chunks::<2>(raw, n)?
                .map(|b| f16_to_f64(u16::from_le_bytes(b)))
                .collect(),
        ),
        DType::BF16 => Data::Float(
            chunks::<2>(raw, n)?
                .map(|b| f32::from_bits((u16::from_le_bytes(b) as u32) << 16) as f64)
                .collect(),
        ),
        _ => return None,
    })
}

/// IEEE half to f64.
fn f16_to_f64(h: u16) -> f64 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = ((h >> 10) & 0x1f) as i32;
    let frac = (h & 0x3ff) as f64;
    sign * match exp {
        0 => frac * 2f64.powi(-24),
        31 if frac == 0.0 => f64::INFINITY,
        31 => f64::NAN,
        e => (1.0 + frac / 1024.0) * 2f64.powi(e - 15),
    }
}

/// One entry of the tensor table.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// The ONNX name.
    pub name: super::Name,
    /// Role in the graph.
    pub kind: TensorKind,
    /// Declared element type (graph inputs/outputs, value_info, initializers), if any.
    pub declared_dtype: Option<DType>,
    /// Declared dimensions, where the model declares a shape for a graph input or
    /// output or in `value_info` (an initializer's dimensions are in `init`).
    pub declared_shape: Option<Vec<DimDecl>>,
    /// The node that writes it (`None` for inputs and initializers).
    pub producer: Option<NodeIndex>,
    /// Initializer or Constant data; boxed, so that the tensor table (mostly
    /// activations, which have none) stays small.
    pub init: Option<Box<TensorData>>,
    /// An initializer the exporter declares a buffer, not a parameter: the dynamo
    /// exporter writes each lifted tensor's `torch.export` input kind in its
    /// `value_info` metadata (`pkg.torch.export.graph_signature.InputSpec.kind`:
    /// PARAMETER, BUFFER, CONSTANT_TENSOR). A buffer never trains, though a
    /// differentiable op reads it (a rotary embedding's `inv_freq`).
    pub buffer: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_int64_decodes() {
        let raw: Vec<u8> = [3i64, -1].iter().flat_map(|v| v.to_le_bytes()).collect();
        let t = TensorData {
            dtype: DType::I64,
            dims: vec![2],
            payload: Payload::Raw(Bytes::from(raw)),
        };
        assert_eq!(t.value().unwrap().to_ints(), vec![3, -1]);
    }

    #[test]
    fn truncated_raw_is_not_a_value() {
        let t = TensorData {
            dtype: DType::I64,
            dims: vec![2],
            payload: Payload::Raw(Bytes::from(vec![0u8; 9])),
        };
        assert!(t.value().is_none());
    }

    #[test]
    fn half_precision() {
        assert_eq!(f16_to_f64(0x3c00), 1.0);
        assert_eq!(f16_to_f64(0xc000), -2.0);
    }
}
