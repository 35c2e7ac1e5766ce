//! Tensor, context and expert parallelism: what one rank holds of each storage.
//!
//! **Tensor parallelism** (Megatron-LM, Shoeybi et al. 2019; torch's
//! `parallelize_module` with `ColwiseParallel`/`RowwiseParallel`): each Linear is split
//! by its role, read from its weight's name (`model.layers.0.self_attn.q_proj.weight`
//! → `q_proj`):
//! - column-parallel (q/k/v, gate/up, fused qkv and gate_up, fc1): the weight's output
//!   rows are split, so the output is split (heads, or the MLP's inner width);
//! - row-parallel (o, down, fc2): the weight's input columns are split; the output is
//!   a partial sum all-reduced in place: whole;
//! - vocab-parallel embedding: the table's rows are split; the looked-up output is
//!   masked and all-reduced: whole; LM head: the weight's rows are split and the
//!   logits (and the vocab-parallel cross entropy's vocabulary-sized tensors) split;
//! - replicated: the MoE router (`gate`, `router`) and position embeddings.
//!
//! Every other tensor is split when one of its inputs is (the attention between the
//! column- and row-parallel layers works on its share of heads) and whole otherwise
//! (norms, residuals). Gradients follow their tensor; the optimizer state and
//! temporaries follow the gradients they are made for. A Linear (a MatMul, Gemm or
//! Gather reading a parameter) whose weight matches no role is refused by name.
//!
//! **Sequence parallelism** (Korthikanti et al. 2022): the whole tensors between the
//! parallel regions are split along the sequence as well, so every activation and
//! activation gradient is split; each column-parallel layer all-gathers its input
//! (a whole-size transient, gathered again in backward where its input gradient is
//! whole before the reduce-scatter).
//!
//! **Context parallelism** (ring attention, Megatron's `--context-parallel-size`): the
//! sequence is split over the ranks for the whole model, so every activation and
//! activation gradient is split; parameters stay whole. Each attention passes its
//! local keys and values around the ring: while one block is used the next is
//! received, a transient of twice the local K and V at the attention (and again in
//! backward, with their gradients).
//!
//! **Expert parallelism**: the experts (parameters named `….experts.…`) are split
//! over the ranks, with their gradients and optimizer state. Under the balanced and
//! capacity routings each expert receives the same tokens from every rank, so a rank
//! computes E/ep experts on ep times the tokens: the expert activations are those of
//! the unsplit layer (the all-to-all's received tokens are the experts' inputs).

use std::collections::HashMap;

use crate::train::{Schedule, StepKind, StorageId, StorageKind};

/// A Linear's role under tensor parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Output features split.
    Column,
    /// Input features split, output all-reduced.
    Row,
    /// Vocabulary-parallel embedding: rows split, output all-reduced.
    VocabEmbed,
    /// Vocabulary-parallel LM head: rows split, logits split.
    VocabHead,
    /// Whole on every rank.
    Replicated,
}

/// The role of a module name (the last component of its path).
fn role_of_module(name: &str) -> Option<Role> {
    Some(match name {
        "q_proj" | "k_proj" | "v_proj" | "qkv_proj" | "query" | "key" | "value"
        | "query_key_value" | "c_attn" | "Wqkv" | "wq" | "wk" | "wv" | "gate_proj" | "up_proj"
        | "gate_up_proj" | "w1" | "w3" | "fc1" | "c_fc" | "linear_fc1" | "dense_h_to_4h"
        | "linear_qkv" => Role::Column,
        "o_proj" | "out_proj" | "c_proj" | "wo" | "w2" | "fc2" | "down_proj" | "linear_proj"
        | "linear_fc2" | "dense_4h_to_h" => Role::Row,
        "embed_tokens" | "wte" | "word_embeddings" | "tok_embeddings" | "embed_in" => {
            Role::VocabEmbed
        }
        "lm_head" | "embed_out" | "output_layer" => Role::VocabHead,
        "gate" | "router" | "wpe" | "position_embeddings" | "embed_positions" => Role::Replicated,
        _ => return None,
    })
}

/// The role of a parameter by its name: the last path component that names one
/// (`….q_proj.lora_A.default.weight` takes `q_proj`'s).
pub fn role(param: &str) -> Option<Role> {
    param.rsplit('.').find_map(role_of_module)
}

