//! memplan's intermediate representation: dtypes, attributes, the tensor table,
//! the op graph, and folded constant values.

pub mod attr;
pub mod dtype;
pub mod graph;
pub mod tensor;
pub mod value;

pub use attr::{Attr, Attrs};
pub use dtype::DType;
pub use graph::{Edge, Graph, Model, Node};
pub use tensor::{DimDecl, Payload, TensorData, TensorId, TensorInfo, TensorKind};
pub use value::{Data, Value};
