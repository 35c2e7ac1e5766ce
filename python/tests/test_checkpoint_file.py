"""The `--pytorch` file of a module plan, applied in PyTorch: the step runs and gives the
gradients of the model without it. A DenseNet-style block passes each layer the list of
earlier features and appends to that same list afterwards; the checkpoint wrapper must
copy such arguments at call time, or the recompute sees the grown list (torchvision's
DenseNet-121: `running_mean should contain 1024 elements not 256`, issue 49)."""

import os
import subprocess

import pytest

torch = pytest.importorskip("torch")

from test_export import memplan_binary  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Layer(torch.nn.Module):
    def __init__(self, c_in, growth):
        super().__init__()
        self.norm = torch.nn.BatchNorm2d(c_in)
        self.conv = torch.nn.Conv2d(c_in, growth, 3, padding=1)

    def forward(self, features):  # a list, as torchvision's _DenseLayer takes it
        return self.conv(torch.relu(self.norm(torch.cat(features, 1))))


class Block(torch.nn.Module):
    def __init__(self, c=4, growth=4, layers=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(c + i * growth, growth) for i in range(layers))

    def forward(self, x):
        features = [x]
        for layer in self.layers:
            features.append(layer(features))  # the list grows after each call
        return torch.cat(features, 1)


def checkpoint_file(tmp_path):
    """A real `--pytorch` file (ResNet-18's module plan), its module list replaced."""
    exe = memplan_binary()
    if exe is None:
        pytest.skip("memplan is not built")
    py = tmp_path / "ckpt.py"
    subprocess.run([exe, "plan", os.path.join(ROOT, "models", "resnet18.onnx"), "--batch", "2",
                    "--budget", "90%", "--granularity", "module", "--pytorch", str(py)],
                   capture_output=True, text=True)
    assert py.exists()
    ns = {}
    exec(compile(py.read_text(), str(py), "exec"), ns)
    return ns


def test_dense_blocks_recompute_what_they_computed(tmp_path):
    ns = checkpoint_file(tmp_path)
    torch.manual_seed(0)
    plain = Block()
    ckpt = Block()
    ckpt.load_state_dict(plain.state_dict())
    ns["CHECKPOINT_MODULES"][:] = ["layers.0", "layers.1", "layers.2"]
    ns["apply"](ckpt)
    x = torch.randn(2, 4, 8, 8)
    plain(x).square().mean().backward()
    ckpt(x).square().mean().backward()  # raised before: the recompute saw the grown list
    for (n, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), n


class Net(torch.nn.Module):
    """What the op-plan file must find in eager PyTorch: a stem with BatchNorm, an
    in-place ReLU6 (autograd copies its input) and a MaxPool whose indices alone may be
    recomputed; dense blocks that concatenate; a Linear head."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                        torch.nn.ReLU6(inplace=True), torch.nn.MaxPool2d(2))
        self.block = Block(c=8, growth=4, layers=3)
        self.head = torch.nn.Linear(20, 10)

    def forward(self, x):
        y = self.block(self.stem(x))
        return self.head(y.mean((2, 3)))


def test_an_op_plan_file_finds_every_value_and_keeps_the_gradients(tmp_path):
    """`plan --pytorch` on an op plan: the hooks find every value of RECOMPUTE in eager
    PyTorch (model.memplan_missing empty) and the gradients are bitwise those of the
    step without the file."""
    exe = memplan_binary()
    if exe is None:
        pytest.skip("memplan is not built")
    pytest.importorskip("onnx")
    torch.manual_seed(0)
    plain = Net().train()
    path = tmp_path / "net.onnx"
    torch.onnx.export(plain, (torch.randn(2, 3, 16, 16),), str(path), dynamo=False,
                      input_names=["input"], output_names=["output"], training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False)
    py = tmp_path / "plan.py"
    # Below what recomputation reaches: the lowest-peak plan is written (exit 1).
    r = subprocess.run([exe, "plan", str(path), "--budget", "0.5", "--optimizer", "sgd", "--pytorch", str(py)],
                       capture_output=True, text=True)
    assert r.returncode in (0, 1) and py.exists(), r.stderr
    ns = {}
    exec(compile(py.read_text(), str(py), "exec"), ns)
    ops = {e[1] for e in ns["RECOMPUTE"]}
    assert {"Clip", "Concat", "MaxPool", "BatchNormalization"} <= ops, ns["RECOMPUTE"]
    ckpt = Net().train()
    ckpt.load_state_dict(plain.state_dict())
    ns["apply"](ckpt)
    x = torch.randn(2, 3, 16, 16)
    plain(x).mean().backward()
    ckpt(x).mean().backward()
    assert ckpt.memplan_missing == []
    for (n, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert torch.equal(a.grad, b.grad), n
