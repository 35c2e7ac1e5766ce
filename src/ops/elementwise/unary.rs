//! Unary maps `y = f(x)`: each op's function, derivative, saved tensor and kernels.

#[allow(unused_imports)]
use super::*;

/// What a unary op's backward reads (PyTorch's saved tensor).
#[derive(Clone, Copy)]
pub(super) enum Keeps {
    /// Gradient needs nothing saved (Neg, Identity; zero gradients of Floor, Sign...).
    Nothing,
    /// `self`: the derivative is a function of the input (Erf, Log, Abs, Gelu...).
    Input,
    /// `result`: the derivative is cheapest from the output (Relu, Sigmoid, Tanh, Exp...).
    Output,
    /// Not differentiable (boolean results).
    NonDiff,
}

/// A unary map `y = f(x)`, same shape; `bool_out` ops (IsNaN, Not...) yield bool.
pub(super) struct Unary {
    pub(super) flops_per_elem: u64,
    pub(super) bool_out: bool,
    pub(super) fold: Option<fn(f64) -> f64>,
    pub(super) keeps: Keeps,
}

impl Op for Unary {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let dtype = if self.bool_out { DType::Bool } else { x.dtype };
        let value = match (&x.value, self.fold) {
            (Some(v), Some(f)) => Some(map_value(v, x.dtype.is_float(), f)),
            _ => None,
        };
        Ok(vec![Fact {
            dtype,
            shape: x.shape.clone(),
            value,
        }])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        self.flops_per_elem.saturating_mul(out[0].numel())
    }
    /// Backward FLOPs: one multiply by the derivative per element, plus computing it.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let needs: &[Saved] = match self.keeps {
            Keeps::NonDiff => return Ok(None),
            Keeps::Nothing => &[],
            Keeps::Input => &[Saved::Input(0)],
            Keeps::Output => &[Saved::Output(0)],
        };
        let flops = (self.flops_per_elem + 1).saturating_mul(out[0].numel());
        Ok(Some(Backward::each(&[0], needs, flops)))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        if self.flops_per_elem == 0 {
            Storage::View
        } else {
            Storage::New
        }
    }
    /// TensorIterator's output layout.
    fn out_strides(
        &self,
        cx: &Cx,
        _k: usize,
        out: &Fact,
        strides: &[Option<&[usize]>],
    ) -> Vec<usize> {
        crate::ops::elementwise_strides(cx, out, strides)
    }
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        unary_kernel(cx, self.bool_out)
    }
    /// `g · f'(x)`, the derivative from the saved input or output as the rule says.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        unary_backward(cx, self.keeps)
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, op_type: &str) -> CudaKernels {
        match op_type {
            "Identity" | "Relu" | "Neg" | "Abs" | "Sqrt" | "Reciprocal" | "Exp" | "Log" | "Erf"
            | "Tanh" | "Sigmoid" | "Gelu" | "LeakyRelu" | "Sin" | "Cos" | "Floor" | "Ceil"
            | "Softplus" | "HardSigmoid" | "HardSwish" | "Elu" => {
                CudaKernels::new(&["unary_fwd_f32"], &["unary_bwd_f32"])
            }
            _ => CudaKernels::HOST,
        }
    }
}

pub(super) fn map_value(v: &Value, float: bool, f: fn(f64) -> f64) -> Value {
    let n = v.data.len();
    let data = if float {
        Data::Float((0..n).map(|i| f(v.data.float(i))).collect())
    } else {
        Data::Int((0..n).map(|i| f(v.data.float(i)) as i64).collect())
    };
    Value {
        shape: v.shape.clone(),
        data,
    }
}

/// Element count above which element-wise kernels run in parallel.
pub(super) const PAR_ELEMS: usize = 1 << 15;

