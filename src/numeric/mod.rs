//! Tensor values and the numeric machinery that op kernels (`ops`) and the
//! executors (`exec`) share: [`Tensor`] (contiguous, row-major, typed), [`gemm`]
//! (matrixmultiply + rayon), [`broadcast`] (numpy broadcasting), [`grad`]
//! (gradients summed back over broadcast axes), [`rng`] (SplitMix64).
//!
//! A leaf of the library: it uses only `ir` (element types, initializer data), so
//! that `ops` and `exec` both depend on it and never on each other's internals.

pub mod broadcast;
pub mod gemm;
pub mod grad;
pub mod rng;
pub mod tensor;

pub use tensor::{Elems, Tensor};

/// Result of a rule or kernel: a message that the caller attaches the node name to.
pub type RuleResult<T> = std::result::Result<T, String>;
