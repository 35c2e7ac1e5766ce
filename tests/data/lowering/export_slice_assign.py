"""Writes tests/data/lowering/slice_assign.onnx, slice_assign_dynamo.onnx and
slice_assign.json: slice assignments (`a[:, :, 1:, 2:] += r`, `a[:, 1, :3] = ...`) as
the TorchScript exporter writes them (ScatterND over an index grid built from
shapes) and as the dynamo exporter does by default (`optimize=True`: ScatterND over
transposed data, ScatterElements for the select, the scalar 0.5 an initializer), with
PyTorch's output and saved bytes on fixed inputs.

Dev-time only: python tests/data/lowering/export_slice_assign.py (torch 2.15, onnx
1.23.2, onnxscript). Weights from torch.manual_seed(0). Saved bytes: the distinct storages of
the tensors autograd saves (`torch.autograd.graph.saved_tensors_hooks`) that are
not parameters (the input, which the Linear saves for its weight's gradient,
included), as tools/census measures them.
"""
import json
import os

import onnx
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


class SliceAssign(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        a = self.lin(x)
        r = torch.tanh(a[:, :, 1:, 2:])
        a[:, :, 1:, 2:] += r
        a[:, 1, :3] = a[:, 0, :3] * 0.5
        return torch.sigmoid(a)


def saved_bytes(model, x):
    params = {p.data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x)
    return y, sum(seen.values())


def main():
    torch.manual_seed(0)
    m = SliceAssign()
    x = torch.randn(3, 2, 6, 8)
    path = os.path.join(HERE, "slice_assign.onnx")
    torch.onnx.export(m, (x,), path, dynamo=False, opset_version=17, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "batch"}})
    p = onnx.load(path)
    del p.metadata_props[:]
    onnx.save(p, path)
    dyn = torch.onnx.export(m, (x,), dynamo=True, dynamic_shapes=({0: "batch"},),
                            input_names=["x"], output_names=["y"])
    d = dyn.model_proto
    del d.metadata_props[:]
    onnx.save(d, os.path.join(HERE, "slice_assign_dynamo.onnx"))
    xg = x.clone().requires_grad_(True)
    y, saved = saved_bytes(m, xg)
    y.sum().backward()
    out = {
        "ops": sorted({n.op_type for n in p.graph.node}),
        "inputs": {"x": {"shape": list(x.shape), "data": x.ravel().tolist()}},
        "outputs": {"y": {"shape": list(y.shape), "data": y.detach().ravel().tolist()}},
        "saved_bytes": saved,
    }
    with open(os.path.join(HERE, "slice_assign.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(out["ops"], saved)


if __name__ == "__main__":
    main()
