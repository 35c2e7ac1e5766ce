"""memplan-export: shape-only files that keep every parameter's name, dtype and dims, the
committed configs, and one-line errors. Runs wherever torch, transformers, onnx and onnxscript are
installed (peft for the LoRA cases); memplan itself is used where it is built
(target/release/memplan or MEMPLAN)."""

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))

from memplan_export import ExportError, committed_names, export, export_hf  # noqa: E402
from memplan_export.cli import main as cli_main  # noqa: E402
from memplan_export.hf import parse_lora  # noqa: E402

SMALL = {"num_hidden_layers": 1}


def memplan_binary():
    for p in (os.environ.get("MEMPLAN"), os.path.join(ROOT, "target", "release", "memplan"),
              os.path.join(ROOT, "target", "debug", "memplan")):
        if p and os.path.exists(p):
            return p
    return None


def profile(path, *flags):
    exe = memplan_binary()
    if exe is None:
        pytest.skip("memplan is not built")
    out = subprocess.run([exe, "profile", path, "--batch", "1", "--train", "--json", *flags],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 32)
        self.norm = torch.nn.BatchNorm1d(32)
        self.out = torch.nn.Linear(32, 4, bias=False)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.fc(x))))


def test_any_module_exports_shape_only(tmp_path):
    path = str(tmp_path / "tiny.onnx")
    ex = export(Tiny, (torch.zeros(8, 16),), path)
    m = onnx.load(path)
    inits = {t.name: t for t in m.graph.initializer}
    want = dict(Tiny().named_parameters())
    for name, p in want.items():
        assert name in inits, name
        t = inits[name]
        assert list(t.dims) == list(p.shape)
        assert t.data_type == onnx.TensorProto.FLOAT
        assert not t.raw_data and not t.float_data and not t.external_data
    assert ex.parameters == len(want)
    assert ex.parameter_elements == sum(p.numel() for p in want.values())
    # BatchNorm's running statistics are buffers: marked so, they never train
    kinds = {vi.name: {p.key: p.value for p in vi.metadata_props} for vi in m.graph.value_info}
    assert kinds["norm.running_mean"]["pkg.torch.export.graph_signature.InputSpec.kind"] == "BUFFER"
    assert kinds["fc.weight"]["pkg.torch.export.graph_signature.InputSpec.kind"] == "PARAMETER"
    # the batch is dynamic and named so
    assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    j = profile(path)
    # floating initializers: the weights and the running statistics (num_batches_tracked is int64)
    assert j["params"]["count"] == sum(p.numel() for p in Tiny().parameters()) + 32 * 2


def test_the_factory_runs_on_the_meta_device(tmp_path):
    seen = []

    def factory():
        m = Tiny()
        seen.append(m.fc.weight.device.type)
        return m

    export(factory, (torch.zeros(2, 16),), str(tmp_path / "t.onnx"))
    assert seen == ["meta"]


MOE = {"mixtral-8x7b", "qwen3-30b-a3b"}


@pytest.mark.parametrize("name", committed_names())
def test_every_committed_name_exports(tmp_path, name):
    path = str(tmp_path / (name + ".onnx"))
    ex = export_hf(name, path, seq=64, overrides={"num_hidden_layers": 2})
    assert ex.parameters > 0 and os.path.getsize(path) < 8 << 20
    m = onnx.load(path)
    assert all(not t.raw_data for t in m.graph.initializer)
    meta = {p.key: p.value for p in m.metadata_props}
    j = profile(path)
    assert j["training"]["peak_bytes"] > j["params"]["bytes"]
    if name in MOE:
        # the experts are sized by the routing assumption, which memplan states
        moe = json.loads(meta["memplan.moe"])
        assert j["moe_routing"]["assumption"] == "balanced"
        assert j["moe_routing"]["experts"] == moe["experts"]
        assert j["moe_routing"]["top_k"] == moe["top_k"]
        assert j["moe_routing"]["selections"] == 2 * moe["experts"]
    else:
        assert "memplan.moe" not in meta and "moe_routing" not in j


def test_committed_config_numbers():
    from memplan_export.hf import resolve_config

    d, _ = resolve_config("meta-llama/Llama-3.1-8B")
    assert (d["hidden_size"], d["num_hidden_layers"], d["num_key_value_heads"], d["vocab_size"]) == (
        4096, 32, 8, 128256)
    d, _ = resolve_config("Qwen3-30B-A3B")
    assert (d["num_experts"], d["num_experts_per_tok"]) == (128, 8)


def test_labels_give_the_loss_first(tmp_path):
    path = str(tmp_path / "q.onnx")
    export_hf("qwen3-8b", path, seq=32, labels=True, overrides=SMALL)
    m = onnx.load(path)
    assert [o.name for o in m.graph.output] == ["loss", "logits"]
    assert [i.name for i in m.graph.input] == ["input_ids", "labels"]
    j = profile(path, "--loss", "graph")
    # the loss is the graph's own: backward starts at it
    assert j["training"]["saved_activation_bytes"] > 0
    assert j["training"]["flops_per_step"] > 2 * j["flops"]["forward"]


