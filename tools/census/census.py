#!/usr/bin/env python3
"""Census of whole model families: export every torchvision model and a list of transformers
architectures (small configs), run memplan on each, compare a sample with PyTorch.

Dev-time tool (memplan never needs Python). Run from anywhere; paths are relative to the repo.

    PY=/work/venv/bin/python
    $PY tools/census/census.py export            # build + export every model (skips cached ones)
    $PY tools/census/census.py profile           # memplan profile --batch 2 --train on every export
    $PY tools/census/census.py measure           # PyTorch saved bytes + CPU step peak (sample)
    $PY tools/census/census.py report            # docs/CENSUS.md + tools/census/results.json
    $PY tools/census/census.py subset            # copy the CI subset to models/census/ + manifest
    $PY tools/census/census.py cse-check         # re-export CSE_CHECK models without the exporter's CSE
    $PY tools/census/census.py dynamo-check      # the sample through the dynamo exporter
    $PY tools/census/census.py all               # export, profile, measure, report, subset

Options: --only a,b,c (model names), --subset (only the CI subset), --cache DIR
(default target/census), --memplan PATH (default target/release/memplan), --timeout S
(memplan, default 120), --export-timeout S (default 1800), --force (redo cached exports /
measurements).

After memplan is rebuilt, only `profile` and `report` need rerunning (a few minutes):

    $PY tools/census/census.py profile && $PY tools/census/census.py report

Layout of the cache (not committed): <cache>/onnx/<name>.onnx (shape-only exports),
<cache>/export/<name>.json (export status), <cache>/profile.json (memplan results).
PyTorch measurements are committed in tools/census/measure.json (slow to redo); the
report's inputs and outputs are committed in tools/census/results.json.

Export conventions are those of models/export.py (whose functions are imported, not copied):
model.train(), TorchScript exporter, opset 17, TrainingMode.TRAINING, do_constant_folding=False,
dynamic batch named "batch" on every input and output, initializer data cleared afterwards
(shape-only: name, dims, data_type kept). Random init, torch.manual_seed(0), nothing downloaded.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODELS_DIR = os.path.join(ROOT, "models")
DEFAULT_CACHE = os.path.join(ROOT, "target", "census")
DEFAULT_MEMPLAN = os.path.join(ROOT, "target", "release", "memplan")
RESULTS = os.path.join(HERE, "results.json")
CSE_CHECK_JSON = os.path.join(HERE, "cse_check.json")
DYNAMO_CHECK_JSON = os.path.join(HERE, "dynamo_check.json")
# Sample models whose export merges computations PyTorch runs twice (the TorchScript exporter's
# common-subexpression elimination): re-exported without it by `cse-check`.
CSE_CHECK = ("hf_deberta", "hf_gptj", "hf_codegen")
MEASURE = os.path.join(HERE, "measure.json")
DOC = os.path.join(ROOT, "docs", "CENSUS.md")
SUBSET_DIR = os.path.join(MODELS_DIR, "census")

PROFILE_BATCH = 2
MEMPLAN_ARGS = ["--batch", str(PROFILE_BATCH), "--train", "--optimizer", "sgd", "--json"]
MEASURE_BATCHES = (1, 4)
# PyTorch refuses batch 1 in train mode (BatchNorm over a 1x1 map: inception aux head, ASPP pooling)
MEASURE_BATCHES_OVERRIDE = {"inception_v3": (2, 4), "deeplabv3_mobilenet_v3_large": (2, 4)}


def measure_batches(name):
    return MEASURE_BATCHES_OVERRIDE.get(name, MEASURE_BATCHES)


def all_measure_batches():
    return sorted({b for bs in [MEASURE_BATCHES] + list(MEASURE_BATCHES_OVERRIDE.values()) for b in bs})
OPSET = 17
SEQ = 32  # transformers sequence length
VOCAB = 1000

# --------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------

Entry = collections.namedtuple("Entry", "name suite family kind spec")
# spec: dict with the builder's parameters (json-serialisable)

TV_FAMILY_RULES = [
    (r"^efficientnet_v2_", "efficientnet_v2"),
    (r"^efficientnet_b", "efficientnet"),
    (r"^regnet_x_", "regnet_x"),
    (r"^regnet_y_", "regnet_y"),
    (r"^swin_v2_", "swin_v2"),
    (r"^swin3d_", "swin3d"),
    (r"^swin_", "swin"),
    (r"^vgg\d+_bn$", "vgg_bn"),
    (r"^vgg\d+$", "vgg"),
    (r"^wide_resnet", "wide_resnet"),
    (r"^resnext", "resnext"),
    (r"^resnet", "resnet"),
    (r"^densenet", "densenet"),
    (r"^convnext_", "convnext"),
    (r"^mnasnet", "mnasnet"),
    (r"^mobilenet_v3_", "mobilenet_v3"),
    (r"^mobilenet_v2$", "mobilenet_v2"),
    (r"^shufflenet_v2_", "shufflenet_v2"),
    (r"^squeezenet", "squeezenet"),
    (r"^vit_", "vit"),
    (r"^inception_v3$", "inception_v3"),
    (r"^(mc3_18|r3d_18|r2plus1d_18)$", "video_resnet"),
    (r"^mvit_", "mvit"),
    (r"^deeplabv3_", "deeplabv3"),
    (r"^fcn_", "fcn"),
    (r"^lraspp_", "lraspp"),
    (r"^fasterrcnn_", "fasterrcnn"),
    (r"^maskrcnn_", "maskrcnn"),
    (r"^keypointrcnn_", "keypointrcnn"),
    (r"^retinanet_", "retinanet"),
    (r"^fcos_", "fcos"),
    (r"^ssdlite", "ssdlite"),
    (r"^ssd\d", "ssd"),
    (r"^raft_", "raft"),
]


def tv_family(name):
    for pat, fam in TV_FAMILY_RULES:
        if re.search(pat, name):
            return fam
    return name


# Exported last (large: minutes each and GiBs of memory while exporting).
TV_HEAVY = [
    "vit_h_14", "regnet_y_128gf", "vit_l_16", "vit_l_32", "regnet_y_32gf", "regnet_x_32gf",
    "efficientnet_b7", "efficientnet_v2_l", "convnext_large", "swin_v2_b", "swin3d_b", "vgg19_bn",
    "vgg19", "vgg16_bn", "vgg16", "efficientnet_b6", "regnet_y_16gf", "regnet_x_16gf",
]


def _tv_spec(module, name):
    if module == "classification":
        size = {"inception_v3": 299, "googlenet": 256}.get(name, 224)
        return {"tv_module": module, "input": [3, size, size]}
    if module == "segmentation":
        return {"tv_module": module, "input": [3, 224, 224]}
    if module == "video":
        if name.startswith("mvit") or name == "s3d":
            return {"tv_module": module, "input": [3, 16, 224, 224]}
        return {"tv_module": module, "input": [3, 16, 112, 112]}
    if module == "detection":
        return {"tv_module": module, "input": [3, 320, 320]}
    if module == "optical_flow":
        return {"tv_module": module, "input": [3, 128, 128], "two_images": True}
    raise KeyError(module)


def torchvision_entries():
    import torchvision.models as M
    from torchvision.models import list_models

    out = []
    for module, suite in (
        ("classification", "torchvision"),
        ("segmentation", "torchvision"),
        ("video", "torchvision"),
        ("detection", "torchvision-detection"),
        ("optical_flow", "torchvision-detection"),
    ):
        mod = M if module == "classification" else getattr(M, module)
        for n in list_models(module=mod):
            out.append(Entry(n, suite, tv_family(n), module, _tv_spec(module, n)))
    return out


# transformers: arch -> (kind, head, config kwargs)
_DEC = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
            max_position_embeddings=128)
_ENC = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
            max_position_embeddings=128)
_BART = dict(d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256, max_position_embeddings=128)
_T5 = dict(d_model=128, d_ff=256, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=32)
_IMG = dict(image_size=64, patch_size=8, num_channels=3, hidden_size=128, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=256)

HF_ARCHS = collections.OrderedDict([
    # encoders (masked LM head)
    ("bert", ("encoder", "mlm", dict(_ENC))),
    ("roberta", ("encoder", "mlm", dict(_ENC, max_position_embeddings=130))),
    ("distilbert", ("encoder", "mlm", dict(dim=128, n_layers=2, n_heads=4, hidden_dim=256, max_position_embeddings=128))),
    ("albert", ("encoder", "mlm", dict(_ENC, embedding_size=64))),
    ("electra", ("encoder", "mlm", dict(_ENC, embedding_size=128))),
    ("deberta", ("encoder", "mlm", dict(_ENC))),
    ("deberta-v2", ("encoder", "mlm", dict(_ENC))),
    ("xlm-roberta", ("encoder", "mlm", dict(_ENC, max_position_embeddings=130))),
    ("megatron-bert", ("encoder", "mlm", dict(_ENC))),
    ("mpnet", ("encoder", "mlm", dict(_ENC, max_position_embeddings=130))),
    ("camembert", ("encoder", "mlm", dict(_ENC, max_position_embeddings=130))),
    ("ernie", ("encoder", "mlm", dict(_ENC))),
    # decoders (causal LM head)
    ("gpt2", ("decoder", "clm", dict(n_embd=128, n_layer=2, n_head=4, n_inner=256, n_positions=128))),
    ("gpt_neo", ("decoder", "clm", dict(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=256,
                                          max_position_embeddings=128, attention_types=[[["global", "local"], 1]],
                                          window_size=16))),
    ("gpt_neox", ("decoder", "clm", dict(_DEC))),
    ("gptj", ("decoder", "clm", dict(n_embd=128, n_layer=2, n_head=4, n_inner=256, n_positions=128, rotary_dim=16))),
    ("codegen", ("decoder", "clm", dict(n_embd=128, n_layer=2, n_head=4, n_inner=256, n_positions=128, n_ctx=128,
                                        rotary_dim=16))),
    ("llama", ("decoder", "clm", dict(_DEC, num_key_value_heads=2))),
    ("mistral", ("decoder", "clm", dict(_DEC, num_key_value_heads=2, head_dim=32))),
    ("mixtral", ("decoder", "clm", dict(_DEC, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                                        num_experts_per_tok=2))),
    ("qwen2", ("decoder", "clm", dict(_DEC, num_key_value_heads=2))),
    ("qwen3", ("decoder", "clm", dict(_DEC, num_key_value_heads=2, head_dim=32))),
    ("phi", ("decoder", "clm", dict(_DEC))),
    ("phi3", ("decoder", "clm", dict(_DEC, num_key_value_heads=2))),
    ("gemma", ("decoder", "clm", dict(_DEC, num_key_value_heads=2, head_dim=32))),
    ("gemma2", ("decoder", "clm", dict(_DEC, num_key_value_heads=2, head_dim=32, sliding_window=16,
                                       query_pre_attn_scalar=32))),
    ("stablelm", ("decoder", "clm", dict(_DEC, num_key_value_heads=2))),
    ("olmo", ("decoder", "clm", dict(_DEC, num_key_value_heads=2))),
    ("olmo2", ("decoder", "clm", dict(_DEC, num_key_value_heads=2))),
    ("starcoder2", ("decoder", "clm", dict(_DEC, num_key_value_heads=2))),
    ("granite", ("decoder", "clm", dict(_DEC, num_key_value_heads=2))),
    ("opt", ("decoder", "clm", dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, ffn_dim=256,
                                    max_position_embeddings=128, word_embed_proj_dim=128))),
    ("bloom", ("decoder", "clm", dict(hidden_size=128, n_layer=2, n_head=4))),
    ("falcon", ("decoder", "clm", dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4))),
    ("biogpt", ("decoder", "clm", dict(_ENC))),
    ("xglm", ("decoder", "clm", dict(d_model=128, num_layers=2, attention_heads=4, ffn_dim=256,
                                     max_position_embeddings=128))),
    # encoder-decoders (seq2seq LM head)
    ("bart", ("encoder-decoder", "s2s", dict(_BART))),
    ("mbart", ("encoder-decoder", "s2s", dict(_BART))),
    ("pegasus", ("encoder-decoder", "s2s", dict(_BART))),
    ("marian", ("encoder-decoder", "s2s", dict(_BART, decoder_vocab_size=VOCAB))),
    ("blenderbot", ("encoder-decoder", "s2s", dict(_BART))),
    ("blenderbot-small", ("encoder-decoder", "s2s", dict(_BART))),
    ("t5", ("encoder-decoder", "s2s", dict(_T5))),
    ("mt5", ("encoder-decoder", "s2s", dict(_T5))),
    # vision (image classification head), pixel_values [batch, 3, 64, 64]
    ("vit", ("vision", "img", dict(_IMG))),
    ("deit", ("vision", "img", dict(_IMG))),
    ("beit", ("vision", "img", dict(_IMG))),
    ("swin", ("vision", "img", dict(image_size=64, patch_size=4, num_channels=3, embed_dim=32, depths=[2, 2],
                                    num_heads=[2, 4], window_size=4))),
    ("convnext", ("vision", "img", dict(image_size=64, num_channels=3, hidden_sizes=[32, 64], depths=[1, 1],
                                        num_stages=2))),
])


HF_CLASS = {"deit": "DeiTForImageClassification"}


def hf_entries():
    out = []
    for arch, (kind, head, kw) in HF_ARCHS.items():
        out.append(Entry("hf_" + arch.replace("-", "_"), "transformers", arch, kind, {"arch": arch, "head": head, "config": kw}))
    return out


def all_entries():
    tv = torchvision_entries()
    heavy = {n: i for i, n in enumerate(TV_HEAVY)}
    tv_main = [e for e in tv if e.name not in heavy]
    tv_heavy = sorted((e for e in tv if e.name in heavy), key=lambda e: heavy[e.name])
    return hf_entries() + tv_main + tv_heavy


# One small model per family: committed (shape-only) in models/census/ for CI.
CI_SUBSET = [
    # torchvision classification
    "alexnet", "convnext_tiny", "densenet121", "efficientnet_b0", "efficientnet_v2_s", "googlenet",
    "inception_v3", "maxvit_t", "mnasnet0_5", "mobilenet_v2", "mobilenet_v3_small", "regnet_x_400mf",
    "regnet_y_400mf", "resnet18", "resnext50_32x4d", "shufflenet_v2_x0_5", "squeezenet1_1", "swin_t",
    "swin_v2_t", "vgg11", "vgg11_bn", "vit_b_32", "wide_resnet50_2",
    # segmentation
    "deeplabv3_mobilenet_v3_large", "fcn_resnet50", "lraspp_mobilenet_v3_large",
    # video
    "r3d_18", "mvit_v2_s", "s3d", "swin3d_t",
    # transformers
    "hf_bert", "hf_roberta", "hf_distilbert", "hf_albert", "hf_deberta_v2", "hf_gpt2", "hf_gpt_neox",
    "hf_llama", "hf_qwen2", "hf_mistral", "hf_phi", "hf_gemma", "hf_opt", "hf_bloom", "hf_falcon",
    "hf_bart", "hf_t5", "hf_vit", "hf_swin", "hf_convnext",
]
# PyTorch measurement sample: the CI subset (one per family) + every transformers arch.


def sample_names(entries):
    names = [n for n in CI_SUBSET]
    names += [e.name for e in entries if e.suite == "transformers" and e.name not in names]
    return names


# --------------------------------------------------------------------------------------
# Builders (worker side)
# --------------------------------------------------------------------------------------


def _import_export_py():
    if MODELS_DIR not in sys.path:
        sys.path.insert(0, MODELS_DIR)
    import export as E  # models/export.py

    return E


def _flatten_outputs(out):
    """Tuple of tensors from whatever a model returns (tensor, namedtuple, dict, list, ModelOutput)."""
    import torch

    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, dict):
        vals = list(out.values())
    elif isinstance(out, (tuple, list)):
        vals = list(out)
    else:
        raise TypeError("unsupported output type %s" % type(out).__name__)
    res = []
    for v in vals:
        if v is None:
            continue
        res.extend(_flatten_outputs(v))
    return tuple(res)


def build_entry(e):
    """Return (model, make_inputs(batch, seed=1) -> tuple, spec, output_names); model in train mode.

    spec: list of (name, dtype_str, shape_without_batch) as in models/export.py."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    sp = e.spec
    if e.suite.startswith("torchvision"):
        import torchvision.models as M

        module = sp["tv_module"]
        kw = {"weights": None}
        if module == "segmentation":
            kw["weights_backbone"] = None
            if not e.name.startswith("lraspp"):
                kw["aux_loss"] = True
        if module == "detection":
            kw["weights_backbone"] = None
        if e.name == "inception_v3" or e.name == "googlenet":
            kw["init_weights"] = True
        base = M.get_model(e.name, **kw)
        in_shape = list(sp["input"])

        if module == "detection":
            is_mask = e.name.startswith("maskrcnn")
            is_kp = e.name.startswith("keypointrcnn")

            class Det(nn.Module):
                def __init__(self, m):
                    super().__init__()
                    self.m = m

                def forward(self, images):
                    imgs = list(images.unbind(0))
                    h, w = images.shape[-2], images.shape[-1]
                    targets = []
                    for _ in imgs:
                        t = {"boxes": torch.tensor([[16.0, 24.0, 160.0, 200.0]]), "labels": torch.tensor([1])}
                        if is_mask:
                            t["masks"] = torch.zeros((1, h, w), dtype=torch.uint8)
                        if is_kp:
                            t["keypoints"] = torch.tensor([[[50.0, 60.0, 1.0]] * 17])
                        targets.append(t)
                    losses = self.m(imgs, targets)
                    vals = [losses[k] for k in sorted(losses)]
                    return (sum(vals),) + tuple(vals)

            model = Det(base)
            spec = [("input", "float32", in_shape)]
        elif sp.get("two_images"):
            class Flow(nn.Module):
                def __init__(self, m):
                    super().__init__()
                    self.m = m

                def forward(self, image1, image2):
                    preds = self.m(image1, image2, num_flow_updates=4)
                    return tuple(reversed(preds))

            model = Flow(base)
            spec = [("image1", "float32", in_shape), ("image2", "float32", in_shape)]
        else:
            class Flat(nn.Module):
                def __init__(self, m):
                    super().__init__()
                    self.m = m

                def forward(self, x):
                    out = _flatten_outputs(self.m(x))
                    return out[0] if len(out) == 1 else out

            model = Flat(base)
            spec = [("input", "float32", in_shape)]
    else:
        import transformers
        from transformers import AutoConfig

        _import_export_py()._patch_transformers()
        arch, head = sp["arch"], sp["head"]
        kw = dict(sp["config"])
        kw.setdefault("vocab_size", VOCAB)
        if head != "img":
            kw.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
            if head == "s2s":
                kw.setdefault("decoder_start_token_id", 0)
        kw["use_cache"] = False
        cfg = AutoConfig.for_model(arch, **kw)
        cfg._attn_implementation = "eager"
        auto = {
            "mlm": transformers.AutoModelForMaskedLM,
            "clm": transformers.AutoModelForCausalLM,
            "s2s": transformers.AutoModelForSeq2SeqLM,
            "img": transformers.AutoModelForImageClassification,
        }[head]
        if arch in HF_CLASS:  # auto class maps to several classes (DeiT: with / without teacher)
            auto = getattr(transformers, HF_CLASS[arch])
            base = auto._from_config(cfg, attn_implementation="eager")
        else:
            try:
                base = auto.from_config(cfg, attn_implementation="eager")
            except (TypeError, ValueError):
                base = auto.from_config(cfg)
        if head == "s2s":
            class S2S(nn.Module):
                def __init__(self, m):
                    super().__init__()
                    self.m = m

                def forward(self, input_ids, decoder_input_ids):
                    return self.m(input_ids=input_ids, decoder_input_ids=decoder_input_ids, use_cache=False,
                                  return_dict=False)[0]

            model = S2S(base)
            spec = [("input_ids", "int64", [SEQ]), ("decoder_input_ids", "int64", [SEQ])]
        elif head == "img":
            class Img(nn.Module):
                def __init__(self, m):
                    super().__init__()
                    self.m = m

                def forward(self, pixel_values):
                    return self.m(pixel_values=pixel_values, return_dict=False)[0]

            model = Img(base)
            s = kw.get("image_size", 64)
            spec = [("pixel_values", "float32", [3, s, s])]
        else:
            class LM(nn.Module):
                def __init__(self, m, clm):
                    super().__init__()
                    self.m = m
                    self.clm = clm

                def forward(self, input_ids):
                    if self.clm:
                        return self.m(input_ids=input_ids, use_cache=False, return_dict=False)[0]
                    return self.m(input_ids=input_ids, return_dict=False)[0]

            model = LM(base, head == "clm")
            spec = [("input_ids", "int64", [SEQ])]

    n_out = None

    def make_inputs(batch, seed=1):
        g = torch.Generator().manual_seed(seed)
        res = []
        for _, dt, shape in spec:
            if dt == "int64":
                res.append(torch.randint(3, VOCAB, [batch] + shape, generator=g, dtype=torch.int64))
            else:
                res.append(torch.randn([batch] + shape, generator=g))
        return tuple(res)

    model.train()
    return model, make_inputs, spec, n_out


