//! Element-wise ops: unary maps, broadcasting binary ops, comparisons, variadic
//! reductions over inputs (Max, Min, Sum, Mean), Where, Cast, Clip and Dropout.
//!
//! FLOPs: `flops_per_elem` × output elements, listed per op in [`register`]
//! (1 for arithmetic, comparisons and single transcendental functions; more for
//! composite activations, e.g. Gelu 8 for its erf/tanh polynomial).

/// An element-wise op's `out_strides`: TensorIterator lays the output out like its
/// inputs ([`crate::ops::elementwise_strides`]).
macro_rules! elementwise_layout {
    () => {
        fn out_strides(
            &self,
            cx: &Cx,
            _k: usize,
            out: &Fact,
            strides: &[Option<&[usize]>],
        ) -> Vec<usize> {
            crate::ops::elementwise_strides(cx, out, strides)
        }
    };
}

/// The row named `op` of an op table and its op code (the row's index).
fn row_of<R>(table: &'static [R], op: &str, name: fn(&R) -> &str) -> Option<(i32, &'static R)> {
    table
        .iter()
        .enumerate()
        .find(|(_, r)| name(r) == op)
        .map(|(i, r)| (i as i32, r))
}

mod binary;
mod others;
mod unary;

use binary::*;
pub use binary::{binary_row, compare_row, BinaryRow, CompareRow, Deriv, BINARY, COMPARE};
pub(crate) use others::Dropout;
use others::*;
pub(crate) use unary::map_f32;
use unary::*;
pub use unary::{unary_row, Keeps, Params, UnaryRow, UNARY};

/// The C that kernels/elementwise.cu's tables are generated into: the unary,
/// binary and comparison switches ([`UNARY`], [`BINARY`], [`COMPARE`]).
pub fn cuda_switches() -> String {
    format!(
        "{}{}",
        unary::cuda_switches(),
        binary::cuda_binary_switches()
    )
}

use rayon::prelude::*;

use super::{
    broadcast, dtype_attr, no_gradient, Arity, Autocast, Backward, BackwardCx, CudaKernels, Cx,
    Fact, Grad, KernelCx, Launch, Op, Registry, RuleResult, Saved, Storage,
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

    for row in BINARY {
        r.add(row.name, Binary(row));
    }
    for row in COMPARE {
        r.add(row.name, Compare(row));
    }

    r.add("Max", Variadic::Max);
    r.add("Min", Variadic::Min);
    r.add("Sum", Variadic::Sum);
    r.add("Mean", Variadic::Mean);
    r.add("Where", Where);
    r.add("Cast", Cast { like: false });
    r.add("CastLike", Cast { like: true });
    r.add("Clip", Clip);
    r.add("Dropout", Dropout);
}
