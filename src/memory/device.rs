//! What a GPU holds for a training step in PyTorch: the step's allocations replayed
//! through the simulated caching allocator ([`super::allocator`]) as a training loop
//! makes them, plus the CUDA context. This is what `torch.cuda.max_memory_reserved`
//! and nvidia-smi show, where the schedule's peak counts live tensor bytes only.
//!
//! The loop ([`replay_events`]; [`replay_schedule`] for a schedule,
//! `remat::graph::replay_on_device` for a recompute plan):
//! 1. `model.to("cuda")`: every fixed value (parameters, buffers, constants, the
//!    batch) in storage order, except optimizer state;
//! 2. step 1: the first forward instruction allocates the cuBLAS workspace of the
//!    thread that runs forward, the first backward instruction a second one for
//!    autograd's device thread (torch/csrc/autograd/engine.cpp runs CUDA backward on
//!    one worker thread per device; aten/src/ATen/cuda/CublasHandlePool.cpp keeps one
//!    workspace per (handle, stream) and handles per thread, allocated through the
//!    caching allocator). Optimizer state is allocated when the optimizer step first
//!    reads it, as `torch.optim` creates its state lazily. Values are allocated when
//!    computed and freed when the plan frees them; at the end of the step every
//!    value still live that is not fixed is freed (`zero_grad(set_to_none=True)`, the
//!    outputs and the loss dropped);
//! 3. the same step again, with the cache warm, until a step reserves nothing new
//!    (at most [`MAX_STEPS`]).
//!
//! Not modelled: cuDNN's per-convolution workspaces (allocated through the caching
//! allocator for the duration of one call; their size depends on the algorithm
//! cuDNN picks), `cudnn.benchmark`'s search workspace, and memory libraries take
//! outside the allocator beyond the context figure.

use serde::Serialize;
use smallvec::SmallVec;

use super::allocator::{AllocConf, Allocator, BlockId, OutOfMemory};
use crate::train::{Schedule, StorageKind};

/// Training steps replayed at most before the reserved bytes are taken as settled.
pub const MAX_STEPS: usize = 4;

const MIB: u64 = 1 << 20;

/// A GPU model: its memory and what PyTorch takes on it besides tensors.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gpu {
    /// Name as given on the command line.
    pub name: &'static str,
    /// Compute capability (major, minor).
    pub capability: (u8, u8),
    /// Total memory as nvidia-smi prints it, MiB.
    pub smi_total_mib: u64,
    /// Total memory as CUDA reports it (`torch.cuda.mem_get_info()[1]`), MiB, where
    /// a published figure exists; nvidia-smi's total includes memory the driver
    /// reserves.
    pub cuda_total_mib: Option<u64>,
    /// PCIe generation of its x16 host link (the vendor's spec sheet).
    pub pcie_gen: u8,
    /// Dense bf16 (fp16 on cards without bf16) tensor-core rate, TFLOP/s, without
    /// sparsity (the vendor's spec sheet; SXM parts where there are two).
    pub dense_tflops: f64,
    /// Non-tensor-core fp32 rate, TFLOP/s (the spec sheet): what fp32 matrix products
    /// run at, as PyTorch does not use TF32 for them by default.
    pub fp32_tflops: f64,
    /// Memory bandwidth, GB/s (10⁹ bytes; the spec sheet).
    pub memory_gb_per_s: f64,
    /// NVLink bandwidth per direction, GB/s (half the bidirectional figure of the
    /// spec sheet; 0: the card has none, or only bridges between pairs).
    pub nvlink_gb_per_s: f64,
}

