//! Quantization: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear and the
//! integer products QLinearMatMul, MatMulInteger, QLinearConv, ConvInteger.
//!
//! Shape rules and FLOPs. memplan's CPU executor holds no 8-bit or sub-byte
//! tensors, so these ops have no CPU kernel of their own (each says so), and they
//! run nowhere on the device. Their outputs are integers (Quantize, the products)
//! or come from integers (Dequantize), so no gradient flows through them, except
//! fake quantization: PyTorch's QAT (`torch.ao.quantization.FakeQuantize`,
//! `torch.fake_quantize_per_tensor_affine`, `torch.fake_quantize_per_channel_affine`)
//! exports as a QuantizeLinear → DequantizeLinear pair of the same scale and zero
//! point (with a `Clip` to 127 between them for the `(0, 127)` range), which trains
//! with a straight-through gradient. `train::fusion` recognises the pair as one
//! float → float op whose kernels are [`fake_quantize`] and
//! [`fake_quantize_backward`] here; a QuantizeLinear outside such a pair whose
//! float input requires a gradient is refused in one line.

use super::{
    conv::window_out, linalg::matmul_shape, Arity, Autocast, Backward, Cx, Fact, Op, Registry,
    RuleResult,
};
use crate::ir::DType;
use crate::numeric::Tensor;
use rayon::prelude::*;

/// Quantize's and Dequantize's attributes.
struct QuantAttrs {
    /// `axis` (per-axis and blocked quantization; default 1).
    axis: i64,
    /// `block_size` (default 0: not blocked).
    block_size: i64,
    /// `output_dtype` (default 0: from the zero point or the scale).
    output_dtype: i64,
}

impl QuantAttrs {
    fn of(attrs: &crate::ir::Attrs) -> QuantAttrs {
        QuantAttrs {
            axis: attrs.int_or("axis", 1),
            block_size: attrs.int_or("block_size", 0),
            output_dtype: attrs.int_or("output_dtype", 0),
        }
    }
}

/// Checks a scale (or zero point) against `x` for per-tensor (scalar or `[1]`),
/// per-axis (`[x[axis]]`) or blocked (`x`'s rank, `ceil(x[axis]/block)` on the
/// axis) quantization.
fn check_scale(at: &QuantAttrs, x: &Fact, s: &Fact, what: &str) -> RuleResult<()> {
    if s.numel() == 1 && s.rank() <= 1 {
        return Ok(());
    }
    let ax = super::axis(at.axis, x.rank())?;
    let block = at.block_size;
    let ok = if block > 0 {
        let b = block as usize;
        s.rank() == x.rank()
            && s.shape.iter().enumerate().all(|(i, &d)| {
                if i == ax {
                    d == x.shape[i].div_ceil(b)
                } else {
                    d == x.shape[i]
                }
            })
    } else {
        s.shape == [x.shape[ax]]
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} {:?} fits neither per-tensor, per-axis (axis {ax}) nor blocked (block_size {block}) quantization of {:?}",
            s.shape, x.shape
        )
        .into())
    }
}

/// `QuantizeLinear(x, y_scale, y_zero_point?) -> y`: `saturate(round(x / scale) +
/// zero_point)`, of the zero point's type, else `output_dtype`, else uint8.
/// FLOPs: 3 per element (divide, round, add and clamp).
struct Quantize;

impl Op for Quantize {
    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let at = QuantAttrs::of(cx.attrs());
        check_scale(&at, x, cx.input(1)?, "y_scale")?;
        let dtype = match cx.opt(2) {
            Some(z) => {
                check_scale(&at, x, z, "y_zero_point")?;
                z.dtype
            }
            None => match at.output_dtype {
                0 => DType::U8,
                code => super::dtype_attr(code)?,
            },
        };
        Ok(vec![Fact::new(dtype, x.shape.clone())])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel().saturating_mul(3)
    }
    /// Refused where the float input requires a gradient: a QuantizeLinear trains
    /// only as half of a fake-quant pair, whose rule `train::fusion` gives (see the
    /// module); one reaching this rule is not part of one.
    fn backward(&self, _cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        Err("a QuantizeLinear whose float input requires a gradient trains only as fake quantization, followed by a DequantizeLinear of the same scale, zero point and axis (a Clip between them allowed), and this one is not".into())
    }
    shape_only!(no_gradient);
    /// Not on autocast's lists: PyTorch's fake quantization runs in its input's
    /// type.
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// `DequantizeLinear(x, x_scale, x_zero_point?) -> y`: `(x − zero_point)·scale`,
/// of `output_dtype` when set, else the scale's type. FLOPs: 2 per element.
/// DynamicQuantizeLinear(x) -> (y uint8, y_scale float32 [], y_zero_point uint8
/// []): FLOPs 5 per element (min and max, then quantize).
struct Dequantize {
    /// DynamicQuantizeLinear (else DequantizeLinear).
    dynamic: bool,
}

