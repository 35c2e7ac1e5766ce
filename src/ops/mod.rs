//! Op rules: for every supported ONNX op, its arity, shape/type rule (with constant
//! folding of small integer tensors), FLOP count, backward rule, storage behaviour
//! and CPU kernels (forward, and backward reading only what the backward rule
//! saves), in one [`Op`] impl.
//!
//! Ops are grouped by family, one file each; every family registers its ops in
//! [`registry`] through its `register` function. See docs/ADDING_AN_OP.md.
//!
//! FLOP convention: a multiply-add counts 2; every other arithmetic or
//! transcendental element operation counts 1; pure data movement (reshape, copy,
//! gather, concat, cast) counts 0. Each op documents its own count.

use std::collections::HashMap;
use std::sync::OnceLock;

use crate::ir::{Attrs, DType, Node, Value};
use crate::numeric::Tensor;

/// The methods every op with shape rules only shares: a new tensor, no CPU
/// forward kernel (it says so), `$backward` ([`no_gradient`] or
/// [`no_backward_kernel`]) as its CPU backward, and no device kernels.
macro_rules! shape_only {
    ($backward:ident) => {
        fn storage(&self, _cx: &$crate::ops::Cx) -> $crate::ops::Storage {
            $crate::ops::Storage::New
        }
        fn forward_cpu(
            &self,
            cx: &$crate::ops::KernelCx,
        ) -> $crate::ops::RuleResult<Vec<$crate::numeric::Tensor>> {
            $crate::ops::no_kernel(cx)
        }
        fn backward_cpu(
            &self,
            cx: &$crate::ops::BackwardCx,
        ) -> $crate::ops::RuleResult<Vec<Option<$crate::numeric::Tensor>>> {
            $crate::ops::$backward(cx)
        }
        /// No CPU kernel to run on the host yet, no device kernels.
        fn cuda_kernels(&self, _op_type: &str) -> $crate::ops::CudaKernels {
            $crate::ops::CudaKernels::HOST
        }
    };
}

/// The methods every op that makes values without a gradient shares (constants,
/// shape values, random numbers): no backward rule, a new tensor, [`no_gradient`]
/// as its CPU backward, host kernels only, and promoted under autocast.
macro_rules! no_gradient_source {
    () => {
        /// Constant, shape-valued or random: no gradient.
        fn backward(
            &self,
            _cx: &$crate::ops::Cx,
            _out: &[$crate::ops::Fact],
        ) -> $crate::ops::RuleResult<Option<$crate::ops::Backward>> {
            Ok(None)
        }
        fn storage(&self, _cx: &$crate::ops::Cx) -> $crate::ops::Storage {
            $crate::ops::Storage::New
        }
        /// No gradient flows through it.
        fn backward_cpu(
            &self,
            cx: &$crate::ops::BackwardCx,
        ) -> $crate::ops::RuleResult<Vec<Option<$crate::numeric::Tensor>>> {
            $crate::ops::no_gradient(cx)
        }
        /// Runs on the host on the GPU backend (no device kernels yet).
        fn cuda_kernels(&self, _op_type: &str) -> $crate::ops::CudaKernels {
            $crate::ops::CudaKernels::HOST
        }
        fn autocast(&self, _op_type: &str) -> $crate::ops::Autocast {
            $crate::ops::Autocast::Promote
        }
    };
}

pub mod attention;
pub mod conv;
pub mod conv_transpose;
pub mod einsum;
pub mod elementwise;
pub mod gather_nd;
pub mod grid_sample;
pub mod layout;
pub mod linalg;
pub mod local_norm;
pub mod loss;
pub mod norm;
pub mod quantize;
pub mod random;
pub mod reduce;
pub mod resize;
pub mod rnn;
pub mod rotary;
pub mod shape;
pub mod signal;
pub mod spatial;
pub mod text;

/// What shape inference knows about one tensor: type, concrete shape, and its value
/// when it is a small constant (shape computations).
#[derive(Debug, Clone, PartialEq)]
pub struct Fact {
    /// Element type.
    pub dtype: DType,
    /// Concrete shape.
    pub shape: Vec<usize>,
    /// Folded value, when known and small; boxed, so that a fact without one (most
    /// of them) stays small.
    pub value: Option<Box<Value>>,
}