/// Cards with published totals (docs/ALLOCATOR.md gives the sources).
pub const GPUS: &[Gpu] = &[
    gpu(
        "v100-16gb",
        (7, 0),
        16160,
        Some(16130),
        3,
        [125.0, 15.7, 900.0, 150.0],
    ),
    gpu(
        "v100-32gb",
        (7, 0),
        32768,
        None,
        3,
        [125.0, 15.7, 900.0, 150.0],
    ),
    gpu("t4", (7, 5), 15360, Some(15095), 3, [65.0, 8.1, 320.0, 0.0]),
    gpu("a10", (8, 6), 23028, None, 4, [125.0, 31.2, 600.0, 0.0]),
    gpu(
        "a100-40gb",
        (8, 0),
        40960,
        Some(40339),
        4,
        [312.0, 19.5, 1555.0, 300.0],
    ),
    gpu(
        "a100-80gb",
        (8, 0),
        81920,
        Some(81158),
        4,
        [312.0, 19.5, 2039.0, 300.0],
    ),
    gpu("l4", (8, 9), 23034, None, 4, [121.0, 30.3, 300.0, 0.0]),
    gpu("l40s", (8, 9), 46068, None, 4, [362.0, 91.6, 864.0, 0.0]),
    gpu(
        "rtx4090",
        (8, 9),
        24564,
        Some(24563),
        4,
        [165.0, 82.6, 1008.0, 0.0],
    ),
    gpu(
        "h100",
        (9, 0),
        81559,
        Some(81090),
        5,
        [989.0, 67.0, 3350.0, 450.0],
    ),
    gpu(
        "h200",
        (9, 0),
        143771,
        Some(143156),
        5,
        [989.0, 67.0, 4800.0, 450.0],
    ),
    gpu(
        "b200",
        (10, 0),
        183359,
        Some(182631),
        5,
        [2250.0, 80.0, 8000.0, 900.0],
    ),
];

/// A table row; `rates`: dense half-precision TFLOP/s, fp32 TFLOP/s, memory GB/s,
/// NVLink GB/s per direction.
const fn gpu(
    name: &'static str,
    cc: (u8, u8),
    smi: u64,
    cuda: Option<u64>,
    pcie_gen: u8,
    rates: [f64; 4],
) -> Gpu {
    Gpu {
        name,
        capability: cc,
        smi_total_mib: smi,
        cuda_total_mib: cuda,
        pcie_gen,
        dense_tflops: rates[0],
        fp32_tflops: rates[1],
        memory_gb_per_s: rates[2],
        nvlink_gb_per_s: rates[3],
    }
}

impl Gpu {
    /// Looks a card up by name (case-insensitive).
    pub fn named(name: &str) -> Result<Gpu, String> {
        GPUS.iter()
            .find(|g| g.name.eq_ignore_ascii_case(name))
            .copied()
            .ok_or_else(|| {
                format!(
                    "unknown GPU '{name}' (known: {})",
                    GPUS.iter().map(|g| g.name).collect::<Vec<_>>().join(", ")
                )
            })
    }

    /// The host link's rate per direction, bytes/s: the PCIe spec's x16 rate for its
    /// generation (15.75 GB/s for Gen3, doubling each generation), an upper bound on
    /// what a pinned-memory copy reaches.
    pub fn pcie_bytes_per_s(&self) -> f64 {
        15.75e9 * f64::from(1u32 << self.pcie_gen.saturating_sub(3))
    }

    /// [`Gpu::dense_tflops`] in FLOP/s.
    pub fn flops_per_s(&self) -> f64 {
        self.dense_tflops * 1e12
    }

    /// [`Gpu::memory_gb_per_s`] in bytes/s.
    pub fn memory_bytes_per_s(&self) -> f64 {
        self.memory_gb_per_s * 1e9
    }

    /// The memory PyTorch can use: CUDA's total where published, else nvidia-smi's.
    pub fn total_bytes(&self) -> u64 {
        self.cuda_total_mib.unwrap_or(self.smi_total_mib) * MIB
    }
}

/// The CUDA context (driver, runtime, the kernels loaded lazily) of a PyTorch
/// process: published measurements under lazy module loading, which PyTorch turns
/// on itself since 1.13.
fn context_for(cc: Option<(u8, u8)>) -> (u64, &'static str) {
    match cc {
        // Measured here: nvidia-smi's process memory less torch.cuda.memory_reserved()
        // while training (tools/gpu-allocator-check.py, 24 runs of six models), 742 to
        // 762 MiB; the largest (convolution models, cuDNN's modules loaded) is used.
        Some((9, 0)) => (
            762 * MIB,
            "762 MiB measured on an H200 while training, PyTorch 2.11 + CUDA 13.0, driver 580 (docs/ALLOCATOR.md); the H100 is assumed the same",
        ),
        Some((8, 9)) => (
            426 * MIB,
            "426 MiB measured on an RTX 6000 Ada, PyTorch 2.10 + CUDA 13.0 (unsloth-zoo PR 1053)",
        ),
        _ => (
            400 * MIB,
            "about 400 MB under lazy loading (pytorch/pytorch issue 109888); no published figure for this generation",
        ),
    }
}

/// `parseChosenWorkspaceSize`'s default: `:4096:8` (32 MiB) on compute capability
/// 9.x to 12.x, `:4096:2:16:8` (8 MiB + 128 KiB) before.
fn cublas_workspace_for(cc: Option<(u8, u8)>) -> u64 {
    match cc {
        Some((major, _)) if (9..=12).contains(&major) => 4096 * 8 * 1024,
        _ => 4096 * 1024 * 2 + 16 * 1024 * 8,
    }
}

