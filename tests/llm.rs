//! Decoder LLMs at sequence 2048 against what PyTorch measured for the same step
//! (tests/data/pytorch/llm_reference.json, written by `python tools/llm/reference.py` on CPU,
//! float32): six dense families covering GQA, RoPE, SwiGLU and GeGLU, RMSNorm,
//! qk-norm, sliding-window attention, tied and untied embeddings, Hugging Face's
//! in-model cross-entropy (`--loss graph`), and eager and SDPA attention; LoRA and
//! QLoRA (bitsandbytes NF4) on the llama config; two mixture-of-experts families with
//! their routers forced to memplan's routing assumption. The models are the
//! shape-only files `memplan-export` wrote from the same configs (models/llm/), read
//! as a user reads them: `memplan profile FILE --train --json`. Saved activations
//! within 2 %, the step's peak within 5 %, at batch 1 and 2, SGD and AdamW.

mod common;

use serde_json::Value;

fn reference() -> serde_json::Map<String, Value> {
    reference_from("llm_reference.json")
}

fn reference_from(file: &str) -> serde_json::Map<String, Value> {
    common::json_object(file)
}

/// `memplan profile` of a reference entry's file at `batch` with `optimizer`: its
/// `training` object.
fn profile(entry: &Value, batch: u64, optimizer: &str) -> Value {
    let file = common::shipped(
        entry["file"]
            .as_str()
            .unwrap()
            .strip_prefix("models/")
            .unwrap(),
    );
    let b = batch.to_string();
    let mut args = vec![
        "profile",
        file.to_str().unwrap(),
        "--batch",
        &b,
        "--train",
        "--optimizer",
        optimizer,
        "--json",
    ];
    if entry["loss"] == "graph" {
        args.extend(["--loss", "graph"]);
    }
    if entry["dtype"] == "bfloat16" {
        args.extend(["--precision", "bf16"]);
    }
    if let Some(pattern) = entry["trainable"].as_str() {
        args.extend(["--trainable", pattern]);
    }
    if let Some(wd) = entry["weight_dtype"].as_str() {
        args.extend(["--weight-dtype", wd]);
    }
    if let Some(routing) = entry["moe_routing"].as_str() {
        args.extend(["--moe-routing", routing]);
    }
    common::memplan_json(&args)["training"].clone()
}

/// Every family of a reference file at each batch measured, SGD and AdamW: saved
/// bytes within 2 % and the step's peak within 5 %. Returns how many families.
fn matches_pytorch(file: &str) -> usize {
    let mut report = Vec::new();
    let mut failed = Vec::new();
    let mut families = 0;
    for (name, r) in reference_from(file)
        .iter()
        .filter(|(k, _)| !k.starts_with('_'))
    {
        families += 1;
        let batches: Vec<u64> = [1u64, 2]
            .into_iter()
            .filter(|b| r.get(format!("batch_{b}")).is_some())
            .collect();
        if batches.is_empty() {
            failed.push(format!("{name}: no batch measured"));
        }
        for b in batches {
            let x = &r[format!("batch_{b}")];
            let want_saved = x["saved_bytes_cuda_equivalent"].as_u64().unwrap();
            for opt in ["sgd", "adamw"] {
                let t = profile(r, b, opt);
                let saved = t["saved_activation_bytes"].as_u64().unwrap();
                let peak = t["peak_bytes"].as_u64().unwrap();
                let want_peak = common::device_equivalent_peak(&x[opt]);
                let ds = saved as f64 / want_saved as f64 - 1.0;
                let dp = peak as f64 / want_peak as f64 - 1.0;
                let line = format!(
                    "{name} b{b} {opt}: saved {:+.3}% ({saved} vs {want_saved}), peak {:+.3}% ({peak} vs {want_peak})",
                    ds * 100.0,
                    dp * 100.0
                );
                if ds.abs() > 0.02 || dp.abs() > 0.05 {
                    failed.push(line.clone());
                }
                report.push(line);
                assert_eq!(
                    t["grads_bytes"].as_u64(),
                    x["grads_bytes"].as_u64(),
                    "{name} b{b}: gradients"
                );
            }
        }
    }
    println!("{}", report.join("\n"));
    assert!(
        failed.is_empty(),
        "outside 2 % / 5 %:\n{}",
        failed.join("\n")
    );
    families
}

#[test]
fn llm_families_match_pytorch_at_sequence_2048() {
    let families = matches_pytorch("llm_reference.json");
    assert!(families >= 6, "{families} families");
}

