"""PyTorch references for decoder LLMs at long sequence (dev-time; CPU, float32 by default).

For every family below: the model is built from its config (seeded, real weights, CPU) and one
training step is measured as models/export.py measures the other references (saved bytes by
saved_tensors_hooks, the step peak from torch.profiler's allocation events, SGD and AdamW; see
tests/data/pytorch/training_reference.json's _meta); the same config is exported shape-only by memplan-export
to models/llm/<family>.onnx, which tests/llm.rs profiles and compares with
tests/data/pytorch/llm_reference.json.

    python tools/llm/reference.py [--families llama,qwen3] [--batches 1,2] [--seq 2048]
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "models"))
sys.path.insert(0, os.path.join(ROOT, "python"))

import export as ref  # noqa: E402  models/export.py: the measurement machinery

VOCAB = 32000
# Each family: its config (small, the family's own features), the attention implementation, and
# whether the model computes its own loss (labels=, read by memplan with --loss graph).
FAMILIES = {
    # GQA, RoPE, SwiGLU, RMSNorm, untied embeddings; loss = logits.mean()
    "llama": dict(
        config=dict(model_type="llama", hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, vocab_size=VOCAB, tie_word_embeddings=False),
        attn="eager", labels=False),
    # qk-norm, GQA, HF's in-model cross-entropy (labels=)
    "qwen3": dict(
        config=dict(model_type="qwen3", hidden_size=384, intermediate_size=1024, num_hidden_layers=3,
                    num_attention_heads=6, num_key_value_heads=2, head_dim=64, vocab_size=VOCAB,
                    tie_word_embeddings=False),
        attn="eager", labels=True),
    # sliding-window attention (window 1024 < sequence), SDPA, in-model loss
    "mistral": dict(
        config=dict(model_type="mistral", hidden_size=512, intermediate_size=1536, num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=2, vocab_size=VOCAB, sliding_window=1024,
                    tie_word_embeddings=False),
        attn="sdpa", labels=True),
    # GeGLU (gelu tanh), tied embeddings, sliding and global layers, qk-norm, eager, in-model loss
    "gemma3": dict(
        config=dict(model_type="gemma3_text", hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=96, vocab_size=VOCAB,
                    sliding_window=512, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                    tie_word_embeddings=True),
        attn="eager", labels=True),
    # fused qkv and gate_up projections, SwiGLU, SDPA; loss = logits.mean()
    "phi3": dict(
        config=dict(model_type="phi3", hidden_size=512, intermediate_size=1376, num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=4, vocab_size=VOCAB, pad_token_id=0,
                    tie_word_embeddings=False),
        attn="sdpa", labels=False),
    # attention bias, tied embeddings, SDPA, in-model loss
    "qwen2": dict(
        config=dict(model_type="qwen2", hidden_size=448, intermediate_size=1216, num_hidden_layers=3,
                    num_attention_heads=7, num_key_value_heads=1, vocab_size=VOCAB, tie_word_embeddings=True),
        attn="sdpa", labels=True),
    # peft LoRA (r 16 on q/k/v/o) on the llama config: only the adapters train (--trainable lora_)
    "llama_lora": dict(
        config=dict(model_type="llama", hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, vocab_size=VOCAB, tie_word_embeddings=False),
        attn="sdpa", labels=True, lora="r=16,alpha=32,targets=q_proj,k_proj,v_proj,o_proj"),
    # mixture of experts (8 experts, top-2, SwiGLU experts), SDPA, in-model loss; routing forced
    # balanced in PyTorch (round robin), as memplan assumes by default (--moe-routing balanced)
    "mixtral": dict(
        config=dict(model_type="mixtral", hidden_size=384, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=6, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                    vocab_size=VOCAB, tie_word_embeddings=False, sliding_window=None),
        attn="sdpa", labels=True, moe="balanced"),
    # Qwen3-MoE: 16 experts, top-4, normalised top-k weights, qk-norm, eager attention, in-model loss
    "qwen3_moe": dict(
        config=dict(model_type="qwen3_moe", hidden_size=384, intermediate_size=1024, moe_intermediate_size=256,
                    num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                    num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
                    mlp_only_layers=[], vocab_size=VOCAB, tie_word_embeddings=False),
        attn="eager", labels=True, moe="balanced"),
}
# QLoRA: the llama_lora family with its frozen Linear weights quantized to NF4 by bitsandbytes
# (Linear4bit, double-quantized absmax, compute in float32; lm_head kept, as transformers'
# BitsAndBytesConfig keeps it); the same file, read with --weight-dtype nf4
FAMILIES["llama_qlora"] = dict(FAMILIES["llama_lora"], qlora="nf4", fixture="llama_lora")
# the mixtral family again, its router forced to memplan's worst case (--moe-routing worst): one
# expert receives every token; the same file
FAMILIES["mixtral_worst"] = dict(FAMILIES["mixtral"], moe="worst", fixture="mixtral")
OPTIMIZERS = ("sgd", "adamw")


def _quantize_nf4(model):
    """Every nn.Linear but the output head becomes bitsandbytes' Linear4bit (NF4, blocksize 64,
    compress_statistics=True as QLoRA), quantized on the CPU from the model's own weights."""
    import torch
    from bitsandbytes.nn import Linear4bit, Params4bit

    head = model.get_output_embeddings()
    for mod in list(model.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Linear) and child is not head:
                q = Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                               compute_dtype=child.weight.dtype, quant_type="nf4", compress_statistics=True)
                q.weight = Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                      compress_statistics=True)._quantize("cpu")
                if child.bias is not None:
                    q.bias = child.bias
                setattr(mod, name, q)
    return model