impl Op for Dequantize {
    fn arity(&self) -> Arity {
        Arity::new(1, 3, 1, 3)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        if self.dynamic {
            if x.dtype != DType::F32 {
                return Err(format!("input must be float32, got {}", x.dtype).into());
            }
            let mut out = vec![Fact::new(DType::U8, x.shape.clone())];
            if cx.n_outputs() > 1 {
                out.push(Fact::new(DType::F32, vec![]));
            }
            if cx.n_outputs() > 2 {
                out.push(Fact::new(DType::U8, vec![]));
            }
            return Ok(out);
        }
        if cx.n_outputs() != 1 {
            return Err("DequantizeLinear has one output".into());
        }
        let s = cx.input(1)?;
        let at = QuantAttrs::of(cx.attrs());
        check_scale(&at, x, s, "x_scale")?;
        if let Some(z) = cx.opt(2) {
            check_scale(&at, x, z, "x_zero_point")?;
        }
        let dtype = match at.output_dtype {
            0 => s.dtype,
            code => super::dtype_attr(code)?,
        };
        Ok(vec![Fact::new(dtype, x.shape.clone())])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        let per = if self.dynamic { 5 } else { 2 };
        out[0].numel().saturating_mul(per)
    }
    /// No gradient: DequantizeLinear reads integers (its scale is not trained
    /// here); DynamicQuantizeLinear's outputs are integers.
    fn backward(&self, _cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(None)
    }
    shape_only!(no_gradient);
    /// Not on autocast's lists: PyTorch's fake quantization runs in its input's
    /// type.
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// The integer products: `QLinearMatMul(a, a_scale, a_zp, b, b_scale, b_zp,
/// y_scale, y_zp)` (output of y_zp's type), `MatMulInteger(A, B, a_zp?, b_zp?)`
/// (int32), `QLinearConv(x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, B?)`
/// (y_zp's type) and `ConvInteger(x, w, x_zp?, w_zp?)` (int32), shaped as MatMul
/// and Conv. FLOPs: 2 per multiply-add, as MatMul and Conv (integer operations).
struct IntegerProduct {
    /// QLinearMatMul, QLinearConv (else MatMulInteger, ConvInteger).
    qlinear: bool,
    /// QLinearConv, ConvInteger (else the matrix products).
    conv: bool,
}

impl IntegerProduct {
    /// Slots of the two operands, and of the output zero point (none: int32).
    fn slots(&self) -> (usize, usize, Option<usize>) {
        if self.qlinear {
            (0, 3, Some(7))
        } else {
            (0, 1, None)
        }
    }
}

impl Op for IntegerProduct {
    fn arity(&self) -> Arity {
        Arity::new(2, 9, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (ia, ib, zp) = self.slots();
        let (a, b) = (cx.input(ia)?, cx.input(ib)?);
        let dtype = match zp {
            Some(z) => cx.input(z)?.dtype,
            None => DType::I32,
        };
        let shape = if self.conv {
            if a.rank() < 3 || b.rank() != a.rank() {
                return Err(format!(
                    "input {:?} and weight {:?} are no convolution",
                    a.shape, b.shape
                )
                .into());
            }
            let attrs = cx.attrs();
            let group = attrs.int_or("group", 1).max(1) as usize;
            if b.shape[1] * group != a.shape[1] {
                return Err(format!(
                    "input has {} channels, weight {:?} with group {group} expects {}",
                    a.shape[1],
                    b.shape,
                    b.shape[1] * group
                )
                .into());
            }
            let mut s = vec![a.shape[0], b.shape[0]];
            s.extend(window_out(&a.shape[2..], &b.shape[2..], attrs, false)?);
            s
        } else {
            matmul_shape(&a.shape, &b.shape)?.0
        };
        Ok(vec![Fact::new(dtype, shape)])
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let (ia, ib, _) = self.slots();
        let (Ok(a), Ok(b)) = (cx.input(ia), cx.input(ib)) else {
            return 0;
        };
        // Multiply-adds per output: the contracted length (K, or C/g · kernel).
        let per = if self.conv {
            b.shape[1..].iter().product::<usize>() as u64
        } else {
            *a.shape.last().unwrap_or(&0) as u64
        };
        out[0].numel().saturating_mul(per).saturating_mul(2)
    }
    /// Integer results: no gradient.
    fn backward(&self, _cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(None)
    }
    shape_only!(no_gradient);
    /// Integer products are not autocast.
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// The parameters of one fake quantization (PyTorch's `fake_quantize_*`): what
/// an exported QuantizeLinear → [Clip →] DequantizeLinear pair holds.
#[derive(Debug, Clone, PartialEq)]
pub struct FakeQuantParams {
    /// One scale (per tensor) or one per index along [`Self::axis`].
    pub scale: Vec<f32>,
    /// As many zero points as scales.
    pub zero_point: Vec<i64>,
    /// The quantized axis of the input (per channel); `None`: per tensor.
    pub axis: Option<usize>,
    /// The integer range rounded values are clamped to (PyTorch's `quant_min`,
    /// `quant_max`): the quantized type's range, narrowed by the Clip.
    pub qmin: i64,
    /// See [`Self::qmin`].
    pub qmax: i64,
}

/// FLOPs of one fake quantization per element: the multiply by `1/scale`, the
/// rounding, the zero point's add, the clamp, its subtraction and the multiply by
/// the scale, counted as the pair's nodes count them (QuantizeLinear 3,
/// DequantizeLinear 2).
pub const FAKE_QUANT_FLOPS: u64 = 5;

/// FLOPs of its backward per element: the gradient masked (one select).
pub const FAKE_QUANT_BACKWARD_FLOPS: u64 = 1;

/// The fake quantization of `x` (float → float, in `x`'s dtype), and with
/// `with_mask` the bool mask its backward saves: as PyTorch's
/// `fake_quantize_per_{tensor,channel}_affine_cachemask` kernels compute it, in
/// float32: `q = nearbyint(x · (1/scale)) + zero_point` (round half to even),
/// `out = (clamp(q, qmin, qmax) − zero_point) · scale`, `mask = qmin ≤ q ≤ qmax`.
/// (ONNX's QuantizeLinear divides by the scale; PyTorch multiplies by its
/// reciprocal, which can differ in the last bit of the quotient. The training step
/// simulates PyTorch's.)
pub fn fake_quantize(
    x: &Tensor,
    p: &FakeQuantParams,
    with_mask: bool,
) -> RuleResult<(Tensor, Option<Tensor>)> {
    let n_q = p.scale.len();
    if n_q == 0 || p.zero_point.len() != n_q {
        return Err(format!("{} scales and {} zero points", n_q, p.zero_point.len()).into());
    }
    if p.qmin > p.qmax {
        return Err(format!("an empty quantization range [{}, {}]", p.qmin, p.qmax).into());
    }
    // Elements per index of the axis, and the axis' length.
    let (inner, len) = match p.axis {
        None if n_q == 1 => (1, 1),
        None => return Err(format!("{n_q} scales for a per-tensor quantization").into()),
        Some(a) => {
            let d = *x
                .shape
                .get(a)
                .ok_or_else(|| format!("axis {a} of a rank-{} input", x.rank()))?;
            if d != n_q {
                return Err(format!("{n_q} scales for axis {a} of {:?}", x.shape).into());
            }
            (x.shape[a + 1..].iter().product::<usize>(), d)
        }
    };
    let xs = x.to_f32()?;
    let (qmin, qmax) = (p.qmin, p.qmax);
    let one = |i: usize, v: f32| -> (f32, bool) {
        let c = (i / inner.max(1)) % len.max(1);
        let (s, z) = (p.scale[c], p.zero_point[c]);
        let q = ((v * (1.0 / s)).round_ties_even() + z as f32) as i64;
        (
            ((q.clamp(qmin, qmax) - z) as f32) * s,
            qmin <= q && q <= qmax,
        )
    };
    let (out, mask): (Vec<f32>, Vec<bool>) =
        xs.par_iter().enumerate().map(|(i, &v)| one(i, v)).unzip();
    let y = Tensor::from_f32(x.dtype(), x.shape.clone(), out)?;
    Ok((y, with_mask.then(|| Tensor::bool(x.shape.clone(), mask))))
}

/// The straight-through gradient of [`fake_quantize`]: the incoming gradient
/// where the mask is set, zero where the value was clamped
/// (`fake_quantize_per_tensor_affine_cachemask_backward`), of `dtype`.
pub fn fake_quantize_backward(g: &Tensor, mask: &Tensor, dtype: DType) -> RuleResult<Tensor> {
    let crate::numeric::Elems::Bool(m) = &mask.elems else {
        return Err(format!("the fake-quant mask is {}, not bool", mask.dtype()).into());
    };
    if g.shape != mask.shape {
        return Err(format!(
            "a gradient of {:?} for a fake-quant mask of {:?}",
            g.shape, mask.shape
        )
        .into());
    }
    let gs = g.to_f32()?;
    let d: Vec<f32> = gs
        .par_iter()
        .zip(m.par_iter())
        .map(|(&g, &keep)| if keep { g } else { 0.0 })
        .collect();
    Tensor::from_f32(dtype, g.shape.clone(), d)
}

pub(super) fn register(r: &mut Registry) {
    r.add("QuantizeLinear", Quantize);
    r.add("DequantizeLinear", Dequantize { dynamic: false });
    r.add("DynamicQuantizeLinear", Dequantize { dynamic: true });
    for (op, qlinear, conv) in [
        ("QLinearMatMul", true, false),
        ("MatMulInteger", false, false),
        ("QLinearConv", true, true),
        ("ConvInteger", false, true),
    ] {
        r.add(op, IntegerProduct { qlinear, conv });
    }
}
