#!/usr/bin/env python3
"""What autograd saves around scaled_dot_product_attention on a GPU, per precision.

A dev-time check of memplan's attention layout rule (src/train/fusion.rs,
SDPA_F32_LAYOUT; docs/TRAINING_MEMORY.md). For each model and precision (fp32;
autocast bf16 and fp16), one forward of models/export.py's build() on the GPU under
saved-tensor hooks: the SDPA backward node PyTorch chose (which kernel ran), the
bytes saved (distinct storages), and the saved storages shared between the SDPA
node and any other node (1 where nn.MultiheadAttention's reshape before out_proj is
a view of the attention output, 0 where it copies).

    python3 tools/gpu-sdpa-layout.py --models vit_b_16,bert_base --batch 2 --out sdpa-layout.json
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def measure(name, batch, precision, device="cuda"):
    import torch

    sys.path.insert(0, os.path.join(ROOT, "models"))
    import export

    model, make_inputs, _, _ = export.build(name)
    model.to(device).train()
    inputs = tuple(t.to(device) for t in make_inputs(batch))
    saved = []  # (storage data_ptr, bytes)

    def pack(t):
        try:
            st = t.untyped_storage()
            saved.append((st.data_ptr(), st.nbytes()))
        except Exception:  # noqa: BLE001
            pass
        return t

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if dtype is None:
            out = model(*inputs)
        else:
            with torch.autocast(device, dtype=dtype):
                out = model(*inputs)
    first = out[0] if isinstance(out, (tuple, list)) else out
    # the SDPA nodes and what they save
    sdpa_kinds, sdpa_ptrs, other_ptrs = set(), set(), set()
    seen, stack = set(), [first.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        ptrs = set()
        for attr in dir(fn):
            if attr.startswith("_saved_"):
                try:
                    v = getattr(fn, attr)
                except Exception:  # noqa: BLE001
                    continue
                if isinstance(v, torch.Tensor) and v.numel():
                    ptrs.add(v.untyped_storage().data_ptr())
        kind = type(fn).__name__
        if "Attention" in kind:
            sdpa_kinds.add(kind)
            sdpa_ptrs |= ptrs
        else:
            other_ptrs |= ptrs
        stack.extend(f for f, _ in fn.next_functions)
    distinct = dict(saved)
    return {
        "model": name, "batch": batch, "precision": precision,
        "sdpa_backward": sorted(sdpa_kinds),
        "saved_bytes": sum(distinct.values()),
        "sdpa_storages_shared_with_other_nodes": len(sdpa_ptrs & other_ptrs),
        "sdpa_storages": len(sdpa_ptrs),
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else device,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="vit_b_16,bert_base")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--precisions", default="fp32,bf16,fp16")
    ap.add_argument("--out", default="sdpa-layout.json")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to try the script")
    a = ap.parse_args()
    rows = []
    for name in a.models.split(","):
        for p in a.precisions.split(","):
            try:
                r = measure(name, a.batch, p, a.device)
            except Exception as e:  # noqa: BLE001
                r = {"model": name, "precision": p, "error": "%s: %s" % (type(e).__name__, e)}
            rows.append(r)
            print(json.dumps(r), flush=True)
            with open(a.out + ".tmp", "w") as f:
                json.dump(rows, f, indent=1)
            os.replace(a.out + ".tmp", a.out)


if __name__ == "__main__":
    main()
