//! Broadcasting binary ops. Every fact of one arithmetic op is one row of
//! [`BINARY`] (FLOPs, autocast class, folding, the f32 and integer kernels, what
//! each operand's gradient reads and its derivative, and the CUDA C of the
//! forward and of both derivatives), and every comparison one row of
//! [`COMPARE`]; kernels/elementwise.cu's `mp_binary`, `mp_binary_d` and
//! `mp_compare` switches are generated from them ([`cuda_switches`]; the op
//! code is the row's index). A new binary op is one row.

#[allow(unused_imports)]
use super::*;

/// An element function of two operands.
type F2 = fn(f32, f32) -> f32;
/// An integer element function of two operands.
type I2 = fn(i64, i64) -> i64;
/// Folding an integer element (`None`: overflow or undefined, no fold) given the attributes.
type FoldInt = fn(i64, i64, &Attrs) -> Option<i64>;
/// A comparison of integers and one of floats.
type Compares = (fn(i64, i64) -> bool, fn(f32, f32) -> bool);

/// One operand's gradient: what it reads, and `g · ∂y/∂operand` per element of
/// the broadcast shape from `(g, a, b, y)` (0 for what it does not read).
pub struct Deriv {
    /// The forward tensors it reads.
    pub needs: &'static [Saved],
    d: fn(f32, f32, f32, f32) -> f32,
    /// Its CUDA C, of `gv`, `A`, `B` and `Y` (the operands and the output).
    cuda: &'static str,
}

/// Everything about one broadcasting arithmetic op.
pub struct BinaryRow {
    /// ONNX op type.
    pub name: &'static str,
    /// FLOPs per output element.
    pub flops: u64,
    /// How autocast treats it.
    pub autocast: Autocast,
    /// Constant folding: integers (`None`: overflow or undefined, no fold) and floats.
    fold: (FoldInt, fn(f64, f64) -> f64),
    /// The f32 kernel for the node's attributes (an error where ONNX or memplan
    /// has none for floats).
    float: fn(&Attrs) -> RuleResult<F2>,
    /// The integer kernel for the node's attributes.
    int: fn(&Attrs) -> RuleResult<I2>,
    /// The gradients of operands 0 and 1 (`None`: no gradient flows).
    grad: Option<[Deriv; 2]>,
    /// Output-sized tensors PyTorch's backward holds at once, its results included
    /// (a broadcast operand's gradient is output-sized until the engine reduces it),
    /// given which operands' gradients are wanted (0: nothing beyond the results is
    /// modelled); see [`Op::backward_scratch`] for `Binary`.
    /// Measured on PyTorch 2.15 (CPU, the node's `grad_fn` called alone; CUDA runs
    /// the same derivative formulas).
    bw_peak: fn([bool; 2]) -> u64,
    /// The CUDA C of the forward, of `a` and `b`; `None`: the op runs on the host
    /// on a device.
    cuda: Option<&'static str>,
}

impl BinaryRow {
    /// Whether the device runs it ([`BinaryRow::cuda`]).
    pub fn on_device(&self) -> bool {
        self.cuda.is_some()
    }
}

macro_rules! always {
    ($f:expr) => {
        |_: &Attrs| Ok($f)
    };
}

fn no_float(name: &'static str) -> RuleResult<F2> {
    Err(format!("{name} on floats is not supported").into())
}

/// `Saved::Input(0)`, `Saved::Input(1)`, `Saved::Output(0)`.
const A: Saved = Saved::Input(0);
const B: Saved = Saved::Input(1);
const Y: Saved = Saved::Output(0);

use Autocast::{Full, Promote};

