//! Reading ONNX files.
//!
//! [`proto`] is generated once by `tools/protogen` from ONNX 1.23's `onnx.proto`
//! (IR version 14, opset 28) and committed. Every `bytes` field is a
//! [`bytes::Bytes`], and [`load`] decodes from a `Bytes` that owns a memory map,
//! so weight payloads are slices of the mapped file and are never copied.

pub mod load;
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto;
mod source;
mod wire;

pub use load::{decode_model, load_model, map_file};

/// The ONNX domain of the loss, backward and optimizer nodes of a rewritten training
/// step (`memplan plan --rewrite`, written and read by `rewrite`;
/// docs/PLAN_FORMAT.md).
pub const REWRITE_DOMAIN: &str = "ai.memplan";
/// The opset version of [`REWRITE_DOMAIN`] written and read.
pub const REWRITE_DOMAIN_VERSION: i64 = 1;

/// Whether a loaded model is a rewritten training step (imports [`REWRITE_DOMAIN`]).
pub fn is_rewrite(model: &crate::ir::Model) -> bool {
    model.opsets.contains_key(REWRITE_DOMAIN)
}
