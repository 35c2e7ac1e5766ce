#!/usr/bin/env python3
"""Export the ONNX test models used by memplan (dev-time tool, not needed to build memplan).

Usage:
    python models/export.py                  # (re)generate every models/*.onnx + models/reference.json
    python models/export.py --only mlp,gpt2  # regenerate a subset (reference.json entries are merged)
    python models/export.py --big PATH [--gb 1.0]
                                             # write a ~1 GB ONNX MLP with inline weights to PATH
                                             # (for memory measurements; never commit it)

Requirements: torch, torchvision, transformers, onnx, onnxscript (dynamo exporter);
onnxruntime is optional (used only to check that the exported graphs run at batch 2 and 3).

All weights are randomly initialised (torch.manual_seed(0)); nothing is downloaded.

Conventions (the Rust side relies on them):
  * every model is exported in TRAINING mode (model.train(); TorchScript exporter with
    training=TrainingMode.TRAINING), so BatchNormalization/Dropout nodes stay in the graph;
  * the batch dimension of every graph input and output is dynamic and named "batch";
  * TorchScript exports use do_constant_folding=False, so the graph initializers are exactly the
    model's parameters plus its floating-point buffers (BatchNorm running stats);
  * dynamo exports are post-processed so that the same holds (see export_dynamo());
  * the "shape-only" files have all initializer data cleared (name, dims and data_type kept).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BATCH = 2  # batch size used for tracing and for the reference outputs

FLOAT_TYPES = None  # filled lazily: ONNX TensorProto data types that are floating point


def _float_types():
    global FLOAT_TYPES
    if FLOAT_TYPES is None:
        from onnx import TensorProto as T

        FLOAT_TYPES = {T.FLOAT, T.DOUBLE, T.FLOAT16, T.BFLOAT16}
    return FLOAT_TYPES


# --------------------------------------------------------------------------------------
# Model definitions
# --------------------------------------------------------------------------------------


def _tiny_models():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(64, 128)
            self.fc2 = nn.Linear(128, 128)
            self.fc3 = nn.Linear(128, 10)

        def forward(self, x):
            return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))

    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(16)
            self.conv2 = nn.Conv2d(16, 32, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(32)
            self.pool = nn.MaxPool2d(2)
            self.gap = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(32, 10)

        def forward(self, x):
            x = F.relu(self.bn1(self.conv1(x)))
            x = F.relu(self.bn2(self.conv2(x)))
            x = self.pool(x)
            x = self.gap(x)
            x = torch.flatten(x, 1)
            return self.fc(x)

    class SelfAttention(nn.Module):
        """Multi-head self-attention written out explicitly (same parameters as nn.MultiheadAttention)."""

        def __init__(self, d_model, nhead, dropout):
            super().__init__()
            self.nhead = nhead
            self.head_dim = d_model // nhead
            self.in_proj = nn.Linear(d_model, 3 * d_model)
            self.out_proj = nn.Linear(d_model, d_model)
            self.attn_drop = nn.Dropout(dropout)

        def forward(self, x):
            b, t, c = x.shape
            qkv = self.in_proj(x).reshape(b, t, 3, self.nhead, self.head_dim).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]  # [b, h, t, d]
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            probs = self.attn_drop(torch.softmax(scores, dim=-1))
            y = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, c)
            return self.out_proj(y)

    class EncoderLayer(nn.Module):
        """Post-norm encoder layer, same structure and parameters as
        nn.TransformerEncoderLayer(d_model, nhead, dim_ff, dropout, activation="gelu", batch_first=True)."""

        def __init__(self, d_model=64, nhead=4, dim_ff=128, dropout=0.1):
            super().__init__()
            self.self_attn = SelfAttention(d_model, nhead, dropout)
            self.linear1 = nn.Linear(d_model, dim_ff)
            self.linear2 = nn.Linear(dim_ff, d_model)
            self.norm1 = nn.LayerNorm(d_model)
            self.norm2 = nn.LayerNorm(d_model)
            self.dropout = nn.Dropout(dropout)
            self.dropout1 = nn.Dropout(dropout)
            self.dropout2 = nn.Dropout(dropout)

        def forward(self, x):
            x = self.norm1(x + self.dropout1(self.self_attn(x)))
            ff = self.linear2(self.dropout(F.gelu(self.linear1(x))))  # exact (erf) GELU
            return self.norm2(x + self.dropout2(ff))

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([EncoderLayer() for _ in range(2)])
            self.head = nn.Linear(64, 10)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    return MLP, CNN, Transformer


def _patch_transformers():
    """transformers 5.x checks position_ids for "packed sequences" (torch.diff + data-dependent
    branch) when no attention mask is given. aten::diff is not exportable by the TorchScript
    exporter, and for single (unpacked) sequences the result is always "not packed", so we
    short-circuit it. The exported computation is unchanged for normal inputs."""
    import transformers.masking_utils as mu

    mu.find_packed_sequence_indices = lambda position_ids: None


def build(name):
    """Return (model, make_inputs(batch) -> tuple, input_specs, output_names).

    input_specs: list of (name, dtype_str, shape_without_batch)."""
    import torch

    torch.manual_seed(0)
    if name in ("mlp", "cnn", "transformer"):
        MLP, CNN, Transformer = _tiny_models()
        if name == "mlp":
            m, spec = MLP(), [("input", "float32", [64])]
        elif name == "cnn":
            m, spec = CNN(), [("input", "float32", [3, 32, 32])]
        else:
            m, spec = Transformer(), [("input", "float32", [16, 64])]
        outs = ["output"]
    elif name.startswith(("resnet18", "resnet50", "mobilenet_v2", "vit_b_16")):
        import torchvision

        base = name.replace("_dynamo", "")
        m = getattr(torchvision.models, base)(weights=None)
        spec, outs = [("input", "float32", [3, 224, 224])], ["output"]
    elif name.startswith("gpt2"):
        from transformers import GPT2Config, GPT2LMHeadModel

        _patch_transformers()

        class GPT2Export(GPT2LMHeadModel):
            def forward(self, input_ids):
                return super().forward(input_ids=input_ids, use_cache=False, return_dict=False)[0]

        m = GPT2Export(GPT2Config(attn_implementation="eager"))
        spec, outs = [("input_ids", "int64", [128])], ["logits"]
    elif name.startswith("bert_base"):
        from transformers import BertConfig, BertModel

        _patch_transformers()

        class BertExport(BertModel):
            def forward(self, input_ids):
                o = super().forward(input_ids=input_ids, return_dict=False)
                return o[0], o[1]

        m = BertExport(BertConfig(attn_implementation="eager"))
        spec, outs = [("input_ids", "int64", [128])], ["last_hidden_state", "pooler_output"]
    else:
        raise KeyError(name)

    def make_inputs(batch, seed=1):
        g = torch.Generator().manual_seed(seed)
        res = []
        for _, dt, shape in spec:
            if dt == "int64":
                res.append(torch.randint(0, 1000, [batch] + shape, generator=g, dtype=torch.int64))
            else:
                res.append(torch.randn([batch] + shape, generator=g))
        return tuple(res)

    m.train()
    return m, make_inputs, spec, outs


# name -> (exporter, shape_only)
MODELS = collections.OrderedDict(
    [
        ("mlp", ("torchscript", False)),
        ("cnn", ("torchscript", False)),
        ("transformer", ("torchscript", False)),
        ("resnet18", ("torchscript", True)),
        ("resnet50", ("torchscript", True)),
        ("mobilenet_v2", ("torchscript", True)),
        ("vit_b_16", ("torchscript", True)),
        ("bert_base", ("torchscript", True)),
        ("gpt2", ("torchscript", True)),
        ("resnet18_dynamo", ("dynamo", True)),
        ("gpt2_dynamo", ("dynamo", True)),
    ]
)
TORCHSCRIPT_OPSET = 17


# --------------------------------------------------------------------------------------
# Exporters
# --------------------------------------------------------------------------------------


def export_torchscript(model, args, spec, outs, path):
    import torch

    in_names = [s[0] for s in spec]
    dyn = {n: {0: "batch"} for n in in_names + outs}
    torch.onnx.export(
        model,
        args,
        path,
        dynamo=False,
        opset_version=TORCHSCRIPT_OPSET,
        training=torch.onnx.TrainingMode.TRAINING,
        do_constant_folding=False,
        input_names=in_names,
        output_names=outs,
        dynamic_axes=dyn,
    )
    import onnx

    return onnx.load(path)


def export_dynamo(model, args, spec, outs):
    """Dynamo (torch.export) exporter, model in train mode.

    We export with optimize=False and then run the onnxscript optimizer passes ourselves,
    with two changes from the default optimize=True pipeline, so that the graph initializers stay
    exactly the model's parameters/buffers (as in the TorchScript files):
      * constant folding is disabled for any node that consumes a parameter/buffer
        (the default would e.g. fold the position-embedding Gather of GPT-2);
      * the BatchNormalization->Conv fusion rewrite is dropped (the default folds BN away).
    The "remove all-zero optional bias" rewrite is value dependent (GPT-2 biases are zero at init),
    so before exporting every floating parameter/buffer is refilled with random non-zero values
    (values are irrelevant: the committed files are shape-only).
    Finally every initializer that is not a parameter/buffer (folded shape constants, masks) is
    turned back into a Constant node, and torch metadata_props are stripped (file size).
    """
    import torch
    import onnx
    import onnx_ir as ir
    import onnx_ir.passes.common as cp
    from onnxscript import rewriter
    from onnxscript.optimizer import _constant_folding
    from onnxscript.rewriter import _fuse_batchnorm

    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_floating_point():
                t.copy_(torch.rand(t.shape, generator=g) * 0.5 + 0.25)

    in_names = [s[0] for s in spec]
    batch = torch.export.Dim("batch")
    dynamic_shapes = tuple({0: batch} for _ in spec)
    prog = torch.onnx.export(
        model,
        args,
        None,
        dynamo=True,
        input_names=in_names,
        output_names=outs,
        dynamic_shapes=dynamic_shapes,
        external_data=False,
        optimize=False,
    )
    irm = prog.model
    pnames = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    pnames |= {n for n, _ in model.named_buffers(remove_duplicate=False)}

    def should_fold(node):
        if node.op_type in ("Shape", "Size"):
            return None
        for v in node.inputs:
            if v is not None and v.is_initializer() and v.name in pnames:
                return False
        return None

    rules = [r for r in rewriter._DEFAULT_REWRITE_RULES if r not in _fuse_batchnorm.rules]
    passes = ir.passes.Sequential(
        cp.InlinePass(),
        ir.passes.PassManager(
            [
                _constant_folding.FoldConstantsPass(
                    shape_inference=True,
                    input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                    output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
                    should_fold=should_fold,
                ),
                rewriter.RewritePass(rules),
                cp.RemoveUnusedNodesPass(),
                cp.RemoveUnusedFunctionsPass(),
                cp.RemoveUnusedOpsetsPass(),
            ],
            steps=2,
            early_stop=True,
        ),
        cp.RemoveUnusedNodesPass(),
        cp.CommonSubexpressionEliminationPass(),
        cp.NameFixPass(),
    )
    passes(irm)
    mp = ir.serde.serialize_model(irm)

    # non-parameter initializers -> Constant nodes at the start of the graph
    keep, consts = [], []
    for init in mp.graph.initializer:
        if init.name in pnames:
            keep.append(init)
        else:
            t = onnx.TensorProto()
            t.CopyFrom(init)
            consts.append(onnx.helper.make_node("Constant", [], [init.name], value=t, name="const_" + init.name))
    gi_names = {i.name for i in mp.graph.input}
    assert not (gi_names & {c.output[0] for c in consts})
    del mp.graph.initializer[:]
    mp.graph.initializer.extend(keep)
    nodes = consts + list(mp.graph.node)
    del mp.graph.node[:]
    mp.graph.node.extend(nodes)

    def strip(msg_list):
        for x in msg_list:
            del x.metadata_props[:]

    del mp.metadata_props[:]
    strip(mp.graph.node)
    strip(mp.graph.input)
    strip(mp.graph.output)
    strip(mp.graph.value_info)
    strip(mp.graph.initializer)
    onnx.checker.check_model(mp)
    return mp


def clear_initializer_data(mp):
    """Shape-only: keep name/dims/data_type of every initializer, drop the data."""
    for t in mp.graph.initializer:
        for f in (
            "raw_data",
            "float_data",
            "int32_data",
            "int64_data",
            "double_data",
            "uint64_data",
            "string_data",
            "external_data",
            "data_location",
        ):
            t.ClearField(f)


# --------------------------------------------------------------------------------------
# Checks / reporting
# --------------------------------------------------------------------------------------


def numel(dims):
    n = 1
    for d in dims:
        n *= int(d)
    return n


def torch_dtype_str(t):
    return str(t.dtype).replace("torch.", "")


def torch_counts(model):
    params = sum(p.numel() for p in model.parameters())
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    fb = [b for b in model.buffers() if b.is_floating_point()]
    nfb = [b for b in model.buffers() if not b.is_floating_point()]
    buffers = sum(b.numel() for b in fb)
    bbytes = sum(b.numel() * b.element_size() for b in fb)
    return {
        "params_count": params + buffers,
        "params_bytes": pbytes + bbytes,
        "trainable_params_count": params,
        "buffers_count": buffers,
        "nonfloat_buffers_count": sum(b.numel() for b in nfb),
    }


def onnx_init_stats(mp):
    fl = [t for t in mp.graph.initializer if t.data_type in _float_types()]
    return {
        "onnx_initializers": len(mp.graph.initializer),
        "onnx_float_initializer_count": sum(numel(t.dims) for t in fl),
        "onnx_nonfloat_initializer_count": sum(
            numel(t.dims) for t in mp.graph.initializer if t.data_type not in _float_types()
        ),
    }


def run_outputs(model, make_inputs, batch, values=None):
    import torch

    with torch.no_grad():
        torch.manual_seed(0)
        out = model(*make_inputs(batch))
    if not isinstance(out, (tuple, list)):
        out = (out,)
    if values is not None:
        values[batch] = [o.numpy() for o in out]
    return [(list(o.shape), torch_dtype_str(o)) for o in out]


def ort_check(mp, make_inputs, spec, expected, values=None):
    """Run the (still weight-carrying) model with onnxruntime at the given batches and compare output
    shapes with PyTorch's. Returns a short status string."""
    try:
        import onnxruntime as ort
    except ImportError:
        return "skipped (onnxruntime not installed)"
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        sess = ort.InferenceSession(mp.SerializeToString(), so, providers=["CPUExecutionProvider"])
        for batch, exp in expected.items():
            feeds = {s[0]: t.numpy() for s, t in zip(spec, make_inputs(batch))}
            res = sess.run(None, feeds)
            got = [list(r.shape) for r in res]
            want = [e[0] for e in exp]
            if got != want:
                return f"MISMATCH at batch {batch}: ort {got} vs torch {want}"
            if values is not None and batch in values:
                diff = max(float(abs(r - v).max()) for r, v in zip(res, values[batch]))
                if diff > 1e-4:
                    return f"VALUE MISMATCH at batch {batch}: max abs diff {diff}"
                values["maxdiff"] = max(values.get("maxdiff", 0.0), diff)
        msg = "ok (batches %s" % ",".join(str(b) for b in expected)
        if values is not None and "maxdiff" in values:
            msg += "; values match torch, max abs diff %.2g" % values["maxdiff"]
        return msg + ")"
    except Exception as e:  # noqa: BLE001
        return "ort failed: %s" % (str(e).splitlines()[0][:300])


