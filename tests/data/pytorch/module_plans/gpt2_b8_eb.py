"""Activation checkpointing plan made by memplan.

model: models/gpt2.onnx
batch: 8
budget: 1.41 GiB (1513311309 bytes)
predicted peak: 1.41 GiB (1513311309 bytes)
method: module:greedy

apply(model) wraps each module below so that its forward runs through
torch.utils.checkpoint.checkpoint(..., use_reentrant=False): the module keeps only
its inputs for backward and runs again when backward reaches it (BatchNorm running
statistics are then updated again, as with any use of torch.utils.checkpoint).
"""

import functools

import torch.utils.checkpoint

CHECKPOINT_MODULES = [
    "transformer.h.0.attn",
    "transformer.h.0.mlp",
    "transformer.h.1.attn",
    "transformer.h.1.mlp.act",
    "transformer.h.2.attn",
    "transformer.h.2.mlp.act",
    "transformer.h.3.attn",
    "transformer.h.3.mlp.act",
    "transformer.h.4.attn",
    "transformer.h.4.mlp.act",
    "transformer.h.5.attn",
    "transformer.h.5.mlp.act",
    "transformer.h.6.attn",
    "transformer.h.6.mlp.act",
    "transformer.h.7.attn",
    "transformer.h.7.mlp.act",
    "transformer.h.8.attn",
    "transformer.h.8.mlp.act",
    "transformer.h.9.attn",
    "transformer.h.9.mlp.act",
    "transformer.h.10.attn",
    "transformer.h.10.mlp.act",
    "transformer.h.11.attn",
    "transformer.h.11.mlp.act",
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
