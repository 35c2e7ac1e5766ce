//! Memory accounting: tensor lifetimes over an execution order and the peak.

pub mod profile;

pub use profile::{profile_inference, InferenceProfile, LiveTensor};
