//! Shape-computation subgraphs as exporters write them fold to constants, so the
//! Reshape/Expand/Range they feed get concrete shapes.

mod common;

use common::*;
use memplan::infer::{infer, Bindings};
use memplan::onnx::load_model;

fn run(
    m: memplan::onnx::proto::ModelProto,
    batch: u64,
) -> (memplan::ir::Model, memplan::infer::Inferred) {
    let dir = tempfile::tempdir().unwrap();
    let p = write_tmp(&dir, "m.onnx", &encode(&m));
    let model = load_model(&p).unwrap();
    let inf = infer(
        &model,
        &Bindings {
            batch: Some(batch),
            ..Default::default()
        },
    )
    .unwrap();
    (model, inf)
}

fn shape_of(m: &memplan::ir::Model, inf: &memplan::infer::Inferred, t: &str) -> Vec<usize> {
    inf.facts[m.graph.tensor_id(t).unwrap()].shape.clone()
}

fn value_of(m: &memplan::ir::Model, inf: &memplan::infer::Inferred, t: &str) -> Vec<i64> {
    inf.facts[m.graph.tensor_id(t).unwrap()]
        .value
        .as_ref()
        .expect("folded")
        .to_ints()
}

#[test]
fn torchscript_style_reshape_chain() {
    // x[batch, 16, 64] → split heads: Reshape(x, Concat(Unsqueeze(Gather(Shape(x), 0)), [16, 4, 16]))
    let m = model(
        vec![
            node("Shape", "shape", &["x"], &["s"]),
            node("Gather", "g0", &["s", "zero"], &["b"]),
            with_ints(
                node("Unsqueeze", "u", &["b", "axes0"], &["b1"]),
                "unused",
                &[],
            ),
            with_int(
                node("Concat", "cat", &["b1", "rest"], &["target"]),
                "axis",
                0,
            ),
            node("Reshape", "reshape", &["x", "target"], &["y"]),
            with_ints(
                node("Transpose", "tr", &["y"], &["z"]),
                "perm",
                &[0, 2, 1, 3],
            ),
        ],
        vec![
            scalar_int("zero", 0),
            ints("axes0", &[0]),
            ints("rest", &[16, 4, 16]),
        ],
        vec![value_info("x", 1, &[D::S("batch"), D::N(16), D::N(64)])],
        vec![value_info(
            "z",
            1,
            &[D::S("batch"), D::N(4), D::N(16), D::N(16)],
        )],
    );
    let (model, inf) = run(m, 6);
    assert_eq!(value_of(&model, &inf, "s"), vec![6, 16, 64]);
    assert_eq!(value_of(&model, &inf, "target"), vec![6, 16, 4, 16]);
    assert_eq!(shape_of(&model, &inf, "z"), vec![6, 4, 16, 16]);
}

#[test]
fn mask_subgraph_range_where_expand() {
    // A causal-mask style subgraph: Range over the sequence, Less, Where, Expand to the batch.
    let m = model(
        vec![
            node("Shape", "shape", &["x"], &["s"]),
            node("Gather", "gseq", &["s", "one"], &["seq"]),
            node("Range", "range", &["zero", "seq", "one"], &["r"]),
            with_ints(
                node("Unsqueeze", "ucol", &["r", "axes1"], &["rc"]),
                "unused",
                &[],
            ),
            node("Less", "less", &["r", "rc"], &["lt"]),
            node("Where", "where", &["lt", "neg", "zerof"], &["mask"]),
            node("ConstantOfShape", "cos", &["s"], &["zeros"]),
            node("Equal", "eq", &["s", "s"], &["same"]),
            node("Gather", "gb", &["s", "zero"], &["b"]),
            with_ints(
                node("Unsqueeze", "ub", &["b", "axes0"], &["b1"]),
                "unused",
                &[],
            ),
            with_int(
                node("Concat", "cat", &["b1", "ones2"], &["eshape"]),
                "axis",
                0,
            ),
            node("Expand", "expand", &["mask", "eshape"], &["big"]),
            node("Add", "add", &["big", "x3"], &["y"]),
        ],
        vec![
            scalar_int("zero", 0),
            scalar_int("one", 1),
            ints("axes0", &[0]),
            ints("axes1", &[1]),
            ints("ones2", &[1, 1]),
            weight("neg", &[]),
            weight("zerof", &[]),
            weight("x3", &[1, 8]),
        ],
        vec![value_info("x", 1, &[D::S("batch"), D::N(8)])],
        vec![],
    );
    let (model, inf) = run(m, 3);
    assert_eq!(value_of(&model, &inf, "r"), (0..8).collect::<Vec<_>>());
    assert_eq!(shape_of(&model, &inf, "lt"), vec![8, 8]);
    // lt[i][j] = r[j] < r[i]: row 0 all false, row 1 = [1, 0, ...].
    let lt = value_of(&model, &inf, "lt");
    assert_eq!(lt[..3], [0, 0, 0]);
    assert_eq!(lt[8..11], [1, 0, 0]);
    assert_eq!(value_of(&model, &inf, "same"), vec![1, 1]);
    assert_eq!(shape_of(&model, &inf, "zeros"), vec![3, 8]);
    assert_eq!(shape_of(&model, &inf, "big"), vec![3, 8, 8]);
    assert_eq!(shape_of(&model, &inf, "y"), vec![3, 8, 8]);
}

