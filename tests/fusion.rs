//! Patterns PyTorch runs as one op where the exporter writes several, saved as
//! PyTorch saves them (src/train/fusion.rs): memplan's saved-activation bytes equal,
//! to the byte, what eager PyTorch saved for the same models.
//!
//! Data: tests/data/fusion/export.py wrote the .onnx files and saved.json (PyTorch
//! 2.15, CPU, float32, no dropout, so CUDA saves the same): Linear layers around each
//! pattern, weights from `torch.manual_seed(0)`, exported by `torch.onnx.export` in
//! training mode; saved.json holds the bytes a `saved_tensors_hooks` pack hook saw
//! in one forward + mean loss (distinct storages, parameters excluded, the input
//! included: models/export.py's `_saved_analysis`), at batch 2 and 4.
//!
//! - `layernorm_opset16`: `nn.LayerNorm` affine, without affine and without bias,
//!   decomposed by the exporter at opset 16 (ReduceMean, Sub, Pow, ReduceMean, Add,
//!   Sqrt, Div [, Mul] [, Add]): saved as `native_layer_norm` saves (input, per-row
//!   mean and rstd): 117760 bytes at batch 2, where the nodes' own rules gave
//!   148992.
//! - `rmsnorm_llama` (TorchScript: rsqrt as `Div(1, Sqrt)`), `rmsnorm_llama_dynamo`
//!   (rsqrt as `Reciprocal(Sqrt)`): transformers' LlamaRMSNorm, which PyTorch runs
//!   op by op; only `torch.rsqrt`, one op written as two, is a pattern (the rules
//!   saved the square root too: 66560 bytes at batch 2 for PyTorch's 66048). The
//!   same pattern makes models/llama_small.onnx's saved bytes PyTorch's exactly
//!   (tests/data/pytorch/training_reference.json).
//! - `rmsnorm_div`: RMSNorm as `x / torch.sqrt(·)`: no pattern, the rules already
//!   save what eager saves.
//! - `silu`, `gelu_tanh`: `F.silu` (exported as Sigmoid + Mul) and
//!   `F.gelu(approximate="tanh")` written out at opset 17: only the input saved.
//!
//! - `qat_convnet`: torch.ao.quantization's eager QAT (prepare_qat: a float stem
//!   Conv2d, QuantStub, qat.ConvReLU2d with its weight fake-quantized per channel,
//!   qat.Linear per tensor, activations in PyTorch's reduce_range `(0, 127)`, the
//!   exporter's `Clip`); `fake_quant_fn`: `torch.fake_quantize_per_tensor_affine`
//!   (Python scalars, and tensor qparams) and `torch.fake_quantize_per_channel_affine`
//!   of a weight between Linear layers. Each QuantizeLinear → [Clip →]
//!   DequantizeLinear is one fake quantization saving its bool mask (1 byte per
//!   element) as `FakeQuantize*CachemaskBackward0` does, and nothing else: 44372
//!   bytes at batch 2 for qat_convnet, 62464 for fake_quant_fn, as PyTorch.
//!
//! - `groupnorm`, `groupnorm_dynamo`: `nn.GroupNorm` (2 groups, 1, 4 without
//!   affine) after Conv2d layers, as the TorchScript and dynamo exporters write it
//!   (Reshape, InstanceNormalization, Reshape, Mul, Add): saved as
//!   `native_group_norm` saves (input, per-group mean and rstd).
//! - `weightnorm`: `torch.nn.utils.parametrizations.weight_norm` on Conv1d layers
//!   (dim 2 as wav2vec 2.0, dim 0) and a Linear, exported as `ReduceL2`, `Div`,
//!   `Mul`: saved as `_weight_norm_interface` saves (the norms).
//!
//! Each model's training step also runs on the CPU executor: `memplan verify
//! --batch 2 --optimizer sgd --budget 0.9 --json` measures the peak predicted, for
//! the no-recompute baseline and for the plan, with identical gradients.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::sgd_schedule;
use memplan::train::{FusedKind, Schedule};
use serde_json::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/fusion")
}

