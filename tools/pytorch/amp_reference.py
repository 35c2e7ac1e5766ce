#!/usr/bin/env python3
"""What PyTorch saves for backward under CUDA autocast (fp16 and bf16), measured without a GPU
(dev-time tool, not needed to build memplan).

Usage:
    python tools/pytorch/amp_reference.py                      # every model of export.py with an .onnx in models/
    python tools/pytorch/amp_reference.py --only gpt2,vit_b_16 # a subset (entries merged into the output)
    options: --batches 2,4  --out PATH (default tests/data/pytorch/amp_reference.json)

How: the model export.py builds (the same construction and seed as its ONNX file) is moved to
*fake* CUDA tensors (torch._subclasses.FakeTensorMode: shapes, dtypes, strides and storages, no
data, no device), and one forward + loss (`out[0].mean()`, as training_reference.json's step) runs
under CUDA autocast, switched on at the C++ level (`torch.set_autocast_enabled("cuda", True)`,
since `torch.autocast` refuses without a device). Every op then dispatches as on a GPU: autocast's
CUDA cast lists, the weight-cast cache, CUDA's dropout (a boolean mask), BatchNorm's CUDA path.
A saved_tensors_hooks pack hook records every tensor autograd saves, deduplicated by storage;
storages of parameters and buffers are left out, the model's input is counted (the definition of
training_reference.json's `saved_bytes`). A graph walk from the loss attributes each storage to
the grad_fn and attribute that saved it (`saved_by`).

What is not PyTorch's own decision here:
* The SDPA kernel. On a CUDA device `scaled_dot_product_attention` picks its kernel from the
  device's properties, which fake tensors do not have (it falls back on the math path, which
  saves the probabilities). This script replaces F.scaled_dot_product_attention with the choice
  measured on an H200 (tools/gpu-sdpa-layout.py, docs/CUDA.md): half-precision inputs without a
  mask run cuDNN's kernel (`aten._scaled_dot_product_cudnn_attention`), everything else the
  memory-efficient kernel (`aten._scaled_dot_product_efficient_attention`, a boolean mask turned
  into a 0/-inf bias of the query's type, the bias padded to 16 columns and expanded, as
  attention.cpp does). Autocast's cast of the call's floating inputs (SDPA is on CUDA's
  lower-precision list) is done by the replacement too. The two kernels' RNG seed and offset
  (0-d int64) are not counted: PyTorch allocates them empty without dropout.
* Nothing is timed and no peak is measured (fake tensors allocate nothing).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODELS = os.path.join(ROOT, "models")  # the ONNX files and export.py
DATA = os.path.join(ROOT, "tests", "data", "pytorch")  # the references tests compare with
sys.path.insert(0, MODELS)

import export  # noqa: E402


# Models whose CUDA path needs the device itself: nn.LSTM / nn.GRU / nn.RNN take cuDNN's
# RNN, which queries the device even on fake tensors.
RNN_MODELS = {
    n: "not measured: nn.LSTM / nn.GRU / nn.RNN take cuDNN's RNN on CUDA, which queries the "
    "device even on fake tensors (here: 'CUDA driver version is insufficient')"
    for n in ("lstm_lm", "gru_classifier", "rnn_tagger")
}


def _sdpa_as_on_h200(orig):
    import torch

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.device.type != "cuda":
            return orig(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if torch.is_autocast_enabled("cuda"):
            half = torch.get_autocast_dtype("cuda")

            def cast(t):
                ok = t is not None and t.is_floating_point() and t.dtype != torch.float64
                return t.to(half) if ok else t

            query, key, value, attn_mask = cast(query), cast(key), cast(value), cast(attn_mask)
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            rep = query.shape[-3] // key.shape[-3]
            key = key.repeat_interleave(rep, dim=-3)
            value = value.repeat_interleave(rep, dim=-3)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        half_in = query.dtype in (torch.float16, torch.bfloat16)
        if attn_mask is None and half_in:
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(
                query, key, value, None, grad, dropout_p, is_causal, False, scale=scale
            )
            return out[0]
        bias = attn_mask
        if bias is not None:
            if bias.dtype == torch.bool:
                bias = torch.where(bias.logical_not(), float("-inf"), 0.0).to(query.dtype)
            last = bias.shape[-1]
            if last % 16:
                bias = torch.nn.functional.pad(bias, (0, 16 - last % 16))[..., :last]
            b, h, sq, sk = query.shape[0], query.shape[-3], query.shape[-2], key.shape[-2]
            bias = bias.expand(b, h, sq, sk)
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, grad, dropout_p, is_causal, scale=scale
        )
        return out[0]

    return sdpa


def measure(name, batch, dtype):
    """measure_model on export.py's model `name` at `batch`."""
    model, make_inputs, spec, outs = export.build(name)
    return measure_model(model, make_inputs(batch), dtype)


