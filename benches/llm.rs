//! Planning at LLM scale (issue 50), on the Llama-3.1-8B-shaped shape-only exports in
//! models/llm/ (`memplan-export --hf llama-3.1-8b --seq 2048 --dtype bf16 --labels`,
//! and the same with `--lora r=16,alpha=32,targets=q_proj,k_proj,v_proj,o_proj`):
//!
//! - `fit_llm/llama3_8b_h100`: `memplan fit --gpu h100 --optimizer adamw --loss graph
//!   --precision bf16`, every row, on the device (model loaded);
//! - `fit_llm/llama3_8b_lora_rtx4090`: the LoRA export with `--trainable lora_` on an
//!   RTX 4090;
//! - `fit_llm/llama3_8b_h100_x8_target64`: the full export on eight H100s with
//!   `--gpus 8 --target-batch 64`: every row and combination, recommended by
//!   estimated step time over NVLink (issue 52; target at most 5 s);
//! - `plan_llm/llama3_8b_b4_80GiB`: `memplan plan --batch 4 --budget 80GiB` with the
//!   same training options (the step built, then planned with the default time limit
//!   of a large graph).
//!
//! Targets: fit at most 3 s, plan at most 10 s.

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion};
use memplan::fit::{fit, FitOptions};
use memplan::infer::Bindings;
use memplan::memory::device::{DeviceModel, Gpu};
use memplan::onnx::load_model;
use memplan::remat::plan::{plan, Solver};
use memplan::remat::portfolio::LARGE_TIME_LIMIT_S;
use memplan::train::{Loss, Optimizer, ParamSelection, Precision, TrainOptions};

// The allocator the `memplan` binary runs on.
#[global_allocator]
static GLOBAL: memplan::Allocator = memplan::Allocator;

fn model_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("models")
        .join("llm")
        .join(format!("{name}.onnx"))
}

fn train(trainable: Option<&str>) -> TrainOptions {
    TrainOptions {
        optimizer: Optimizer::Adamw,
        precision: Precision::Bf16,
        loss: Loss::Graph,
        params: ParamSelection::new(None, trainable).unwrap(),
        ..Default::default()
    }
}

fn on(gpu: &str, train: TrainOptions) -> FitOptions {
    let g = Gpu::named(gpu).unwrap();
    let memory = g.total_bytes();
    FitOptions {
        memory,
        train,
        gpus: 1,
        target_batch: None,
        dims: Default::default(),
        plan_time_limit_s: 60.0,
        device: Some(DeviceModel::new(Default::default(), Some(g), None).with_memory(memory, 0)),
        routing: None,
        cluster: None,
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("fit_llm");
    g.sample_size(10);
    for (name, gpu, trainable) in [
        ("llama3_8b", "h100", None),
        ("llama3_8b_lora", "rtx4090", Some("lora_")),
    ] {
        let m = load_model(&model_path(name)).unwrap();
        let o = on(gpu, train(trainable));
        g.bench_function(format!("{name}_{gpu}"), |b| {
            b.iter(|| black_box(fit(&m, name, &o).unwrap().strategies.len()))
        });
    }
    let m = load_model(&model_path("llama3_8b")).unwrap();
    let h100 = Gpu::named("h100").unwrap();
    let o = FitOptions {
        gpus: 8,
        target_batch: Some(64),
        cluster: Some(memplan::fit::time::Cluster::of(h100, 8, None).unwrap()),
        ..on("h100", train(None))
    };
    g.bench_function("llama3_8b_h100_x8_target64", |b| {
        b.iter(|| black_box(fit(&m, "llama3_8b", &o).unwrap().recommendation.is_some()))
    });
    g.finish();
    let mut g = c.benchmark_group("plan_llm");
    g.sample_size(10);
    let m = load_model(&model_path("llama3_8b")).unwrap();
    let b4 = Bindings {
        batch: Some(4),
        ..Default::default()
    };
    let t = train(None);
    g.bench_function("llama3_8b_b4_80GiB", |b| {
        b.iter(|| {
            let step = memplan::step::build(&m, &b4, &t, "plan").unwrap();
            black_box(
                plan(&step.graph, 80 << 30, Solver::Ilp, LARGE_TIME_LIMIT_S)
                    .unwrap()
                    .peak_bytes,
            )
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
