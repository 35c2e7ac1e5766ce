//! The simulated CUDA caching allocator against sequences whose outcome follows
//! from PyTorch's rules (c10/cuda/CUDACachingAllocator.cpp), and the training-loop
//! replay against the schedule's own peak.

use memplan::memory::allocator::{AllocConf, Allocator};

mod common;

const MIB: u64 = 1 << 20;

fn conf(text: &str) -> AllocConf {
    AllocConf::parse(text).unwrap()
}

/// Allocates each size, returns the blocks.
fn alloc_all(a: &mut Allocator, sizes: &[u64]) -> Vec<usize> {
    sizes.iter().map(|&s| a.malloc(s).unwrap()).collect()
}

#[test]
fn freed_small_segments_do_not_serve_larger_requests() {
    // 16 MiB requests get 16 MiB segments of their own; freed, they cannot merge
    // across segments, so 32 MiB requests need new segments: 8·16 + 4·32 = 256 MiB.
    let mut a = Allocator::new(AllocConf::default(), u64::MAX);
    for b in alloc_all(&mut a, &[16 * MIB; 8]) {
        a.free(b);
    }
    alloc_all(&mut a, &[32 * MIB; 4]);
    let s = a.stats();
    assert_eq!(s.reserved_peak, 256 * MIB);
    assert_eq!(s.segments, 12);
    assert_eq!(s.allocated, 128 * MIB);
}

#[test]
fn freed_large_segments_are_split_for_smaller_requests() {
    // Each freed 32 MiB segment is split in two 16 MiB blocks (the rest, 16 MiB, is
    // more than 1 MiB): 128 MiB in all.
    let mut a = Allocator::new(AllocConf::default(), u64::MAX);
    for b in alloc_all(&mut a, &[32 * MIB; 4]) {
        a.free(b);
    }
    alloc_all(&mut a, &[16 * MIB; 8]);
    assert_eq!(a.stats().reserved_peak, 128 * MIB);
    assert_eq!(a.stats().segments, 4);
}

#[test]
fn expandable_segments_map_20_mib_pages() {
    // 8 · 16 MiB = 128 MiB packed in one segment, mapped in 20 MiB pages: 7 pages.
    let mut a = Allocator::new(conf("expandable_segments:True"), u64::MAX);
    alloc_all(&mut a, &[16 * MIB; 8]);
    assert_eq!(a.stats().reserved_peak, 140 * MIB);
    assert_eq!(a.stats().segments, 1);
    // Without expandable segments: eight 16 MiB segments.
    let mut b = Allocator::new(AllocConf::default(), u64::MAX);
    alloc_all(&mut b, &[16 * MIB; 8]);
    assert_eq!(b.stats().reserved_peak, 128 * MIB);
}

#[test]
fn small_requests_share_2_mib_segments() {
    let mut a = Allocator::new(AllocConf::default(), u64::MAX);
    // 4096 requests of 512 B fill exactly one 2 MiB segment; one more opens another.
    alloc_all(&mut a, &[1; 4096]);
    assert_eq!(a.stats().reserved_peak, 2 * MIB);
    assert_eq!(a.stats().allocated, 2 * MIB);
    a.malloc(1).unwrap();
    assert_eq!(a.stats().reserved_peak, 4 * MIB);
    // A 1 MiB request is small; 1 MiB + 1 B is large and gets a 20 MiB segment.
    let mut b = Allocator::new(AllocConf::default(), u64::MAX);
    b.malloc(MIB).unwrap();
    assert_eq!(b.stats().reserved_peak, 2 * MIB);
    b.malloc(MIB + 1).unwrap();
    assert_eq!(b.stats().reserved_peak, 22 * MIB);
    // Three 6 MiB requests share one 20 MiB segment (the rest after each split is
    // more than 1 MiB); the fourth does not fit in the 2 MiB left.
    let mut c = Allocator::new(AllocConf::default(), u64::MAX);
    alloc_all(&mut c, &[6 * MIB; 3]);
    assert_eq!(c.stats().reserved_peak, 20 * MIB);
    c.malloc(6 * MIB).unwrap();
    assert_eq!(c.stats().reserved_peak, 40 * MIB);
}

