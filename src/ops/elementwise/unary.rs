//! Unary maps `y = f(x)`. Every fact of one op is one row of [`UNARY`]: FLOPs,
//! the saved tensor, the autocast class, constant folding, the integer kernel,
//! attribute parameters, the f32 function and its derivative, and the CUDA C of
//! both, from which kernels/elementwise.cu's `mp_unary`/`mp_unary_d` switches are
//! generated ([`cuda_switches`]). A new unary op is one row.

#[allow(unused_imports)]
use super::*;

/// What a unary op's backward reads (PyTorch's saved tensor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keeps {
    /// Gradient needs nothing saved (Neg, Identity; zero gradients of Floor, Sign...).
    Nothing,
    /// `self`: the derivative is a function of the input (Erf, Log, Abs, Gelu...).
    Input,
    /// `result`: the derivative is cheapest from the output (Relu, Sigmoid, Tanh, Exp...).
    Output,
}

impl Keeps {
    /// The saved tensor the derivative reads.
    pub fn saved(self) -> Option<Saved> {
        match self {
            Keeps::Nothing => None,
            Keeps::Input => Some(Saved::Input(0)),
            Keeps::Output => Some(Saved::Output(0)),
        }
    }
}

/// The attribute parameters `(alpha, beta, gamma)` of one node, ONNX defaults filled in.
pub type Params = [f32; 3];

/// Everything about one unary op.
pub struct UnaryRow {
    /// ONNX op type.
    pub name: &'static str,
    /// FLOPs per element.
    pub flops: u64,
    /// What the derivative reads.
    pub keeps: Keeps,
    /// How autocast treats it.
    pub autocast: Autocast,
    /// Constant folding (f64) where shapes need it.
    fold: Option<fn(f64) -> f64>,
    /// The kernel on integer tensors, where ONNX allows them.
    int: Option<fn(i64) -> i64>,
    /// The parameters from the node's attributes.
    params: fn(&Attrs) -> RuleResult<Params>,
    /// `y = f(x, p)` in f32.
    f: fn(f32, &Params) -> f32,
    /// `f'` as a function of the saved element `s` ([`UnaryRow::keeps`]; 0 when nothing).
    d: fn(f32, &Params) -> f32,
    /// The CUDA C of `f` (of `x`) and of `f'` (of `s`), with `alpha`, `beta`,
    /// `gamma` in scope; `None`: the op runs on the host on a device.
    pub cuda: Option<(&'static str, &'static str)>,
}

impl UnaryRow {
    /// The node's parameters.
    pub fn params(&self, a: &Attrs) -> RuleResult<Params> {
        (self.params)(a)
    }
}

fn no_params(_: &Attrs) -> RuleResult<Params> {
    Ok([0.0; 3])
}

/// `alpha` with its default; `beta`, `gamma` 0.
macro_rules! alpha {
    ($d:expr) => {
        |a: &Attrs| Ok([a.float("alpha").unwrap_or($d), 0.0, 0.0])
    };
}

/// Gelu's `approximate`: alpha 0 for `none` (erf), 1 for `tanh`.
fn gelu_params(a: &Attrs) -> RuleResult<Params> {
    match a.string("approximate").unwrap_or("none") {
        "none" => Ok([0.0; 3]),
        "tanh" => Ok([1.0, 0.0, 0.0]),
        other => Err(format!("unknown approximate '{other}'").into()),
    }
}

/// `sqrt(2 / pi)`, Gelu's tanh approximation.
fn gelu_c() -> f32 {
    (2.0 / std::f32::consts::PI).sqrt()
}

use Autocast::{Full, Promote};
use Keeps::{Input as In, Nothing as No, Output as Out};

