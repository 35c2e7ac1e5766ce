//! Element-wise ops: unary maps, broadcasting binary ops, comparisons, variadic
//! reductions over inputs (Max, Min, Sum, Mean), Where, Cast, Clip and Dropout.
//!
//! FLOPs: `flops_per_elem` × output elements, listed per op in [`register`]
//! (1 for arithmetic, comparisons and single transcendental functions; more for
//! composite activations, e.g. Gelu 8 for its erf/tanh polynomial).

use super::{
    broadcast, dtype_attr, Arity, Backward, Cx, Fact, Grad, Op, Registry, RuleResult, Saved,
    Storage,
};
use crate::ir::value::MAX_FOLD_ELEMS;
use crate::ir::{DType, Data, Value};

/// What a unary op's backward reads (PyTorch's saved tensor).
#[derive(Clone, Copy)]
enum Keeps {
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
struct Unary {
    flops_per_elem: u64,
    bool_out: bool,
    fold: Option<fn(f64) -> f64>,
    keeps: Keeps,
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
}

fn map_value(v: &Value, float: bool, f: fn(f64) -> f64) -> Value {
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

/// How a binary op combines elements and what type it yields.
#[derive(Clone, Copy)]
enum BinKind {
    /// Same type as the inputs.
    Arith(fn(i64, i64) -> Option<i64>, fn(f64, f64) -> f64),
    /// Yields bool.
    Compare(fn(f64, f64) -> bool),
}

/// A broadcasting binary op.
struct Binary {
    flops_per_elem: u64,
    kind: BinKind,
}

/// Folds an element-wise op over broadcast inputs when all values are known.
fn fold_broadcast(
    vals: &[&Value],
    out_shape: &[usize],
    f: impl Fn(&[usize]) -> Option<FoldElem>,
) -> Option<Data> {
    let n: usize = out_shape.iter().product();
    if n > MAX_FOLD_ELEMS {
        return None;
    }
    let rank = out_shape.len();
    let mut idx = vec![0usize; vals.len()];
    let mut ints = Vec::new();
    let mut floats = Vec::new();
    let mut coord = vec![0usize; rank];
    for _ in 0..n {
        for (k, v) in vals.iter().enumerate() {
            let off = rank - v.shape.len();
            let mut flat = 0;
            for (i, &d) in v.shape.iter().enumerate() {
                flat = flat * d + if d == 1 { 0 } else { coord[off + i] };
            }
            idx[k] = flat;
        }
        match f(&idx)? {
            FoldElem::I(x) => ints.push(x),
            FoldElem::F(x) => floats.push(x),
        }
        for i in (0..rank).rev() {
            coord[i] += 1;
            if coord[i] < out_shape[i] {
                break;
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

enum FoldElem {
    I(i64),
    F(f64),
}

impl Op for Binary {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (a, b) = (cx.input(0)?, cx.input(1)?);
        let shape = broadcast(&[&a.shape, &b.shape])?;
        let dtype = match self.kind {
            BinKind::Arith(..) => a.dtype,
            BinKind::Compare(_) => DType::Bool,
        };
        let value = match (&a.value, &b.value) {
            (Some(va), Some(vb)) => {
                let float = a.dtype.is_float();
                let kind = self.kind;
                fold_broadcast(&[va, vb], &shape, |i| match kind {
                    BinKind::Arith(fi, ff) => Some(if float {
                        FoldElem::F(ff(va.data.float(i[0]), vb.data.float(i[1])))
                    } else {
                        FoldElem::I(fi(va.data.int(i[0]), vb.data.int(i[1]))?)
                    }),
                    BinKind::Compare(fc) => Some(FoldElem::I(fc(
                        va.data.float(i[0]),
                        vb.data.float(i[1]),
                    ) as i64)),
                })
                .map(|data| Value {
                    shape: shape.clone(),
                    data,
                })
            }
            _ => None,
        };
        Ok(vec![Fact {
            dtype,
            shape,
            value,
        }])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        self.flops_per_elem.saturating_mul(out[0].numel())
    }
    /// Add/Sub save nothing; Mul saves the other operand for each gradient; Div saves
    /// the divisor (and the dividend for the divisor's gradient); Pow and PRelu save
    /// both. Comparisons have no gradient. Backward FLOPs: 2 per element per gradient.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let name = cx.node.op_type.as_str();
        let (a, b): (Vec<Saved>, Vec<Saved>) = match (self.kind, name) {
            (BinKind::Compare(_), _) | (_, "BitShift") => return Ok(None),
            (_, "Mod") if out[0].dtype.is_float() => {
                return Err("the gradient of a floating-point Mod is not modelled".into())
            }
            (_, "Mod") => return Ok(None),
            (_, "Add" | "Sub") => (vec![], vec![]),
            (_, "Mul") => (vec![Saved::Input(1)], vec![Saved::Input(0)]),
            (_, "Div") => (
                vec![Saved::Input(1)],
                vec![Saved::Input(0), Saved::Input(1)],
            ),
            // PowBackward: self and exponent (and the result for the exponent's gradient).
            (_, "Pow") => (
                vec![Saved::Input(0), Saved::Input(1)],
                vec![Saved::Input(0), Saved::Output(0)],
            ),
            _ => (
                vec![Saved::Input(0), Saved::Input(1)],
                vec![Saved::Input(0), Saved::Input(1)],
            ),
        };
        Ok(Some(Backward {
            grads: vec![Grad { input: 0, needs: a }, Grad { input: 1, needs: b }],
            extras: Vec::new(),
            flops: out[0].numel().saturating_mul(4),
        }))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
}

/// Max, Min, Sum, Mean over 1+ broadcast inputs. FLOPs: one per output element per
/// extra input (Mean adds one division per element).
struct Variadic {
    mean: bool,
    fold: fn(f64, f64) -> f64,
}

impl Op for Variadic {
    fn arity(&self) -> Arity {
        Arity::new(1, usize::MAX, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let ins = (0..cx.inputs.len())
            .map(|i| cx.input(i))
            .collect::<RuleResult<Vec<_>>>()?;
        let shapes: Vec<&[usize]> = ins.iter().map(|f| f.shape.as_slice()).collect();
        let shape = broadcast(&shapes)?;
        let vals: Option<Vec<&Value>> = ins.iter().map(|f| f.value.as_ref()).collect();
        let float = ins[0].dtype.is_float();
        let value = vals.filter(|_| !self.mean).and_then(|vals| {
            let f = self.fold;
            fold_broadcast(&vals, &shape, |i| {
                let mut acc = vals[0].data.float(i[0]);
                for (k, v) in vals.iter().enumerate().skip(1) {
                    acc = f(acc, v.data.float(i[k]));
                }
                Some(if float {
                    FoldElem::F(acc)
                } else {
                    FoldElem::I(acc as i64)
                })
            })
            .map(|data| Value {
                shape: shape.clone(),
                data,
            })
        });
        Ok(vec![Fact {
            dtype: ins[0].dtype,
            shape,
            value,
        }])
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let extra = cx.inputs.len().saturating_sub(1) as u64 + self.mean as u64;
        extra.saturating_mul(out[0].numel())
    }
    /// Sum/Mean save nothing; Max/Min save their inputs (the gradient goes to the
    /// selected one). Backward FLOPs: 1 per element per input.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let n = cx.inputs.len();
        let needs: Vec<Saved> = if matches!(cx.node.op_type.as_str(), "Max" | "Min") {
            (0..n).map(Saved::Input).collect()
        } else {
            Vec::new()
        };
        let inputs: Vec<usize> = (0..n).collect();
        Ok(Some(Backward::each(
            &inputs,
            &needs,
            out[0].numel().saturating_mul(n as u64),
        )))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
}

/// `Where(cond, x, y)`: broadcast of three. FLOPs: 1 select per output element.
struct Where;

impl Op for Where {
    fn arity(&self) -> Arity {
        Arity::new(3, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (c, x, y) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
        if x.dtype != y.dtype {
            return Err(format!("X is {} but Y is {}", x.dtype, y.dtype));
        }
        let shape = broadcast(&[&c.shape, &x.shape, &y.shape])?;
        let value = match (&c.value, &x.value, &y.value) {
            (Some(vc), Some(vx), Some(vy)) => {
                let float = x.dtype.is_float();
                fold_broadcast(&[vc, vx, vy], &shape, |i| {
                    let pick = if vc.data.int(i[0]) != 0 {
                        (vx, i[1])
                    } else {
                        (vy, i[2])
                    };
                    Some(if float {
                        FoldElem::F(pick.0.data.float(pick.1))
                    } else {
                        FoldElem::I(pick.0.data.int(pick.1))
                    })
                })
                .map(|data| Value {
                    shape: shape.clone(),
                    data,
                })
            }
            _ => None,
        };
        Ok(vec![Fact {
            dtype: x.dtype,
            shape,
            value,
        }])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel()
    }
    /// Both branches' gradients are masked by the saved condition.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(Some(Backward::each(
            &[1, 2],
            &[Saved::Input(0)],
            out[0].numel().saturating_mul(2),
        )))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
}

/// `Cast` (attribute `to`) and `CastLike` (type of input 1). Data movement: 0 FLOPs.
struct Cast {
    like: bool,
}

impl Op for Cast {
    fn arity(&self) -> Arity {
        if self.like {
            Arity::new(2, 2, 1, 1)
        } else {
            Arity::new(1, 1, 1, 1)
        }
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let to = if self.like {
            cx.input(1)?.dtype
        } else {
            dtype_attr(cx.attrs().int("to").ok_or("missing attribute 'to'")?)?
        };
        let value = x.value.as_ref().map(|v| {
            let n = v.data.len();
            let data = if to.is_float() {
                Data::Float((0..n).map(|i| v.data.float(i)).collect())
            } else if to == DType::Bool {
                Data::Int((0..n).map(|i| (v.data.float(i) != 0.0) as i64).collect())
            } else {
                Data::Int((0..n).map(|i| v.data.int(i)).collect())
            };
            Value {
                shape: v.shape.clone(),
                data,
            }
        });
        Ok(vec![Fact {
            dtype: to,
            shape: x.shape.clone(),
            value,
        }])
    }
    fn flops(&self, _cx: &Cx, _out: &[Fact]) -> u64 {
        0
    }
    /// Float-to-float casts pass the gradient back (cast again), saving nothing; casts
    /// to or from integers have no gradient.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let from_float = cx.inputs[0].is_some_and(|f| f.dtype.is_float());
        if !(from_float && out[0].dtype.is_float()) {
            return Ok(None);
        }
        Ok(Some(Backward::each(&[0], &[], out[0].numel())))
    }
    /// A cast to the same type is the input itself; otherwise a new tensor.
    fn storage(&self, cx: &Cx) -> Storage {
        let to = cx.attrs().int("to").and_then(|c| dtype_attr(c).ok());
        match (cx.inputs[0], to) {
            (Some(x), Some(t)) if !self.like && x.dtype == t => Storage::View,
            _ => Storage::New,
        }
    }
}

/// `Clip(x, min?, max?)` (opset 11+ inputs; older `min`/`max` attributes).
/// FLOPs: 2 comparisons per element.
struct Clip;

impl Op for Clip {
    fn arity(&self) -> Arity {
        Arity::new(1, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        Ok(vec![Fact::new(x.dtype, x.shape.clone())])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel().saturating_mul(2)
    }
    /// clamp/hardtanh save their input to mask the gradient.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(Some(Backward::each(
            &[0],
            &[Saved::Input(0)],
            out[0].numel().saturating_mul(2),
        )))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
}

/// `Dropout(x, ratio?, training_mode?) -> (y, mask?)`. The mask is bool, same shape.
/// Training mode comes from the `training_mode` input (opset 12+) when it is a known
/// constant. FLOPs: training 2 per element (draw/compare and scale), inference 0.
struct Dropout;

impl Dropout {
    /// Whether this Dropout drops (training mode).
    fn training(cx: &Cx) -> bool {
        if cx.opset >= 12 {
            cx.opt(2)
                .and_then(|f| f.value.as_ref())
                .and_then(|v| v.scalar_int())
                .is_some_and(|t| t != 0)
        } else {
            cx.attrs().int("is_test").unwrap_or(0) == 0
        }
    }

