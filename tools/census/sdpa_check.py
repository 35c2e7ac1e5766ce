"""Hugging Face models as users train them: transformers' default attention (`sdpa`)
and a padding mask, through both exporters, against PyTorch's saved bytes.

The census builds every transformers model with `attn_implementation="eager"`; this check
builds the encoder and decoder architectures of census.py's HF_ARCHS (the same small
configs) with the default attention instead, every dropout probability set to 0 (PyTorch's
CPU SDPA takes its math path under dropout, which CUDA does not), and calls them with an
attention mask whose second sample is padded for its last quarter. For each model it
measures what PyTorch saves for backward in one step at batch 2 (CPU, float32, distinct
storages through saved_tensors_hooks, parameters and buffers excluded), exports it in
training mode with the TorchScript exporter (opset 17) and the dynamo exporter (its default
opset, optimize=False), and runs `memplan profile FILE --batch 2 --train --optimizer sgd
--json` on each.

    python tools/census/sdpa_check.py [--memplan target/release/memplan] [--only bert,llama]
        [--out tools/census/sdpa_check.json]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import census  # noqa: E402

BATCH = 2


def zero_dropout(cfg):
    for k, v in list(vars(cfg).items()):
        if ("drop" in k or k.endswith("pdrop")) and isinstance(v, float):
            setattr(cfg, k, 0.0)


def build(arch, head, kw):
    import transformers
    from transformers import AutoConfig

    kw = dict(kw, vocab_size=census.VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              use_cache=False)
    cfg = AutoConfig.for_model(arch, **kw)
    zero_dropout(cfg)
    auto = {"mlm": transformers.AutoModelForMaskedLM,
            "clm": transformers.AutoModelForCausalLM}[head]
    base = auto.from_config(cfg)

    class LM(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask,
                          return_dict=False)[0]

    return LM(base).train(), base.config._attn_implementation


def inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, census.VOCAB, (BATCH, census.SEQ), generator=g)
    mask = torch.ones(BATCH, census.SEQ, dtype=torch.int64)
    mask[1, census.SEQ * 3 // 4:] = 0
    return ids, mask


def saved_bytes(m, args):
    fixed = {t.untyped_storage().data_ptr() for t in [*m.parameters(), *m.buffers()]}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in fixed:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = m(*args)
    out.float().mean().backward()
    return sum(seen.values())


def export(m, args, path, dynamo):
    names = ["input_ids", "attention_mask"]
    if dynamo:
        b = torch.export.Dim("batch")
        torch.onnx.export(m, args, path, dynamo=True, optimize=False, input_names=names,
                          dynamic_shapes=({0: b}, {0: b}), external_data=False)
    else:
        torch.onnx.export(m, args, path, dynamo=False, opset_version=17,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=names, dynamic_axes={n: {0: "batch"} for n in names})


def memplan(binary, path):
    p = subprocess.run([binary, "profile", path, "--batch", str(BATCH), "--train", "--optimizer",
                        "sgd", "--json"], capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1]}
    return {"saved_bytes": json.loads(p.stdout)["training"]["saved_activation_bytes"]}


def one_line(e):
    return (type(e).__name__ + ": " + (str(e).strip().splitlines() or [""])[0])[:200]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--memplan", default="target/release/memplan")
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default=os.path.join(HERE, "sdpa_check.json"))
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    census._import_export_py()._patch_transformers()
    only = set(filter(None, a.only.split(",")))
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch, (kind, head, kw) in census.HF_ARCHS.items():
            if head not in ("mlm", "clm") or (only and arch not in only):
                continue
            row = {}
            try:
                torch.manual_seed(0)
                m, impl = build(arch, head, kw)
                row["attn_implementation"] = impl
                args = inputs()
                row["pytorch_saved_bytes"] = saved_bytes(m, args)
            except Exception as e:  # noqa: BLE001
                rows[arch] = {"error": one_line(e)}
                print(arch, rows[arch], flush=True)
                continue
            for exporter in ("torchscript", "dynamo"):
                path = os.path.join(tmp, "%s_%s.onnx" % (arch, exporter))
                try:
                    export(m, args, path, exporter == "dynamo")
                except Exception as e:  # noqa: BLE001
                    row[exporter] = {"export_error": one_line(e)}
                    continue
                r = memplan(a.memplan, path)
                if "saved_bytes" in r:
                    t = row["pytorch_saved_bytes"]
                    r["diff_pct"] = round(100.0 * (r["saved_bytes"] - t) / t, 2)
                row[exporter] = r
            rows[arch] = row
            print(arch, json.dumps(row), flush=True)
    meta = {"generated_by": "python tools/census/sdpa_check.py", "batch": BATCH,
            "seq": census.SEQ, "torch": torch.__version__}
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    with open(a.out, "w") as f:
        json.dump({"_meta": meta, **rows}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
