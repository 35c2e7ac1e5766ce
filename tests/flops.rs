//! FLOP counts of the main ops on hand-computed cases (a multiply-add counts 2).

mod common;

use common::*;
use memplan::infer::{infer, Bindings};
use memplan::onnx::load_model;

fn flops_of(m: memplan::onnx::proto::ModelProto) -> Vec<u64> {
    let dir = tempfile::tempdir().unwrap();
    let p = write_tmp(&dir, "f.onnx", &encode(&m));
    let model = load_model(&p).unwrap();
    infer(
        &model,
        &Bindings {
            batch: Some(2),
            ..Default::default()
        },
    )
    .unwrap()
    .flops
}

#[test]
fn conv_gemm_matmul() {
    let conv = with_ints(
        node("Conv", "c", &["x", "w", "b"], &["y"]),
        "pads",
        &[1, 1, 1, 1],
    );
    let f = flops_of(model(
        vec![conv],
        vec![weight("w", &[4, 3, 3, 3]), weight("b", &[4])],
        vec![value_info(
            "x",
            1,
            &[D::S("batch"), D::N(3), D::N(8), D::N(8)],
        )],
        vec![],
    ));
    // out [2,4,8,8] = 512 elements × (2·27 MACs + 1 bias)
    assert_eq!(f, vec![512 * 55]);

    let f = flops_of(model(
        vec![
            node("MatMul", "mm", &["x", "w"], &["y"]),
            with_int(node("Gemm", "g", &["a", "wg", "c"], &["z"]), "transB", 1),
        ],
        vec![
            weight("w", &[4, 5]),
            weight("wg", &[6, 4]),
            weight("c", &[6]),
        ],
        vec![
            value_info("x", 1, &[D::S("batch"), D::N(3), D::N(4)]),
            value_info("a", 1, &[D::S("batch"), D::N(4)]),
        ],
        vec![],
    ));
    // MatMul: [2,3,4]×[4,5] → 30 outputs × 2·4; Gemm: [2,4]×[4,6]ᵀ → 12 × 2·4 + 12 (C)
    assert_eq!(f, vec![240, 108]);
}

#[test]
fn normalizations_and_data_movement() {
    let f = flops_of(model(
        vec![
            node("Softmax", "sm", &["x"], &["s"]),
            node("LayerNormalization", "ln", &["s", "g", "b"], &["l"]),
            with_ints(node("Transpose", "t", &["l"], &["tr"]), "perm", &[1, 0]),
            node("Relu", "r", &["tr"], &["y"]),
        ],
        vec![weight("g", &[10]), weight("b", &[10])],
        vec![value_info("x", 1, &[D::S("batch"), D::N(10)])],
        vec![],
    ));
    assert_eq!(f, vec![5 * 20, 8 * 20, 0, 20]);
}
