//! Memory accounting: tensor lifetimes over an execution order and the peak.

pub mod allocator;
pub mod device;
pub mod profile;
pub mod simulate;

pub use profile::{profile_inference, InferenceProfile, LiveTensor};
pub use simulate::{simulate, Breakdown, Category, Replay};