/// The unary ops. The row index is the op code of kernels/elementwise.cu.
pub static UNARY: &[UnaryRow] = &[
    // Data movement.
    UnaryRow {
        name: "Identity",
        flops: 0,
        keeps: No,
        autocast: Promote,
        fold: Some(|x| x),
        int: Some(|v| v),
        params: no_params,
        f: |x, _| x,
        d: |_, _| 1.0,
        cuda: Some(("x", "1.0f")),
    },
    // One arithmetic operation or one transcendental function per element.
    UnaryRow {
        name: "Relu",
        flops: 1,
        keeps: Out,
        autocast: Promote,
        fold: Some(|x| x.max(0.0)),
        int: Some(|v| v.max(0)),
        params: no_params,
        f: |x, _| x.max(0.0),
        d: |y, _| if y > 0.0 { 1.0 } else { 0.0 },
        cuda: Some(("fmaxf(x, 0.0f)", "s > 0.0f ? 1.0f : 0.0f")),
    },
    UnaryRow {
        name: "Neg",
        flops: 1,
        keeps: No,
        autocast: Promote,
        fold: Some(|x| -x),
        int: Some(i64::wrapping_neg),
        params: no_params,
        f: |x, _| -x,
        d: |_, _| -1.0,
        cuda: Some(("-x", "-1.0f")),
    },
    UnaryRow {
        name: "Abs",
        flops: 1,
        keeps: In,
        autocast: Promote,
        fold: Some(f64::abs),
        int: Some(i64::wrapping_abs),
        params: no_params,
        f: |x, _| x.abs(),
        d: |x, _| if x == 0.0 { 0.0 } else { x.signum() },
        cuda: Some(("fabsf(x)", "s == 0.0f ? 0.0f : copysignf(1.0f, s)")),
    },
    UnaryRow {
        name: "Floor",
        flops: 1,
        keeps: No,
        autocast: Promote,
        fold: Some(f64::floor),
        int: None,
        params: no_params,
        f: |x, _| x.floor(),
        d: |_, _| 0.0,
        cuda: Some(("floorf(x)", "0.0f")),
    },
    UnaryRow {
        name: "Ceil",
        flops: 1,
        keeps: No,
        autocast: Promote,
        fold: Some(f64::ceil),
        int: None,
        params: no_params,
        f: |x, _| x.ceil(),
        d: |_, _| 0.0,
        cuda: Some(("ceilf(x)", "0.0f")),
    },
    UnaryRow {
        name: "Round",
        flops: 1,
        keeps: No,
        autocast: Promote,
        fold: Some(f64::round_ties_even),
        int: None,
        params: no_params,
        f: |x, _| x.round_ties_even(),
        d: |_, _| 0.0,
        cuda: None,
    },
    UnaryRow {
        name: "Sign",
        flops: 1,
        keeps: No,
        autocast: Promote,
        fold: Some(|x| if x == 0.0 { 0.0 } else { x.signum() }),
        int: Some(i64::signum),
        params: no_params,
        f: |x, _| if x == 0.0 { 0.0 } else { x.signum() },
        d: |_, _| 0.0,
        cuda: None,
    },
    // Integers only (opset 18): floats are refused by the shape rule.
    UnaryRow {
        name: "BitwiseNot",
        flops: 1,
        keeps: No,
        autocast: Promote,
        fold: None,
        int: Some(|x| !x),
        params: no_params,
        f: |x, _| x,
        d: |_, _| 0.0,
        cuda: None,
    },
    UnaryRow {
        name: "Sqrt",
        flops: 1,
        keeps: Out,
        autocast: Promote,
        fold: Some(f64::sqrt),
        int: None,
        params: no_params,
        f: |x, _| x.sqrt(),
        d: |y, _| 0.5 / y,
        cuda: Some(("sqrtf(x)", "0.5f / s")),
    },
    UnaryRow {
        name: "Reciprocal",
        flops: 1,
        keeps: Out,
        autocast: Promote,
        fold: Some(|x| 1.0 / x),
        int: None,
        params: no_params,
        f: |x, _| 1.0 / x,
        d: |y, _| -y * y,
        cuda: Some(("1.0f / x", "-s * s")),
    },
    UnaryRow {
        name: "Exp",
        flops: 1,
        keeps: Out,
        autocast: Full,
        fold: Some(f64::exp),
        int: None,
        params: no_params,
        f: |x, _| x.exp(),
        d: |y, _| y,
        cuda: Some(("expf(x)", "s")),
    },
    UnaryRow {
        name: "Log",
        flops: 1,
        keeps: In,
        autocast: Full,
        fold: Some(f64::ln),
        int: None,
        params: no_params,
        f: |x, _| x.ln(),
        d: |x, _| 1.0 / x,
        cuda: Some(("logf(x)", "1.0f / s")),
    },
    UnaryRow {
        name: "Erf",
        flops: 1,
        keeps: In,
        autocast: Promote,
        fold: Some(erf),
        int: None,
        params: no_params,
        f: |x, _| libm::erff(x),
        d: |x, _| std::f32::consts::FRAC_2_SQRT_PI * (-x * x).exp(),
        cuda: Some(("erff(x)", "1.12837916709551257f * expf(-s * s)")),
    },
    UnaryRow {
        name: "Sin",
        flops: 1,
        keeps: In,
        autocast: Promote,
        fold: Some(f64::sin),
        int: None,
        params: no_params,
        f: |x, _| x.sin(),
        d: |x, _| x.cos(),
        cuda: Some(("sinf(x)", "cosf(s)")),
    },
    UnaryRow {
        name: "Cos",
        flops: 1,
        keeps: In,
        autocast: Promote,
        fold: Some(f64::cos),
        int: None,
        params: no_params,
        f: |x, _| x.cos(),
        d: |x, _| -x.sin(),
        cuda: Some(("cosf(x)", "-sinf(s)")),
    },
    UnaryRow {
        name: "Tan",
        flops: 1,
        keeps: Out,
        autocast: Promote,
        fold: Some(f64::tan),
        int: None,
        params: no_params,
        f: |x, _| x.tan(),
        d: |y, _| 1.0 + y * y,
        cuda: None,
    },
    UnaryRow {
        name: "Tanh",
        flops: 1,
        keeps: Out,
        autocast: Promote,
        fold: Some(f64::tanh),
        int: None,
        params: no_params,
        f: |x, _| x.tanh(),
        d: |y, _| 1.0 - y * y,
        cuda: Some(("tanhf(x)", "1.0f - s * s")),
    },
    UnaryRow {
        name: "Atan",
        flops: 1,
        keeps: In,
        autocast: Promote,
        fold: Some(f64::atan),
        int: None,
        params: no_params,
        f: |x, _| x.atan(),
        d: |x, _| 1.0 / (1.0 + x * x),
        cuda: None,
    },
    UnaryRow {
        name: "LeakyRelu",
        flops: 1,
        keeps: In,
        autocast: Promote,
        fold: None,
        int: None,
        params: alpha!(0.01),
        f: |x, p| if x < 0.0 { p[0] * x } else { x },
        d: |x, p| if x > 0.0 { 1.0 } else { p[0] },
        cuda: Some(("x < 0.0f ? alpha * x : x", "s > 0.0f ? 1.0f : alpha")),
    },
    UnaryRow {
        name: "ThresholdedRelu",
        flops: 1,
        keeps: In,
        autocast: Promote,
        fold: None,
        int: None,
        params: alpha!(1.0),
        f: |x, p| if x > p[0] { x } else { 0.0 },
        d: |x, p| if x > p[0] { 1.0 } else { 0.0 },
        cuda: None,
    },
    // A few operations per element (exp + add + divide, or polynomial approximations).
    UnaryRow {
        name: "Sigmoid",
        flops: 3,
        keeps: Out,
        autocast: Promote,
        fold: None,
        int: None,
        params: no_params,
        f: |x, _| sigmoid(x),
        d: |y, _| y * (1.0 - y),
        cuda: Some(("mp_sigmoid(x)", "s * (1.0f - s)")),
    },
    UnaryRow {
        name: "HardSigmoid",
        flops: 3,
        keeps: In,
        autocast: Promote,
        fold: None,
        int: None,
        params: |a| {
            let (al, be) = (a.float("alpha"), a.float("beta"));
            Ok([al.unwrap_or(0.2), be.unwrap_or(0.5), 0.0])
        },
        f: |x, p| (p[0] * x + p[1]).clamp(0.0, 1.0),
        d: |x, p| {
            let v = p[0] * x + p[1];
            if v > 0.0 && v < 1.0 {
                p[0]
            } else {
                0.0
            }
        },
        cuda: Some((
            "fminf(fmaxf(alpha * x + beta, 0.0f), 1.0f)",
            "(alpha * s + beta > 0.0f && alpha * s + beta < 1.0f) ? alpha : 0.0f",
        )),
    },
    UnaryRow {
        name: "HardSwish",
        flops: 4,
        keeps: In,
        autocast: Promote,
        fold: None,
        int: None,
        params: no_params,
        f: |x, _| x * (x / 6.0 + 0.5).clamp(0.0, 1.0),
        d: |x, _| {
            if x < -3.0 {
                0.0
            } else if x > 3.0 {
                1.0
            } else {
                x / 3.0 + 0.5
            }
        },
        cuda: Some((
            "x * fminf(fmaxf(x / 6.0f + 0.5f, 0.0f), 1.0f)",
            "s < -3.0f ? 0.0f : (s > 3.0f ? 1.0f : s / 3.0f + 0.5f)",
        )),
    },
    UnaryRow {
        name: "Softplus",
        flops: 3,
        keeps: In,
        autocast: Full,
        fold: None,
        int: None,
        params: no_params,
        f: |x, _| softplus(x),
        d: |x, _| sigmoid(x),
        cuda: Some(("mp_softplus(x)", "mp_sigmoid(s)")),
    },
    UnaryRow {
        name: "Softsign",
        flops: 3,
        keeps: In,
        autocast: Promote,
        fold: None,
        int: None,
        params: no_params,
        f: |x, _| x / (1.0 + x.abs()),
        d: |x, _| 1.0 / (1.0 + x.abs()).powi(2),
        cuda: None,
    },
    UnaryRow {
        name: "Elu",
        flops: 3,
        keeps: Out,
        autocast: Promote,
        fold: None,
        int: None,
        params: alpha!(1.0),
        f: |x, p| if x < 0.0 { p[0] * x.exp_m1() } else { x },
        d: |y, p| if y > 0.0 { 1.0 } else { y + p[0] },
        cuda: Some((
            "x < 0.0f ? alpha * expm1f(x) : x",
            "s > 0.0f ? 1.0f : s + alpha",
        )),
    },
    UnaryRow {
        name: "Selu",
        flops: 4,
        keeps: Out,
        autocast: Promote,
        fold: None,
        int: None,
        params: |a| {
            let (al, g) = (a.float("alpha"), a.float("gamma"));
            Ok([al.unwrap_or(1.673_263_2), 0.0, g.unwrap_or(1.050_701)])
        },
        f: |x, p| p[2] * if x > 0.0 { x } else { p[0] * x.exp_m1() },
        d: |y, p| if y > 0.0 { p[2] } else { y + p[0] * p[2] },
        cuda: None,
    },
    UnaryRow {
        name: "Celu",
        flops: 4,
        keeps: Out,
        autocast: Promote,
        fold: None,
        int: None,
        params: alpha!(1.0),
        f: |x, p| x.max(0.0) + (p[0] * (x / p[0]).exp_m1()).min(0.0),
        d: |y, p| if y > 0.0 { 1.0 } else { y / p[0] + 1.0 },
        cuda: None,
    },
    UnaryRow {
        name: "Mish",
        flops: 6,
        keeps: In,
        autocast: Promote,
        fold: None,
        int: None,
        params: no_params,
        f: |x, _| x * softplus(x).tanh(),
        d: |x, _| {
            let t = softplus(x).tanh();
            t + x * (1.0 - t * t) * sigmoid(x)
        },
        cuda: None,
    },
    UnaryRow {
        name: "Gelu",
        flops: 8,
        keeps: In,
        autocast: Promote,
        fold: None,
        int: None,
        params: gelu_params,
        f: |x, p| {
            if p[0] == 0.0 {
                0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2))
            } else {
                0.5 * x * (1.0 + (gelu_c() * (x + 0.044_715 * x * x * x)).tanh())
            }
        },
        d: |x, p| {
            if p[0] == 0.0 {
                let cdf = 0.5 * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2));
                let pdf = (-0.5 * x * x).exp()
                    * (0.5 * std::f32::consts::FRAC_2_SQRT_PI)
                    * std::f32::consts::FRAC_1_SQRT_2;
                cdf + x * pdf
            } else {
                let t = (gelu_c() * (x + 0.044_715 * x * x * x)).tanh();
                0.5 * (1.0 + t)
                    + 0.5 * x * (1.0 - t * t) * gelu_c() * (1.0 + 3.0 * 0.044_715 * x * x)
            }
        },
        cuda: Some(("mp_gelu(x, alpha)", "mp_gelu_d(s, alpha)")),
    },
    // The inverse and hyperbolic trigonometric family (autograd saves the input).
    UnaryRow {
        name: "Asin",
        flops: 1,
        keeps: In,
        autocast: Promote,
        fold: Some(f64::asin),
        int: None,
        params: no_params,
        f: |x, _| x.asin(),
        d: |x, _| 1.0 / (1.0 - x * x).sqrt(),
        cuda: Some(("asinf(x)", "1.0f / sqrtf(1.0f - s * s)")),
    },
    UnaryRow {
        name: "Acos",
        flops: 1,
        keeps: In,
        autocast: Promote,
        fold: Some(f64::acos),
        int: None,
        params: no_params,
        f: |x, _| x.acos(),
        d: |x, _| -1.0 / (1.0 - x * x).sqrt(),
        cuda: Some(("acosf(x)", "-1.0f / sqrtf(1.0f - s * s)")),
    },
    UnaryRow {
        name: "Sinh",
        flops: 1,
        keeps: In,
        autocast: Promote,
        fold: Some(f64::sinh),
        int: None,
        params: no_params,
        f: |x, _| x.sinh(),
        d: |x, _| x.cosh(),
        cuda: Some(("sinhf(x)", "coshf(s)")),
    },
    UnaryRow {
        name: "Cosh",
        flops: 1,
        keeps: In,
        autocast: Promote,
        fold: Some(f64::cosh),
        int: None,
        params: no_params,
        f: |x, _| x.cosh(),
        d: |x, _| x.sinh(),
        cuda: Some(("coshf(x)", "sinhf(s)")),
    },
    UnaryRow {
        name: "Asinh",
        flops: 1,
        keeps: In,
        autocast: Promote,
        fold: Some(f64::asinh),
        int: None,
        params: no_params,
        f: |x, _| x.asinh(),
        d: |x, _| 1.0 / (x * x + 1.0).sqrt(),
        cuda: Some(("asinhf(x)", "1.0f / sqrtf(s * s + 1.0f)")),
    },
    UnaryRow {
        name: "Acosh",
        flops: 1,
        keeps: In,
        autocast: Promote,
        fold: Some(f64::acosh),
        int: None,
        params: no_params,
        f: |x, _| x.acosh(),
        d: |x, _| 1.0 / (x * x - 1.0).sqrt(),
        cuda: Some(("acoshf(x)", "1.0f / sqrtf(s * s - 1.0f)")),
    },
    UnaryRow {
        name: "Atanh",
        flops: 1,
        keeps: In,
        autocast: Promote,
        fold: Some(f64::atanh),
        int: None,
        params: no_params,
        f: |x, _| x.atanh(),
        d: |x, _| 1.0 / (1.0 - x * x),
        cuda: Some(("atanhf(x)", "1.0f / (1.0f - s * s)")),
    },
    // Swish (opset 24): x · sigmoid(alpha · x), PyTorch's SiLU at alpha 1 (saves the input).
    UnaryRow {
        name: "Swish",
        flops: 4,
        keeps: In,
        autocast: Promote,
        fold: None,
        int: None,
        params: alpha!(1.0),
        f: |x, p| x * sigmoid(p[0] * x),
        d: |x, p| {
            let s = sigmoid(p[0] * x);
            s + p[0] * x * s * (1.0 - s)
        },
        cuda: Some((
            "x * mp_sigmoid(alpha * x)",
            "mp_sigmoid(alpha * s) + alpha * s * mp_sigmoid(alpha * s) * (1.0f - mp_sigmoid(alpha * s))",
        )),
    },
    // Shrink: x + bias below -lambd, x - bias above lambd, 0 between (PyTorch's
    // hard/softshrink; saves the input).
    UnaryRow {
        name: "Shrink",
        flops: 2,
        keeps: In,
        autocast: Promote,
        fold: None,
        int: None,
        params: |a| {
            let (l, b) = (a.float("lambd"), a.float("bias"));
            Ok([l.unwrap_or(0.5), b.unwrap_or(0.0), 0.0])
        },
        f: |x, p| {
            if x < -p[0] {
                x + p[1]
            } else if x > p[0] {
                x - p[1]
            } else {
                0.0
            }
        },
        d: |x, p| if x < -p[0] || x > p[0] { 1.0 } else { 0.0 },
        cuda: Some((
            "x < -alpha ? x + beta : (x > alpha ? x - beta : 0.0f)",
            "(s < -alpha || s > alpha) ? 1.0f : 0.0f",
        )),
    },
];