/// The arithmetic ops. The row index is the op code of kernels/elementwise.cu.
pub static BINARY: &[BinaryRow] = &[
    BinaryRow {
        name: "Add",
        flops: 1,
        autocast: Promote,
        fold: (|a, b, _| a.checked_add(b), |a, b| a + b),
        float: always!(|x, y| x + y),
        int: always!(i64::wrapping_add),
        grad: Some([
            Deriv {
                needs: &[],
                d: |g, _, _, _| g,
                cuda: "gv",
            },
            Deriv {
                needs: &[],
                d: |g, _, _, _| g,
                cuda: "gv",
            },
        ]),
        // AddBackward0 passes the incoming gradient on.
        bw_peak: |_| 0,
        cuda: Some("a + b"),
    },
    BinaryRow {
        name: "Sub",
        flops: 1,
        autocast: Promote,
        fold: (|a, b, _| a.checked_sub(b), |a, b| a - b),
        float: always!(|x, y| x - y),
        int: always!(i64::wrapping_sub),
        grad: Some([
            Deriv {
                needs: &[],
                d: |g, _, _, _| g,
                cuda: "gv",
            },
            Deriv {
                needs: &[],
                d: |g, _, _, _| -g,
                cuda: "-gv",
            },
        ]),
        // SubBackward0 passes the gradient on to the minuend and negates it for
        // the subtrahend; memplan counts these as the results.
        bw_peak: |_| 0,
        cuda: Some("a - b"),
    },
    BinaryRow {
        name: "Mul",
        flops: 1,
        autocast: Promote,
        fold: (|a, b, _| a.checked_mul(b), |a, b| a * b),
        float: always!(|x, y| x * y),
        int: always!(i64::wrapping_mul),
        // MulBackward saves the other operand for each gradient.
        grad: Some([
            Deriv {
                needs: &[B],
                d: |g, _, b, _| g * b,
                cuda: "gv * B",
            },
            Deriv {
                needs: &[A],
                d: |g, a, _, _| g * a,
                cuda: "gv * A",
            },
        ]),
        // MulBackward0: `grad * other`, `grad * self`, one tensor each.
        bw_peak: |w| w[0] as u64 + w[1] as u64,
        cuda: Some("a * b"),
    },
    BinaryRow {
        name: "Div",
        flops: 1,
        autocast: Promote,
        // Integer Div truncates, as ONNX does for integer tensors.
        fold: (|a, b, _| a.checked_div(b), |a, b| a / b),
        float: always!(|x, y| x / y),
        int: always!(|x, y| if y == 0 { 0 } else { x.wrapping_div(y) }),
        // DivBackward: the divisor (and the dividend for the divisor's gradient).
        grad: Some([
            Deriv {
                needs: &[B],
                d: |g, _, b, _| g / b,
                cuda: "gv / B",
            },
            Deriv {
                needs: &[A, B],
                d: |g, a, b, _| -g * a / (b * b),
                cuda: "-gv * A / (B * B)",
            },
        ]),
        // DivBackward0: `grad / other` for the dividend; for the divisor
        // `-grad * ((self / other) / other)`, whose C++ temporaries live to the end of
        // the expression: four at once.
        bw_peak: |w| if w[1] { 4 } else { w[0] as u64 },
        cuda: Some("a / b"),
    },
    BinaryRow {
        name: "Pow",
        flops: 1,
        // Autocast's fp32 list.
        autocast: Full,
        fold: (
            |a, b, _| u32::try_from(b).ok().and_then(|b| a.checked_pow(b)),
            f64::powf,
        ),
        float: always!(pow_f32),
        int: always!(|x, y| x.wrapping_pow(y.clamp(0, u32::MAX as i64) as u32)),
        // PowBackward: self and exponent (and the result for the exponent's
        // gradient). d/da a^b = b·a^(b−1); d/db a^b = a^b·ln a (0 where a = 0, as
        // PyTorch).
        grad: Some([
            Deriv {
                needs: &[A, B],
                d: |g, x, e, _| {
                    let d = if e == 0.0 {
                        0.0
                    } else if e == 2.0 {
                        2.0 * x
                    } else {
                        e * x.powf(e - 1.0)
                    };
                    g * d
                },
                cuda: "gv * (B == 0.0f ? 0.0f : (B == 2.0f ? 2.0f * A : B * powf(A, B - 1.0f)))",
            },
            Deriv {
                needs: &[A, Y],
                d: |g, x, _, y| if x == 0.0 { 0.0 } else { g * y * x.ln() },
                cuda: "A == 0.0f ? 0.0f : gv * Y * logf(A)",
            },
        ]),
        // PowBackward0 of a scalar exponent, `grad * (exponent * self.pow(exponent -
        // 1))`: three at once; with the exponent's gradient (PowBackward1) four, six
        // with both.
        bw_peak: |w| match w {
            [_, false] => 3 * w[0] as u64,
            [false, true] => 4,
            [true, true] => 6,
        },
        cuda: Some("mp_pow(a, b)"),
    },
    BinaryRow {
        name: "PRelu",
        flops: 2,
        autocast: Promote,
        fold: (|_, _, _| None, |x, s| if x < 0.0 { x * s } else { x }),
        float: always!(|x, s| if x < 0.0 { x * s } else { x }),
        int: |_| Err("PRelu on integers is not supported".into()),
        grad: Some([
            Deriv {
                needs: &[A, B],
                d: |g, x, s, _| if x > 0.0 { g } else { g * s },
                cuda: "A > 0.0f ? gv : gv * B",
            },
            Deriv {
                needs: &[A, B],
                d: |g, x, _, _| if x > 0.0 { 0.0 } else { g * x },
                cuda: "A > 0.0f ? 0.0f : gv * A",
            },
        ]),
        bw_peak: |_| 0,
        cuda: None,
    },
    BinaryRow {
        name: "Mod",
        flops: 1,
        autocast: Promote,
        fold: (
            |a, b, at| match (b, at.int_or("fmod", 0) != 0) {
                (0, _) => None,
                (_, true) => a.checked_rem(b),
                (_, false) => Some(py_mod(a, b)),
            },
            // Floats need fmod = 1: C's fmod, the sign of the dividend.
            |a, b| a % b,
        ),
        float: |at| {
            if at.int_or("fmod", 0) != 0 {
                Ok(|x, y| x % y)
            } else {
                Err("Mod on floats needs fmod = 1".into())
            }
        },
        int: |at| {
            Ok(if at.int_or("fmod", 0) != 0 {
                |x, y| if y == 0 { 0 } else { x.wrapping_rem(y) }
            } else {
                py_mod
            })
        },
        // Integer Mod has no gradient; a float Mod's is not modelled (see `backward`).
        grad: None,
        bw_peak: |_| 0,
        cuda: None,
    },
    BinaryRow {
        name: "BitShift",
        flops: 1,
        autocast: Promote,
        fold: (|_, _, _| None, |a, _| a),
        float: |_| no_float("BitShift"),
        int: |at| {
            Ok(if at.string("direction") == Some("LEFT") {
                |x, y| ((x as u64) << (y & 63)) as i64
            } else {
                |x, y| ((x as u64) >> (y & 63)) as i64
            })
        },
        grad: None,
        bw_peak: |_| 0,
        cuda: None,
    },
    // Bitwise ops on integers (opset 18): no gradient, on the host on a device.
    BinaryRow {
        name: "BitwiseAnd",
        flops: 1,
        autocast: Promote,
        fold: (|a, b, _| Some(a & b), |a, _| a),
        float: |_| no_float("BitwiseAnd"),
        int: always!(|x, y| x & y),
        grad: None,
        bw_peak: |_| 0,
        cuda: None,
    },
    BinaryRow {
        name: "BitwiseOr",
        flops: 1,
        autocast: Promote,
        fold: (|a, b, _| Some(a | b), |a, _| a),
        float: |_| no_float("BitwiseOr"),
        int: always!(|x, y| x | y),
        grad: None,
        bw_peak: |_| 0,
        cuda: None,
    },
    BinaryRow {
        name: "BitwiseXor",
        flops: 1,
        autocast: Promote,
        fold: (|a, b, _| Some(a ^ b), |a, _| a),
        float: |_| no_float("BitwiseXor"),
        int: always!(|x, y| x ^ y),
        grad: None,
        bw_peak: |_| 0,
        cuda: None,
    },
];

