//! Device tensors and the by-value kernel descriptors ([`Strided`], [`Win`]).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};

use super::{Backend, CudaError, Device, MemCounter, Result};
use crate::ir::DType;
use crate::numeric::broadcast::{bcast_strides, strides};
use crate::numeric::{Elems, Tensor};

/// The typed storage of a [`DeviceTensor`].
#[derive(Debug)]
pub enum DeviceBuf {
    /// float32.
    F32(CudaSlice<f32>),
    /// int64.
    I64(CudaSlice<i64>),
    /// int32.
    I32(CudaSlice<i32>),
    /// bool, one byte per element.
    Bool(CudaSlice<u8>),
    /// float16, as its 16-bit words.
    F16(CudaSlice<u16>),
    /// bfloat16, as its 16-bit words.
    BF16(CudaSlice<u16>),
    /// Host memory of the emulated backend (8-byte aligned).
    Host {
        /// Element type.
        dtype: DType,
        /// The bytes, in 8-byte words.
        data: Vec<u64>,
    },
}

/// A contiguous row-major tensor on the device. Its bytes (element count ×
/// element size) are counted live from allocation to drop. An alias
/// ([`DeviceTensor::alias`]: a view sharing its source's memory) counts nothing;
/// a tensor set apart ([`DeviceTensor::set_apart`]) counts as workspace; one
/// allocated while a training step's launcher runs
/// ([`MemCounter::set_launching`]) counts in the launch bucket until held
/// ([`DeviceTensor::hold`]).
#[derive(Debug)]
pub struct DeviceTensor {
    /// Shape.
    pub shape: Vec<usize>,
    buf: Arc<DeviceBuf>,
    ptr: u64,
    bytes: u64,
    /// Bytes of the allocation counted as workspace instead ([`DeviceTensor::count_as`]).
    apart: u64,
    bucket: Bucket,
    counter: Arc<MemCounter>,
}

/// Which count a [`DeviceTensor`]'s bytes are in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bucket {
    Tensor,
    Workspace,
    Launch,
}

impl DeviceTensor {
    fn uncount(&self) {
        match self.bucket {
            Bucket::Tensor => self.counter.sub(self.bytes),
            Bucket::Workspace => self.counter.sub_workspace(self.bytes),
            Bucket::Launch => self.counter.sub_launch(self.bytes),
        }
    }
}

impl Drop for DeviceTensor {
    fn drop(&mut self) {
        self.uncount();
        self.counter.sub_workspace(self.apart);
    }
}

impl DeviceTensor {
    /// Element type.
    pub fn dtype(&self) -> DType {
        match *self.buf {
            DeviceBuf::F32(_) => DType::F32,
            DeviceBuf::I64(_) => DType::I64,
            DeviceBuf::I32(_) => DType::I32,
            DeviceBuf::Bool(_) => DType::Bool,
            DeviceBuf::F16(_) => DType::F16,
            DeviceBuf::BF16(_) => DType::BF16,
            DeviceBuf::Host { dtype, .. } => dtype,
        }
    }

    /// Element count.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes counted for it.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The raw device address (kernel argument).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The storage.
    pub fn buf(&self) -> &DeviceBuf {
        &self.buf
    }

    /// A view of the same memory under `shape` (same element count), counting
    /// nothing: the memory stays allocated while the source or any alias lives,
    /// and is counted by the source alone.
    pub fn alias(&self, shape: Vec<usize>) -> Result<DeviceTensor> {
        if shape.iter().product::<usize>() != self.numel() {
            return Err(CudaError::Kernel(format!(
                "an alias {shape:?} of a {:?} tensor",
                self.shape
            )));
        }
        Ok(DeviceTensor {
            shape,
            buf: self.buf.clone(),
            ptr: self.ptr,
            bytes: 0,
            apart: 0,
            bucket: Bucket::Tensor,
            counter: self.counter.clone(),
        })
    }

    /// Moves this tensor's bytes from the tensor count to the workspace count
    /// (a copy the step makes that no schedule storage holds, e.g. a strided
    /// view materialized for a contiguous kernel).
    pub fn set_apart(&mut self) {
        if self.bucket != Bucket::Workspace {
            self.uncount();
            self.counter.add_workspace(self.bytes);
            self.bucket = Bucket::Workspace;
        }
    }