/// Whether a parameter belongs to a mixture-of-experts layer's experts.
fn is_expert(param: &str) -> bool {
    param.split('.').any(|c| c == "experts")
}

/// Tensor, context and expert parallel degrees.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Degrees {
    /// Tensor-parallel ranks.
    pub tp: u64,
    /// Sequence parallelism within the tensor-parallel group.
    pub sequence_parallel: bool,
    /// Context-parallel ranks.
    pub cp: u64,
    /// Expert-parallel ranks.
    pub ep: u64,
}

impl Default for Degrees {
    fn default() -> Self {
        Degrees {
            tp: 1,
            sequence_parallel: false,
            cp: 1,
            ep: 1,
        }
    }
}

/// What a rank's storage is: how it is divided.
#[derive(Debug, Clone, Copy, Default)]
struct Share {
    /// Divided over the tensor-parallel ranks.
    tp: bool,
    /// Carries the sequence (an activation or its gradient).
    seq: bool,
    /// An expert parameter or its gradient.
    expert: bool,
}

/// Facts about the one-GPU schedule the split reads.
struct Facts {
    /// Per storage: made from parameters alone (a weight's cast or transpose), and
    /// the parameter it is made from.
    root: Vec<Option<StorageId>>,
    /// The storage a gradient's tensor lives in, per storage (`None`: not a
    /// gradient, or of no known tensor).
    grad_of: Vec<Option<StorageId>>,
}

fn facts(s: &Schedule, names: &[String]) -> Facts {
    let mut root: Vec<Option<StorageId>> = s
        .storages
        .iter()
        .enumerate()
        .map(|(i, st)| (st.kind == StorageKind::Parameter).then_some(i))
        .collect();
    let fixed = |k: StorageKind| matches!(k, StorageKind::Constant | StorageKind::Buffer);
    for st in s.steps.iter().filter(|x| x.kind == StepKind::Forward) {
        let r = st.reads.iter().find_map(|&r| root[r]);
        let only_params = st
            .reads
            .iter()
            .all(|&x| root[x].is_some() || fixed(s.storages[x].kind));
        if let (Some(r), true) = (r, only_params) {
            for &w in &st.writes {
                root[w].get_or_insert(r);
            }
        }
    }
    let mut by_name: HashMap<&str, StorageId> = HashMap::new();
    for (t, &sid) in s.tensor_storage.iter().enumerate() {
        if let Some(n) = names.get(t) {
            by_name.insert(n, sid);
        }
    }
    for (i, st) in s.storages.iter().enumerate() {
        by_name.entry(&st.name).or_insert(i);
    }
    let grad_of = s
        .storages
        .iter()
        .map(|st| grad_name(&st.name).and_then(|t| by_name.get(t).copied()))
        .collect();
    Facts { root, grad_of }
}

/// The tensor a gradient storage is named after (`x/grad`, `x/grad+`).
fn grad_name(name: &str) -> Option<&str> {
    name.strip_suffix("/grad")
        .or_else(|| name.strip_suffix("/grad+"))
}

/// Fused q/k/v projections, by module name.
const FUSED_QKV: [&str; 4] = ["qkv_proj", "query_key_value", "c_attn", "Wqkv"];

const LINEAR: [&str; 5] = ["MatMul", "Gemm", "Gather", "MatMulInteger", "MatMulNBits"];

