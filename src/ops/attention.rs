//! `Attention` (opset 23, default domain): scaled dot-product attention with
//! grouped/multi-query heads, masks, a key/value cache and softcapping, as
//! `torch.nn.functional.scaled_dot_product_attention` runs it.
//!
//! Forms (the ONNX spec and its reference implementation):
//! - 4-D inputs `Q [B, Hq, Sq, D]`, `K [B, Hkv, Skv, D]`, `V [B, Hkv, Skv, Dv]`, or
//!   3-D inputs `Q [B, Sq, Hq·D]`, `K [B, Skv, Hkv·D]`, `V [B, Skv, Hkv·Dv]` with the
//!   `q_num_heads` and `kv_num_heads` attributes (then `Y` is `[B, Sq, Hq·Dv]`);
//! - grouped-query heads: `Hq` a multiple of `Hkv`, q head `h` reading kv head
//!   `h / (Hq / Hkv)` (numpy's `repeat`);
//! - `past_key [B, Hkv, P, D]` and `past_value [B, Hkv, P, Dv]` (both or neither),
//!   concatenated before the new keys: `St = P + Skv` keys in all;
//! - `attn_mask` broadcasting (right-aligned) to `[B, Hq, Sq, St]`, bool (`false`
//!   masks) or numeric (added to the scores); its last axis may be shorter than `St`
//!   and is padded with masked positions (the reference pads it, it never broadcasts);
//! - `is_causal`: query `i` sees key `j` iff `j ≤ i + offset` (bottom-right, the
//!   offset `P`), composed with the mask by adding the biases;
//! - `scale` (default `1/√D`), `softcap` (`c·tanh(s/c)` before the mask, when > 0),
//!   `softmax_precision` (checked; the CPU kernel always works in f64);
//! - outputs `Y`, `present_key [B, Hkv, St, D]`, `present_value [B, Hkv, St, Dv]`
//!   and `qk_matmul_output [B, Hq, Sq, St]`, of `qk_matmul_output_mode` 0 (the scaled
//!   `Q·Kᵀ`, as the spec says), 1 (after softcap), 2 (plus the mask) or 3 (after the
//!   softmax);
//! - from opset 24, `nonpad_kv_seqlen [B]` (int64, input 6; keys `j ≥ n[b]` masked,
//!   causal offset `n[b] − Sq`; not with a cache); from opset 25, the sliding window
//!   (`left_window_size`, `right_window_size`, −1 unbounded).
//!
//! A query row whose every key is masked gives a zero row of `Y` (and of mode 3's
//! output), as the spec's errata says, not NaN.

use rayon::prelude::*;

use super::{
    Arity, Autocast, Backward, BackwardCx, CudaKernels, Cx, Fact, Grad, KernelCx, Op, Registry,
    RuleResult, Saved, Storage,
};
use crate::ir::{Attrs, DType, Node};
use crate::numeric::Tensor;

/// Physical dim order of `scaled_dot_product_attention`'s `[B, H, S, D]` output in
/// float32 on a GPU: `[B, S, H, D]`. PyTorch's CUDA SDPA runs float32 through the
/// memory-efficient kernel (flash attention takes half precision only, and no
/// mask), which allocates its output as `[B, S, H, D]` whatever the query's layout
/// (`_efficient_attention_forward`, aten/src/ATen/native/transformers/cuda/
/// attention.cu); flash attention and the CPU kernel write the query's layout
/// (the fused pattern's `out_layout`); so did cuDNN's kernel, which PyTorch 2.11 ran
/// under autocast on an H200 (tools/gpu-sdpa-layout.py). Where the model's following
/// transpose does not restore `[B, S, H, D]` (`nn.MultiheadAttention`'s `permute(2, 0, 1, 3)`), the
/// reshape after it copies, and `out_proj` saves the copy beside the output the
/// kernel saves: one tensor a layer more than on the CPU (vit_b_16 on an H200,
/// tests/data/pytorch/training_reference_cuda_h200.json).
pub const SDPA_F32_LAYOUT: [usize; 4] = [0, 2, 1, 3];

/// Sizes of one application (after the 3-D inputs are split into heads).
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    hq: usize,
    hkv: usize,
    sq: usize,
    skv: usize,
    /// Cached keys (`past_key`'s axis 2; 0 without a cache).
    past: usize,
    d: usize,
    dv: usize,
    three_d: bool,
    has_past: bool,
}

impl Dims {
    /// Keys in all, `P + Skv`.
    fn st(&self) -> usize {
        self.past + self.skv
    }
    /// Q heads per kv head.
    fn group(&self) -> usize {
        self.hq / self.hkv
    }
    /// Scores, `B·Hq·Sq·St`.
    fn scores(&self) -> u64 {
        [self.b, self.hq, self.sq, self.st()]
            .iter()
            .fold(1u64, |a, &x| a.saturating_mul(x as u64))
    }
    fn y_shape(&self) -> Vec<usize> {
        if self.three_d {
            vec![self.b, self.sq, self.hq * self.dv]
        } else {
            vec![self.b, self.hq, self.sq, self.dv]
        }
    }
}

/// Whether output `i` of the node is declared (not omitted).
fn declared(node: &Node, i: usize) -> bool {
    matches!(node.outputs.get(i), Some(Some(_)))
}

