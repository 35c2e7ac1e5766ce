//! The step-time model `fit`'s recommendation decides by: how long one optimizer
//! step of a combination takes on the card and the links between the cards.
//!
//! - **Compute**: each schedule step is a roofline on the card ([`Gpu`]): the longer
//!   of its FLOPs at the card's rate (the dense half-precision tensor-core rate when
//!   it reads a half-precision operand, else the fp32 rate) and of the bytes it reads
//!   and writes at the memory bandwidth. A step that does neither (a view) costs 0.
//!   Peak rates: real kernels reach a fraction of them, the same fraction for every
//!   combination to first order, so the ranking holds where the absolute time is
//!   optimistic.
//! - **Recompute**: the combination's extra FLOP fraction of the forward and backward.
//! - **Communication**: the bytes [`super::traffic`] counts, over the interconnect
//!   ([`Interconnect`]), each collective as a ring: `(N−1)/N` of its bytes at the
//!   link's rate plus `N−1` latencies per 25 MiB bucket (DDP's default bucket).
//!   Collectives overlap the compute they run beside, as DDP, ZeRO and FSDP issue
//!   them: gradient reductions the backward of the micro-batch, parameter gathers
//!   forward and backward; ZeRO's gather of the updated parameters after the
//!   optimizer step overlaps nothing. Only what outlasts that compute is exposed.
//! - **Host copies** (offload): PCIe bytes at the card's link rate, all exposed; the
//!   CPU's optimizer update is not timed.

use serde::Serialize;

use super::combo::Dist;
use crate::ir::DType;
use crate::memory::device::Gpu;
use crate::train::{Schedule, StepKind};

/// Bytes per collective call (DDP's `bucket_cap_mb` default, 25 MiB).
const BUCKET_BYTES: u64 = 25 << 20;

/// The link collectives run over, per GPU and direction.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Interconnect {
    /// Name as given (`nvlink`, `pcie`, `infiniband`, or `custom`).
    pub name: String,
    /// Bytes per second each way.
    pub bytes_per_s: f64,
    /// Seconds per ring step.
    pub latency_s: f64,
}

/// What `--interconnect` names before the card is known.
#[derive(Debug, Clone, PartialEq)]
pub enum Link {
    /// The card's NVLink.
    NvLink,
    /// The card's PCIe link.
    Pcie,
    /// InfiniBand NDR, one 400 Gb/s NIC per GPU (a DGX H100 node's).
    InfiniBand,
    /// Given rates.
    Custom(Interconnect),
}

/// Per-ring-step latencies of the presets (NCCL's tuning model, src/graph/tuning.cc,
/// puts a ring step at a few microseconds: about 5 µs over NVLink, 6 µs over PCIe,
/// 10 µs over the network, rounded up).
const NVLINK_LATENCY_S: f64 = 5e-6;
const PCIE_LATENCY_S: f64 = 6e-6;
const IB_LATENCY_S: f64 = 10e-6;
/// InfiniBand NDR: 400 Gb/s per NIC.
const IB_BYTES_PER_S: f64 = 50e9;

impl std::str::FromStr for Link {
    type Err = String;

    /// `nvlink`, `pcie`, `infiniband` (or `ib`), or `BW,LATENCY`: a rate per second
    /// each way (`100G`: 100 GB/s) and the latency of one ring step (`5us`, `0.01ms`,
    /// or seconds).
    fn from_str(text: &str) -> std::result::Result<Self, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "nvlink" => return Ok(Link::NvLink),
            "pcie" => return Ok(Link::Pcie),
            "infiniband" | "ib" => return Ok(Link::InfiniBand),
            _ => {}
        }
        let (bw, lat) = text.split_once(',').ok_or_else(|| {
            format!("'{text}': expected nvlink, pcie, infiniband or BW,LATENCY (e.g. 100G,5us)")
        })?;
        let bytes_per_s = crate::units::parse_rate(bw.trim().trim_end_matches("B/s"))?;
        Ok(Link::Custom(Interconnect {
            name: "custom".into(),
            bytes_per_s,
            latency_s: parse_seconds(lat)?,
        }))
    }
}

/// `5us`, `0.01ms`, `2e-6s` or `2e-6`: seconds, at least 0.
fn parse_seconds(text: &str) -> std::result::Result<f64, String> {
    let t = text.trim();
    let (num, mult) = if let Some(n) = t.strip_suffix("us") {
        (n, 1e-6)
    } else if let Some(n) = t.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else {
        (t, 1.0)
    };
    match num.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v * mult),
        _ => Err(format!("'{text}': expected a latency such as 5us")),
    }
}

