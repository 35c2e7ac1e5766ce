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
pub use unary::{cuda_switches, unary_row, Keeps, Params, UnaryRow, UNARY};

use rayon::prelude::*;

use super::{
    broadcast, dtype_attr, no_backward_kernel, no_gradient, Arity, Autocast, Backward, BackwardCx,
    CudaKernels, Cx, Fact, Grad, KernelCx, Launch, Op, Registry, RuleResult, Saved, Storage,
};
use crate::ir::value::MAX_FOLD_ELEMS;
use crate::ir::{Attrs, DType, Data, Value};
use crate::numeric::broadcast::{for_each, zip2};
use crate::numeric::grad::sum_to;
use crate::numeric::{rng, Elems, Tensor};

/// Registers the element-wise family.
pub fn register(r: &mut Registry) {
    for row in UNARY {
        r.add(row.name, Unary(row));
    }
    let pred = |fold, kernel| Predicate { fold, kernel };
    r.add("Not", pred(|x| (x == 0.0) as i64 as f64, not));
    r.add("IsNaN", pred(|x| x.is_nan() as i64 as f64, is_nan));
    r.add("IsInf", pred(|x| x.is_infinite() as i64 as f64, is_inf));

    let arith = |fi, ff| Binary {
        flops_per_elem: 1,
        kind: BinKind::Arith(fi, ff),
        autocast: Autocast::Promote,
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
        // Autocast's fp32 list.
        Binary {
            autocast: Autocast::Full,
            ..arith(
                |a, b| u32::try_from(b).ok().and_then(|b| a.checked_pow(b)),
                f64::powf,
            )
        },
    );
    r.add(
        "PRelu",
        Binary {
            flops_per_elem: 2,
            kind: BinKind::Arith(|_, _| None, |x, s| if x < 0.0 { x * s } else { x }),
            autocast: Autocast::Promote,
        },
    );
    r.add(
        "BitShift",
        Binary {
            flops_per_elem: 1,
            kind: BinKind::Arith(|_, _| None, |a, _| a),
            autocast: Autocast::Promote,
        },
    );
    let cmp = |f| Binary {
        flops_per_elem: 1,
        kind: BinKind::Compare(f),
        autocast: Autocast::Promote,
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
