//! The library's error type. Every failure a user can cause (a bad file, an
//! unsupported op, an impossible shape) is one of these, with the file, node or
//! tensor named, and prints as one line. The file path is kept in the variants that
//! have one but not printed: callers (the CLI) prefix every message with the path.

use std::path::PathBuf;

use crate::numeric::RuleError;

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while loading, inferring or profiling a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file could not be opened or mapped.
    #[error("cannot read: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// An output file could not be written.
    #[error("cannot write {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The bytes are not a protobuf-encoded ONNX model (truncated, corrupt, or another format).
    #[error("not a valid ONNX model: {reason}")]
    NotOnnx {
        /// The file.
        path: PathBuf,
        /// What the decoder or the structural check found.
        reason: String,
    },
    /// A `--dag` file is not a rematerialization benchmark graph (bad JSON, a
    /// missing field, a link to an unknown node or against the order).
    #[error("not a rematerialization DAG: {reason}")]
    NotDag {
        /// The file.
        path: PathBuf,
        /// What the reader found.
        reason: String,
    },
    /// The model decodes but its graph is malformed (undefined tensor, duplicate producer, cycle...).
    #[error("invalid graph: {0}")]
    Graph(String),
    /// A graph input or output of a type memplan does not model: strings, sequences,
    /// maps, optionals, sparse tensors (`kind` names it: "a string tensor", "a sequence").
    #[error("graph {role} '{tensor}' is {kind}: memplan models numeric tensors only (not strings, sequences, maps or optionals)")]
    UnsupportedType {
        /// "input" or "output".
        role: &'static str,
        /// The tensor's name.
        tensor: String,
        /// What it is.
        kind: &'static str,
    },
    /// Ops the tool has no rule for; one entry per op type with one node using it.
    #[error("unsupported ops: {}", .0.iter().map(|(op, node)| format!("{op} (node '{node}')")).collect::<Vec<_>>().join(", "))]
    Unsupported(Vec<(String, String)>),
    /// A node's shape rule or kernel failed: the rule's typed error, with the node.
    #[error("node '{node}' ({op}): {source}")]
    Rule {
        /// Node name (or a generated `op_type#index` when the model gave none).
        node: String,
        /// ONNX op type.
        op: String,
        /// What the rule found.
        source: RuleError,
    },
    /// The GPU backend failed (no driver or GPU, a kernel that did not compile, a
    /// device kernel that refused its inputs).
    #[error("{0}")]
    Cuda(#[from] CudaError),
    /// One step of a training step failed (on the CPU or the device).
    #[error("step '{step}': {source}")]
    Step {
        /// The step's name.
        step: String,
        /// What failed.
        source: Box<Error>,
    },
    /// A tensor operation outside any node's rule failed (a cast, a reshape).
    #[error("{0}")]
    Numeric(#[from] RuleError),
    /// The executor cannot run what it was given, or found its own state
    /// inconsistent (a value missing, a recomputation that differs).
    #[error("{0}")]
    Exec(String),
    /// A node's shape or type rule failed.
    #[error("node '{node}' ({op}): {reason}")]
    Node {
        /// Node name (or a generated `op_type#index` when the model gave none).
        node: String,
        /// ONNX op type.
        op: String,
        /// What is wrong.
        reason: String,
    },
    /// A symbolic dimension of a graph input has no value.
    #[error("dimension '{dim}' of input '{input}' is unbound: {}", unbound_hint(.hint))]
    UnboundDim {
        /// The dim_param (or a description for an anonymous dim).
        dim: String,
        /// The graph input that carries it.
        input: String,
        /// The setting that gives it a value (`None`: only the model can, an
        /// anonymous dimension past the first).
        hint: Option<Setting>,
    },
    /// A setting's value that the model contradicts or that is out of range; the
    /// message names the setting in words, a front end may add its own name for it.
    #[error("{reason}")]
    Setting {
        /// The setting.
        setting: Setting,
        /// What is wrong with it.
        reason: String,
    },
    /// A dimension binding from the user contradicts the model.
    #[error("{0}")]
    Binding(String),
    /// A measured-costs file (`plan --costs`) that does not fit the graph.
    #[error("invalid costs: {0}")]
    Costs(String),
    /// A training step written by `plan --rewrite`: where a model is expected, or one
    /// that cannot be read back.
    #[error("memplan rewrite: {0}")]
    Rewrite(String),
    /// A plan.json that cannot be read, or that does not fit the step it is used for.
    #[error("{0}")]
    Plan(String),
}

impl From<String> for Error {
    fn from(s: String) -> Error {
        Error::Exec(s)
    }
}

impl From<&str> for Error {
    fn from(s: &str) -> Error {
        Error::Exec(s.to_string())
    }
}

/// A setting of a run, which a front end names its own way (the CLI: its flags;
/// the library's messages name none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Setting {
    /// The batch size.
    Batch,
    /// The value of one named input dimension.
    Dim(String),
    /// The device memory `fit` fits into.
    Memory,
    /// The memory a `verify` run may use.
    MaxMemory,
    /// The loss reduction of a training step.
    Loss,
    /// The pattern of parameters to freeze.
    Freeze,
    /// The pattern of parameters that train.
    Trainable,
    /// How frozen parameters are stored.
    WeightDtype,
    /// How many tokens each expert of a mixture-of-experts layer receives.
    MoeRouting,
}