/// Everything about one comparison (a bool result, no gradient).
pub struct CompareRow {
    /// ONNX op type.
    pub name: &'static str,
    /// Constant folding.
    fold: fn(f64, f64) -> bool,
    /// On bool operands (`None`: not defined for bools).
    bools: Option<fn(bool, bool) -> bool>,
    /// On integer and float operands (`None`: bools only).
    nums: Option<Compares>,
    /// The CUDA C on floats `x`, `z`; `None`: the host.
    cuda: Option<&'static str>,
}

/// The comparisons and logical ops. The row index is the op code of `compare_f32`.
pub static COMPARE: &[CompareRow] = &[
    CompareRow {
        name: "Equal",
        fold: |a, b| a == b,
        bools: Some(|x, y| x == y),
        nums: Some((|x, y| x == y, |x, y| x == y)),
        cuda: Some("x == z"),
    },
    CompareRow {
        name: "Less",
        fold: |a, b| a < b,
        bools: None,
        nums: Some((|x, y| x < y, |x, y| x < y)),
        cuda: Some("x < z"),
    },
    CompareRow {
        name: "LessOrEqual",
        fold: |a, b| a <= b,
        bools: None,
        nums: Some((|x, y| x <= y, |x, y| x <= y)),
        cuda: Some("x <= z"),
    },
    CompareRow {
        name: "Greater",
        fold: |a, b| a > b,
        bools: None,
        nums: Some((|x, y| x > y, |x, y| x > y)),
        cuda: Some("x > z"),
    },
    CompareRow {
        name: "GreaterOrEqual",
        fold: |a, b| a >= b,
        bools: None,
        nums: Some((|x, y| x >= y, |x, y| x >= y)),
        cuda: Some("x >= z"),
    },
    CompareRow {
        name: "And",
        fold: |a, b| a != 0.0 && b != 0.0,
        bools: Some(|x, y| x && y),
        nums: None,
        cuda: None,
    },
    CompareRow {
        name: "Or",
        fold: |a, b| a != 0.0 || b != 0.0,
        bools: Some(|x, y| x || y),
        nums: None,
        cuda: None,
    },
    CompareRow {
        name: "Xor",
        fold: |a, b| (a != 0.0) != (b != 0.0),
        bools: Some(|x, y| x != y),
        nums: None,
        cuda: None,
    },
];

