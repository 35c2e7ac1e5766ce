//! The counting device allocator: every [`super::DeviceTensor`] registers its
//! bytes here when allocated and unregisters them when dropped, so `live` and
//! `peak` count tensor bytes exactly as `exec::train::Allocator` counts storages
//! on the CPU (element count × element size, no rounding). Workspace (the cuBLAS
//! workspace, Conv's im2col buffers) is counted apart and reported apart, never
//! hidden and never mixed into the tensor peak.
//!
//! Cross-check: [`MemCounter::mark`] records `cuMemGetInfo`'s free bytes; the
//! driver's view of the bytes in use since the mark is then compared with the
//! counted ones ([`DriverCheck`]). The driver allocates in pages (2 MiB on
//! current GPUs) and the context itself holds memory, so the two agree only up
//! to that granularity: the check reports both rather than asserting equality.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Live and peak bytes of tensors, and workspace bytes, on one device.
#[derive(Debug, Default)]
pub struct MemCounter {
    live: AtomicU64,
    peak: AtomicU64,
    allocations: AtomicU64,
    workspace_live: AtomicU64,
    workspace_peak: AtomicU64,
    /// Whether a launcher runs for a training step ([`MemCounter::set_launching`]).
    launching: std::sync::atomic::AtomicBool,
    launch_live: AtomicU64,
    launch_peak: AtomicU64,
    /// `cuMemGetInfo` free bytes at the last [`MemCounter::mark`], and the
    /// lowest free bytes sampled since.
    driver: Mutex<Option<(u64, u64)>>,
}

/// A snapshot of a [`MemCounter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct MemoryReport {
    /// Tensor bytes live now.
    pub live_bytes: u64,
    /// Highest tensor bytes live since the last reset.
    pub peak_bytes: u64,
    /// Tensor allocations made.
    pub allocations: u64,
    /// Workspace bytes live now (cuBLAS workspace, im2col buffers).
    pub workspace_bytes: u64,
    /// Highest workspace bytes live since the last reset.
    pub workspace_peak_bytes: u64,
    /// Highest bytes of tensors a launcher allocated while launching for a
    /// training step and that the step had not yet stored (its outputs in flight,
    /// its temporaries), since the last reset: apart from tensors and workspace.
    pub launch_peak_bytes: u64,
}

/// The driver's view beside the counted one (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct DriverCheck {
    /// `free(mark) − min free(sampled since)`: the most device memory in use
    /// beyond what was in use at the mark, as the driver saw it.
    pub mem_get_info_peak_delta_bytes: u64,
    /// Counted tensor peak plus workspace and launch peaks over the same span
    /// (an upper bound of what was counted at once).
    pub counted_peak_bytes: u64,
}

impl MemCounter {
    /// Registers a tensor allocation of `bytes`.
    pub fn add(&self, bytes: u64) {
        let now = self.live.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.peak.fetch_max(now, Ordering::SeqCst);
        self.allocations.fetch_add(1, Ordering::SeqCst);
    }

    /// Unregisters a tensor allocation of `bytes`.
    pub fn sub(&self, bytes: u64) {
        self.live.fetch_sub(bytes, Ordering::SeqCst);
    }

    /// Registers workspace of `bytes`.
    pub fn add_workspace(&self, bytes: u64) {
        let now = self.workspace_live.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.workspace_peak.fetch_max(now, Ordering::SeqCst);
    }

    /// Unregisters workspace of `bytes`.
    pub fn sub_workspace(&self, bytes: u64) {
        self.workspace_live.fetch_sub(bytes, Ordering::SeqCst);
    }

    /// While on, new tensors count in the launch bucket (a training step's
    /// launcher running; the step moves what it stores into the tensor count
    /// with [`crate::exec::cuda::DeviceTensor::hold`]).
    pub fn set_launching(&self, on: bool) {
        self.launching.store(on, Ordering::SeqCst);
    }

    /// Whether [`MemCounter::set_launching`] is on.
    pub fn launching(&self) -> bool {
        self.launching.load(Ordering::SeqCst)
    }

    /// Registers launch bytes.
    pub fn add_launch(&self, bytes: u64) {
        let now = self.launch_live.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.launch_peak.fetch_max(now, Ordering::SeqCst);
    }

    /// Unregisters launch bytes.
    pub fn sub_launch(&self, bytes: u64) {
        self.launch_live.fetch_sub(bytes, Ordering::SeqCst);
    }

    /// Restarts the peaks at the live values (the start of a measured step).
    pub fn reset_peak(&self) {
        self.launch_peak
            .store(self.launch_live.load(Ordering::SeqCst), Ordering::SeqCst);
        self.peak
            .store(self.live.load(Ordering::SeqCst), Ordering::SeqCst);
        self.workspace_peak
            .store(self.workspace_live.load(Ordering::SeqCst), Ordering::SeqCst);
        self.allocations.store(0, Ordering::SeqCst);
    }

    /// The counts now.
    pub fn report(&self) -> MemoryReport {
        MemoryReport {
            live_bytes: self.live.load(Ordering::SeqCst),
            peak_bytes: self.peak.load(Ordering::SeqCst),
            allocations: self.allocations.load(Ordering::SeqCst),
            workspace_bytes: self.workspace_live.load(Ordering::SeqCst),
            workspace_peak_bytes: self.workspace_peak.load(Ordering::SeqCst),
            launch_peak_bytes: self.launch_peak.load(Ordering::SeqCst),
        }
    }

    /// Starts a driver cross-check with `free` = `cuMemGetInfo`'s free bytes now.
    pub fn mark(&self, free: u64) {
        *self.driver.lock().expect("no poisoned lock") = Some((free, free));
    }

    /// Records a `cuMemGetInfo` sample (after a synchronize, e.g. after every
    /// allocation of a measured step).
    pub fn sample(&self, free: u64) {
        if let Some((_, low)) = self.driver.lock().expect("no poisoned lock").as_mut() {
            *low = (*low).min(free);
        }
    }

    /// The cross-check since [`MemCounter::mark`]; `None` without a mark.
    pub fn driver_check(&self) -> Option<DriverCheck> {
        let (mark, low) = (*self.driver.lock().expect("no poisoned lock"))?;
        let r = self.report();
        Some(DriverCheck {
            mem_get_info_peak_delta_bytes: mark.saturating_sub(low),
            counted_peak_bytes: r.peak_bytes + r.workspace_peak_bytes + r.launch_peak_bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_like_the_cpu_allocator() {
        let m = MemCounter::default();
        m.add(100);
        m.add(50);
        m.sub(100);
        m.add(10);
        let r = m.report();
        assert_eq!((r.live_bytes, r.peak_bytes, r.allocations), (60, 150, 3));
        m.add_workspace(7);
        m.sub_workspace(7);
        assert_eq!(m.report().workspace_peak_bytes, 7);
        assert_eq!(m.report().peak_bytes, 150, "workspace is counted apart");
        m.reset_peak();
        assert_eq!(m.report().peak_bytes, 60);
        m.mark(1000);
        m.sample(900);
        m.sample(950);
        let c = m.driver_check().unwrap();
        assert_eq!(c.mem_get_info_peak_delta_bytes, 100);
    }
}