/// The device a step is replayed for.
#[derive(Debug, Clone)]
pub struct DeviceModel {
    /// The allocator's settings.
    pub conf: AllocConf,
    /// The card (`None`: a generic pre-Hopper card of unlimited memory).
    pub gpu: Option<Gpu>,
    /// CUDA context bytes.
    pub context_bytes: u64,
    /// Where `context_bytes` comes from.
    pub context_source: String,
    /// One cuBLAS workspace.
    pub cublas_workspace_bytes: u64,
    /// Bytes the allocator may reserve (`u64::MAX`: unlimited).
    pub capacity: u64,
    /// Memory kept free ([`DeviceModel::with_memory`]).
    pub headroom: u64,
    /// Memory NCCL holds outside the caching allocator for the process groups the
    /// rank communicates in ([`nccl_bytes`]; 0 on one GPU).
    pub nccl_bytes: u64,
    /// NCCL's memory per communicator as measured on the user's cluster (`None`:
    /// the published figures of [`nccl_communicator_bytes`]).
    pub nccl_per_group: Option<u64>,
}

/// GPU memory NCCL holds for one communicator of `ranks` ranks, outside PyTorch's
/// caching allocator (channel buffers, proxy and peer-to-peer staging): 544 MB for
/// a group of two, 688 MB for more, measured with PyTorch on four NVLink A100s
/// after a 4 MB all-reduce in each group (NVIDIA/nccl issue 964). It grows with
/// `NCCL_BUFFSIZE` (default 4 MiB per channel) and the channel count, so a cluster
/// tuned otherwise holds a different amount: give `--headroom` for that.
pub fn nccl_communicator_bytes(ranks: u64) -> u64 {
    match ranks {
        0 | 1 => 0,
        2 => 544 * MIB,
        _ => 688 * MIB,
    }
}

/// NCCL's memory on a rank that communicates in groups of the given sizes.
pub fn nccl_bytes(groups: &[u64]) -> u64 {
    groups.iter().map(|&r| nccl_communicator_bytes(r)).sum()
}

impl DeviceModel {
    /// For `gpu` (or a generic card), with the context figure overridden by
    /// `context` when given; the allocator may reserve without limit.
    pub fn new(conf: AllocConf, gpu: Option<Gpu>, context: Option<u64>) -> DeviceModel {
        let cc = gpu.map(|g| g.capability);
        let (ctx, source) = context_for(cc);
        DeviceModel {
            conf,
            gpu,
            context_bytes: context.unwrap_or(ctx),
            context_source: if context.is_some() {
                "given".to_string()
            } else {
                source.to_string()
            },
            cublas_workspace_bytes: cublas_workspace_for(cc),
            capacity: u64::MAX,
            headroom: 0,
            nccl_bytes: 0,
            nccl_per_group: None,
        }
    }

    /// The same device with `memory` bytes in all, `headroom` of them kept free:
    /// what the allocator may reserve is the rest after the context (0 when the
    /// context alone does not fit).
    pub fn with_memory(mut self, memory: u64, headroom: u64) -> DeviceModel {
        self.capacity = memory
            .saturating_sub(headroom)
            .saturating_sub(self.context_bytes);
        self.headroom = headroom;
        self
    }

    /// The same device on a rank that communicates in groups of the given sizes
    /// ([`DeviceModel::with_nccl`] of their NCCL memory).
    pub fn on_groups(self, groups: &[u64]) -> DeviceModel {
        let bytes = match self.nccl_per_group {
            Some(b) => groups.iter().filter(|&&r| r > 1).map(|_| b).sum(),
            None => nccl_bytes(groups),
        };
        self.with_nccl(bytes)
    }

    /// The same device on a rank that also holds `nccl` bytes for NCCL: what the
    /// allocator may reserve shrinks by them, and nvidia-smi shows them.
    pub fn with_nccl(mut self, nccl: u64) -> DeviceModel {
        let extra = nccl.saturating_sub(self.nccl_bytes);
        if self.capacity != u64::MAX {
            self.capacity = self.capacity.saturating_sub(extra);
        }
        self.nccl_bytes = nccl;
        self
    }
}

