"""Six small models through both PyTorch exporters at the opsets users export with, each
profiled by memplan (docs/CENSUS.md, "Opsets, and Hugging Face's default attention"): the
TorchScript exporter at opsets 9, 11, 13, 14, 16, 17, 18 and 20, the dynamo exporter
(optimize=False) at 18, 20 and 23, training mode, a dynamic batch; then `memplan profile FILE
--batch 2 --train --optimizer sgd --json`. Prints one line per file: its saved bytes, or
why it did not export or profile.

    python tools/census/opset_sweep.py OUT_DIR [--memplan target/release/memplan]
"""

import argparse
import json
import os
import subprocess
import warnings

import torch
import torchvision
from torch.onnx import TrainingMode

TS_OPSETS = (9, 11, 13, 14, 16, 17, 18, 20)
DYNAMO_OPSETS = (18, 20, 23)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    m = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=512, n_positions=64))
    class W(torch.nn.Module):
        def __init__(s): super().__init__(); s.m = m
        def forward(s, ids): return (s.m(input_ids=ids, use_cache=False).logits,)
    return W(), (torch.randint(0, 512, (2, 16)),)

def tiny_bert():
    from transformers import BertConfig, BertModel
    m = BertModel(BertConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=128, vocab_size=512))
    class W(torch.nn.Module):
        def __init__(s): super().__init__(); s.m = m
        def forward(s, ids): return (s.m(input_ids=ids).last_hidden_state,)
    return W(), (torch.randint(0, 512, (2, 16)),)

def gn_net():
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.GroupNorm(4, 16), torch.nn.SiLU(),
                            torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.InstanceNorm2d(16, affine=True), torch.nn.GELU(),
                            torch.nn.Upsample(scale_factor=2, mode="bilinear"), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 10))
    return m, (torch.randn(2, 3, 16, 16),)

def rn18():
    return torchvision.models.resnet18(num_classes=10), (torch.randn(2, 3, 64, 64),)

def mnv3():
    return torchvision.models.mobilenet_v3_small(num_classes=10), (torch.randn(2, 3, 64, 64),)

def lstm():
    class L(torch.nn.Module):
        def __init__(s): super().__init__(); s.e = torch.nn.Embedding(100, 32); s.l = torch.nn.LSTM(32, 32, num_layers=2, batch_first=True); s.o = torch.nn.Linear(32, 100)
        def forward(s, x): return (s.o(s.l(s.e(x))[0]),)
    return L(), (torch.randint(0, 100, (2, 8)),)


MODELS = dict(gpt2=tiny_gpt2, bert=tiny_bert, gn=gn_net, rn18=rn18, mnv3=mnv3, lstm=lstm)


def export(make, path, opset, dynamo):
    torch.manual_seed(0)
    m, args = make()
    m.train()
    if dynamo:
        torch.onnx.export(m, args, path, dynamo=True, optimize=False, opset_version=opset,
                          dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=1024)},),
                          external_data=False)
    else:
        torch.onnx.export(m, args, path, dynamo=False, training=TrainingMode.TRAINING,
                          opset_version=opset, do_constant_folding=False, input_names=["x"],
                          dynamic_axes={"x": {0: "batch"}})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--memplan", default="target/release/memplan")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    os.makedirs(a.out, exist_ok=True)
    for name, make in MODELS.items():
        for dynamo, opsets in ((False, TS_OPSETS), (True, DYNAMO_OPSETS)):
            for opset in opsets:
                f = "%s_%s%d.onnx" % (name, "dy" if dynamo else "ts", opset)
                path = os.path.join(a.out, f)
                try:
                    export(make, path, opset, dynamo)
                except Exception as e:  # noqa: BLE001
                    print(f, "export failed:", type(e).__name__, str(e).strip().splitlines()[0][:120])
                    continue
                p = subprocess.run([a.memplan, "profile", path, "--batch", "2", "--train",
                                    "--optimizer", "sgd", "--json"], capture_output=True, text=True)
                if p.returncode != 0:
                    print(f, "memplan:", p.stderr.strip().splitlines()[-1])
                    continue
                print(f, json.loads(p.stdout)["training"]["saved_activation_bytes"], flush=True)


if __name__ == "__main__":
    main()
