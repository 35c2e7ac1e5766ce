//! Small constant tensors known at load time: the values that shape-computation
//! subgraphs (Shape → Gather → Concat → Reshape ...) carry. Shape inference folds
//! them so that every Reshape, Expand or Range gets a concrete shape.

/// Largest tensor (in elements) whose value is tracked for folding. Anything larger is
/// real data, not a shape computation.
pub const MAX_FOLD_ELEMS: usize = 1 << 16;

/// Element storage of a folded value. Integers and booleans are `Int`
/// (bools as 0/1), all floating types are `Float`.
#[derive(Debug, Clone, PartialEq)]
pub enum Data {
    /// Integer or boolean elements.
    Int(Vec<i64>),
    /// Floating-point elements.
    Float(Vec<f64>),
}

impl Data {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Data::Int(v) => v.len(),
            Data::Float(v) => v.len(),
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as i64 (floats truncate toward zero, as Cast does).
    pub fn int(&self, i: usize) -> i64 {
        match self {
            Data::Int(v) => v[i],
            Data::Float(v) => v[i] as i64,
        }
    }

    /// Element `i` as f64.
    pub fn float(&self, i: usize) -> f64 {
        match self {
            Data::Int(v) => v[i] as f64,
            Data::Float(v) => v[i],
        }
    }

    /// Picks elements by index, keeping the variant.
    pub fn gather(&self, idx: impl Iterator<Item = usize>) -> Data {
        match self {
            Data::Int(v) => Data::Int(idx.map(|i| v[i]).collect()),
            Data::Float(v) => Data::Float(idx.map(|i| v[i]).collect()),
        }
    }
}

/// A constant tensor value.
#[derive(Debug, Clone, PartialEq)]
pub struct Value {
    /// Shape (empty for a scalar).
    pub shape: Vec<usize>,
    /// Row-major elements; `data.len()` equals the product of `shape`.
    pub data: Data,
}

impl Value {
    /// An integer tensor.
    pub fn ints(shape: Vec<usize>, v: Vec<i64>) -> Value {
        Value {
            shape,
            data: Data::Int(v),
        }
    }

    /// A 1-D integer tensor.
    pub fn vec(v: Vec<i64>) -> Value {
        Value::ints(vec![v.len()], v)
    }

    /// All elements as i64.
    pub fn to_ints(&self) -> Vec<i64> {
        (0..self.data.len()).map(|i| self.data.int(i)).collect()
    }

    /// The single element of a scalar or one-element tensor.
    pub fn scalar_int(&self) -> Option<i64> {
        (self.data.len() == 1).then(|| self.data.int(0))
    }

    /// The single element of a scalar or one-element tensor, as f64.
    pub fn scalar_float(&self) -> Option<f64> {
        (self.data.len() == 1).then(|| self.data.float(0))
    }
}