/// The positive integer attribute `name`, if given.
fn heads_attr(attrs: &Attrs, name: &str) -> RuleResult<Option<usize>> {
    match attrs.int(name) {
        None => Ok(None),
        Some(v) if v > 0 => Ok(Some(v as usize)),
        Some(v) => Err(format!("{name} must be positive, got {v}").into()),
    }
}

/// Checks the input shapes (`shape(i)`: input `i`'s shape, `None` when omitted)
/// against each other and the attributes, and gives the sizes.
fn dims(
    attrs: &Attrs,
    opset: i64,
    shape: &dyn Fn(usize) -> Option<Vec<usize>>,
) -> RuleResult<Dims> {
    let req = |i: usize, what: &str| {
        shape(i).ok_or_else(|| {
            crate::numeric::RuleError::Invalid(format!("input {i} ({what}) is required"))
        })
    };
    let (q, k, v) = (req(0, "Q")?, req(1, "K")?, req(2, "V")?);
    if q.len() != k.len() || q.len() != v.len() {
        return Err(format!("Q {q:?}, K {k:?} and V {v:?} must all be 3-D or all 4-D").into());
    }
    let qh = heads_attr(attrs, "q_num_heads")?;
    let kvh = heads_attr(attrs, "kv_num_heads")?;
    let (hq, hkv, sq, skv, d, dv, three_d) = match q.len() {
        3 => {
            let (Some(hq), Some(hkv)) = (qh, kvh) else {
                return Err(
                    "3-D Q, K and V need the q_num_heads and kv_num_heads attributes".into(),
                );
            };
            if q[2] % hq != 0 {
                return Err(format!(
                    "Q's hidden size {} is not a multiple of q_num_heads {hq}",
                    q[2]
                )
                .into());
            }
            if k[2] % hkv != 0 || v[2] % hkv != 0 {
                return Err(format!(
                    "K's hidden size {} and V's {} must be multiples of kv_num_heads {hkv}",
                    k[2], v[2]
                )
                .into());
            }
            (hq, hkv, q[1], k[1], q[2] / hq, v[2] / hkv, true)
        }
        4 => {
            for (a, given, dim) in [("q_num_heads", qh, q[1]), ("kv_num_heads", kvh, k[1])] {
                if given.is_some_and(|g| g != dim) {
                    return Err(format!(
                        "{a} {} disagrees with the 4-D input's {dim} heads",
                        given.unwrap_or(0)
                    )
                    .into());
                }
            }
            if v[1] != k[1] {
                return Err(format!("V has {} heads, K {}", v[1], k[1]).into());
            }
            (q[1], k[1], q[2], k[2], q[3], v[3], false)
        }
        r => return Err(format!("Q, K and V must be 3-D or 4-D, got rank {r}").into()),
    };
    let kd = if three_d { k[2] / hkv } else { k[3] };
    if kd != d {
        return Err(format!("the head size of Q is {d}, of K {kd}: they must agree").into());
    }
    if q[0] != k[0] || q[0] != v[0] {
        return Err(format!("batch sizes differ: Q {}, K {}, V {}", q[0], k[0], v[0]).into());
    }
    if k[1 + usize::from(!three_d)] != v[1 + usize::from(!three_d)] {
        return Err(format!("K {k:?} and V {v:?} have different sequence lengths").into());
    }
    if hkv == 0 || hq % hkv != 0 {
        return Err(format!("q_num_heads {hq} is not a multiple of kv_num_heads {hkv}").into());
    }
    let b = q[0];
    let (pk, pv) = (shape(4), shape(5));
    let past = match (&pk, &pv) {
        (None, None) => 0,
        (Some(pk), Some(pv)) => {
            if pk.len() != 4 || pk[..2] != [b, hkv] || pk[3] != d {
                return Err(format!("past_key is {pk:?}, expected [{b}, {hkv}, past, {d}]").into());
            }
            if pv.len() != 4 || pv[..3] != pk[..3] || pv[3] != dv {
                return Err(format!(
                    "past_value is {pv:?}, expected [{b}, {hkv}, {}, {dv}]",
                    pk[2]
                )
                .into());
            }
            pk[2]
        }
        _ => return Err("past_key and past_value must be given together".into()),
    };
    let dims = Dims {
        b,
        hq,
        hkv,
        sq,
        skv,
        past,
        d,
        dv,
        three_d,
        has_past: pk.is_some(),
    };
    if let Some(n) = shape(6) {
        if opset < 24 {
            return Err(format!(
                "nonpad_kv_seqlen (input 6) needs opset 24, the model has {opset}"
            )
            .into());
        }
        if dims.has_past {
            return Err("nonpad_kv_seqlen cannot be combined with past_key and past_value".into());
        }
        if n != [b] {
            return Err(format!("nonpad_kv_seqlen is {n:?}, expected [{b}]").into());
        }
    }
    if let Some(m) = shape(3) {
        let want = [b, hq, sq, dims.st()];
        let ok = !m.is_empty()
            && m.len() <= 4
            && m[m.len() - 1] <= dims.st()
            && m[..m.len() - 1]
                .iter()
                .zip(&want[4 - m.len()..3])
                .all(|(&a, &t)| a == 1 || a == t);
        if !ok {
            return Err(format!(
                "attn_mask {m:?} does not broadcast to {want:?} (its last axis may be shorter, not longer)"
            )
            .into());
        }
    }
    Ok(dims)
}

