//! Normalizations: BatchNormalization, LayerNormalization, InstanceNormalization,
//! GroupNormalization, and the softmax family (normalization along an axis).

use super::{axis, Arity, Backward, Cx, Fact, Grad, Op, Registry, RuleResult, Saved, Storage};
use crate::ir::DType;

/// `BatchNormalization(X, scale, B, mean, var)`.
/// Opset ≥ 14: optional outputs running_mean, running_var (`training_mode`=1);
/// opset < 14: optional outputs mean, var, saved_mean, saved_var. All extra outputs are `[C]`.
/// FLOPs: 4 per element to normalize and scale; training mode adds 4 per element
/// for the batch mean (1) and variance (3).
struct BatchNorm;

impl BatchNorm {
    fn training(cx: &Cx) -> bool {
        if cx.opset >= 14 {
            cx.attrs().int_or("training_mode", 0) != 0
        } else {
            cx.n_outputs() > 1
        }
    }
}

impl Op for BatchNorm {
    fn arity(&self) -> Arity {
        Arity::new(5, 5, 1, 5)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        if x.rank() < 2 {
            return Err(format!("input must be [N, C, ...], got {:?}", x.shape));
        }
        let c = x.shape[1];
        for (i, name) in [(1, "scale"), (2, "B"), (3, "mean"), (4, "var")] {
            let f = cx.input(i)?;
            if f.shape != [c] {
                return Err(format!("{name} is {:?}, expected [{c}]", f.shape));
            }
        }
        let stat = cx.input(3)?.dtype;
        let mut out = vec![Fact::new(x.dtype, x.shape.clone())];
        for _ in 1..cx.n_outputs() {
            out.push(Fact::new(stat, vec![c]));
        }
        Ok(out)
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let per: u64 = if Self::training(cx) { 8 } else { 4 };
        per.saturating_mul(out[0].numel())
    }
    /// Training BN (NativeBatchNormBackward) saves the input, scale, running stats
    /// and the batch mean and inverse std it computed ([C] each, float32). Memplan's
    /// training step always runs BN in training mode. Backward FLOPs: 8 per element.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let c = out[0].shape[1];
        let stat = Fact::new(DType::F32, vec![c]);
        let needs = vec![
            Saved::Input(0),
            Saved::Input(1),
            Saved::Extra(0),
            Saved::Extra(1),
        ];
        let _ = cx;
        Ok(Some(Backward {
            grads: vec![
                Grad {
                    input: 0,
                    needs: needs.clone(),
                },
                Grad { input: 1, needs },
                Grad {
                    input: 2,
                    needs: vec![],
                },
            ],
            extras: vec![stat.clone(), stat],
            flops: out[0].numel().saturating_mul(8),
        }))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
}

/// `LayerNormalization(X, Scale, B?) -> (Y, Mean?, InvStdDev?)` over axes `axis..`.
/// Mean and InvStdDev are `X.shape[..axis] + [1; rank-axis]`, of `stash_type` (float).
/// FLOPs: 8 per element (mean, center, square, variance sum, scale by 1/σ, γ, β, and
/// the reductions' adds).
struct LayerNorm;

impl Op for LayerNorm {
    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 3)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let ax = axis(cx.attrs().int_or("axis", -1), x.rank())?;
        let normalized = &x.shape[ax..];
        for i in 1..cx.inputs.len() {
            if let Some(f) = cx.opt(i) {
                super::broadcast(&[&f.shape, normalized])
                    .ok()
                    .filter(|b| b == normalized)
                    .ok_or_else(|| {
                        format!(
                            "input {i} {:?} does not broadcast to the normalized shape {normalized:?}",
                            f.shape
                        )
                    })?;
            }
        }
        let stash = super::dtype_attr(cx.attrs().int_or("stash_type", 1))?;
        let mut stat = x.shape[..ax].to_vec();
        stat.resize(x.rank(), 1);
        let mut out = vec![Fact::new(x.dtype, x.shape.clone())];
        for _ in 1..cx.n_outputs() {
            out.push(Fact::new(stash, stat.clone()));
        }
        Ok(out)
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel().saturating_mul(8)
    }
    /// NativeLayerNormBackward saves the input, γ, β, and the per-row mean and rstd
    /// (float32, one per normalized row). Backward FLOPs: 8 per element.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let x = cx.input(0)?;
        let ax = axis(cx.attrs().int_or("axis", -1), x.rank())?;
        let mut stat = x.shape[..ax].to_vec();
        stat.resize(x.rank(), 1);
        let stat = Fact::new(DType::F32, stat);
        let needs = vec![
            Saved::Input(0),
            Saved::Input(1),
            Saved::Extra(0),
            Saved::Extra(1),
        ];
        Ok(Some(Backward {
            grads: vec![
                Grad {
                    input: 0,
                    needs: needs.clone(),
                },
                Grad { input: 1, needs },
                Grad {
                    input: 2,
                    needs: vec![],
                },
            ],
            extras: vec![stat.clone(), stat],
            flops: out[0].numel().saturating_mul(8),
        }))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
}