/// `f` over every element, in parallel for large tensors.
pub(crate) fn map_f32(x: &[f32], f: impl Fn(f32) -> f32 + Sync + Send) -> Vec<f32> {
    if x.len() >= PAR_ELEMS {
        x.par_iter().map(|&v| f(v)).collect()
    } else {
        x.iter().map(|&v| f(v)).collect()
    }
}

/// A unary op's f32 function, with its attributes (defaults from the ONNX spec).
pub(super) fn unary_fn(op: &str, a: &Attrs) -> RuleResult<Box<dyn Fn(f32) -> f32 + Sync + Send>> {
    let alpha = |d: f32| a.float("alpha").unwrap_or(d);
    Ok(match op {
        "Relu" => Box::new(|x: f32| x.max(0.0)),
        "Neg" => Box::new(|x: f32| -x),
        "Abs" => Box::new(f32::abs),
        "Floor" => Box::new(f32::floor),
        "Ceil" => Box::new(f32::ceil),
        "Round" => Box::new(f32::round_ties_even),
        "Sign" => Box::new(|x: f32| if x == 0.0 { 0.0 } else { x.signum() }),
        "Sqrt" => Box::new(f32::sqrt),
        "Reciprocal" => Box::new(|x: f32| 1.0 / x),
        "Exp" => Box::new(f32::exp),
        "Log" => Box::new(f32::ln),
        "Erf" => Box::new(libm::erff),
        "Sin" => Box::new(f32::sin),
        "Cos" => Box::new(f32::cos),
        "Tan" => Box::new(f32::tan),
        "Tanh" => Box::new(f32::tanh),
        "Atan" => Box::new(f32::atan),
        "LeakyRelu" => {
            let al = alpha(0.01);
            Box::new(move |x: f32| if x < 0.0 { al * x } else { x })
        }
        "ThresholdedRelu" => {
            let al = alpha(1.0);
            Box::new(move |x: f32| if x > al { x } else { 0.0 })
        }
        "Sigmoid" => Box::new(sigmoid),
        "HardSigmoid" => {
            let (al, be) = (alpha(0.2), a.float("beta").unwrap_or(0.5));
            Box::new(move |x: f32| (al * x + be).clamp(0.0, 1.0))
        }
        "HardSwish" => Box::new(|x: f32| x * (x / 6.0 + 0.5).clamp(0.0, 1.0)),
        "Softplus" => Box::new(softplus),
        "Softsign" => Box::new(|x: f32| x / (1.0 + x.abs())),
        "Elu" => {
            let al = alpha(1.0);
            Box::new(move |x: f32| if x < 0.0 { al * x.exp_m1() } else { x })
        }
        "Selu" => {
            let al = alpha(1.673_263_2);
            let g = a.float("gamma").unwrap_or(1.050_701);
            Box::new(move |x: f32| g * if x > 0.0 { x } else { al * x.exp_m1() })
        }
        "Celu" => {
            let al = alpha(1.0);
            Box::new(move |x: f32| x.max(0.0) + (al * (x / al).exp_m1()).min(0.0))
        }
        "Mish" => Box::new(|x: f32| x * softplus(x).tanh()),
        "Gelu" => match a.string("approximate").unwrap_or("none") {
            "none" => {
                Box::new(|x: f32| 0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2)))
            }
            "tanh" => Box::new(|x: f32| {
                let c = (2.0 / std::f32::consts::PI).sqrt();
                0.5 * x * (1.0 + (c * (x + 0.044_715 * x * x * x)).tanh())
            }),
            other => return Err(format!("unknown approximate '{other}'")),
        },
        other => return Err(format!("no f32 kernel for {other}")),
    })
}

