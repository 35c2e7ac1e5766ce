"""Issue 48's GPU check, prepared for one device call of at most 8 minutes (docs/CUDA.md).

Builds a 1 B and an 8 B LLaMA-style model with random init directly on the GPU in bf16 and runs
one training step per configuration, each in its own process (a fresh caching allocator):
  * full fine-tuning: AdamW (foreach), every decoder layer checkpointed
    (gradient_checkpointing_enable(use_reentrant=False)), the model's own loss (labels=);
  * LoRA: peft r 16 on q/k/v/o, AdamW over the adapters, no checkpointing, the model's own loss;
each at sequence 1024 and 4096, batch 1. Two steps run (the first allocates AdamW's state); the
second is measured: torch.cuda.max_memory_allocated / max_memory_reserved after
reset_peak_memory_stats, and nvidia-smi's used memory for the process at the end. Results go to
$OUT/gpu-llm.json as each finishes, beside memplan's predictions for the same files
(tools/llm/gpu_predictions.json, made here with --gpu h100).

    python tools/llm/gpu-llm.py [--sizes 1b,8b] [--seqs 1024,4096] [--budget 450] [--device cuda]
On a CPU (--device cpu --tiny) it runs the same code on two-layer configs: a smoke test.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "python"))

SIZES = {
    # Llama-3.2-1B's shape (tied embeddings), and the committed Llama-3.1-8B config
    "1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
               tie_word_embeddings=True, rope_theta=500000.0),
    "8b": "llama-3.1-8b",
}
MODES = ("full_every_block", "lora")
LORA = "r=16,alpha=32,targets=q_proj,k_proj,v_proj,o_proj"


def config(size, tiny):
    from memplan_export.hf import resolve_config

    d = dict(SIZES[size]) if isinstance(SIZES[size], dict) else resolve_config(SIZES[size])[0]
    if tiny:
        d.update(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=1024)
    return d


def one(size, mode, seq, device, tiny):
    """One configuration in this process: the measured step's figures."""
    import torch
    from transformers import AutoModelForCausalLM

    from memplan_export.hf import _add_lora, build_config, parse_lora

    cfg = build_config(config(size, tiny), attn="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        if mode == "lora":
            model = _add_lora(model, parse_lora(LORA), device=device)
    if mode == "full_every_block":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, foreach=True)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device=device)
    cuda = device == "cuda"
    res = {}
    for i in range(2):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t = time.time()
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        opt.step()
        del out
        if cuda:
            torch.cuda.synchronize()
            res = {"max_memory_allocated": torch.cuda.max_memory_allocated(),
                   "max_memory_reserved": torch.cuda.max_memory_reserved(),
                   "allocated_before_step": before, "step_seconds": round(time.time() - t, 3)}
        else:
            res = {"step_seconds": round(time.time() - t, 3)}
    if cuda:
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True)
        for line in q.stdout.splitlines():
            pid, mib = [x.strip() for x in line.split(",")]
            if int(pid) == os.getpid():
                res["nvidia_smi_bytes"] = int(mib) << 20
        res["device_name"] = torch.cuda.get_device_name()
    res["params"] = sum(p.numel() for p in model.parameters())
    res["trainable"] = sum(p.numel() for p in params)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1b,8b")
    ap.add_argument("--seqs", default="1024,4096")
    ap.add_argument("--budget", type=float, default=450, help="seconds for the whole run")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--one", nargs=3, metavar=("SIZE", "MODE", "SEQ"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        size, mode, seq = a.one
        try:
            print(json.dumps(one(size, mode, int(seq), a.device, a.tiny)))
        except Exception as e:  # noqa: BLE001  an out-of-memory is a result
            print(json.dumps({"error": ("%s: %s" % (type(e).__name__, e)).splitlines()[0][:300]}))
        return
    out_dir = os.environ.get("OUT", "gpu-out")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "gpu-llm.json")
    pred_path = os.path.join(HERE, "gpu_predictions.json")
    results = {"predictions": json.load(open(pred_path)) if os.path.exists(pred_path) else None,
               "runs": {}}
    start = time.time()
    for size in a.sizes.split(","):
        for mode in MODES:
            for seq in a.seqs.split(","):
                key = "%s/%s/%s" % (size, mode, seq)
                left = a.budget - (time.time() - start)
                if left < 20:
                    results["runs"][key] = {"skipped": "out of time"}
                    continue
                cmd = [sys.executable, __file__, "--device", a.device, "--one", size, mode, seq]
                if a.tiny:
                    cmd.append("--tiny")
                try:
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
                    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
                    r = json.loads(lines[-1]) if lines else {"error": p.stderr.strip()[-300:]}
                except subprocess.TimeoutExpired:
                    r = {"error": "timed out"}
                results["runs"][key] = r
                print(key, r, flush=True)
                with open(path + ".tmp", "w") as f:
                    json.dump(results, f, indent=1)
                os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
