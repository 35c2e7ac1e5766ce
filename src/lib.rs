//! memplan: predicts the memory of running and training an ONNX model.
//!
//! Pipeline: [`onnx::load_model`] maps and decodes the file into the [`ir`] graph;
//! [`infer::lower::lower`] turns control flow (If, Loop, Scan) and sequences into plain ops
//! for the bindings; [`infer::infer`] binds symbolic dimensions and gives every tensor a concrete
//! dtype and shape using the per-op rules in [`ops`]; [`memory::profile`] walks
//! tensor lifetimes over the execution order to the peak; [`report`] prints it;
//! [`exec`] runs the graph on the CPU with each op's kernel.
#![warn(missing_docs)]

pub mod choice;
pub mod error;
pub mod exec;
pub mod files;
pub mod fit;
pub mod infer;
pub mod ir;
pub mod memory;
pub mod moe;
pub mod numeric;
pub mod onnx;
pub mod ops;
pub mod parallel;
pub mod remat;
pub mod report;
pub mod rewrite;
pub mod step;
pub mod train;
pub mod units;

pub use error::{Error, Result};

// The COIN-OR `*-src` crates carry no Rust items anyone uses, only the static
// libraries of CBC built from source; naming them keeps those libraries in the
// link (otherwise it fails on undefined C++ symbols). build.rs links the C++
// runtime they need. (The team recipe this follows: cbc-from-source.md in the
// shared notes.)
extern crate cbc_src;
extern crate cgl_src;
extern crate clp_src;
extern crate coinutils_src;
extern crate osi_src;

/// The global allocator the `memplan` binary and the `profile` bench install
/// (`#[global_allocator] static A: memplan::Allocator = memplan::Allocator;`):
/// mimalloc, which serves loading's many small allocations faster than glibc's
/// malloc. The library itself allocates through whatever the program installs.
pub use mimalloc::MiMalloc as Allocator;