/// The row of arithmetic op `op` and its op code.
pub fn binary_row(op: &str) -> Option<(i32, &'static BinaryRow)> {
    row_of(BINARY, op, |r| r.name)
}

/// The row of comparison `op` and its op code.
pub fn compare_row(op: &str) -> Option<(i32, &'static CompareRow)> {
    row_of(COMPARE, op, |r| r.name)
}

/// The C of `mp_binary(op, a, b)`, `mp_binary_d(op, slot, gv, A, B, Y)` and
/// `mp_compare(op, x, z)`: one case per row with CUDA code.
pub(super) fn cuda_binary_switches() -> String {
    let nan = "default: return __int_as_float(0x7fc00000);";
    let (mut f, mut d, mut c) = (String::new(), String::new(), String::new());
    for (i, r) in BINARY.iter().enumerate() {
        let Some(fx) = r.cuda else { continue };
        f.push_str(&format!("    case {i}: return {fx}; // {}\n", r.name));
        if let Some([d0, d1]) = &r.grad {
            d.push_str(&format!(
                "    case {i}: return slot == 0 ? ({}) : ({}); // {}\n",
                d0.cuda, d1.cuda, r.name
            ));
        }
    }
    for (i, r) in COMPARE.iter().enumerate() {
        if let Some(cx) = r.cuda {
            c.push_str(&format!("    case {i}: return {cx}; // {}\n", r.name));
        }
    }
    format!(
        "__device__ __forceinline__ float mp_binary(int op, float a, float b) {{\n    switch (op) {{\n{f}    {nan}\n    }}\n}}\n\
         __device__ __forceinline__ float mp_binary_d(int op, int slot, float gv, float A, float B, float Y) {{\n    switch (op) {{\n{d}    {nan}\n    }}\n}}\n\
         __device__ __forceinline__ bool mp_compare(int op, float x, float z) {{\n    switch (op) {{\n{c}    default: return false;\n    }}\n}}\n"
    )
}