impl Fact {
    /// A fact without a value.
    pub fn new(dtype: DType, shape: Vec<usize>) -> Fact {
        Fact {
            dtype,
            shape,
            value: None,
        }
    }

    /// A fact carrying a value (shape taken from it).
    pub fn with_value(dtype: DType, value: Value) -> Fact {
        Fact {
            dtype,
            shape: value.shape.clone(),
            value: Some(Box::new(value)),
        }
    }

    /// Element count, saturating (overflow is rejected when sizes are computed).
    pub fn numel(&self) -> u64 {
        numel(&self.shape)
    }

    /// Rank.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Bytes of storage, `None` on overflow.
    pub fn bytes(&self) -> Option<u64> {
        let n = self
            .shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d as u64))?;
        self.dtype.bytes_for(n)
    }
}

/// Element count of a shape, saturating at `u64::MAX`.
pub fn numel(shape: &[usize]) -> u64 {
    shape.iter().fold(1u64, |a, &d| a.saturating_mul(d as u64))
}

/// Allowed input and output counts of an op (inclusive bounds).
#[derive(Debug, Clone, Copy)]
pub struct Arity {
    /// Minimum number of inputs.
    pub min_in: usize,
    /// Maximum number of inputs.
    pub max_in: usize,
    /// Minimum number of outputs.
    pub min_out: usize,
    /// Maximum number of outputs.
    pub max_out: usize,
}

impl Arity {
    /// `ins` inputs (a range), `outs` outputs (a range).
    pub const fn new(min_in: usize, max_in: usize, min_out: usize, max_out: usize) -> Arity {
        Arity {
            min_in,
            max_in,
            min_out,
            max_out,
        }
    }
}

/// Everything a rule sees of one node: attributes, input facts, the opset.
pub struct Cx<'a> {
    /// The node.
    pub node: &'a Node,
    /// Input facts in order; `None` for omitted optional inputs (inline up to four:
    /// no allocation per node).
    pub inputs: CxInputs<'a>,
    /// Version of the default ONNX domain.
    pub opset: i64,
}

pub use crate::numeric::{RuleError, RuleResult};

/// [`Cx::inputs`].
pub type CxInputs<'a> = smallvec::SmallVec<[Option<&'a Fact>; 4]>;

impl<'a> Cx<'a> {
    /// The node's attributes.
    pub fn attrs(&self) -> &Attrs {
        &self.node.attrs
    }

    /// Required input `i`.
    pub fn input(&self, i: usize) -> RuleResult<&'a Fact> {
        self.inputs
            .get(i)
            .copied()
            .flatten()
            .ok_or(RuleError::MissingInput(i))
    }

    /// Optional input `i`.
    pub fn opt(&self, i: usize) -> Option<&'a Fact> {
        self.inputs.get(i).copied().flatten()
    }

    /// The constant value of input `i`, required for the shape to be known.
    pub fn value(&self, i: usize) -> RuleResult<&'a Value> {
        self.input(i)?
            .value
            .as_deref()
            .ok_or(RuleError::NotConstant(i))
    }

    /// A constant list of sizes (non-negative dimensions) at input `i`.
    pub fn sizes(&self, i: usize, what: &str) -> RuleResult<Vec<usize>> {
        self.value(i)?
            .to_ints()
            .into_iter()
            .map(|v| dim(v, what))
            .collect()
    }

    /// Optional constant integer list at input `i` (absent → `None`).
    pub fn opt_ints(&self, i: usize) -> RuleResult<Option<Vec<i64>>> {
        match self.opt(i) {
            None => Ok(None),
            Some(_) => Ok(Some(self.value(i)?.to_ints())),
        }
    }

    /// Number of outputs the node declares.
    pub fn n_outputs(&self) -> usize {
        self.node.outputs.len()
    }

    /// Whether output `i` is present (declared and not omitted).
    pub fn has_output(&self, i: usize) -> bool {
        matches!(self.node.outputs.get(i), Some(Some(_)))
    }
}

