//! Losses a model computes itself: NegativeLogLikelihoodLoss and
//! SoftmaxCrossEntropyLoss (opset 12+), as `torch.nn.functional.nll_loss` and
//! `cross_entropy` export them.
//!
//! Both read class scores `[N, C, d1..dk]` and integer targets `[N, d1..dk]`, an
//! optional per-class weight `[C]`, `reduction` (`mean`, the default, `sum` or
//! `none`) and an optional `ignore_index`. Element `(n, d)` loses
//! `−w[t]·logp[n, t, d]` (`t` its target; 0 where `t` is ignored); `mean` divides
//! the sum by the summed weights of the targets not ignored, `none` keeps the
//! target's shape.

use super::{
    Arity, Autocast, Backward, BackwardCx, CudaKernels, Cx, Fact, Grad, KernelCx, Op, Registry,
    RuleResult, Saved, Storage,
};
use crate::ir::DType;
use crate::numeric::Tensor;

/// How a loss reduces.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reduction {
    Mean,
    Sum,
    None,
}

/// The losses' attributes.
struct LossAttrs {
    /// `reduction` (default "mean").
    reduction: Reduction,
    /// `ignore_index` (default: none).
    ignore_index: Option<i64>,
}

impl LossAttrs {
    fn of(attrs: &crate::ir::Attrs) -> RuleResult<LossAttrs> {
        let reduction = match attrs.string("reduction").unwrap_or("mean") {
            "mean" => Reduction::Mean,
            "sum" => Reduction::Sum,
            "none" => Reduction::None,
            r => return Err(format!("reduction '{r}' is not one of mean, sum, none").into()),
        };
        Ok(LossAttrs {
            reduction,
            ignore_index: attrs.int("ignore_index"),
        })
    }

    /// [`nll`] of the log-probabilities `lp` at the targets (input 1), weighted
    /// by input 2 when given: the loss and the summed weight.
    fn loss(
        &self,
        cx: &KernelCx,
        lp: &[f32],
        (c, inner): (usize, usize),
    ) -> RuleResult<(Vec<f32>, f64)> {
        let w = cx.opt(2).map(|w| w.to_f32()).transpose()?;
        nll(
            lp,
            &cx.input(1)?.to_i64s(),
            w.as_deref(),
            (c, inner),
            self.ignore_index,
            self.reduction,
        )
    }

    /// The saved targets (input 1) and their [`target_grads`] of the incoming
    /// gradient, from the saved summed weight (extra 0) and weights (input 2,
    /// when given).
    fn saved_target_grads(&self, cx: &BackwardCx) -> RuleResult<(Vec<i64>, Vec<f32>)> {
        let targets = cx.saved(Saved::Input(1))?.to_i64s();
        let total = cx.saved(Saved::Extra(0))?.to_f32()?[0];
        let w = match cx.inputs.get(2).copied().flatten() {
            Some(_) => Some(cx.saved(Saved::Input(2))?.to_f32()?),
            None => None,
        };
        let tg = target_grads(
            &targets,
            w.as_deref(),
            &cx.grad(0)?,
            total,
            self.ignore_index,
            self.reduction,
        );
        Ok((targets, tg))
    }
}

/// `(N, C, inner)` of scores `[N, C, d..]` after checking the target `[N, d..]`
/// and the weight `[C]`.
fn dims(cx: &Cx) -> RuleResult<(usize, usize, usize)> {
    let x = cx.input(0)?;
    let t = cx.input(1)?;
    if x.rank() < 2 {
        return Err(format!("scores must be [N, C, ...], got {:?}", x.shape).into());
    }
    if !x.dtype.is_float() {
        return Err(format!("scores must be floating point, got {}", x.dtype).into());
    }
    if !matches!(t.dtype, DType::I32 | DType::I64) {
        return Err(format!("target must be int32 or int64, got {}", t.dtype).into());
    }
    let mut want = vec![x.shape[0]];
    want.extend_from_slice(&x.shape[2..]);
    if t.shape != want {
        return Err(format!(
            "target is {:?}, expected {want:?} for scores {:?}",
            t.shape, x.shape
        )
        .into());
    }
    let c = x.shape[1];
    if let Some(w) = cx.opt(2) {
        if w.shape != [c] {
            return Err(format!("weight is {:?}, expected [{c}]", w.shape).into());
        }
    }
    Ok((x.shape[0], c, x.shape[2..].iter().product()))
}