/// The row of unary op `op` and its op code (its index in [`UNARY`]).
pub fn unary_row(op: &str) -> Option<(i32, &'static UnaryRow)> {
    row_of(UNARY, op, |r| r.name)
}

/// The C of kernels/elementwise.cu's `mp_unary(op, x, alpha, beta, gamma)` and
/// `mp_unary_d(op, s, alpha, beta, gamma)`: one case per row with CUDA code.
pub(super) fn cuda_switches() -> String {
    let mut f = String::new();
    let mut d = String::new();
    for (i, r) in UNARY.iter().enumerate() {
        if let Some((fx, ds)) = r.cuda {
            f.push_str(&format!("    case {i}: return {fx}; // {}\n", r.name));
            d.push_str(&format!("    case {i}: return {ds}; // {}\n", r.name));
        }
    }
    let sig = "float alpha, float beta, float gamma";
    format!(
        "__device__ __forceinline__ float mp_unary(int op, float x, {sig}) {{\n    switch (op) {{\n{f}    default: return __int_as_float(0x7fc00000);\n    }}\n}}\n\
         __device__ __forceinline__ float mp_unary_d(int op, float s, {sig}) {{\n    switch (op) {{\n{d}    default: return __int_as_float(0x7fc00000);\n    }}\n}}\n"
    )
}

