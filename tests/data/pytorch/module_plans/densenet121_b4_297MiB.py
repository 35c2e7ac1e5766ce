"""Activation checkpointing plan made by memplan.

model: models/densenet121.onnx
batch: 4
budget: 297.00 MiB (311427072 bytes)
predicted peak: 296.80 MiB (311217860 bytes)
method: module:greedy

apply(model) wraps each module below so that its forward runs through
torch.utils.checkpoint.checkpoint(..., use_reentrant=False): the module keeps only
its inputs for backward and runs again when backward reaches it (BatchNorm running
statistics are then updated again, as with any use of torch.utils.checkpoint).
"""

import functools

import torch.utils.checkpoint

CHECKPOINT_MODULES = [
    "features.pool0",
    "features.denseblock1.denselayer1",
    "features.denseblock1.denselayer2",
    "features.denseblock1.denselayer3",
    "features.denseblock1.denselayer4",
    "features.denseblock1.denselayer5",
    "features.denseblock1.denselayer6",
    "features.denseblock2.denselayer1",
    "features.denseblock2.denselayer3",
    "features.denseblock2.denselayer4",
    "features.denseblock2.denselayer5",
    "features.denseblock2.denselayer6",
    "features.denseblock2.denselayer7",
    "features.denseblock2.denselayer8",
    "features.denseblock2.denselayer9",
    "features.denseblock2.denselayer10",
    "features.denseblock3.denselayer1",
]


def _snapshot(v):
    """Lists, tuples and dicts copied (tensors are not): a container argument as it is
    at call time."""
    if isinstance(v, list):
        return [_snapshot(x) for x in v]
    if type(v) is tuple:
        return tuple(_snapshot(x) for x in v)
    if isinstance(v, dict):
        return {k: _snapshot(x) for k, x in v.items()}
    return v


def apply(model):
    """Checkpoints every module of CHECKPOINT_MODULES in `model`; returns `model`."""
    for name in CHECKPOINT_MODULES:
        module = model.get_submodule(name)
        if getattr(module, "_memplan_checkpointed", False):
            continue
        forward = module.forward

        @functools.wraps(forward)
        def checkpointed(*args, _forward=forward, **kwargs):
            # The recompute must see the arguments as they are now: DenseNet passes
            # each layer the list of earlier features and appends to it afterwards.
            args = tuple(_snapshot(a) for a in args)
            kwargs = {k: _snapshot(v) for k, v in kwargs.items()}
            return torch.utils.checkpoint.checkpoint(
                _forward, *args, use_reentrant=False, **kwargs
            )

        module.forward = checkpointed
        module._memplan_checkpointed = True
    return model
