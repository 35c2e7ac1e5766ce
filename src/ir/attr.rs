//! Typed node attributes.

use std::collections::BTreeMap;

use super::tensor::TensorData;

/// One attribute value, typed as ONNX declares it.
#[derive(Debug, Clone)]
pub enum Attr {
    /// `INT`.
    Int(i64),
    /// `FLOAT`.
    Float(f32),
    /// `STRING` (decoded as UTF-8, lossily).
    String(String),
    /// `INTS`.
    Ints(Vec<i64>),
    /// `FLOATS`.
    Floats(Vec<f32>),
    /// `STRINGS`.
    Strings(Vec<String>),
    /// `TENSOR` (e.g. Constant's `value`); boxed, so that the other kinds (and the
    /// map of every node's attributes) stay small.
    Tensor(Box<TensorData>),
    /// `GRAPH`: a subgraph (If's branches, Loop's and Scan's body), kept as its
    /// protobuf encoding (a `GraphProto`); `crate::lower` decodes and inlines it
    /// once shapes are known.
    Graph(bytes::Bytes),
    /// Other kinds memplan does not interpret (`GRAPHS`, sparse tensors...); the
    /// string names the kind.
    Other(&'static str),
}

/// A node's attributes by name.
#[derive(Debug, Clone, Default)]
pub struct Attrs(pub BTreeMap<String, Attr>);

impl Attrs {
    /// Integer attribute, if present with that type.
    pub fn int(&self, name: &str) -> Option<i64> {
        match self.0.get(name)? {
            Attr::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// Integer attribute or a default.
    pub fn int_or(&self, name: &str, default: i64) -> i64 {
        self.int(name).unwrap_or(default)
    }

    /// Float attribute, if present.
    pub fn float(&self, name: &str) -> Option<f32> {
        match self.0.get(name)? {
            Attr::Float(f) => Some(*f),
            _ => None,
        }
    }

    /// Integer list attribute, if present.
    pub fn ints(&self, name: &str) -> Option<&[i64]> {
        match self.0.get(name)? {
            Attr::Ints(v) => Some(v),
            _ => None,
        }
    }

    /// Float list attribute, if present.
    pub fn floats(&self, name: &str) -> Option<&[f32]> {
        match self.0.get(name)? {
            Attr::Floats(v) => Some(v),
            _ => None,
        }
    }

    /// String attribute, if present.
    pub fn string(&self, name: &str) -> Option<&str> {
        match self.0.get(name)? {
            Attr::String(s) => Some(s),
            _ => None,
        }
    }

    /// Subgraph attribute, if present.
    pub fn graph(&self, name: &str) -> Option<&bytes::Bytes> {
        match self.0.get(name)? {
            Attr::Graph(g) => Some(g),
            _ => None,
        }
    }

    /// Tensor attribute, if present.
    pub fn tensor(&self, name: &str) -> Option<&TensorData> {
        match self.0.get(name)? {
            Attr::Tensor(t) => Some(&**t),
            _ => None,
        }
    }

    /// True when an attribute with this name exists (any type).
    pub fn has(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
}