    /// Counts only `bytes` of this allocation where it is counted, the rest as
    /// workspace: a value the executor keeps whole where the schedule's storage is
    /// smaller (PyTorch saves a reduced copy of it).
    pub fn count_as(&mut self, bytes: u64) {
        if bytes < self.bytes {
            let rest = self.bytes - bytes;
            self.uncount();
            self.bytes = bytes;
            match self.bucket {
                Bucket::Tensor => self.counter.add(bytes),
                Bucket::Workspace => self.counter.add_workspace(bytes),
                Bucket::Launch => self.counter.add_launch(bytes),
            }
            self.counter.add_workspace(rest);
            self.apart += rest;
        }
    }

    /// Moves a tensor a launcher allocated (launch bucket) into the tensor
    /// count: the step stores it in its schedule storage.
    pub fn hold(&mut self) {
        if self.bucket == Bucket::Launch {
            self.uncount();
            self.counter.add(self.bytes);
            self.bucket = Bucket::Tensor;
        }
    }

    /// An error unless the tensor is float32.
    pub fn expect_f32(&self, what: &str) -> Result<()> {
        if self.dtype() == DType::F32 {
            Ok(())
        } else {
            Err(CudaError::Kernel(format!(
                "{what} is {}, the device kernels take float32",
                self.dtype()
            )))
        }
    }
}

/// Element size on the device, for the dtypes the backend stores.
pub fn elem_size(dtype: DType) -> Result<usize> {
    match dtype {
        DType::F32 | DType::I32 => Ok(4),
        DType::I64 => Ok(8),
        DType::Bool => Ok(1),
        DType::F16 | DType::BF16 => Ok(2),
        other => Err(CudaError::Kernel(format!(
            "{other} tensors are not supported on the device yet (float32, float16, bfloat16, int64, int32, bool)"
        ))),
    }
}

/// Workspace memory (im2col buffers): counted apart from tensors while alive.
#[derive(Debug)]
pub struct Workspace {
    /// The buffer.
    pub buf: WorkspaceBuf,
    ptr: u64,
    bytes: u64,
    counter: Arc<MemCounter>,
}

/// A workspace's memory.
#[derive(Debug)]
pub enum WorkspaceBuf {
    /// On the GPU.
    Gpu(CudaSlice<f32>),
    /// On the host (emulation).
    Host(Vec<u64>),
}

impl Workspace {
    /// The raw device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for Workspace {
    fn drop(&mut self) {
        self.counter.sub_workspace(self.bytes);
    }
}

fn raw<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

fn host_words(bytes: usize) -> Vec<u64> {
    vec![0u64; bytes.div_ceil(8).max(1)]
}

impl Device {
    /// A zero-filled tensor (false, 0) of `dtype` and `shape`.
    pub fn zeros(&self, dtype: DType, shape: &[usize]) -> Result<DeviceTensor> {
        let n: usize = shape.iter().product();
        let bytes = (n * elem_size(dtype)?) as u64;
        let (buf, ptr) = match self.backend() {
            Backend::Emulated(_) => {
                let data = host_words(bytes as usize);
                let ptr = data.as_ptr() as u64;
                (DeviceBuf::Host { dtype, data }, ptr)
            }
            Backend::Gpu(_) => {
                let s = self.stream()?;
                // cuMemAlloc rejects 0 bytes: empty tensors get one element, count 0.
                let len = n.max(1);
                let buf = match dtype {
                    DType::F32 => DeviceBuf::F32(s.alloc_zeros::<f32>(len)?),
                    DType::I64 => DeviceBuf::I64(s.alloc_zeros::<i64>(len)?),
                    DType::I32 => DeviceBuf::I32(s.alloc_zeros::<i32>(len)?),
                    DType::Bool => DeviceBuf::Bool(s.alloc_zeros::<u8>(len)?),
                    DType::F16 => DeviceBuf::F16(s.alloc_zeros::<u16>(len)?),
                    DType::BF16 => DeviceBuf::BF16(s.alloc_zeros::<u16>(len)?),
                    _ => unreachable!("elem_size accepted it"),
                };
                let ptr = match &buf {
                    DeviceBuf::F32(b) => raw(b, s),
                    DeviceBuf::I64(b) => raw(b, s),
                    DeviceBuf::I32(b) => raw(b, s),
                    DeviceBuf::Bool(b) => raw(b, s),
                    DeviceBuf::F16(b) | DeviceBuf::BF16(b) => raw(b, s),
                    DeviceBuf::Host { .. } => unreachable!("a GPU buffer"),
                };
                (buf, ptr)
            }
        };
        let bucket = if self.counter().launching() {
            self.counter().add_launch(bytes);
            Bucket::Launch
        } else {
            self.counter().add(bytes);
            Bucket::Tensor
        };
        Ok(DeviceTensor {
            shape: shape.to_vec(),
            buf: Arc::new(buf),
            ptr,
            bytes,
            apart: 0,
            bucket,
            counter: self.counter().clone(),
        })
    }