/// Which storages tensor parallelism splits (see the module docs), or the modules
/// whose Linear layers have no role.
fn tp_split(s: &Schedule, f: &Facts) -> Result<Vec<bool>, String> {
    let name = |r: StorageId| s.storages[r].name.as_str();
    let mut split = vec![false; s.storages.len()];
    let mut unmatched: Vec<String> = Vec::new();
    // Parameters: split when a Linear reads them in a split role.
    for st in s.steps.iter().filter(|x| x.kind == StepKind::Forward) {
        let activation = st.reads.iter().any(|&r| f.root[r].is_none());
        if !LINEAR.contains(&st.op.as_str()) || !activation {
            continue;
        }
        for p in st.reads.iter().filter_map(|&r| f.root[r]) {
            match role(name(p)) {
                Some(Role::Replicated) => {}
                Some(_) => split[p] = true,
                None => {
                    let m = name(p)
                        .trim_end_matches(".weight")
                        .trim_end_matches(".bias");
                    if !unmatched.iter().any(|u| u == m) {
                        unmatched.push(m.to_string());
                    }
                }
            }
        }
    }
    if !unmatched.is_empty() {
        let more = unmatched.len().saturating_sub(4);
        unmatched.truncate(4);
        let tail = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        return Err(format!(
            "tensor parallelism splits Linear layers by role (q/k/v/o_proj, gate/up/down_proj, embeddings, lm_head); no role for {}{tail}",
            unmatched.join(", ")
        ));
    }
    for st in &s.steps {
        if st.kind == StepKind::Optimizer {
            continue;
        }
        let linear = LINEAR.contains(&st.op.as_str());
        let weight_role = st
            .reads
            .iter()
            .filter_map(|&r| f.root[r])
            .find_map(|p| role(name(p)));
        let from_params = st.reads.iter().all(|&r| f.root[r].is_some());
        for &w in &st.writes {
            if let Some(p) = f.root[w] {
                split[w] = split[p];
                continue;
            }
            if let Some(t) = f.grad_of[w].filter(|&t| t != w) {
                split[w] = split[t];
                continue;
            }
            split[w] = match (st.kind, linear && !from_params, weight_role) {
                (StepKind::Forward, true, Some(Role::Row | Role::VocabEmbed)) => false,
                (StepKind::Forward, true, Some(Role::Column | Role::VocabHead)) => true,
                _ => st.reads.iter().any(|&r| split[r]),
            };
        }
    }
    Ok(split)
}

/// What the split did to a rank's step, for reports.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SplitSummary {
    /// Parameter bytes of the rank (after the split).
    pub param_bytes: u64,
    /// Parameters the tensor-parallel split divides.
    pub tp_split_params: usize,
    /// Expert parameters the expert-parallel split divides.
    pub expert_params: usize,
    /// Bytes one micro-batch's forward all-reduces over the tensor-parallel ranks
    /// (the row-parallel and embedding outputs, whole; under sequence parallelism the
    /// same volume is reduce-scattered and all-gathered), over the whole model;
    /// backward moves as much again.
    pub allreduce_bytes: u64,
    /// Bytes of keys and values a rank passes around the context-parallel ring in
    /// one forward (its local keys and values, over the attentions).
    pub ring_kv_bytes: u64,
}

/// Divides `bytes` (and its pieces) by `d`, rounding up.
fn divide(st: &mut crate::train::Storage, d: u64) {
    if d <= 1 {
        return;
    }
    // A parameter's local shape, as FSDP pads and shards it after (dim 0).
    if st.kind == StorageKind::Parameter {
        if let Some(d0) = st.shape.first_mut() {
            *d0 = d0.div_ceil(d as usize);
        }
    }
    if st.pieces.is_empty() {
        st.bytes = st.bytes.div_ceil(d);
    } else {
        for p in &mut st.pieces {
            *p = p.div_ceil(d);
        }
        st.bytes = st.pieces.iter().sum();
    }
}

/// Rewrites `s` (whose forward tensors are named `names`, by tensor id) into one
/// rank's step under `d`.
pub fn split(s: &mut Schedule, names: &[String], d: &Degrees) -> Result<SplitSummary, String> {
    let f = facts(s, names);
    let tp = if d.tp > 1 {
        tp_split(s, &f)?
    } else {
        vec![false; s.storages.len()]
    };
    let shares: Vec<Share> = (0..s.storages.len())
        .map(|i| share(s, &f, &tp, i))
        .collect();
    let grads_before = s.bytes_where(|x| x.kind == StorageKind::ParamGrad);
    let mut summary = SplitSummary::default();
    if d.tp > 1 {
        summary.allreduce_bytes = reduced_outputs(s, &f)
            .iter()
            .map(|&w| s.storages[w].bytes)
            .sum();
    }
    if d.tp > 1 {
        check_heads(s, &f, d.tp)?;
    }
    if d.ep > 1 {
        check_experts(s, d.ep)?;
    }
    divide_flops(s, &tp, d);
    // Whole-size inputs of the column-parallel layers, gathered (split by context).
    let gathers = if d.tp > 1 && d.sequence_parallel {
        gathered_inputs(s, &f)
    } else {
        Vec::new()
    };
    for (st, sh) in s.storages.iter_mut().zip(&shares) {
        let param = st.kind == StorageKind::Parameter;
        if sh.tp || (sh.seq && d.sequence_parallel) {
            divide(st, d.tp);
            summary.tp_split_params += usize::from(param && sh.tp);
        }
        if sh.seq {
            divide(st, d.cp);
        }
        if sh.expert && d.ep > 1 {
            divide(st, d.ep);
            summary.expert_params += usize::from(param);
        }
    }
    super::pipeline::scale_optimizer(s, grads_before);
    for (step, bytes) in gathers {
        add_transient(
            s,
            step,
            "sequence-parallel all-gather",
            bytes.div_ceil(d.cp),
        );
    }
    // The ring's blocks: the rank's keys and values (split already), twice.
    let ring = if d.cp > 1 {
        ring_blocks(s, &f)
    } else {
        Vec::new()
    };
    if d.cp > 1 && ring.is_empty() {
        return Err("context parallelism splits the sequence of attention (keys and values from k_proj/v_proj or a fused qkv projection); this model has none".into());
    }
    for (step, bytes) in ring {
        if s.steps[step].kind == StepKind::Forward {
            summary.ring_kv_bytes += bytes;
        }
        add_transient(s, step, "context-parallel ring K/V", 2 * bytes);
    }
    summary.param_bytes = s.bytes_where(|x| x.kind == StorageKind::Parameter);
    Ok(summary)
}

