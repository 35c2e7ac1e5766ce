//! Typed node attributes.

use std::fmt;

use super::graph::Name;
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
    /// protobuf encoding (a `GraphProto`); lowering (src/infer/lower) decodes and inlines it
    /// once shapes are known.
    Graph(bytes::Bytes),
    /// Other kinds memplan does not interpret (`GRAPHS`, sparse tensors...); the
    /// string names the kind.
    Other(&'static str),
}

/// A node's attributes by name: a small vector sorted by name, one entry per name
/// (nodes have a handful, so one allocation and a scan beat a tree map).
#[derive(Clone, Default)]
pub struct Attrs(Vec<(Name, Attr)>);

impl fmt::Debug for Attrs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<K: Into<Name>> FromIterator<(K, Attr)> for Attrs {
    /// Later entries replace earlier ones with the same name, as a map's `collect`.
    fn from_iter<I: IntoIterator<Item = (K, Attr)>>(iter: I) -> Attrs {
        let mut out = Attrs::default();
        for (k, v) in iter {
            out.insert(k, v);
        }
        out
    }
}

impl<K: Into<Name>, const N: usize> From<[(K, Attr); N]> for Attrs {
    fn from(entries: [(K, Attr); N]) -> Attrs {
        entries.into_iter().collect()
    }
}

impl Attrs {
    /// An empty set with room for `n` attributes.
    pub fn with_capacity(n: usize) -> Attrs {
        Attrs(Vec::with_capacity(n))
    }

    /// Number of attributes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The attribute with this name, of any type.
    pub fn get(&self, name: &str) -> Option<&Attr> {
        self.0.iter().find(|(k, _)| &**k == name).map(|(_, v)| v)
    }

    /// Sets an attribute; returns the value it replaces, if any.
    pub fn insert(&mut self, name: impl Into<Name>, value: Attr) -> Option<Attr> {
        let name = name.into();
        // Exporters write attributes sorted by name: then it goes last.
        if self.0.last().is_none_or(|(k, _)| **k < *name) {
            self.0.push((name, value));
            return None;
        }
        match self.0.binary_search_by(|(k, _)| (**k).cmp(&*name)) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, value)),
            Err(i) => {
                self.0.insert(i, (name, value));
                None
            }
        }
    }

    /// Removes an attribute; returns its value, if it was there.
    pub fn remove(&mut self, name: &str) -> Option<Attr> {
        let i = self.0.iter().position(|(k, _)| &**k == name)?;
        Some(self.0.remove(i).1)
    }

    /// Names and values, sorted by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Attr)> {
        self.0.iter().map(|(k, v)| (&**k, v))
    }

    /// Names, sorted.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(k, _)| &**k)
    }

    /// Values, sorted by name.
    pub fn values(&self) -> impl Iterator<Item = &Attr> {
        self.0.iter().map(|(_, v)| v)
    }

    /// Integer attribute, if present with that type.
    pub fn int(&self, name: &str) -> Option<i64> {
        match self.get(name)? {
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
        match self.get(name)? {
            Attr::Float(f) => Some(*f),
            _ => None,
        }
    }

    /// Integer list attribute, if present.
    pub fn ints(&self, name: &str) -> Option<&[i64]> {
        match self.get(name)? {
            Attr::Ints(v) => Some(v),
            _ => None,
        }
    }

    /// Float list attribute, if present.
    pub fn floats(&self, name: &str) -> Option<&[f32]> {
        match self.get(name)? {
            Attr::Floats(v) => Some(v),
            _ => None,
        }
    }

    /// String attribute, if present.
    pub fn string(&self, name: &str) -> Option<&str> {
        match self.get(name)? {
            Attr::String(s) => Some(s),
            _ => None,
        }
    }

    /// Subgraph attribute, if present.
    pub fn graph(&self, name: &str) -> Option<&bytes::Bytes> {
        match self.get(name)? {
            Attr::Graph(g) => Some(g),
            _ => None,
        }
    }

    /// Tensor attribute, if present.
    pub fn tensor(&self, name: &str) -> Option<&TensorData> {
        match self.get(name)? {
            Attr::Tensor(t) => Some(&**t),
            _ => None,
        }
    }

    /// True when an attribute with this name exists (any type).
    pub fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }
}

/// Defines [`COMMON_ATTR_NAMES`] and [`common_attr_name`] from one list.
macro_rules! common_attr_names {
    ($($n:literal),* $(,)?) => {
        /// The attribute names of the ONNX operators memplan reads most often, as
        /// static strings: loading gives these names a [`Name::from_static`] (no
        /// reference count to take and drop per attribute).
        pub const COMMON_ATTR_NAMES: &[&str] = &[$($n),*];

        /// `s` as a static name when it is one of [`COMMON_ATTR_NAMES`].
        pub fn common_attr_name(s: &str) -> Option<Name> {
            match s {
                $($n => Some(Name::from_static($n)),)*
                _ => None,
            }
        }
    };
}

common_attr_names![
    "allowzero",
    "alpha",
    "auto_pad",
    "axes",
    "axis",
    "batch_dims",
    "beta",
    "ceil_mode",
    "count_include_pad",
    "dilations",
    "direction",
    "dtype",
    "ends",
    "epsilon",
    "exclusive",
    "group",
    "hidden_size",
    "keepdims",
    "kernel_shape",
    "mode",
    "momentum",
    "noop_with_empty_axes",
    "num_outputs",
    "output_padding",
    "pads",
    "perm",
    "ratio",
    "reverse",
    "seed",
    "split",
    "stash_type",
    "starts",
    "strides",
    "to",
    "training_mode",
    "transA",
    "transB",
    "value",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_keeps_names_sorted_and_replaces() {
        let mut a = Attrs::default();
        assert!(a.insert("b", Attr::Int(1)).is_none());
        assert!(a.insert("c", Attr::Int(2)).is_none());
        assert!(a.insert("a", Attr::Int(3)).is_none());
        assert!(matches!(a.insert("c", Attr::Int(4)), Some(Attr::Int(2))));
        let got: Vec<(&str, i64)> = a
            .iter()
            .map(|(k, v)| match v {
                Attr::Int(i) => (k, *i),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(got, [("a", 3), ("b", 1), ("c", 4)]);
    }

    #[test]
    fn common_attr_names_are_distinct_and_found() {
        let mut sorted = COMMON_ATTR_NAMES.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(
            sorted.len(),
            COMMON_ATTR_NAMES.len(),
            "a name is listed twice"
        );
        for &n in COMMON_ATTR_NAMES {
            assert_eq!(common_attr_name(n).as_deref(), Some(n));
        }
        assert!(common_attr_name("axis_").is_none());
    }
}