/// A forward tensor that an op's backward reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Saved {
    /// Forward input `i`.
    Input(usize),
    /// Forward output `i`.
    Output(usize),
    /// Extra tensor `i` of [`Backward::extras`], made by the forward kernel only for
    /// backward (BatchNorm's batch mean and inverse std, MaxPool's indices, Dropout's mask).
    Extra(usize),
}

/// Gradient of one input and what computing it reads.
#[derive(Debug, Clone, PartialEq)]
pub struct Grad {
    /// Input slot that receives the gradient (when it requires one).
    pub input: usize,
    /// Forward tensors needed for it.
    pub needs: Vec<Saved>,
}

/// An op's backward rule, as PyTorch's autograd runs it on CUDA: a tensor is saved
/// only when a gradient that needs it is required (autograd's rule too).
#[derive(Debug, Clone, PartialEq)]
pub struct Backward {
    /// Differentiable inputs and what each gradient reads.
    pub grads: Vec<Grad>,
    /// Tensors the forward kernel makes only for backward.
    pub extras: Vec<Fact>,
    /// FLOPs of the backward, for all gradients required (estimates documented per op).
    pub flops: u64,
}

impl Backward {
    /// Gradients for `inputs`, each needing `needs`; no extras.
    pub fn each(inputs: &[usize], needs: &[Saved], flops: u64) -> Backward {
        Backward {
            grads: inputs
                .iter()
                .map(|&input| Grad {
                    input,
                    needs: needs.to_vec(),
                })
                .collect(),
            extras: Vec::new(),
            flops,
        }
    }
}

/// The layout of an element-wise op's output ([`Op::out_strides`]).
pub fn elementwise_strides(cx: &Cx, out: &Fact, strides: &[Option<&[usize]>]) -> Vec<usize> {
    let ins: Vec<(&[usize], Option<&[usize]>)> = cx
        .inputs
        .iter()
        .zip(strides)
        .filter_map(|(f, st)| f.map(|f| (f.shape.as_slice(), *st)))
        .collect();
    layout::elementwise(&out.shape, &ins)
}