/// Tensor parallelism gives each rank whole attention heads, as Megatron
/// (`num_attention_heads` and `num_query_groups` divisible by the tensor-parallel
/// size) and torch's plans (the local view to heads) need: at each attention (a
/// Softmax over `[batch, heads, queries, keys]`), its heads and the key/value heads
/// of the `k_proj` before it (its width over the head size, `q_proj`'s width over
/// the heads; of a fused projection, half the width beyond the queries', [`fused_kv`])
/// must divide by `tp`. Llama-3-8B's 8 key/value heads allow tp ≤ 8.
fn check_heads(s: &Schedule, f: &Facts, tp: u64) -> Result<(), String> {
    let width = |st: &crate::train::Step| -> Option<u64> {
        let out = &s.storages[*st.writes.first()?].shape;
        out.last().map(|&d| d as u64)
    };
    // The projections since the previous attention: q's and k's widths.
    let (mut q, mut k, mut seen) = (None, None, false);
    for st in s.steps.iter().filter(|x| x.kind == StepKind::Forward) {
        match projection(s, f, st) {
            Some(Proj::Q) => (q, seen) = (width(st), true),
            Some(Proj::K) => (k, seen) = (width(st), true),
            Some(Proj::V) => seen = true,
            Some(Proj::Fused) => {
                seen = true;
                if let Some((kv, out)) = fused_kv(s, f, st, q.is_some()) {
                    (q, k) = (q.or(Some(out - kv)), Some(kv / 2));
                }
            }
            None => {}
        }
        let shape = st.writes.first().map(|&w| &s.storages[w].shape);
        let Some([_, heads, _, _]) = shape.map(Vec::as_slice).filter(|_| st.op == "Softmax") else {
            continue;
        };
        // A Softmax after no projection is not attention (a segmentation head's).
        if !std::mem::take(&mut seen) {
            continue;
        }
        let heads = *heads as u64;
        if heads % tp != 0 {
            return Err(format!("tensor parallelism gives each rank whole attention heads: {heads} heads do not divide over {tp} ranks (at {})", st.name));
        }
        if let (Some(q), Some(k)) = (q.take(), k.take()) {
            let head = q / heads;
            let kv = if head > 0 && q % heads == 0 && k % head == 0 {
                k / head
            } else {
                0
            };
            if kv > 0 && kv % tp != 0 {
                return Err(format!("tensor parallelism gives each rank whole key/value heads: {kv} key/value heads do not divide over {tp} ranks (at {})", st.name));
            }
        }
    }
    Ok(())
}

/// An attention projection, by the module that owns the weight a Linear reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Proj {
    Q,
    K,
    V,
    /// Queries, keys and values in one (or, after a separate query projection, keys
    /// and values: GPT-2's cross-attention `c_attn`).
    Fused,
}

