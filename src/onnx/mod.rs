//! Reading ONNX files.
//!
//! [`proto`] is generated once by `tools/protogen` from ONNX 1.23's `onnx.proto`
//! (IR version 14, opset 28) and committed. Every `bytes` field is a
//! [`bytes::Bytes`], and [`load`] decodes from a `Bytes` that owns a memory map,
//! so weight payloads are slices of the mapped file and are never copied.

pub mod load;
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto;

pub use load::{decode_model, load_model, map_file};