/// The device a figure is for (`training.device` in the profile JSON, `device` in
/// fit's).
#[derive(Debug, Clone, Serialize)]
pub struct DeviceSummary {
    /// The GPU named (`None`: a generic pre-Hopper card).
    pub gpu: Option<String>,
    /// The CUDA context counted.
    pub context_bytes: u64,
    /// Where that figure comes from.
    pub context_source: String,
    /// One cuBLAS workspace (PyTorch's default for the card).
    pub cublas_workspace_bytes: u64,
    /// Whether the allocator uses expandable segments.
    pub expandable_segments: bool,
    /// Memory kept free (fit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub headroom_bytes: Option<u64>,
    /// What the allocator may reserve: the memory less headroom and the context
    /// (fit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocator_capacity_bytes: Option<u64>,
    /// NCCL's memory outside the allocator, per rank (several GPUs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nccl_bytes: Option<u64>,
}

impl DeviceModel {
    /// What nvidia-smi shows for the process after a replay: the allocator's
    /// reserved bytes (cuBLAS workspaces among them) plus the CUDA context.
    pub fn device_bytes(&self, a: &AllocatorReport) -> u64 {
        a.reserved_bytes
            .saturating_add(self.context_bytes)
            .saturating_add(self.nccl_bytes)
    }

    /// What this device assumes.
    pub fn summary(&self) -> DeviceSummary {
        let limited = self.capacity != u64::MAX;
        DeviceSummary {
            gpu: self.gpu.map(|g| g.name.to_string()),
            context_bytes: self.context_bytes,
            context_source: self.context_source.clone(),
            cublas_workspace_bytes: self.cublas_workspace_bytes,
            expandable_segments: self.conf.expandable_segments,
            headroom_bytes: limited.then_some(self.headroom),
            allocator_capacity_bytes: limited.then_some(self.capacity),
            nccl_bytes: (self.nccl_bytes > 0).then_some(self.nccl_bytes),
        }
    }
}

/// `training.allocator` in the profile JSON: the step under PyTorch's caching
/// allocator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AllocatorReport {
    /// Peak bytes in allocated blocks (`torch.cuda.max_memory_allocated`): tensors at
    /// their rounded sizes, and the cuBLAS workspaces.
    pub allocated_peak_bytes: u64,
    /// Peak bytes reserved (`torch.cuda.max_memory_reserved`).
    pub reserved_bytes: u64,
    /// Segments (`cudaMalloc`s, or expandable segments) when reserved peaked.
    pub segments: u64,
    /// `reserved_bytes - allocated_peak_bytes`: memory the allocator holds that no
    /// tensor uses at the allocated peak (rounding, split remainders, cached blocks
    /// too small or in the wrong place).
    pub fragmentation_bytes: u64,
    /// cuBLAS workspaces among the allocations (one for forward's thread, one for
    /// autograd's device thread).
    pub cublas_workspaces: u64,
    /// Training steps replayed until reserved settled.
    pub steps_replayed: u64,
    /// Cached segments released because the device was full (0 without a memory
    /// limit).
    pub cache_releases: u64,
}

/// One event of a training step, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A step starts (backward or not: which thread runs it).
    Step {
        /// Whether it is a backward step.
        backward: bool,
    },
    /// A value is allocated (no-op when it is live).
    Alloc(usize),
    /// A value is freed (no-op when it is not live or fixed).
    Free(usize),
}

/// The training loop of a schedule, its storages living as [`super::simulate`]
/// lives them: each
/// allocation of a storage from the step that writes it (or first reads it) to
/// the end of its last reader, a recomputed tensor a new allocation; optimizer
/// state allocated at its first use.
pub fn replay_schedule(s: &Schedule, d: &DeviceModel) -> Result<AllocatorReport, OutOfMemory> {
    let ivs = super::simulate::intervals(s);
    let n = s.steps.len();
    let mut starts: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut ends: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (v, (st, iv)) in s.storages.iter().zip(&ivs).enumerate() {
        if st.persistent {
            continue;
        }
        for &(a, b) in iv {
            starts[a].push(v);
            ends[b].push(v);
        }
    }
    let values = StepValues::of(s);
    let lazy = &values.lazy;
    let mut events = Vec::with_capacity(n * 4);
    for (i, st) in s.steps.iter().enumerate() {
        events.push(Event::Step {
            backward: st.kind == crate::train::StepKind::Backward,
        });
        // Optimizer state at its first use (Alloc of a live value is a no-op).
        events.extend(
            st.reads
                .iter()
                .chain(&st.updates)
                .filter(|&&v| lazy[v])
                .map(|&v| Event::Alloc(v)),
        );
        events.extend(starts[i].iter().map(|&v| Event::Alloc(v)));
        events.extend(ends[i].iter().map(|&v| Event::Free(v)));
    }
    let fixed: Vec<bool> = s.storages.iter().map(|st| st.persistent).collect();
    replay_events(&values, &fixed, &events, d)
}