def dims_str(vi):
    tt = vi.type.tensor_type
    ds = []
    for d in tt.shape.dim:
        if d.HasField("dim_param"):
            ds.append(repr(d.dim_param))
        elif d.HasField("dim_value"):
            ds.append(str(d.dim_value))
        else:
            ds.append("?")
    import onnx

    return "%s[%s]" % (onnx.TensorProto.DataType.Name(tt.elem_type), ", ".join(ds))


def _attr_value(a):
    import onnx

    v = onnx.helper.get_attribute_value(a)
    if isinstance(v, onnx.TensorProto):
        return "tensor(%s%s)" % (onnx.TensorProto.DataType.Name(v.data_type), list(v.dims))
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, list):
        return [x.decode() if isinstance(x, bytes) else x for x in v]
    return v


def describe(name, mp):
    """Text block for /tmp/optypes.txt."""
    import onnx

    lines = [f"=== {name} ==="]
    lines.append("ir_version %d; opset_import %s" % (mp.ir_version, [(o.domain or "ai.onnx", o.version) for o in mp.opset_import]))
    lines.append("producer %s %s" % (mp.producer_name, mp.producer_version))
    for vi in mp.graph.input:
        lines.append("  input  %s: %s" % (vi.name, dims_str(vi)))
    for vi in mp.graph.output:
        lines.append("  output %s: %s" % (vi.name, dims_str(vi)))
    st = onnx_init_stats(mp)
    lines.append(
        "  initializers: %d (float numel %d, non-float numel %d); value_info entries: %d; nodes: %d"
        % (st["onnx_initializers"], st["onnx_float_initializer_count"], st["onnx_nonfloat_initializer_count"], len(mp.graph.value_info), len(mp.graph.node))
    )
    hist = collections.Counter(f"{n.domain or 'ai.onnx'}:{n.op_type}" for n in mp.graph.node)
    lines.append("  op histogram:")
    for k, v in sorted(hist.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"    {v:5d} {k}")
    # per op type: arity variants and attribute values seen
    lines.append("  per-op inputs/outputs arity and attributes (distinct values, truncated):")
    by_op = collections.OrderedDict()
    for n in mp.graph.node:
        d = by_op.setdefault(n.op_type, {"arity": collections.Counter(), "attrs": collections.OrderedDict()})
        d["arity"]["%d->%d" % (len(n.input), len(n.output))] += 1
        for a in n.attribute:
            vals = d["attrs"].setdefault(a.name, [])
            s = repr(_attr_value(a))
            if s not in vals:
                vals.append(s)
    for op in sorted(by_op):
        d = by_op[op]
        ar = ", ".join(f"{k} x{v}" for k, v in sorted(d["arity"].items()))
        lines.append(f"    {op}: inputs->outputs {ar}")
        for an, vals in d["attrs"].items():
            shown = vals[:8]
            more = "" if len(vals) <= 8 else f" ... (+{len(vals) - 8} more)"
            lines.append(f"        {an}: {'; '.join(shown)}{more}")
    used = {i for n in mp.graph.node for i in n.input} | {o.name for o in mp.graph.output}
    dangling = collections.Counter(
        f"{n.op_type} output#{k}" for n in mp.graph.node for k, o in enumerate(n.output) if o and o not in used
    )
    if dangling:
        lines.append("  unused node outputs: %s" % dict(dangling))
    init_names = {t.name for t in mp.graph.initializer}
    consumers = collections.Counter(n.op_type for n in mp.graph.node for i in n.input if i in init_names)
    lines.append("  initializer uses by consumer op type: %s" % dict(sorted(consumers.items())))
    # empty-string inputs (omitted optional inputs)
    opt = collections.Counter(n.op_type for n in mp.graph.node if any(i == "" for i in n.input))
    if opt:
        lines.append("  nodes with omitted optional inputs (''): %s" % dict(opt))
    # Dropout / BatchNormalization details matter for training-memory modelling
    const_vals = {}
    for n in mp.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            t = n.attribute[0].t
            if numel(t.dims) <= 4:
                try:
                    const_vals[n.output[0]] = onnx.numpy_helper.to_array(t).tolist()
                except Exception:  # noqa: BLE001
                    pass
    drop = collections.Counter()
    for n in mp.graph.node:
        if n.op_type == "Dropout":
            ratio = const_vals.get(n.input[1], "?") if len(n.input) > 1 and n.input[1] else "default(0.5)"
            tm = const_vals.get(n.input[2], "?") if len(n.input) > 2 and n.input[2] else "absent(=false)"
            drop["ratio=%s training_mode=%s outputs=%d" % (ratio, tm, len(n.output))] += 1
    for k, v in drop.items():
        lines.append(f"  Dropout variant: {k}  x{v}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# Main export
# --------------------------------------------------------------------------------------


def export_one(name, log):
    import onnx
    import torch

    exporter, shape_only = MODELS[name]
    model, make_inputs, spec, outs = build(name)
    counts = torch_counts(model)
    args = make_inputs(BATCH)
    t0 = time.time()
    if exporter == "torchscript":
        with tempfile.TemporaryDirectory() as td:
            mp = export_torchscript(model, args, spec, outs, os.path.join(td, name + ".onnx"))
        opset = TORCHSCRIPT_OPSET
    else:
        mp = export_dynamo(model, args, spec, outs)
        opset = [o.version for o in mp.opset_import if o.domain in ("", "ai.onnx")][0]
    t_export = time.time() - t0

    onnx_out_names = [o.name for o in mp.graph.output]
    # outputs are only value-comparable when the graph is deterministic (no Dropout) and has real weights
    deterministic = not shape_only and not any(n.op_type == "Dropout" for n in mp.graph.node)
    values = {} if deterministic else None
    ref_out = {b: run_outputs(model, make_inputs, b, values) for b in (BATCH, 3)}
    ort_status = ort_check(mp, make_inputs, spec, ref_out, values)

    st = onnx_init_stats(mp)
    # name-level check: initializers == parameters + floating buffers
    expected_names = {n for n, _ in model.named_parameters()} | {
        n for n, b in model.named_buffers() if b.is_floating_point()
    }
    init_names = {t.name for t in mp.graph.initializer}
    name_check = {
        "params_not_in_onnx": sorted(expected_names - init_names)[:10],
        "onnx_not_params": sorted(init_names - expected_names)[:10],
    }
    if shape_only:
        clear_initializer_data(mp)
    path = os.path.join(HERE, name + ".onnx")
    onnx.save(mp, path)
    size = os.path.getsize(path)

    entry = {
        "exporter": exporter,
        "opset": opset,
        **{k: counts[k] for k in ("params_count", "params_bytes", "trainable_params_count", "buffers_count")},
        "nonfloat_buffers_count": counts["nonfloat_buffers_count"],
        "batch": BATCH,
        "inputs": [
            {"name": s[0], "shape": [BATCH] + s[2], "dtype": s[1]} for s in spec
        ],
        "outputs": [
            {"name": n, "shape": sh, "dtype": dt} for n, (sh, dt) in zip(onnx_out_names, ref_out[BATCH])
        ],
        "inputs_batch3": [{"name": s[0], "shape": [3] + s[2], "dtype": s[1]} for s in spec],
        "outputs_batch3": [
            {"name": n, "shape": sh, "dtype": dt} for n, (sh, dt) in zip(onnx_out_names, ref_out[3])
        ],
        "shape_only": shape_only,
        "onnx_float_initializer_count": st["onnx_float_initializer_count"],
        "onnx_initializers": st["onnx_initializers"],
        "onnx_nodes": len(mp.graph.node),
        "file_bytes": size,
    }
    ok = st["onnx_float_initializer_count"] == counts["params_count"]
    log(
        f"{name}: {exporter} opset {opset} export {t_export:.1f}s size {size} bytes; "
        f"torch params+fbuffers {counts['params_count']} onnx float init {st['onnx_float_initializer_count']} "
        f"{'OK' if ok else 'MISMATCH (%+d)' % (st['onnx_float_initializer_count'] - counts['params_count'])}; "
        f"names {name_check}; ort {ort_status}"
    )
    entry["check"] = {
        "float_initializers_equal_params": ok,
        "ort_runs_batch2_and_3": ort_status,
    }
    return entry, describe(name, mp)


OPTYPES_HEADER = """# Op-type report for models/*.onnx, written by `python models/export.py` (versions: %s)
# Per model: opset, graph inputs/outputs with dims ('name' = dim_param, number = dim_value),
# initializer stats, op histogram (domain:op_type), and per op type the inputs->outputs arity
# variants and the distinct attribute values used.
# General notes:
#  * TorchScript files (opset 17): Dropout is always 3->2 (data, ratio Constant, training_mode
#    Constant true) -> (output, mask BOOL); BatchNormalization has training_mode=1 and 5->3
#    (Y, running_mean, running_var outputs; the last two are unused). No value_info in the files.
#    nn.Linear on >2-D inputs = Transpose(weight, perm [1,0]) + MatMul + Add (so weights are consumed
#    through Transpose nodes), on 2-D inputs = Gemm transB=1; GPT-2's Conv1D = Gemm without transB.
#    GPT-2's tied lm_head is Transpose(transformer.wte.weight) + MatMul (wte also feeds the Gather).
#  * Dynamo files (opset 20, ir_version 10): BatchNormalization is INFERENCE mode (no
#    training_mode attribute, 5->1) even though the model was exported in train mode (torch-onnx
#    limitation), Dropout is 3->1 with training_mode Constant true. value_info is present for
#    every intermediate tensor.
#  * Shape-only files: initializers have name/dims/data_type but no data (onnx.checker rejects
#    them: "should contain one and only one value field"); onnx.shape_inference works on them.
#  * Graph-output dims named like 'MatMullogits_dim_1' are the TorchScript exporter's own
#    symbolic names for dims it could not infer; PyTorch's real shapes are in models/reference.json.

"""


def write_big(path, gb):
    """~gb GiB ONNX MLP with inline weights, built directly with onnx.helper."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    hidden = 4096
    layer_bytes = hidden * hidden * 4
    n_layers = max(1, round(gb * (1 << 30) / layer_bytes))
    rng = np.random.default_rng(0)
    inits, nodes = [], []
    x = "input"
    for i in range(n_layers):
        w = (rng.standard_normal((hidden, hidden), dtype=np.float32) * 0.01)
        b = np.zeros((hidden,), dtype=np.float32)
        inits.append(helper.make_tensor(f"fc{i}.weight", TensorProto.FLOAT, w.shape, w.tobytes(), raw=True))
        inits.append(helper.make_tensor(f"fc{i}.bias", TensorProto.FLOAT, b.shape, b.tobytes(), raw=True))
        del w
        nodes.append(helper.make_node("MatMul", [x, f"fc{i}.weight"], [f"mm{i}"], name=f"MatMul_{i}"))
        nodes.append(helper.make_node("Add", [f"mm{i}", f"fc{i}.bias"], [f"add{i}"], name=f"Add_{i}"))
        if i < n_layers - 1:
            nodes.append(helper.make_node("Relu", [f"add{i}"], [f"relu{i}"], name=f"Relu_{i}"))
            x = f"relu{i}"
        else:
            nodes[-1].output[0] = "output"
    graph = helper.make_graph(
        nodes,
        "big_mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", hidden])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", hidden])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="memplan-export-big")
    onnx.save(model, path)  # inline (no external data); must stay < 2 GiB
    print(f"wrote {path}: {n_layers} x Linear({hidden},{hidden}), {os.path.getsize(path)} bytes, "
          f"{n_layers * (hidden * hidden + hidden)} params")


def versions():
    import onnx
    import torch

    v = {"python": sys.version.split()[0], "torch": torch.__version__, "onnx": onnx.__version__}
    for mod in ("torchvision", "transformers", "onnxscript", "onnxruntime"):
        try:
            v[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big", metavar="PATH", help="write a large inline-weight ONNX MLP to PATH and exit")
    ap.add_argument("--gb", type=float, default=1.0, help="size of --big model in GiB (default 1.0, max ~1.9)")
    ap.add_argument("--only", help="comma-separated subset of: " + ",".join(MODELS))
    ap.add_argument("--optypes", default="/tmp/optypes.txt", help="where to write the op-type report")
    a = ap.parse_args()

    if a.big:
        if a.gb > 1.9:
            ap.error("--gb must be < 1.9 (inline protobuf limit is 2 GiB)")
        write_big(a.big, a.gb)
        return

    import warnings

    warnings.filterwarnings("ignore")
    names = list(MODELS) if not a.only else a.only.split(",")
    ref_path = os.path.join(HERE, "reference.json")
    ref = {}
    if a.only and os.path.exists(ref_path):
        with open(ref_path) as f:
            ref = json.load(f)
    ref["_meta"] = {"generated_by": "python models/export.py", "versions": versions()}
    descs = {}
    if a.only and os.path.exists(a.optypes):
        # keep blocks of models not regenerated
        with open(a.optypes) as f:
            cur = None
            for line in f:
                if line.startswith("=== ") and line.rstrip().endswith(" ==="):
                    cur = line.strip()[4:-4]
                    descs[cur] = ""
                if cur:
                    descs[cur] += line

    def log(msg):
        print(msg, flush=True)

    for name in names:
        entry, desc = export_one(name, log)
        ref[name] = entry
        descs[name] = desc + "\n"
        with open(a.optypes, "w") as f:
            f.write(OPTYPES_HEADER % json.dumps(ref["_meta"]["versions"]))
            for n in MODELS:
                if n in descs:
                    f.write(descs[n])
        ordered = {"_meta": ref["_meta"]}
        ordered.update({n: ref[n] for n in MODELS if n in ref})
        with open(ref_path, "w") as f:
            json.dump(ordered, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