/// Folds an element-wise op over broadcast inputs when all values are known.
pub(super) fn fold_broadcast(
    vals: &[&Value],
    out_shape: &[usize],
    f: impl Fn(&[usize]) -> Option<FoldElem>,
) -> Option<Data> {
    let n: usize = out_shape.iter().product();
    if n > MAX_FOLD_ELEMS {
        return None;
    }
    let rank = out_shape.len();
    // Each operand's stride along each output axis (0 where it broadcasts), and
    // its flat index, kept up to date as the output coordinate advances.
    let strides: Vec<Vec<usize>> = vals
        .iter()
        .map(|v| {
            let off = rank - v.shape.len();
            let mut st = vec![0usize; rank];
            let mut step = 1;
            for (i, &d) in v.shape.iter().enumerate().rev() {
                if d != 1 {
                    st[off + i] = step;
                }
                step *= d;
            }
            st
        })
        .collect();
    let mut idx = vec![0usize; vals.len()];
    let mut ints = Vec::new();
    let mut floats = Vec::new();
    let mut coord = vec![0usize; rank];
    for _ in 0..n {
        // The first element tells the kind: room for all `n` at once.
        match f(&idx)? {
            FoldElem::I(x) => {
                if ints.capacity() == 0 {
                    ints.reserve_exact(n);
                }
                ints.push(x)
            }
            FoldElem::F(x) => {
                if floats.capacity() == 0 {
                    floats.reserve_exact(n);
                }
                floats.push(x)
            }
        }
        for i in (0..rank).rev() {
            coord[i] += 1;
            if coord[i] < out_shape[i] {
                for (x, st) in idx.iter_mut().zip(&strides) {
                    *x += st[i];
                }
                break;
            }
            for (x, st) in idx.iter_mut().zip(&strides) {
                *x -= st[i] * (out_shape[i] - 1);
            }
            coord[i] = 0;
        }
    }
    Some(if floats.is_empty() {
        Data::Int(ints)
    } else if ints.is_empty() {
        Data::Float(floats)
    } else {
        return None;
    })
}

pub(super) enum FoldElem {
    I(i64),
    F(f64),
}

/// The facts of a broadcasting op of `a` and `b` with elements folded by `f`.
fn broadcast_fact(
    cx: &Cx,
    dtype: DType,
    f: impl Fn(&Value, usize, &Value, usize) -> Option<FoldElem>,
) -> RuleResult<Vec<Fact>> {
    let (a, b) = (cx.input(0)?, cx.input(1)?);
    let shape = broadcast(&[&a.shape, &b.shape])?;
    let value = match (&a.value, &b.value) {
        (Some(va), Some(vb)) => {
            fold_broadcast(&[va, vb], &shape, |i| f(va, i[0], vb, i[1])).map(|data| Value {
                shape: shape.clone(),
                data,
            })
        }
        _ => None,
    };
    Ok(vec![Fact {
        dtype,
        shape,
        value: value.map(Box::new),
    }])
}

