//! Autodiff: turns the forward graph into the schedule of one training step:
//! forward, loss, backward in reverse order, optimizer update.
//!
//! Each op's backward rule (`Op::backward`, beside the op) says which inputs get
//! gradients and which forward tensors each gradient reads: the tensors PyTorch's
//! autograd saves on CUDA. Memory is tracked per *storage*, as PyTorch allocates it:
//! view ops (transpose, slice, select, unsqueeze, expand, identity dropout, a reshape
//! that can be a view...) alias their input's storage and cost nothing. Every tensor's
//! strides are followed (`ops::layout`; element-wise results laid out like their
//! inputs), so a reshape copies exactly where PyTorch's would, and an op whose PyTorch
//! kernel copies a strided operand before saving it (`torch.matmul`'s reshape for
//! `bmm`) writes a [`StorageKind::Copy`] that backward reads in the operand's place
//! ([`ops::Op::saved_copies`]). A gradient flowing back through a view op is a view of
//! the incoming gradient.
//!
//! Recognised fusions (PyTorch runs these as one kernel; memplan models what that
//! kernel saves): the exact GELU exporters write as `x · (erf(x/√2) + 1) · 0.5`
//! (`F.gelu` saves only `x`), `F.gelu(approximate="tanh")` written out (saves only
//! `x`), SiLU written as `x · sigmoid(x)` (`F.silu` saves only `x`), and the
//! exporter's decomposition of `scaled_dot_product_attention` (flash attention
//! saves q, k, v, the output and a logsumexp), LayerNorm decomposed into
//! ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div (`native_layer_norm` saves the input
//! and the per-row mean and rstd), and the `torch.rsqrt` of LLaMA-style RMSNorm
//! written as Pow/ReduceMean/Add/Sqrt/Reciprocal (rsqrt saves its result, not the
//! square root), and QAT's fake quantization, QuantizeLinear → [Clip →]
//! DequantizeLinear (one float → float kernel saving a bool mask; its integer values
//! are views of its input, and its rules are [`super::fusion::FakeQuant::rule`]).
//! GPT-2's hand-written tanh GELU
//! (`NewGELUActivation`, with `torch.pow`) and eager attention are left as written,
//! since PyTorch runs them op by op.

//!
//! The builder runs in phases, one file each: [`rules`] (each node's backward rule
//! and the recognised fusions), [`params`] (which parameters train, and how frozen
//! ones are stored), [`flow`] (which tensors require and get a gradient),
//! [`precision`] (the float type of every tensor, the persistent storages),
//! [`forward`], [`loss`], [`backward`] and [`optimizer`].

mod backward;
mod flow;
mod forward;
mod loss;
mod optimizer;
mod params;
mod precision;
mod rules;

use super::fusion::FakeQuantRole;
use super::schedule::{Schedule, Step, Storage, StorageId, StorageKind};
use super::TrainOptions;
use crate::error::Result;
use crate::infer::Inferred;
use crate::ir::{DType, Model, TensorId};
use crate::ops::{Backward, Fact};
use petgraph::stable_graph::NodeIndex;
use std::collections::{HashMap, HashSet};

use flow::Flow;
use params::Params;
use rules::Rules;

/// What the phases before the first step find (read-only while steps are built).
struct Analysis<'a> {
    /// Rules per node and the fusions.
    rules: Rules<'a>,
    /// Which parameters train and how frozen ones are stored.
    params: Params,
    /// Which tensors require and get a gradient.
    flow: Flow,
    /// Autocast's type-promotion origins.
    origins: super::policy::Origins,
    /// The file is trained as written (a bfloat16 export under bf16).
    as_written: bool,
}

/// Key of the autocast weight cache: the parameter's storage and the view's shape
/// and strides.
type CastKey = (StorageId, Vec<usize>, Option<Vec<usize>>);

/// The schedule under construction, and the per-tensor state the steps share.
struct Builder<'m, 'a> {
    model: &'m Model,
    inf: &'m Inferred,
    opts: &'m TrainOptions,
    an: &'a Analysis<'m>,
    storages: Vec<Storage>,
    steps: Vec<Step>,
    /// The float type of every forward float tensor (set as forward reaches it).
    float_dtype: Vec<Option<DType>>,
    /// The storage of every forward tensor.
    tstore: Vec<Option<StorageId>>,
    /// Strides of each forward tensor in its storage (`ops::layout`); `None`: a view
    /// memplan does not follow (a reshape of it copies).
    strides: Vec<Option<Vec<usize>>>,
    /// Storages of trainable parameters (autocast caches their casts).
    trainable_storage: HashSet<StorageId>,
    /// Autocast weight cache ([`precision`]).
    weight_cast: HashMap<CastKey, StorageId>,
    /// Per forward step: the storage each input slot is read from (after casts).
    read_as: Vec<Vec<Option<StorageId>>>,
    /// Per forward step: the extras its backward reads.
    extras_of: Vec<Vec<StorageId>>,
    /// The gradient of each tensor, once backward made one.
    grad: Vec<Option<StorageId>>,
    /// Parameters whose gradient so far is one contribution autograd cannot add
    /// into in place ([`backward`]).
    view_grad: Vec<bool>,
    /// The float32 copy a fused kernel reads its input as, by (last node, input).
    fp32_reads: HashMap<(NodeIndex, TensorId), StorageId>,
}

