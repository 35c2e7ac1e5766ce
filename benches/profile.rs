//! Load + shape inference + inference profile, per model.
//!
//! `fit/<model>`: `memplan fit` at 16 GiB over 8 GPUs (all 8 strategies, each solved
//! from two schedules and confirmed at its answer and the next batch), model loaded.
//! `fit_planned/<model>`: `memplan fit MODEL --memory 16GiB` with default options
//! (1 GPU), the six rows including `checkpointing-planned`, model loaded; ten
//! samples (each takes about a second). Both on live tensor bytes (`--tensors-only`).
//! `fit_planned_device/<model>`: the same on the device total, as the command runs
//! it by default (the caching allocator replayed; the planned row taken back and
//! planned again at the batch whose allocations fit).
//! `end_to_end/<model>`: map and decode the file, build the IR, infer every shape at
//! batch 8, and compute the inference memory profile: the work `memplan profile`
//! does minus printing. `load/<model>` and `infer_profile/<model>` split it in two.
//! benches/compare.sh runs this beside Python onnx's `onnx.load` +
//! `onnx.shape_inference.infer_shapes` on the same files and prints the ratio.

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion};
use memplan::infer::{infer, Bindings};
use memplan::memory::profile_inference;
use memplan::onnx::load_model;

// The allocator the `memplan` binary runs on.
#[global_allocator]
static GLOBAL: memplan::Allocator = memplan::Allocator;

fn model_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("models")
        .join(format!("{name}.onnx"))
}

fn models() -> Vec<String> {
    match std::env::var("MEMPLAN_BENCH_MODELS") {
        Ok(list) => list.split(',').map(str::to_string).collect(),
        Err(_) => vec!["resnet50".into(), "gpt2".into()],
    }
}

fn bench(c: &mut Criterion) {
    let bindings = Bindings {
        batch: Some(8),
        ..Default::default()
    };
    for name in models() {
        let path = model_path(&name);
        c.bench_function(&format!("end_to_end/{name}"), |b| {
            b.iter(|| {
                let m = load_model(black_box(&path)).unwrap();
                let inf = infer(&m, &bindings).unwrap();
                black_box(profile_inference(&m.graph, &inf).peak_bytes())
            })
        });
        c.bench_function(&format!("load/{name}"), |b| {
            b.iter(|| black_box(load_model(black_box(&path)).unwrap()))
        });
        let m = load_model(&path).unwrap();
        let fit_opts = memplan::fit::FitOptions {
            memory: 16 << 30,
            train: memplan::train::TrainOptions::default(),
            gpus: 8,
            target_batch: Some(1024),
            dims: Default::default(),
            plan_time_limit_s: 10.0,
            device: None,
            routing: None,
            cluster: None,
        };
        c.bench_function(&format!("fit/{name}"), |b| {
            b.iter(|| {
                black_box(
                    memplan::fit::fit(&m, &name, &fit_opts)
                        .unwrap()
                        .strategies
                        .len(),
                )
            })
        });
        // The same as the command line runs it: fitted on the device total (the
        // caching allocator replayed, the CUDA context counted).
        let device_opts = memplan::fit::FitOptions {
            device: Some(
                memplan::memory::device::DeviceModel::new(Default::default(), None, None)
                    .with_memory(16 << 30, 0),
            ),
            ..fit_opts.clone()
        };
        c.bench_function(&format!("fit_device/{name}"), |b| {
            b.iter(|| {
                black_box(
                    memplan::fit::fit(&m, &name, &device_opts)
                        .unwrap()
                        .strategies
                        .len(),
                )
            })
        });
        let planned_opts = memplan::fit::FitOptions {
            gpus: 1,
            target_batch: None,
            ..fit_opts.clone()
        };
        let planned_device_opts = memplan::fit::FitOptions {
            device: device_opts.device.clone(),
            ..planned_opts.clone()
        };
        for (group, opts) in [
            ("fit_planned", &planned_opts),
            ("fit_planned_device", &planned_device_opts),
        ] {
            let mut g = c.benchmark_group(group);
            g.sample_size(10);
            g.bench_function(&name, |b| {
                b.iter(|| black_box(memplan::fit::fit(&m, &name, opts).unwrap().strategies.len()))
            });
            g.finish();
        }
        c.bench_function(&format!("infer_profile/{name}"), |b| {
            b.iter(|| {
                let inf = infer(black_box(&m), &bindings).unwrap();
                black_box(profile_inference(&m.graph, &inf).peak_bytes())
            })
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