fn loss_fact(cx: &Cx) -> RuleResult<Fact> {
    let shape = match LossAttrs::of(cx.attrs())?.reduction {
        Reduction::None => cx.input(1)?.shape.clone(),
        _ => vec![],
    };
    Ok(Fact::new(cx.input(0)?.dtype, shape))
}

/// The loss of log-probabilities `lp` (`[N, C, inner]`, flattened) against
/// `targets`: the loss (one per target for `none`, else one value) and the summed
/// weight of the targets not ignored, `mean`'s divisor. Sums in f64.
fn nll(
    lp: &[f32],
    targets: &[i64],
    weight: Option<&[f32]>,
    (c, inner): (usize, usize),
    ignore: Option<i64>,
    red: Reduction,
) -> RuleResult<(Vec<f32>, f64)> {
    let mut per = vec![0f32; targets.len()];
    let mut total_w = 0f64;
    for (j, &t) in targets.iter().enumerate() {
        if Some(t) == ignore {
            continue;
        }
        if t < 0 || t as usize >= c {
            return Err(format!("target {t} is out of range for {c} classes").into());
        }
        let (n, i) = (j / inner, j % inner);
        let w = weight.map_or(1.0, |w| w[t as usize]);
        per[j] = -w * lp[(n * c + t as usize) * inner + i];
        total_w += w as f64;
    }
    let loss = match red {
        Reduction::None => per,
        Reduction::Sum => vec![per.iter().map(|&v| v as f64).sum::<f64>() as f32],
        Reduction::Mean => vec![(per.iter().map(|&v| v as f64).sum::<f64>() / total_w) as f32],
    };
    Ok((loss, total_w))
}

/// The gradient reaching each target's log-probability, `−w[t]·g` (`g` divided by
/// the summed weight for `mean`), 0 where the target is ignored: one per target.
fn target_grads(
    targets: &[i64],
    weight: Option<&[f32]>,
    g: &[f32],
    total_w: f32,
    ignore: Option<i64>,
    red: Reduction,
) -> Vec<f32> {
    targets
        .iter()
        .enumerate()
        .map(|(j, &t)| {
            if Some(t) == ignore || t < 0 {
                return 0.0;
            }
            let w = weight.map_or(1.0, |w| w.get(t as usize).copied().unwrap_or(0.0));
            let gj = match red {
                Reduction::None => g[j],
                Reduction::Sum => g[0],
                Reduction::Mean => g[0] / total_w,
            };
            -w * gj
        })
        .collect()
}

/// log-softmax over axis 1 of `[N, C, inner]`, in f64 per column.
fn log_softmax(x: &[f32], (n, c, inner): (usize, usize, usize)) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for b in 0..n {
        for i in 0..inner {
            let at = |k: usize| (b * c + k) * inner + i;
            let m = (0..c).map(|k| x[at(k)]).fold(f32::NEG_INFINITY, f32::max) as f64;
            let s: f64 = (0..c).map(|k| (x[at(k)] as f64 - m).exp()).sum();
            let ls = m + s.ln();
            for k in 0..c {
                out[at(k)] = (x[at(k)] as f64 - ls) as f32;
            }
        }
    }
    out
}

/// `NegativeLogLikelihoodLoss(input, target, weight?) -> loss`.
/// FLOPs: 2 per target (weight and sum), plus 1 per target for `mean`'s divisor.
struct Nll;