def nf4_stored_bytes(model):
    """What bitsandbytes stores for the model's quantized weights: the 4-bit codes, the 8-bit
    absmax, its fp32 second-level absmax and offset (the shared code tables apart); and how
    many elements they quantize."""
    from bitsandbytes.nn import Params4bit

    total, elements = 0, 0
    for p in model.parameters():
        if isinstance(p, Params4bit) and p.quant_state is not None:
            qs = p.quant_state
            parts = [p.data, qs.absmax] + ([qs.state2.absmax, qs.offset] if qs.nested else [])
            total += sum(t.numel() * t.element_size() for t in parts)
            elements += qs.shape.numel()
    return total, elements


def _forced_indices(t, k, e, routing):
    """[t, k] expert indices, distinct per token. balanced: token i goes to experts (i·k + j) mod
    E, so every expert receives T·k/E tokens; worst: slot 0 of every token goes to expert 0 and
    the other slots round robin over the other experts (memplan's --moe-routing worst)."""
    import torch

    i, j = torch.arange(t)[:, None], torch.arange(k)[None, :]
    if routing == "balanced":
        return (i * k + j) % e
    assert routing == "worst"
    rest = 1 + (i * (k - 1) + (j - 1)) % (e - 1)
    return torch.where(j == 0, torch.zeros_like(rest), rest)


def _forced_router(self, hidden_states):
    """transformers' top-k router (MixtralTopKRouter.forward) with the experts chosen by
    ``_forced_indices`` instead of by score. The scores still come from the router's softmax,
    so its gradient flows as in training."""
    import torch
    import torch.nn.functional as F

    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
    idx = _forced_indices(router_probs.shape[0], self.top_k, self.num_experts, self._memplan_routing)
    top_value = router_probs.gather(1, idx)
    if getattr(self, "norm_topk_prob", True):
        top_value /= top_value.sum(dim=-1, keepdim=True)
    return router_logits, top_value.to(router_logits.dtype), idx


def _force_routing(model, routing):
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    assert routers, "a MoE family without top-k routers"
    for r in routers:
        r._memplan_routing = routing
        r.forward = _forced_router.__get__(r)


def _builder(fam, seq, dtype):
    import torch

    from memplan_export.hf import build_config

    spec = FAMILIES[fam]

    class LM(torch.nn.Module):
        """input_ids (and labels) positionally, the output tuple as HF returns it."""

        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, labels=None):
            return self.m(input_ids=input_ids, labels=labels, use_cache=False, return_dict=False)

    def build(_name):
        from transformers import AutoModelForCausalLM

        cfg = build_config(spec["config"], attn=spec["attn"])
        if spec.get("moe"):
            cfg._experts_implementation = "eager"  # transformers' per-expert loop, as exported
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
        if spec.get("moe"):
            _force_routing(base, spec["moe"])
        if spec.get("qlora"):
            _quantize_nf4(base)
            nf4_bytes = nf4_stored_bytes(base)
        if spec.get("lora"):
            from memplan_export.hf import _add_lora, parse_lora

            base = _add_lora(base, parse_lora(spec["lora"]), device="cpu")
        m = LM(base)
        m._memplan_graph_loss = spec["labels"]
        m._memplan_nf4_bytes = nf4_bytes if spec.get("qlora") else None
        m.train()
        names = [("input_ids", "int64", [seq])] + ([("labels", "int64", [seq])] if spec["labels"] else [])

        def make_inputs(batch, seed=1):
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
            return (ids, ids.clone()) if spec["labels"] else (ids,)

        return m, make_inputs, names, ["loss", "logits"] if spec["labels"] else ["logits"]

    return build


