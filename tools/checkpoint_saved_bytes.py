"""Bytes PyTorch keeps after forward with modules checkpointed (dev-time tool).

Runs torchvision's resnet18 (weights=None, train mode, batch 4, 224x224) on CPU with the
listed modules wrapped in torch.utils.checkpoint.checkpoint(..., use_reentrant=False),
tracks every storage an op creates during forward (a TorchDispatchMode holding weak
storage references) and sums those still alive when forward returns, leaving out the
parameters, buffers, the input and the output: what memplan calls
saved_bytes_at_forward_end. tests/module_plan.rs holds the numbers it printed with
torch 2.15.0 / torchvision 0.29.2.

    python tools/checkpoint_saved_bytes.py
"""

import json

import torch
import torch.utils.checkpoint as cp
import torchvision
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


class Track(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.refs = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self.refs[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
        return out


def measure(checkpointed, batch=4):
    torch.manual_seed(0)
    m = torchvision.models.resnet18(weights=None).train()
    for name in checkpointed:
        mod = m.get_submodule(name)
        f = mod.forward
        mod.forward = (lambda f: lambda *a, **k: cp.checkpoint(f, *a, use_reentrant=False, **k))(f)
    x = torch.randn(batch, 3, 224, 224)
    tr = Track()
    with tr:
        y = m(x)
    excl = {p.untyped_storage().data_ptr() for p in list(m.parameters()) + list(m.buffers())}
    excl.add(x.untyped_storage().data_ptr())
    excl.add(y.untyped_storage().data_ptr())
    return sum(n for p, (r, n) in tr.refs.items() if not r.expired() and p not in excl)


blocks = [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
print(json.dumps({
    "none": measure([]),
    "every-block": measure(blocks),
    "layer2.0": measure(["layer2.0"]),
    "layer1": measure(["layer1"]),
    "layer3.1.conv1": measure(["layer3.1.conv1"]),
    "searched": measure(["maxpool", "layer1.0", "layer1.1", "layer2.0.downsample", "layer2.1",
                         "layer3.0.downsample", "layer3.1", "layer4.0.downsample", "layer4.1"]),
}))
