//! The host emulation of kernels/: the same CUDA C, compiled for the CPU by a
//! C++ compiler with a small prelude standing in for CUDA's built-ins, and run
//! with one thread per block, blocks in order. Every kernel of kernels/ is
//! written so that this is exact: grid-stride loops cover all elements for any
//! grid, and block reductions work for any block size, one included. With it,
//! [`super::Device::emulated`] runs the real launchers (src/exec/cuda/ops.rs) and
//! the real kernels without a GPU, so tests/cuda.rs checks both against the CPU
//! kernels on any machine with `c++` (GEMMs there are a naive loop, not cuBLAS;
//! math functions are the host libm's, not CUDA's: agreement to rounding).

use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::path::Path;

use super::{CudaError, Result};
use crate::exec::cuda_src::{COMMON, SOURCES};

/// Stands in for the CUDA built-ins the kernels use.
pub const PRELUDE: &str = r#"// memplan: host emulation of kernels/ (src/exec/cuda/emulate.rs).
#include <math.h>
#include <string.h>
#include <stddef.h>
#include <utility>
#include <type_traits>
struct mp_dim3 { unsigned x, y, z; };
static mp_dim3 blockIdx, threadIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__
// The dynamic shared memory of the block reductions (one thread per block).
double sh[4096];
static inline void __syncthreads() {}
static inline float __int_as_float(int v) { float f; memcpy(&f, &v, 4); return f; }
static inline float __uint_as_float(unsigned v) { float f; memcpy(&f, &v, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned v; memcpy(&v, &f, 4); return v; }
static inline float __fmul_rn(float a, float b) { return a * b; }
"#;

/// The whole C++ program: prelude, kernels/common.cuh, every kernels/*.cu, and
/// `mp_emulate(name, grid, args)`, which runs kernel `name` over `grid` blocks
/// of one thread with `args` as `cuLaunchKernel` takes them.
pub fn program() -> String {
    let mut s = String::from(PRELUDE);
    s.push_str(COMMON);
    for src in SOURCES {
        s.push_str(&format!("\n#line 1 \"{}\"\n{}\n", src.file, src.text()));
    }
    s.push_str(
        r#"
template <class... A, size_t... I>
static void mp_call_impl(void (*f)(A...), void** a, std::index_sequence<I...>) {
    f(*static_cast<typename std::remove_cv<typename std::remove_reference<A>::type>::type*>(a[I])...);
}
template <class... A>
static void mp_call(void (*f)(A...), void** a) { mp_call_impl(f, a, std::index_sequence_for<A...>{}); }
struct mp_entry { const char* name; void (*run)(void**); };
static const mp_entry mp_table[] = {
"#,
    );
    for src in SOURCES {
        for k in src.kernels() {
            s.push_str(&format!(
                "    {{\"{k}\", [](void** a) {{ mp_call(&{k}, a); }}}},\n"
            ));
        }
    }
    s.push_str(
        r#"};
extern "C" int mp_emulate(const char* name, unsigned grid, void** args) {
    for (const mp_entry& e : mp_table) {
        if (strcmp(e.name, name) == 0) {
            blockDim = {1, 1, 1};
            threadIdx = {0, 0, 0};
            gridDim = {grid, 1, 1};
            for (unsigned b = 0; b < grid; ++b) {
                blockIdx = {b, 0, 0};
                e.run(args);
            }
            return 0;
        }
    }
    return 1;
}
"#,
    );
    s
}

type RunFn = unsafe extern "C" fn(*const c_char, c_uint, *mut *mut c_void) -> c_int;

/// The compiled emulation, loaded.
pub struct Emulator {
    run: RunFn,
    _lib: libloading::Library,
}

impl Emulator {
    /// Compiles [`program`] with `cxx` (e.g. `c++`) into `dir` and loads it.
    pub fn build(dir: &Path, cxx: &str) -> Result<Emulator> {
        let src = dir.join("memplan_kernels_emulated.cpp");
        let lib = dir.join("libmemplan_kernels_emulated.so");
        std::fs::write(&src, program())
            .map_err(|e| CudaError::Unavailable(format!("writing {}: {e}", src.display())))?;
        let out = std::process::Command::new(cxx)
            .args(["-std=c++17", "-O1", "-shared", "-fPIC", "-w", "-o"])
            .arg(&lib)
            .arg(&src)
            .output()
            .map_err(|e| CudaError::Unavailable(format!("running {cxx}: {e}")))?;
        if !out.status.success() {
            return Err(CudaError::Compile {
                file: "(host emulation)",
                log: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
        Emulator::load(&lib)
    }

    /// Loads a library built by [`Emulator::build`].
    pub fn load(path: &Path) -> Result<Emulator> {
        // SAFETY: the library is memplan's own emulation (no initializers beyond
        // zeroed globals); `mp_emulate` has the declared signature.
        unsafe {
            let lib = libloading::Library::new(path)
                .map_err(|e| CudaError::Unavailable(format!("loading {}: {e}", path.display())))?;
            let run: RunFn = *lib
                .get::<RunFn>(b"mp_emulate\0")
                .map_err(|e| CudaError::Unavailable(format!("mp_emulate: {e}")))?;
            Ok(Emulator { run, _lib: lib })
        }
    }

    /// Runs kernel `name` over `grid` blocks with `args` (pointers to each
    /// argument's value, as `cuLaunchKernel`).
    ///
    /// # Safety
    /// `args` match the kernel's C signature and every pointer argument is a
    /// live host allocation of the extent the kernel touches.
    pub unsafe fn launch(&self, name: &str, grid: u32, args: &mut [*mut c_void]) -> Result<()> {
        let n = CString::new(name).expect("kernel names have no NUL");
        // SAFETY: the caller's contract.
        let rc = unsafe { (self.run)(n.as_ptr(), grid, args.as_mut_ptr()) };
        if rc != 0 {
            return Err(CudaError::Kernel(format!(
                "the emulation has no kernel {name}"
            )));
        }
        Ok(())
    }
}
