"""Hugging Face models as users train them: transformers' default attention (`sdpa`)
and a padding mask, through both exporters, against PyTorch's saved bytes.

The census builds every transformers model with `attn_implementation="eager"`; this check
builds the architectures of census.py's HF_ARCHS (the same small configs) with the default
attention instead, every dropout probability set to 0 (PyTorch's CPU SDPA takes its math path
under dropout, which CUDA does not), and calls the text models with an attention mask whose
second sample is padded for its last quarter (encoder-decoders: on the encoder's input; vision
models take pixels alone). For each model it
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
    """(model, attention implementation, inputs, input names)."""
    import transformers
    from transformers import AutoConfig

    kw = dict(kw, vocab_size=census.VOCAB)
    if head != "img":
        kw.update(pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)
        if head == "s2s":
            kw.setdefault("decoder_start_token_id", 0)
    cfg = AutoConfig.for_model(arch, **kw)
    zero_dropout(cfg)
    auto = {"mlm": transformers.AutoModelForMaskedLM,
            "clm": transformers.AutoModelForCausalLM,
            "s2s": transformers.AutoModelForSeq2SeqLM,
            "img": transformers.AutoModelForImageClassification}[head]
    if arch in census.HF_CLASS:
        base = getattr(transformers, census.HF_CLASS[arch])._from_config(cfg)
    else:
        base = auto.from_config(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, census.VOCAB, (BATCH, census.SEQ), generator=g)
    mask = torch.ones(BATCH, census.SEQ, dtype=torch.int64)
    mask[1, census.SEQ * 3 // 4:] = 0

    class Img(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, pixel_values):
            return self.m(pixel_values=pixel_values, return_dict=False)[0]

    class S2S(Img):
        def forward(self, input_ids, attention_mask, decoder_input_ids):
            return self.m(input_ids=input_ids, attention_mask=attention_mask,
                          decoder_input_ids=decoder_input_ids, return_dict=False)[0]

    class LM(Img):
        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask,
                          return_dict=False)[0]

    if head == "img":
        size = kw.get("image_size", 64)
        args, names = (torch.randn(BATCH, 3, size, size, generator=g),), ["pixel_values"]
    elif head == "s2s":
        dec = torch.randint(3, census.VOCAB, (BATCH, census.SEQ), generator=g)
        args, names = (ids, mask, dec), ["input_ids", "attention_mask", "decoder_input_ids"]
    else:
        args, names = (ids, mask), ["input_ids", "attention_mask"]
    wrap = {"img": Img, "s2s": S2S}.get(head, LM)
    return wrap(base).train(), base.config._attn_implementation, args, names


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


def export(m, args, names, path, dynamo):
    if dynamo:
        b = torch.export.Dim("batch")
        torch.onnx.export(m, args, path, dynamo=True, optimize=False, input_names=names,
                          dynamic_shapes=tuple({0: b} for _ in names), external_data=False)
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
    # Rows of architectures not run now are kept.
    rows = {n: r for n, r in census._load(a.out, {}).items() if not n.startswith("_")}
    with tempfile.TemporaryDirectory() as tmp:
        for arch, (kind, head, kw) in census.HF_ARCHS.items():
            if only and arch not in only:
                continue
            row = {}
            try:
                torch.manual_seed(0)
                m, impl, args, names = build(arch, head, kw)
                row["attn_implementation"] = impl
                row["pytorch_saved_bytes"] = saved_bytes(m, args)
            except Exception as e:  # noqa: BLE001
                rows[arch] = {"error": one_line(e)}
                print(arch, rows[arch], flush=True)
                continue
            for exporter in ("torchscript", "dynamo"):
                path = os.path.join(tmp, "%s_%s.onnx" % (arch, exporter))
                try:
                    export(m, args, names, path, exporter == "dynamo")
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