impl Op for Nll {
    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        dims(cx)?;
        Ok(vec![loss_fact(cx)?])
    }
    fn flops(&self, cx: &Cx, _out: &[Fact]) -> u64 {
        cx.input(1).map_or(0, |t| t.numel().saturating_mul(3))
    }
    /// NllLossBackward0 saves the input, the target, the weight and the summed
    /// weight (`total_weight`, a float32 scalar the forward makes). Backward FLOPs:
    /// 1 per target (the scatter writes zeros elsewhere).
    fn backward(&self, cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        let mut needs = vec![Saved::Input(0), Saved::Input(1), Saved::Extra(0)];
        if cx.opt(2).is_some() {
            needs.push(Saved::Input(2));
        }
        Ok(Some(Backward {
            grads: vec![Grad { input: 0, needs }],
            extras: vec![Fact::new(DType::F32, vec![])],
            flops: cx.input(1)?.numel(),
        }))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// The loss as the module documents; with [`KernelCx::extras`], the summed
    /// weight follows.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let at = LossAttrs::of(cx.attrs())?;
        let x = cx.input(0)?;
        let (c, inner) = (x.shape[1], x.shape[2..].iter().product());
        let (loss, total) = at.loss(cx, &x.to_f32()?, (c, inner))?;
        let o = cx.out(0)?;
        let mut out = vec![Tensor::from_f32(o.dtype, o.shape.clone(), loss)?];
        if cx.extras {
            out.push(Tensor::f32(vec![], vec![total as f32]));
        }
        Ok(out)
    }
    /// `dinput[n, t, d] = −w[t]·g` (divided by the summed weight for `mean`) at
    /// each target's class, 0 elsewhere and where the target is ignored.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let at = LossAttrs::of(cx.attrs())?;
        let x = cx.input(0)?;
        let (c, inner) = (x.shape[1], x.shape[2..].iter().product::<usize>());
        let _ = cx.saved(Saved::Input(0))?;
        let (targets, tg) = at.saved_target_grads(cx)?;
        let mut dx = vec![0f32; x.numel() as usize];
        for (j, (&t, &v)) in targets.iter().zip(&tg).enumerate() {
            if v != 0.0 {
                dx[(j / inner * c + t as usize) * inner + j % inner] = v;
            }
        }
        cx.answer(vec![(0, dx)])
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    /// nll_loss is on autocast's fp32 list.
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Full
    }
}

/// `SoftmaxCrossEntropyLoss(scores, labels, weights?) -> (output, log_prob?)`:
/// log-softmax over axis 1, then the negative log-likelihood; `log_prob` is
/// `[N, C, d..]`. FLOPs: 5 per score (the log-softmax) plus 3 per label.
struct SoftmaxCrossEntropy;