#[test]
fn freed_neighbours_merge_and_best_fit_picks_the_smallest() {
    let mut a = Allocator::new(AllocConf::default(), u64::MAX);
    // One 20 MiB segment split into 4 + 4 + 4 + 8 (rest).
    let b = alloc_all(&mut a, &[4 * MIB; 3]);
    a.free(b[0]);
    a.free(b[1]);
    // Freed neighbours merged into 8 MiB: a 7 MiB request fits there (and the
    // rest, 1 MiB, is not split off), no new segment.
    let x = a.malloc(7 * MIB).unwrap();
    assert_eq!(a.stats().reserved_peak, 20 * MIB);
    assert_eq!(a.block_size(x), 8 * MIB);
    // Best fit: 3 MiB goes to the 8 MiB tail... which is the only free block left.
    a.malloc(3 * MIB).unwrap();
    assert_eq!(a.stats().reserved_peak, 20 * MIB);
}

#[test]
fn a_full_device_releases_the_cache_then_fails() {
    // 64 MiB device: four 16 MiB segments, freed; a 32 MiB request does not fit
    // beside them, so the cache is released and the request succeeds.
    let mut a = Allocator::new(AllocConf::default(), 64 * MIB);
    for b in alloc_all(&mut a, &[16 * MIB; 4]) {
        a.free(b);
    }
    a.malloc(32 * MIB).unwrap();
    assert_eq!(a.stats().reserved, 32 * MIB);
    assert_eq!(a.stats().releases, 4);
    // Live 32 + 32 MiB leave nothing for another 2 MiB segment.
    a.malloc(32 * MIB).unwrap();
    let err = a.malloc(MIB).unwrap_err();
    assert_eq!(err.requested, MIB);
    assert_eq!(err.reserved, 64 * MIB);
}

#[test]
fn max_split_size_keeps_oversize_blocks_whole() {
    // With max_split_size_mb:64, a cached 100 MiB segment does not serve a 30 MiB
    // request (oversize blocks serve only requests within 20 MiB of their size).
    let c = conf("max_split_size_mb:64");
    let mut a = Allocator::new(c, u64::MAX);
    let b = a.malloc(100 * MIB).unwrap();
    a.free(b);
    a.malloc(30 * MIB).unwrap();
    assert_eq!(a.stats().reserved_peak, 130 * MIB);
    // ... but serves an 85 MiB one whole.
    let mut d = Allocator::new(c, u64::MAX);
    let b = d.malloc(100 * MIB).unwrap();
    d.free(b);
    let x = d.malloc(85 * MIB).unwrap();
    assert_eq!(d.block_size(x), 100 * MIB);
    assert_eq!(d.stats().reserved_peak, 100 * MIB);
    // Without the option the 100 MiB segment is split for the 30 MiB request.
    let mut e = Allocator::new(AllocConf::default(), u64::MAX);
    let b = e.malloc(100 * MIB).unwrap();
    e.free(b);
    e.malloc(30 * MIB).unwrap();
    assert_eq!(e.stats().reserved_peak, 100 * MIB);
}

#[test]
fn expandable_segments_unmap_free_pages_when_full() {
    // 100 MiB device, expandable: 4 · 20 MiB mapped, the first three freed; a
    // 60 MiB request fits in the freed pages without mapping more.
    let mut a = Allocator::new(conf("expandable_segments:True"), 100 * MIB);
    let b = alloc_all(&mut a, &[20 * MIB; 4]);
    assert_eq!(a.stats().reserved_peak, 80 * MIB);
    for &x in &b[..3] {
        a.free(x);
    }
    a.malloc(60 * MIB).unwrap();
    assert_eq!(a.stats().reserved_peak, 80 * MIB);
    a.free(b[3]);
    // 60 MiB live at the segment's start; 40 MiB more maps 2 pages: 100 MiB, full.
    a.malloc(40 * MIB).unwrap();
    assert_eq!(a.stats().reserved, 100 * MIB);
}

