//! The optimizer update of a training step (PyTorch's formulas: SGD, momentum, Adam,
//! AdamW).

#[allow(unused_imports)]
use super::*;

/// The optimizer update (PyTorch's formulas, step 1, state from `state`), in
/// place on `params` and `state`. Gives the foreach Adam temporary
/// (`sqrt(exp_avg_sq) / sqrt(1 − β2ᵗ) + ε` of every parameter at once, which the
/// schedule counts as one OptimizerTemp storage), `None` for the others.
pub(crate) fn optimizer_step(
    s: &Schedule,
    gval: &[Option<Tensor>],
    params: &mut [Option<Tensor>],
    state_out: Option<&mut Tensor>,
    opts: &StepOptions,
) -> Result<Option<Tensor>> {
    let state = state_out.as_deref();
    let opt = opts.optimizer;
    let lr = opts.lr;
    let wd64 = opts.weight_decay.unwrap_or(match opt {
        Optimizer::Adamw => 1e-2,
        _ => 0.0,
    });
    let wd = wd64 as f32;
    let mu = opts.momentum as f32;
    let n: usize = s
        .with_grad
        .iter()
        .map(|&t| gval[t].as_ref().map_or(0, Tensor::numel))
        .sum();
    // Half-precision (bf16) parameters and states are updated in f32 and rounded
    // back, one tensor at a time.
    let state_dtype = state.as_ref().map(|t| t.dtype());
    let mut state_f32: Option<Vec<f32>> = match &state {
        Some(t) => Some(t.to_f32()?.into_owned()),
        None => None,
    };
    let mut state_vec = state_f32.as_mut();
    let state = &mut state_vec;
    if state.as_ref().map_or(0, |v| v.len()) != opt.states() as usize * n {
        return Err("the optimizer state does not match the parameters".into());
    }
    // Step 1: Adam's coefficients, in f64 then f32.
    let t = 1i32;
    let (b1, b2) = opts.betas;
    let bc1 = 1.0 - b1.powi(t);
    let bc2_sqrt = ((1.0 - b2.powi(t)).sqrt()) as f32;
    let step_size = (lr as f64 / bc1) as f32;
    let decay = (1.0 - lr as f64 * wd64) as f32;
    let (one_b1, one_b2, b2f, eps) = (
        (1.0 - b1) as f32,
        (1.0 - b2) as f32,
        b2 as f32,
        opts.eps as f32,
    );
    let mut denom_all = Vec::new();
    let mut off = 0;
    for &t in &s.with_grad {
        let g = gval[t]
            .as_ref()
            .ok_or("a parameter has no gradient")?
            .to_f32()?;
        let g: &[f32] = &g;
        let p = params[t].as_mut().ok_or("a parameter has no value")?;
        let mut p32 = p.to_f32()?.into_owned();
        let ps = &mut p32;
        if ps.len() != g.len() {
            return Err("a gradient does not match its parameter".into());
        }
        let k = g.len();
        match opt {
            Optimizer::Sgd => {
                for (p, &g) in ps.iter_mut().zip(g) {
                    let g = if wd != 0.0 { g + wd * *p } else { g };
                    *p -= lr * g;
                }
            }
            Optimizer::Momentum => {
                let buf = &mut state.as_mut().expect("checked")[off..off + k];
                for ((p, &g), b) in ps.iter_mut().zip(g).zip(buf) {
                    let g = if wd != 0.0 { g + wd * *p } else { g };
                    // `buf = μ·buf + g` (PyTorch's first step sets `buf = g`: the
                    // same from zero state).
                    *b = mu * *b + g;
                    *p -= lr * *b;
                }
            }
            Optimizer::Adam8bit | Optimizer::Lion | Optimizer::Adafactor => {
                return Err(format!("the {opt} update is not executed").into());
            }
            Optimizer::Adam | Optimizer::Adamw => {
                let st = state.as_mut().expect("checked");
                let (m_all, v_all) = st.split_at_mut(n);
                let m = &mut m_all[off..off + k];
                let v = &mut v_all[off..off + k];
                for (((p, &g), m), v) in ps.iter_mut().zip(g).zip(m).zip(v) {
                    let g = if opt == Optimizer::Adamw {
                        *p *= decay;
                        g
                    } else if wd != 0.0 {
                        g + wd * *p
                    } else {
                        g
                    };
                    *m += (g - *m) * one_b1;
                    *v = *v * b2f + one_b2 * g * g;
                    let d = v.sqrt() / bc2_sqrt + eps;
                    denom_all.push(d);
                    *p -= step_size * *m / d;
                }
            }
        }
        *p = Tensor::from_f32(p.dtype(), p.shape.clone(), p32)?;
        off += k;
    }
    if let (Some(t), Some(v), Some(dt)) = (state_out, state_f32, state_dtype) {
        *t = Tensor::from_f32(dt, t.shape.clone(), v)?;
    }
    let master = s
        .with_grad
        .first()
        .and_then(|&t| params[t].as_ref())
        .map_or(DType::F32, Tensor::dtype);
    Ok(match opt {
        Optimizer::Adam | Optimizer::Adamw => Some(Tensor::from_f32(master, vec![n], denom_all)?),
        _ => None,
    })
}
