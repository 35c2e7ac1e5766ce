//! The training step as memplan models it: storages (allocations, as PyTorch makes
//! them) and the ordered steps that write, read and free them. Built by
//! [`super::autodiff::build_schedule`]; replayed by `memory::simulate`.

use petgraph::stable_graph::NodeIndex;

use super::fusion::FusedPattern;
use crate::ir::{DType, TensorId};

/// Index of a [`Storage`] in [`Schedule::storages`].
pub type StorageId = usize;

/// What a storage holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StorageKind {
    /// A trainable parameter.
    Parameter,
    /// A floating initializer that receives no gradient (BatchNorm running stats).
    Buffer,
    /// Integer initializers and `Constant` outputs.
    Constant,
    /// A graph input fed by the user (the batch).
    Input,
    /// A forward activation.
    Activation,
    /// A tensor a forward kernel makes only for backward (BN stats, indices, masks).
    Extra,
    /// A reduced-precision copy (autocast casts of activations and cached weights).
    Cast,
    /// A contiguous copy of a strided input that an op's PyTorch kernel makes and its
    /// backward saves in the input's place (`torch.matmul` reshaping a transposed or
    /// expanded operand for `bmm`), maybe of the expanded size.
    Copy,
    /// The scalar loss.
    Loss,
    /// The gradient of an activation.
    ActivationGrad,
    /// The gradient of a parameter (`.grad`).
    ParamGrad,
    /// A partial gradient added into an existing gradient, freed at once.
    GradTemp,
    /// Optimizer state (momentum, Adam moments).
    OptimizerState,
    /// Temporaries of the optimizer update.
    OptimizerTemp,
}

/// One allocation.
#[derive(Debug, Clone)]
pub struct Storage {
    /// Name (the tensor it was first made for).
    pub name: String,
    /// Bytes.
    pub bytes: u64,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
    /// What it holds.
    pub kind: StorageKind,
    /// Allocated before the step and kept after it (parameters, buffers, optimizer
    /// state, the input batch; gradients under accumulation).
    pub persistent: bool,
    /// Kept until the end of the step once made (the model outputs and the loss, held
    /// by the training loop; parameter gradients, read by the optimizer).
    pub held: bool,
    /// Read by some backward step: a saved activation.
    pub saved: bool,
    /// The tensors PyTorch allocates for this storage, in order, when it is not one
    /// tensor (optimizer state: each state tensor of each parameter; foreach
    /// temporaries: one per parameter); empty: one allocation of `bytes`. Used only
    /// while they add up to `bytes` (a partitioned storage is one flat buffer).
    pub pieces: Vec<u64>,
}

impl Storage {
    /// The allocations PyTorch makes for this storage ([`Storage::pieces`] when they
    /// add up to `bytes`, else `bytes` at once).
    pub fn allocations(&self) -> &[u64] {
        let sum = self.pieces.iter().fold(0u64, |a, &b| a.saturating_add(b));
        if !self.pieces.is_empty() && sum == self.bytes {
            &self.pieces
        } else {
            std::slice::from_ref(&self.bytes)
        }
    }
}

/// Phase of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    /// A forward op.
    Forward,
    /// The loss.
    Loss,
    /// A backward op (or the loss's backward).
    Backward,
    /// The optimizer update.
    Optimizer,
}

/// One step of the schedule.
#[derive(Debug, Clone)]
pub struct Step {
    /// Node name (backward steps: `<node>/grad`).
    pub name: String,
    /// Op type.
    pub op: String,
    /// Phase.
    pub kind: StepKind,
    /// The forward node it comes from.
    pub node: Option<NodeIndex>,
    /// Storages read.
    pub reads: Vec<StorageId>,
    /// Storages allocated by this step.
    pub writes: Vec<StorageId>,
    /// Live storages updated in place (gradient accumulation).
    pub updates: Vec<StorageId>,
    /// Backward steps of a forward node: that node's input slots whose gradient this
    /// step produces (written, accumulated, or a view of the incoming gradient).
    /// Empty for every other step.
    pub grad_inputs: Vec<usize>,
    /// Forward steps: the storage each input slot of the node is read from (`None`
    /// for an omitted input): the input's own storage, or the autocast copy it is
    /// read through (a [`StorageKind::Cast`] storage, which this step writes unless
    /// it is a cached weight cast made by an earlier step). Empty for other steps.
    pub slots: Vec<Option<StorageId>>,
    /// FLOPs.
    pub flops: u64,
    /// Forward steps: the node is part of a fused pattern (`super::fusion`), which
    /// PyTorch runs inside one kernel rather than as its own op.
    pub fused: bool,
}