/// The projection a forward step is: the module owning the weight it reads
/// (`….k_proj.weight`, a LoRA-wrapped `….k_proj.base_layer.weight`, or a copy made
/// from either, as a transpose), not an adapter's (`….k_proj.lora_B.default.weight`).
fn projection(s: &Schedule, f: &Facts, st: &crate::train::Step) -> Option<Proj> {
    if st.kind != StepKind::Forward || !LINEAR.contains(&st.op.as_str()) {
        return None;
    }
    st.reads.iter().filter_map(|&r| f.root[r]).find_map(|p| {
        let n = s.storages[p].name.strip_suffix(".weight")?;
        let m = n.strip_suffix(".base_layer").unwrap_or(n);
        match m.rsplit('.').next()? {
            "q_proj" | "query" | "wq" | "q_attn" => Some(Proj::Q),
            "k_proj" | "key" | "wk" => Some(Proj::K),
            "v_proj" | "value" | "wv" => Some(Proj::V),
            x if FUSED_QKV.contains(&x) => Some(Proj::Fused),
            _ => None,
        }
    })
}

/// The outputs tensor parallelism all-reduces: the row-parallel Linears' and the
/// vocab-parallel embedding's.
fn reduced_outputs(s: &Schedule, f: &Facts) -> Vec<StorageId> {
    let mut out = Vec::new();
    for st in s.steps.iter().filter(|x| x.kind == StepKind::Forward) {
        let activation = st.reads.iter().any(|&r| f.root[r].is_none());
        let reduced = st.reads.iter().filter_map(|&r| f.root[r]).any(|p| {
            matches!(
                role(&s.storages[p].name),
                Some(Role::Row | Role::VocabEmbed)
            )
        });
        if LINEAR.contains(&st.op.as_str()) && activation && reduced {
            out.extend(st.writes.iter().copied());
        }
    }
    out
}

/// Each step's FLOPs on one rank: the steps that touch a tensor-parallel split
/// tensor do 1/tp of the work, and context parallelism divides every forward and
/// backward step's (the ring spreads attention's evenly).
fn divide_flops(s: &mut Schedule, tp: &[bool], d: &Degrees) {
    for st in &mut s.steps {
        if st.kind == StepKind::Optimizer {
            continue;
        }
        let split = st.reads.iter().chain(&st.writes).any(|&x| tp[x]);
        if split && d.tp > 1 {
            st.flops = st.flops.div_ceil(d.tp);
        }
        st.flops = st.flops.div_ceil(d.cp.max(1));
    }
}

/// The experts of each MoE layer: `….experts.N.…` modules counted per layer, or the
/// leading dimension of fused expert weights; `ep` must divide every count.
fn check_experts(s: &Schedule, ep: u64) -> Result<(), String> {
    let mut layers: HashMap<&str, std::collections::HashSet<&str>> = HashMap::new();
    let mut fused: Vec<u64> = Vec::new();
    for st in s
        .storages
        .iter()
        .filter(|x| x.kind == StorageKind::Parameter)
    {
        let Some((layer, rest)) = st.name.split_once(".experts.") else {
            continue;
        };
        match rest.split('.').next() {
            Some(n) if n.bytes().all(|b| b.is_ascii_digit()) => {
                layers.entry(layer).or_default().insert(n);
            }
            _ => fused.extend(st.shape.first().map(|&e| e as u64)),
        }
    }
    let counts: Vec<u64> = layers
        .values()
        .map(|e| e.len() as u64)
        .chain(fused)
        .collect();
    if counts.is_empty() {
        return Err("expert parallelism splits mixture-of-experts layers (parameters under `experts`); this model has none".into());
    }
    match counts.iter().find(|&&e| e % ep != 0) {
        Some(e) => Err(format!(
            "expert parallelism over {ep} ranks needs a number of experts it divides; a layer has {e}"
        )),
        None => Ok(()),
    }
}

/// How storage `i` is divided.
fn share(s: &Schedule, f: &Facts, tp: &[bool], i: StorageId) -> Share {
    let st = &s.storages[i];
    let param_of = |k: StorageId| f.root[k];
    let tensor = f.grad_of[i];
    let base = match st.kind {
        StorageKind::ParamGrad | StorageKind::GradTemp | StorageKind::ActivationGrad => {
            tensor.unwrap_or(i)
        }
        _ => i,
    };
    let param = param_of(base).or(param_of(i));
    let seq = param.is_none()
        && matches!(
            s.storages[base].kind,
            StorageKind::Activation
                | StorageKind::Extra
                | StorageKind::Cast
                | StorageKind::Copy
                | StorageKind::ActivationGrad
                | StorageKind::GradTemp
        );
    Share {
        tp: tp[i],
        seq,
        expert: param.is_some_and(|p| is_expert(&s.storages[p].name)),
    }
}