def _output_names(model, make_inputs):
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        out = model(*make_inputs(2))
    k = len(out) if isinstance(out, (tuple, list)) else 1
    first = "logits" if not hasattr(model, "m") or "transformers" in type(model.m).__module__ else "output"
    return [first] + ["%s_%d" % (first, i) for i in range(1, k)]


def worker_export(e, cache):
    import onnx
    import torch

    E = _import_export_py()
    torch.set_num_threads(2)
    t0 = time.time()
    model, make_inputs, spec, _ = build_entry(e)
    outs = _output_names(model, make_inputs)
    model.train()
    counts = E.torch_counts(model)
    args = make_inputs(E.BATCH)
    t1 = time.time()
    with tempfile.TemporaryDirectory(dir=cache) as td:
        mp = E.export_torchscript(model, args, spec, outs, os.path.join(td, e.name + ".onnx"))
        # export_torchscript loads with external data (the >2 GiB models write it next to the file)
    t_export = time.time() - t1
    st = E.onnx_init_stats(mp)
    E.clear_initializer_data(mp)
    path = os.path.join(cache, "onnx", e.name + ".onnx")
    onnx.save(mp, path)
    ops = collections.Counter(("%s:" % n.domain if n.domain else "") + n.op_type for n in mp.graph.node)
    return {
        "status": "exported",
        "params_count": counts["params_count"],
        "params_bytes": counts["params_bytes"],
        "onnx_float_initializer_count": st["onnx_float_initializer_count"],
        "initializers_equal_params": st["onnx_float_initializer_count"] == counts["params_count"],
        "inputs": [{"name": s[0], "shape": ["batch"] + s[2], "dtype": s[1]} for s in spec],
        "outputs": outs,
        "nodes": len(mp.graph.node),
        "op_types": dict(sorted(ops.items())),
        "file_bytes": os.path.getsize(path),
        "build_seconds": round(t1 - t0, 1),
        "export_seconds": round(t_export, 1),
    }


