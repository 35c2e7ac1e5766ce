#!/usr/bin/env python3
"""Reference values for tests/exec_forward.rs `resize_tf_crop_and_resize_matches_the_onnx_reference`:
Resize with coordinate_transformation_mode tf_crop_and_resize, computed by the ONNX
reference implementation (onnx.reference.ReferenceEvaluator, onnx 1.23.2) on the test's
`seq` input (x[i] = ((37 i) mod 101 - 50) * 0.1, float32). Prints Rust constants.

    python3 tests/data/ops/reference_crop_and_resize.py
"""
import numpy as np
import onnx
from onnx import helper, TensorProto
from onnx.reference import ReferenceEvaluator


def seq(shape):
    n = int(np.prod(shape))
    return np.array([((i * 37 % 101) - 50) * 0.1 for i in range(n)], dtype=np.float32).reshape(shape)


CASES = [
    # name, mode, input shape, roi, sizes, extra attributes
    ("CROP_LINEAR", "linear", [1, 1, 4, 5], [0, 0, 0.2, 0.1, 1, 1, 0.9, 0.7], [1, 1, 3, 4], {}),
    ("CROP_LINEAR_EXTRAPOLATE", "linear", [1, 2, 4, 4], [0, 0, 0.4, 0.6, 1, 1, 1.2, 1.7], [1, 2, 3, 3],
     {"extrapolation_value": 2.5}),
    ("CROP_NEAREST", "nearest", [1, 1, 4, 5], [0, 0, -0.2, 0.3, 1, 1, 0.8, 1.1], [1, 1, 4, 3], {}),
    ("CROP_CUBIC_ONE_ROW", "cubic", [1, 1, 5, 4], [0, 0, 0.3, 0.1, 1, 1, 0.5, 0.8], [1, 1, 1, 5], {}),
]

for name, mode, shape, roi, sizes, extra in CASES:
    node = helper.make_node("Resize", ["x", "roi", "", "sizes"], ["y"], mode=mode,
                            coordinate_transformation_mode="tf_crop_and_resize", **extra)
    g = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
         helper.make_tensor_value_info("roi", TensorProto.FLOAT, [len(roi)]),
         helper.make_tensor_value_info("sizes", TensorProto.INT64, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    y = ReferenceEvaluator(m).run(None, {"x": seq(shape), "roi": np.array(roi, np.float32),
                                         "sizes": np.array(sizes, np.int64)})[0]
    vals = ", ".join("%.8e" % v for v in y.astype(np.float32).ravel())
    print("// %s: %s, input %s, roi %s, sizes %s, %s" % (name, mode, shape, roi, sizes, extra))
    print("pub const %s: [f32; %d] = [%s];" % (name, y.size, vals))
