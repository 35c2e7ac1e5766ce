//! Tensor values and the numeric machinery that op kernels (`ops`) and the
//! executors (`exec`) share: [`Tensor`] (contiguous, row-major, typed), [`gemm`]
//! (matrixmultiply + rayon), [`broadcast`] (numpy broadcasting), [`grad`]
//! (gradients summed back over broadcast axes), [`rng`] (SplitMix64), [`fft`]
//! (complex transforms of any length, the signal ops').
//!
//! A leaf of the library: it uses only `ir` (element types, initializer data), so
//! that `ops` and `exec` both depend on it and never on each other's internals.

pub mod broadcast;
pub mod fft;
pub mod gemm;
pub mod grad;
pub mod rng;
pub mod tensor;

pub use tensor::{Elems, Tensor};

/// Result of a rule or kernel; the caller attaches the node and op
/// ([`crate::error::Error::Rule`]).
pub type RuleResult<T> = std::result::Result<T, RuleError>;

/// Why a shape rule or a kernel failed, before the caller names the node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    /// A required input is absent.
    #[error("required input {0} is missing")]
    MissingInput(usize),
    /// An output the kernel must produce is not declared.
    #[error("output {0} is not declared")]
    MissingOutput(usize),
    /// The output shape depends on an input's values, which are not known.
    #[error("input {0} must be a constant for its output shape to be known (data-dependent shapes are not supported)")]
    NotConstant(usize),
    /// What the node does depends on input values (an If's condition, a Loop's
    /// trip count): the reason, in words.
    #[error("{0}")]
    ValueDependent(String),
    /// The CPU executor has no kernel for the op (a clear refusal, never a guess).
    #[error("the CPU executor has no kernel for {0} yet")]
    NoKernel(String),
    /// The op has a backward rule but no CPU backward kernel.
    #[error("the CPU executor has no backward kernel for {0} yet")]
    NoBackwardKernel(String),
    /// A backward kernel was asked for the gradient of an op without one.
    #[error("{0} has no gradient")]
    NoGradient(String),
    /// A backward kernel read a tensor its rule does not save (a kernel bug: the
    /// memory model would be wrong).
    #[error("the backward kernel reads {0}, which was not saved for it")]
    NotSaved(String),
    /// Anything else the rule checks (the ONNX spec's requirements), in its words.
    #[error("{0}")]
    Invalid(String),
}

impl From<String> for RuleError {
    fn from(s: String) -> RuleError {
        RuleError::Invalid(s)
    }
}

impl From<&str> for RuleError {
    fn from(s: &str) -> RuleError {
        RuleError::Invalid(s.to_string())
    }
}