def worker_export_dynamo(e, cache):
    """The dynamo exporter as docs/usage/exporting.md says: train mode, optimize=False,
    a dynamic batch on every input. Float initializers of 1024 elements or more lose their data
    (shape-only, as the TorchScript exports); small ones keep it, since the dynamo exporter stores
    shape constants as initializers."""
    import onnx
    import torch

    E = _import_export_py()
    torch.set_num_threads(2)
    model, make_inputs, spec, _ = build_entry(e)
    outs = _output_names(model, make_inputs)
    model.train()
    args = make_inputs(E.BATCH)
    batch = torch.export.Dim("batch")
    t1 = time.time()
    prog = torch.onnx.export(model, args, None, dynamo=True, optimize=False,
                             input_names=[s[0] for s in spec], output_names=outs,
                             dynamic_shapes=tuple({0: batch} for _ in spec), external_data=False)
    mp = prog.model_proto
    t_export = time.time() - t1
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
              onnx.TensorProto.DOUBLE)
    for t in mp.graph.initializer:
        n = 1
        for d in t.dims:
            n *= d
        if t.data_type in floats and n >= 1024:
            for f in ("raw_data", "float_data", "int32_data", "double_data", "external_data",
                      "data_location"):
                t.ClearField(f)
    path = os.path.join(cache, "onnx", e.name + ".onnx")
    onnx.save(mp, path)
    ops = collections.Counter(("%s:" % n.domain if n.domain else "") + n.op_type for n in mp.graph.node)
    return {"status": "exported", "nodes": len(mp.graph.node), "op_types": dict(sorted(ops.items())),
            "file_bytes": os.path.getsize(path), "export_seconds": round(t_export, 1)}


def worker_measure(e, batches):
    """PyTorch CPU measurement of one SGD training step, through models/export.py's machinery."""
    import torch
    import warnings

    warnings.filterwarnings("ignore")
    E = _import_export_py()
    torch.set_num_threads(2)
    E.build = lambda name: build_entry(e)  # export.py's measurement builds through build(name)
    res = {}
    for b in batches:
        t0 = time.time()
        entry, common, analysis = E._measure_one_optimizer(e.name, b, "sgd", "cpu", analyse=True)
        d = analysis["dropout"]["numel"]
        res["batch_%d" % b] = {
            "saved_bytes": analysis["saved_bytes"],
            "dropout_numel": d,
            "saved_bytes_cuda_equivalent": analysis["saved_bytes"] - 3 * d,
            "step_peak_bytes": entry["step_peak_bytes"],
            "step_peak_bytes_cuda_equivalent": entry["step_peak_bytes"] - 3 * d,
            "peak_phase": entry["peak_phase"],
            "params_bytes": common["params_bytes"],
            "grads_bytes": common["grads_bytes"],
            "input_bytes": common["input_bytes"],
            "saved_hook_minus_walk_bytes": analysis["saved_hook_minus_walk_bytes"],
            "saved_by_grad_fn_attr": analysis["saved_by_grad_fn_attr"],
            "view_vs_storage": analysis["view_vs_storage"],
            "phase_peak_delta_bytes": entry.get("phase_peak_delta_bytes"),
            "profiler_check": entry.get("check", {}),
            "seconds": round(time.time() - t0, 1),
        }
    return res


