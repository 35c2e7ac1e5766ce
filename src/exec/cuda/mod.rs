//! The GPU backend (cargo feature `cuda`; docs/CUDA.md): CUDA driver, NVRTC and
//! cuBLAS through cudarc, every library loaded with dlopen at first use, so a
//! build with the feature runs (and says clearly why the GPU is unavailable) on
//! a machine without CUDA.
//!
//! - [`probe`]: which CUDA libraries can be loaded, checked before any call
//!   (cudarc panics on a missing library; memplan answers with one line).
//! - [`Device`]: context, stream, cuBLAS handle, the NVRTC kernel cache
//!   ([`kernels`]) and the counting allocator ([`alloc`]).
//! - [`DeviceTensor`]: a typed device buffer with a shape, counted while alive.
//! - [`ops`]: per-op launchers, forward and backward, mirroring the CPU kernels
//!   of src/ops (the kernel names sit beside each op's rules: `Op::cuda_kernels`).

pub mod alloc;
pub mod emulate;
pub mod kernels;
pub mod ops;
pub mod precision;
pub mod run;
pub mod step;
pub mod tensor;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};

pub use alloc::{MemCounter, MemoryReport};
pub use tensor::{DeviceTensor, Strided, Win};

pub use crate::error::CudaError;

/// Result of the GPU backend.
pub type Result<T> = std::result::Result<T, CudaError>;

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> CudaError {
        CudaError::Driver(format!("{e:?}"))
    }
}

impl From<cudarc::cublas::result::CublasError> for CudaError {
    fn from(e: cudarc::cublas::result::CublasError) -> CudaError {
        CudaError::Blas(format!("{e:?}"))
    }
}

/// The CUDA libraries memplan loads, and whether each can be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Libraries {
    /// libcuda (the driver; comes with the GPU driver, not the toolkit).
    pub driver: bool,
    /// libnvrtc (the runtime compiler; a toolkit or the nvidia-cuda-nvrtc-cu12 wheel).
    pub nvrtc: bool,
    /// libcublas.
    pub cublas: bool,
}

/// Which CUDA libraries can be loaded (dlopen with the names cudarc tries; the
/// loader's search path, e.g. `LD_LIBRARY_PATH`, decides where).
pub fn probe() -> Libraries {
    // SAFETY: each probe only dlopens the candidate names and drops the handle.
    unsafe {
        Libraries {
            driver: cudarc::driver::sys::is_culib_present(),
            nvrtc: cudarc::nvrtc::sys::is_culib_present(),
            cublas: cudarc::cublas::sys::is_culib_present(),
        }
    }
}

impl Libraries {
    /// `Ok` when every library the device backend needs loads; else one line
    /// naming what is missing.
    pub fn require_all(&self) -> Result<()> {
        let missing: Vec<&str> = [
            (self.driver, "libcuda (the NVIDIA driver)"),
            (
                self.nvrtc,
                "libnvrtc (CUDA toolkit or pip nvidia-cuda-nvrtc-cu12)",
            ),
            (
                self.cublas,
                "libcublas (CUDA toolkit or pip nvidia-cublas-cu12)",
            ),
        ]
        .iter()
        .filter(|(ok, _)| !ok)
        .map(|(_, n)| *n)
        .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(CudaError::Unavailable(format!(
                "the CUDA backend cannot start: {} cannot be loaded (set LD_LIBRARY_PATH to the directory holding it)",
                missing.join(", ")
            )))
        }
    }
}

/// Runs `f`, turning a panic of cudarc (a symbol missing from an older library)
/// into an error.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(CudaError::Unavailable(format!("{what}: {msg}")))
        }
    }
}

/// Bytes of the cuBLAS workspace memplan gives cuBLAS (allocated through the
/// counting allocator as workspace, so cuBLAS never allocates behind its back).
/// 32 MiB: NVIDIA's recommendation for Hopper, ample for older GPUs.
pub const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// A CUDA device: context, stream, cuBLAS handle (with a counted workspace)
/// and the NVRTC module cache.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    arch: &'static str,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
    /// The cuBLAS workspace (counted as workspace); kept alive with the handle.
    _blas_workspace: cudarc::driver::CudaSlice<u8>,
}

/// Where a [`Device`] runs its kernels.
pub enum Backend {
    /// A GPU.
    Gpu(Gpu),
    /// The kernels of kernels/ compiled for the host by a C++ compiler
    /// ([`emulate`]), run one thread per block, on host memory: the launchers and
    /// kernels execute without a GPU (tests), GEMMs by a naive loop.
    Emulated(emulate::Emulator),
}

/// One device: its backend and memory counter. Every launch goes on one
/// stream, in order.
pub struct Device {
    backend: Backend,
    mem: Arc<MemCounter>,
}