/// The llama and qwen3 configs built in bfloat16 and stepped on the CPU
/// (tests/data/pytorch/llm_reference_bf16.json), against their bf16 exports under
/// `--precision bf16`: Hugging Face's `softmax(x, dtype=float32)` computes and saves
/// in float32, which the exporter writes as a cast after the softmax
/// ([`memplan::infer::lower`] swaps them back).
#[test]
fn bf16_llm_families_match_pytorch() {
    assert!(matches_pytorch("llm_reference_bf16.json") >= 2);
}

/// A file exported in bfloat16 (models/llm/llama_bfloat16.onnx, the llama family after
/// `--dtype bf16`) holds the model's own float32 upcasts as Casts; `--precision bf16`
/// keeps them, so it saves more than the float32 export retyped to bfloat16
/// (measured: 1,005,150,216 against 449,368,064 B at batch 1; PyTorch saves
/// 1,005,150,208), and profiling it under another precision warns.
#[test]
fn a_bf16_export_trains_as_written() {
    let saved = |file: &str| {
        let f = common::shipped(file);
        let t = common::memplan_json(&[
            "profile",
            f.to_str().unwrap(),
            "--batch",
            "1",
            "--train",
            "--optimizer",
            "sgd",
            "--precision",
            "bf16",
            "--json",
        ]);
        t["training"]["saved_activation_bytes"].as_u64().unwrap()
    };
    let (written, retyped) = (saved("llm/llama_bfloat16.onnx"), saved("llm/llama.onnx"));
    assert!(
        written > retyped + retyped / 2,
        "bf16 export {written} B, fp32 export retyped {retyped} B"
    );
    let f = common::shipped("llm/llama_bfloat16.onnx");
    let (ok, _, err) =
        common::run_memplan(&["profile", f.to_str().unwrap(), "--batch", "1", "--train"]);
    assert!(ok, "{err}");
    assert!(
        err.contains("warning") && err.contains("--precision bf16"),
        "{err}"
    );
}

/// A mixture-of-experts file (models/llm/mixtral.onnx: 8 experts, top-2, sequence
/// 2048) is sized by the routing assumption, which the output states: balanced gives
/// each expert T·k/E tokens, capacity=2 twice that, worst one expert every token.
/// Every routing holds T·k rows in all, so balanced and worst save the same bytes
/// (as PyTorch measured with the router forced to each: tests/data/pytorch/llm_reference.json,
/// mixtral and mixtral_worst); capacity=2 sizes every expert at twice its share.
#[test]
fn moe_routing_sizes_the_experts_and_is_stated() {
    let file = common::shipped("llm/mixtral.onnx");
    let run = |routing: &str| {
        common::memplan_json(&[
            "profile",
            file.to_str().unwrap(),
            "--batch",
            "1",
            "--train",
            "--optimizer",
            "sgd",
            "--loss",
            "graph",
            "--moe-routing",
            routing,
            "--json",
        ])
    };
    let (bal, cap, worst) = (run("balanced"), run("capacity=2"), run("worst"));
    let r = &bal["moe_routing"];
    assert_eq!(r["assumption"], "balanced");
    assert_eq!(r["experts"], 8);
    assert_eq!(r["top_k"], 2);
    assert_eq!(r["tokens"], 2048);
    assert_eq!(r["selections"], 2 * 8, "2 layers of 8 experts");
    assert_eq!(r["max_expert_tokens"], 2048 * 2 / 8);
    assert_eq!(cap["moe_routing"]["max_expert_tokens"], 2048 * 2 * 2 / 8);
    assert_eq!(worst["moe_routing"]["max_expert_tokens"], 2048);
    let saved = |v: &Value| v["training"]["saved_activation_bytes"].as_u64().unwrap();
    assert_eq!(saved(&bal), saved(&worst));
    assert!(
        saved(&cap) > saved(&bal),
        "{} vs {}",
        saved(&cap),
        saved(&bal)
    );
    let (ok, out, _) = common::run_memplan(&[
        "profile",
        file.to_str().unwrap(),
        "--batch",
        "1",
        "--moe-routing",
        "capacity=1.25",
    ]);
    assert!(ok);
    assert!(
        out.contains("MoE routing assumed capacity=1.25: 16 expert selections"),
        "{out}"
    );
}

/// QLoRA: the llama_lora file read with `--weight-dtype nf4` stores each frozen Linear
/// weight as bitsandbytes' `Params4bit` does (tests/data/pytorch/llm_reference.json llama_qlora:
/// what bitsandbytes stored for the same model, quantized on the CPU), the output head
/// kept in float32 as transformers keeps it; the step itself is checked with the other
/// families (`llm_families_match_pytorch_at_sequence_2048`).
#[test]
fn nf4_stores_what_bitsandbytes_stores() {
    let r = reference();
    let q = &r["llama_qlora"];
    let with = profile(q, 1, "sgd");
    let mut plain = q.clone();
    plain.as_object_mut().unwrap().remove("weight_dtype");
    let without = profile(&plain, 1, "sgd");
    let params = |t: &Value| t["params_bytes"].as_u64().unwrap();
    let elements = q["nf4_quantized_elements"].as_u64().unwrap();
    let stored = q["nf4_stored_bytes"].as_u64().unwrap();
    // The float32 weights out, their NF4 storage in: exactly what bitsandbytes keeps.
    assert_eq!(params(&without) - params(&with), 4 * elements - stored);
}