def test_bf16_keeps_the_models_float32_upcasts(tmp_path):
    path = str(tmp_path / "b.onnx")
    export_hf("llama-3.1-8b", path, seq=32, dtype="bf16", overrides=SMALL)
    m = onnx.load(path)
    assert all(t.data_type == onnx.TensorProto.BFLOAT16 for t in m.graph.initializer
               if t.name.endswith("weight"))
    casts = [n for n in m.graph.node if n.op_type == "Cast"
             and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT for a in n.attribute)]
    assert casts, "RMSNorm's float32 variance is a Cast in a bf16 export"


def test_lora_adapters_are_exported(tmp_path):
    pytest.importorskip("peft")
    path = str(tmp_path / "l.onnx")
    export_hf("llama-3.1-8b", path, seq=32, lora="r=8,alpha=16,targets=q_proj,v_proj", overrides=SMALL)
    names = [t.name for t in onnx.load(path).graph.initializer]
    lora = [n for n in names if "lora_" in n]
    assert len(lora) == 4, lora  # A and B for q_proj and v_proj of one layer
    j = profile(path, "--trainable", "lora_")
    # q_proj 4096 -> 4096 and v_proj 4096 -> 1024 (8 kv heads of 128), rank 8, float32
    assert j["training"]["trainable_params_bytes"] == 4 * 8 * (4096 + 4096 + 4096 + 1024)


def test_lora_spec_parsing():
    assert parse_lora("r=16,alpha=32,targets=q_proj,v_proj") == {
        "r": 16, "alpha": 32, "targets": ["q_proj", "v_proj"], "dropout": 0.0}
    with pytest.raises(ExportError):
        parse_lora("r=16")
    with pytest.raises(ExportError):
        parse_lora("r=0,targets=q_proj")
    with pytest.raises(ExportError):
        parse_lora("rank16,targets=q_proj")


def test_a_lora_target_that_matches_nothing_is_one_line(tmp_path):
    pytest.importorskip("peft")
    with pytest.raises(ExportError) as e:
        export_hf("llama-3.1-8b", str(tmp_path / "x.onnx"), seq=16, lora="targets=qkv", overrides=SMALL)
    assert "qkv" in str(e.value) and "q_proj" in str(e.value) and "\n" not in str(e.value)


def test_bad_input_is_one_line_and_exit_1(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "no_such_model", "hidden_size": 8}))
    out = str(tmp_path / "o.onnx")
    for argv in (["--hf", str(cfg), "-o", out],
                 ["--hf", "not-a-model", "-o", out],
                 ["--hf", str(tmp_path), "-o", out],
                 ["--hf", "qwen3-8b", "--seq", "0", "-o", out]):
        assert cli_main(argv) == 1, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("memplan-export: ") and "\n" not in err, err
        assert not os.path.exists(out)
    assert "no_such_model" in _err(tmp_path, capsys, ["--hf", str(cfg), "-o", out])


def _err(tmp_path, capsys, argv):
    cli_main(argv)
    return capsys.readouterr().err


def test_an_existing_output_is_kept(tmp_path, capsys):
    out = tmp_path / "keep.onnx"
    out.write_bytes(b"precious")
    assert cli_main(["--hf", "qwen3-8b", "--set", "num_hidden_layers=1", "--seq", "16", "-o", str(out)]) == 1
    assert out.read_bytes() == b"precious"
    assert "--force" in capsys.readouterr().err


def test_moe_experts_are_written_directly_and_sized_by_routing(tmp_path):
    """A Mixtral-style bank exports as one custom op whose translation writes the eager loop:
    one NonZero per expert and layer, no traced loop; memplan sizes the experts by
    --moe-routing and refuses the flag on a dense model."""
    cfg = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "num_local_experts": 4,
           "num_experts_per_tok": 2}
    path = str(tmp_path / "moe.onnx")
    export_hf(cfg, path, seq=32, labels=True)
    m = onnx.load(path)
    meta = json.loads({p.key: p.value for p in m.metadata_props}["memplan.moe"])
    assert meta["written"] == "directly" and meta["experts"] == 4 and meta["layers"] == 2
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("NonZero") == 2 * 4
    assert "SplitToSequence" not in ops  # the traced loop's chunk
    worst = profile(path, "--loss", "graph", "--moe-routing", "worst")
    balanced = profile(path, "--loss", "graph")
    assert balanced["moe_routing"]["max_expert_tokens"] == 32 * 2 // 4
    assert worst["moe_routing"]["max_expert_tokens"] == 32
    exe = memplan_binary()
    dense = str(tmp_path / "dense.onnx")
    export_hf("llama-3.1-8b", dense, seq=16, overrides=SMALL)
    out = subprocess.run([exe, "profile", dense, "--batch", "1", "--moe-routing", "worst"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "no mixture-of-experts routing" in out.stderr
