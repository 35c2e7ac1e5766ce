//! Activation recomputation: rewriting a training schedule so that fewer
//! activations are kept for backward, at the cost of recomputing them.

pub mod bench;
pub mod blocks;
pub mod bounds;
pub mod chain;
pub mod checkmate;
pub mod costs;
pub mod dag;
pub mod dtr;
pub mod from_schedule;
pub mod gap_milp;
pub mod graph;
pub mod heuristics;
pub mod hoist;
pub mod module_plan;
pub mod modules;
pub mod pareto;
pub mod plan;
pub mod planfile;
pub mod portfolio;
pub mod pytorch_ops;
pub mod sqrt;

pub use sqrt::checkpoint_sqrt;