    /// `n` floats of workspace (zeroed), counted as workspace.
    pub fn workspace(&self, n: usize) -> Result<Workspace> {
        let (buf, ptr) = match self.backend() {
            Backend::Emulated(_) => {
                let data = host_words(n * 4);
                let ptr = data.as_ptr() as u64;
                (WorkspaceBuf::Host(data), ptr)
            }
            Backend::Gpu(_) => {
                let s = self.stream()?;
                let buf = s.alloc_zeros::<f32>(n.max(1))?;
                let ptr = raw(&buf, s);
                (WorkspaceBuf::Gpu(buf), ptr)
            }
        };
        let bytes = (n * 4) as u64;
        self.counter().add_workspace(bytes);
        Ok(Workspace {
            buf,
            ptr,
            bytes,
            counter: self.counter().clone(),
        })
    }

    /// Copies a host tensor to the device (float16/bfloat16 as their bits).
    pub fn upload(&self, t: &Tensor) -> Result<DeviceTensor> {
        let mut d = self.zeros(t.dtype(), &t.shape)?;
        self.write(&mut d, t)?;
        Ok(d)
    }

    /// Copies a host tensor into device tensor `d` of the same dtype and
    /// element count, in place (`d` must not be aliased).
    pub fn write(&self, d: &mut DeviceTensor, t: &Tensor) -> Result<()> {
        if d.dtype() != t.dtype() || d.numel() != t.numel() {
            return Err(CudaError::Kernel(format!(
                "writing a {} {:?} tensor into a {} {:?} one",
                t.dtype(),
                t.shape,
                d.dtype(),
                d.shape
            )));
        }
        if t.numel() == 0 {
            return Ok(());
        }
        let buf = Arc::get_mut(&mut d.buf)
            .ok_or_else(|| CudaError::Kernel("writing into an aliased tensor".into()))?;
        if let DeviceBuf::Host { data, .. } = buf {
            let bytes: Vec<u8> = match &t.elems {
                Elems::F32(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
                Elems::I64(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
                Elems::I32(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
                Elems::Bool(v) => v.iter().map(|&x| x as u8).collect(),
                Elems::F16(v) => v.iter().flat_map(|x| x.to_bits().to_ne_bytes()).collect(),
                Elems::BF16(v) => v.iter().flat_map(|x| x.to_bits().to_ne_bytes()).collect(),
            };
            // SAFETY: `data` holds at least `bytes.len()` bytes (sized by zeros).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    data.as_mut_ptr() as *mut u8,
                    bytes.len(),
                )
            };
            return Ok(());
        }
        let s = self.stream()?;
        match (&t.elems, buf) {
            (Elems::F32(v), DeviceBuf::F32(b)) => s.memcpy_htod(v, b)?,
            (Elems::I64(v), DeviceBuf::I64(b)) => s.memcpy_htod(v, b)?,
            (Elems::I32(v), DeviceBuf::I32(b)) => s.memcpy_htod(v, b)?,
            (Elems::Bool(v), DeviceBuf::Bool(b)) => {
                let bytes: Vec<u8> = v.iter().map(|&x| x as u8).collect();
                s.memcpy_htod(&bytes, b)?
            }
            (Elems::F16(v), DeviceBuf::F16(b)) => {
                let bits: Vec<u16> = v.iter().map(|x| x.to_bits()).collect();
                s.memcpy_htod(&bits, b)?
            }
            (Elems::BF16(v), DeviceBuf::BF16(b)) => {
                let bits: Vec<u16> = v.iter().map(|x| x.to_bits()).collect();
                s.memcpy_htod(&bits, b)?
            }
            _ => unreachable!("zeros made the tensor's dtype"),
        }
        Ok(())
    }

    /// Copies a device tensor back to the host (synchronizes).
    pub fn download(&self, t: &DeviceTensor) -> Result<Tensor> {
        let n = t.numel();
        let elems = match &*t.buf {
            DeviceBuf::Host { dtype, data } => {
                // SAFETY: `data` holds n elements of `dtype` (sized by zeros).
                let bytes = unsafe {
                    std::slice::from_raw_parts(data.as_ptr() as *const u8, n * elem_size(*dtype)?)
                };
                match dtype {
                    DType::F32 => Elems::F32(
                        bytes
                            .chunks_exact(4)
                            .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
                            .collect(),
                    ),
                    DType::I64 => Elems::I64(
                        bytes
                            .chunks_exact(8)
                            .map(|c| i64::from_ne_bytes(c.try_into().unwrap()))
                            .collect(),
                    ),
                    DType::I32 => Elems::I32(
                        bytes
                            .chunks_exact(4)
                            .map(|c| i32::from_ne_bytes(c.try_into().unwrap()))
                            .collect(),
                    ),
                    DType::F16 => Elems::F16(
                        bytes
                            .chunks_exact(2)
                            .map(|c| half::f16::from_bits(u16::from_ne_bytes([c[0], c[1]])))
                            .collect(),
                    ),
                    DType::BF16 => Elems::BF16(
                        bytes
                            .chunks_exact(2)
                            .map(|c| half::bf16::from_bits(u16::from_ne_bytes([c[0], c[1]])))
                            .collect(),
                    ),
                    _ => Elems::Bool(bytes.iter().map(|&x| x != 0).collect()),
                }
            }
            DeviceBuf::F32(b) => Elems::F32(self.stream()?.clone_dtoh(b)?[..n].to_vec()),
            DeviceBuf::I64(b) => Elems::I64(self.stream()?.clone_dtoh(b)?[..n].to_vec()),
            DeviceBuf::I32(b) => Elems::I32(self.stream()?.clone_dtoh(b)?[..n].to_vec()),
            DeviceBuf::Bool(b) => Elems::Bool(
                self.stream()?.clone_dtoh(b)?[..n]
                    .iter()
                    .map(|&x| x != 0)
                    .collect(),
            ),
            DeviceBuf::F16(b) => Elems::F16(
                self.stream()?.clone_dtoh(b)?[..n]
                    .iter()
                    .map(|&x| half::f16::from_bits(x))
                    .collect(),
            ),
            DeviceBuf::BF16(b) => Elems::BF16(
                self.stream()?.clone_dtoh(b)?[..n]
                    .iter()
                    .map(|&x| half::bf16::from_bits(x))
                    .collect(),
            ),
        };
        Ok(Tensor::new(t.shape.clone(), elems))
    }

    /// Launches kernel `name` over `n` elements (grid-stride kernels) with `args`.
    pub fn launch(&self, name: &'static str, n: usize, args: &[Arg]) -> Result<()> {
        self.launch_cfg(name, grid(n), args)
    }

    /// Launches kernel `name` with an explicit configuration.
    pub fn launch_cfg(&self, name: &'static str, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        if cfg.grid_dim.0 == 0 {
            return Ok(());
        }
        let g = match self.backend() {
            Backend::Gpu(g) => g,
            Backend::Emulated(e) => {
                let mut ptrs: Vec<*mut std::ffi::c_void> = args
                    .iter()
                    .map(|a| match a {
                        Arg::Ptr(v) | Arg::U64(v) => v as *const u64 as *mut _,
                        Arg::I64(v) => v as *const i64 as *mut _,
                        Arg::I32(v) => v as *const i32 as *mut _,
                        Arg::F32(v) => v as *const f32 as *mut _,
                        Arg::F64(v) => v as *const f64 as *mut _,
                        Arg::Strided(v) => v.as_ref() as *const Strided as *mut _,
                        Arg::Win(v) => v as *const Win as *mut _,
                    })
                    .collect();
                // SAFETY: as for the GPU launch below; host pointers of the
                // emulated backend's own buffers.
                return unsafe { e.launch(name, cfg.grid_dim.0, &mut ptrs) };
            }
        };
        let f = g.function(name)?;
        let mut b = g.stream.launch_builder(&f);
        for a in args {
            match a {
                Arg::Ptr(v) | Arg::U64(v) => b.arg(v),
                Arg::I64(v) => b.arg(v),
                Arg::I32(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
                Arg::F64(v) => b.arg(v),
                Arg::Strided(v) => b.arg(v.as_ref()),
                Arg::Win(v) => b.arg(v),
            };
        }
        // SAFETY: the argument list matches the kernel's C signature (each launcher
        // in super::ops is written beside its kernel), every pointer is a live
        // device allocation of the extent the kernel reads.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

/// One kernel argument, by value.
#[derive(Debug, Clone)]
pub enum Arg {
    /// A device pointer (0: null).
    Ptr(u64),
    /// `long long`.
    I64(i64),
    /// `unsigned long long`.
    U64(u64),
    /// `int`.
    I32(i32),
    /// `float`.
    F32(f32),
    /// `double`.
    F64(f64),
    /// `Strided` (boxed: 392 bytes).
    Strided(Box<Strided>),
    /// `Win`.
    Win(Win),
}

impl Arg {
    /// `t`'s device pointer.
    pub fn t(t: &DeviceTensor) -> Arg {
        Arg::Ptr(t.ptr())
    }
    /// `t`'s pointer, or null.
    pub fn opt(t: Option<&DeviceTensor>) -> Arg {
        Arg::Ptr(t.map_or(0, |t| t.ptr()))
    }
    /// A size.
    pub fn n(v: usize) -> Arg {
        Arg::I64(v as i64)
    }
}

/// Threads per block of the grid-stride kernels.
pub const BLOCK: u32 = 256;

/// A grid-stride launch over `n` elements (at most 65535 blocks).
pub fn grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).min(65_535) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of [`BLOCK`] threads per item (`items` blocks) with the f64
/// shared memory of the block reductions.
pub fn per_block(items: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (items as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: BLOCK * 8,
    }
}

/// Most axes a [`Strided`] describes (kernels/common.cuh `MP_MAX_RANK`).
pub const MAX_RANK: usize = 8;

/// kernels/common.cuh `Strided`: a row-major iteration space and up to three
/// operands' element strides per axis.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Strided {
    rank: i32,
    pad: i32,
    shape: [i64; MAX_RANK],
    st: [[i64; MAX_RANK]; 3],
}

// SAFETY: #[repr(C)], plain integers, the layout of the C struct.
unsafe impl DeviceRepr for Strided {}

impl Strided {
    /// The space `shape` with the given per-operand strides (each of `shape`'s rank).
    pub fn new(shape: &[usize], ops: &[Vec<i64>]) -> Result<Strided> {
        if shape.len() > MAX_RANK || ops.len() > 3 {
            return Err(CudaError::Kernel(format!(
                "rank {} exceeds the device kernels' {MAX_RANK}",
                shape.len()
            )));
        }
        let mut d = Strided {
            rank: shape.len() as i32,
            pad: 0,
            shape: [1; MAX_RANK],
            st: [[0; MAX_RANK]; 3],
        };
        for (i, &s) in shape.iter().enumerate() {
            d.shape[i] = s as i64;
        }
        for (k, st) in ops.iter().enumerate() {
            for (i, &s) in st.iter().enumerate() {
                d.st[k][i] = s;
            }
        }
        Ok(d)
    }