/// A broadcasting arithmetic op: one row of [`BINARY`].
pub(super) struct Binary(pub(super) &'static BinaryRow);

impl Binary {
    /// Operand 1's shape as it broadcasts against operand 0's. The same, except
    /// PRelu before opset 7 (as old PyTorch exports write it): a 1-D slope of the
    /// channel count applies along axis 1, so `[C]` broadcasts as `[C, 1, ..]`.
    fn operand_shape(&self, opset: i64, a: &[usize], b: &[usize]) -> Vec<usize> {
        if self.0.name == "PRelu" && opset < 7 && b.len() == 1 && a.len() > 2 && a[1] == b[0] {
            let mut s = vec![1; a.len() - 1];
            s[0] = b[0];
            s
        } else {
            b.to_vec()
        }
    }
}

impl Op for Binary {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (a, b) = (cx.input(0)?, cx.input(1)?);
        let sb = self.operand_shape(cx.opset, &a.shape, &b.shape);
        if sb != b.shape {
            // Not folded: the slope is a weight.
            return Ok(vec![Fact::new(a.dtype, broadcast(&[&a.shape, &sb])?)]);
        }
        let float = a.dtype.is_float();
        let (fi, ff) = self.0.fold;
        let attrs = cx.attrs();
        broadcast_fact(cx, a.dtype, |va, i, vb, j| {
            Some(if float {
                FoldElem::F(ff(va.data.float(i), vb.data.float(j)))
            } else {
                FoldElem::I(fi(va.data.int(i), vb.data.int(j), attrs)?)
            })
        })
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        self.0.flops.saturating_mul(out[0].numel())
    }
    /// Each operand's gradient reads what its row says. Backward FLOPs: 2 per
    /// element per gradient.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let Some([d0, d1]) = &self.0.grad else {
            if self.0.name == "Mod" && out[0].dtype.is_float() {
                return Err("the gradient of a floating-point Mod is not modelled".into());
            }
            return Ok(None);
        };
        Ok(Some(Backward {
            grads: vec![
                Grad {
                    input: 0,
                    needs: d0.needs.to_vec(),
                },
                Grad {
                    input: 1,
                    needs: d1.needs.to_vec(),
                },
            ],
            extras: Vec::new(),
            flops: out[0].numel().saturating_mul(4),
        }))
    }
    /// What the row's [`BinaryRow::bw_peak`] holds beyond the wanted gradients
    /// memplan allocates (each of its operand's shape).
    fn backward_scratch(&self, cx: &Cx, wanted: &[usize]) -> u64 {
        let w = [wanted.contains(&0), wanted.contains(&1)];
        let shapes: Vec<&[usize]> = cx.inputs.iter().flatten().map(|f| &f.shape[..]).collect();
        let Ok(out) = broadcast(&shapes) else {
            return 0;
        };
        let numel = out.iter().fold(1u64, |n, &d| n.saturating_mul(d as u64));
        let held = (self.0.bw_peak)(w).saturating_mul(numel);
        let results: u64 = wanted
            .iter()
            .filter_map(|&k| cx.inputs.get(k).copied().flatten())
            .map(Fact::numel)
            .sum();
        held.saturating_sub(results)
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    elementwise_layout!();
    /// Input 0's type: floats in f32, integers in wrapping i64.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let (a, b) = (cx.input(0)?, cx.input(1)?);
        let out = cx.out(0)?.shape.clone();
        let sb = self.operand_shape(cx.opset, &a.shape, &b.shape);
        let (sa, sb) = (&a.shape[..], &sb[..]);
        let dtype = a.dtype();
        if dtype.is_float() {
            let f = (self.0.float)(cx.attrs())?;
            let (x, y) = (a.to_f32()?, float_operand(b)?);
            let v = if sa == out.as_slice() && sb == out.as_slice() && x.len() >= PAR_ELEMS {
                x.par_iter()
                    .zip(y.par_iter())
                    .map(|(&p, &q)| f(p, q))
                    .collect()
            } else {
                zip2(&out, (&x, sa), (&y, sb), f)
            };
            return Ok(vec![Tensor::from_f32(dtype, out, v)?]);
        }
        let f = (self.0.int)(cx.attrs())?;
        let v = zip2(&out, (&a.to_i64s(), sa), (&b.to_i64s(), sb), f);
        Ok(vec![Tensor::from_i64(dtype, out, v)?])
    }
    /// Each operand's gradient computed at the broadcast shape from the saved
    /// tensors its row reads, then summed back over the axes it was broadcast along.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let Some(derivs) = &self.0.grad else {
            return no_gradient(cx);
        };
        let out = cx.output(0)?.shape.clone();
        let sa = cx.input(0)?.shape.clone();
        let sb = self.operand_shape(cx.opset, &sa, &cx.input(1)?.shape);
        let g = cx.grad(0)?;
        // A saved operand as f32 at the shape it broadcasts from; a scalar 0 where
        // not read.
        let val = |s: Saved, needs: &[Saved]| -> RuleResult<(Vec<f32>, Vec<usize>)> {
            if !needs.contains(&s) {
                return Ok((vec![0.0], vec![]));
            }
            let t = cx.saved(s)?;
            let shape = if s == B { sb.clone() } else { t.shape.clone() };
            Ok((float_operand(t)?.into_owned(), shape))
        };
        let mut res = Vec::new();
        for (slot, dv) in derivs.iter().enumerate() {
            if !cx.wants(slot) {
                continue;
            }
            let d = dv.d;
            let full: Vec<f32> = if dv.needs.is_empty() {
                g.iter().map(|&g| d(g, 0.0, 0.0, 0.0)).collect()
            } else {
                let (a, b, y) = (val(A, dv.needs)?, val(B, dv.needs)?, val(Y, dv.needs)?);
                let mut v = Vec::with_capacity(g.len());
                for_each(&out, [&a.1[..], &b.1[..], &y.1[..]], |o, [i, j, k]| {
                    v.push(d(g[o], a.0[i], b.0[j], y.0[k]))
                });
                v
            };
            let target = if slot == 0 { &sa } else { &sb };
            res.push((slot, sum_to(&full, &out, target)));
        }
        cx.answer(res)
    }
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        match (self.0.cuda, &self.0.grad) {
            (Some(_), Some(_)) => CudaKernels::new(
                Launch::Binary,
                &["binary_fwd_f32"],
                &["binary_bwd_f32", "reduce_f32"],
            ),
            (Some(_), None) => CudaKernels::new(Launch::Binary, &["binary_fwd_f32"], &[]),
            (None, _) => CudaKernels::HOST,
        }
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        self.0.autocast
    }
}