impl std::fmt::Display for Setting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Setting::Batch => write!(f, "the batch size"),
            Setting::Dim(d) => write!(f, "a value for dimension '{d}'"),
            Setting::Memory => write!(f, "the device memory"),
            Setting::MaxMemory => write!(f, "the memory limit"),
            Setting::Loss => write!(f, "the loss"),
            Setting::Freeze => write!(f, "the parameters to freeze"),
            Setting::Trainable => write!(f, "the parameters that train"),
            Setting::WeightDtype => write!(f, "the frozen parameters' storage type"),
            Setting::MoeRouting => write!(f, "the mixture-of-experts routing assumption"),
        }
    }
}

fn unbound_hint(hint: &Option<Setting>) -> String {
    match hint {
        Some(s) => format!("set {s}"),
        None => "only a model with that dimension named or fixed can be profiled".into(),
    }
}

impl Error {
    /// Builds a [`Error::Setting`].
    pub fn setting(setting: Setting, reason: impl Into<String>) -> Self {
        Error::Setting {
            setting,
            reason: reason.into(),
        }
    }

    /// The setting an error is about, if any (for a front end's hint).
    pub fn about(&self) -> Option<&Setting> {
        match self {
            Error::Setting { setting, .. } => Some(setting),
            Error::UnboundDim { hint, .. } => hint.as_ref(),
            _ => None,
        }
    }

    /// Builds a [`Error::Rule`]: `source` at node `node` of type `op`.
    pub fn rule(node: &str, op: &str, source: RuleError) -> Self {
        Error::Rule {
            node: node.to_string(),
            op: op.to_string(),
            source,
        }
    }

    /// Wraps `source` as the failure of step `step` ([`Error::Step`]).
    pub fn step(step: &str, source: Error) -> Self {
        Error::Step {
            step: step.to_string(),
            source: Box::new(source),
        }
    }

    /// Builds a [`Error::Node`].
    pub fn node(node: &str, op: &str, reason: impl Into<String>) -> Self {
        Error::Node {
            node: node.to_string(),
            op: op.to_string(),
            reason: reason.into(),
        }
    }
}

/// An error of the GPU backend, one line (NVRTC logs excepted).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CudaError {
    /// A CUDA library cannot be loaded (no driver, no toolkit, no GPU).
    #[error("{0}")]
    Unavailable(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// A kernel source did not compile.
    #[error("NVRTC could not compile kernels/{file}:\n{log}")]
    Compile {
        /// The kernels/ file.
        file: &'static str,
        /// NVRTC's log.
        log: String,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Blas(String),
    /// An op's device kernel rejected its inputs or is missing.
    #[error("{0}")]
    Kernel(String),
    /// An op's rule or CPU kernel failed (the host fallback, shared rule helpers).
    #[error("{0}")]
    Rule(#[from] RuleError),
}

impl From<String> for CudaError {
    fn from(e: String) -> CudaError {
        CudaError::Kernel(e)
    }
}