impl Link {
    /// The link on `gpu` for `gpus` GPUs: as given, or by default NVLink where the
    /// card has it and the GPUs fit one 8-GPU node, InfiniBand past one node, PCIe
    /// otherwise.
    pub fn resolve(given: Option<&Link>, gpu: &Gpu, gpus: u64) -> Result<Interconnect, String> {
        let link = match given {
            Some(l) => l.clone(),
            None if gpus > 8 => Link::InfiniBand,
            None if gpu.nvlink_gb_per_s > 0.0 => Link::NvLink,
            None => Link::Pcie,
        };
        Ok(match link {
            Link::NvLink if gpu.nvlink_gb_per_s <= 0.0 => {
                return Err(format!("the {} has no NVLink", gpu.name));
            }
            Link::NvLink => Interconnect {
                name: "nvlink".into(),
                bytes_per_s: gpu.nvlink_gb_per_s * 1e9,
                latency_s: NVLINK_LATENCY_S,
            },
            Link::Pcie => Interconnect {
                name: "pcie".into(),
                bytes_per_s: gpu.pcie_bytes_per_s(),
                latency_s: PCIE_LATENCY_S,
            },
            Link::InfiniBand => Interconnect {
                name: "infiniband".into(),
                bytes_per_s: IB_BYTES_PER_S,
                latency_s: IB_LATENCY_S,
            },
            Link::Custom(i) => i,
        })
    }
}

/// The card and its links: what the time model needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    /// The card.
    pub gpu: Gpu,
    /// Between the cards.
    pub link: Interconnect,
    /// Within a tensor-parallel group (one node: up to 8 GPUs).
    pub tp_link: Interconnect,
}

impl Cluster {
    /// `gpus` of `gpu` joined by `link` ([`Link::resolve`]'s default when `None`).
    pub fn of(gpu: Gpu, gpus: u64, link: Option<&Link>) -> Result<Cluster, String> {
        Ok(Cluster {
            link: Link::resolve(link, &gpu, gpus)?,
            tp_link: Link::resolve(link, &gpu, gpus.min(8))?,
            gpu,
        })
    }
}

/// Roofline seconds of one micro-batch's phases on one GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseSeconds {
    /// Forward and loss.
    pub forward: f64,
    /// Backward.
    pub backward: f64,
    /// The optimizer update.
    pub optimizer: f64,
}

/// Roofline seconds of `s`'s phases on `gpu`.
pub fn phase_seconds(s: &Schedule, gpu: &Gpu) -> PhaseSeconds {
    let mut t = PhaseSeconds::default();
    for step in &s.steps {
        let bytes: u64 = step
            .reads
            .iter()
            .chain(&step.writes)
            .map(|&i| s.storages[i].bytes)
            .sum();
        let half = step
            .reads
            .iter()
            .any(|&i| matches!(s.storages[i].dtype, DType::F16 | DType::BF16));
        let rate = if half {
            gpu.dense_tflops
        } else {
            gpu.fp32_tflops
        } * 1e12;
        let secs = (step.flops as f64 / rate).max(bytes as f64 / gpu.memory_bytes_per_s());
        match step.kind {
            StepKind::Forward | StepKind::Loss => t.forward += secs,
            StepKind::Backward => t.backward += secs,
            StepKind::Optimizer => t.optimizer += secs,
        }
    }
    t
}

/// An optimizer step's estimated time and its parts, seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StepTime {
    /// Everything below, added.
    pub total_s: f64,
    /// Forward and backward of every micro-batch, and the optimizer update.
    pub compute_s: f64,
    /// Recomputation (checkpointing).
    pub recompute_s: f64,
    /// Collective communication that no compute hides.
    pub exposed_communication_s: f64,
    /// All collective communication, hidden or not.
    pub communication_s: f64,
    /// Host-device copies (offload).
    pub pcie_s: f64,
    /// Pipeline stages idle at the start and end of the step (1F1B's bubble:
    /// `(p − 1)` micro-batch stage times).
    pub pipeline_bubble_s: f64,
}

/// What [`estimate`] needs of a combination.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// How the GPUs share the state.
    pub dist: Dist,
    /// GPUs.
    pub gpus: u64,
    /// Micro-batches per optimizer step.
    pub steps: u64,
    /// Extra FLOP fraction from recomputation.
    pub overhead: f64,
    /// Gradient bytes, parameter bytes and trainable parameter bytes, unpartitioned
    /// (`G`, `W`, `Wt` of [`super::combo`]).
    pub grads: u64,
    /// See `grads`.
    pub params: u64,
    /// See `grads`.
    pub trainable: u64,
    /// PCIe bytes per optimizer step.
    pub pcie_bytes: u64,
    /// Tensor and pipeline parallelism of each replica.
    pub mp: super::combo::Mp,
    /// Bytes one micro-batch's forward all-reduces over the tensor-parallel ranks
    /// (backward as much again).
    pub tp_bytes: u64,
}