impl Device {
    /// Opens GPU `ordinal`: probes the libraries first (an error, not a panic,
    /// when one is missing), creates the context, the stream and the cuBLAS
    /// handle with a counted workspace.
    pub fn new(ordinal: usize) -> Result<Device> {
        probe().require_all()?;
        guarded("opening the CUDA device", || {
            let count = CudaContext::device_count()?;
            if count <= 0 || ordinal >= count as usize {
                return Err(CudaError::Unavailable(format!(
                    "no CUDA device {ordinal} (the driver sees {count})"
                )));
            }
            let ctx = CudaContext::new(ordinal)?;
            let stream = ctx.default_stream();
            let (major, minor) = ctx.compute_capability()?;
            let arch = kernels::arch_name(major, minor);
            let mem = Arc::new(MemCounter::default());
            let blas = CudaBlas::new(stream.clone())?;
            let mut ws = stream.alloc_zeros::<u8>(CUBLAS_WORKSPACE_BYTES)?;
            mem.add_workspace(CUBLAS_WORKSPACE_BYTES as u64);
            {
                use cudarc::driver::DevicePtrMut;
                let (ptr, _sync) = ws.device_ptr_mut(&stream);
                // SAFETY: the buffer outlives the handle (both owned by Gpu, the
                // handle dropped first: field order).
                let st = unsafe {
                    cudarc::cublas::sys::cublasSetWorkspace_v2(
                        *blas.handle(),
                        ptr as *mut std::ffi::c_void,
                        CUBLAS_WORKSPACE_BYTES,
                    )
                };
                if st != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                    return Err(CudaError::Blas(format!("cublasSetWorkspace: {st:?}")));
                }
            }
            // Full f32 GEMMs (default math: no TF32), for agreement with the CPU within 1e-4.
            // SAFETY: a valid handle.
            unsafe {
                cudarc::cublas::sys::cublasSetMathMode(
                    *blas.handle(),
                    cudarc::cublas::sys::cublasMath_t::CUBLAS_DEFAULT_MATH,
                );
            }
            Ok(Device {
                backend: Backend::Gpu(Gpu {
                    ctx,
                    stream,
                    blas,
                    arch,
                    modules: Mutex::new(HashMap::new()),
                    functions: Mutex::new(HashMap::new()),
                    _blas_workspace: ws,
                }),
                mem,
            })
        })
    }

    /// A device that runs the kernels on the host through `emulator`.
    pub fn emulated(emulator: emulate::Emulator) -> Device {
        Device {
            backend: Backend::Emulated(emulator),
            mem: Arc::new(MemCounter::default()),
        }
    }

    /// The backend.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    fn gpu(&self) -> Result<&Gpu> {
        match &self.backend {
            Backend::Gpu(g) => Ok(g),
            Backend::Emulated(_) => Err(CudaError::Unavailable(
                "this device is the host emulation, not a GPU".into(),
            )),
        }
    }

    /// The GPU's name, as the driver reports it.
    pub fn name(&self) -> Result<String> {
        match &self.backend {
            Backend::Gpu(g) => Ok(g.ctx.name()?),
            Backend::Emulated(_) => Ok("host emulation of kernels/ (C++)".into()),
        }
    }

    /// The NVRTC architecture the kernels are compiled for (`compute_XY`).
    pub fn arch(&self) -> &'static str {
        match &self.backend {
            Backend::Gpu(g) => g.arch,
            Backend::Emulated(_) => "host",
        }
    }

    /// The stream every launch and copy goes on (GPU only).
    pub fn stream(&self) -> Result<&Arc<CudaStream>> {
        Ok(&self.gpu()?.stream)
    }

    /// The cuBLAS handle (on [`Device::stream`], with memplan's workspace).
    pub fn blas(&self) -> Result<&CudaBlas> {
        Ok(&self.gpu()?.blas)
    }

    /// The live/peak counter of this device's tensors.
    pub fn counter(&self) -> &Arc<MemCounter> {
        &self.mem
    }

    /// The memory report: tensors live and peak, workspace.
    pub fn memory(&self) -> MemoryReport {
        self.mem.report()
    }

    /// `cuMemGetInfo`: free and total bytes of the device.
    pub fn mem_get_info(&self) -> Result<(usize, usize)> {
        Ok(self.gpu()?.ctx.mem_get_info()?)
    }

    /// Waits for every queued launch and copy.
    pub fn synchronize(&self) -> Result<()> {
        match &self.backend {
            Backend::Gpu(g) => Ok(g.stream.synchronize()?),
            Backend::Emulated(_) => Ok(()),
        }
    }

    /// Compiles and loads every kernel of kernels/ now (a training step calls it
    /// before its `cuMemGetInfo` mark: loaded modules take device memory).
    pub fn preload(&self) -> Result<()> {
        let Backend::Gpu(g) = &self.backend else {
            return Ok(());
        };
        for src in crate::exec::cuda_src::SOURCES {
            for k in src.kernels() {
                g.function(k)?;
            }
        }
        Ok(())
    }
}

impl Gpu {
    /// Kernel `name` of kernels/, compiling its source with NVRTC on first use
    /// (once per source and process).
    pub fn function(&self, name: &'static str) -> Result<CudaFunction> {
        if let Some(f) = self.functions.lock().expect("no poisoned lock").get(name) {
            return Ok(f.clone());
        }
        let src = crate::exec::cuda_src::source_of(name)
            .ok_or_else(|| CudaError::Kernel(format!("no kernels/*.cu defines {name}")))?;
        let module = {
            let mut mods = self.modules.lock().expect("no poisoned lock");
            match mods.get(src.file) {
                Some(m) => m.clone(),
                None => {
                    let ptx = kernels::compile(src, self.arch)?;
                    let m = self.ctx.load_module(ptx)?;
                    mods.insert(src.file, m.clone());
                    m
                }
            }
        };
        let f = module.load_function(name)?;
        self.functions
            .lock()
            .expect("no poisoned lock")
            .insert(name, f.clone());
        Ok(f)
    }
}
