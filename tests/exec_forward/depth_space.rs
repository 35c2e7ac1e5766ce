//! DepthToSpace and SpaceToDepth against numpy's reshape/transpose (the ONNX
//! spec's definition; CRD checked equal to torch's pixel_shuffle), values made by
//! /work/venv/bin/python with numpy from `arange` inputs.

use super::*;

fn arange(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::f32(shape.to_vec(), (0..n).map(|i| i as f32).collect())
}

fn ints_of(t: &Tensor) -> Vec<i64> {
    t.as_f32().unwrap().iter().map(|&v| v as i64).collect()
}

#[test]
fn depth_to_space_and_back() {
    let x = arange(&[1, 8, 2, 3]);
    let dcr = [0, 12, 1, 13, 2, 14, 24, 36, 25, 37, 26, 38, 3, 15, 4, 16, 5, 17, 27, 39, 28, 40, 29, 41, 6, 18, 7, 19, 8, 20, 30, 42, 31, 43, 32, 44, 9, 21, 10, 22, 11, 23, 33, 45, 34, 46, 35, 47];
    let crd = [0, 6, 1, 7, 2, 8, 12, 18, 13, 19, 14, 20, 3, 9, 4, 10, 5, 11, 15, 21, 16, 22, 17, 23, 24, 30, 25, 31, 26, 32, 36, 42, 37, 43, 38, 44, 27, 33, 28, 34, 29, 35, 39, 45, 40, 46, 41, 47];
    for (mode, want) in [("DCR", &dcr), ("CRD", &crd)] {
        let attrs = [("blocksize", Attr::Int(2)), ("mode", Attr::String(mode.into()))];
        let y = run_op("DepthToSpace", &attrs, std::slice::from_ref(&x), 1).remove(0);
        assert_eq!(y.shape, vec![1, 2, 4, 6], "{mode}");
        assert_eq!(ints_of(&y), want.to_vec(), "{mode}");
    }
    let s2d = [0, 2, 4, 12, 14, 16, 24, 26, 28, 36, 38, 40, 1, 3, 5, 13, 15, 17, 25, 27, 29, 37, 39, 41, 6, 8, 10, 18, 20, 22, 30, 32, 34, 42, 44, 46, 7, 9, 11, 19, 21, 23, 31, 33, 35, 43, 45, 47];
    let y = run_op("SpaceToDepth", &[("blocksize", Attr::Int(2))], &[arange(&[1, 2, 4, 6])], 1).remove(0);
    assert_eq!(y.shape, vec![1, 8, 2, 3]);
    assert_eq!(ints_of(&y), s2d.to_vec());
}