/// A broadcasting comparison to bool: one row of [`COMPARE`]. Integers compared
/// exactly, floats in f32, bools logically.
pub(super) struct Compare(pub(super) &'static CompareRow);

impl Op for Compare {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let f = self.0.fold;
        broadcast_fact(cx, DType::Bool, |va, i, vb, j| {
            Some(FoldElem::I(f(va.data.float(i), vb.data.float(j)) as i64))
        })
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
        let (a, b) = (cx.input(0)?, cx.input(1)?);
        let out = cx.out(0)?.shape.clone();
        let (sa, sb) = (&a.shape[..], &b.shape[..]);
        let name = self.0.name;
        let v: Vec<bool> = match (&a.elems, &b.elems, self.0.bools, self.0.nums) {
            (Elems::Bool(x), Elems::Bool(y), Some(f), _) => zip2(&out, (x, sa), (y, sb), f),
            (Elems::Bool(_), Elems::Bool(_), None, _) => {
                return Err(format!("{name} on bool is not supported").into())
            }
            (_, _, _, None) => return Err(format!("{name} takes bool operands").into()),
            (_, _, _, Some((fi, _))) if !a.dtype().is_float() && !b.dtype().is_float() => {
                zip2(&out, (&a.to_i64s(), sa), (&b.to_i64s(), sb), fi)
            }
            (_, _, _, Some((_, ff))) => {
                zip2(&out, (&float_operand(a)?, sa), (&float_operand(b)?, sb), ff)
            }
        };
        Ok(vec![Tensor::bool(out, v)])
    }
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        no_gradient(cx)
    }
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        match self.0.cuda {
            Some(_) => CudaKernels::new(Launch::Compare, &["compare_f32"], &[]),
            None => CudaKernels::HOST,
        }
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// Python's `%` (the result has the sign of the divisor): ONNX `Mod` with `fmod = 0`.
pub(super) fn py_mod(a: i64, b: i64) -> i64 {
    if b == 0 {
        return 0;
    }
    let r = a.wrapping_rem(b);
    if r != 0 && ((r < 0) != (b < 0)) {
        r + b
    } else {
        r
    }
}

/// `x^y` in f32, with integer exponents exact for small powers (ONNX Pow of a float
/// by 2 or 3 is common in GELU approximations).
pub(super) fn pow_f32(x: f32, y: f32) -> f32 {
    if y == 2.0 {
        x * x
    } else if y == 3.0 {
        x * x * x
    } else {
        x.powf(y)
    }
}

/// A float operand, any numeric type converted (Pow's exponent may be an integer).
pub(super) fn float_operand(t: &Tensor) -> RuleResult<std::borrow::Cow<'_, [f32]>> {
    if t.dtype().is_float() {
        t.to_f32()
    } else {
        Ok(std::borrow::Cow::Owned(
            t.to_f64s().into_iter().map(|v| v as f32).collect(),
        ))
    }
}
