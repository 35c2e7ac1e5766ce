"""The ``memplan-export`` command."""

from __future__ import annotations

import argparse
import sys
import time

from .core import ExportError


def _overrides(items):
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ExportError("--set takes KEY=VALUE, got '%s'" % item)
        k, v = item.split("=", 1)
        for conv in (int, float):
            try:
                v = conv(v)
                break
            except ValueError:
                pass
        else:
            v = {"true": True, "false": False, "null": None}.get(v.lower(), v)
        out[k.strip()] = v
    return out


def parser():
    from .hf import committed_names

    p = argparse.ArgumentParser(
        prog="memplan-export",
        description="Export a model as a shape-only ONNX file for memplan: built on the meta device, "
        "in training mode, every parameter and buffer written with its name, dtype and dims and no "
        "data. Nothing is downloaded.",
        epilog="Committed names: " + ", ".join(committed_names()),
    )
    p.add_argument("--hf", required=True, metavar="CONFIG",
                   help="a config.json, a folder holding one, or a committed name")
    p.add_argument("-o", "--output", required=True, metavar="PATH", help="the ONNX file to write")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="the dtype to train in (default fp32): export in it, so the model's own "
                   "float32 upcasts stay in the graph")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--labels", action="store_true",
                   help="the model computes its own loss (labels=); read it with memplan's --loss graph")
    p.add_argument("--attn", default="sdpa", choices=["eager", "sdpa"], help="attention (default sdpa, as transformers)")
    p.add_argument("--lora", metavar="SPEC", help="peft LoRA adapters: r=16,alpha=32,targets=q_proj,v_proj")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="record that the model trains with every block checkpointed "
                   "(memplan: --checkpoint every-block)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config value (e.g. --set num_hidden_layers=2)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.add_argument("-v", "--verbose", action="store_true", help="show the exporter's own output")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    import os

    from .hf import export_hf

    try:
        if os.path.exists(args.output) and not args.force:
            raise ExportError("%s exists (--force overwrites it)" % args.output)
        if args.seq <= 0:
            raise ExportError("--seq must be positive")
        t = time.time()
        out = export_hf(args.hf, args.output, dtype=args.dtype, seq=args.seq, labels=args.labels,
                        attn=args.attn, lora=args.lora, gradient_checkpointing=args.gradient_checkpointing,
                        overrides=_overrides(args.set), verbose=args.verbose)
    except ExportError as e:
        print("memplan-export: %s" % e, file=sys.stderr)
        return 1
    for n in out.notes:
        print("note: " + n, file=sys.stderr)
    print("wrote %s: %d nodes, %d parameters (%s elements), %d buffers, %.1f MiB, in %.1f s"
          % (out.path, out.nodes, out.parameters, format(out.parameter_elements, ","), out.buffers,
             out.file_bytes / 2**20, time.time() - t))
    flags = ["--batch 1", "--train"]
    if args.labels:
        flags.append("--loss graph")
    if args.dtype != "fp32":
        flags.append("--precision " + args.dtype)
    if args.lora:
        flags.append("--trainable lora_")
    if args.gradient_checkpointing:
        flags.append("--checkpoint every-block")
    print("next: memplan profile %s %s" % (out.path, " ".join(flags)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