def _nf4_bytes(fam, seq, dtype):
    return _builder(fam, seq, dtype)(fam)[0]._memplan_nf4_bytes


def measure(fam, batch, seq, dtype, log):
    t = time.time()
    build = _builder(fam, seq, dtype)
    entry, analysis = {}, None
    for kind in OPTIMIZERS:
        e, common, a = ref._measure_one_optimizer(fam, batch, kind, "cpu", analyse=(kind == "sgd"), builder=build)
        entry.update(common)
        entry[kind] = e
        analysis = analysis or a
    d = analysis["dropout"]["numel"]
    entry["saved_bytes"] = analysis["saved_bytes"]
    entry["saved_tensors"] = analysis["saved_tensors"]
    entry["saved_bytes_cuda_equivalent"] = analysis["saved_bytes"] - 3 * d
    entry["saved_by_grad_fn"] = analysis.get("saved_by_grad_fn")
    entry["dropout_numel"] = d
    entry["seconds"] = round(time.time() - t, 1)
    log("%s b%d: saved %d, sgd peak delta %d (%s), adamw peak delta %d, %.0fs" % (
        fam, batch, entry["saved_bytes"], entry["sgd"]["step_peak_delta_bytes"], entry["sgd"]["peak_phase"],
        entry["adamw"]["step_peak_delta_bytes"], time.time() - t))
    return entry


def export_fixture(fam, seq, dtype, out_dir):
    from memplan_export import export_hf

    spec = FAMILIES[fam]
    name = spec.get("fixture", fam)
    path = os.path.join(out_dir, "%s.onnx" % name if dtype == "float32" else "%s_%s.onnx" % (name, dtype))
    short = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    return export_hf(spec["config"], path, dtype=short, seq=seq, labels=spec["labels"], attn=spec["attn"],
                     lora=spec.get("lora"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--batches", default="1,2")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "data", "pytorch", "llm_reference.json"))
    ap.add_argument("--no-measure", action="store_true", help="only export the fixtures")
    a = ap.parse_args()
    import torch
    import transformers

    torch.set_num_threads(2)
    fams = a.families.split(",")
    out_dir = os.path.join(ROOT, "models", "llm")
    os.makedirs(out_dir, exist_ok=True)
    res = json.load(open(a.out)) if os.path.exists(a.out) else {}
    res["_meta"] = {
        "generated_by": "python tools/llm/reference.py",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "device": "cpu",
        "seq": a.seq,
        "definitions": "as tests/data/pytorch/training_reference.json (_meta.definitions), with AdamW "
        "(torch.optim.AdamW(lr=1e-3, foreach=True)) beside SGD; the model is the family's config "
        "built by transformers (seed 0), called as model(input_ids=, labels=, use_cache=False, "
        "return_dict=False); loss = the model's own (labels given) or logits.mean()",
    }
    for fam in fams:
        ex = export_fixture(fam, a.seq, a.dtype, out_dir)
        print("exported %s (%d nodes)" % (ex.path, ex.nodes), flush=True)
        if a.no_measure:
            continue
        key = fam if a.dtype == "float32" else "%s_%s" % (fam, a.dtype)
        spec = FAMILIES[fam]
        entry = res.get(key, {})
        entry.update({"config": spec["config"], "attn": spec["attn"],
                      "loss": "graph" if spec["labels"] else "mean", "dtype": a.dtype,
                      "file": os.path.relpath(ex.path, ROOT)})
        if spec.get("lora"):
            entry.update({"lora": spec["lora"], "trainable": "lora_"})
        if spec.get("qlora"):
            stored, elements = _nf4_bytes(fam, a.seq, a.dtype)
            entry.update({"weight_dtype": spec["qlora"], "nf4_stored_bytes": stored,
                          "nf4_quantized_elements": elements})
        if spec.get("moe"):
            entry.update({"moe_routing": spec["moe"], "experts_implementation": "eager"})
        for b in [int(x) for x in a.batches.split(",")]:
            entry["batch_%d" % b] = measure(fam, b, a.seq, a.dtype, lambda m: print(m, flush=True))
        res[key] = entry
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
