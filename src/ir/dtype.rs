//! Element types, as ONNX's `TensorProto.DataType`, with their storage size.

use std::fmt;

/// An ONNX element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 8-bit unsigned.
    U8,
    /// 8-bit signed.
    I8,
    /// 16-bit unsigned.
    U16,
    /// 16-bit signed.
    I16,
    /// 32-bit signed.
    I32,
    /// 64-bit signed.
    I64,
    /// Variable-length string (no fixed size; never a tensor we can size).
    String,
    /// Boolean, one byte per element.
    Bool,
    /// IEEE half.
    F16,
    /// 64-bit IEEE float.
    F64,
    /// 32-bit unsigned.
    U32,
    /// 64-bit unsigned.
    U64,
    /// Complex of two f32.
    C64,
    /// Complex of two f64.
    C128,
    /// bfloat16.
    BF16,
    /// The 8-bit float formats (e4m3fn, e4m3fnuz, e5m2, e5m2fnuz, e8m0).
    F8,
    /// The 4-bit formats (uint4, int4, float4e2m1), two per byte.
    Nibble,
    /// The 2-bit formats (uint2, int2), four per byte.
    Crumb,
}

impl DType {
    /// Maps ONNX's `TensorProto.DataType` number; `None` for UNDEFINED or unknown codes.
    pub fn from_onnx(code: i32) -> Option<DType> {
        Some(match code {
            1 => DType::F32,
            2 => DType::U8,
            3 => DType::I8,
            4 => DType::U16,
            5 => DType::I16,
            6 => DType::I32,
            7 => DType::I64,
            8 => DType::String,
            9 => DType::Bool,
            10 => DType::F16,
            11 => DType::F64,
            12 => DType::U32,
            13 => DType::U64,
            14 => DType::C64,
            15 => DType::C128,
            16 => DType::BF16,
            17..=20 | 24 => DType::F8,
            21..=23 => DType::Nibble,
            25 | 26 => DType::Crumb,
            _ => return None,
        })
    }

    /// Storage bits per element (4 and 2 for the sub-byte types, 0 for strings).
    pub fn bits(self) -> u64 {
        match self {
            DType::Crumb => 2,
            DType::Nibble => 4,
            DType::U8 | DType::I8 | DType::Bool | DType::F8 => 8,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 16,
            DType::F32 | DType::I32 | DType::U32 => 32,
            DType::F64 | DType::I64 | DType::U64 | DType::C64 => 64,
            DType::C128 => 128,
            DType::String => 0,
        }
    }

    /// Bytes needed for `numel` elements (sub-byte types round up), `None` on overflow.
    pub fn bytes_for(self, numel: u64) -> Option<u64> {
        numel.checked_mul(self.bits()).map(|b| b.div_ceil(8))
    }

    /// True for the floating-point types (the ones that hold weights and get gradients).
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::F32 | DType::F16 | DType::BF16 | DType::F64 | DType::F8
        )
    }

    /// True for integer and boolean types.
    pub fn is_int(self) -> bool {
        matches!(
            self,
            DType::U8
                | DType::I8
                | DType::U16
                | DType::I16
                | DType::I32
                | DType::I64
                | DType::U32
                | DType::U64
                | DType::Bool
        )
    }

    /// Lower-case name as printed in reports (`float32`, `int64`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::U16 => "uint16",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::String => "string",
            DType::Bool => "bool",
            DType::F16 => "float16",
            DType::F64 => "float64",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::C64 => "complex64",
            DType::C128 => "complex128",
            DType::BF16 => "bfloat16",
            DType::F8 => "float8",
            DType::Nibble => "int4",
            DType::Crumb => "int2",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(DType::F32.bytes_for(10), Some(40));
        assert_eq!(DType::Bool.bytes_for(3), Some(3));
        assert_eq!(DType::Nibble.bytes_for(3), Some(2));
        // UINT2 and INT2: four per byte.
        assert_eq!(DType::from_onnx(25), Some(DType::Crumb));
        assert_eq!(DType::from_onnx(26).unwrap().bytes_for(5), Some(2));
        assert_eq!(DType::from_onnx(22).unwrap().bytes_for(5), Some(3));
        assert_eq!(DType::I64.bytes_for(u64::MAX / 4), None);
        assert_eq!(DType::from_onnx(7), Some(DType::I64));
        assert_eq!(DType::from_onnx(0), None);
    }
}