def measure_model(model, inputs, dtype):
    """What one forward + loss of `model` (train mode, on CPU) on `inputs` saves under CUDA
    autocast to `dtype`, on fake CUDA tensors (the module docstring)."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    orig = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _sdpa_as_on_h200(orig)
    stor = collections.OrderedDict()  # storage key -> (bytes, dtype)
    keep = []
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = model.to("cuda")
            inputs = tuple(x.to("cuda") for x in inputs)
            params = list(model.parameters()) + list(model.buffers())
            excl = {t.untyped_storage()._cdata for t in params}

            def pack(t):
                st = t.untyped_storage()
                k = st._cdata
                if k not in excl and k not in stor and not (t.dim() == 0 and t.dtype == torch.int64):
                    stor[k] = (st.nbytes(), str(t.dtype).replace("torch.", ""))
                keep.append(t)
                return t

            torch.manual_seed(export.TRAIN_SEED)
            torch.set_autocast_enabled("cuda", True)
            torch.set_autocast_dtype("cuda", dtype)
            torch.autocast_increment_nesting()
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = model(*inputs)
                    if hasattr(out, "to_tuple"):
                        out = out.to_tuple()
                    outs_l = list(out) if isinstance(out, (tuple, list)) else [out]
                    first = outs_l[0]
                    loss = first if getattr(model, "_memplan_graph_loss", False) else first.mean()
            finally:
                torch.autocast_decrement_nesting()
                torch.set_autocast_enabled("cuda", False)
                torch.clear_autocast_cache()
            by = collections.Counter()
            owner = {}
            seen = set()
            roots = [loss.grad_fn] + [o.grad_fn for o in outs_l[1:] if isinstance(o, torch.Tensor)]
            queue = collections.deque(r for r in roots if r is not None)
            while queue:
                node = queue.popleft()
                if node in seen:
                    continue
                seen.add(node)
                for a in sorted(a for a in dir(node) if a.startswith("_saved_")):
                    try:
                        v = getattr(node, a)
                    except Exception:  # noqa: BLE001
                        continue
                    for t in v if isinstance(v, (tuple, list)) else [v]:
                        if isinstance(t, torch.Tensor):
                            k = t.untyped_storage()._cdata
                            if k in stor and k not in owner:
                                owner[k] = "%s.%s %s" % (type(node).__name__, a, stor[k][1])
                queue.extend(f for f, _ in node.next_functions if f is not None)
            for k, (nb, dt) in stor.items():
                by[owner.get(k, "unattributed %s" % dt)] += nb
            by_dtype = collections.Counter()
            for nb, dt in stor.values():
                by_dtype[dt] += nb
    finally:
        F.scaled_dot_product_attention = orig
    return {
        "loss": "graph" if getattr(model, "_memplan_graph_loss", False) else "mean",
        "saved_bytes": sum(nb for nb, _ in stor.values()),
        "saved_tensors": len(stor),
        "saved_by_dtype": dict(sorted(by_dtype.items())),
        "saved_by": dict(sorted(by.items(), key=lambda kv: (-kv[1], kv[0]))),
    }


def main():
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="")
    ap.add_argument("--batches", default="2,4")
    ap.add_argument("--out", default=os.path.join(DATA, "amp_reference.json"))
    a = ap.parse_args()
    names = [n for n in export.MODELS if os.path.exists(os.path.join(MODELS, n + ".onnx"))]
    if a.only:
        names = [n for n in a.only.split(",") if n]
    res = {}
    if os.path.exists(a.out):
        with open(a.out) as f:
            res = json.load(f)
    res["_meta"] = {
        "generated_by": "python tools/pytorch/amp_reference.py",
        "versions": {"torch": torch.__version__},
        "definition": __doc__.split("How: ")[1].split("\n\n")[0].replace("\n", " "),
        "sdpa": "as measured on an H200: half without a mask -> cuDNN's kernel; otherwise the "
        "memory-efficient kernel (see this script's docstring)",
    }
    for name in names:
        entry = {}
        for batch in [int(b) for b in a.batches.split(",")]:
            for label, dt in (("amp-fp16", torch.float16), ("amp-bf16", torch.bfloat16)):
                try:
                    entry.setdefault("batch_%d" % batch, {})[label] = measure(name, batch, dt)
                except Exception as e:  # noqa: BLE001
                    entry = {"error": "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:300])}
                    break
            if "error" in entry:
                break
        if "error" in entry and name in RNN_MODELS:
            entry["error"] = RNN_MODELS[name]
        res[name] = entry
        print(name, entry.get("error") or {b: {k: v["saved_bytes"] for k, v in e.items()} for b, e in entry.items()},
              flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1, sort_keys=False)
        f.write("\n")


if __name__ == "__main__":
    main()
