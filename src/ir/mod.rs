//! memplan's intermediate representation: dtypes, attributes, the tensor table,
//! the op graph, and folded constant values.

pub mod attr;
pub mod dtype;
pub mod graph;
pub mod name;
pub mod scope;
pub mod tensor;
pub mod value;

pub use attr::{Attr, Attrs};
pub use dtype::DType;
pub use graph::{Edge, Graph, Inputs, Model, Name, NameHash, NameIndex, Node, Outputs, Slots};
pub use scope::{module_path, parameter_name};
pub use tensor::{DimDecl, Payload, TensorData, TensorId, TensorInfo, TensorKind};
pub use value::{Data, Value};