    /// Operands of the given shapes broadcast (numpy) to `out`.
    pub fn broadcast(out: &[usize], ins: &[&[usize]]) -> Result<Strided> {
        let ops: Vec<Vec<i64>> = ins
            .iter()
            .map(|s| bcast_strides(s, out).iter().map(|&v| v as i64).collect())
            .collect();
        Strided::new(out, &ops)
    }

    /// Stride of operand `k` along axis `i`.
    pub fn stride(&self, k: usize, i: usize) -> i64 {
        self.st[k][i]
    }

    /// Contiguous row-major strides of `shape` as i64.
    pub fn contiguous(shape: &[usize]) -> Vec<i64> {
        strides(shape).iter().map(|&v| v as i64).collect()
    }
}

/// kernels/common.cuh `Win`: a 1-D or 2-D window as 2-D (src/ops/conv.rs).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Win {
    /// Input height, width.
    pub h: i64,
    /// Input width.
    pub w: i64,
    /// Output height.
    pub oh: i64,
    /// Output width.
    pub ow: i64,
    /// Kernel height.
    pub kh: i64,
    /// Kernel width.
    pub kw: i64,
    /// Strides.
    pub sh: i64,
    /// Stride along the width.
    pub sw: i64,
    /// Dilations.
    pub dh: i64,
    /// Dilation along the width.
    pub dw: i64,
    /// Leading pads.
    pub ph: i64,
    /// Leading pad along the width.
    pub pw: i64,
    /// Input plus both pads.
    pub padded_h: i64,
    /// Padded width.
    pub padded_w: i64,
}

// SAFETY: #[repr(C)], plain integers, the layout of the C struct.
unsafe impl DeviceRepr for Win {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_have_the_c_layout() {
        // kernels/common.cuh static_asserts the same sizes.
        assert_eq!(std::mem::size_of::<Strided>(), 264);
        assert_eq!(std::mem::size_of::<Win>(), 112);
        let d = Strided::broadcast(&[2, 3, 4], &[&[3, 1], &[4]]).unwrap();
        assert_eq!((d.stride(0, 1), d.stride(0, 2), d.stride(1, 2)), (1, 0, 1));
    }
}
