//! NVRTC compilation of kernels/ (embedded by [`crate::exec::cuda_src`]). A
//! [`super::Device`] compiles each source once, at the first launch of one of
//! its kernels, for the device's own architecture, and caches the module.
//! [`compile`] also runs without a GPU (only libnvrtc is needed), which is how
//! CI checks every kernel (tests/cuda.rs, .ci/cuda-nvrtc.sh).

use cudarc::nvrtc::{CompileOptions, Ptx};

use super::{guarded, CudaError, Result};
use crate::exec::cuda_src::Source;

/// The virtual architecture for compute capability `major.minor` (PTX for
/// exactly that GPU, JIT-compiled by the driver). Unknown capabilities fall
/// back to the newest listed below them.
pub fn arch_name(major: i32, minor: i32) -> &'static str {
    const ARCHS: &[((i32, i32), &str)] = &[
        ((10, 0), "compute_100"),
        ((9, 0), "compute_90"),
        ((8, 9), "compute_89"),
        ((8, 7), "compute_87"),
        ((8, 6), "compute_86"),
        ((8, 0), "compute_80"),
        ((7, 5), "compute_75"),
        ((7, 0), "compute_70"),
    ];
    ARCHS
        .iter()
        .find(|(cc, _)| (major, minor) >= *cc)
        .map_or("compute_70", |(_, a)| a)
}

/// Whether libnvrtc can be loaded (no GPU needed).
pub fn nvrtc_available() -> bool {
    // SAFETY: only dlopens the candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles one kernels/ source for `arch` (`compute_XY`). Defaults of NVRTC
/// otherwise: IEEE division and square root, FMA contraction on (results agree
/// with the CPU to rounding).
pub fn compile(src: &Source, arch: &'static str) -> Result<Ptx> {
    if !nvrtc_available() {
        return Err(CudaError::Unavailable(
            "libnvrtc cannot be loaded (CUDA toolkit, or pip nvidia-cuda-nvrtc-cu12 with its lib/ on LD_LIBRARY_PATH)".into(),
        ));
    }
    let file = src.file;
    guarded("NVRTC", || {
        let opts = CompileOptions {
            arch: Some(arch),
            name: Some(file.to_string()),
            options: vec!["--std=c++17".into()],
            ..Default::default()
        };
        cudarc::nvrtc::compile_ptx_with_opts(src.program(), opts).map_err(|e| match e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => CudaError::Compile {
                file,
                log: log.to_string_lossy().into_owned(),
            },
            other => CudaError::Compile {
                file,
                log: format!("{other:?}"),
            },
        })
    })
}

/// The PTX text of a compiled source (tests check each kernel's entry is in it).
pub fn ptx_text(ptx: &Ptx) -> String {
    ptx.to_src()
}