pub(super) fn sigmoid(x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

pub(super) fn softplus(x: f32) -> f32 {
    // log(1 + e^x) without overflow.
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// Unary ops: floats computed in f32 (half types widened and rounded back);
/// Identity on any type; Neg/Abs/Sign/Relu on integers; Not/IsNaN/IsInf to bool.
pub(super) fn unary_kernel(cx: &KernelCx, bool_out: bool) -> RuleResult<Vec<Tensor>> {
    let x = cx.input(0)?;
    let op = cx.node.op_type.as_str();
    let shape = x.shape.clone();
    if op == "Identity" {
        return Ok(vec![x.clone()]);
    }
    if bool_out {
        let v: Vec<bool> = match op {
            "Not" => match &x.elems {
                Elems::Bool(b) => b.iter().map(|&b| !b).collect(),
                e => return Err(format!("Not takes bool, got {}", e.dtype())),
            },
            "IsNaN" => x.to_f32()?.iter().map(|v| v.is_nan()).collect(),
            "IsInf" => {
                let (pos, neg) = (
                    cx.attrs().int_or("detect_positive", 1) != 0,
                    cx.attrs().int_or("detect_negative", 1) != 0,
                );
                x.to_f32()?
                    .iter()
                    .map(|&v| v.is_infinite() && ((v > 0.0 && pos) || (v < 0.0 && neg)))
                    .collect()
            }
            other => return Err(format!("no kernel for {other}")),
        };
        return Ok(vec![Tensor::bool(shape, v)]);
    }
    if !x.dtype().is_float() {
        let f: fn(i64) -> i64 = match op {
            "Neg" => i64::wrapping_neg,
            "Abs" => i64::wrapping_abs,
            "Sign" => i64::signum,
            "Relu" => |v| v.max(0),
            other => return Err(format!("{other} on {} is not supported", x.dtype())),
        };
        let v = x.to_i64s().into_iter().map(f).collect();
        return Ok(vec![Tensor::from_i64(x.dtype(), shape, v)?]);
    }
    let f = unary_fn(op, cx.attrs())?;
    let v = map_f32(&x.to_f32()?, f);
    Ok(vec![Tensor::from_f32(x.dtype(), shape, v)?])
}

/// An element function (a unary op's derivative).
pub(super) type ElemFn = Box<dyn Fn(f32) -> f32 + Sync + Send>;

/// A unary op's derivative: `d(s)` with `s` the saved input or output element, or
/// `None` for ops without a CPU backward kernel.
pub(super) fn unary_derivative(op: &str, a: &Attrs) -> RuleResult<Option<ElemFn>> {
    let alpha = |d: f32| a.float("alpha").unwrap_or(d);
    let sig = |x: f32| sigmoid(x);
    Ok(Some(match op {
        // Nothing saved.
        "Identity" => Box::new(|_| 1.0),
        "Neg" => Box::new(|_| -1.0),
        "Floor" | "Ceil" | "Round" | "Sign" => Box::new(|_| 0.0),
        // From the input x.
        "Abs" => Box::new(|x: f32| if x == 0.0 { 0.0 } else { x.signum() }),
        "Log" => Box::new(|x: f32| 1.0 / x),
        "Erf" => Box::new(|x: f32| std::f32::consts::FRAC_2_SQRT_PI * (-x * x).exp()),
        "Sin" => Box::new(f32::cos),
        "Cos" => Box::new(|x: f32| -x.sin()),
        "Atan" => Box::new(|x: f32| 1.0 / (1.0 + x * x)),
        "LeakyRelu" => {
            let al = alpha(0.01);
            Box::new(move |x: f32| if x > 0.0 { 1.0 } else { al })
        }
        "ThresholdedRelu" => {
            let al = alpha(1.0);
            Box::new(move |x: f32| if x > al { 1.0 } else { 0.0 })
        }
        "HardSigmoid" => {
            let (al, be) = (alpha(0.2), a.float("beta").unwrap_or(0.5));
            Box::new(move |x: f32| {
                let v = al * x + be;
                if v > 0.0 && v < 1.0 {
                    al
                } else {
                    0.0
                }
            })
        }
        "HardSwish" => Box::new(|x: f32| {
            if x < -3.0 {
                0.0
            } else if x > 3.0 {
                1.0
            } else {
                x / 3.0 + 0.5
            }
        }),
        "Softplus" => Box::new(sig),
        "Softsign" => Box::new(|x: f32| 1.0 / (1.0 + x.abs()).powi(2)),
        "Mish" => Box::new(move |x: f32| {
            let t = softplus(x).tanh();
            t + x * (1.0 - t * t) * sig(x)
        }),
        "Gelu" => match a.string("approximate").unwrap_or("none") {
            "none" => Box::new(|x: f32| {
                let cdf = 0.5 * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2));
                let pdf = (-0.5 * x * x).exp()
                    * (0.5 * std::f32::consts::FRAC_2_SQRT_PI)
                    * std::f32::consts::FRAC_1_SQRT_2;
                cdf + x * pdf
            }),
            "tanh" => Box::new(|x: f32| {
                let c = (2.0 / std::f32::consts::PI).sqrt();
                let t = (c * (x + 0.044_715 * x * x * x)).tanh();
                0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044_715 * x * x)
            }),
            other => return Err(format!("unknown approximate '{other}'")),
        },
        // From the output y.
        "Relu" => Box::new(|y: f32| if y > 0.0 { 1.0 } else { 0.0 }),
        "Sqrt" => Box::new(|y: f32| 0.5 / y),
        "Reciprocal" => Box::new(|y: f32| -y * y),
        "Exp" => Box::new(|y: f32| y),
        "Tan" => Box::new(|y: f32| 1.0 + y * y),
        "Tanh" => Box::new(|y: f32| 1.0 - y * y),
        "Sigmoid" => Box::new(|y: f32| y * (1.0 - y)),
        "Elu" => {
            let al = alpha(1.0);
            Box::new(move |y: f32| if y > 0.0 { 1.0 } else { y + al })
        }
        "Selu" => {
            let al = alpha(1.673_263_2);
            let g = a.float("gamma").unwrap_or(1.050_701);
            Box::new(move |y: f32| if y > 0.0 { g } else { y + al * g })
        }
        "Celu" => {
            let al = alpha(1.0);
            Box::new(move |y: f32| if y > 0.0 { 1.0 } else { y / al + 1.0 })
        }
        _ => return Ok(None),
    }))
}