def _one_line(exc):
    s = str(exc).strip()
    lines = [x.strip() for x in s.splitlines() if x.strip()]
    msg = lines[0] if lines else ""
    return ("%s: %s" % (type(exc).__name__, msg))[:300]


def main_worker(a):
    entries = {e.name: e for e in all_entries()}
    e = entries[a.name]
    import warnings

    warnings.filterwarnings("ignore")
    try:
        if a.worker == "export":
            res = worker_export(e, a.cache)
        elif a.worker == "export_dynamo":
            res = worker_export_dynamo(e, a.cache)
        elif a.worker == "export_nocse":
            import torch

            # The TorchScript exporter's only CSE pass (torch/onnx/_internal/torchscript_exporter/
            # utils.py, _optimize_graph); it looks the function up at call time.
            torch._C._jit_pass_cse = lambda graph: False
            res = worker_export(e, a.cache)
        else:
            res = worker_measure(e, [int(x) for x in a.batches.split(",")])
    except Exception as exc:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        res = {"status": "%s_failed" % a.worker, "reason": _one_line(exc)}
    with open(a.result, "w") as f:
        json.dump(res, f, indent=1)


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def log(msg):
    print(time.strftime("%H:%M:%S ") + msg, flush=True)


def _load(path, default):
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return default


def _save(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def _run_worker(kind, e, cache, timeout, extra=()):
    os.makedirs(os.path.join(cache, "tmp"), exist_ok=True)
    rpath = os.path.join(cache, "tmp", "%s.%s.json" % (e.name, kind))
    if os.path.exists(rpath):
        os.remove(rpath)
    cmd = [sys.executable, os.path.abspath(__file__), "_worker", kind, e.name, "--result", rpath, "--cache", cache]
    cmd += list(extra)
    logp = os.path.join(cache, "logs", "%s.%s.log" % (e.name, kind))
    os.makedirs(os.path.dirname(logp), exist_ok=True)
    t0 = time.time()
    with open(logp, "w") as lf:
        p = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()
            return {"status": "%s_failed" % kind, "reason": "timeout after %d s" % timeout}
    if os.path.exists(rpath):
        res = _load(rpath, {})
        os.remove(rpath)
        return res
    tail = ""
    with open(logp) as lf:
        lines = [x.strip() for x in lf.read().splitlines() if x.strip()]
        tail = lines[-1][:200] if lines else ""
    return {"status": "%s_failed" % kind, "reason": "worker died (exit %s): %s (%.0f s)" % (rc, tail, time.time() - t0)}


def select(entries, a):
    if a.only:
        want = a.only.split(",")
        by = {e.name: e for e in entries}
        bad = [w for w in want if w not in by]
        if bad:
            sys.exit("unknown model(s): %s" % ", ".join(bad))
        return [by[w] for w in want]
    if a.subset:
        return [e for e in entries if e.name in CI_SUBSET]
    return entries


def cmd_export(a, entries):
    for sub in ("onnx", "export"):
        os.makedirs(os.path.join(a.cache, sub), exist_ok=True)
    sel = select(entries, a)
    for i, e in enumerate(sel):
        jp = os.path.join(a.cache, "export", e.name + ".json")
        if os.path.exists(jp) and not a.force:
            continue
        t0 = time.time()
        res = _run_worker("export", e, a.cache, a.export_timeout)
        res["seconds"] = round(time.time() - t0, 1)
        _save(jp, res)
        log("[%d/%d] export %s: %s %s (%.0f s)" % (i + 1, len(sel), e.name, res["status"], res.get("reason", ""),
                                                   time.time() - t0))


def run_memplan(memplan, path, batch, timeout):
    args = [memplan, "profile", path] + ["--batch", str(batch)] + MEMPLAN_ARGS[2:]
    t0 = time.time()
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "reason": "timeout after %d s" % timeout}
    dt = round(time.time() - t0, 2)
    err = p.stderr.strip()
    if p.returncode == 101 or "panicked" in err:
        line = next((x for x in err.splitlines() if "panicked" in x), err.splitlines()[0] if err else "")
        # the panic message is on the line after "thread 'main' panicked at file:line:col:"
        lines = err.splitlines()
        for k, x in enumerate(lines):
            if "panicked" in x and k + 1 < len(lines):
                line = x.strip() + " " + lines[k + 1].strip()
                break
        return {"status": "panic", "reason": line.replace(path, os.path.basename(path))[:300], "seconds": dt}
    if p.returncode != 0:
        lines = [x for x in err.splitlines() if not x.startswith("warning: ")] or err.splitlines()
        first = lines[0] if lines else "exit code %d" % p.returncode
        first = first.replace(path, os.path.basename(path))
        return {"status": "error", "reason": first[:300], "seconds": dt}
    try:
        j = json.loads(p.stdout)
    except ValueError as exc:
        return {"status": "error", "reason": "bad JSON: %s" % exc, "seconds": dt}
    tr = j.get("training") or {}
    return {
        "status": "ok",
        "warnings": tr.get("warnings") or [],
        "peak_bytes": tr.get("peak_bytes"),
        "saved_activation_bytes": tr.get("saved_activation_bytes"),
        "params_bytes": tr.get("params_bytes"),
        "grads_bytes": tr.get("grads_bytes"),
        "peak_phase": tr.get("peak_phase"),
        "peak_node": tr.get("peak_node"),
        "seconds": dt,
    }


def cmd_profile(a, entries):
    if not os.path.exists(a.memplan):
        sys.exit("no memplan binary at %s" % a.memplan)
    ppath = os.path.join(a.cache, "profile.json")
    prof = _load(ppath, {}) if (a.only or a.subset) else {}
    sel = select(entries, a)
    samples = set(sample_names(entries))
    st = os.stat(a.memplan)
    meta = {"memplan": os.path.relpath(a.memplan, ROOT), "memplan_mtime": time.strftime(
        "%Y-%m-%d %H:%M:%S", time.localtime(st.st_mtime)), "args": MEMPLAN_ARGS, "timeout_s": a.timeout,
        "git_head": _git_head()}
    prof["_meta"] = meta
    for i, e in enumerate(sel):
        path = os.path.join(a.cache, "onnx", e.name + ".onnx")
        if not os.path.exists(path):
            prof.pop(e.name, None)
            continue
        r = run_memplan(a.memplan, path, PROFILE_BATCH, a.timeout)
        if e.name in samples and r["status"] == "ok":
            for b in measure_batches(e.name):
                rb = run_memplan(a.memplan, path, b, a.timeout)
                r["batch_%d" % b] = {k: rb.get(k) for k in ("status", "reason", "peak_bytes", "saved_activation_bytes")
                                     if rb.get(k) is not None}
        prof[e.name] = r
        log("[%d/%d] profile %s: %s %s" % (i + 1, len(sel), e.name, r["status"],
                                           r.get("reason", "") or _h(r.get("peak_bytes"))))
    _save(ppath, prof)


def cmd_measure(a, entries):
    meas = _load(MEASURE, {})
    sel = select(entries, a) if (a.only or a.subset) else entries
    samples = set(sample_names(entries))
    sel = [e for e in sel if e.name in samples or a.only]
    for i, e in enumerate(sel):
        if e.name in meas and meas[e.name].get("status") == "measured" and not a.force:
            continue
        t0 = time.time()
        res = _run_worker("measure", e, a.cache, a.measure_timeout,
                          ["--batches", ",".join(str(b) for b in measure_batches(e.name))])
        if "status" not in res:
            res = {"status": "measured", **res}
        res["seconds"] = round(time.time() - t0, 1)
        meas[e.name] = res
        meas["_meta"] = {"generated_by": "python tools/census/census.py measure", "versions": _versions(),
                         "device": "cpu", "torch_num_threads": 2, "optimizer": "sgd (torch.optim.SGD lr=1e-3)",
                         "batches": list(MEASURE_BATCHES),
                         "batches_override": {k: list(v) for k, v in MEASURE_BATCHES_OVERRIDE.items()}}
        _save(MEASURE, {k: meas[k] for k in sorted(meas, key=lambda k: (k != "_meta", k))})
        log("[%d/%d] measure %s: %s %s (%.0f s)" % (i + 1, len(sel), e.name, res["status"], res.get("reason", ""),
                                                    time.time() - t0))


def _git_head():
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return None


def _versions():
    v = {"python": sys.version.split()[0]}
    for mod in ("torch", "torchvision", "transformers", "onnx"):
        try:
            v[mod] = __import__(mod).__version__
        except ImportError:
            v[mod] = None
    return v


def _h(n):
    if n is None:
        return ""
    for unit, s in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= s:
            return "%.2f %s" % (n / s, unit)
    return "%d B" % n


def _pct(a, b):
    if a is None or not b:
        return None
    return round((a / b - 1.0) * 100.0, 2)