#[test]
fn slices_and_splits() {
    let m = model(
        vec![
            node("Slice", "slice", &["x", "st", "en", "ax", "sp"], &["a"]),
            with_int(
                node("Split", "split", &["x", "sizes"], &["p", "q"]),
                "axis",
                1,
            ),
            with_int(node("Flatten", "flat", &["a"], &["f"]), "axis", 1),
        ],
        vec![
            ints("st", &[1, -1]),
            ints("en", &[i64::MAX, i64::MIN]),
            ints("ax", &[1, 2]),
            ints("sp", &[2, -2]),
            ints("sizes", &[3, 7]),
        ],
        vec![value_info("x", 1, &[D::S("batch"), D::N(10), D::N(5)])],
        vec![],
    );
    let (model, inf) = run(m, 2);
    // axis 1: 1,3,5,7,9 → 5; axis 2 reversed by 2: 4,2,0 → 3
    assert_eq!(shape_of(&model, &inf, "a"), vec![2, 5, 3]);
    assert_eq!(shape_of(&model, &inf, "p"), vec![2, 3, 5]);
    assert_eq!(shape_of(&model, &inf, "q"), vec![2, 7, 5]);
    assert_eq!(shape_of(&model, &inf, "f"), vec![2, 15]);
}

#[test]
fn zero_element_constant_is_a_complete_constant() {
    // transformers' mask code: Constant(dims [0], no data) → ConstantOfShape → a
    // scalar. A 0-element tensor needs no data; it is not a shape-only initializer.
    let empty = memplan::onnx::proto::TensorProto {
        name: Some("empty".into()),
        dims: vec![0],
        data_type: Some(7),
        ..Default::default()
    };
    let mut c = node("Constant", "c", &[], &["shape"]);
    c.attribute.push(memplan::onnx::proto::AttributeProto {
        name: Some("value".into()),
        r#type: Some(memplan::onnx::proto::attribute_proto::AttributeType::Tensor as i32),
        t: Some(empty),
        ..Default::default()
    });
    let m = model(
        vec![
            c,
            node("ConstantOfShape", "cos", &["shape"], &["s"]),
            node("Cast", "cast", &["s"], &["sf"]),
            node("Add", "add", &["x", "sf"], &["y"]),
        ]
        .into_iter()
        .map(|n| {
            if n.name() == "cast" {
                with_int(n, "to", 1)
            } else {
                n
            }
        })
        .collect(),
        vec![],
        vec![value_info("x", 1, &[D::S("batch"), D::N(4)])],
        vec![value_info("y", 1, &[D::S("batch"), D::N(4)])],
    );
    let (model, inf) = run(m, 2);
    assert_eq!(shape_of(&model, &inf, "shape"), vec![0]);
    assert_eq!(value_of(&model, &inf, "shape"), Vec::<i64>::new());
    assert_eq!(shape_of(&model, &inf, "s"), Vec::<usize>::new());
    assert_eq!(value_of(&model, &inf, "s"), vec![0]);
    assert_eq!(shape_of(&model, &inf, "y"), vec![2, 4]);
}
