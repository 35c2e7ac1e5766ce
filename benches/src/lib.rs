//! Benchmark-only crate; see `benches/profile.rs`.