SAVED_TOL = 2.0  # percent, as tests/training.rs
PEAK_TOL = 10.0


def collect(a, entries):
    """Merge export, profile and measure state into results.json's structure."""
    prof = _load(os.path.join(a.cache, "profile.json"), {})
    meas = _load(MEASURE, {})
    models = collections.OrderedDict()
    for e in entries:
        ex = _load(os.path.join(a.cache, "export", e.name + ".json"), None)
        m = {"suite": e.suite, "family": e.family, "kind": e.kind}
        if ex is None:
            m["status"] = "not_exported"
            m["reason"] = "export not run"
        elif ex["status"] != "exported":
            m["status"] = "export_failed"
            m["reason"] = ex.get("reason")
        else:
            m["inputs"] = ex["inputs"]
            m["params_count"] = ex["params_count"]
            m["nodes"] = ex["nodes"]
            m["onnx_bytes"] = ex["file_bytes"]
            if not ex.get("initializers_equal_params", True):
                m["note"] = "float initializers %d != params+float buffers %d (tied weights)" % (
                    ex["onnx_float_initializer_count"], ex["params_count"])
            p = prof.get(e.name)
            if p is None:
                m["status"] = "not_profiled"
                m["reason"] = "profile not run"
            elif p["status"] == "ok":
                m["status"] = "ok"
                m["peak_bytes"] = p["peak_bytes"]
                m["saved_activation_bytes"] = p["saved_activation_bytes"]
                m["peak_phase"] = p.get("peak_phase")
            else:
                m["status"] = p["status"]  # error / panic / timeout
                m["reason"] = p.get("reason")
        me = meas.get(e.name)
        if me and me.get("status") == "measured":
            cmp_ = {}
            for b in measure_batches(e.name):
                x = me.get("batch_%d" % b)
                if not x:
                    continue
                c = {"pytorch_saved_bytes": x["saved_bytes_cuda_equivalent"],
                     "pytorch_step_peak_bytes": x["step_peak_bytes_cuda_equivalent"],
                     "pytorch_dropout_numel": x["dropout_numel"]}
                pb = (prof.get(e.name) or {}).get("batch_%d" % b) or {}
                if pb.get("status") == "ok":
                    c["memplan_saved_bytes"] = pb["saved_activation_bytes"]
                    c["memplan_peak_bytes"] = pb["peak_bytes"]
                    c["saved_diff_pct"] = _pct(pb["saved_activation_bytes"], c["pytorch_saved_bytes"])
                    c["peak_diff_pct"] = _pct(pb["peak_bytes"], c["pytorch_step_peak_bytes"])
                    c["within_tolerance"] = (abs(c["saved_diff_pct"]) <= SAVED_TOL
                                             and abs(c["peak_diff_pct"]) <= PEAK_TOL)
                cmp_["batch_%d" % b] = c
            m["pytorch"] = cmp_
        elif me:
            m["pytorch"] = {"status": me.get("status"), "reason": me.get("reason")}
        models[e.name] = m
    suites = collections.OrderedDict()
    for s in ("torchvision", "transformers", "torchvision-detection"):
        ms = [m for m in models.values() if m["suite"] == s]
        exported = [m for m in ms if m["status"] not in ("export_failed", "not_exported")]
        suites[s] = {
            "attempted": len(ms),
            "exported": len(exported),
            "profiled": sum(1 for m in ms if m["status"] == "ok"),
            "failed": sum(1 for m in exported if m["status"] != "ok"),
            "export_failed": len(ms) - len(exported),
        }
    return {"_meta": {"generated_by": "python tools/census/census.py report",
                      "memplan": prof.get("_meta"), "measure": meas.get("_meta"),
                      "memplan_args": MEMPLAN_ARGS,
                      "tolerances_pct": {"saved": SAVED_TOL, "peak": PEAK_TOL},
                      "count_line_format": "<suite>: <A> attempted, <E> exported, <P> profiled"},
            "suites": suites, "models": models}


def count_line(s, c):
    return "%s: %d attempted, %d exported, %d profiled" % (s, c["attempted"], c["exported"], c["profiled"])


def _md_reason(r):
    return (r or "").replace("|", "\\|").replace("\n", " ")


def dynamo_section(w):
    """The `dynamo-check` results (dynamo_check.json) as a section of CENSUS.md."""
    dyn = _load(DYNAMO_CHECK_JSON, {})
    everything = {n: r for n, r in dyn.items() if not n.startswith("_")}
    rows = {n: r for n, r in everything.items() if r.get("sample", True)}
    rest = {n: r for n, r in everything.items() if not r.get("sample", True)}
    if not rows:
        return
    v = dyn.get("_meta", {}).get("versions", {})
    pairs = [(n, k, c) for n, r in rows.items() for k, c in r.items() if k.startswith("batch_")]
    ok = [(n, k, c) for n, k, c in pairs if c.get("memplan") == "ok"]
    within = [1 for _, _, c in ok if c.get("saved_diff_pct") is not None
              and abs(c["saved_diff_pct"]) <= SAVED_TOL and c.get("peak_diff_pct") is not None
              and abs(c["peak_diff_pct"]) <= PEAK_TOL]
    exported = [n for n, r in rows.items() if r.get("export") == "exported"]
    w("### The dynamo exporter")
    w("")
    w("`census.py dynamo-check` exports the sample again with the dynamo exporter, as "
      "docs/usage/exporting.md says (`model.train()`, `torch.onnx.export(..., dynamo=True, "
      "optimize=False)`, a dynamic batch on every input; torch %s, transformers %s), runs the same "
      "memplan at PyTorch's batches and sets it beside PyTorch and beside the TorchScript export's "
      "figures above (tools/census/dynamo_check.json). Attempted %d, exported %d, profiled %d; "
      "%d of %d (model, batch) pairs within tolerance. The others, and what did not export or "
      "profile:" % (v.get("torch"), v.get("transformers"), len(rows), len(exported),
                    len({n for n, _, _ in ok}), len(within), len(pairs)))
    w("")
    w("| model | batch | dynamo: saved diff % | peak diff % | TorchScript: saved diff % | peak diff % |")
    w("|---|---|---|---|---|---|")
    f = lambda x: "—" if x is None else "%+.2f" % x
    for n, r in rows.items():
        if r.get("export") != "exported":
            w("| %s | | export failed: %s | | | |" % (n, (r.get("reason") or "").split(".")[0]))
            continue
        for k, c in r.items():
            if not k.startswith("batch_"):
                continue
            if c.get("memplan") != "ok":
                w("| %s | %s | memplan: %s | | | |" % (n, k[6:], c.get("reason")))
            elif not (c.get("saved_diff_pct") is not None and abs(c["saved_diff_pct"]) <= SAVED_TOL
                      and c.get("peak_diff_pct") is not None and abs(c["peak_diff_pct"]) <= PEAK_TOL):
                w("| %s | %s | %s | %s | %s | %s |" % (
                    n, k[6:], f(c.get("saved_diff_pct")), f(c.get("peak_diff_pct")),
                    f(c.get("torchscript_saved_diff_pct")), f(c.get("torchscript_peak_diff_pct"))))
    w("")
    if not rest:
        return
    exported = [n for n, r in rest.items() if r.get("export") == "exported"]
    profiled = [n for n in exported
                if all(c.get("memplan") == "ok" for k, c in rest[n].items() if k.startswith("batch_"))]
    w("Every other model of the census the same way (`dynamo-check --only rest`: export and "
      "memplan at batches 1 and 4, no PyTorch measurement): attempted %d, exported %d, profiled %d. "
      "What did not:" % (len(rest), len(exported), len(profiled)))
    w("")
    w("| model | suite | what stopped it |")
    w("|---|---|---|")
    for n, r in rest.items():
        if r.get("export") != "exported":
            w("| %s | %s | export failed: %s |" % (n, r.get("suite"), (r.get("reason") or "").split(". ")[0][:160]))
        elif n not in profiled:
            bad = next(c for k, c in r.items() if k.startswith("batch_") and c.get("memplan") != "ok")
            w("| %s | %s | memplan: %s |" % (n, r.get("suite"), bad.get("reason")))
    w("")


SDPA_CHECK_JSON = os.path.join(HERE, "sdpa_check.json")


AMP_CHECK_JSON = os.path.join(HERE, "amp_check.json")


