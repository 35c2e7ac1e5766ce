"""Shape-only ONNX export of any ``nn.Module``: the model is built on the meta device, exported
with the dynamo exporter (``optimize=False``, so the graph is what trains), and every parameter and
buffer is written back as an initializer holding its name, dtype and dims but no data.

memplan reads such a file as it reads one with weights: memory needs shapes, not values.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field

#: Key of the graph-signature metadata the dynamo exporter puts on initializers; memplan reads it
#: (as a value_info entry) to tell buffers, which never train, from parameters.
KIND_KEY = "pkg.torch.export.graph_signature.InputSpec.kind"


#: Node metadata dropped from the file: a stack trace and the FX node's text per node.
_DROPPED_NODE_METADATA = {"pkg.torch.onnx.stack_trace", "pkg.torch.onnx.fx_node", "namespace",
                          "pkg.torch.onnx.class_hierarchy"}


class ExportError(Exception):
    """A failure the user can act on; ``str()`` is one line."""


@dataclass
class Exported:
    """What was written: the path, the ONNX model proto's size, and counts a user checks."""

    path: str
    nodes: int
    parameters: int
    parameter_elements: int
    buffers: int
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    file_bytes: int = 0
    notes: list = field(default_factory=list)


def _meta_like(x):
    import torch

    if isinstance(x, torch.Tensor):
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    if isinstance(x, (tuple, list)):
        return type(x)(_meta_like(v) for v in x)
    if isinstance(x, dict):
        return {k: _meta_like(v) for k, v in x.items()}
    return x


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    for line in text.splitlines():
        line = line.strip()
        if line:
            return "%s: %s" % (type(e).__name__, line)
    return type(e).__name__


@contextlib.contextmanager
def _quiet(verbose: bool):
    """The exporter prints progress lines and warnings; keep them unless asked."""
    if verbose:
        yield
        return
    import logging
    import warnings

    out, err = io.StringIO(), io.StringIO()
    level = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                yield
    finally:
        logging.disable(level)