/// The attributes that shape the scores.
#[derive(Debug, Clone, Copy)]
struct Params {
    scale: f64,
    /// `c` of `c·tanh(s/c)`, when positive.
    softcap: Option<f64>,
    causal: bool,
    mode: i64,
    /// Sliding window (opset 25), −1 unbounded.
    window: (i64, i64),
}

fn params(attrs: &Attrs, opset: i64, d: &Dims) -> RuleResult<Params> {
    let mode = attrs.int_or("qk_matmul_output_mode", 0);
    if !(0..=3).contains(&mode) {
        return Err(format!("qk_matmul_output_mode must be 0, 1, 2 or 3, got {mode}").into());
    }
    if let Some(p) = attrs.int("softmax_precision") {
        if !matches!(p, 1 | 10 | 11 | 16) {
            return Err(format!(
                "softmax_precision {p} is not a float type code (1, 10, 11 or 16)"
            )
            .into());
        }
    }
    let window = if opset >= 25 {
        (
            attrs.int_or("left_window_size", -1),
            attrs.int_or("right_window_size", -1),
        )
    } else {
        (-1, -1)
    };
    if window.0 < -1 || window.1 < -1 {
        return Err(format!("window sizes must be -1 or non-negative, got {window:?}").into());
    }
    let scale = match attrs.float("scale") {
        Some(s) => s as f64,
        None if d.d > 0 => 1.0 / (d.d as f64).sqrt(),
        None => 1.0,
    };
    let softcap = attrs
        .float("softcap")
        .map(|c| c as f64)
        .filter(|&c| c > 0.0);
    Ok(Params {
        scale,
        softcap,
        causal: attrs.int_or("is_causal", 0) != 0,
        mode,
        window,
    })
}

/// What the backward reads besides the query, the output and the logsumexp.
struct SavedSlots {
    /// The full keys and values (past included).
    k: Saved,
    v: Saved,
    /// The mask: the input, or for a boolean one the float mask PyTorch converts it
    /// to (`0` / `-inf` in the query's type) and saves; `None` without one.
    mask: Option<Saved>,
    /// What the forward makes for backward: the logsumexp first, then the
    /// concatenations no declared output holds, then the float mask.
    extras: Vec<Fact>,
}

/// Where the backward finds what it reads ([`SavedSlots`]). `mask`: input 3's fact;
/// `qt`: the query's type.
fn saved_layout(
    node: &Node,
    d: &Dims,
    (qt, kt, vt): (DType, DType, DType),
    mask: Option<&Fact>,
) -> SavedSlots {
    let mut extras = vec![Fact::new(DType::F32, vec![d.b, d.hq, d.sq])];
    let mut slot = |input: usize, out: usize, dt: DType, head: usize| {
        if !d.has_past {
            Saved::Input(input)
        } else if declared(node, out) {
            Saved::Output(out)
        } else {
            extras.push(Fact::new(dt, vec![d.b, d.hkv, d.st(), head]));
            Saved::Extra(extras.len() - 1)
        }
    };
    let k = slot(1, 1, kt, d.d);
    let v = slot(2, 2, vt, d.dv);
    let mask = mask.map(|m| {
        if m.dtype == DType::Bool {
            extras.push(Fact::new(qt, m.shape.clone()));
            Saved::Extra(extras.len() - 1)
        } else {
            Saved::Input(3)
        }
    });
    SavedSlots { k, v, mask, extras }
}

/// `Attention(Q, K, V, attn_mask?, past_key?, past_value?, nonpad_kv_seqlen?) ->
/// (Y, present_key?, present_value?, qk_matmul_output?)`; the forms are in the
/// module's documentation.
///
/// FLOPs, with `N = B·Hq·Sq·St` scores: `2·N·D` for `Q·Kᵀ`, 5 per score for the
/// scale, the mask and the softmax (max, subtract, exp, sum, divide), 3 more per
/// score with a softcap (divide, tanh, multiply), and `2·N·Dv` for `P·V`.
struct Attention;