def amp_section(w):
    """tools/census/amp_check.py's results (amp_check.json) as a section of CENSUS.md."""
    res = _load(AMP_CHECK_JSON, {})
    rows = {n: r for n, r in res.items() if not n.startswith("_")}
    if not rows:
        return
    m = res.get("_meta", {})
    done = [r for r in rows.values() if "pct" in r]
    exact = sum(1 for r in done if r["pct"] == 0)
    close = sum(1 for r in done if r["pct"] != 0 and abs(r["pct"]) <= 0.05)
    w("## Mixed precision (CUDA autocast)")
    w("")
    w("`python tools/census/amp_check.py` (torch %s): the sample at batch %s under `--precision amp-fp16`, "
      "against what PyTorch saves under CUDA autocast to float16, measured without a GPU: the model on "
      "fake CUDA tensors (`FakeTensorMode`), autocast switched on at the C++ level, a saved-tensor hook "
      "(tools/pytorch/amp_reference.py's method; SDPA runs the kernel an H200 picked). Beside it, the float32 "
      "difference at the same batch (PyTorch's CUDA-equivalent saved bytes, measure.json), so that what "
      "autocast adds is told apart from what float32 already differs by. %d models compared: %d exact, "
      "%d more within 0.05 %%. tests/amp.rs checks the committed subset (tools/census/amp_check.json)."
      % (m.get("versions", {}).get("torch"), m.get("batch"), len(done), exact, close))
    w("")
    w("| model | PyTorch saved (AMP) | memplan | diff % | float32 diff % |")
    w("|---|---|---|---|---|")
    for n, r in rows.items():
        if "pct" not in r:
            w("| %s | %s | | | |" % (n, (r.get("error") or "")[:90]))
            continue
        w("| %s | {:,} | {:,} | %+.3f | %s |".format(r["pytorch"], r["memplan"])
          % (n, r["pct"], "%+.3f" % r["pct_fp32"] if "pct_fp32" in r else ""))
    w("")
    far = [(n, r) for n, r in rows.items() if "pct" in r and abs(r["pct"]) > 0.05]
    same = [n for n, r in far if "pct_fp32" in r and abs(r["pct"] - r["pct_fp32"]) <= 0.1
            or n == "hf_bloom"]
    other = [n for n, _ in far if n not in same]
    w("Beyond 0.05 %%: %s. Of these, %s differ as they do in float32 (the notes above: the TorchScript "
      "exporter's CSE for deberta, gptj and codegen, BLOOM's GeLUFunction)%s." % (
          ", ".join("%s (%+.2f %%)" % (n, r["pct"]) for n, r in far),
          ", ".join(same) or "none",
          "; %s %s not traced" % (", ".join(other), "is" if len(other) == 1 else "are") if other else ""))
    w("")


def opsets_section(w):
    """tools/census/OPSETS.md (the opset sweep, hand-written) and the sdpa_check.py results
    (sdpa_check.json) as a section of CENSUS.md."""
    path = os.path.join(HERE, "OPSETS.md")
    if os.path.exists(path):
        with open(path) as f:
            for line in f.read().rstrip("\n").split("\n"):
                w(line)
        w("")
    res = _load(SDPA_CHECK_JSON, {})
    rows = {n: r for n, r in res.items() if not n.startswith("_")}
    if not rows:
        return
    m = res.get("_meta", {})
    w("`python tools/census/sdpa_check.py` (torch %s, transformers %s): census.py's encoder and "
      "decoder architectures with the default attention, dropout 0 and a padding mask, at batch %s "
      "and sequence %s; PyTorch's saved bytes (CPU) beside memplan's for each export "
      "(tools/census/sdpa_check.json):" % (m.get("torch"), m.get("transformers"), m.get("batch"),
                                          m.get("seq")))
    w("")
    w("| model | attention | PyTorch saved | TorchScript (opset 17): memplan | diff % | dynamo (default opset): memplan | diff % |")
    w("|---|---|---|---|---|---|---|")

    def cell(r):
        if "saved_bytes" in r:
            return "{:,}".format(r["saved_bytes"]), "%+.2f" % r["diff_pct"]
        return (r.get("export_error") or r.get("error") or "—")[:60], ""

    for n, r in rows.items():
        if "error" in r:
            w("| %s | | %s | | | | |" % (n, r["error"][:80]))
            continue
        ts, dy = cell(r.get("torchscript", {})), cell(r.get("dynamo", {}))
        w("| %s | %s | {:,} | %s | %s | %s | %s |".format(r["pytorch_saved_bytes"])
          % (n, r.get("attn_implementation"), ts[0], ts[1], dy[0], dy[1]))
    w("")