#[test]
fn a_full_expandable_segment_unmaps_its_free_pages() {
    // 100 MiB device, expandable: five 20 MiB blocks fill it; the 2nd and 4th are
    // freed (two holes, 20 MiB each). 40 MiB fits no hole and mapping 2 more pages
    // would exceed the device, so the free pages are unmapped (reserved 60 MiB) and
    // the request maps 2 pages at the segment's end.
    let mut a = Allocator::new(conf("expandable_segments:True"), 100 * MIB);
    let b = alloc_all(&mut a, &[20 * MIB; 5]);
    assert_eq!(a.stats().reserved, 100 * MIB);
    a.free(b[1]);
    a.free(b[3]);
    let x = a.malloc(40 * MIB).unwrap();
    assert_eq!(a.block_size(x), 40 * MIB);
    let s = a.stats();
    assert_eq!(
        (s.reserved, s.allocated, s.releases),
        (100 * MIB, 100 * MIB, 2)
    );
    // Nothing is left to unmap: one more page does not fit.
    assert!(a.malloc(MIB + 1).is_err());
    // Freeing a block and emptying the cache unmaps its page.
    a.free(b[0]);
    a.empty_cache();
    assert_eq!(a.stats().reserved, 80 * MIB);
}

#[test]
fn power2_divisions_round_requests() {
    // 1.2 GiB with 4 divisions between 1 and 2 GiB rounds to 1.25 GiB.
    let c = conf("roundup_power2_divisions:4");
    let mut a = Allocator::new(c, u64::MAX);
    let x = a.malloc(1200 * MIB).unwrap();
    assert_eq!(a.block_size(x), 1280 * MIB);
    assert_eq!(a.stats().reserved_peak, 1280 * MIB);
}

mod training {
    use std::process::Command;

    use memplan::fit::{combo::combos, fit, Ckpt, Combo, FitOptions, Steps};
    use memplan::infer::{infer, Bindings};
    use memplan::memory::allocator::AllocConf;
    use memplan::memory::device::{replay_schedule, DeviceModel, Gpu};
    use memplan::memory::simulate;
    use memplan::onnx::load_model;
    use memplan::train::{build_schedule, Schedule, TrainOptions};

    use super::common;

    fn schedule(name: &str, batch: u64) -> Schedule {
        let model = load_model(&common::shipped(name)).unwrap();
        let b = Bindings {
            batch: Some(batch),
            ..Default::default()
        };
        let m = memplan::infer::lower::lower(&model, &b).unwrap();
        let inf = infer(&m, &b).unwrap();
        build_schedule(&m, &inf, &TrainOptions::default()).unwrap()
    }

