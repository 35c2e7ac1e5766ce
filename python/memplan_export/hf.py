"""Hugging Face causal LMs from a local config (a file, a folder holding config.json, or a name
committed in ``configs/``), built on the meta device in training mode and exported shape-only.
Nothing is downloaded."""

from __future__ import annotations

import contextlib
import json
import os
import re

from .core import ExportError, export_program, to_shape_only
from .moe import prepare as prepare_moe
from .moe import translation_table

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def committed_names() -> list[str]:
    """The model names whose public config numbers ship with the package."""
    if not os.path.isdir(CONFIG_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))


def _normalise(name: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-")


def resolve_config(spec: str) -> tuple[dict, str]:
    """(config dict, where it came from) for a path to a config.json, a folder holding one, or a
    committed name (case and separators ignored; a hub id such as ``meta-llama/Llama-3.1-8B``
    matches by its last part)."""
    if os.path.isdir(spec):
        path = os.path.join(spec, "config.json")
        if not os.path.isfile(path):
            raise ExportError("%s: no config.json in this folder" % spec)
        return _read_json(path), path
    if os.path.isfile(spec):
        return _read_json(spec), spec
    want = _normalise(spec.split("/")[-1])
    for name in committed_names():
        if _normalise(name) == want:
            path = os.path.join(CONFIG_DIR, name + ".json")
            return _read_json(path), "committed config '%s'" % name
    raise ExportError(
        "'%s' is neither a config.json, a folder holding one, nor a committed name (%s)"
        % (spec, ", ".join(committed_names()) or "none committed")
    )


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise ExportError("%s: cannot read a JSON config: %s" % (path, str(e).splitlines()[0]))
    if not isinstance(d, dict):
        raise ExportError("%s: a config is a JSON object" % path)
    return d


def build_config(d: dict, *, attn: str = "sdpa", overrides: dict | None = None):
    """A transformers config from the dict, with overrides (``num_hidden_layers=2``, ...)."""
    import transformers
    from transformers import AutoConfig

    d = {k: v for k, v in d.items() if not k.startswith("_")}
    model_type = d.pop("model_type", None)
    if not model_type:
        raise ExportError("the config names no model_type")
    try:
        cfg = AutoConfig.for_model(model_type, **d)
    except (ValueError, KeyError) as e:
        raise ExportError(
            "model_type '%s' is not known to transformers %s (%s)"
            % (model_type, transformers.__version__, str(e).splitlines()[0][:120])
        )
    for k, v in (overrides or {}).items():
        setattr(cfg, k, v)
    cfg._attn_implementation = attn
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = False
    return cfg


def parse_lora(text: str | None) -> dict | None:
    """``r=16,alpha=32,targets=q_proj,v_proj[,dropout=0.05]``: a bare word after ``targets=``
    adds a target."""
    if not text:
        return None
    out = {"r": 16, "alpha": 32, "targets": [], "dropout": 0.0}
    key = None
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        if "=" in part:
            key, val = part.split("=", 1)
            key = key.strip()
            if key in ("r", "rank"):
                out["r"] = _positive_int(val, "lora r")
            elif key in ("alpha", "lora_alpha"):
                out["alpha"] = float(val) if "." in val else _positive_int(val, "lora alpha")
            elif key in ("dropout", "lora_dropout"):
                out["dropout"] = float(val)
            elif key in ("targets", "target_modules"):
                out["targets"].append(val.strip())
            else:
                raise ExportError("--lora: unknown key '%s' (r, alpha, targets, dropout)" % key)
        elif key in ("targets", "target_modules"):
            out["targets"].append(part)
        else:
            raise ExportError("--lora: '%s' is not KEY=VALUE" % part)
    if not out["targets"]:
        raise ExportError("--lora names no targets (targets=q_proj,v_proj)")
    return out


def _positive_int(text: str, what: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise ExportError("%s: '%s' is not an integer" % (what, text))
    if v <= 0:
        raise ExportError("%s must be positive, got %d" % (what, v))
    return v


def build_model(cfg, *, dtype: str = "fp32", lora: dict | None = None, gradient_checkpointing=False,
                qlora=False):
    """The causal LM on the meta device, in training mode; peft's LoRA adapters when asked."""
    import torch
    from transformers import AutoModelForCausalLM

    tdtype = getattr(torch, DTYPES[dtype])
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=tdtype)
    except ValueError as e:
        raise ExportError("transformers cannot build this config: %s" % str(e).splitlines()[0][:200])
    if lora:
        model = _add_lora(model, lora)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _add_lora(model, lora: dict, device: str = "meta"):
    import torch

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ExportError("--lora needs peft (pip install peft)")
    names = {n.split(".")[-1] for n, _ in model.named_modules()}
    missing = [t for t in lora["targets"] if t not in names and t != "all-linear"]
    if missing:
        raise ExportError(
            "LoRA target %s matches no module of this model (its linear layers: %s)"
            % (", ".join(missing), ", ".join(sorted(_linear_names(model))))
        )
    conf = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules=lora["targets"],
                      lora_dropout=lora["dropout"], bias="none", task_type="CAUSAL_LM")
    try:
        with torch.device(device):
            return get_peft_model(model, conf)
    except ValueError as e:
        raise ExportError("peft: %s" % str(e).splitlines()[0][:200])


