"""Activation checkpointing plan made by memplan.

model: models/resnet50.onnx
batch: 8
budget: 502.59 MiB (527000000 bytes)
predicted peak: 499.11 MiB (523351364 bytes)
method: module:exhaustive

apply(model) wraps each module below so that its forward runs through
torch.utils.checkpoint.checkpoint(..., use_reentrant=False): the module keeps only
its inputs for backward and runs again when backward reaches it (BatchNorm running
statistics are then updated again, as with any use of torch.utils.checkpoint).
"""

import functools

import torch.utils.checkpoint

CHECKPOINT_MODULES = [
    "maxpool",
    "layer1.0",
    "layer1.1",
    "layer1.2",
    "layer2.0",
    "layer2.2",
    "layer2.3",
    "layer3.4",
]


def apply(model):
    """Checkpoints every module of CHECKPOINT_MODULES in `model`; returns `model`."""
    for name in CHECKPOINT_MODULES:
        module = model.get_submodule(name)
        if getattr(module, "_memplan_checkpointed", False):
            continue
        forward = module.forward

        @functools.wraps(forward)
        def checkpointed(*args, _forward=forward, **kwargs):
            return torch.utils.checkpoint.checkpoint(
                _forward, *args, use_reentrant=False, **kwargs
            )

        module.forward = checkpointed
        module._memplan_checkpointed = True
    return model