    #[test]
    fn replay_counts_what_the_schedule_holds() {
        for (name, batch) in [
            ("cnn.onnx", 4),
            ("transformer.onnx", 2),
            ("resnet18.onnx", 2),
        ] {
            let s = schedule(name, batch);
            let peak = simulate(&s).peak().total();
            for conf in [
                AllocConf::default(),
                AllocConf::parse("expandable_segments:True").unwrap(),
            ] {
                let d = DeviceModel::new(conf, None, None);
                let r = replay_schedule(&s, &d).unwrap();
                // Blocks are the tensors rounded up, plus two cuBLAS workspaces.
                let ws = 2 * d.cublas_workspace_bytes;
                assert_eq!(r.cublas_workspaces, 2, "{name}");
                assert!(
                    r.allocated_peak_bytes >= peak + ws,
                    "{name}: {r:?} < {peak}"
                );
                // Rounding adds at most 512 B a storage, or the split rest under
                // 1 MiB of a large block.
                let bound = peak + ws + s.storages.len() as u64 * (1 << 20);
                assert!(r.allocated_peak_bytes <= bound, "{name}: {r:?}");
                assert!(r.reserved_bytes >= r.allocated_peak_bytes, "{name}");
                assert_eq!(
                    r.fragmentation_bytes,
                    r.reserved_bytes - r.allocated_peak_bytes
                );
                assert!(r.segments >= 1 && r.steps_replayed >= 2, "{name}: {r:?}");
                // On a device that holds exactly what was reserved, nothing is
                // released; below the allocated peak it cannot fit.
                let exact = d.clone().with_memory(r.reserved_bytes + d.context_bytes, 0);
                let again = replay_schedule(&s, &exact).unwrap();
                assert_eq!(
                    (again.reserved_bytes, again.cache_releases),
                    (r.reserved_bytes, 0)
                );
                let short = d
                    .clone()
                    .with_memory(r.allocated_peak_bytes - 1 + d.context_bytes, 0);
                assert!(replay_schedule(&s, &short).is_err(), "{name}");
                // Between the two the allocator may get by releasing its cache.
                let tight = d
                    .clone()
                    .with_memory(r.reserved_bytes - 1 + d.context_bytes, 0);
                if let Ok(t) = replay_schedule(&s, &tight) {
                    assert!(
                        t.reserved_bytes < r.reserved_bytes && t.cache_releases > 0,
                        "{name}: {t:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn fit_on_the_device_is_confirmed_by_the_replay() {
        let model = load_model(&common::shipped("cnn.onnx")).unwrap();
        let d = DeviceModel::new(AllocConf::default(), Gpu::named("t4").ok(), Some(64 << 20))
            .with_memory(200 << 20, 16 << 20);
        assert_eq!(d.capacity, (200 - 16 - 64) << 20);
        let o = FitOptions {
            memory: 200 << 20,
            train: TrainOptions::default(),
            gpus: 1,
            target_batch: None,
            dims: Default::default(),
            plan_time_limit_s: 5.0,
            device: Some(d.clone()),
            routing: None,
            cluster: None,
        };
        let r = fit(&model, "cnn", &o).unwrap();
        let tensors = fit(
            &model,
            "cnn",
            &FitOptions {
                device: None,
                memory: d.capacity,
                ..o.clone()
            },
        )
        .unwrap();
        let dev = r.device.as_ref().unwrap();
        assert_eq!(
            (dev.context_bytes, dev.headroom_bytes),
            (64 << 20, Some(16 << 20))
        );
        assert_eq!(dev.allocator_capacity_bytes, Some(d.capacity));
        assert_eq!(dev.gpu.as_deref(), Some("t4"));
        for (row, t) in r.strategies.iter().zip(&tensors.strategies) {
            assert_eq!(row.name, t.name);
            // Reserved is never below the live bytes: never more batch than that.
            assert!(
                row.max_batch <= t.max_batch,
                "{}: {} > {}",
                row.name,
                row.max_batch,
                t.max_batch
            );
            if row.max_batch > 0 {
                let res = row.reserved_bytes.unwrap();
                assert!(res <= d.capacity, "{}", row.name);
                assert_eq!(row.device_bytes, Some(res + d.context_bytes));
            }
        }
        // As exported: the step at max_batch fits the device, the next does not.
        let mb = r.strategies[0].max_batch;
        assert!(mb > 1);
        assert!(replay_schedule(&schedule("cnn.onnx", mb), &d).is_ok());
        assert!(replay_schedule(&schedule("cnn.onnx", mb + 1), &d).is_err());
    }

    #[test]
    fn every_combination_runs_its_micro_batch_on_the_device() {
        // With a target, every combination's micro-batch is replayed on the device
        // (fitting is not monotone in the batch, so below max_batch is not enough).
        let model = load_model(&common::shipped("cnn.onnx")).unwrap();
        // A toy card: NCCL's memory left out (`--nccl-memory 0`).
        let mut d =
            DeviceModel::new(AllocConf::default(), None, Some(32 << 20)).with_memory(120 << 20, 0);
        d.nccl_per_group = Some(0);
        let o = FitOptions {
            memory: 120 << 20,
            train: TrainOptions::default(),
            gpus: 2,
            target_batch: Some(3000),
            dims: Default::default(),
            plan_time_limit_s: 5.0,
            device: Some(d.clone()),
            routing: None,
            cluster: None,
        };
        let r = fit(&model, "cnn", &o).unwrap();
        let steps = Steps::new(&model, &o);
        let rec = r.recommendation.as_ref().unwrap();
        let by_names = |names: &[String]| {
            combos(o.gpus)
                .into_iter()
                .flat_map(|c| {
                    [
                        c,
                        Combo {
                            accumulate: true,
                            ..c
                        },
                    ]
                })
                .find(|c| c.names() == names)
                .unwrap()
        };
        let c = by_names(&rec.strategies);
        assert!(
            steps.device_at(c, rec.micro_batch, &d).unwrap().is_some(),
            "{rec:?}"
        );
        let mut checked = 0;
        for row in r
            .strategies
            .iter()
            .filter(|s| s.combines.is_some() && s.max_batch > 0)
        {
            let c = by_names(row.combines.as_ref().unwrap());
            assert!(
                steps.device_at(c, row.max_batch, &d).unwrap().is_some(),
                "{}",
                row.name
            );
            checked += 1;
        }
        assert!(checked >= 5, "{checked}");
    }

    /// ResNet-50 on 24 GiB, 8 GPUs, target 512 (AdamW): within a family of rows that
    /// differ only in how the GPUs share the state, no row is reported below a
    /// sibling's batch that fits it (bisection alone stopped every-block at 674 and
    /// its ZeRO-1 combination at 665 where DDP's 699 fit both), and every row still
    /// fits at its batch and not at the next.
    #[test]
    fn rows_sharing_the_state_differently_take_a_siblings_batch_that_fits() {
        let model = load_model(&common::shipped("resnet50.onnx")).unwrap();
        let d = DeviceModel::new(AllocConf::default(), None, None).with_memory(24 << 30, 0);
        let o = FitOptions {
            memory: 24 << 30,
            train: TrainOptions {
                optimizer: memplan::train::Optimizer::Adamw,
                ..TrainOptions::default()
            },
            gpus: 8,
            target_batch: Some(512),
            dims: Default::default(),
            routing: None,
            plan_time_limit_s: 10.0,
            device: Some(d.clone()),
            cluster: None,
        };
        let r = fit(&model, "resnet50", &o).unwrap();
        let steps = Steps::new(&model, &o);
        let all: Vec<Combo> = combos(o.gpus)
            .into_iter()
            .chain([false, true].into_iter().flat_map(|mixed| {
                [Ckpt::None, Ckpt::Sqrt, Ckpt::EveryBlock].map(|ckpt| Combo {
                    mixed,
                    ckpt,
                    ..Combo::PLAIN
                })
            }))
            .collect();
        let rows: Vec<(Combo, u64)> = r
            .strategies
            .iter()
            .filter_map(|row| {
                let c = all.iter().find(|c| c.name() == row.name)?;
                Some((*c, row.max_batch))
            })
            .collect();
        assert!(rows.len() >= 30, "{}", rows.len());
        let mut compared = 0;
        for &(c, b) in &rows {
            assert!(steps.device_at(c, b, &d).unwrap().is_some(), "{}", c.name());
            assert!(
                steps.device_at(c, b + 1, &d).unwrap().is_none(),
                "{}",
                c.name()
            );
            for &(s, sb) in &rows {
                if (s.mixed, s.ckpt) == (c.mixed, c.ckpt) && s != c && sb > b {
                    compared += 1;
                    assert!(
                        steps.device_at(c, sb, &d).unwrap().is_none(),
                        "{} at {b}: {}'s {sb} fits it",
                        c.name(),
                        s.name()
                    );
                }
            }
        }
        assert!(compared >= 20, "{compared}");
    }

    /// GPT-2 on 16 GiB (Adam): the planned row's plan is confirmed on the device
    /// at a smaller batch than its live bytes allow, and planned again there: the
    /// plan made for the larger batch cost 58.7 % replayed, 48.4 % after the
    /// take-back; planned again, 18.8 % on an idle machine (below every-block's
    /// 23.1 % at one batch more), 37-39 % where the portfolio's gap MILP is cut by
    /// its time (other tests beside this one). Its allocations fit the device.
    #[test]
    fn the_planned_row_is_planned_again_at_the_device_batch() {
        let model = load_model(&common::shipped("gpt2.onnx")).unwrap();
        let d = DeviceModel::new(AllocConf::default(), None, None).with_memory(16 << 30, 0);
        let o = FitOptions {
            memory: 16 << 30,
            train: TrainOptions {
                optimizer: memplan::train::Optimizer::Adam,
                ..TrainOptions::default()
            },
            gpus: 1,
            target_batch: None,
            dims: Default::default(),
            routing: None,
            // 2 s for each plan made again: other tests run beside this one.
            plan_time_limit_s: 20.0,
            device: Some(d.clone()),
            cluster: None,
        };
        let r = fit(&model, "gpt2", &o).unwrap();
        let row = |n: &str| r.strategies.iter().find(|s| s.name == n).unwrap();
        let (planned, every) = (row("checkpointing-planned"), row("checkpoint-every-block"));
        assert!(planned.reserved_bytes.unwrap() <= d.capacity);
        assert!(
            planned.max_batch + 1 >= every.max_batch,
            "planned {} every-block {}",
            planned.max_batch,
            every.max_batch
        );
        assert!(planned.overhead < 0.45, "planned {}", planned.overhead);
        assert!(every.overhead < 0.3, "every-block {}", every.overhead);
        // The fragmentation named is a row's reserved bytes over its live bytes.
        let f = r
            .fragmentation
            .as_ref()
            .expect("√n reserves 1.7 GiB over live");
        let named = row(&f.strategy);
        assert_eq!(f.max_batch, named.max_batch);
        assert_eq!(
            f.excess_bytes,
            named.reserved_bytes.unwrap() - named.peak_bytes
        );
        assert!(f.fraction_of_capacity >= 0.1);
    }

    #[test]
    fn plan_reports_the_planned_step_on_the_device() {
        let m = common::shipped("cnn.onnx");
        let v = common::memplan_json(&[
            "plan",
            m.to_str().unwrap(),
            "--batch",
            "8",
            "--budget",
            "0.7",
            "--json",
            "--gpu",
            "t4",
        ]);
        let (a, b) = (&v["allocator"], &v["baseline_allocator"]);
        let reserved = a["reserved_bytes"].as_u64().unwrap();
        assert!(a["allocated_peak_bytes"].as_u64().unwrap() >= v["peak_bytes"].as_u64().unwrap());
        assert!(
            b["allocated_peak_bytes"].as_u64().unwrap()
                >= v["baseline_peak_bytes"].as_u64().unwrap()
        );
        let ctx = v["device"]["context_bytes"].as_u64().unwrap();
        assert_eq!(v["device_bytes"].as_u64().unwrap(), reserved + ctx);
        assert_eq!(v["device"]["gpu"], "t4");
    }

    #[test]
    fn profile_reports_the_allocator() {
        let m = common::shipped("cnn.onnx");
        let run = |extra: &[&str]| -> serde_json::Value {
            let mut args = vec![
                "profile",
                m.to_str().unwrap(),
                "--batch",
                "8",
                "--train",
                "--json",
            ];
            args.extend_from_slice(extra);
            common::memplan_json(&args)
        };
        let v = run(&[]);
        let t = &v["training"];
        let a = &t["allocator"];
        for k in [
            "allocated_peak_bytes",
            "reserved_bytes",
            "segments",
            "fragmentation_bytes",
        ] {
            assert!(a[k].is_u64(), "{k}");
        }
        let reserved = a["reserved_bytes"].as_u64().unwrap();
        assert!(a["allocated_peak_bytes"].as_u64().unwrap() >= t["peak_bytes"].as_u64().unwrap());
        let ctx = t["device"]["context_bytes"].as_u64().unwrap();
        assert_eq!(t["device_bytes"].as_u64().unwrap(), reserved + ctx);
        // Hopper's cuBLAS workspace is 32 MiB; a given context replaces the table's.
        let h = run(&[
            "--gpu",
            "h100",
            "--cuda-context",
            "300MiB",
            "--allocator",
            "expandable",
        ]);
        let hd = &h["training"]["device"];
        assert_eq!(hd["cublas_workspace_bytes"], 32 << 20);
        assert_eq!(hd["context_bytes"], 300 << 20);
        assert_eq!(hd["expandable_segments"], true);
        assert_eq!(hd["gpu"], "h100");
        // Text: what nvidia-smi would show.
        let out = Command::new(env!("CARGO_BIN_EXE_memplan"))
            .args([
                "profile",
                common::shipped("cnn.onnx").to_str().unwrap(),
                "--batch",
                "8",
                "--train",
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("nvidia-smi would show") && text.contains("reserved"),
            "{text}"
        );
        // Device flags without --train: one line.
        let out = Command::new(env!("CARGO_BIN_EXE_memplan"))
            .args([
                "profile",
                common::shipped("cnn.onnx").to_str().unwrap(),
                "--gpu",
                "h100",
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.lines().count() == 1 && err.contains("--train"),
            "{err}"
        );
    }

    /// The replay against PyTorch on an H200 (tests/data/pytorch/allocator_h200.json: 24 runs
    /// of six models at two batches, default and expandable segments, plus the
    /// diagnostic variants; measured 4 December 2026 with
    /// tools/gpu-allocator-check.py, docs/ALLOCATOR.md). What the process holds
    /// (nvidia-smi) is the reserved bytes plus the H200's measured context.
    #[test]
    fn replay_matches_pytorch_on_an_h200() {
        let path = common::pytorch_data("allocator_h200.json");
        let data: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let h200 = Gpu::named("h200").unwrap();
        let mut checked = 0;
        for row in data["rows"].as_array().unwrap() {
            let model = row["model"].as_str().unwrap();
            let batch = row["batch"].as_u64().unwrap();
            let expandable = row["expandable"].as_bool().unwrap();
            let variant = row["variant"].as_str().unwrap();
            // Which rows are compared, and how close the allocated peak must be:
            // PyTorch's own kernels allocate what the exported graph does not show
            // in two cases (skipped rows skip every check). The bounds are the worst
            // rows' with a little margin; most rows agree to 0.5 %.
            let alloc_tol = match (model, batch, variant) {
                // cuDNN's convolution workspaces (through the caching allocator):
                // 350 MiB more at batch 256. Without cuDNN (the no-cudnn row) it
                // agrees to 0.4 %. memplan does not model cuDNN's workspaces.
                ("cnn", 256, "") => continue,
                // A diagnostic: the math attention kernel keeps more than the
                // exported graph does; PyTorch's default kernel is the row above.
                (_, _, "math-sdpa") => continue,
                // vit_b_16 was 3.2 to 5.0 % below PyTorch until the float32
                // attention output's GPU layout was modelled (its reshaped copy
                // saved beside it, `train::SDPA_F32_LAYOUT`); now within 0.6 %.
                _ => 0.02,
            };
            let s = schedule(&format!("{model}.onnx"), batch);
            let conf = if expandable {
                AllocConf::parse("expandable_segments:True").unwrap()
            } else {
                AllocConf::default()
            };
            let d = DeviceModel::new(conf, Some(h200), None);
            let r = replay_schedule(&s, &d).unwrap();
            let rel = |ours: u64, theirs: u64| ours as f64 / theirs as f64 - 1.0;
            let what = format!("{model} batch {batch} expandable {expandable} {variant}");
            let alloc = rel(
                r.allocated_peak_bytes,
                row["max_memory_allocated"].as_u64().unwrap(),
            );
            assert!(alloc.abs() <= alloc_tol, "{what}: allocated {alloc:+.3}");
            // Reserved: the default allocator's holes differ by up to 8.7 %
            // (mobilenet_v2 at batch 32); expandable segments agree closer.
            let reserved = rel(
                r.reserved_bytes,
                row["max_memory_reserved"].as_u64().unwrap(),
            );
            let res_tol = if expandable { 0.07 } else { 0.10 };
            assert!(reserved.abs() <= res_tol, "{what}: reserved {reserved:+.3}");
            let smi = row["nvidia_smi_mib"].as_u64().unwrap() << 20;
            let device = rel(r.reserved_bytes + d.context_bytes, smi);
            assert!(device.abs() <= 0.08, "{what}: device {device:+.3}");
            checked += 1;
        }
        assert_eq!(checked, 25, "rows compared");
    }
}