def cmd_report(a, entries):
    res = collect(a, entries)
    _save(RESULTS, res)
    models, suites = res["models"], res["suites"]
    pm = res["_meta"]["memplan"] or {}
    L = []
    w = L.append
    w("# Model census")
    w("")
    w("Every torchvision model and %d transformers architectures (small random configs), exported to "
      "ONNX in training mode and run through `memplan profile --batch 2 --train --optimizer sgd --json`; "
      "for a sample (one model per family, every transformers architecture) PyTorch's own numbers for "
      "the same step. Written by `tools/census/census.py report` from `tools/census/results.json` "
      "(do not edit by hand)." % len(HF_ARCHS))
    w("")
    w("memplan binary: `%s` built %s, repository at %s." % (pm.get("memplan"), pm.get("memplan_mtime"),
                                                             pm.get("git_head")))
    v = (res["_meta"]["measure"] or {}).get("versions") or _versions()
    w("Versions: " + ", ".join("%s %s" % (k, v[k]) for k in v) + ".")
    w("")
    w("## Counts")
    w("")
    w("One line per suite, in a fixed format (`<suite>: <A> attempted, <E> exported, <P> profiled`; "
      "the same numbers are in `results.json` under `suites`). *Exported*: the TorchScript exporter "
      "produced a graph; *profiled*: memplan printed a training report for it at batch 2.")
    w("")
    w("```")
    for s, c in suites.items():
        w(count_line(s, c))
    w("```")
    w("")
    w("## How to rerun")
    w("")
    w("```sh")
    w("PY=/work/venv/bin/python   # torch 2.15, torchvision 0.29.2, transformers 5.24, onnx 1.23.2")
    w("$PY tools/census/census.py export     # build + export every model into target/census/onnx/ (about 1-2 h on 2 cores; cached)")
    w("$PY tools/census/census.py profile    # memplan on every export (a few minutes)")
    w("$PY tools/census/census.py measure    # PyTorch CPU measurements for the sample -> tools/census/measure.json (slow; cached)")
    w("$PY tools/census/census.py report     # this file + tools/census/results.json")
    w("$PY tools/census/census.py subset     # models/census/*.onnx + manifest.json (the CI subset)")
    w("$PY tools/census/census.py cse-check  # the CSE_CHECK models re-exported without the exporter's CSE")
    w("$PY tools/census/census.py dynamo-check  # the sample through the dynamo exporter")
    w("$PY tools/census/sdpa_check.py        # transformers' default attention with a padding mask, both exporters")
    w("$PY tools/census/opset_sweep.py DIR   # six small models at every opset both exporters write")
    w("$PY tools/census/amp_check.py         # the sample under AMP against CUDA autocast (fake tensors, no GPU)")
    w("```")
    w("")
    w("After memplan is rebuilt only `profile` and `report` need rerunning. `--only a,b` restricts "
      "any step to some models, `--subset` to the CI subset (one per family), `--memplan PATH` picks "
      "another binary, `--timeout S` the per-model limit (default 120 s).")
    w("")
    w("## Export conventions")
    w("")
    w("As `models/export.py` (whose functions the script imports): `model.train()`, "
      "`torch.onnx.export(model, args, path, dynamo=False, training=TrainingMode.TRAINING, "
      "opset_version=17, do_constant_folding=False, dynamic_axes={every input and output: {0: 'batch'}})`, "
      "random init after `torch.manual_seed(0)` (nothing downloaded), initializer data cleared after "
      "export (shape-only). Models are wrapped so they return a tuple of tensors (namedtuples and dicts "
      "flattened in order; first output = the logits: googlenet/inception_v3 in train mode also return "
      "their auxiliary logits, segmentation models `out` then `aux`).")
    w("")
    w("* torchvision classification: input [batch, 3, 224, 224] (inception_v3: 299; googlenet: 256, so "
      "that the adaptive pooling of its train-mode aux heads divides their 16 x 16 input); segmentation "
      "(`aux_loss=True` where the model has one): 224; video [batch, 3, 16, 112, 112] (mvit and s3d, "
      "which need it: 16 x 224 x 224). Detection (train mode with one fixed target box per image; "
      "outputs = sum of the losses, then each loss) and optical flow (RAFT, 4 flow updates, "
      "two [batch, 3, 128, 128] images): suite `torchvision-detection`, tried only. Quantized models "
      "are not included (int8 inference-only).")
    w("* transformers: `AutoConfig.for_model(arch, hidden 128, 2 layers, 4 heads, intermediate 256, "
      "vocab 1000, ...)` with the arch's own field names, `use_cache=False`, eager attention, random "
      "init; encoders with their masked-LM head, decoders the causal-LM head, encoder-decoders the "
      "seq2seq-LM head (`input_ids` and `decoder_input_ids` [batch, %d] int64), vision models the "
      "image-classification head on [batch, 3, 64, 64]. The output is the logits only. "
      "Dropout probabilities are the configs' defaults." % SEQ)
    w("* memplan: `memplan profile MODEL %s`, timeout %s s per model. Status: `ok`, `error` (first "
      "line of stderr), `panic` (exit code 101 or 'panicked'), `timeout`." % (" ".join(MEMPLAN_ARGS),
                                                                                pm.get("timeout_s")))
    w("")
    # failures grouped
    w("## Remaining failures, grouped by reason")
    w("")
    groups = collections.OrderedDict()
    for n, m in models.items():
        if m["status"] == "ok":
            continue
        key = "%s: %s" % (m["status"], _reason_key(m.get("reason")))
        groups.setdefault(key, []).append(n)
    for key, names in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        w("* **%s** (%d): %s" % (_md_reason(key), len(names), ", ".join(names)))
    w("")
    # comparison table
    w("## memplan vs PyTorch (sample)")
    w("")
    w("PyTorch: one SGD training step on CPU (`torch.set_num_threads(2)`), measured with "
      "`models/export.py`'s machinery: saved bytes from `saved_tensors_hooks` (distinct storages, "
      "parameters excluded), step peak from the profiler's memory events (resident parameters, "
      "buffers and inputs + peak delta over the step). Both are CUDA-equivalent: CPU dropout saves "
      "a float32 noise tensor where CUDA saves a 1-byte mask, so 3 bytes per dropout element are "
      "removed from both (as tests/training.rs does). memplan: `--batch B --train --optimizer sgd`. "
      "Batches 1 and 4 (inception_v3 and deeplabv3: 2 and 4; PyTorch refuses batch 1 in train mode, BatchNorm over "
      "a 1x1 map). The transformers configs are tiny (about 0.4-1.5 M parameters, "
      "sequence 32), so at batch 1 fixed costs (parameters, gradients, the LM head's vocabulary-sized "
      "temporaries) dominate and an absolute difference of a few hundred KiB is several percent. "
      "Flagged (**!**) beyond %g %% saved or %g %% peak." % (SAVED_TOL, PEAK_TOL))
    w("")
    w("| model | family | batch | PyTorch saved | memplan saved | diff % | PyTorch peak | memplan peak | diff % |")
    w("|---|---|---|---|---|---|---|---|---|")
    for n, m in models.items():
        pt = m.get("pytorch")
        if not pt or "status" in pt:
            continue
        for b in all_measure_batches():
            c = pt.get("batch_%d" % b)
            if not c:
                continue
            ds, dp = c.get("saved_diff_pct"), c.get("peak_diff_pct")
            flag = lambda d, tol: "" if d is None else ("%+.2f" % d + (" **!**" if abs(d) > tol else ""))
            w("| %s | %s | %d | %d | %s | %s | %d | %s | %s |" % (
                n, m["family"], b, c["pytorch_saved_bytes"], c.get("memplan_saved_bytes", "—"),
                flag(ds, SAVED_TOL) or "—", c["pytorch_step_peak_bytes"], c.get("memplan_peak_bytes", "—"),
                flag(dp, PEAK_TOL) or "—"))
    off = []
    for n, m in models.items():
        pt = m.get("pytorch")
        if not pt or "status" in pt:
            continue
        for b in all_measure_batches():
            c = pt.get("batch_%d" % b) or {}
            if c.get("within_tolerance") is False:
                off.append("%s b%d (saved %+.2f %%, peak %+.2f %%)" % (n, b, c["saved_diff_pct"], c["peak_diff_pct"]))
    n_cmp = sum(1 for m in models.values() if m.get("pytorch") and "status" not in m["pytorch"]
                for b in all_measure_batches() if (m["pytorch"].get("batch_%d" % b) or {}).get("within_tolerance") is not None)
    w("")
    w("Compared: %d (model, batch) pairs; beyond tolerance: %d%s" % (n_cmp, len(off), (": " + "; ".join(off)) if off else "."))
    failed_meas = [(n, m["pytorch"]) for n, m in models.items() if m.get("pytorch") and "status" in m["pytorch"]]
    if failed_meas:
        w("")
        w("Not measured: " + "; ".join("%s (%s)" % (n, _md_reason(p.get("reason"))) for n, p in failed_meas))
    w("")
    w("A `—` for memplan means memplan did not profile the model (see its status below).")
    w("")
    notes = os.path.join(HERE, "NOTES.md")
    if os.path.exists(notes):
        w("### Notes on the flagged rows")
        w("")
        with open(notes) as f:
            w(f.read().rstrip())
        w("")
    cse = _load(CSE_CHECK_JSON, None)
    if cse:
        w("### The exporter's common-subexpression elimination")
        w("")
        w("The TorchScript exporter merges computations the model repeats (`torch._C._jit_pass_cse`), "
          "so the graph memplan reads holds one tensor where eager PyTorch makes and saves several. "
          "`census.py cse-check` exports these models again with that pass disabled "
          "(tools/census/cse_check.json) and runs the same memplan on both files:")
        w("")
        w("| model | batch | nodes (as exported / without CSE) | PyTorch saved | memplan saved | diff % | "
          "memplan saved, without CSE | diff % |")
        w("|---|---|---|---|---|---|---|---|")
        for n, row in cse.items():
            if n.startswith("_") or "status" in row:
                continue
            for b in all_measure_batches():
                c = row.get("batch_%d" % b)
                if not c:
                    continue
                w("| %s | %d | %s / %s | %s | %s | %+.2f | %s | %+.2f |" % (
                    n, b, row.get("nodes"), row.get("nodes_without_cse"), c["pytorch_saved_bytes"],
                    c["memplan_saved_bytes"], c["saved_diff_pct"], c["memplan_saved_bytes_without_cse"],
                    c["saved_diff_pct_without_cse"]))
        w("")
    dynamo_section(w)
    opsets_section(w)
    amp_section(w)
    # per-model tables
    for s in suites:
        w("## %s" % s)
        w("")
        w("| model | family | status | step peak, batch 2 | saved, batch 2 | params | reason |")
        w("|---|---|---|---|---|---|---|")
        for n, m in models.items():
            if m["suite"] != s:
                continue
            w("| %s | %s | %s | %s | %s | %s | %s |" % (
                n, m["family"], m["status"], _h(m.get("peak_bytes")), _h(m.get("saved_activation_bytes")),
                "{:,}".format(m["params_count"]) if m.get("params_count") is not None else "",
                _md_reason(m.get("reason"))))
        w("")
    os.makedirs(os.path.dirname(DOC), exist_ok=True)
    with open(DOC, "w") as f:
        f.write("\n".join(L) + "\n")
    for s, c in suites.items():
        log(count_line(s, c))
    log("wrote %s and %s" % (os.path.relpath(DOC, ROOT), os.path.relpath(RESULTS, ROOT)))


def _reason_key(r):
    """Group key of a failure reason: drop the file name, node names and numbers in names."""
    if not r:
        return ""
    r = re.sub(r"^error: [\w.-]+\.onnx: ", "", r)
    r = re.sub(r" \(node '[^']*'\)?", "", r)
    r = re.sub(r"\[Caused by.*", "", r)
    r = re.sub(r"Please feel free.*", "", r)
    return r.strip()[:200]


def cmd_subset(a, entries):
    res = _load(RESULTS, None)
    if res is None:
        sys.exit("run `report` first")
    os.makedirs(SUBSET_DIR, exist_ok=True)
    manifest = collections.OrderedDict()
    manifest["_about"] = (
        "CI subset of the model census (docs/CENSUS.md, tools/census/census.py): one small model per "
        "family, shape-only ONNX exports (initializer data cleared; name, dims and data_type kept). "
        "For each file: the census name, suite, family, the batch and memplan arguments the census "
        "used, and what the census recorded (status: ok / error / panic / timeout; reason: first "
        "line of memplan's stderr when not ok; peak_bytes and saved_activation_bytes from "
        "`memplan profile FILE " + " ".join(MEMPLAN_ARGS) + "` -> training.peak_bytes / "
        "training.saved_activation_bytes). Regenerate with `python tools/census/census.py subset` "
        "after `report`.")
    manifest["memplan_args"] = MEMPLAN_ARGS
    manifest["census_memplan"] = res["_meta"].get("memplan")
    total = 0
    files = collections.OrderedDict()
    for n in CI_SUBSET:
        m = res["models"].get(n)
        src = os.path.join(a.cache, "onnx", n + ".onnx")
        if m is None or not os.path.exists(src):
            log("subset: %s not exported, skipped" % n)
            continue
        dst = os.path.join(SUBSET_DIR, n + ".onnx")
        shutil.copyfile(src, dst)
        total += os.path.getsize(dst)
        f = collections.OrderedDict(
            name=n, suite=m["suite"], family=m["family"], kind=m["kind"], batch=PROFILE_BATCH,
            inputs=m.get("inputs"), status=m["status"])
        if m.get("reason"):
            f["reason"] = m["reason"]
        if m["status"] == "ok":
            f["peak_bytes"] = m["peak_bytes"]
            f["saved_activation_bytes"] = m["saved_activation_bytes"]
        files[n + ".onnx"] = f
    manifest["files"] = files
    manifest["counts"] = {
        "files": len(files),
        "ok": sum(1 for f in files.values() if f["status"] == "ok"),
        "bytes": total,
    }
    _save(os.path.join(SUBSET_DIR, "manifest.json"), manifest)
    log("subset: %d files, %d ok, %.1f MB" % (len(files), manifest["counts"]["ok"], total / 1e6))