impl Op for Attention {
    fn arity(&self) -> Arity {
        Arity::new(3, 7, 1, 4)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let d = dims(cx.attrs(), cx.opset, &|i| {
            cx.opt(i).map(|f| f.shape.clone())
        })?;
        params(cx.attrs(), cx.opset, &d)?;
        let (q, k, v) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
        if !q.dtype.is_float() || !v.dtype.is_float() {
            return Err(format!(
                "Q and V must be floating point, got {} and {}",
                q.dtype, v.dtype
            )
            .into());
        }
        if k.dtype != q.dtype {
            return Err(format!("K is {}, Q {}: they must agree", k.dtype, q.dtype).into());
        }
        for (i, want) in [(4, q.dtype), (5, v.dtype)] {
            if let Some(f) = cx.opt(i) {
                if f.dtype != want {
                    return Err(format!("input {i} is {}, expected {want}", f.dtype).into());
                }
            }
        }
        if let Some(m) = cx.opt(3) {
            if !(m.dtype.is_float() || m.dtype.is_int()) {
                return Err(format!("attn_mask must be bool or numeric, got {}", m.dtype).into());
            }
        }
        if let Some(n) = cx.opt(6) {
            if n.dtype != DType::I64 {
                return Err(format!("nonpad_kv_seqlen must be int64, got {}", n.dtype).into());
            }
        }
        let mut out = vec![Fact::new(q.dtype, d.y_shape())];
        let rest = [
            Fact::new(q.dtype, vec![d.b, d.hkv, d.st(), d.d]),
            Fact::new(v.dtype, vec![d.b, d.hkv, d.st(), d.dv]),
            Fact::new(q.dtype, vec![d.b, d.hq, d.sq, d.st()]),
        ];
        out.extend(rest.into_iter().take(cx.n_outputs().saturating_sub(1)));
        Ok(out)
    }
    fn flops(&self, cx: &Cx, _out: &[Fact]) -> u64 {
        let Ok(d) = dims(cx.attrs(), cx.opset, &|i| {
            cx.opt(i).map(|f| f.shape.clone())
        }) else {
            return 0;
        };
        let cap = params(cx.attrs(), cx.opset, &d).is_ok_and(|p| p.softcap.is_some());
        let n = d.scores();
        n.saturating_mul(2 * d.d as u64)
            .saturating_add(n.saturating_mul(if cap { 8 } else { 5 }))
            .saturating_add(n.saturating_mul(2 * d.dv as u64))
    }
    /// As SDPA's memory-efficient and flash backends on CUDA save: the query, the
    /// full key and value (past included: `present_key`/`present_value` when the
    /// node declares them and a cache is given, else an extra holding the
    /// concatenation; without a cache the inputs themselves), the output `Y`, the
    /// per-row logsumexp (an extra, float32 `[B, Hq, Sq]`), the mask when given (a
    /// numeric one as it is; a boolean one as the `0` / `-inf` mask of the query's
    /// type PyTorch makes of it, an extra) and `nonpad_kv_seqlen`, which rebuilds it. Gradients for Q, K, V, and
    /// past_key/past_value when given; none for the mask.
    ///
    /// Backward FLOPs, `N = B·Hq·Sq·St`: `2·N·(3·D + 2·Dv)` for the five products
    /// (recomputing `S = Q·Kᵀ`, `dV = Pᵀ·dY`, `dP = dY·Vᵀ`, `dQ = dS·K`,
    /// `dK = dSᵀ·Q`), 5 per score (scale, mask, `exp(S − lse)`, `P∘(dP − δ)`), 5
    /// more with a softcap (its recomputation and derivative), and `2·B·Hq·Sq·Dv`
    /// for `δ = rowsum(dY∘Y)`.
    fn backward(&self, cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        let d = dims(cx.attrs(), cx.opset, &|i| {
            cx.opt(i).map(|f| f.shape.clone())
        })?;
        let p = params(cx.attrs(), cx.opset, &d)?;
        let types = (cx.input(0)?.dtype, cx.input(1)?.dtype, cx.input(2)?.dtype);
        let slots = saved_layout(cx.node, &d, types, cx.opt(3));
        let mut needs = vec![
            Saved::Input(0),
            slots.k,
            slots.v,
            Saved::Output(0),
            Saved::Extra(0),
        ];
        needs.extend(slots.mask);
        if cx.opt(6).is_some() {
            needs.push(Saved::Input(6));
        }
        let extras = slots.extras;
        let mut inputs = vec![0, 1, 2];
        if d.has_past {
            inputs.extend([4, 5]);
        }
        let n = d.scores();
        let per_score = if p.softcap.is_some() { 10 } else { 5 };
        let flops = n
            .saturating_mul(2 * (3 * d.d as u64 + 2 * d.dv as u64))
            .saturating_add(n.saturating_mul(per_score))
            .saturating_add(
                [d.b, d.hq, d.sq, 2 * d.dv]
                    .iter()
                    .fold(1u64, |a, &x| a.saturating_mul(x as u64)),
            );
        Ok(Some(Backward {
            grads: inputs
                .into_iter()
                .map(|input| Grad {
                    input,
                    needs: needs.clone(),
                })
                .collect(),
            extras,
            flops,
        }))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// `Y` in 4-D as PyTorch's kernels write it: [`SDPA_F32_LAYOUT`] in float32 or
    /// with a mask (the memory-efficient kernel), else the query's layout (flash
    /// attention); the 3-D form and the other outputs contiguous.
    fn out_strides(
        &self,
        cx: &Cx,
        k: usize,
        out: &Fact,
        strides: &[Option<&[usize]>],
    ) -> Vec<usize> {
        if k != 0 || out.shape.len() != 4 {
            return super::layout::contiguous(&out.shape);
        }
        if out.dtype == DType::F32 || cx.opt(3).is_some() {
            return super::layout::permuted(&out.shape, &SDPA_F32_LAYOUT);
        }
        match (
            cx.inputs.first().copied().flatten(),
            strides.first().copied().flatten(),
        ) {
            (Some(q), Some(s)) if q.shape == out.shape => s.to_vec(),
            _ => super::layout::contiguous(&out.shape),
        }
    }
    /// Per query row (f64 sums): the scaled scores against every key, softcap,
    /// the bias (mask, causal, padding, window), the softmax and `P·V`; a fully
    /// masked row gives zeros. `present_key`/`present_value` are the
    /// concatenations, `qk_matmul_output` per its mode. With [`KernelCx::extras`],
    /// the logsumexp (float32 `[B, Hq, Sq]`, `+∞` for a fully masked row), the
    /// concatenations no declared output holds and the float mask of a boolean one
    /// follow the declared outputs.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let d = dims(cx.attrs(), cx.opset, &|i| {
            cx.opt(i).map(|t| t.shape.clone())
        })?;
        let p = params(cx.attrs(), cx.opset, &d)?;
        let (qt, kt, vt) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
        let q = heads(&qt.to_f32()?, &d, d.hq, d.sq, d.d);
        let k_new = heads(&kt.to_f32()?, &d, d.hkv, d.skv, d.d);
        let v_new = heads(&vt.to_f32()?, &d, d.hkv, d.skv, d.dv);
        let bh = d.b * d.hkv;
        let (k, v) = match (cx.opt(4), cx.opt(5)) {
            (Some(pk), Some(pv)) => (
                concat_seq(&pk.to_f32()?, &k_new, bh, d.past, d.skv, d.d),
                concat_seq(&pv.to_f32()?, &v_new, bh, d.past, d.skv, d.dv),
            ),
            _ => (k_new, v_new),
        };
        let bias = Bias::new(&d, &p, cx.opt(3), cx.opt(6))?;
        let want_qk = cx.outputs.get(3).is_some_and(|o| o.is_some());
        let fwd = forward(&d, &p, &bias, &q, &k, &v, want_qk);
        let y = if d.three_d {
            unheads(&fwd.y, &d, d.hq, d.sq, d.dv)
        } else {
            fwd.y
        };
        let mut outs = vec![Tensor::from_f32(qt.dtype(), d.y_shape(), y)?];
        let kv_shape = |h: usize| vec![d.b, d.hkv, d.st(), h];
        let mut qk = Some(fwd.qk);
        for i in 1..cx.n_outputs() {
            let Some(f) = cx.outputs[i] else {
                outs.push(Tensor::f32(vec![0], vec![]));
                continue;
            };
            outs.push(match i {
                1 => Tensor::from_f32(f.dtype, kv_shape(d.d), k.clone())?,
                2 => Tensor::from_f32(f.dtype, kv_shape(d.dv), v.clone())?,
                _ => Tensor::from_f32(f.dtype, f.shape.clone(), qk.take().unwrap_or_default())?,
            });
        }
        if cx.extras {
            outs.push(Tensor::f32(vec![d.b, d.hq, d.sq], fwd.lse));
            let mask = cx.opt(3);
            let mask_fact = mask.map(|m| Fact::new(m.dtype(), m.shape.clone()));
            let types = (qt.dtype(), kt.dtype(), vt.dtype());
            let slots = saved_layout(cx.node, &d, types, mask_fact.as_ref());
            if matches!(slots.k, Saved::Extra(_)) {
                outs.push(Tensor::from_f32(kt.dtype(), kv_shape(d.d), k)?);
            }
            if matches!(slots.v, Saved::Extra(_)) {
                outs.push(Tensor::from_f32(vt.dtype(), kv_shape(d.dv), v)?);
            }
            if let (Some(Saved::Extra(_)), Some(m)) = (slots.mask, mask) {
                outs.push(Tensor::from_f32(qt.dtype(), m.shape.clone(), bool_bias(m))?);
            }
        }
        Ok(outs)
    }
    /// From the saved tensors only, per query row: the scores again,
    /// `P = exp(S − lse)`, `dV += Pᵀ·dY`, `dP = dY·Vᵀ`, `dS = P∘(dP − rowsum(dY∘Y))`,
    /// through the softcap's derivative, `dQ = dS·K·scale`, `dK += dSᵀ·Q·scale`
    /// (summed over the q heads sharing a kv head). Gradients reaching
    /// `present_key`/`present_value` add to the full keys and values, which split
    /// into the cache's and the new part; one reaching `qk_matmul_output` enters at
    /// its mode's point (the scores, after the softcap, or the probabilities).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let d = dims(cx.attrs(), cx.opset, &|i| {
            cx.inputs.get(i).copied().flatten().map(|f| f.shape.clone())
        })?;
        let p = params(cx.attrs(), cx.opset, &d)?;
        let types = (cx.input(0)?.dtype, cx.input(1)?.dtype, cx.input(2)?.dtype);
        let slots = saved_layout(cx.node, &d, types, cx.inputs.get(3).copied().flatten());
        let (ks, vs) = (slots.k, slots.v);
        let q = heads(&cx.saved(Saved::Input(0))?.to_f32()?, &d, d.hq, d.sq, d.d);
        let full = |s: Saved, h: usize| -> RuleResult<Vec<f32>> {
            let t = cx.saved(s)?.to_f32()?;
            Ok(if matches!(s, Saved::Input(_)) {
                heads(&t, &d, d.hkv, d.skv, h)
            } else {
                t.into_owned()
            })
        };
        let (k, v) = (full(ks, d.d)?, full(vs, d.dv)?);
        let y = heads(&cx.saved(Saved::Output(0))?.to_f32()?, &d, d.hq, d.sq, d.dv);
        let lse = cx.saved(Saved::Extra(0))?.to_f32()?.into_owned();
        let mask = match slots.mask {
            Some(m) => Some(cx.saved(m)?),
            None => None,
        };
        let nonpad = match cx.inputs.get(6).copied().flatten() {
            Some(_) => Some(cx.saved(Saved::Input(6))?),
            None => None,
        };
        let bias = Bias::new(&d, &p, mask, nonpad)?;
        let dy = heads(&cx.grad(0)?, &d, d.hq, d.sq, d.dv);
        let incoming = |i: usize| -> RuleResult<Option<Vec<f32>>> {
            match cx.grads.get(i).copied().flatten() {
                Some(_) => Ok(Some(cx.grad(i)?.into_owned())),
                None => Ok(None),
            }
        };
        let g_qk = incoming(3)?;
        let saved = SavedRows {
            q: &q,
            k: &k,
            v: &v,
            y: &y,
            lse: &lse,
            dy: &dy,
            g_qk: g_qk.as_deref(),
        };
        let (dq, mut dk, mut dv) = backward(&d, &p, &bias, &saved);
        for (i, acc) in [(1, &mut dk), (2, &mut dv)] {
            if let Some(g) = incoming(i)? {
                acc.iter_mut().zip(&g).for_each(|(a, b)| *a += b);
            }
        }
        let bh = d.b * d.hkv;
        let (dpk, dk) = split_seq(&dk, bh, d.past, d.skv, d.d);
        let (dpv, dv) = split_seq(&dv, bh, d.past, d.skv, d.dv);
        let (dq, dk, dv) = if d.three_d {
            (
                unheads(&dq, &d, d.hq, d.sq, d.d),
                unheads(&dk, &d, d.hkv, d.skv, d.d),
                unheads(&dv, &d, d.hkv, d.skv, d.dv),
            )
        } else {
            (dq, dk, dv)
        };
        let all = [(0, dq), (1, dk), (2, dv), (4, dpk), (5, dpv)];
        cx.answer(all.into_iter().filter(|(i, _)| cx.wants(*i)).collect())
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    /// scaled_dot_product_attention is on autocast's lower-precision list.
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Half
    }
}