/// Unary backward: `g · f'(s)`, `s` the saved tensor the rule names.
pub(super) fn unary_backward(cx: &BackwardCx, keeps: Keeps) -> RuleResult<Vec<Option<Tensor>>> {
    let saved = match keeps {
        Keeps::NonDiff => return no_gradient(cx),
        Keeps::Nothing => None,
        Keeps::Input => Some(cx.saved(Saved::Input(0))?),
        Keeps::Output => Some(cx.saved(Saved::Output(0))?),
    };
    let Some(d) = unary_derivative(&cx.node.op_type, cx.attrs())? else {
        return no_backward_kernel(cx);
    };
    let g = cx.grad(0)?;
    let v: Vec<f32> = match saved {
        None => {
            let k = d(0.0);
            g.iter().map(|&g| g * k).collect()
        }
        Some(s) => {
            let s = s.to_f32()?;
            if s.len() != g.len() {
                return Err("the saved tensor and the gradient differ in size".into());
            }
            if g.len() >= PAR_ELEMS {
                g.par_iter()
                    .zip(s.par_iter())
                    .map(|(&g, &s)| g * d(s))
                    .collect()
            } else {
                g.iter().zip(s.iter()).map(|(&g, &s)| g * d(s)).collect()
            }
        }
    };
    cx.answer(vec![(0, v)])
}

pub(super) fn erf(x: f64) -> f64 {
    // Abramowitz-Stegun 7.1.26; folding an Erf on constants is rare and only needs
    // to be close.
    let t = 1.0 / (1.0 + 0.3275911 * x.abs());
    let y = 1.0
        - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
            + 0.254829592)
            * t
            * (-x * x).exp();
    y.copysign(x)
}