/// The rules every supported op must give. No defaults (an op cannot be half-written),
/// except the layout facts that only view ops, element-wise ops and the matrix
/// products have ([`Op::view_strides`], [`Op::out_strides`], [`Op::saved_copies`]).
pub trait Op: Send + Sync {
    /// Input/output counts accepted.
    fn arity(&self) -> Arity;
    /// Output facts (one per declared output, omitted ones included) from input facts.
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>>;
    /// Floating-point operations of one execution, given inputs and inferred outputs.
    fn flops(&self, cx: &Cx, outputs: &[Fact]) -> u64;
    /// The backward rule. `Ok(None)`: no gradient flows through (integer, comparison
    /// and shape-only results). `Err`: PyTorch differentiates it but memplan has no rule.
    fn backward(&self, cx: &Cx, outputs: &[Fact]) -> RuleResult<Option<Backward>>;
    /// How the output relates to input 0's storage in PyTorch: most ops write a new
    /// tensor; view ops (reshape, transpose, slice...) alias their input.
    fn storage(&self, cx: &Cx) -> Storage;
    /// A view op's output `k` (of fact `out`) as strides over input 0's storage, given
    /// input 0's strides ([`layout`]); `None` where it is no view under them (a
    /// reshape that copies). Read only where [`Op::storage`] is not
    /// [`Storage::New`]. Default: an output of input 0's shape keeps its strides.
    fn view_strides(&self, cx: &Cx, k: usize, out: &Fact, strides: &[usize]) -> Option<Vec<usize>> {
        let _ = k;
        cx.inputs
            .first()
            .copied()
            .flatten()
            .filter(|x| x.shape == out.shape)
            .map(|_| strides.to_vec())
    }
    /// The strides of new output `k` (of fact `out`), given each input's strides
    /// (`None`: omitted or unknown). Default: contiguous; element-wise ops follow
    /// their inputs' layout ([`layout::elementwise`]).
    fn out_strides(
        &self,
        cx: &Cx,
        k: usize,
        out: &Fact,
        strides: &[Option<&[usize]>],
    ) -> Vec<usize> {
        let _ = (cx, k, strides);
        layout::contiguous(&out.shape)
    }
    /// Input slots that PyTorch's kernel copies into fresh contiguous memory before
    /// its backward saves them (then the copy, not the input, is what is saved), with
    /// the copy's shape: `torch.matmul` reshaping a strided operand for `bmm`.
    /// `strides`: each input's strides (`None`: omitted, or a layout memplan does not
    /// follow); `requires`: whether each input requires grad. Default: none.
    fn saved_copies(
        &self,
        cx: &Cx,
        strides: &[Option<&[usize]>],
        requires: &[bool],
    ) -> Vec<(usize, Vec<usize>)> {
        let _ = (cx, strides, requires);
        Vec::new()
    }
    /// Elements of the temporaries PyTorch's backward holds beyond the gradients it
    /// returns, given the inputs whose gradient is `wanted` (of the incoming
    /// gradient's dtype, alive during the backward step only): a derivative formula's
    /// intermediates, and a broadcast operand's output-sized gradient before the
    /// engine reduces it. Default: none.
    fn backward_scratch(&self, cx: &Cx, wanted: &[usize]) -> u64 {
        let _ = (cx, wanted);
        0
    }
    /// The CPU forward kernel: one output tensor per declared output, in order
    /// (omitted optional outputs may be computed anyway; the executor drops them),
    /// each of the dtype and shape that [`Op::infer`] gave. An op without a kernel
    /// says so with [`no_kernel`].
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>>;
    /// The CPU backward kernel: from the incoming output gradients and the saved
    /// tensors the backward rule declares for the wanted gradients (and nothing
    /// else: [`BackwardCx::saved`] refuses any other), one entry per input slot,
    /// `Some` exactly for [`BackwardCx::wanted`], of the input's dtype and shape.
    /// Ops without a gradient answer with [`no_gradient`]; an op with a rule but no
    /// kernel yet with [`no_backward_kernel`].
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>>;
    /// The CUDA kernels (kernels/*.cu, names as defined there) the GPU backend
    /// (`exec::cuda::ops`, feature `cuda`) launches for `op_type` (ops sharing an
    /// impl differ by name). Empty `forward`: the op runs on the host there (the
    /// CPU kernel on downloaded inputs), as the integer shape computations do.
    /// cuBLAS GEMMs are listed as [`CUBLAS_SGEMM`].
    fn cuda_kernels(&self, op_type: &str) -> CudaKernels;
    /// How PyTorch's autocast runs `op_type` (ops sharing an impl may differ by
    /// name); the training schedule's precision policy turns it into dtypes.
    fn autocast(&self, op_type: &str) -> Autocast;
}

/// How PyTorch's autocast treats an op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Autocast {
    /// Runs in the half type (autocast's lower-precision list: convolutions, matrix products).
    Half,
    /// Runs in float32 (autocast's fp32 list: softmax, norms, sums, exp/log/pow...).
    Full,
    /// Reads its input as it is and writes float32 (autocast's `fp32_append_dtype`
    /// policy: `norm` is called with `dtype=float32`, so no float32 copy of the input
    /// is made, and `LinalgVectorNormBackward0` saves the half input).
    Widen,
    /// Writes the type the graph gives its output (an explicit `Cast`: PyTorch's
    /// `.float()` / `.to(torch.float32)` makes a float32 copy of a half tensor).
    AsWritten,
    /// Runs in the widest floating type of its inputs (everything else).
    Promote,
}

/// Stands for cuBLAS's strided-batched SGEMM in [`CudaKernels`] lists (not a
/// kernels/ name; skipped by the check that every listed kernel is defined).
pub const CUBLAS_SGEMM: &str = "cublasSgemmStridedBatched";