impl Op for SoftmaxCrossEntropy {
    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 2)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        dims(cx)?;
        let x = cx.input(0)?;
        let mut out = vec![loss_fact(cx)?];
        if cx.n_outputs() > 1 {
            out.push(Fact::new(x.dtype, x.shape.clone()));
        }
        Ok(out)
    }
    fn flops(&self, cx: &Cx, _out: &[Fact]) -> u64 {
        let (Ok(x), Ok(t)) = (cx.input(0), cx.input(1)) else {
            return 0;
        };
        x.numel()
            .saturating_mul(5)
            .saturating_add(t.numel().saturating_mul(3))
    }
    /// As `cross_entropy` runs it: LogSoftmaxBackward0 saves the log-probabilities
    /// and NllLossBackward0 the same tensor, the target, the weight and the summed
    /// weight. The log-probabilities are output 1 when the node declares it, else an
    /// extra the forward makes. Backward FLOPs: 3 per score plus 1 per label.
    fn backward(&self, cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        let x = cx.input(0)?;
        let total = Fact::new(DType::F32, vec![]);
        let (lp, extras) = if cx.has_output(1) {
            (Saved::Output(1), vec![total])
        } else {
            (
                Saved::Extra(1),
                vec![total, Fact::new(x.dtype, x.shape.clone())],
            )
        };
        let mut needs = vec![lp, Saved::Input(1), Saved::Extra(0)];
        if cx.opt(2).is_some() {
            needs.push(Saved::Input(2));
        }
        Ok(Some(Backward {
            grads: vec![Grad { input: 0, needs }],
            extras,
            flops: x
                .numel()
                .saturating_mul(3)
                .saturating_add(cx.input(1)?.numel()),
        }))
    }
    /// cross_entropy's backward is two steps: NllLossBackward0 writes the gradient
    /// reaching the log-probabilities (scores-sized, zeros but at the targets), and
    /// LogSoftmaxBackward0 reads it to write the scores' gradient, so both are alive
    /// at once. On an LLM's logits this is one more logits-sized tensor at the step's
    /// peak (Qwen3-style, sequence 2048: 250 MiB, tests/llm.rs).
    fn backward_scratch(&self, cx: &Cx, wanted: &[usize]) -> u64 {
        match cx.input(0) {
            Ok(x) if wanted.contains(&0) => x.numel(),
            _ => 0,
        }
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// log-softmax over the classes (f64 per column), then the loss as the module
    /// documents; with [`KernelCx::extras`], the summed weight and (when output 1
    /// is not declared) the log-probabilities follow.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let at = LossAttrs::of(cx.attrs())?;
        let x = cx.input(0)?;
        let d = (x.shape[0], x.shape[1], x.shape[2..].iter().product());
        let lp = log_softmax(&x.to_f32()?, d);
        let (loss, total) = at.loss(cx, &lp, (d.1, d.2))?;
        let o = cx.out(0)?;
        let lp = Tensor::from_f32(x.dtype(), x.shape.clone(), lp)?;
        let mut out = vec![Tensor::from_f32(o.dtype, o.shape.clone(), loss)?];
        let declared = cx.outputs.get(1).is_some_and(|o| o.is_some());
        if cx.n_outputs() > 1 {
            out.push(lp.clone());
        }
        if cx.extras {
            out.push(Tensor::f32(vec![], vec![total as f32]));
            if !declared {
                out.push(lp);
            }
        }
        Ok(out)
    }
    /// The log-softmax backward, `dscores = d − p·Σ_c d` with `p = exp(log_prob)`,
    /// of the gradient `d` reaching the log-probabilities: `−w[t]·g` (over the
    /// summed weight for `mean`) at each target's class (none where ignored), plus
    /// output 1's incoming gradient.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let at = LossAttrs::of(cx.attrs())?;
        let x = cx.input(0)?;
        let (c, inner) = (x.shape[1], x.shape[2..].iter().product::<usize>());
        let lp_slot = if cx.outputs.get(1).is_some_and(|o| o.is_some()) {
            Saved::Output(1)
        } else {
            Saved::Extra(1)
        };
        let lp = cx.saved(lp_slot)?.to_f32()?;
        let (targets, tg) = at.saved_target_grads(cx)?;
        // The gradient reaching each log-probability: from the loss at the
        // targets, plus output 1's own where one flows in.
        let mut dlp = match cx.grads.get(1).copied().flatten() {
            Some(_) => cx.grad(1)?.into_owned(),
            None => vec![0f32; lp.len()],
        };
        for (j, (&t, &a)) in targets.iter().zip(&tg).enumerate() {
            if a != 0.0 {
                dlp[(j / inner * c + t as usize) * inner + j % inner] += a;
            }
        }
        let mut dx = vec![0f32; lp.len()];
        for n in 0..x.shape[0] {
            for i in 0..inner {
                let at = |k: usize| (n * c + k) * inner + i;
                let s: f64 = (0..c).map(|k| dlp[at(k)] as f64).sum();
                for k in 0..c {
                    dx[at(k)] = dlp[at(k)] - lp[at(k)].exp() * s as f32;
                }
            }
        }
        cx.answer(vec![(0, dx)])
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    /// cross_entropy is on autocast's fp32 list.
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Full
    }
}

pub(super) fn register(r: &mut Registry) {
    r.add("NegativeLogLikelihoodLoss", Nll);
    r.add("SoftmaxCrossEntropyLoss", SoftmaxCrossEntropy);
}