/// `InstanceNormalization(X, scale, B)` and `GroupNormalization(X, scale, B)`: Y like X.
/// FLOPs: 8 per element, as LayerNormalization.
struct SameShapeNorm {
    arity: Arity,
}

impl Op for SameShapeNorm {
    fn arity(&self) -> Arity {
        self.arity
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        if x.rank() < 2 {
            return Err(format!("input must be [N, C, ...], got {:?}", x.shape));
        }
        Ok(vec![Fact::new(x.dtype, x.shape.clone())])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel().saturating_mul(8)
    }
    /// Instance/group norm save the input, scale and per-group mean and rstd.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let x = cx.input(0)?;
        let groups = if cx.node.op_type == "GroupNormalization" {
            cx.attrs().int_or("num_groups", 1).max(1) as usize
        } else {
            x.shape[1]
        };
        let stat = Fact::new(DType::F32, vec![x.shape[0], groups]);
        let needs = vec![
            Saved::Input(0),
            Saved::Input(1),
            Saved::Extra(0),
            Saved::Extra(1),
        ];
        Ok(Some(Backward {
            grads: vec![
                Grad {
                    input: 0,
                    needs: needs.clone(),
                },
                Grad { input: 1, needs },
                Grad {
                    input: 2,
                    needs: vec![],
                },
            ],
            extras: vec![stat.clone(), stat],
            flops: out[0].numel().saturating_mul(8),
        }))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
}

/// `Softmax` / `LogSoftmax` / `Hardmax` along `axis` (default -1 from opset 13, 1 before).
/// FLOPs: 5 per element (max, subtract, exp, sum, divide or log-subtract).
struct Softmax;

impl Op for Softmax {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let default = if cx.opset >= 13 { -1 } else { 1 };
        axis(cx.attrs().int_or("axis", default), x.rank())?;
        if !x.dtype.is_float() {
            return Err(format!("input must be floating point, got {}", x.dtype));
        }
        Ok(vec![Fact::new(x.dtype, x.shape.clone())])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel().saturating_mul(5)
    }
    /// SoftmaxBackward / LogSoftmaxBackward save the output. Hardmax has no gradient.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if cx.node.op_type == "Hardmax" {
            return Ok(None);
        }
        Ok(Some(Backward::each(
            &[0],
            &[Saved::Output(0)],
            out[0].numel().saturating_mul(3),
        )))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
}

/// `LpNormalization(X)` along `axis`: Y like X. FLOPs: 3 per element.
struct LpNorm;

impl Op for LpNorm {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        axis(cx.attrs().int_or("axis", -1), x.rank())?;
        Ok(vec![Fact::new(x.dtype, x.shape.clone())])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel().saturating_mul(3)
    }
    /// Normalizing by the norm needs the input and the output.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(Some(Backward::each(
            &[0],
            &[Saved::Input(0), Saved::Output(0)],
            out[0].numel().saturating_mul(4),
        )))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
}

/// Registers the normalization family.
pub fn register(r: &mut Registry) {
    r.add("BatchNormalization", BatchNorm);
    r.add("LayerNormalization", LayerNorm);
    r.add(
        "InstanceNormalization",
        SameShapeNorm {
            arity: Arity::new(3, 3, 1, 1),
        },
    );
    r.add(
        "GroupNormalization",
        SameShapeNorm {
            arity: Arity::new(3, 3, 1, 1),
        },
    );
    r.add("Softmax", Softmax);
    r.add("LogSoftmax", Softmax);
    r.add("Hardmax", Softmax);
    r.add("LpNormalization", LpNorm);
}