fn saved_json() -> Value {
    let text = std::fs::read_to_string(dir().join("saved.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn schedule(name: &str, batch: u64) -> Schedule {
    sgd_schedule(&dir().join(format!("{name}.onnx")), batch)
}

/// Checks `name` against PyTorch at both batches and returns the batch-2 schedule.
fn saved_as_pytorch(name: &str) -> Schedule {
    let r = saved_json();
    for b in [4u64, 2] {
        let s = schedule(name, b);
        let want = r[name][format!("batch_{b}")]["saved_bytes"]
            .as_u64()
            .unwrap_or_else(|| panic!("saved.json has no {name} batch {b}"));
        assert_eq!(
            s.saved_activation_bytes(),
            want,
            "{name} batch {b}: memplan's saved bytes, PyTorch's"
        );
        if b == 2 {
            return s;
        }
    }
    unreachable!()
}

/// The patterns of `kind` in `s`, by node count.
fn sizes(s: &Schedule, kind: FusedKind) -> Vec<usize> {
    s.fused
        .iter()
        .filter(|p| p.kind == kind)
        .map(|p| p.nodes.len())
        .collect()
}

/// `memplan verify MODEL --batch 2 --optimizer sgd --budget 0.9 --json`: the CPU
/// step's measured peak is the predicted one, baseline and planned, gradients and
/// updated parameters identical, something recomputed within the budget.
fn verifies(name: &str) {
    verifies_under(name, "0.9", true);
}

/// [`verifies`] under `budget`; `recomputes`: whether the plan must recompute.
fn verifies_under(name: &str, budget: &str, recomputes: bool) {
    let model = dir().join(format!("{name}.onnx"));
    let out = Command::new(env!("CARGO_BIN_EXE_memplan"))
        .arg("verify")
        .arg(&model)
        .args([
            "--batch",
            "2",
            "--optimizer",
            "sgd",
            "--budget",
            budget,
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["baseline_measured_peak_bytes"], v["baseline_predicted_peak_bytes"],
        "{name}: baseline {v}"
    );
    assert_eq!(
        v["measured_peak_bytes"], v["predicted_peak_bytes"],
        "{name}: planned {v}"
    );
    assert!(
        v["measured_peak_bytes"].as_u64() <= v["budget_bytes"].as_u64(),
        "{name}: {v}"
    );
    assert_eq!(
        v["recomputations"].as_u64().unwrap() > 0,
        recomputes,
        "{name}: {v}"
    );
    assert_eq!(v["gradients_identical"], true, "{name}: {v}");
    assert_eq!(v["updated_params_identical"], true, "{name}: {v}");
}

/// Decomposed `nn.LayerNorm` (opset 16): each norm reads its input and the graph's
/// per-row mean and square root (the bytes of PyTorch's float32 mean and rstd);
/// the inner nodes save nothing.
#[test]
fn decomposed_layer_norm_saves_as_native_layer_norm() {
    let s = saved_as_pytorch("layernorm_opset16");
    // Affine (· weight + bias), no affine, weight only.
    assert_eq!(sizes(&s, FusedKind::LayerNorm), vec![9, 7, 8]);
    for p in s.fused.iter().filter(|p| p.kind == FusedKind::LayerNorm) {
        let [x, mean, sd] = p.reads[..] else {
            panic!("{p:?}")
        };
        let bytes = |t: usize| s.storages[s.tensor_storage[t]].bytes;
        assert_eq!(bytes(x), 2 * 64 * 32 * 4);
        assert_eq!((bytes(mean), bytes(sd)), (2 * 64 * 4, 2 * 64 * 4));
    }
    verifies("layernorm_opset16");
}

/// transformers' LlamaRMSNorm, through both exporters: eager runs it op by op, and
/// only rsqrt (`Div(1, Sqrt)` or `Reciprocal(Sqrt)`) is one op written as two.
#[test]
fn llama_rms_norm_saves_as_eager() {
    for name in ["rmsnorm_llama", "rmsnorm_llama_dynamo"] {
        let s = saved_as_pytorch(name);
        assert_eq!(sizes(&s, FusedKind::Rsqrt), vec![5], "{name}");
        verifies(name);
    }
}

/// RMSNorm as `x / torch.sqrt(·)`: eager saves what the nodes' rules save (the
/// square root's result, the dividend and divisor), so nothing is fused.
#[test]
fn rms_norm_with_division_is_left_op_by_op() {
    let s = saved_as_pytorch("rmsnorm_div");
    assert!(s.fused.is_empty(), "{:?}", s.fused);
    // Its peak is the division's backward, which holds four output-sized tensors
    // (`DivBackward0`'s divisor gradient): no recompute lowers it, so the step runs
    // unplanned, its scratch measured as predicted.
    verifies_under("rmsnorm_div", "1MiB", false);
}

/// `F.silu` as Sigmoid + Mul: `SiluBackward0` saves only the input.
#[test]
fn silu_saves_as_pytorch() {
    let s = saved_as_pytorch("silu");
    assert_eq!(sizes(&s, FusedKind::Silu), vec![2, 2]);
    verifies("silu");
}

/// `F.gelu(approximate="tanh")` written out: `GeluBackward0` saves only the input.
#[test]
fn tanh_gelu_saves_as_pytorch() {
    let s = saved_as_pytorch("gelu_tanh");
    assert_eq!(sizes(&s, FusedKind::GeluTanh), vec![9, 9]);
    verifies("gelu_tanh");
}

/// QAT fake quantization: every QuantizeLinear → [Clip →] DequantizeLinear pair
/// (with the zero point's Cast, a Python scalar's Constant and Cast, the Clip's
/// bound) is one fake quantization whose backward reads only its bool mask, the
/// integer values views costing nothing; the fake-quantized weights and
/// activations are saved by the layers that read them, as in PyTorch.
#[test]
fn fake_quantization_saves_its_mask_as_pytorch() {
    let s = saved_as_pytorch("qat_convnet");
    // QuantStub's (0, 127) activation, the conv weight per channel, the ConvReLU's
    // activation, the Linear's weight per tensor, its activation.
    assert_eq!(sizes(&s, FusedKind::FakeQuant), vec![5, 3, 5, 3, 5]);
    let masks: Vec<u64> = s
        .fused
        .iter()
        .filter(|p| p.kind == FusedKind::FakeQuant)
        .map(|p| p.extras[0].bytes().unwrap())
        .collect();
    assert_eq!(
        masks,
        vec![2 * 8 * 64, 8 * 8 * 9, 2 * 8 * 64, 10 * 512, 2 * 10]
    );
    verifies("qat_convnet");
    let s = saved_as_pytorch("fake_quant_fn");
    // Python scalars (two Constants and two Casts), the weight per channel, tensor
    // qparams.
    assert_eq!(sizes(&s, FusedKind::FakeQuant), vec![6, 3, 3]);
    verifies("fake_quant_fn");
}

/// `nn.GroupNorm` as both exporters write it (Reshape, InstanceNormalization with
/// constant ones and zeros, Reshape back, `Mul(weight)`, `Add(bias)`, the affine
/// operands through Unsqueeze): saved as `native_group_norm` saves (the input and
/// the float32 mean and rstd per image and group); the normalized activation the
/// weight's gradient would read is not saved. Three norms per model: 2 groups, 1
/// group, 4 groups without affine (the exporters multiply by constant ones and add
/// zeros).
#[test]
fn exported_group_norm_saves_as_native_group_norm() {
    for name in ["groupnorm", "groupnorm_dynamo"] {
        let s = saved_as_pytorch(name);
        let norms: Vec<_> = s
            .fused
            .iter()
            .filter(|p| p.kind == FusedKind::GroupNorm)
            .collect();
        assert_eq!(norms.len(), 3, "{name}: {norms:?}");
        for (p, groups) in norms.iter().zip([2, 1, 4]) {
            // Reshape, InstanceNormalization, Reshape, Mul, Add and the Unsqueezes.
            assert!(p.nodes.len() >= 5, "{name}: {p:?}");
            let [x] = p.reads[..] else { panic!("{p:?}") };
            assert_eq!(s.storages[s.tensor_storage[x]].bytes, 2 * 8 * 64 * 4);
            let stats: Vec<_> = p.extras.iter().map(|f| f.shape.clone()).collect();
            assert_eq!(stats, vec![vec![2, groups]; 2], "{name}");
        }
        verifies(name);
    }
}

/// Weight normalization over the first or last dim (`ReduceL2`, `Div`, `Mul`):
/// saved as `_weight_norm_interface` saves (the norms; `v` and `g` are parameters),
/// not the `v / ‖v‖` quotient the `Mul`'s rule would keep for `g`'s gradient. The
/// normalized weights themselves are saved by the layers that read them, as in
/// PyTorch (the convolutions' weights, the Linear's transposed `mat2`).
#[test]
fn weight_norm_saves_only_the_norms() {
    let s = saved_as_pytorch("weightnorm");
    assert_eq!(sizes(&s, FusedKind::WeightNorm), vec![3, 3, 3]);
    for p in s.fused.iter().filter(|p| p.kind == FusedKind::WeightNorm) {
        let [n] = p.reads[..] else { panic!("{p:?}") };
        // The Conv1d over dim 2: 5 norms; over dim 0: 16 and 10.
        assert!(
            [5 * 4, 16 * 4, 10 * 4].contains(&s.storages[s.tensor_storage[n]].bytes),
            "{p:?}"
        );
    }
    verifies("weightnorm");
}
