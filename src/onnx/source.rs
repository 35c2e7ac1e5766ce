//! What building the IR reads of a decoded model, as traits over two sources: prost's
//! owned structs ([`super::proto`]) and the zero-copy views of [`super::wire`]. One
//! builder ([`super::load`]) serves both, so both give the same IR and the same errors.

use std::borrow::Cow;

use bytes::Bytes;
use prost::Message;

use super::proto;
use crate::ir::{DType, DimDecl};

/// A `GraphProto`.
pub(crate) trait GraphSrc {
    /// Its nodes.
    type Node: NodeSrc;
    /// Its initializers.
    type Tensor: TensorSrc;
    /// Its inputs, outputs and `value_info`.
    type Info: InfoSrc;
    /// `name`, `""` when absent.
    fn name(&self) -> &str;
    /// `node`.
    fn nodes(&self) -> &[Self::Node];
    /// `initializer`.
    fn initializers(&self) -> &[Self::Tensor];
    /// Whether `sparse_initializer` is non-empty.
    fn has_sparse_initializers(&self) -> bool;
    /// `input`.
    fn inputs(&self) -> &[Self::Info];
    /// `output`.
    fn outputs(&self) -> &[Self::Info];
    /// `value_info`.
    fn value_info(&self) -> &[Self::Info];
}

/// A tensor's `dims`.
pub(crate) type Dims = smallvec::SmallVec<[i64; 6]>;

/// A `NodeProto`.
pub(crate) trait NodeSrc {
    /// One attribute.
    type Attr<'s>: AttrSrc
    where
        Self: 's;
    /// `name`, `""` when absent.
    fn name(&self) -> &str;
    /// `op_type`, `""` when absent.
    fn op_type(&self) -> &str;
    /// `domain`, `""` when absent.
    fn domain(&self) -> &str;
    /// `input`, in order.
    fn inputs(&self) -> impl Iterator<Item = &str>;
    /// `output`, in order.
    fn outputs(&self) -> impl Iterator<Item = &str>;
    /// The number of `output` entries.
    fn output_count(&self) -> usize {
        self.outputs().count()
    }
    /// `attribute`, in order.
    fn attributes(&self) -> impl Iterator<Item = Self::Attr<'_>>;
    /// The number of `attribute` entries.
    fn attribute_count(&self) -> usize {
        self.attributes().count()
    }
    /// The value of the first `metadata_props` entry with this key (`""` when it
    /// has no value).
    fn metadata(&self, key: &str) -> Option<&str>;
}

/// An `AttributeProto`.
pub(crate) trait AttrSrc {
    /// Its tensor.
    type Tensor: TensorSrc;
    /// `name`, `""` when absent.
    fn name(&self) -> &str;
    /// `type`.
    fn kind(&self) -> Option<i32>;
    /// `i`.
    fn i(&self) -> Option<i64>;
    /// `f`.
    fn f(&self) -> Option<f32>;
    /// `s`.
    fn s(&self) -> Option<&[u8]>;
    /// `ints`.
    fn ints(&self) -> Cow<'_, [i64]>;
    /// `floats`.
    fn floats(&self) -> Cow<'_, [f32]>;
    /// `strings`.
    fn strings(&self) -> impl Iterator<Item = &[u8]>;
    /// `t`.
    fn t(&self) -> Option<&Self::Tensor>;
    /// `g`, encoded as a `GraphProto`.
    fn g(&self) -> Option<Bytes>;
    /// The in-place reader could not read it (`super::wire`): the model is loaded
    /// through prost instead.
    fn malformed(&self) -> bool {
        false
    }
}

