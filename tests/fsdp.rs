//! FSDP2 per rank against real PyTorch runs: `fully_shard` per decoder layer and on
//! the root, gloo on CPU, world 2 and 4, `reshard_after_forward` true and false,
//! float32 and a bf16 `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`,
//! on two LLaMA-style configs (one with GQA, uneven shards and an in-model loss)
//! (tests/data/pytorch/fsdp2_reference.json, `python tools/pytorch/fsdp2_reference.py`).
//! memplan reads the same configs' shape-only exports (models/llm/fsdp_llama_*.onnx)
//! as a user does: `memplan profile FILE --train --fsdp N ... --json`. Every
//! rank's peak within 5 % (the worst rank's: ranks differ only in the optimizer
//! state of the last rank's shorter shard, and memplan gives the first rank's).

mod common;

use serde_json::Value;

/// memplan's per-rank training figures for one reference run.
fn profile(cfg: &Value, run: &Value) -> Value {
    let file = common::shipped(
        run["file"]
            .as_str()
            .unwrap()
            .strip_prefix("models/")
            .unwrap(),
    );
    let (batch, world) = (cfg["batch"].to_string(), run["world"].to_string());
    let reshard = run["reshard_after_forward"].as_bool().unwrap().to_string();
    let mut args = vec![
        "profile",
        file.to_str().unwrap(),
        "--train",
        "--batch",
        &batch,
        "--optimizer",
        "adamw",
        "--json",
        "--fsdp",
        &world,
        "--reshard-after-forward",
        &reshard,
    ];
    if cfg["loss"] == "graph" {
        args.extend(["--loss", "graph"]);
    }
    if run["policy"] == "bf16" {
        args.extend([
            "--precision",
            "bf16",
            "--param-dtype",
            "bf16",
            "--reduce-dtype",
            "fp32",
        ]);
    }
    common::memplan_json(&args)["training"].clone()
}

/// The reference's largest rank peak (the CPU-only copies left out).
fn reference_peak(run: &Value) -> u64 {
    run["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r["resident_bytes_before_step"].as_u64().unwrap()
                + r["device_equivalent_step_peak_delta_bytes"]
                    .as_u64()
                    .unwrap()
        })
        .max()
        .unwrap()
}

#[test]
fn fsdp2_rank_peaks_match_real_gloo_runs() {
    let reference = common::json_object("fsdp2_reference.json");
    let mut seen = 0;
    let mut report = Vec::new();
    for cfg_name in ["fsdp_llama_a", "fsdp_llama_b"] {
        let cfg = &reference[cfg_name];
        for (name, run) in cfg["runs"].as_object().unwrap() {
            assert!(run["checks_pass"].as_bool().unwrap(), "{cfg_name} {name}");
            let t = profile(cfg, run);
            let (ours, theirs) = (t["peak_bytes"].as_u64().unwrap(), reference_peak(run));
            let err = (ours as f64 - theirs as f64) / theirs as f64;
            report.push(format!(
                "{cfg_name} {name}: {ours} vs {theirs} ({:+.2}%)",
                err * 100.0
            ));
            assert!(err.abs() <= 0.05, "{}", report.join("\n"));
            // The sharded parameters are the padded shards PyTorch stores.
            let sharded = run["ranks"][0]["sharded_param_bytes"].as_u64().unwrap();
            assert_eq!(
                t["fsdp"]["sharded_param_bytes"].as_u64().unwrap(),
                sharded,
                "{cfg_name} {name}"
            );
            seen += 1;
        }
    }
    assert_eq!(seen, 16, "{}", report.join("\n"));
    eprintln!("{}", report.join("\n"));
}

#[test]
fn resharding_trades_memory_for_a_second_gather_and_more_ranks_hold_less() {
    let file = common::shipped("llm/fsdp_llama_b.onnx");
    let f = file.to_str().unwrap();
    let base = [
        "profile",
        f,
        "--train",
        "--batch",
        "4",
        "--optimizer",
        "adamw",
        "--loss",
        "graph",
        "--json",
    ];
    let peak = |world: &str, reshard: &str| -> (u64, u64) {
        let more = ["--fsdp", world, "--reshard-after-forward", reshard];
        let t = common::memplan_json(&[&base[..], &more[..]].concat())["training"].clone();
        (
            t["peak_bytes"].as_u64().unwrap(),
            t["fsdp"]["all_gather_bytes"].as_u64().unwrap(),
        )
    };
    let (kept, kept_ag) = peak("2", "false");
    let (resharded, resharded_ag) = peak("2", "true");
    assert!(resharded < kept, "{resharded} vs {kept}");
    assert!(resharded_ag > kept_ag, "{resharded_ag} vs {kept_ag}");
    let (four, _) = peak("4", "true");
    assert!(four < resharded, "{four} vs {resharded}");
    // One rank alone is the unsharded step plus FSDP's buffers.
    let single = common::memplan_json(&base)["training"]["peak_bytes"]
        .as_u64()
        .unwrap();
    assert!(resharded < single + single / 2);
}

#[test]
fn fsdp_flags_are_checked() {
    let file = common::shipped("llm/fsdp_llama_a.onnx");
    let f = file.to_str().unwrap();
    let (ok, _, err) = common::run_memplan(&["profile", f, "--fsdp", "2"]);
    assert!(!ok && err.contains("give --train"), "{err}");
    let (ok, _, err) = common::run_memplan(&[
        "profile",
        f,
        "--train",
        "--batch",
        "2",
        "--fsdp",
        "2",
        "--fsdp-units",
        "model.nothing",
    ]);
    assert!(!ok && err.contains("no module 'model.nothing'"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let (ok, _, err) = common::run_memplan(&[
        "profile",
        f,
        "--train",
        "--fsdp",
        "2",
        "--param-dtype",
        "int8",
    ]);
    assert!(!ok && err.contains("expected fp32, fp16 or bf16"), "{err}");
}

#[test]
fn plan_takes_one_ranks_step() {
    let file = common::shipped("llm/fsdp_llama_b.onnx");
    let f = file.to_str().unwrap();
    let base = [
        "plan",
        f,
        "--batch",
        "4",
        "--optimizer",
        "adamw",
        "--loss",
        "graph",
        "--json",
    ];
    let unsharded = common::memplan_json(&[&base[..], &["--budget", "100%"]].concat());
    let sharded = common::memplan_json(&[&base[..], &["--budget", "100%", "--fsdp", "4"]].concat());
    let peak = |v: &serde_json::Value| v["baseline_peak_bytes"].as_u64().unwrap();
    assert!(peak(&sharded) < peak(&unsharded), "{sharded}");
    // A tighter budget is met within the rank's step.
    let tight = common::memplan_json(&[&base[..], &["--budget", "95%", "--fsdp", "4"]].concat());
    assert!(
        tight["peak_bytes"].as_u64().unwrap() <= tight["budget_bytes"].as_u64().unwrap(),
        "{tight}"
    );
    let (ok, _, err) = common::run_memplan(&[
        "plan",
        f,
        "--batch",
        "4",
        "--budget",
        "90%",
        "--fsdp",
        "2",
        "--pytorch",
        "/tmp/x.py",
    ]);
    assert!(!ok && err.contains("plan without --fsdp"), "{err}");
}