/// `[B, S, H·X]` (3-D) to `[B, H, S, X]`; 4-D data is already so.
fn heads(x: &[f32], d: &Dims, h: usize, s: usize, w: usize) -> Vec<f32> {
    if !d.three_d {
        return x.to_vec();
    }
    let mut out = vec![0f32; x.len()];
    for b in 0..d.b {
        for si in 0..s {
            for hi in 0..h {
                let src = ((b * s + si) * h + hi) * w;
                let dst = ((b * h + hi) * s + si) * w;
                out[dst..dst + w].copy_from_slice(&x[src..src + w]);
            }
        }
    }
    out
}

/// `[B, H, S, X]` back to `[B, S, H·X]`.
fn unheads(x: &[f32], d: &Dims, h: usize, s: usize, w: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for b in 0..d.b {
        for si in 0..s {
            for hi in 0..h {
                let dst = ((b * s + si) * h + hi) * w;
                let src = ((b * h + hi) * s + si) * w;
                out[dst..dst + w].copy_from_slice(&x[src..src + w]);
            }
        }
    }
    out
}

/// `[BH, P, X]` and `[BH, S, X]` concatenated along the sequence.
fn concat_seq(past: &[f32], cur: &[f32], bh: usize, p: usize, s: usize, w: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(bh * (p + s) * w);
    for i in 0..bh {
        out.extend_from_slice(&past[i * p * w..(i + 1) * p * w]);
        out.extend_from_slice(&cur[i * s * w..(i + 1) * s * w]);
    }
    out
}