/// A `TensorProto`.
pub(crate) trait TensorSrc {
    /// `name`, `""` when absent.
    fn name(&self) -> &str;
    /// `data_type`.
    fn data_type(&self) -> Option<i32>;
    /// `dims` (inline up to rank 6: no allocation).
    fn dims(&self) -> Dims;
    /// `data_location`.
    fn data_location(&self) -> Option<i32>;
    /// The value of the first `external_data` entry with this key.
    fn external(&self, key: &str) -> Option<String>;
    /// `raw_data`.
    fn raw_data(&self) -> Option<Bytes>;
    /// `int64_data`.
    fn int64_data(&self) -> Cow<'_, [i64]>;
    /// `int32_data`.
    fn int32_data(&self) -> Cow<'_, [i32]>;
    /// `uint64_data`.
    fn uint64_data(&self) -> Cow<'_, [u64]>;
    /// `float_data`.
    fn float_data(&self) -> Cow<'_, [f32]>;
    /// `double_data`.
    fn double_data(&self) -> Cow<'_, [f64]>;
}

/// A `ValueInfoProto`.
pub(crate) trait InfoSrc {
    /// `name`.
    fn name(&self) -> Option<&str>;
    /// What its declared type is when memplan does not model it (not a numeric tensor).
    fn unmodelled(&self) -> Option<&'static str>;
    /// Its declared element type and dimensions, when it is a tensor.
    fn decl_type(&self) -> (Option<DType>, Option<Vec<DimDecl>>);
    /// The value of the first `metadata_props` entry with this key (`""` when it
    /// has no value).
    fn metadata(&self, key: &str) -> Option<&str>;
}

impl GraphSrc for proto::GraphProto {
    type Node = proto::NodeProto;
    type Tensor = proto::TensorProto;
    type Info = proto::ValueInfoProto;
    fn name(&self) -> &str {
        self.name()
    }
    fn nodes(&self) -> &[proto::NodeProto] {
        &self.node
    }
    fn initializers(&self) -> &[proto::TensorProto] {
        &self.initializer
    }
    fn has_sparse_initializers(&self) -> bool {
        !self.sparse_initializer.is_empty()
    }
    fn inputs(&self) -> &[proto::ValueInfoProto] {
        &self.input
    }
    fn outputs(&self) -> &[proto::ValueInfoProto] {
        &self.output
    }
    fn value_info(&self) -> &[proto::ValueInfoProto] {
        &self.value_info
    }
}

impl NodeSrc for proto::NodeProto {
    type Attr<'s> = &'s proto::AttributeProto;
    fn name(&self) -> &str {
        self.name()
    }
    fn op_type(&self) -> &str {
        self.op_type()
    }
    fn domain(&self) -> &str {
        self.domain()
    }
    fn inputs(&self) -> impl Iterator<Item = &str> {
        self.input.iter().map(String::as_str)
    }
    fn outputs(&self) -> impl Iterator<Item = &str> {
        self.output.iter().map(String::as_str)
    }
    fn attributes(&self) -> impl Iterator<Item = &proto::AttributeProto> {
        self.attribute.iter()
    }
    fn attribute_count(&self) -> usize {
        self.attribute.len()
    }
    fn metadata(&self, key: &str) -> Option<&str> {
        self.metadata_props
            .iter()
            .find(|p| p.key() == key)
            .map(|p| p.value())
    }
}

impl AttrSrc for &proto::AttributeProto {
    type Tensor = proto::TensorProto;
    fn name(&self) -> &str {
        self.name.as_deref().unwrap_or("")
    }
    fn kind(&self) -> Option<i32> {
        self.r#type
    }
    fn i(&self) -> Option<i64> {
        self.i
    }
    fn f(&self) -> Option<f32> {
        self.f
    }
    fn s(&self) -> Option<&[u8]> {
        self.s.as_deref()
    }
    fn ints(&self) -> Cow<'_, [i64]> {
        Cow::Borrowed(&self.ints)
    }
    fn floats(&self) -> Cow<'_, [f32]> {
        Cow::Borrowed(&self.floats)
    }
    fn strings(&self) -> impl Iterator<Item = &[u8]> {
        self.strings.iter().map(|b| b.as_ref())
    }
    fn t(&self) -> Option<&proto::TensorProto> {
        self.t.as_ref()
    }
    fn g(&self) -> Option<Bytes> {
        self.g.as_ref().map(|g| Bytes::from(g.encode_to_vec()))
    }
}

