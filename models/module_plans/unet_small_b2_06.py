"""Activation checkpointing plan made by memplan.

model: models/unet_small.onnx
batch: 2
budget: 887.71 KiB (909016 bytes)
predicted peak: 998.39 KiB (1022356 bytes), over the budget: the lowest peak found
method: module:exhaustive

apply(model) wraps each module below so that its forward runs through
torch.utils.checkpoint.checkpoint(..., use_reentrant=False): the module keeps only
its inputs for backward and runs again when backward reaches it (BatchNorm running
statistics are then updated again, as with any use of torch.utils.checkpoint).
"""

import functools

import torch.utils.checkpoint

CHECKPOINT_MODULES = [
    "enc1",
    "enc2",
    "mid",
    "dec2",
    "dec1",
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