/// The inverse of [`concat_seq`].
fn split_seq(full: &[f32], bh: usize, p: usize, s: usize, w: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut a, mut b) = (
        Vec::with_capacity(bh * p * w),
        Vec::with_capacity(bh * s * w),
    );
    for i in 0..bh {
        let row = &full[i * (p + s) * w..(i + 1) * (p + s) * w];
        a.extend_from_slice(&row[..p * w]);
        b.extend_from_slice(&row[p * w..]);
    }
    (a, b)
}

/// The additive bias of every score: the mask (bool: 0 or −∞; numeric: its
/// value; −∞ past its last axis), the causal and window frontiers and the padding
/// of `nonpad_kv_seqlen` (0 or −∞).
struct Bias {
    /// Mask values (bool already as 0/−∞), its strides over `[B, Hq, Sq]` (0 where
    /// broadcast) and its last axis.
    mask: Option<(Vec<f32>, [usize; 3], usize)>,
    causal: bool,
    window: (i64, i64),
    /// Keys before the query block, per batch.
    offset: Vec<i64>,
    /// Valid keys per batch.
    nonpad: Option<Vec<i64>>,
}

/// A boolean mask as the additive one PyTorch makes of it: `0` where set, `-inf`
/// where masked.
fn bool_bias(m: &Tensor) -> Vec<f32> {
    m.to_i64s()
        .into_iter()
        .map(|x| if x != 0 { 0.0 } else { f32::NEG_INFINITY })
        .collect()
}

impl Bias {
    fn new(
        d: &Dims,
        p: &Params,
        mask: Option<&Tensor>,
        nonpad: Option<&Tensor>,
    ) -> RuleResult<Bias> {
        let mask = match mask {
            None => None,
            Some(m) => {
                let vals: Vec<f32> = if m.dtype() == DType::Bool {
                    bool_bias(m)
                } else if m.dtype().is_float() {
                    m.to_f32()?.into_owned()
                } else {
                    m.to_f64s().into_iter().map(|x| x as f32).collect()
                };
                let mut shape = vec![1usize; 4 - m.rank()];
                shape.extend_from_slice(&m.shape);
                let last = shape[3];
                let mut strides = [0usize; 3];
                let mut acc = last;
                for a in (0..3).rev() {
                    strides[a] = if shape[a] == 1 { 0 } else { acc };
                    acc *= shape[a];
                }
                Some((vals, strides, last))
            }
        };
        let nonpad = nonpad.map(|t| t.to_i64s());
        let offset = (0..d.b)
            .map(|b| match &nonpad {
                Some(n) if !d.has_past => n[b] - d.sq as i64,
                _ => d.past as i64,
            })
            .collect();
        Ok(Bias {
            mask,
            causal: p.causal,
            window: p.window,
            offset,
            nonpad,
        })
    }

