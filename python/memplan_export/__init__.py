"""memplan-export: models in without weights, for memplan .

``export(factory, example_inputs, path)`` writes any ``nn.Module`` as a shape-only ONNX file;
``export_hf(name_or_config, path, seq=4096, ...)`` does it for a Hugging Face causal LM from its
config alone. Both build the model on the meta device: no weights are allocated or downloaded.
"""

from .core import Exported, ExportError, export
from .hf import committed_names, export_hf, resolve_config

__all__ = ["export", "export_hf", "committed_names", "resolve_config", "Exported", "ExportError"]
__version__ = "0.1.0"
