//! Activation recomputation: rewriting a training schedule so that fewer
//! activations are kept for backward, at the cost of recomputing them.

pub mod bench;
pub mod costs;
pub mod dag;
pub mod from_schedule;
pub mod graph;
pub mod heuristics;
pub mod ilp;
pub mod pareto;
pub mod plan;
pub mod planfile;
pub mod rewrite;
pub mod scale;
pub mod sqrt;
pub mod step;

pub use sqrt::checkpoint_sqrt;
