//! The CPU training step (`memplan::exec`), resnet18 at batch 8, fp32, SGD:
//! `train_step/resnet18_b8/baseline` (no recomputation) and `.../planned_50pct`
//! (the `ilp` plan at 50 % of the baseline peak), measured in the same run so the
//! ratio of the two is the measured recompute overhead. Throughput is in FLOPs of the
//! no-recompute step (multiply-add = 2): criterion's `elem/s` reads as FLOP/s.
//! `MEMPLAN_BENCH_STEP_MODELS=resnet18:8,cnn:32` picks other models and batches.

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use memplan::exec::train::StepOptions;
use memplan::exec::verify::{seeded_inputs, Step};
use memplan::exec::{Executor, Options};
use memplan::infer::{infer, Bindings};
use memplan::onnx::load_model;
use memplan::remat::graph::replay;
use memplan::remat::plan::{plan, Solver};
use memplan::train::{Loss, Optimizer, Precision, TrainOptions};

fn model_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("models")
        .join(format!("{name}.onnx"))
}

fn cases() -> Vec<(String, u64)> {
    let list = std::env::var("MEMPLAN_BENCH_STEP_MODELS").unwrap_or("resnet18:8".into());
    list.split(',')
        .map(|c| {
            let (m, b) = c.split_once(':').unwrap_or((c, "8"));
            (m.to_string(), b.parse().expect("batch"))
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let train = TrainOptions {
        optimizer: Optimizer::Sgd,
        precision: Precision::Fp32,
        loss: Loss::Mean,
        grads_resident: false,
        params: Default::default(),
    };
    for (name, batch) in cases() {
        let model = load_model(&model_path(&name)).unwrap();
        let inf = infer(
            &model,
            &Bindings {
                batch: Some(batch),
                ..Default::default()
            },
        )
        .unwrap();
        let step = Step::new(&model, &inf, &train, &name).unwrap();
        let g = step.graph();
        let base = g.no_recompute_plan();
        let base_peak = replay(g, &base).unwrap().peak_bytes;
        let planned = plan(g, base_peak / 2, Solver::Ilp, 10.0).unwrap();
        let params = Executor::new(&model, &inf, Options::default())
            .unwrap()
            .params()
            .to_vec();
        let inputs = seeded_inputs(&model, &inf).unwrap();
        let opts = StepOptions::default();
        let mut group = c.benchmark_group(format!("train_step/{name}_b{batch}"));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(30))
            .throughput(Throughput::Elements(g.base_cost() as u64));
        group.bench_function("baseline", |b| {
            b.iter(|| black_box(step.run(&base, &params, &inputs, &opts).unwrap().peak_bytes))
        });
        let label = if planned.feasible {
            "planned_50pct"
        } else {
            "planned_lowest_peak"
        };
        eprintln!(
            "{name} b{batch}: baseline peak {base_peak} B, {label} peak {} B, predicted overhead {:.4}",
            planned.peak_bytes, planned.overhead
        );
        group.bench_function(label, |b| {
            b.iter(|| {
                black_box(
                    step.run(&planned.plan, &params, &inputs, &opts)
                        .unwrap()
                        .peak_bytes,
                )
            })
        });
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