/// The time of one optimizer step of `c`, whose micro-batch phases take `t`.
pub fn estimate(t: PhaseSeconds, c: &Shape, cl: &Cluster) -> StepTime {
    let n = c.gpus.max(1);
    let k = c.steps.max(1) as f64;
    let coll = |bytes: u64| collective_seconds(bytes, n, &cl.link);
    let hide = |comm: f64, window: f64| (comm - window).max(0.0);
    // A replica's ranks share its work evenly; the tensor-parallel all-reduces wait
    // for the layer before them and hold up the one after: not hidden.
    let ranks = c.mp.ranks().max(1) as f64;
    let fb = (t.forward + t.backward) / ranks;
    let tp_link = if c.mp.tp > 1 { &cl.tp_link } else { &cl.link };
    let tp_comm = k * 2.0 * collective_seconds(2 * c.tp_bytes, c.mp.tp, tp_link);
    let bubble = (c.mp.pp.max(1) - 1) as f64 * fb;
    let recompute = c.overhead * fb;
    // Recomputation runs inside backward, which hides collectives beside it.
    let back = t.backward / ranks + recompute;
    let fwd = t.forward / ranks;
    let (g, w, wt) = (c.grads, c.params, c.trainable);
    let (comm, exposed) = match c.dist {
        Dist::Single => (0.0, 0.0),
        _ if n == 1 => (0.0, 0.0),
        // One all-reduce of the gradients in the last micro-batch's backward.
        Dist::DataParallel => (coll(2 * g), hide(coll(2 * g), back)),
        // Reduce-scatter in the last backward; the updated parameters gathered after.
        Dist::Zero(1) => (coll(2 * g), hide(coll(g), back) + coll(g)),
        // Reduce-scatter in every backward; the gather after the step.
        Dist::Zero(2) | Dist::ZeroOffload => {
            (k * coll(g) + coll(wt), k * hide(coll(g), back) + coll(wt))
        }
        // Gathered in forward, kept for backward, reduce-scattered in it.
        Dist::Fsdp { reshard: false } => (
            k * (coll(w) + coll(g)),
            k * (hide(coll(w), fwd) + hide(coll(g), back)),
        ),
        // Parameters gathered in forward and backward of every micro-batch.
        _ => (
            k * (coll(w) * 2.0 + coll(g)),
            k * (hide(coll(w), fwd) + hide(coll(w) + coll(g), back)),
        ),
    };
    // ZeRO partitions the update; offload runs it on the host.
    let optimizer = match c.dist {
        Dist::Single | Dist::DataParallel => t.optimizer,
        Dist::ZeroOffload | Dist::Zero3Offload => 0.0,
        Dist::Zero(_) | Dist::Fsdp { .. } => t.optimizer / n as f64,
    };
    let optimizer = optimizer / ranks;
    let compute = k * fb + optimizer;
    let pcie = c.pcie_bytes as f64 / cl.gpu.pcie_bytes_per_s();
    let recompute = k * recompute;
    let exposed = exposed + tp_comm;
    StepTime {
        total_s: compute + recompute + exposed + pcie + bubble,
        compute_s: compute,
        recompute_s: recompute,
        exposed_communication_s: exposed,
        communication_s: comm + tp_comm,
        pcie_s: pcie,
        pipeline_bubble_s: bubble,
    }
}

/// Seconds of a ring collective moving `bytes` per GPU (ZeRO's count) over `n` GPUs.
pub fn collective_seconds(bytes: u64, n: u64, link: &Interconnect) -> f64 {
    if n <= 1 || bytes == 0 {
        return 0.0;
    }
    let frac = (n - 1) as f64 / n as f64;
    let calls = bytes.div_ceil(BUCKET_BYTES) as f64;
    frac * bytes as f64 / link.bytes_per_s + calls * (n - 1) as f64 * link.latency_s
}