/// A unary map `y = f(x)` of the same shape: one row of [`UNARY`].
pub(super) struct Unary(pub(super) &'static UnaryRow);

impl Op for Unary {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        if self.0.name == "BitwiseNot" && (x.dtype.is_float() || x.dtype == DType::Bool) {
            return Err(format!("BitwiseNot takes integers, got {}", x.dtype).into());
        }
        let value = match (&x.value, self.0.fold) {
            (Some(v), Some(f)) => Some(map_value(v, x.dtype.is_float(), f)),
            _ => None,
        };
        Ok(vec![Fact {
            dtype: x.dtype,
            shape: x.shape.clone(),
            value: value.map(Box::new),
        }])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        self.0.flops.saturating_mul(out[0].numel())
    }
    /// Backward FLOPs: one multiply by the derivative per element, plus computing it.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let needs: Vec<Saved> = self.0.keeps.saved().into_iter().collect();
        let flops = (self.0.flops + 1).saturating_mul(out[0].numel());
        Ok(Some(Backward::each(&[0], &needs, flops)))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        if self.0.flops == 0 {
            Storage::View
        } else {
            Storage::New
        }
    }
    elementwise_layout!();
    /// Floats computed in f32 (half types widened and rounded back); integers
    /// where the row has an integer kernel.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let shape = x.shape.clone();
        if self.0.name == "Identity" {
            return Ok(vec![x.clone()]);
        }
        if !x.dtype().is_float() {
            let Some(f) = self.0.int else {
                return Err(format!("{} on {} is not supported", self.0.name, x.dtype()).into());
            };
            let v = x.to_i64s().into_iter().map(f).collect();
            return Ok(vec![Tensor::from_i64(x.dtype(), shape, v)?]);
        }
        let (p, f) = (self.0.params(cx.attrs())?, self.0.f);
        let v = map_f32(&x.to_f32()?, |x| f(x, &p));
        Ok(vec![Tensor::from_f32(x.dtype(), shape, v)?])
    }
    /// `g · f'(s)`, `s` the saved input or output the row names.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let (p, d) = (self.0.params(cx.attrs())?, self.0.d);
        let g = cx.grad(0)?;
        let v: Vec<f32> = match self.0.keeps.saved() {
            None => {
                let k = d(0.0, &p);
                g.iter().map(|&g| g * k).collect()
            }
            Some(s) => {
                let s = cx.saved(s)?.to_f32()?;
                if s.len() != g.len() {
                    return Err("the saved tensor and the gradient differ in size".into());
                }
                if g.len() >= PAR_ELEMS {
                    g.par_iter()
                        .zip(s.par_iter())
                        .map(|(&g, &s)| g * d(s, &p))
                        .collect()
                } else {
                    g.iter()
                        .zip(s.iter())
                        .map(|(&g, &s)| g * d(s, &p))
                        .collect()
                }
            }
        };
        cx.answer(vec![(0, v)])
    }
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        match self.0.cuda {
            Some(_) => CudaKernels::new(Launch::Unary, &["unary_fwd_f32"], &["unary_bwd_f32"]),
            None => CudaKernels::HOST,
        }
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        self.0.autocast
    }
}

