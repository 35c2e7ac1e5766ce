//! Shape and data-movement ops, including the shape-computation subgraphs exporters
//! emit (Shape → Gather → Unsqueeze → Concat → Reshape, Range, ConstantOfShape,
//! Expand ...). When inputs carry constant values these ops fold them, so later
//! Reshape/Expand/Slice nodes see concrete shapes.
//!
//! FLOPs: all ops here move or select data and count 0.

/// Every op here costs 0 FLOPs; this macro writes the `flops` method.
macro_rules! no_flops {
    () => {
        fn flops(&self, _cx: &Cx, _out: &[Fact]) -> u64 {
            0
        }
    };
}

/// The strided copies of the data-movement ops, one per element size.
pub(super) const COPIES: &[&str] = &["strided_copy_b1", "strided_copy_b4", "strided_copy_b8"];

mod depth_space;
mod pad_tile;
mod select;
mod slice_scatter;
mod sources;
mod views;

use depth_space::*;
use pad_tile::*;
use select::*;
pub use slice_scatter::SLICE_SCATTER;
use slice_scatter::*;
pub use sources::literal_fact;
use sources::*;
pub use views::reshape_target;
use views::*;

use super::{
    axis, broadcast, dim, dtype_attr, input0_backward, layout, no_backward_kernel, no_gradient,
    nothing_saved_backward, numel, Arity, Autocast, Backward, BackwardCx, CudaKernels, Cx, Fact,
    KernelCx, Launch, Op, Registry, RuleError, RuleResult, Saved, Storage,
};
use crate::ir::value::MAX_FOLD_ELEMS;
use crate::ir::{DType, Data, TensorData, Value};
use crate::numeric::broadcast::{affine_offsets, for_each};
use crate::numeric::grad::sum_to;
use crate::numeric::Tensor;

/// Row-major strides of a shape.
pub(super) fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Builds the value of an output whose element `k` (row-major over `out_shape`) is
/// element `src(coord)` of `v`. `None` when the output is too large to fold.
pub(super) fn remap(
    v: &Value,
    out_shape: &[usize],
    src: impl Fn(&[usize]) -> usize,
) -> Option<Value> {
    let n: usize = out_shape.iter().product();
    if n > MAX_FOLD_ELEMS {
        return None;
    }
    let mut coord = vec![0usize; out_shape.len()];
    let mut idx = Vec::with_capacity(n);
    for _ in 0..n {
        idx.push(src(&coord));
        for i in (0..coord.len()).rev() {
            coord[i] += 1;
            if coord[i] < out_shape[i] {
                break;
            }
            coord[i] = 0;
        }
    }
    Some(Value {
        shape: out_shape.to_vec(),
        data: v.data.gather(idx.into_iter()),
    })
}

/// The fact of an output of `x`'s type shaped `shape` whose element at `coord` is
/// `x`'s element `src(coord)`: its value folded when `x`'s is known ([`remap`]).
pub(super) fn remapped_fact(x: &Fact, shape: Vec<usize>, src: impl Fn(&[usize]) -> usize) -> Fact {
    let value = x.value.as_ref().and_then(|v| remap(v, &shape, src));
    Fact {
        dtype: x.dtype,
        shape,
        value: value.map(Box::new),
    }
}

pub(super) fn with_shape(v: &Value, shape: Vec<usize>) -> Value {
    Value {
        shape,
        data: v.data.clone(),
    }
}

/// Registers shape and data-movement ops.
pub fn register(r: &mut Registry) {
    r.add("Constant", Constant);
    r.add("Shape", ShapeOp);
    r.add("Size", Size);
    r.add("Reshape", View::Reshape);
    r.add("Flatten", View::Flatten);
    r.add("Transpose", Transpose);
    r.add("Squeeze", View::Squeeze);
    r.add("Unsqueeze", View::Unsqueeze);
    r.add("Concat", Concat);
    r.add("Split", Split);
    r.add("Slice", Slice);
    r.add("Gather", Gather);
    r.add("GatherElements", GatherElements);
    r.add("ConstantOfShape", ConstantOfShape);
    r.add("Range", Range);
    r.add("Expand", Expand);
    r.add("Tile", Tile);
    r.add("DepthToSpace", DepthSpace { to_space: true });
    r.add("SpaceToDepth", DepthSpace { to_space: false });
    r.add("Pad", Pad);
    r.add("NonZero", NonZero);
    r.add("Trilu", LikeInput::Trilu);
    r.add("ScatterND", LikeInput::ScatterNd);
    r.add("ScatterElements", LikeInput::ScatterElements);
    // Scatter (opsets 9-10) is ScatterElements under its old name.
    r.add("Scatter", LikeInput::ScatterElements);
    r.add_lowered(SLICE_SCATTER, SliceScatter);
    r.add("BitCast", BitCast);
    r.add("Compress", Compress);
    r.add("CenterCropPad", CenterCropPad);
    r.add("ReverseSequence", ReverseSequence);
    r.add("OneHot", OneHot);
    r.add("EyeLike", LikeInput::EyeLike);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reshape_rules() {
        assert_eq!(
            reshape_target(&[2, 3, 4], &[0, -1], false).unwrap(),
            vec![2, 12]
        );
        assert_eq!(
            reshape_target(&[2, 3, 4], &[4, 0, 2], false).unwrap(),
            vec![4, 3, 2]
        );
        assert!(reshape_target(&[2, 3, 4], &[5, -1], false).is_err());
        assert!(reshape_target(&[2, 3, 4], &[-1, -1], false).is_err());
        assert!(reshape_target(&[8, 768], &[1, 768], false).is_err());
    }

    /// Integer ranges are counted exactly, near the int64 extremes too (a float
    /// count gave `[0]` for `Range(i64::MAX - 1, i64::MAX, 1)`).
    #[test]
    fn integer_ranges_are_exact() {
        use crate::ir::{Node, Value};
        let n = Node {
            name: "r".into(),
            op_type: "Range".into(),
            domain: Default::default(),
            inputs: vec![Some(0), Some(1), Some(2)].into(),
            outputs: vec![Some(3)].into(),
            attrs: Default::default(),
        };
        let range = |s: i64, l: i64, d: i64| {
            let f = |v: i64| Fact::with_value(DType::I64, Value::ints(vec![], vec![v]));
            let (a, b, c) = (f(s), f(l), f(d));
            let cx = Cx {
                node: &n,
                inputs: smallvec::smallvec![Some(&a), Some(&b), Some(&c)],
                opset: 17,
            };
            let out = sources::Range.infer(&cx).map(|o| o[0].clone());
            out.map(|f| {
                (
                    f.shape,
                    f.value
                        .filter(|v| !v.data.is_empty())
                        .map(|v| v.data.int(0)),
                )
            })
        };
        assert_eq!(
            range(i64::MAX - 1, i64::MAX, 1).unwrap(),
            (vec![1], Some(i64::MAX - 1))
        );
        assert_eq!(range(i64::MIN, i64::MIN + 3, 2).unwrap().0, vec![2]);
        assert_eq!(range(5, 0, -2).unwrap().0, vec![3]);
        assert_eq!(range(0, 5, -1).unwrap().0, vec![0]);
        assert!(range(i64::MIN, i64::MAX, 1).is_err(), "2^64 elements");
        assert!(range(0, 1, 0).is_err());
    }
}
