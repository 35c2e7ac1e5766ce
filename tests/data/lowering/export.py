"""Writes the models tests/lowering.rs reads: control flow and sequences as the
exporters write them, with onnxruntime's outputs on fixed inputs (expected.json).

Dev-time only: /work/venv/bin/python tests/data/lowering/export.py
(torch 2.15, onnx 1.23.2, onnxruntime 1.32). Weights from torch.manual_seed(0).

- dynamo_split: the dynamo exporter with optimize=False (as `torch.onnx.export(...,
  dynamo=True, optimize=False)` writes it): chunk, split and unbind become
  SplitToSequence + SequenceAt; Linear layers around them.
- scripted_control: a torch.jit.script'ed module through the TorchScript exporter: a
  `for` over a constant range (the exporter unrolls it), a `for` over the batch
  rows growing a Python list (Loop whose trip count folds once the batch is bound,
  the list a loop-carried sequence: SequenceEmpty, SequenceInsert,
  ConcatFromSequence) and an `if` on a shape (If whose condition folds).
- scan_rnn: written with onnx.helper: a tanh RNN as Scan (opset 17) over axis 1,
  its body reading two weights of the main graph (outer scope), so they train.
- if_dynamic: an If whose condition is a graph input (refused).
- loop_huge: a 4.8 KB Loop of 10,000 iterations over a body of 202 nodes (refused past
  lower::MAX_ADDED_NODES, in about a second; it unrolled to 2 million nodes before).
"""
import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))


class Split(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(16, 8)

    def forward(self, x):
        y = self.a(x)
        g, v = y.chunk(2, dim=-1)
        h = v * torch.sigmoid(g)
        p, q = torch.split(h, [4, 12], dim=-1)
        h = torch.cat([q, p], dim=-1)
        rows = h.unbind(1)
        h = rows[0] + rows[-1] + h.mean(dim=1)
        return self.b(h)


class Control(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.lin = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(2):
            h = torch.tanh(self.lin(h))
        # A loop over the rows (trip count: the batch): Loop, its list a sequence.
        rows: list[torch.Tensor] = []
        for i in range(h.size(0)):
            rows.append(torch.sigmoid(self.lin(h[i])) * h[i])
        h = h + torch.stack(rows, dim=0)
        if h.size(1) == 16:
            h = h * 0.5
        else:
            h = h * 2.0
        return self.out(h)


def scan_rnn():
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32) * 0.3, "W")
    u = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32) * 0.3, "U")
    w0 = numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32) * 0.3, "W0")
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["x_t", "W"], ["xw"]),
            helper.make_node("MatMul", ["h", "U"], ["hu"]),
            helper.make_node("Add", ["xw", "hu"], ["s"]),
            helper.make_node("Tanh", ["s"], ["h_next"]),
            helper.make_node("Identity", ["h_next"], ["y_t"]),
        ],
        "rnn_step",
        [
            helper.make_tensor_value_info("h", TensorProto.FLOAT, ["batch", 16]),
            helper.make_tensor_value_info("x_t", TensorProto.FLOAT, ["batch", 8]),
        ],
        [
            helper.make_tensor_value_info("h_next", TensorProto.FLOAT, ["batch", 16]),
            helper.make_tensor_value_info("y_t", TensorProto.FLOAT, ["batch", 16]),
        ],
    )
    axes = numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")
    g = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["x"], ["xm"], axes=[1], keepdims=0),
            helper.make_node("MatMul", ["xm", "W0"], ["h0"]),
            helper.make_node(
                "Scan", ["h0", "x"], ["h_last", "ys"], body=body, num_scan_inputs=1,
                scan_input_axes=[1], scan_output_axes=[1],
            ),
            helper.make_node("Unsqueeze", ["h_last", "axes"], ["h_last_b"]),
            helper.make_node("Add", ["ys", "h_last_b"], ["y"]),
        ],
        "scan_rnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 5, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5, 16])],
        [w, u, w0, axes],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m)
    return m


def if_dynamic():
    then_g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["t"])], "then", [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    else_g = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["e"])], "else", [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    g = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)],
        "if_dynamic",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def loop_huge():
    nodes, prev = [], "x_in"
    for i in range(200):
        nodes.append(helper.make_node("Add", [prev, "one"], ["a%d" % i]))
        prev = "a%d" % i
    nodes += [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
              helper.make_node("Identity", [prev], ["x_out"])]
    body = helper.make_graph(
        nodes, "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_in", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_out", TensorProto.FLOAT, [4])],
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    g = helper.make_graph(
        [helper.make_node("Loop", ["M", "C", "x"], ["y"], body=body)], "loop_huge",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [helper.make_tensor("M", TensorProto.INT64, [], [10000]),
         helper.make_tensor("C", TensorProto.BOOL, [], [1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def main():
    torch.manual_seed(0)
    expected = {}
    models = {}
    x = torch.randn(2, 4, 16)
    p = torch.onnx.export(Split(), (x,), dynamo=True, optimize=False,
                          dynamic_shapes=({0: "batch"},), input_names=["x"], output_names=["y"])
    models["dynamo_split"] = (p.model_proto, {"x": x.numpy()})
    torch.manual_seed(0)
    path = os.path.join(HERE, "scripted_control.onnx")
    x2 = torch.randn(2, 8)
    torch.onnx.export(torch.jit.script(Control()), (x2,), path, dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "batch"}})
    models["scripted_control"] = (onnx.load(path), {"x": x2.numpy()})
    rng = np.random.default_rng(1)
    models["scan_rnn"] = (scan_rnn(), {"x": rng.standard_normal((2, 5, 8)).astype(np.float32)})
    models["if_dynamic"] = (if_dynamic(), None)
    models["loop_huge"] = (loop_huge(), None)
    for name, (m, feeds) in models.items():
        # Metadata that changes from run to run is dropped.
        del m.metadata_props[:]
        onnx.save(m, os.path.join(HERE, f"{name}.onnx"))
        if feeds is None:
            continue
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        outs = sess.run(None, feeds)
        ops = sorted({n.op_type for n in m.graph.node})
        expected[name] = {
            "ops": ops,
            "inputs": {k: {"shape": list(v.shape), "data": v.ravel().tolist()} for k, v in feeds.items()},
            "outputs": {o.name: {"shape": list(v.shape), "data": v.ravel().tolist()}
                        for o, v in zip(sess.get_outputs(), outs)},
        }
        print(name, ops, [v.shape for v in outs])
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)


if __name__ == "__main__":
    main()