/// The launcher of the GPU backend (`exec::cuda::ops`) that runs an op: the
/// backend dispatches on it with exhaustive matches, so a new launcher is a new
/// variant that does not compile until the backend runs it, and a new op that
/// reuses one needs nothing there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launch {
    /// None: the op runs on the host (the CPU kernel on downloaded inputs).
    Host,
    /// `unary_fwd_f32` / `unary_bwd_f32` with the op's row code ([`elementwise::UNARY`]).
    Unary,
    /// Broadcasting arithmetic (Add, Sub, Mul, Div, Pow).
    Binary,
    /// Broadcasting comparisons to bool.
    Compare,
    /// `Where(cond, x, y)`.
    Where,
    /// `Clip` with constant bounds.
    Clip,
    /// `Dropout` (the mask an extra).
    Dropout,
    /// `MatMul` (cuBLAS).
    MatMul,
    /// `Gemm` (cuBLAS).
    Gemm,
    /// `Conv` up to 2-D (im2col and cuBLAS).
    Conv,
    /// Max and average pooling, 2-D.
    Pool,
    /// `GlobalAveragePool`.
    GlobalAveragePool,
    /// `BatchNormalization` in training mode.
    BatchNorm,
    /// `LayerNormalization`.
    LayerNorm,
    /// `Softmax` / `LogSoftmax`.
    Softmax,
    /// ReduceSum, ReduceMean, ReduceMax, ReduceMin.
    Reduce,
    /// A copy into the output's shape (Reshape, Flatten, Squeeze, Unsqueeze).
    Reshape,
    /// `Transpose`.
    Transpose,
    /// `Expand` (broadcast copy).
    Expand,
    /// `Concat`.
    Concat,
    /// `Split`.
    Split,
    /// `Slice` of one contiguous block.
    Slice,
    /// `Gather`.
    Gather,
    /// `GatherElements`.
    GatherElements,
    /// `Cast` / `CastLike` between device dtypes.
    Cast,
}

/// The CUDA kernels of one op, forward and backward ([`Op::cuda_kernels`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaKernels {
    /// The launcher that runs them.
    pub launch: Launch,
    /// Kernels of the forward launcher.
    pub forward: &'static [&'static str],
    /// Kernels of the backward launcher (empty: no gradient, or host).
    pub backward: &'static [&'static str],
    /// False for [`CudaKernels::UNLISTED`]: the op family's match has no arm for
    /// this op type (the registry-wide test fails on it).
    pub listed: bool,
}

impl CudaKernels {
    /// An op that runs on the host on the GPU backend.
    pub const HOST: CudaKernels = CudaKernels {
        launch: Launch::Host,
        forward: &[],
        backward: &[],
        listed: true,
    };

    /// What a family's match gives an op type it does not name: runs on the host,
    /// and fails `tests/op_registry.rs`, so that no op gets it silently.
    pub const UNLISTED: CudaKernels = CudaKernels {
        listed: false,
        ..CudaKernels::HOST
    };

    /// `forward` and `backward` kernels, run by `launch`.
    pub const fn new(
        launch: Launch,
        forward: &'static [&'static str],
        backward: &'static [&'static str],
    ) -> CudaKernels {
        CudaKernels {
            launch,
            forward,
            backward,
            listed: true,
        }
    }
}

/// Everything a CPU kernel sees of one node: attributes, input values, the output
/// facts that inference gave, the opset and the run's options.
pub struct KernelCx<'a> {
    /// The node.
    pub node: &'a Node,
    /// Input values in order; `None` for omitted optional inputs.
    pub inputs: Vec<Option<&'a Tensor>>,
    /// Inferred output facts, one per declared output; `None` where omitted.
    pub outputs: Vec<Option<&'a Fact>>,
    /// Version of the default ONNX domain.
    pub opset: i64,
    /// Seed of this node's random stream (Dropout's mask).
    pub seed: u64,
    /// Whether a Dropout in training mode drops (`false`: every Dropout is the
    /// identity, for comparing with a deterministic reference).
    pub dropout: bool,
    /// Whether the kernel also makes the extra tensors its backward rule declares
    /// ([`Backward::extras`]: BatchNorm's batch mean and inverse std, LayerNorm's
    /// mean and inverse std, MaxPool's indices, Dropout's mask), appended in order
    /// after one tensor per declared output. The forward of a training step: there
    /// BatchNormalization always normalizes with the batch statistics (training
    /// mode), as memplan's schedule assumes.
    pub extras: bool,
}