/// A predicate `y = p(x)` yielding bool (Not, IsNaN, IsInf): not differentiable,
/// run on the host on a device.
pub(super) struct Predicate {
    pub(super) fold: fn(f64) -> f64,
    pub(super) kernel: fn(&Tensor, &Attrs) -> RuleResult<Vec<bool>>,
}

impl Op for Predicate {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        Ok(vec![Fact {
            dtype: DType::Bool,
            shape: x.shape.clone(),
            value: x
                .value
                .as_ref()
                .map(|v| Box::new(map_value(v, x.dtype.is_float(), self.fold))),
        }])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel()
    }
    fn backward(&self, _cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(None)
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    elementwise_layout!();
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let v = (self.kernel)(x, cx.attrs())?;
        Ok(vec![Tensor::bool(x.shape.clone(), v)])
    }
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        no_gradient(cx)
    }
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

pub(super) fn not(x: &Tensor, _: &Attrs) -> RuleResult<Vec<bool>> {
    match &x.elems {
        Elems::Bool(b) => Ok(b.iter().map(|&b| !b).collect()),
        e => Err(format!("Not takes bool, got {}", e.dtype()).into()),
    }
}

pub(super) fn is_nan(x: &Tensor, _: &Attrs) -> RuleResult<Vec<bool>> {
    Ok(x.to_f32()?.iter().map(|v| v.is_nan()).collect())
}

pub(super) fn is_inf(x: &Tensor, a: &Attrs) -> RuleResult<Vec<bool>> {
    let pos = a.int_or("detect_positive", 1) != 0;
    let neg = a.int_or("detect_negative", 1) != 0;
    Ok(x.to_f32()?
        .iter()
        .map(|&v| v.is_infinite() && ((v > 0.0 && pos) || (v < 0.0 && neg)))
        .collect())
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
