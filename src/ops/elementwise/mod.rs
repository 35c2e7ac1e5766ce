//! Element-wise ops: unary maps, broadcasting binary ops, comparisons, variadic
//! reductions over inputs (Max, Min, Sum, Mean), Where, Cast, Clip and Dropout.
//!
//! FLOPs: `flops_per_elem` × output elements, listed per op in [`register`]
//! (1 for arithmetic, comparisons and single transcendental functions; more for
//! composite activations, e.g. Gelu 8 for its erf/tanh polynomial).

mod binary;
mod others;
mod unary;

use binary::*;
pub(crate) use others::Dropout;
use others::*;
pub(crate) use unary::map_f32;
use unary::*;

use rayon::prelude::*;

use super::{
    broadcast, dtype_attr, no_backward_kernel, no_gradient, Arity, Backward, BackwardCx,
    CudaKernels, Cx, Fact, Grad, KernelCx, Op, Registry, RuleResult, Saved, Storage,
};
use crate::ir::value::MAX_FOLD_ELEMS;
use crate::ir::{Attrs, DType, Data, Value};
use crate::numeric::broadcast::{for_each, zip2};
use crate::numeric::grad::sum_to;
use crate::numeric::{rng, Elems, Tensor};

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