impl TensorSrc for proto::TensorProto {
    fn name(&self) -> &str {
        self.name.as_deref().unwrap_or("")
    }
    fn data_type(&self) -> Option<i32> {
        self.data_type
    }
    fn dims(&self) -> Dims {
        Dims::from_slice(&self.dims)
    }
    fn data_location(&self) -> Option<i32> {
        self.data_location
    }
    fn external(&self, key: &str) -> Option<String> {
        self.external_data
            .iter()
            .find(|e| e.key.as_deref() == Some(key))
            .and_then(|e| e.value.clone())
    }
    fn raw_data(&self) -> Option<Bytes> {
        self.raw_data.clone()
    }
    fn int64_data(&self) -> Cow<'_, [i64]> {
        Cow::Borrowed(&self.int64_data)
    }
    fn int32_data(&self) -> Cow<'_, [i32]> {
        Cow::Borrowed(&self.int32_data)
    }
    fn uint64_data(&self) -> Cow<'_, [u64]> {
        Cow::Borrowed(&self.uint64_data)
    }
    fn float_data(&self) -> Cow<'_, [f32]> {
        Cow::Borrowed(&self.float_data)
    }
    fn double_data(&self) -> Cow<'_, [f64]> {
        Cow::Borrowed(&self.double_data)
    }
}

impl InfoSrc for proto::ValueInfoProto {
    fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }
    fn metadata(&self, key: &str) -> Option<&str> {
        self.metadata_props
            .iter()
            .find(|p| p.key() == key)
            .map(|p| p.value())
    }
    fn unmodelled(&self) -> Option<&'static str> {
        use proto::type_proto::Value as V;
        match self.r#type.as_ref().and_then(|t| t.value.as_ref())? {
            V::TensorType(tt) => tensor_unmodelled(tt.elem_type),
            V::SequenceType(_) => Some("a sequence"),
            V::MapType(_) => Some("a map"),
            V::OptionalType(_) => Some("an optional"),
            V::SparseTensorType(_) => Some("a sparse tensor"),
            _ => Some("of an unknown type"),
        }
    }
    fn decl_type(&self) -> (Option<DType>, Option<Vec<DimDecl>>) {
        use proto::tensor_shape_proto::dimension::Value as D;
        let Some(proto::type_proto::Value::TensorType(tt)) =
            self.r#type.as_ref().and_then(|t| t.value.as_ref())
        else {
            return (None, None);
        };
        let dtype = tt.elem_type.and_then(DType::from_onnx);
        let shape = tt.shape.as_ref().map(|s| {
            s.dim
                .iter()
                .map(|d| match &d.value {
                    Some(D::DimValue(v)) => dim_decl(Some(Ok(*v))),
                    Some(D::DimParam(p)) => dim_decl(Some(Err(p))),
                    None => dim_decl(None),
                })
                .collect()
        });
        (dtype, shape)
    }
}

/// A tensor type memplan does not model, by its element type.
pub(crate) fn tensor_unmodelled(elem_type: Option<i32>) -> Option<&'static str> {
    (elem_type == Some(8)).then_some("a string tensor")
}

/// A declared dimension from a `Dimension`'s value: `dim_value` (`Ok`) or
/// `dim_param` (`Err`); an empty `dim_param` is unknown.
pub(crate) fn dim_decl(value: Option<Result<i64, &str>>) -> DimDecl {
    match value {
        Some(Ok(v)) => DimDecl::Fixed(v),
        Some(Err(p)) if !p.is_empty() => DimDecl::Named(p.to_string()),
        _ => DimDecl::Unknown,
    }
}
