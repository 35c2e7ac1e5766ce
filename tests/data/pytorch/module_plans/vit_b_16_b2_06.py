"""Activation checkpointing plan made by memplan.

model: models/vit_b_16.onnx
batch: 2
budget: 400.39 MiB (419844559 bytes)
predicted peak: 668.02 MiB (700468437 bytes), over the budget: the lowest peak found
method: module:greedy

apply(model) wraps each module below so that its forward runs through
torch.utils.checkpoint.checkpoint(..., use_reentrant=False): the module keeps only
its inputs for backward and runs again when backward reaches it (BatchNorm running
statistics are then updated again, as with any use of torch.utils.checkpoint).
"""

import functools

import torch.utils.checkpoint

CHECKPOINT_MODULES = [
    "encoder.layers.encoder_layer_0.self_attention",
    "encoder.layers.encoder_layer_0.mlp",
    "encoder.layers.encoder_layer_1.self_attention",
    "encoder.layers.encoder_layer_1.mlp",
    "encoder.layers.encoder_layer_2.self_attention",
    "encoder.layers.encoder_layer_2.mlp",
    "encoder.layers.encoder_layer_3.self_attention",
    "encoder.layers.encoder_layer_3.mlp",
    "encoder.layers.encoder_layer_4.self_attention",
    "encoder.layers.encoder_layer_4.mlp",
    "encoder.layers.encoder_layer_5.self_attention",
    "encoder.layers.encoder_layer_5.mlp",
    "encoder.layers.encoder_layer_6.self_attention",
    "encoder.layers.encoder_layer_6.mlp",
    "encoder.layers.encoder_layer_7.self_attention",
    "encoder.layers.encoder_layer_7.mlp",
    "encoder.layers.encoder_layer_8.self_attention",
    "encoder.layers.encoder_layer_8.mlp",
    "encoder.layers.encoder_layer_9.self_attention",
    "encoder.layers.encoder_layer_9.mlp",
    "encoder.layers.encoder_layer_10.self_attention",
    "encoder.layers.encoder_layer_10.mlp",
    "encoder.layers.encoder_layer_11.self_attention",
    "encoder.layers.encoder_layer_11.mlp",
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
