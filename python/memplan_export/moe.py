"""Mixture-of-experts layers, exported as transformers' eager experts compute them.

transformers' eager experts (``MixtralExperts.forward``, ``Qwen3MoeExperts.forward``) loop over
the experts a batch hits: for each, ``where`` finds its tokens (a data-dependent count), the
tokens are gathered, run through the expert's SwiGLU MLP, weighted and added back with
``index_add_``. A loop over data cannot export, and tracing the loop over every expert costs
about a third of a second per expert (Qwen3-30B-A3B: 48 layers of 128 experts, about half an
hour). So each expert bank becomes one custom op, ``memplan::moe_experts``, and its ONNX
translation writes the same computation for every expert directly:

    slots  = NonZero(Equal(Reshape(top_k_index, [-1]), e))     the data-dependent count
    tokens = Div(slots, k)                                     (memplan: --moe-routing)
    h      = Gemm(Gather(hidden, tokens), gate_up[e], transB)  split into gate, up
    h      = Gemm(silu(gate) * up, down[e], transB) * Gather(weights, slots)
    out    = ScatterND(out, tokens, h, reduction=add)          index_add_

These are the tensors the eager loop makes, saves and frees, expert by expert (checked against
PyTorch with a forced router: tools/llm/reference.py, mixtral and qwen3_moe). Other activations
than SiLU, or banks of another layout, fall back to tracing the loop.
"""



_OP = None


def _custom_op():
    """``torch.ops.memplan.moe_experts``, registered once, with a shape-only (fake) kernel: the
    model is built on the meta device and never runs."""
    global _OP
    if _OP is not None:
        return _OP
    import torch

    @torch.library.custom_op("memplan::moe_experts", mutates_args=())
    def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("memplan::moe_experts only exports (memplan-export); it does not run")

    @moe_experts.register_fake
    def _(hidden, top_k_index, top_k_weights, gate_up, down):
        return torch.empty_like(hidden)

    _OP = torch.ops.memplan.moe_experts.default
    return _OP


def _bank_forward(self, hidden_states, top_k_index, top_k_weights):
    return _custom_op()(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


def _loop_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' eager experts over every expert (traced: slow, for banks the custom op
    does not cover)."""
    import torch
    import torch.nn.functional as F

    final = torch.zeros_like(hidden_states)
    for e in range(self.num_experts):
        token_idx, top_k_pos = torch.where(top_k_index == e)
        current = hidden_states[token_idx]
        gate, up = F.linear(current, self.gate_up_proj[e]).chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        h = F.linear(h, self.down_proj[e])
        h = h * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, h.to(final.dtype))
    return final


def experts_modules(model):
    """The expert banks: modules holding stacked ``gate_up_proj [E, 2I, H]`` and ``down_proj
    [E, H, I]`` weights (Mixtral, Qwen3-MoE, ...)."""
    return [m for m in model.modules()
            if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj") and hasattr(m, "num_experts")
            and getattr(m.gate_up_proj, "dim", lambda: 0)() == 3]


def _is_silu(m) -> bool:
    import torch

    act = getattr(m, "act_fn", None)
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


def prepare(model):
    """Points every expert bank at an exportable forward. Returns what the file's metadata says
    of them (experts, top-k, layers), or None for a dense model."""
    banks = experts_modules(model)
    if not banks:
        return None
    direct = all(_is_silu(m) and not getattr(m, "has_bias", False) for m in banks)
    for m in banks:
        m.forward = (_bank_forward if direct else _loop_forward).__get__(m)
    return {"experts": banks[0].num_experts, "top_k": getattr(model.config, "num_experts_per_tok", None),
            "layers": len(banks), "implementation": "transformers eager (a loop over experts)",
            "written": "directly" if direct else "traced"}


def translation_table(moe) -> dict | None:
    """``custom_translation_table`` for torch.onnx.export when the banks use the custom op."""
    if not moe or moe.get("written") != "directly":
        return None
    return {_custom_op(): _experts_onnx}


def _experts_onnx(hidden, top_k_index, top_k_weights, gate_up, down):
    """The eager loop over every expert, written as ONNX (see the module docs). Shapes are
    static but the token count: E and 2I come from the weights."""
    from onnxscript import opset18 as op

    experts, two_inter = gate_up.shape[0], gate_up.shape[1]
    inter = two_inter // 2
    top_k = top_k_index.shape[-1]
    hidden_type, weights_type = _onnx_type(hidden), _onnx_type(top_k_weights)

    def ints(*v):
        return op.Constant(value_ints=list(v))

    final = op.Expand(op.CastLike(op.Constant(value_float=0.0), hidden), op.Shape(hidden))
    flat_index = op.Reshape(top_k_index, ints(-1))
    flat_weights = op.Reshape(top_k_weights, ints(-1, 1))
    k = op.Constant(value_int=top_k)
    for e in range(experts):
        at = op.Constant(value_int=e)
        slots = op.Squeeze(op.NonZero(op.Equal(flat_index, at)), ints(0))
        tokens = op.Div(slots, k)
        gu = op.Gemm(op.Gather(hidden, tokens, axis=0), op.Gather(gate_up, at, axis=0), transB=1)
        gate = op.Slice(gu, ints(0), ints(inter), ints(1))
        up = op.Slice(gu, ints(inter), ints(two_inter), ints(1))
        h = op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)
        h = op.Gemm(h, op.Gather(down, at, axis=0), transB=1)
        w = op.Gather(flat_weights, slots, axis=0)
        if weights_type == hidden_type:
            h = op.Mul(h, w)
        else:  # bf16 experts, float32 router weights: PyTorch promotes, then casts back
            h = op.Cast(op.Mul(op.Cast(h, to=weights_type), w), to=hidden_type)
        final = op.ScatterND(final, op.Unsqueeze(tokens, ints(1)), h, reduction="add")
    return final


def _onnx_type(v) -> int:
    """The ONNX element type (TensorProto enum) of a value being translated."""
    t = v.dtype
    return int(getattr(t, "value", t))