def _linear_names(model):
    import torch

    return {n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


@contextlib.contextmanager
def _masks_as_eager():
    """transformers builds attention masks as eager PyTorch does while we export: under
    torch.export it materializes the causal mask of every SDPA call (in case the exported graph
    serves other query lengths), where an eager step passes none and SDPA runs with
    ``is_causal=True`` without saving one (a [S, S] float mask per layer: Qwen2-style, seq 2048,
    16 MiB a layer). The file is for one sequence length and unpacked sequences (position ids
    0..S-1), so its mask is the eager one."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    patches = {
        # an eager step skips the mask where it can: not while exporting
        "is_torchdynamo_exporting": lambda: False,
        # position ids 0..S-1 (none given) are no packed sequences: eager finds that from their
        # values, which a trace cannot read, so it would mask per packed sequence
        "find_packed_sequence_indices": lambda position_ids: None,
    }
    saved = {k: getattr(masking_utils, k) for k in patches if hasattr(masking_utils, k)}
    for k in saved:
        setattr(masking_utils, k, patches[k])
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(masking_utils, k, v)


def export_hf(spec: str, path: str, *, dtype="fp32", seq=2048, labels=False, attn="sdpa",
              lora=None, gradient_checkpointing=False, overrides=None, batch=2, verbose=False):
    """Export a causal LM from its config (see ``resolve_config``) as a shape-only ONNX file:
    input ``input_ids [batch, seq]`` (and ``labels`` of the same shape with ``labels=True``), the
    batch dynamic. Returns ``core.Exported``."""
    import torch

    if dtype not in DTYPES:
        raise ExportError("--dtype must be one of %s" % ", ".join(DTYPES))
    if attn not in ("eager", "sdpa"):
        raise ExportError("--attn must be eager or sdpa")
    if not isinstance(seq, int) or seq <= 0:
        raise ExportError("--seq must be a positive integer")
    d, source = (dict(spec), "a config given in Python") if isinstance(spec, dict) else resolve_config(spec)
    cfg = build_config(d, attn=attn, overrides=overrides)
    if hasattr(cfg, "_experts_implementation"):
        cfg._experts_implementation = "eager"
    limit = getattr(cfg, "max_position_embeddings", None)
    notes = []
    if limit and seq > limit:
        notes.append("sequence %d is over the config's max_position_embeddings %d" % (seq, limit))
    lora_spec = parse_lora(lora) if isinstance(lora, str) else lora
    model = build_model(cfg, dtype=dtype, lora=lora_spec, gradient_checkpointing=gradient_checkpointing)
    moe = prepare_moe(model)
    ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")
    kwargs = {"input_ids": ids, "use_cache": False, "return_dict": False}
    input_names, output_names = ["input_ids"], ["logits"]
    if labels:
        kwargs["labels"] = torch.zeros((batch, seq), dtype=torch.long, device="meta")
        input_names, output_names = ["input_ids", "labels"], ["loss", "logits"]
    if any(k in d for k in ("num_experts", "num_local_experts", "n_routed_experts")) and not moe:
        hint = ("this model's mixture-of-experts layers are not stacked expert banks "
                "(gate_up_proj, down_proj [experts, ...]), the kind memplan-export exports")
    else:
        hint = "try --attn eager" if attn == "sdpa" else "try --attn sdpa, or fewer options"
    with _masks_as_eager():
        prog = export_program(model, (), kwargs, input_names=None, output_names=output_names,
                              batch_dim=0, verbose=verbose, hint=hint,
                              translations=translation_table(moe))
    meta = {
        "memplan.exported_by": "memplan-export",
        "memplan.config": source,
        "memplan.model_type": cfg.model_type,
        "memplan.dtype": dtype,
        "memplan.seq": str(seq),
        "memplan.attn": attn,
        "memplan.loss": "graph" if labels else "none",
    }
    if moe:
        meta["memplan.moe"] = json.dumps(moe)
    if lora_spec:
        meta["memplan.lora"] = json.dumps(lora_spec)
    if gradient_checkpointing:
        meta["memplan.gradient_checkpointing"] = "every-block"
    out = to_shape_only(prog, path, meta)
    out.notes.extend(notes)
    return out