    /// The drop ratio (default 0.5), when known.
    fn ratio(cx: &Cx) -> f64 {
        if cx.opset >= 12 {
            cx.opt(1)
                .and_then(|f| f.value.as_ref())
                .and_then(|v| v.scalar_float())
                .unwrap_or(0.5)
        } else {
            cx.attrs().float("ratio").map_or(0.5, f64::from)
        }
    }

    /// True when it changes nothing: inference mode or ratio 0 (PyTorch returns the
    /// input itself).
    fn is_identity(cx: &Cx) -> bool {
        !Self::training(cx) || Self::ratio(cx) == 0.0
    }
}

impl Op for Dropout {
    fn arity(&self) -> Arity {
        Arity::new(1, 3, 1, 2)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let mut out = vec![Fact::new(x.dtype, x.shape.clone())];
        if cx.n_outputs() > 1 {
            out.push(Fact::new(DType::Bool, x.shape.clone()));
        }
        Ok(out)
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        if Self::training(cx) {
            out[0].numel().saturating_mul(2)
        } else {
            0
        }
    }
    /// Training: the gradient is masked by a 1-byte mask per element (CUDA's
    /// native_dropout saves a bool mask). Identity dropout saves nothing.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if Self::is_identity(cx) {
            return Ok(Some(Backward::each(&[0], &[], 0)));
        }
        Ok(Some(Backward {
            grads: vec![Grad {
                input: 0,
                needs: vec![Saved::Extra(0)],
            }],
            extras: vec![Fact::new(DType::Bool, out[0].shape.clone())],
            flops: out[0].numel().saturating_mul(2),
        }))
    }
    fn storage(&self, cx: &Cx) -> Storage {
        if Self::is_identity(cx) {
            Storage::View
        } else {
            Storage::New
        }
    }
}