/// `--checkpoint every-block:selective` on the llama family at sequence 2048, batch 1,
/// SGD, applied in PyTorch with the `--pytorch` file (tests/data/pytorch/llm_selective_reference.json,
/// `python tools/llm/selective.py`, CPU, float32): PyTorch keeps after forward what the
/// plan keeps plus the outputs (within 0.01 %; the loss and one CPU RNG state per
/// checkpointed block taken out), its device-equivalent step peak is within 5 % of the
/// plan's, and the gradients are bitwise those of the step without the file. The plan is
/// made again here: the same blocks and the same bytes as when it was measured.
#[test]
fn a_selective_llm_plan_matches_pytorch() {
    let p = preset_matches_pytorch(
        "llm_selective_reference.json",
        &[
            "peak_bytes",
            "saved_bytes_at_forward_end",
            "selective_modules",
        ],
    );
    assert_eq!(p["selective_modules"], p["checkpoint_modules"]);
}

/// `plan --checkpoint every-block:offload`'s file in PyTorch (tools/llm/selective.py
/// --preset every-block:offload, tests/data/pytorch/llm_offload_reference.json): what is alive
/// after forward and the step peak as memplan's, the gradients bitwise the baseline's,
/// and the bytes its hooks copied back equal to memplan's; what they copied to the
/// host within 2 % under memplan's (a tensor saved twice is copied once).
#[test]
fn an_offload_llm_plan_matches_pytorch() {
    let p = preset_matches_pytorch(
        "llm_offload_reference.json",
        &[
            "peak_bytes",
            "saved_bytes_at_forward_end",
            "offloaded_modules",
            "host_bytes",
            "pcie_bytes",
        ],
    );
    assert_eq!(p["offloaded_modules"], p["checkpoint_modules"]);
    assert_eq!(p["overhead"], 0.0);
    let r = Value::Object(reference_from("llm_offload_reference.json"));
    let n = |v: &Value, k: &str| v[k].as_u64().unwrap();
    let t = &r["transfers"];
    assert_eq!(2 * n(t, "to_device_bytes"), n(&p, "pcie_bytes"));
    let host = n(&p, "host_bytes");
    assert!(n(t, "to_host_bytes") <= host && n(t, "to_host_bytes") as f64 >= 0.98 * host as f64);
}

/// Plans `reference`'s preset as it was measured, checks `keys` unchanged, and the
/// measured step against the plan; returns the plan.
fn preset_matches_pytorch(reference: &str, keys: &[&str]) -> Value {
    let r = Value::Object(reference_from(reference));
    let file = common::shipped(&format!("llm/{}.onnx", r["family"].as_str().unwrap()));
    let batch = r["batch"].as_u64().unwrap().to_string();
    let p = common::memplan_json(&[
        "plan",
        file.to_str().unwrap(),
        "--batch",
        &batch,
        "--optimizer",
        "sgd",
        "--checkpoint",
        r["preset"].as_str().unwrap(),
        "--json",
    ]);
    let m = &r["memplan"];
    for &k in keys {
        assert_eq!(p[k], m[k], "{k}: the plan changed since it was measured");
    }
    let n = |v: &Value, k: &str| v[k].as_u64().unwrap();
    let pt = &r["pytorch"];
    let fe = n(m, "saved_bytes_at_forward_end") + n(&r, "output_bytes");
    let want = n(pt, "forward_end_delta_bytes") - n(&r, "rng_state_bytes") - 4;
    let d = fe as f64 / want as f64 - 1.0;
    assert!(
        d.abs() < 1e-4,
        "{reference}: alive after forward {fe} vs PyTorch {want} ({:+.4}%)",
        d * 100.0
    );
    let peak =
        n(pt, "resident_bytes_before_step") + n(pt, "device_equivalent_step_peak_delta_bytes");
    let dp = n(m, "peak_bytes") as f64 / peak as f64 - 1.0;
    assert!(
        dp.abs() < 0.05,
        "{reference}: peak {} vs PyTorch {peak} ({:+.2}%)",
        n(m, "peak_bytes"),
        dp * 100.0
    );
    assert_eq!(r["gradients_differ"], serde_json::json!([]));
    assert!(n(&r, "gradients_compared") > 10);
    p
}
