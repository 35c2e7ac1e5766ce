"""Reference forward outputs for memplan's CPU executor (tests/exec_forward.rs).

Runs the real-weight tiny models (mlp, cnn, transformer) with onnxruntime on seeded
inputs and writes tests/data/pytorch/forward_reference.json: per case the model file, batch,
what was changed for the run, the inputs and the outputs (float32 values written as
the exact float64 they equal, so they parse back bit for bit).

Dev-time only (needs numpy, onnx, onnxruntime); the tests read the committed JSON.

    python tools/pytorch/forward_reference.py

Cases:
- mlp, batch 4, as exported;
- cnn, batch 2, as exported: BatchNormalization in training mode (batch statistics;
  the updated running statistics are added as graph outputs and compared too);
- cnn_bn_eval, batch 2: every BatchNormalization switched to inference mode
  (`training_mode` 0, running statistics used, extra outputs removed);
- transformer, batch 2: every Dropout's `training_mode` input removed (inference:
  identity), since a random mask cannot be compared. The Rust side runs with
  `Options { dropout: false }`.

onnxruntime runs with graph optimizations disabled and one thread, so every op runs
as written (no fusions).
"""

import json
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODELS = os.path.join(ROOT, "models")
DATA = os.path.join(ROOT, "tests", "data", "pytorch")
SEED = 20240611


def f32_list(a):
    return [float(x) for x in np.asarray(a, dtype=np.float32).ravel()]


def tensor_json(a):
    a = np.asarray(a)
    if a.dtype == np.float32:
        data = f32_list(a)
        dtype = "float32"
    elif a.dtype == np.int64:
        data = [int(x) for x in a.ravel()]
        dtype = "int64"
    else:
        raise ValueError(f"unexpected dtype {a.dtype}")
    return {"dtype": dtype, "shape": list(a.shape), "data": data}


def run(model, feeds, extra_outputs=()):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for name in extra_outputs:
        m.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
        m.graph.output[-1].name = name
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def bn_eval(model):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for n in m.graph.node:
        if n.op_type == "BatchNormalization":
            for a in n.attribute:
                if a.name == "training_mode":
                    a.i = 0
            del n.output[1:]
    return m


def no_dropout(model):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for n in m.graph.node:
        if n.op_type == "Dropout":
            del n.input[2:]
    return m


def main():
    rng = np.random.default_rng(SEED)
    cases = []

    def case(name, file, batch, change, model, extra=()):
        inp = model.graph.input[0]
        dims = [d.dim_value if d.dim_value else batch for d in inp.type.tensor_type.shape.dim]
        x = rng.standard_normal(dims).astype(np.float32)
        outs = run(model, {inp.name: x}, extra)
        cases.append(
            {
                "name": name,
                "model": file,
                "batch": batch,
                "change": change,
                "inputs": {inp.name: tensor_json(x)},
                "outputs": {k: tensor_json(v) for k, v in outs.items()},
            }
        )

    load = lambda f: onnx.load(os.path.join(MODELS, f))
    case("mlp", "mlp.onnx", 4, "none", load("mlp.onnx"))
    cnn = load("cnn.onnx")
    stats = [o for n in cnn.graph.node if n.op_type == "BatchNormalization" for o in n.output[1:]]
    case("cnn", "cnn.onnx", 2, "none", cnn, stats)
    case("cnn_bn_eval", "cnn.onnx", 2, "batchnorm_eval", bn_eval(cnn))
    case("transformer", "transformer.onnx", 2, "dropout_off", no_dropout(load("transformer.onnx")))

    out = {
        "_meta": {
            "generator": "tools/pytorch/forward_reference.py",
            "seed": SEED,
            "python": sys.version.split()[0],
            "numpy": np.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": ort.__version__,
            "graph_optimization": "disabled",
        },
        "cases": cases,
    }
    path = os.path.join(DATA, "forward_reference.json")
    with open(path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes, {len(cases)} cases)")


if __name__ == "__main__":
    main()