    /// The bias of query row `(b, h, i)` against every key, into `out`.
    fn row(&self, b: usize, h: usize, i: usize, out: &mut [f32]) {
        let off = self.offset[b] + i as i64;
        for (j, o) in out.iter_mut().enumerate() {
            let diff = off - j as i64;
            let masked = (self.causal && diff < 0)
                || (self.window.0 >= 0 && diff > self.window.0)
                || (self.window.1 >= 0 && -diff > self.window.1)
                || self.nonpad.as_ref().is_some_and(|n| j as i64 >= n[b]);
            *o = if masked { f32::NEG_INFINITY } else { 0.0 };
        }
        if let Some((vals, st, last)) = &self.mask {
            let base = b * st[0] + h * st[1] + i * st[2];
            for (j, o) in out.iter_mut().enumerate() {
                *o += if j < *last {
                    vals[base + j]
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
    }
}

/// One query row's scores: the scaled `q·k` (`raw`), after the softcap
/// (`capped`, with `tanh(raw/c)` in `t`), and with the bias (`logit`, −∞ where the
/// bias is).
struct Scores {
    raw: Vec<f64>,
    t: Vec<f64>,
    capped: Vec<f64>,
    logit: Vec<f64>,
    bias: Vec<f32>,
}

impl Scores {
    fn new(st: usize) -> Scores {
        Scores {
            raw: vec![0.0; st],
            t: vec![0.0; st],
            capped: vec![0.0; st],
            logit: vec![0.0; st],
            bias: vec![0.0; st],
        }
    }

    /// Fills the row for query `q` against keys `k` (`St × D`); `bias` is set.
    fn fill(&mut self, p: &Params, q: &[f32], k: &[f32], dd: usize) {
        for j in 0..self.raw.len() {
            let kr = &k[j * dd..(j + 1) * dd];
            let dot: f64 = q.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum();
            let raw = dot * p.scale;
            self.raw[j] = raw;
            let capped = match p.softcap {
                Some(c) => {
                    let t = (raw / c).tanh();
                    self.t[j] = t;
                    c * t
                }
                None => raw,
            };
            self.capped[j] = capped;
            let b = self.bias[j];
            self.logit[j] = if b == f32::NEG_INFINITY {
                f64::NEG_INFINITY
            } else {
                capped + b as f64
            };
        }
    }

    /// The softmax of the logits into `pr` and its logsumexp (`+∞`, and zeros,
    /// for a fully masked row).
    fn softmax(&self, pr: &mut [f64]) -> f64 {
        if self.bias.iter().all(|&b| b == f32::NEG_INFINITY) {
            pr.iter_mut().for_each(|x| *x = 0.0);
            return f64::INFINITY;
        }
        let m = self
            .logit
            .iter()
            .copied()
            .filter(|l| *l > f64::NEG_INFINITY)
            .fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = self.logit.iter().map(|&l| (l - m).exp()).sum();
        let lse = m + s.ln();
        for (x, &l) in pr.iter_mut().zip(&self.logit) {
            *x = (l - lse).exp();
        }
        lse
    }
}

/// The forward's results in the `[B, H, S, X]` layout.
struct Forward {
    y: Vec<f32>,
    lse: Vec<f32>,
    qk: Vec<f32>,
}

fn forward(
    d: &Dims,
    p: &Params,
    bias: &Bias,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    want_qk: bool,
) -> Forward {
    let (st, g) = (d.st(), d.group());
    let blocks: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..d.b * d.hq)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / d.hq, bh % d.hq);
            let kvh = b * d.hkv + h / g;
            let kb = &k[kvh * st * d.d..(kvh + 1) * st * d.d];
            let vb = &v[kvh * st * d.dv..(kvh + 1) * st * d.dv];
            let mut sc = Scores::new(st);
            let mut pr = vec![0f64; st];
            let mut y = vec![0f32; d.sq * d.dv];
            let mut lse = vec![0f32; d.sq];
            let mut qk = if want_qk {
                vec![0f32; d.sq * st]
            } else {
                Vec::new()
            };
            for i in 0..d.sq {
                bias.row(b, h, i, &mut sc.bias);
                let qr = &q[(bh * d.sq + i) * d.d..(bh * d.sq + i + 1) * d.d];
                sc.fill(p, qr, kb, d.d);
                lse[i] = sc.softmax(&mut pr) as f32;
                for (c, yo) in y[i * d.dv..(i + 1) * d.dv].iter_mut().enumerate() {
                    let acc: f64 = (0..st).map(|j| pr[j] * vb[j * d.dv + c] as f64).sum();
                    *yo = acc as f32;
                }
                if want_qk {
                    for (j, o) in qk[i * st..(i + 1) * st].iter_mut().enumerate() {
                        *o = match p.mode {
                            0 => sc.raw[j] as f32,
                            1 => sc.capped[j] as f32,
                            2 => sc.capped[j] as f32 + sc.bias[j],
                            _ => pr[j] as f32,
                        };
                    }
                }
            }
            (y, lse, qk)
        })
        .collect();
    let mut f = Forward {
        y: Vec::with_capacity(d.b * d.hq * d.sq * d.dv),
        lse: Vec::with_capacity(d.b * d.hq * d.sq),
        qk: Vec::new(),
    };
    for (y, lse, qk) in blocks {
        f.y.extend(y);
        f.lse.extend(lse);
        f.qk.extend(qk);
    }
    f
}