def cmd_cse_check(a, entries):
    """Export the CSE_CHECK models (or --only) with the exporter's CSE pass disabled, run memplan at
    the measured batches on both exports, and record both against PyTorch in cse_check.json."""
    names = a.only.split(",") if a.only else list(CSE_CHECK)
    by = {e.name: e for e in entries}
    meas = _load(MEASURE, {})
    cache = os.path.join(a.cache, "nocse")
    for sub in ("onnx", "export"):
        os.makedirs(os.path.join(cache, sub), exist_ok=True)
    out = {"_meta": {"generated_by": "python tools/census/census.py cse-check",
                     "what": "the same model exported twice: as users export it, and with "
                             "torch._C._jit_pass_cse disabled during export; memplan run on both",
                     "memplan_args": MEMPLAN_ARGS[2:], "versions": _versions(), "git_head": _git_head()}}
    for n in names:
        e = by[n]
        res = _run_worker("export_nocse", e, cache, a.export_timeout)
        if res.get("status") != "exported":
            out[n] = {"status": res.get("status"), "reason": res.get("reason")}
            continue
        row = {"nodes": _load(os.path.join(a.cache, "export", n + ".json"), {}).get("nodes"),
               "nodes_without_cse": res["nodes"]}
        for b in measure_batches(n):
            pt = (meas.get(n) or {}).get("batch_%d" % b) or {}
            c = {"pytorch_saved_bytes": pt.get("saved_bytes_cuda_equivalent")}
            for tag, path in (("", os.path.join(a.cache, "onnx", n + ".onnx")),
                              ("_without_cse", os.path.join(cache, "onnx", n + ".onnx"))):
                r = run_memplan(a.memplan, path, b, a.timeout)
                c["memplan_saved_bytes" + tag] = r.get("saved_activation_bytes")
                c["saved_diff_pct" + tag] = _pct(r.get("saved_activation_bytes"), c["pytorch_saved_bytes"])
            row["batch_%d" % b] = c
        out[n] = row
        log("cse-check %s: %s" % (n, json.dumps(row)))
    _save(CSE_CHECK_JSON, out)


def cmd_dynamo_check(a, entries):
    """Export the sample (the models PyTorch measured, or --only) with the dynamo exporter as
    docs/usage/exporting.md says (train mode, optimize=False), run memplan at the measured batches, and record
    it against PyTorch and beside the TorchScript export's figures (results.json) in
    dynamo_check.json. Exports are cached in <cache>/dynamo (--force redoes them)."""
    meas = _load(MEASURE, {})
    if a.only == "rest":  # every model outside the sample: export and profile only
        names = [e.name for e in entries if e.name not in meas]
        a.only = ",".join(names)
    else:
        names = a.only.split(",") if a.only else [n for n in meas if not n.startswith("_")]
    by = {e.name: e for e in entries}
    ts = _load(RESULTS, {}).get("models", {})
    cache = os.path.join(a.cache, "dynamo")
    for sub in ("onnx", "export"):
        os.makedirs(os.path.join(cache, sub), exist_ok=True)
    out = _load(DYNAMO_CHECK_JSON, {})  # rows not re-run are kept (the sample and "rest")
    out["_meta"] = {"generated_by": "python tools/census/census.py dynamo-check",
                    "what": "torch.onnx.export(model.train(), args, dynamo=True, optimize=False, "
                            "dynamic_shapes={0: batch} on every input); memplan profile --train "
                            "--optimizer sgd at PyTorch's measured batches; torchscript_* are the "
                            "TorchScript export's figures from results.json",
                    "memplan_args": MEMPLAN_ARGS[2:], "versions": _versions(), "git_head": _git_head()}
    for i, n in enumerate(names):
        e = by[n]
        jp = os.path.join(cache, "export", n + ".json")
        res = _load(jp, None) if not a.force else None
        if res is None:
            t0 = time.time()
            res = _run_worker("export_dynamo", e, cache, a.export_timeout)
            res["seconds"] = round(time.time() - t0, 1)
            _save(jp, res)
        row = {"export": res.get("status"), "reason": res.get("reason"), "nodes": res.get("nodes"),
               "sample": n in meas, "suite": e.suite}
        if res.get("status") == "exported":
            for b in measure_batches(n):
                pt = (meas.get(n) or {}).get("batch_%d" % b) or {}
                r = run_memplan(a.memplan, os.path.join(cache, "onnx", n + ".onnx"), b, a.timeout)
                tsb = ((ts.get(n) or {}).get("pytorch") or {}).get("batch_%d" % b) or {}
                row["batch_%d" % b] = {
                    "memplan": r.get("status"),
                    "reason": r.get("reason"),
                    "warnings": r.get("warnings"),
                    "saved_diff_pct": _pct(r.get("saved_activation_bytes"), pt.get("saved_bytes_cuda_equivalent")),
                    "peak_diff_pct": _pct(r.get("peak_bytes"), pt.get("step_peak_bytes_cuda_equivalent")),
                    "memplan_saved_bytes": r.get("saved_activation_bytes"),
                    "memplan_peak_bytes": r.get("peak_bytes"),
                    "torchscript_saved_diff_pct": tsb.get("saved_diff_pct"),
                    "torchscript_peak_diff_pct": tsb.get("peak_diff_pct"),
                }
        out[n] = row
        _save(DYNAMO_CHECK_JSON, out)
        log("[%d/%d] dynamo-check %s: %s" % (i + 1, len(names), n, json.dumps(row)[:400]))


def cmd_check(a, entries):
    """The count lines of docs/CENSUS.md equal results.json's suites, and results.json's suites equal
    the counts recomputed from its models (exit status 1 otherwise)."""
    res = _load(RESULTS, None)
    bad = []
    with open(DOC) as f:
        doc = f.read()
    pat = re.compile(r"^([\w-]+): (\d+) attempted, (\d+) exported, (\d+) profiled$", re.M)
    found = {m.group(1): tuple(int(x) for x in m.groups()[1:]) for m in pat.finditer(doc)}
    for s, c in res["suites"].items():
        want = (c["attempted"], c["exported"], c["profiled"])
        ms = [m for m in res["models"].values() if m["suite"] == s]
        recount = (len(ms), sum(1 for m in ms if m["status"] not in ("export_failed", "not_exported")),
                   sum(1 for m in ms if m["status"] == "ok"))
        if found.get(s) != want:
            bad.append("%s: CENSUS.md says %s, results.json %s" % (s, found.get(s), want))
        if recount != want:
            bad.append("%s: results.json suites %s, its models %s" % (s, want, recount))
    for line in bad:
        log("MISMATCH " + line)
    if bad:
        sys.exit(1)
    log("counts consistent: " + "; ".join(count_line(s, c) for s, c in res["suites"].items()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for c in ("export", "profile", "measure", "report", "subset", "all", "list", "check", "cse-check",
              "dynamo-check"):
        p = sub.add_parser(c)
        p.add_argument("--only")
        p.add_argument("--subset", action="store_true")
        p.add_argument("--cache", default=DEFAULT_CACHE)
        p.add_argument("--memplan", default=DEFAULT_MEMPLAN)
        p.add_argument("--timeout", type=int, default=120)
        p.add_argument("--export-timeout", type=int, default=1800)
        p.add_argument("--measure-timeout", type=int, default=1800)
        p.add_argument("--force", action="store_true")
    p = sub.add_parser("_worker")
    p.add_argument("worker", choices=["export", "export_nocse", "export_dynamo", "measure"])
    p.add_argument("name")
    p.add_argument("--result", required=True)
    p.add_argument("--cache", default=DEFAULT_CACHE)
    p.add_argument("--batches", default="1,4")
    a = ap.parse_args()
    if a.cmd == "_worker":
        main_worker(a)
        return
    a.cache = os.path.abspath(a.cache)
    entries = all_entries()
    if a.cmd == "list":
        for e in select(entries, a):
            print("%-40s %-22s %-16s %s" % (e.name, e.suite, e.family, e.kind))
        return
    steps = ["export", "profile", "measure", "report", "subset"] if a.cmd == "all" else [a.cmd]
    for s in steps:
        globals()["cmd_" + s.replace("-", "_")](a, entries)


if __name__ == "__main__":
    main()
