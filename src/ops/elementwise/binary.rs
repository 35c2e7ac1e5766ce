//! Broadcasting binary ops and comparisons: folding, kernels and gradients.

#[allow(unused_imports)]
use super::*;

/// How a binary op combines elements and what type it yields.
#[derive(Clone, Copy)]
pub(super) enum BinKind {
    /// Same type as the inputs.
    Arith(fn(i64, i64) -> Option<i64>, fn(f64, f64) -> f64),
    /// Yields bool.
    Compare(fn(f64, f64) -> bool),
}

/// A broadcasting binary op.
pub(super) struct Binary {
    pub(super) flops_per_elem: u64,
    pub(super) kind: BinKind,
    pub(super) autocast: Autocast,
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

pub(super) enum FoldElem {
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
        binary_kernel(cx, matches!(self.kind, BinKind::Compare(_)))
    }
    /// Each operand's gradient computed at the broadcast shape, then summed back
    /// over the axes it was broadcast along.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        if matches!(self.kind, BinKind::Compare(_)) {
            return no_gradient(cx);
        }
        binary_backward(cx)
    }
    /// Device kernels (exec::cuda::ops); see [`Op::cuda_kernels`].
    fn cuda_kernels(&self, op_type: &str) -> CudaKernels {
        match op_type {
            "Add" | "Sub" | "Mul" | "Div" | "Pow" => CudaKernels::new(
                Launch::Binary,
                &["binary_fwd_f32"],
                &["binary_bwd_f32", "reduce_f32"],
            ),
            "Equal" | "Less" | "LessOrEqual" | "Greater" | "GreaterOrEqual" => {
                CudaKernels::new(Launch::Compare, &["compare_f32"], &[])
            }
            "Mod" | "PRelu" | "BitShift" | "And" | "Or" | "Xor" => CudaKernels::HOST,
            _ => CudaKernels::UNLISTED,
        }
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        self.autocast
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

/// Broadcasting binary ops. Arithmetic keeps input 0's type (floats in f32,
/// integers in wrapping i64, integer Div truncating); comparisons yield bool
/// (integers compared exactly, floats in f32, bools logically).
pub(super) fn binary_kernel(cx: &KernelCx, compare: bool) -> RuleResult<Vec<Tensor>> {
    let (a, b) = (cx.input(0)?, cx.input(1)?);
    let op = cx.node.op_type.as_str();
    let out = cx.out(0)?.shape.clone();
    let (sa, sb) = (&a.shape[..], &b.shape[..]);
    if compare {
        let v: Vec<bool> = match (&a.elems, &b.elems) {
            (Elems::Bool(x), Elems::Bool(y)) => {
                let f: fn(bool, bool) -> bool = match op {
                    "And" => |x, y| x && y,
                    "Or" => |x, y| x || y,
                    "Xor" => |x, y| x != y,
                    "Equal" => |x, y| x == y,
                    other => return Err(format!("{other} on bool is not supported").into()),
                };
                zip2(&out, (x, sa), (y, sb), f)
            }
            _ if !a.dtype().is_float() && !b.dtype().is_float() => {
                let f: fn(i64, i64) -> bool = match op {
                    "Equal" => |x, y| x == y,
                    "Less" => |x, y| x < y,
                    "LessOrEqual" => |x, y| x <= y,
                    "Greater" => |x, y| x > y,
                    "GreaterOrEqual" => |x, y| x >= y,
                    other => return Err(format!("{other} on integers is not supported").into()),
                };
                zip2(&out, (&a.to_i64s(), sa), (&b.to_i64s(), sb), f)
            }
            _ => {
                let f: fn(f32, f32) -> bool = match op {
                    "Equal" => |x, y| x == y,
                    "Less" => |x, y| x < y,
                    "LessOrEqual" => |x, y| x <= y,
                    "Greater" => |x, y| x > y,
                    "GreaterOrEqual" => |x, y| x >= y,
                    other => return Err(format!("{other} on floats is not supported").into()),
                };
                zip2(&out, (&float_operand(a)?, sa), (&float_operand(b)?, sb), f)
            }
        };
        return Ok(vec![Tensor::bool(out, v)]);
    }
    let dtype = a.dtype();
    if dtype.is_float() {
        let fmod = cx.attrs().int_or("fmod", 0) != 0;
        let f: fn(f32, f32) -> f32 = match op {
            "Add" => |x, y| x + y,
            "Sub" => |x, y| x - y,
            "Mul" => |x, y| x * y,
            "Div" => |x, y| x / y,
            "Pow" => pow_f32,
            "PRelu" => |x, s| if x < 0.0 { x * s } else { x },
            "Mod" if fmod => |x, y| x % y,
            "Mod" => return Err("Mod on floats needs fmod = 1".into()),
            other => return Err(format!("{other} on floats is not supported").into()),
        };
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
    let f: fn(i64, i64) -> i64 = match op {
        "Add" => i64::wrapping_add,
        "Sub" => i64::wrapping_sub,
        "Mul" => i64::wrapping_mul,
        "Div" => |x, y| if y == 0 { 0 } else { x.wrapping_div(y) },
        "Mod" if cx.attrs().int_or("fmod", 0) != 0 => {
            |x, y| if y == 0 { 0 } else { x.wrapping_rem(y) }
        }
        "Mod" => py_mod,
        "Pow" => |x, y| x.wrapping_pow(y.clamp(0, u32::MAX as i64) as u32),
        "BitShift" => {
            if cx.attrs().string("direction") == Some("LEFT") {
                |x, y| ((x as u64) << (y & 63)) as i64
            } else {
                |x, y| ((x as u64) >> (y & 63)) as i64
            }
        }
        other => return Err(format!("{other} on {dtype} is not supported").into()),
    };
    let v = zip2(&out, (&a.to_i64s(), sa), (&b.to_i64s(), sb), f);
    Ok(vec![Tensor::from_i64(dtype, out, v)?])
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

/// Binary backward at the broadcast shape, each gradient summed back to its
/// operand's shape. Reads only the saved operands of the wanted gradients.
pub(super) fn binary_backward(cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
    let op = cx.node.op_type.as_str();
    let out = cx.output(0)?.shape.clone();
    let (sa, sb) = (cx.input(0)?.shape.clone(), cx.input(1)?.shape.clone());
    let g = cx.grad(0)?;
    let val = |s: Saved| -> RuleResult<(Vec<f32>, Vec<usize>)> {
        let t = cx.saved(s)?;
        Ok((float_operand(t)?.into_owned(), t.shape.clone()))
    };
    // `g ⊙ f(p)` at the broadcast shape for an operand `p` read at its own shape.
    let times = |(p, sp): (Vec<f32>, Vec<usize>), f: &dyn Fn(f32, f32) -> f32| -> Vec<f32> {
        zip2(&out, (&g[..], &out[..]), (&p[..], &sp[..]), f)
    };
    let mut res = Vec::new();
    for slot in [0, 1] {
        if !cx.wants(slot) {
            continue;
        }
        let full: Vec<f32> = match (op, slot) {
            ("Add", _) => g.to_vec(),
            ("Sub", 0) => g.to_vec(),
            ("Sub", _) => g.iter().map(|&v| -v).collect(),
            ("Mul", 0) => times(val(Saved::Input(1))?, &|g, b| g * b),
            ("Mul", _) => times(val(Saved::Input(0))?, &|g, a| g * a),
            ("Div", 0) => times(val(Saved::Input(1))?, &|g, b| g / b),
            ("Div", _) => {
                let (a, b) = (val(Saved::Input(0))?, val(Saved::Input(1))?);
                let mut v = Vec::with_capacity(g.len());
                for_each(&out, [&a.1[..], &b.1[..]], |o, [i, j]| {
                    v.push(-g[o] * a.0[i] / (b.0[j] * b.0[j]))
                });
                v
            }
            // d/da a^b = b·a^(b−1); d/db a^b = a^b·ln a (0 where a = 0, as PyTorch).
            ("Pow", 0) => {
                let (a, b) = (val(Saved::Input(0))?, val(Saved::Input(1))?);
                let mut v = Vec::with_capacity(g.len());
                for_each(&out, [&a.1[..], &b.1[..]], |o, [i, j]| {
                    let (x, e) = (a.0[i], b.0[j]);
                    let d = if e == 0.0 {
                        0.0
                    } else if e == 2.0 {
                        2.0 * x
                    } else {
                        e * x.powf(e - 1.0)
                    };
                    v.push(g[o] * d)
                });
                v
            }
            ("Pow", _) => {
                let (a, y) = (val(Saved::Input(0))?, val(Saved::Output(0))?);
                let mut v = Vec::with_capacity(g.len());
                for_each(&out, [&a.1[..], &y.1[..]], |o, [i, k]| {
                    let x = a.0[i];
                    v.push(if x == 0.0 {
                        0.0
                    } else {
                        g[o] * y.0[k] * x.ln()
                    })
                });
                v
            }
            ("PRelu", _) => {
                let (a, b) = (val(Saved::Input(0))?, val(Saved::Input(1))?);
                let mut v = Vec::with_capacity(g.len());
                for_each(&out, [&a.1[..], &b.1[..]], |o, [i, j]| {
                    let (x, sl) = (a.0[i], b.0[j]);
                    v.push(match (slot, x > 0.0) {
                        (0, true) => g[o],
                        (0, false) => g[o] * sl,
                        (_, true) => 0.0,
                        (_, false) => g[o] * x,
                    })
                });
                v
            }
            _ => return no_backward_kernel(cx),
        };
        let target = if slot == 0 { &sa } else { &sb };
        res.push((slot, sum_to(&full, &out, target)));
    }
    cx.answer(res)
}
