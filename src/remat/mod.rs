//! Activation recomputation: rewriting a training schedule so that fewer
//! activations are kept for backward, at the cost of recomputing them.

pub mod sqrt;

pub use sqrt::checkpoint_sqrt;