impl Step {
    /// A step of `kind` that reads `reads` and writes `writes`; the rest (its node,
    /// updates, gradient slots, input slots, fusion) empty, for the caller to set.
    pub fn new(
        name: impl Into<String>,
        op: impl Into<String>,
        kind: StepKind,
        reads: Vec<StorageId>,
        writes: Vec<StorageId>,
        flops: u64,
    ) -> Step {
        Step {
            name: name.into(),
            op: op.into(),
            kind,
            node: None,
            reads,
            writes,
            updates: Vec::new(),
            grad_inputs: Vec::new(),
            slots: Vec::new(),
            flops,
            fused: false,
        }
    }
}

/// The training step: storages and ordered steps.
#[derive(Debug, Clone)]
pub struct Schedule {
    /// Every allocation.
    pub storages: Vec<Storage>,
    /// Forward, loss, backward, optimizer.
    pub steps: Vec<Step>,
    /// Storage of each forward tensor (views share their base's).
    pub tensor_storage: Vec<StorageId>,
    /// Trainable parameters (forward tensor ids).
    pub trainable: Vec<TensorId>,
    /// Parameters that receive a gradient from this loss.
    pub with_grad: Vec<TensorId>,
    /// The fused patterns recognised in the model ([`fused_patterns`]), as the
    /// schedule models them.
    pub fused: Vec<FusedPattern>,
    /// Reads of a fused pattern that its backward takes from an autocast copy
    /// rather than from the tensor's own storage: (the pattern's last node, the
    /// tensor, the float32 copy). Under AMP, `native_group_norm` saves the float32
    /// copy of a half input.
    pub fused_copies: Vec<(NodeIndex, TensorId, StorageId)>,
}

impl Schedule {
    /// Adds a storage of `bytes` and `kind` (typed as the first storage; not
    /// persistent, held or saved; one allocation) that the caller's steps write and
    /// read; returns its id.
    pub fn add_storage(&mut self, name: String, bytes: u64, kind: StorageKind) -> StorageId {
        let dtype = self.storages.first().map_or(DType::F32, |s| s.dtype);
        self.storages.push(Storage {
            name,
            bytes,
            dtype,
            shape: Vec::new(),
            kind,
            persistent: false,
            held: false,
            saved: false,
            pieces: Vec::new(),
        });
        self.storages.len() - 1
    }

    /// Sum of bytes of the storages matching `f`.
    pub fn bytes_where(&self, f: impl Fn(&Storage) -> bool) -> u64 {
        self.storages.iter().filter(|s| f(s)).map(|s| s.bytes).sum()
    }

    /// Bytes of the distinct non-parameter storages that backward reads, as they stand
    /// when the forward pass ends (model inputs included).
    pub fn saved_activation_bytes(&self) -> u64 {
        self.bytes_where(|s| {
            s.saved
                && !matches!(
                    s.kind,
                    StorageKind::Parameter | StorageKind::Buffer | StorageKind::Constant
                )
        })
    }

    /// The autocast copy the backward of the fused pattern ending at `last` reads
    /// in place of tensor `t` ([`Self::fused_copies`]).
    pub fn fused_copy(&self, last: NodeIndex, t: TensorId) -> Option<StorageId> {
        self.fused_copies
            .iter()
            .find(|&&(n, x, _)| n == last && x == t)
            .map(|&(_, _, c)| c)
    }

    /// FLOPs of the whole step.
    pub fn flops(&self) -> u64 {
        self.steps
            .iter()
            .fold(0u64, |a, s| a.saturating_add(s.flops))
    }
}