/// Sequence parallelism's all-gathers: each column-parallel Linear's forward step
/// (and its backward steps) with the whole size of its activation input.
fn gathered_inputs(s: &Schedule, f: &Facts) -> Vec<(usize, u64)> {
    let mut by_node: HashMap<_, u64> = HashMap::new();
    let mut out = Vec::new();
    for (i, st) in s.steps.iter().enumerate() {
        let col = st.reads.iter().filter_map(|&r| f.root[r]).any(|p| {
            matches!(
                role(&s.storages[p].name),
                Some(Role::Column | Role::VocabHead)
            )
        });
        if st.kind != StepKind::Forward || !LINEAR.contains(&st.op.as_str()) || !col {
            continue;
        }
        let input = st
            .reads
            .iter()
            .filter(|&&r| f.root[r].is_none())
            .map(|&r| s.storages[r].bytes)
            .max()
            .unwrap_or(0);
        out.push((i, input));
        if let Some(n) = st.node {
            by_node.insert(n, input);
        }
    }
    for (i, st) in s.steps.iter().enumerate() {
        if st.kind == StepKind::Backward {
            if let Some(&b) = st.node.and_then(|n| by_node.get(&n)) {
                out.push((i, b));
            }
        }
    }
    out
}

/// The keys' and values' share of a fused q/k/v projection's output, as widths
/// `(k + v, q + k + v)`: the queries are as wide as the projection's input (the
/// hidden size, `heads × head size`), the keys and values split the rest evenly (GQA:
/// phi3's 8 heads and 4 key/value heads give a half, not two thirds). After a
/// separate query projection (`q_seen`) the output is keys and values alone. `None`
/// when the widths say otherwise.
fn fused_kv(s: &Schedule, f: &Facts, st: &crate::train::Step, q_seen: bool) -> Option<(u64, u64)> {
    let width = |k: StorageId| s.storages[k].shape.last().map(|&d| d as u64);
    let out = width(*st.writes.first()?)?;
    if q_seen {
        return Some((out, out));
    }
    let hidden = st
        .reads
        .iter()
        .find(|&&r| f.root[r].is_none())
        .and_then(|&r| width(r))?;
    let kv = out.checked_sub(hidden)?;
    (kv > 0 && kv % 2 == 0).then_some((kv, out))
}

/// Context parallelism's ring: per attention (the first Softmax or attention op
/// after a value projection), its forward and backward steps with the bytes of the
/// keys and values it reads around the ring (the unsplit projections' outputs).
fn ring_blocks(s: &Schedule, f: &Facts) -> Vec<(usize, u64)> {
    let out_bytes =
        |i: usize| -> u64 { s.steps[i].writes.iter().map(|&w| s.storages[w].bytes).sum() };
    let mut out = Vec::new();
    let (mut kv, mut q_seen) = (0u64, false);
    let mut nodes = HashMap::new();
    for i in 0..s.steps.len() {
        match projection(s, f, &s.steps[i]) {
            Some(Proj::K | Proj::V) => kv += out_bytes(i),
            Some(Proj::Q) => q_seen = true,
            Some(Proj::Fused) => {
                let (kv_width, width) = fused_kv(s, f, &s.steps[i], q_seen).unwrap_or((2, 3));
                kv += out_bytes(i) * kv_width / width;
            }
            None => {}
        }
        let op = s.steps[i].op.as_str();
        let attention = op == "Softmax" || op.contains("Attention");
        if kv > 0 && s.steps[i].kind == StepKind::Forward && attention {
            out.push((i, kv));
            if let Some(n) = s.steps[i].node {
                nodes.insert(n, kv);
            }
            (kv, q_seen) = (0, false);
        }
    }
    for (i, st) in s.steps.iter().enumerate() {
        if st.kind == StepKind::Backward {
            if let Some(&b) = st.node.and_then(|n| nodes.get(&n)) {
                out.push((i, b));
            }
        }
    }
    out
}

/// A transient storage of `bytes` written by step `at` (freed after it).
fn add_transient(s: &mut Schedule, at: usize, name: &str, bytes: u64) {
    let kind = if s.steps[at].kind == StepKind::Forward {
        StorageKind::Activation
    } else {
        StorageKind::GradTemp
    };
    let id = s.add_storage(format!("{name} ({})", s.steps[at].name), bytes, kind);
    s.steps[at].writes.push(id);
}
