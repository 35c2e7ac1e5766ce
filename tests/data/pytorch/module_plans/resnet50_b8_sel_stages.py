"""Activation checkpointing plan made by memplan.

model: models/resnet50.onnx
batch: 8
budget: none given
predicted peak: 540.93 MiB (567209284 bytes)
method: module:given

apply(model) wraps each module below so that its forward runs through
torch.utils.checkpoint.checkpoint(..., use_reentrant=False): the module keeps only
its inputs for backward and runs again when backward reaches it (BatchNorm running
statistics are then updated again, as with any use of torch.utils.checkpoint).
Modules in SELECTIVE_MODULES keep their convolutions' and matrix products' outputs
too, and rerun only the rest.
"""

import functools

import torch
import torch.utils.checkpoint

CHECKPOINT_MODULES = [
    "maxpool",
    "layer1.0",
    "layer1.1",
    "layer1.2",
    "layer2",
    "layer3",
    "layer4",
]

# Of CHECKPOINT_MODULES, these are checkpointed selectively (PyTorch 2.4 or later):
# the outputs of their convolutions and matrix products are kept from forward, and
# only the ops between them run again in backward.
SELECTIVE_MODULES = [
    "layer2",
    "layer3",
    "layer4",
]

_SAVED_OPS = {
    torch.ops.aten.convolution.default,
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
}


def _policy(ctx, op, *args, **kwargs):
    if op in _SAVED_OPS:
        return torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
    return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    if not hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts"):
        raise RuntimeError("SELECTIVE_MODULES need PyTorch 2.4 or later")
    return torch.utils.checkpoint.create_selective_checkpoint_contexts(_policy)


def apply(model):
    """Checkpoints every module of CHECKPOINT_MODULES in `model`; returns `model`."""
    for name in CHECKPOINT_MODULES:
        module = model.get_submodule(name)
        if getattr(module, "_memplan_checkpointed", False):
            continue
        forward = module.forward
        extra = {"context_fn": _selective_context} if name in SELECTIVE_MODULES else {}

        @functools.wraps(forward)
        def checkpointed(*args, _forward=forward, _extra=extra, **kwargs):
            return torch.utils.checkpoint.checkpoint(
                _forward, *args, use_reentrant=False, **_extra, **kwargs
            )

        module.forward = checkpointed
        module._memplan_checkpointed = True
    return model