impl<'a> KernelCx<'a> {
    /// The node's attributes.
    pub fn attrs(&self) -> &Attrs {
        &self.node.attrs
    }

    /// Required input `i`.
    pub fn input(&self, i: usize) -> RuleResult<&'a Tensor> {
        self.inputs
            .get(i)
            .copied()
            .flatten()
            .ok_or(RuleError::MissingInput(i))
    }

    /// Optional input `i`.
    pub fn opt(&self, i: usize) -> Option<&'a Tensor> {
        self.inputs.get(i).copied().flatten()
    }

    /// The inferred fact of output `i` (shape and dtype the kernel must produce).
    pub fn out(&self, i: usize) -> RuleResult<&'a Fact> {
        self.outputs
            .get(i)
            .copied()
            .flatten()
            .ok_or(RuleError::MissingOutput(i))
    }

    /// Number of declared outputs (omitted ones included).
    pub fn n_outputs(&self) -> usize {
        self.outputs.len()
    }
}

/// The kernel of an op that has none yet: an error naming the op type.
pub fn no_kernel(cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
    Err(RuleError::NoKernel(cx.node.op_type.to_string()))
}

/// Everything a CPU backward kernel sees of one node: its attributes, the facts of
/// its inputs and outputs (dtype, shape, and folded values of small constants, which
/// PyTorch keeps in the backward node as plain numbers), the saved tensors, and the
/// incoming gradients. Tensor *data* of the forward pass is reachable only through
/// [`BackwardCx::saved`], and only for what the op's backward rule declares.
pub struct BackwardCx<'a> {
    /// The node.
    pub node: &'a Node,
    /// Input facts in order; `None` for omitted optional inputs (inline up to four:
    /// no allocation per node).
    pub inputs: CxInputs<'a>,
    /// Output facts, one per declared output; `None` where omitted.
    pub outputs: Vec<Option<&'a Fact>>,
    /// Version of the default ONNX domain.
    pub opset: i64,
    /// The saved tensors given to the kernel: those the rule's [`Grad::needs`]
    /// list for the wanted gradients (more are allowed, never read).
    pub saved: Vec<(Saved, &'a Tensor)>,
    /// Incoming gradient of each declared output; `None`: no gradient flows into
    /// that output (zeros).
    pub grads: Vec<Option<&'a Tensor>>,
    /// Input slots whose gradient is wanted (each listed in the rule's `grads`).
    pub wanted: Vec<usize>,
    /// The forward's [`KernelCx::dropout`].
    pub dropout: bool,
}

impl<'a> BackwardCx<'a> {
    /// The node's attributes.
    pub fn attrs(&self) -> &Attrs {
        &self.node.attrs
    }

    /// The rule context of the same node (for the shape and backward rules' helpers).
    pub fn rule_cx(&self) -> Cx<'a> {
        Cx {
            node: self.node,
            inputs: self.inputs.clone(),
            opset: self.opset,
        }
    }

    /// Whether the gradient of input `i` is wanted.
    pub fn wants(&self, i: usize) -> bool {
        self.wanted.contains(&i)
    }

    /// The fact of input `i`.
    pub fn input(&self, i: usize) -> RuleResult<&'a Fact> {
        self.inputs
            .get(i)
            .copied()
            .flatten()
            .ok_or(RuleError::MissingInput(i))
    }

    /// The fact of output `i`.
    pub fn output(&self, i: usize) -> RuleResult<&'a Fact> {
        self.outputs
            .get(i)
            .copied()
            .flatten()
            .ok_or(RuleError::MissingOutput(i))
    }

    /// A saved tensor; an error when it was not given, i.e. when the kernel reads
    /// something the backward rule does not save for the wanted gradients.
    pub fn saved(&self, s: Saved) -> RuleResult<&'a Tensor> {
        self.saved
            .iter()
            .find(|(k, _)| *k == s)
            .map(|(_, t)| *t)
            .ok_or_else(|| RuleError::NotSaved(format!("{s:?}")))
    }

    /// The incoming gradient of output `i` as f32 (zeros when none flows in).
    pub fn grad(&self, i: usize) -> RuleResult<std::borrow::Cow<'a, [f32]>> {
        match self.grads.get(i).copied().flatten() {
            Some(g) => {
                let f = self.output(i)?;
                if g.shape != f.shape {
                    return Err(format!(
                        "the gradient of output {i} is {:?}, the output {:?}",
                        g.shape, f.shape
                    )
                    .into());
                }
                g.to_f32()
            }
            None => Ok(std::borrow::Cow::Owned(vec![
                0.0;
                self.output(i)?
                    .shape
                    .iter()
                    .product()
            ])),
        }
    }

    /// Builds the kernel's answer from `(input slot, f32 gradient)` pairs: one
    /// entry per input slot, each gradient of its input's dtype and shape.
    pub fn answer(&self, grads: Vec<(usize, Vec<f32>)>) -> RuleResult<Vec<Option<Tensor>>> {
        let mut out: Vec<Option<Tensor>> = vec![None; self.node.inputs.len()];
        for (i, v) in grads {
            let f = self.input(i)?;
            out[i] = Some(Tensor::from_f32(f.dtype, f.shape.clone(), v)?);
        }
        Ok(out)
    }
}