fn erf(x: f64) -> f64 {
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

/// Registers the element-wise family.
pub fn register(r: &mut Registry) {
    let unary = |flops_per_elem, fold, keeps| Unary {
        flops_per_elem,
        bool_out: false,
        fold,
        keeps,
    };
    use Keeps::{Input as In, Nothing as No, Output as Out};
    // Data movement.
    r.add("Identity", unary(0, Some(|x| x), No));
    // One arithmetic operation or one transcendental function per element.
    r.add("Relu", unary(1, Some(|x: f64| x.max(0.0)), Out));
    r.add("Neg", unary(1, Some(|x: f64| -x), No));
    r.add("Abs", unary(1, Some(f64::abs), In));
    r.add("Floor", unary(1, Some(f64::floor), No));
    r.add("Ceil", unary(1, Some(f64::ceil), No));
    r.add("Round", unary(1, Some(f64::round_ties_even), No));
    r.add(
        "Sign",
        unary(
            1,
            Some(|x: f64| if x == 0.0 { 0.0 } else { x.signum() }),
            No,
        ),
    );
    r.add("Sqrt", unary(1, Some(f64::sqrt), Out));
    r.add("Reciprocal", unary(1, Some(|x: f64| 1.0 / x), Out));
    r.add("Exp", unary(1, Some(f64::exp), Out));
    r.add("Log", unary(1, Some(f64::ln), In));
    r.add("Erf", unary(1, Some(erf), In));
    r.add("Sin", unary(1, Some(f64::sin), In));
    r.add("Cos", unary(1, Some(f64::cos), In));
    r.add("Tan", unary(1, Some(f64::tan), Out));
    r.add("Tanh", unary(1, Some(f64::tanh), Out));
    r.add("Atan", unary(1, Some(f64::atan), In));
    r.add("LeakyRelu", unary(1, None, In));
    r.add("ThresholdedRelu", unary(1, None, In));
    // A few operations per element (exp + add + divide, or polynomial approximations).
    r.add("Sigmoid", unary(3, None, Out));
    r.add("HardSigmoid", unary(3, None, In));
    r.add("HardSwish", unary(4, None, In));
    r.add("Softplus", unary(3, None, In));
    r.add("Softsign", unary(3, None, In));
    r.add("Elu", unary(3, None, Out));
    r.add("Selu", unary(4, None, Out));
    r.add("Celu", unary(4, None, Out));
    r.add("Mish", unary(6, None, In));
    r.add("Gelu", unary(8, None, In));
    let pred = |fold| Unary {
        flops_per_elem: 1,
        bool_out: true,
        fold,
        keeps: Keeps::NonDiff,
    };
    r.add("Not", pred(Some(|x: f64| (x == 0.0) as i64 as f64)));
    r.add("IsNaN", pred(Some(|x: f64| x.is_nan() as i64 as f64)));
    r.add("IsInf", pred(Some(|x: f64| x.is_infinite() as i64 as f64)));

    let arith = |fi, ff| Binary {
        flops_per_elem: 1,
        kind: BinKind::Arith(fi, ff),
    };
    r.add("Add", arith(|a, b| a.checked_add(b), |a, b| a + b));
    r.add("Sub", arith(|a, b| a.checked_sub(b), |a, b| a - b));
    r.add("Mul", arith(|a, b| a.checked_mul(b), |a, b| a * b));
    // Integer Div truncates, as ONNX does for integer tensors.
    r.add("Div", arith(|a, b| a.checked_div(b), |a, b| a / b));
    r.add(
        "Mod",
        arith(|a, b| a.checked_rem_euclid(b), |a, b| a.rem_euclid(b)),
    );
    r.add(
        "Pow",
        arith(
            |a, b| u32::try_from(b).ok().and_then(|b| a.checked_pow(b)),
            f64::powf,
        ),
    );
    r.add(
        "PRelu",
        Binary {
            flops_per_elem: 2,
            kind: BinKind::Arith(|_, _| None, |x, s| if x < 0.0 { x * s } else { x }),
        },
    );
    r.add(
        "BitShift",
        Binary {
            flops_per_elem: 1,
            kind: BinKind::Arith(|_, _| None, |a, _| a),
        },
    );
    let cmp = |f| Binary {
        flops_per_elem: 1,
        kind: BinKind::Compare(f),
    };
    r.add("Equal", cmp(|a, b| a == b));
    r.add("Less", cmp(|a, b| a < b));
    r.add("LessOrEqual", cmp(|a, b| a <= b));
    r.add("Greater", cmp(|a, b| a > b));
    r.add("GreaterOrEqual", cmp(|a, b| a >= b));
    r.add("And", cmp(|a, b| a != 0.0 && b != 0.0));
    r.add("Or", cmp(|a, b| a != 0.0 || b != 0.0));
    r.add("Xor", cmp(|a, b| (a != 0.0) != (b != 0.0)));

    r.add(
        "Max",
        Variadic {
            mean: false,
            fold: f64::max,
        },
    );
    r.add(
        "Min",
        Variadic {
            mean: false,
            fold: f64::min,
        },
    );
    r.add(
        "Sum",
        Variadic {
            mean: false,
            fold: |a, b| a + b,
        },
    );
    r.add(
        "Mean",
        Variadic {
            mean: true,
            fold: |a, b| a + b,
        },
    );
    r.add("Where", Where);
    r.add("Cast", Cast { like: false });
    r.add("CastLike", Cast { like: true });
    r.add("Clip", Clip);
    r.add("Dropout", Dropout);
}