/// Seconds as people read them: `812 ms`, `3.41 s`.
pub fn human_seconds(s: f64) -> String {
    if s < 1.0 {
        format!("{:.0} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

/// The estimated time of an optimizer step of `c` over `n` GPUs, `k` micro-batches
/// of `micro` samples, with recompute fraction `ov` and traffic `tr`.
pub(super) fn step_time(
    steps: &super::Steps,
    cl: &Cluster,
    c: super::Combo,
    (n, k, micro): (u64, u64, u64),
    ov: f64,
    tr: super::combo::Traffic,
) -> crate::error::Result<StepTime> {
    let s = steps.schedule(c, micro)?;
    let (grads, params, trainable) = super::combo::state_bytes(&s);
    let r = c.mp.ranks();
    let tp_bytes = if c.mp.tp > 1 {
        let names: Vec<String> = (0..s.tensor_storage.len())
            .map(|t| steps.model.graph.tensor(t).name.to_string())
            .collect();
        let l = c.mp.layout(k);
        crate::parallel::split::split(&mut (*s).clone(), &names, &l.degrees)
            .map_err(crate::error::Error::Graph)?
            .allreduce_bytes
            / c.mp.pp
    } else {
        0
    };
    let shape = Shape {
        dist: c.dist,
        gpus: n,
        steps: k,
        overhead: ov,
        grads: grads.div_ceil(r),
        params: params.div_ceil(r),
        trainable: trainable.div_ceil(r),
        pcie_bytes: tr.pcie_bytes,
        mp: c.mp,
        tp_bytes,
    };
    Ok(estimate(phase_seconds(&s, &cl.gpu), &shape, cl))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::device::Gpu;

    fn h100() -> Cluster {
        let gpu = Gpu::named("h100").unwrap();
        let link = Link::resolve(None, &gpu, 8).unwrap();
        Cluster {
            gpu,
            tp_link: link.clone(),
            link,
        }
    }

    fn shape(dist: Dist) -> Shape {
        Shape {
            dist,
            gpus: 8,
            steps: 1,
            overhead: 0.0,
            grads: 16 << 30,
            params: 16 << 30,
            trainable: 16 << 30,
            pcie_bytes: 0,
            mp: crate::fit::combo::Mp::NONE,
            tp_bytes: 0,
        }
    }

    #[test]
    fn links_parse_and_default_by_card_and_size() {
        let h = Gpu::named("h100").unwrap();
        assert_eq!(Link::resolve(None, &h, 8).unwrap().name, "nvlink");
        assert_eq!(Link::resolve(None, &h, 16).unwrap().name, "infiniband");
        let t4 = Gpu::named("t4").unwrap();
        assert_eq!(Link::resolve(None, &t4, 4).unwrap().name, "pcie");
        assert!(Link::resolve(Some(&Link::NvLink), &t4, 4).is_err());
        let c: Link = "100G,5us".parse().unwrap();
        let i = Link::resolve(Some(&c), &h, 8).unwrap();
        assert_eq!(i.bytes_per_s, 100e9);
        assert!((i.latency_s - 5e-6).abs() < 1e-15);
        assert!("fast".parse::<Link>().is_err());
        assert!("100G,soon".parse::<Link>().is_err());
    }

    #[test]
    fn hidden_communication_is_not_exposed_and_slow_links_cost_time() {
        let cl = h100();
        let t = PhaseSeconds {
            forward: 0.1,
            backward: 0.2,
            optimizer: 0.01,
        };
        // 32 GiB all-reduce over 450 GB/s: about 67 ms, hidden by 200 ms of backward.
        let ddp = estimate(t, &shape(Dist::DataParallel), &cl);
        assert!(ddp.communication_s > 0.05 && ddp.exposed_communication_s == 0.0);
        assert!((ddp.total_s - 0.31).abs() < 1e-9);
        // ZeRO-1's gather after the update is exposed.
        let z1 = estimate(t, &shape(Dist::Zero(1)), &cl);
        assert!(z1.exposed_communication_s > 0.03);
        // The same over PCIe Gen5 (63 GB/s) is slower than over NVLink: a 16 GiB
        // gather takes 235 ms there, longer than the forward it hides behind.
        let slow = Cluster {
            link: Link::resolve(Some(&Link::Pcie), &cl.gpu, 8).unwrap(),
            ..cl.clone()
        };
        let z3 = estimate(t, &shape(Dist::Zero(3)), &cl);
        let z3_slow = estimate(t, &shape(Dist::Zero(3)), &slow);
        assert!(z3_slow.total_s > z3.total_s);
        // Accumulation multiplies the compute.
        let acc = estimate(
            t,
            &Shape {
                steps: 4,
                ..shape(Dist::Single)
            },
            &cl,
        );
        assert!((acc.compute_s - 1.21).abs() < 1e-9);
    }
}