/// The allocations of a step's values (its schedule's storages): each one's
/// tensors ([`crate::train::Storage::allocations`]: optimizer state per state and
/// parameter), and which are allocated at their first use (optimizer state).
#[derive(Debug, Clone)]
pub struct StepValues {
    /// Bytes of every tensor, value after value; value `v`'s are
    /// `pieces[start[v]..start[v + 1]]`.
    pieces: Vec<u64>,
    start: Vec<usize>,
    /// Fixed values allocated at their first use rather than up front.
    pub lazy: Vec<bool>,
}

impl StepValues {
    /// The storages of `s` (the values of its remat graph, `remat::from_schedule`).
    pub fn of(s: &Schedule) -> StepValues {
        let mut pieces = Vec::with_capacity(s.storages.len());
        let mut start = Vec::with_capacity(s.storages.len() + 1);
        start.push(0);
        for st in &s.storages {
            pieces.extend(st.allocations().iter().copied().filter(|&b| b > 0));
            start.push(pieces.len());
        }
        StepValues {
            pieces,
            start,
            lazy: s
                .storages
                .iter()
                .map(|st| st.kind == StorageKind::OptimizerState && st.persistent)
                .collect(),
        }
    }

    /// How many values.
    pub fn len(&self) -> usize {
        self.lazy.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.lazy.is_empty()
    }

    /// Bytes of each tensor PyTorch allocates for value `v`, in order.
    pub fn sizes(&self, v: usize) -> &[u64] {
        &self.pieces[self.start[v]..self.start[v + 1]]
    }
}

/// The blocks of one value (almost always one tensor).
type Blocks = SmallVec<[BlockId; 1]>;

/// Allocates every tensor of a value.
fn alloc_value(a: &mut Allocator, sizes: &[u64]) -> Result<Blocks, OutOfMemory> {
    sizes.iter().map(|&b| a.malloc(b)).collect()
}

/// The training loop over one step's events (see the module docs): `fixed[v]`
/// values are allocated before the first step and never freed (at their first
/// `Alloc` when lazy). An error is the allocation the device cannot hold.
pub fn replay_events(
    values: &StepValues,
    fixed: &[bool],
    events: &[Event],
    d: &DeviceModel,
) -> Result<AllocatorReport, OutOfMemory> {
    let mut a = Allocator::new(d.conf, d.capacity);
    let mut held: Vec<Blocks> = vec![Blocks::new(); values.len()];
    for v in 0..values.len() {
        if fixed[v] && !values.lazy[v] {
            held[v] = alloc_value(&mut a, values.sizes(v))?;
        }
    }
    let mut workspaces = 0u64;
    let (mut fwd_ws, mut bwd_ws) = (false, false);
    let mut steps = 0u64;
    for _ in 0..MAX_STEPS {
        let before = a.stats().reserved_peak;
        for &e in events {
            match e {
                Event::Step { backward } => {
                    let ws = if backward { &mut bwd_ws } else { &mut fwd_ws };
                    if !*ws && d.cublas_workspace_bytes > 0 {
                        a.malloc(d.cublas_workspace_bytes)?;
                        *ws = true;
                        workspaces += 1;
                    }
                }
                Event::Alloc(v) => {
                    if held[v].is_empty() {
                        held[v] = alloc_value(&mut a, values.sizes(v))?;
                    }
                }
                Event::Free(v) => {
                    if !fixed[v] {
                        for b in held[v].drain(..) {
                            a.free(b);
                        }
                    }
                }
            }
        }
        for (v, slot) in held.iter_mut().enumerate() {
            if !fixed[v] {
                for b in slot.drain(..) {
                    a.free(b);
                }
            }
        }
        steps += 1;
        if steps > 1 && a.stats().reserved_peak == before {
            break;
        }
    }
    let s = a.stats();
    Ok(AllocatorReport {
        allocated_peak_bytes: s.allocated_peak,
        reserved_bytes: s.reserved_peak,
        segments: s.segments_at_peak,
        fragmentation_bytes: s.reserved_peak.saturating_sub(s.allocated_peak),
        cublas_workspaces: workspaces,
        steps_replayed: steps,
        cache_releases: s.releases,
    })
}