def _dynamic_shapes(args, kwargs, batch_dim: int | None):
    """Dim 0 of every tensor input is the shared dynamic batch, named ``batch`` (memplan binds it
    with ``--batch``)."""
    import torch

    if batch_dim is None:
        return None
    batch = torch.export.Dim("batch", min=1, max=1 << 20)

    def spec(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return {0: batch}
        return None

    dyn_args = tuple(spec(a) for a in args)
    dyn_kwargs = {k: spec(v) for k, v in kwargs.items()}
    if kwargs:
        return {**{f"_arg{i}": d for i, d in enumerate(dyn_args)}, **dyn_kwargs} if args else dyn_kwargs
    return dyn_args


def _shape_only_initializer(name, value):
    """An initializer TensorProto with name, data_type and dims, and no data."""
    import onnx

    t = onnx.TensorProto()
    t.name = name
    t.data_type = int(value.dtype)
    dims = []
    for d in value.shape:
        if not isinstance(d, int):
            raise ExportError("initializer '%s' has a symbolic dimension %s" % (name, d))
        dims.append(d)
    t.dims.extend(dims)
    return t


def _has_data(value) -> bool:
    """Whether an initializer's value holds real bytes (a constant the exporter made), not a meta
    tensor standing for a parameter."""
    cv = value.const_value
    if cv is None:
        return False
    raw = getattr(cv, "raw", None)
    import torch

    if isinstance(raw, torch.Tensor):
        return raw.device.type != "meta"
    return True


def _name_batch_dim(g):
    """The exporter names the dynamic batch after its own symbol (``s72``); memplan binds a
    dimension named ``batch`` with ``--batch``. Rename the symbol at dim 0 of the inputs."""
    syms = set()
    for vi in g.input:
        dims = vi.type.tensor_type.shape.dim
        if dims and dims[0].dim_param:
            syms.add(dims[0].dim_param)
    if not syms:
        return
    pattern = re.compile(r"\b(%s)\b" % "|".join(re.escape(s) for s in sorted(syms)))
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param:
                d.dim_param = pattern.sub("batch", d.dim_param)


def to_shape_only(program, path: str, metadata: dict | None = None) -> Exported:
    """Write ``program`` (a ``torch.onnx.ONNXProgram``) to ``path``: parameters and buffers as
    shape-only initializers, constants the exporter made with their data. Atomic: a temporary file
    in the same folder, then a rename."""
    import onnx
    import onnx_ir as ir

    graph = program.model.graph
    kept = dict(graph.initializers)
    shapes = {}  # name -> (value, kind)
    for name, v in kept.items():
        if not _has_data(v):
            kind = v.meta.get(KIND_KEY) or v.metadata_props.get(KIND_KEY) or "PARAMETER"
            shapes[name] = (v, kind)
    for name in shapes:
        graph.initializers.pop(name)
    try:
        mp = ir.serde.serialize_model(program.model)
    finally:
        for name, (v, _) in shapes.items():
            graph.initializers[name] = v
    params = buffers = elements = 0
    for name, (v, kind) in shapes.items():
        mp.graph.initializer.append(_shape_only_initializer(name, v))
        vi = onnx.ValueInfoProto()
        vi.name = name
        vi.type.tensor_type.elem_type = int(v.dtype)
        for d in v.shape:
            vi.type.tensor_type.shape.dim.add().dim_value = int(d)
        p = vi.metadata_props.add()
        p.key, p.value = KIND_KEY, kind
        mp.graph.value_info.append(vi)
        if kind == "PARAMETER":
            params += 1
            n = 1
            for d in v.shape:
                n *= int(d)
            elements += n
        else:
            buffers += 1
    _name_batch_dim(mp.graph)
    for node in mp.graph.node:  # source lines and FX text: most of the file, read by nothing
        keep = [p for p in node.metadata_props if p.key not in _DROPPED_NODE_METADATA]
        if len(keep) != len(node.metadata_props):
            del node.metadata_props[:]
            node.metadata_props.extend(keep)
    for k, val in (metadata or {}).items():
        p = mp.metadata_props.add()
        p.key, p.value = str(k), str(val)
    data = mp.SerializeToString()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".memplan-export-", suffix=".onnx", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 is no output file's mode
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return Exported(
        path=path,
        nodes=len(mp.graph.node),
        parameters=params,
        parameter_elements=elements,
        buffers=buffers,
        inputs=[i.name for i in mp.graph.input],
        outputs=[o.name for o in mp.graph.output],
        file_bytes=len(data),
    )


def export_program(model, args=(), kwargs=None, *, input_names=None, output_names=None,
                   batch_dim: int | None = 0, verbose=False, hint=None, translations=None):
    """``torch.onnx.export(dynamo=True, optimize=False)`` of a (meta) model in training mode;
    ``translations`` is its ``custom_translation_table`` (ops memplan-export writes itself)."""
    import torch

    kwargs = kwargs or {}
    model.train()
    dyn = _dynamic_shapes(args, kwargs, batch_dim)
    try:
        with _quiet(verbose):
            return torch.onnx.export(
                model,
                tuple(args),
                None,
                kwargs=kwargs or None,
                dynamo=True,
                optimize=False,
                dynamic_shapes=dyn,
                input_names=input_names,
                output_names=output_names,
                external_data=False,
                custom_translation_table=translations,
            )
    except Exception as e:  # noqa: BLE001  the exporter raises many kinds
        msg = "torch.onnx.export failed: " + _first_line(_root_cause(e))
        if hint:
            msg += " (" + hint + ")"
        raise ExportError(msg) from e


def _root_cause(e: BaseException) -> BaseException:
    """The exporter wraps the real error (a torch.export failure) in its own; report the inner."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        inner = e.__cause__ or e.__context__
        if inner is None:
            break
        e = inner
    return e


def export(factory, example_inputs, path, *, kwargs=None, input_names=None, output_names=None,
           dtype=None, batch_dim: int | None = 0, metadata=None, verbose=False) -> Exported:
    """Export ``factory()`` (any callable returning an ``nn.Module``) as a shape-only ONNX file.

    The factory runs under ``torch.device("meta")``: no weights are allocated, so a 70 B model
    exports on a laptop. ``example_inputs`` (a tuple of tensors, real or meta) fix every dimension
    but the batch (dim 0 of every tensor input, exported as the dynamic ``batch``); ``kwargs`` are
    keyword inputs. ``dtype`` casts the model's floating parameters (export in the dtype you train
    in: the model's own float32 upcasts are kept only then). Returns what was written."""
    import torch

    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise ExportError("the factory returned %s, not a torch.nn.Module" % type(model).__name__)
    if dtype is not None:
        model = model.to(dtype)
    args = _meta_like(tuple(example_inputs))
    kw = _meta_like(dict(kwargs or {}))
    prog = export_program(model, args, kw, input_names=input_names, output_names=output_names,
                          batch_dim=batch_dim, verbose=verbose)
    meta = {"memplan.exported_by": "memplan-export"}
    meta.update(metadata or {})
    return to_shape_only(prog, path, meta)


def eprint(*a):
    print(*a, file=sys.stderr)