/// What the backward reads, in the `[B, H, S, X]` layout.
struct SavedRows<'a> {
    q: &'a [f32],
    /// Full keys `[B, Hkv, St, D]`.
    k: &'a [f32],
    /// Full values `[B, Hkv, St, Dv]`.
    v: &'a [f32],
    y: &'a [f32],
    lse: &'a [f32],
    dy: &'a [f32],
    /// The gradient reaching `qk_matmul_output`, `[B, Hq, Sq, St]`.
    g_qk: Option<&'a [f32]>,
}

/// `(dQ, dK_full, dV_full)`, one task per kv head.
fn backward(d: &Dims, p: &Params, bias: &Bias, s: &SavedRows) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (st, g) = (d.st(), d.group());
    let blocks: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..d.b * d.hkv)
        .into_par_iter()
        .map(|kvh| {
            let b = kvh / d.hkv;
            let kb = &s.k[kvh * st * d.d..(kvh + 1) * st * d.d];
            let vb = &s.v[kvh * st * d.dv..(kvh + 1) * st * d.dv];
            let mut dk = vec![0f64; st * d.d];
            let mut dv = vec![0f64; st * d.dv];
            let mut dq = vec![0f32; g * d.sq * d.d];
            let mut sc = Scores::new(st);
            let mut pr = vec![0f64; st];
            let mut ds = vec![0f64; st];
            for hg in 0..g {
                let h = (kvh % d.hkv) * g + hg;
                let bh = b * d.hq + h;
                for i in 0..d.sq {
                    let row = bh * d.sq + i;
                    bias.row(b, h, i, &mut sc.bias);
                    let qr = &s.q[row * d.d..(row + 1) * d.d];
                    sc.fill(p, qr, kb, d.d);
                    let lse = s.lse[row] as f64;
                    for (x, &l) in pr.iter_mut().zip(&sc.logit) {
                        *x = if lse.is_finite() {
                            (l - lse).exp()
                        } else {
                            0.0
                        };
                    }
                    let gy = &s.dy[row * d.dv..(row + 1) * d.dv];
                    let yr = &s.y[row * d.dv..(row + 1) * d.dv];
                    let delta: f64 = gy.iter().zip(yr).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let gq = s.g_qk.map(|x| &x[row * st..(row + 1) * st]);
                    // The probabilities' own gradient, mode 3: Σ_k P_k·G_k.
                    let gp_dot: f64 = match (p.mode, gq) {
                        (3, Some(gq)) => pr.iter().zip(gq).map(|(&a, &b)| a * b as f64).sum(),
                        _ => 0.0,
                    };
                    for j in 0..st {
                        let vr = &vb[j * d.dv..(j + 1) * d.dv];
                        let dp: f64 = gy.iter().zip(vr).map(|(&a, &b)| a as f64 * b as f64).sum();
                        let mut dl = pr[j] * (dp - delta);
                        let gj = gq.map_or(0.0, |x| x[j] as f64);
                        if p.mode == 3 {
                            dl += pr[j] * (gj - gp_dot);
                        }
                        let mut dc = dl;
                        if matches!(p.mode, 1 | 2) {
                            dc += gj;
                        }
                        let mut dr = match p.softcap {
                            Some(_) => dc * (1.0 - sc.t[j] * sc.t[j]),
                            None => dc,
                        };
                        if p.mode == 0 {
                            dr += gj;
                        }
                        ds[j] = dr * p.scale;
                        if pr[j] != 0.0 {
                            for (o, &a) in dv[j * d.dv..(j + 1) * d.dv].iter_mut().zip(gy) {
                                *o += pr[j] * a as f64;
                            }
                        }
                    }
                    let dqr = &mut dq[(hg * d.sq + i) * d.d..(hg * d.sq + i + 1) * d.d];
                    for (c, o) in dqr.iter_mut().enumerate() {
                        *o = (0..st).map(|j| ds[j] * kb[j * d.d + c] as f64).sum::<f64>() as f32;
                    }
                    for j in 0..st {
                        if ds[j] != 0.0 {
                            for (o, &a) in dk[j * d.d..(j + 1) * d.d].iter_mut().zip(qr) {
                                *o += ds[j] * a as f64;
                            }
                        }
                    }
                }
            }
            let f = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
            (dq, f(dk), f(dv))
        })
        .collect();
    let (mut dq, mut dk, mut dv) = (Vec::new(), Vec::new(), Vec::new());
    for (a, b, c) in blocks {
        dq.extend(a);
        dk.extend(b);
        dv.extend(c);
    }
    (dq, dk, dv)
}

pub(super) fn register(r: &mut Registry) {
    r.add("Attention", Attention);
}
