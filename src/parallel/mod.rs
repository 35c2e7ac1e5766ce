//! The training step of one rank when the model is spread over several GPUs.
//!
//! Each layout rewrites the one-GPU [`crate::train::Schedule`] into the schedule of a
//! rank, so the same replay (live tensors, the caching allocator) gives the rank's
//! peak:
//! - [`fsdp`]: FSDP2 (`fully_shard`) by units, HSDP included.

pub mod fsdp;

pub use fsdp::{shard, Fsdp, FsdpSummary};
