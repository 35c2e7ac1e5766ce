"""Exports for tests/export_modes.rs, with what PyTorch saves for backward in one training
step at batch 2 (pytorch.json):

* one small model (Conv -> BatchNorm -> ReLU -> Dropout -> Conv -> BatchNorm -> mean) six
  ways: the two PyTorch exporters, in training mode as docs/usage/exporting.md says
  and in the ways that write a file for inference (eval mode; the dynamo exporter's default
  optimizer);
* a rotary embedding as transformers writes it (a non-persistent `inv_freq` buffer that a
  differentiable computation reads) through the dynamo exporter: rotary_dynamo.onnx, and
  with its default optimizer, which folds the cos/sin tables: rotary_dynamo_optimized.onnx;
* a Conv3d without bias through the dynamo exporter, which writes the missing bias as
  zeros of shape [4, 2] (onnxscript's aten_conv3d): conv3d_dynamo.onnx;
* a table indexed by a buffer (Swin's relative position bias) through the dynamo
  exporter, which writes `table[index]` as GatherND over a one-input Concat:
  index_dynamo.onnx.

    python tests/data/export_modes/export_modes.py   # torch 2.15, onnx 1.23, onnxscript
"""

import json
import os
import warnings

import torch

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(4)
        self.drop = torch.nn.Dropout(0.1)
        self.conv2 = torch.nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(4)

    def forward(self, x):
        x = self.drop(torch.relu(self.bn1(self.conv1(x))))
        return self.bn2(self.conv2(x)).mean(dim=(2, 3))


class Rotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(8, 8, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x):  # [batch, 6, 8]
        t = torch.arange(x.shape[1], dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        q = self.q(x)
        return q * emb.cos() + q * emb.sin()


class Video(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv3d(2, 4, 3, padding=1, bias=False)

    def forward(self, x):  # [batch, 2, 4, 6, 6]
        return torch.relu(self.conv(x)).mean(dim=(2, 3, 4))


class RelPos(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(25, 2))
        self.register_buffer("rel_index", torch.randint(0, 25, (9, 9)))

    def forward(self, x):  # [batch, 2, 9, 9]
        bias = self.table[self.rel_index.flatten()].view(9, 9, 2).permute(2, 0, 1)
        return torch.relu(x + bias)


def saved_bytes(m, x, dropout_elements=0):
    """What PyTorch saves for backward in one training step: distinct storages through
    saved_tensors_hooks, parameters and buffers (BatchNorm's running statistics, inv_freq)
    excluded. On the CPU dropout saves a float32 noise tensor where CUDA saves a 1-byte
    mask: 3 bytes per element are taken out, as tests/training.rs does."""
    m.train()
    fixed = {p.data_ptr() for p in [*m.parameters(), *m.buffers()]}
    seen = {}

    def pack(t):
        if t.data_ptr() not in fixed:
            seen[t.data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x).mean().backward()
    return sum(seen.values()) - 3 * dropout_elements


def main():
    torch.manual_seed(0)
    m = Net()
    x = torch.randn(2, 3, 8, 8)
    batch = {"input": {0: "batch"}}
    dyn = ({0: torch.export.Dim("batch")},)

    def ts(name, train, fold):
        m.train(train)
        mode = torch.onnx.TrainingMode.TRAINING if train else torch.onnx.TrainingMode.EVAL
        torch.onnx.export(m, (x,), os.path.join(HERE, name), dynamo=False, opset_version=17,
                          training=mode, do_constant_folding=fold, input_names=["input"],
                          dynamic_axes=batch)

    def dynamo(name, train, optimize):
        m.train(train)
        torch.onnx.export(m, (x,), os.path.join(HERE, name), dynamo=True, optimize=optimize,
                          dynamic_shapes=dyn)

    ts("ts_train.onnx", True, False)
    ts("ts_eval.onnx", False, True)  # the exporter's defaults for a model in eval mode
    ts("ts_eval_nofold.onnx", False, False)
    dynamo("dynamo_train.onnx", True, False)
    dynamo("dynamo_train_optimized.onnx", True, True)  # the default optimize=True
    dynamo("dynamo_eval.onnx", False, False)

    rotary = Rotary()
    xr = torch.randn(2, 6, 8)
    torch.onnx.export(rotary, (xr,), os.path.join(HERE, "rotary_dynamo.onnx"), dynamo=True,
                      optimize=False, dynamic_shapes=dyn)
    # The default optimize=True folds the cos/sin tables into initializers.
    torch.onnx.export(rotary, (xr,), os.path.join(HERE, "rotary_dynamo_optimized.onnx"),
                      dynamo=True, dynamic_shapes=dyn)

    video = Video()
    xv = torch.randn(2, 2, 4, 6, 6)
    torch.onnx.export(video, (xv,), os.path.join(HERE, "conv3d_dynamo.onnx"), dynamo=True,
                      optimize=False, dynamic_shapes=dyn)

    relpos = RelPos()
    xi = torch.randn(2, 2, 9, 9)
    torch.onnx.export(relpos, (xi,), os.path.join(HERE, "index_dynamo.onnx"), dynamo=True,
                      optimize=False, dynamic_shapes=dyn)

    def io(model, inp):
        # PyTorch's output on the export's input: the weights are in the .data file.
        with torch.no_grad():
            out = model(inp)
        return {k: {"shape": list(t.shape), "data": [float(v) for v in t.flatten()]}
                for k, t in (("x", inp), ("y", out))}

    with open(os.path.join(HERE, "pytorch.json"), "w") as f:
        json.dump({"batch": 2, "saved_bytes": saved_bytes(m, x, 2 * 4 * 8 * 8),
                   "rotary_saved_bytes": saved_bytes(rotary, xr),
                   "conv3d_saved_bytes": saved_bytes(video, xv),
                   "index_saved_bytes": saved_bytes(relpos, xi),
                   "rotary_io": io(rotary, xr), "conv3d_io": io(video, xv),
                   "torch": torch.__version__},
                  f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