impl Builder<'_, '_> {
    fn new_storage(
        &mut self,
        name: &str,
        fact: &Fact,
        dtype: DType,
        kind: StorageKind,
    ) -> StorageId {
        let bytes = dtype.bytes_for(fact.numel()).unwrap_or(u64::MAX);
        self.storages.push(Storage {
            name: name.to_string(),
            bytes,
            dtype,
            shape: fact.shape.clone(),
            kind,
            persistent: false,
            held: false,
            saved: false,
            pieces: Vec::new(),
        });
        self.storages.len() - 1
    }

    /// Element type of a forward float tensor under the precision policy.
    fn dtype_of(&self, t: TensorId) -> DType {
        self.float_dtype[t].unwrap_or(self.inf.facts[t].dtype)
    }

    fn is_float(&self, t: TensorId) -> bool {
        self.inf.facts[t].dtype.is_float()
    }

    /// A fake quantization's role for the node, if it is in one.
    fn fq_role(&self, ix: NodeIndex) -> Option<FakeQuantRole> {
        self.an.rules.fq.get(&ix).map(|&(_, role)| role)
    }
}

/// Builds the training-step schedule for inferred shapes and options.
pub fn build_schedule(model: &Model, inf: &Inferred, opts: &TrainOptions) -> Result<Schedule> {
    let rules = Rules::of(model, inf, opts);
    let params = Params::of(model, inf, opts, &rules)?;
    let flow = Flow::of(model, inf, opts, &rules, &params)?;
    let an = Analysis {
        rules,
        params,
        flow,
        origins: super::policy::Origins::of(model, inf),
        as_written: super::policy::exported_in_bf16(model, opts.precision),
    };
    let mut b = Builder::new(model, inf, opts, &an);
    b.forward();
    b.loss();
    b.backward();
    b.keep_what_unused_branches_save();
    b.optimizer();
    let mut schedule = b.finish();
    schedule.fused = an.rules.fused;
    Ok(schedule)
}

impl Builder<'_, '_> {
    /// The schedule built (its fused patterns are the caller's to move in).
    fn finish(self) -> Schedule {
        let tensor_storage = self
            .tstore
            .into_iter()
            .map(|s| s.unwrap_or(usize::MAX))
            .collect();
        let mut fused_copies: Vec<(NodeIndex, TensorId, StorageId)> = self
            .fp32_reads
            .iter()
            .map(|(&(n, t), &c)| (n, t, c))
            .collect();
        fused_copies.sort_unstable();
        let n_t = self.inf.facts.len();
        let p = &self.an.params;
        Schedule {
            storages: self.storages,
            steps: self.steps,
            tensor_storage,
            trainable: (0..n_t).filter(|&t| p.trainable[t]).collect(),
            with_grad: p.with_grad(&self.an.flow),
            fused: Vec::new(),
            fused_copies,
        }
    }
}

/// The backward FLOPs of the gradients that are required: an op's rule counts all of
/// them ([`Backward::flops`]); a frozen layer computes only its input's gradient (a
/// frozen matmul: half its backward), the first layer only its weight's. Estimated
/// as the share of the required gradients among the present inputs' gradients that
/// read a saved tensor (a bias's gradient, a reduction of the incoming one, counts
/// as free; a convolution's rule gives its bias the weight's needs, so a frozen
/// convolution with a bias is counted at a third, where its input gradient is half).
fn required_share(bw: &Backward, inputs: &[Option<TensorId>], required: &[usize]) -> u64 {
    let costly: Vec<usize> = bw
        .grads
        .iter()
        .filter(|g| !g.needs.is_empty() && matches!(inputs.get(g.input), Some(Some(_))))
        .map(|g| g.input)
        .collect();
    if costly.is_empty() {
        return bw.flops;
    }
    let needed = costly.iter().filter(|i| required.contains(i)).count() as u64;
    (bw.flops as u128 * needed.max(1) as u128 / costly.len() as u128) as u64
}
