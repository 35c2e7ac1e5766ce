"""Ground-truth shape/dtype of every tensor of the test models at batch 2 (dev-time tool).

Usage:
    python tools/pytorch/tensor_shapes.py            # writes tests/data/pytorch/tensor_shapes.json

For every model models/<stem>.onnx listed in tests/data/pytorch/reference.json (the "_meta" key is skipped)
the graph is actually executed with onnxruntime (graph optimizations disabled, so no node output
is fused away) with every node output added as a graph output, and the shape and dtype of every
graph input and node output is recorded:

    {"<stem>": {"<tensor name>": ["float32", [2, 64]], ...}, ...}

Shape-only files (initializer data cleared by models/export.py, dims/data_type kept) get their
initializers refilled with deterministic random data first (float: normal * 0.02, integer: zeros),
the same idea as export.py's own onnxruntime check, which ran on the still weight-carrying model.
Inputs are built like export.py's make_inputs: float inputs randn, int64 inputs random in [0, 1000),
with the dynamic "batch" dimension set to 2. Tensors that cannot be fetched are listed under
"<stem>__missing".
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODELS = os.path.join(ROOT, "models")
DATA = os.path.join(ROOT, "tests", "data", "pytorch")
BATCH = 2

DTYPES = {
    TensorProto.FLOAT: "float32",
    TensorProto.FLOAT16: "float16",
    TensorProto.DOUBLE: "float64",
    TensorProto.INT64: "int64",
    TensorProto.INT32: "int32",
    TensorProto.INT8: "int8",
    TensorProto.UINT8: "uint8",
    TensorProto.BOOL: "bool",
}
NP_DTYPES = {np.dtype(v): v for v in DTYPES.values()}
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)


def has_data(t):
    return bool(
        t.raw_data
        or t.float_data
        or t.int32_data
        or t.int64_data
        or t.double_data
        or t.uint64_data
        or t.string_data
        or t.external_data
    )


def fill_initializers(mp, rng):
    """Refill initializers whose data was cleared (shape-only files). Returns how many were filled."""
    filled = 0
    for i, t in enumerate(mp.graph.initializer):
        n = 1
        for d in t.dims:
            n *= int(d)
        if has_data(t) or n == 0:
            continue
        np_dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
        shape = [int(d) for d in t.dims]
        if t.data_type in FLOAT_TYPES:
            arr = (rng.standard_normal(shape) * 0.02).astype(np_dtype)
        else:
            arr = np.zeros(shape, dtype=np_dtype)
        new = numpy_helper.from_array(arr, t.name)
        mp.graph.initializer[i].CopyFrom(new)
        filled += 1
    return filled


def make_feeds(mp, rng):
    init_names = {t.name for t in mp.graph.initializer}
    feeds = {}
    for vi in mp.graph.input:
        if vi.name in init_names:
            continue
        tt = vi.type.tensor_type
        shape = []
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                shape.append(d.dim_value)
            elif d.dim_param == "batch":
                shape.append(BATCH)
            else:
                raise SystemExit(f"input {vi.name}: unknown symbolic dim {d.dim_param!r}")
        np_dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if tt.elem_type in FLOAT_TYPES:
            feeds[vi.name] = rng.standard_normal(shape).astype(np_dtype)
        else:
            feeds[vi.name] = rng.integers(0, 1000, shape).astype(np_dtype)
    return feeds


def node_outputs(graph):
    names = []
    for n in graph.node:
        for o in n.output:
            if o:
                names.append(o)
    return names


def measure(stem):
    path = os.path.join(MODELS, stem + ".onnx")
    mp = onnx.load(path)
    rng = np.random.default_rng(0)
    fill_initializers(mp, rng)
    feeds = make_feeds(mp, rng)

    # element types from onnx shape inference (only the elem type is copied into the new outputs,
    # so ORT's own runtime shapes are what we record)
    inferred = onnx.shape_inference.infer_shapes(mp)
    elem = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output) + list(inferred.graph.input):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            elem[vi.name] = vi.type.tensor_type.elem_type

    existing = {o.name for o in mp.graph.output}
    wanted = node_outputs(mp.graph)
    untyped = []
    for name in wanted:
        if name in existing:
            continue
        vi = onnx.ValueInfoProto()
        vi.name = name
        if name in elem:
            vi.type.tensor_type.elem_type = elem[name]
        else:
            untyped.append(name)
        mp.graph.output.append(vi)
        existing.add(name)
    # drop value_info so that ORT does not check runtime shapes against export-time annotations
    del mp.graph.value_info[:]

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    sess = ort.InferenceSession(mp.SerializeToString(), so, providers=["CPUExecutionProvider"])
    out_names = [o.name for o in sess.get_outputs()]
    res = sess.run(out_names, feeds)

    shapes = {}
    for name, arr in feeds.items():
        shapes[name] = [NP_DTYPES[arr.dtype], list(arr.shape)]
    got = dict(zip(out_names, res))
    missing = []
    for name in wanted:
        if name in shapes:
            continue
        arr = got.get(name)
        if arr is None or not isinstance(arr, np.ndarray):
            missing.append(name)
            continue
        ds = NP_DTYPES.get(arr.dtype)
        if ds is None:
            raise SystemExit(f"{stem}: tensor {name} has unsupported dtype {arr.dtype}")
        shapes[name] = [ds, [int(d) for d in arr.shape]]
        # cross-check against the elem type onnx inferred
        if name in elem and DTYPES.get(elem[name]) != ds:
            print(f"  warning {stem}/{name}: onnx infers {elem[name]}, ort gave {ds}", file=sys.stderr)
    return shapes, missing, untyped


def main():
    with open(os.path.join(DATA, "reference.json")) as f:
        ref = json.load(f)
    out = {}
    for stem in ref:
        if stem == "_meta":
            continue
        shapes, missing, untyped = measure(stem)
        out[stem] = shapes
        if missing:
            out[stem + "__missing"] = missing
        print(
            f"{stem}: {len(shapes)} tensors, {len(missing)} missing, {len(untyped)} without inferred type",
            file=sys.stderr,
        )
    path = os.path.join(DATA, "tensor_shapes.json")
    with open(path, "w") as f:
        f.write("{\n")
        items = list(out.items())
        for i, (k, v) in enumerate(items):
            f.write(json.dumps(k) + ":" + json.dumps(v, separators=(",", ":")))
            f.write(",\n" if i + 1 < len(items) else "\n")
        f.write("}\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