/// The backward rule of an op whose float output's gradient flows back to input 0
/// alone, reading `needs`: one FLOP per output element; no gradient for other
/// types.
pub(crate) fn input0_backward(out: &[Fact], needs: &[Saved]) -> RuleResult<Option<Backward>> {
    if !out[0].dtype.is_float() {
        return Ok(None);
    }
    Ok(Some(Backward::each(&[0], needs, out[0].numel())))
}

/// [`input0_backward`] reading nothing (the gradient reshaped, transposed, summed
/// back, sliced, ...).
pub(crate) fn nothing_saved_backward(out: &[Fact]) -> RuleResult<Option<Backward>> {
    input0_backward(out, &[])
}

/// The backward kernel of an op that has no gradient (its rule answers `Ok(None)`).
pub fn no_gradient(cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
    Err(RuleError::NoGradient(cx.node.op_type.to_string()))
}

/// The backward kernel of an op with a backward rule but no CPU kernel yet.
pub fn no_backward_kernel(cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
    Err(RuleError::NoBackwardKernel(cx.node.op_type.to_string()))
}

/// Output storage of an op in PyTorch (for memory of training steps, where views
/// cost nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// Outputs are new tensors.
    New,
    /// Output 0 (and every output, for Split) is a view of input 0 that keeps its
    /// memory layout contiguous when the input is.
    View,
    /// A view that is not contiguous (transpose, expand, inner slice): a later reshape
    /// of it copies.
    StridedView,
    /// A reshape: a view of a contiguous input, a copy of a strided one.
    Reshape,
}

/// The ONNX domain of the forward ops lowering (src/infer/lower) writes in place of an
/// exporter's spelling of them (`SliceScatter` for a scatter over a box's grid); a
/// lowered model imports it, version 1.
pub const LOWERED_DOMAIN: &str = "ai.memplan.lowered";

/// Op table keyed by op type: the default ONNX domain, and the few ops of
/// [`LOWERED_DOMAIN`] that lowering writes.
pub struct Registry {
    ops: HashMap<&'static str, Box<dyn Op>, crate::ir::NameHash>,
    lowered: HashMap<&'static str, Box<dyn Op>, crate::ir::NameHash>,
}

impl Registry {
    /// Adds an op; a name registered twice is a programming error caught by tests.
    pub fn add(&mut self, name: &'static str, op: impl Op + 'static) {
        let prev = self.ops.insert(name, Box::new(op));
        debug_assert!(prev.is_none(), "op {name} registered twice");
    }

    /// Adds an op of [`LOWERED_DOMAIN`].
    pub fn add_lowered(&mut self, name: &'static str, op: impl Op + 'static) {
        let prev = self.lowered.insert(name, Box::new(op));
        debug_assert!(prev.is_none(), "op {name} registered twice");
    }

    /// The rule for `op_type` in `domain`, if supported.
    pub fn get(&self, domain: &str, op_type: &str) -> Option<&dyn Op> {
        let table = match domain {
            "" => &self.ops,
            LOWERED_DOMAIN => &self.lowered,
            _ => return None,
        };
        table.get(op_type).map(|b| b.as_ref())
    }

    /// Names of all supported ops, sorted.
    pub fn names(&self) -> Vec<&'static str> {
        let mut v: Vec<_> = self.ops.keys().copied().collect();
        v.sort_unstable();
        v
    }
}

/// Ops whose output shape depends on input values however they are written: each
/// with the input whose values decide it. memplan refuses them as data-dependent
/// ([`RuleError::NotConstant`](crate::numeric::RuleError::NotConstant)) rather than
/// folding image bytes or box scores; nobody trains through them.
pub const VALUE_SHAPED: &[(&str, usize)] = &[
    // The number of boxes kept depends on the scores (input 1) and overlaps.
    ("NonMaxSuppression", 1),
    // The number of distinct values.
    ("Unique", 0),
    // The decoded image's height and width are in the encoded bytes.
    ("ImageDecoder", 0),
];

/// The global op table.
pub fn registry() -> &'static Registry {
    static REG: OnceLock<Registry> = OnceLock::new();
    REG.get_or_init(|| {
        let mut r = Registry {
            ops: HashMap::default(),
            lowered: HashMap::default(),
        };
        attention::register(&mut r);
        elementwise::register(&mut r);
        linalg::register(&mut r);
        local_norm::register(&mut r);
        loss::register(&mut r);
        conv::register(&mut r);
        conv_transpose::register(&mut r);
        einsum::register(&mut r);
        gather_nd::register(&mut r);
        grid_sample::register(&mut r);
        norm::register(&mut r);
        quantize::register(&mut r);
        random::register(&mut r);
        reduce::register(&mut r);
        resize::register(&mut r);
        rnn::register(&mut r);
        rotary::register(&mut r);
        shape::register(&mut r);
        signal::register(&mut r);
        spatial::register(&mut r);
        text::register(&mut r);
        r
    })
}

/// Normalizes a possibly negative axis against `rank`.
pub fn axis(a: i64, rank: usize) -> RuleResult<usize> {
    let r = rank as i64;
    if a < -r || a >= r {
        return Err(format!("axis {a} is out of range for rank {rank}").into());
    }
    Ok(if a < 0 { (a + r) as usize } else { a as usize })
}

/// Multidirectional (numpy) broadcasting of several shapes.
pub fn broadcast(shapes: &[&[usize]]) -> RuleResult<Vec<usize>> {
    let rank = shapes.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut out = vec![1usize; rank];
    for s in shapes {
        let off = rank - s.len();
        for (i, &d) in s.iter().enumerate() {
            let o = &mut out[off + i];
            if *o == 1 {
                *o = d;
            } else if d != 1 && d != *o {
                return Err(format!(
                    "shapes {} cannot be broadcast together",
                    shapes
                        .iter()
                        .map(|s| format!("{s:?}"))
                        .collect::<Vec<_>>()
                        .join(" and ")
                )
                .into());
            }
        }
    }
    Ok(out)
}

/// Converts a non-negative i64 dimension to usize with a clear error.
pub fn dim(v: i64, what: &str) -> RuleResult<usize> {
    Ok(usize::try_from(v).map_err(|_| format!("{what} {v} is negative"))?)
}

/// Maps an ONNX dtype code attribute (`to`, `dtype`) to a [`DType`].
pub fn dtype_attr(code: i64) -> RuleResult<DType> {
    Ok(i32::try_from(code)
        .ok()
        .and_then(DType::from_onnx)
        .ok_or_else(|| format!("unknown dtype code {code}"))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcasting() {
        assert_eq!(broadcast(&[&[2, 1, 4], &[3, 1]]).unwrap(), vec![2, 3, 4]);
        assert_eq!(broadcast(&[&[], &[5]]).unwrap(), vec![5]);
        assert!(broadcast(&[&[2, 3], &[4, 3]]).is_err());
    }

    #[test]
    fn axes() {
        assert_eq!(axis(-1, 3).unwrap(), 2);
        assert!(axis(0, 0).is_err());
        assert!(axis(3, 3).is_err());
        assert!(axis(-4, 3).is_err());
    }
}
