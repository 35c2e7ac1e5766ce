//! Per-op launchers of the GPU backend, forward and backward, mirroring the CPU
//! kernels of src/ops (the reference semantics): same outputs in the same order
//! (declared outputs, then the backward rule's extras when asked), same
//! gradients per input slot. The kernels each op runs are listed beside its
//! other rules (`Op::cuda_kernels`).
//!
//! Ops without device kernels (integer shape computations: Shape, Constant,
//! ConstantOfShape, Range, Cast, integer arithmetic, Slice, ...) run on the host:
//! inputs are downloaded, the CPU kernel runs, outputs are uploaded ([`forward`]
//! says which path ran through [`Path`]). Their outputs are still device tensors,
//! counted like any other.

use std::ops::Deref;

use super::tensor::{per_block, Arg, Strided, Win, Workspace};
use super::{CudaError, Device, DeviceTensor, Result};
use crate::ir::{Attrs, DType, Node};
use crate::numeric::broadcast::{bcast_strides, strides};
use crate::numeric::Tensor;
use crate::ops::{self, axis, registry, BackwardCx, Cx, Fact, KernelCx, Saved};

/// Everything a device forward launcher sees of one node (as [`KernelCx`], with
/// device inputs and the input facts, which hold the folded constants).
pub struct DevKernelCx<'a> {
    /// The node.
    pub node: &'a Node,
    /// Input values; `None` for omitted optional inputs.
    pub inputs: Vec<Option<&'a DeviceTensor>>,
    /// Input facts (dtype, shape, folded value).
    pub input_facts: Vec<Option<&'a Fact>>,
    /// Inferred output facts; `None` where omitted.
    pub outputs: Vec<Option<&'a Fact>>,
    /// Default-domain opset.
    pub opset: i64,
    /// Seed of this node's random stream ([`KernelCx::seed`]).
    pub seed: u64,
    /// [`KernelCx::dropout`].
    pub dropout: bool,
    /// [`KernelCx::extras`].
    pub extras: bool,
}

impl<'a> DevKernelCx<'a> {
    fn attrs(&self) -> &Attrs {
        &self.node.attrs
    }
    fn input(&self, i: usize) -> Result<&'a DeviceTensor> {
        self.inputs
            .get(i)
            .copied()
            .flatten()
            .ok_or_else(|| CudaError::Kernel(format!("required input {i} is missing")))
    }
    fn opt(&self, i: usize) -> Option<&'a DeviceTensor> {
        self.inputs.get(i).copied().flatten()
    }
    fn out(&self, i: usize) -> Result<&'a Fact> {
        self.outputs
            .get(i)
            .copied()
            .flatten()
            .ok_or_else(|| CudaError::Kernel(format!("output {i} is not declared")))
    }
    fn rule_cx(&self) -> Cx<'a> {
        Cx {
            node: self.node,
            inputs: self.input_facts.clone(),
            opset: self.opset,
        }
    }
}

/// Everything a device backward launcher sees (as [`BackwardCx`], device tensors).
pub struct DevBackwardCx<'a> {
    /// The node.
    pub node: &'a Node,
    /// Input facts.
    pub inputs: Vec<Option<&'a Fact>>,
    /// Output facts.
    pub outputs: Vec<Option<&'a Fact>>,
    /// Default-domain opset.
    pub opset: i64,
    /// The saved tensors the rule lists for the wanted gradients.
    pub saved: Vec<(Saved, &'a DeviceTensor)>,
    /// Incoming gradient per declared output (`None`: zeros).
    pub grads: Vec<Option<&'a DeviceTensor>>,
    /// Input slots whose gradient is wanted.
    pub wanted: Vec<usize>,
    /// [`BackwardCx::dropout`].
    pub dropout: bool,
}

/// A borrowed or owned device tensor.
pub enum Held<'a> {
    /// Borrowed.
    B(&'a DeviceTensor),
    /// Owned.
    O(DeviceTensor),
}

impl Deref for Held<'_> {
    type Target = DeviceTensor;
    fn deref(&self) -> &DeviceTensor {
        match self {
            Held::B(t) => t,
            Held::O(t) => t,
        }
    }
}

impl<'a> DevBackwardCx<'a> {
    fn attrs(&self) -> &Attrs {
        &self.node.attrs
    }
    fn wants(&self, i: usize) -> bool {
        self.wanted.contains(&i)
    }
    fn input(&self, i: usize) -> Result<&'a Fact> {
        self.inputs
            .get(i)
            .copied()
            .flatten()
            .ok_or_else(|| CudaError::Kernel(format!("required input {i} is missing")))
    }
    fn output(&self, i: usize) -> Result<&'a Fact> {
        self.outputs
            .get(i)
            .copied()
            .flatten()
            .ok_or_else(|| CudaError::Kernel(format!("output {i} is not declared")))
    }
    fn saved(&self, s: Saved) -> Result<&'a DeviceTensor> {
        self.saved_opt(s).ok_or_else(|| {
            CudaError::Kernel(format!(
                "the backward kernel reads {s:?}, which was not saved for it"
            ))
        })
    }
    fn saved_opt(&self, s: Saved) -> Option<&'a DeviceTensor> {
        self.saved.iter().find(|(k, _)| *k == s).map(|(_, t)| *t)
    }
    /// Incoming gradient of output `i` (zeros when none flows in).
    fn grad(&self, dev: &Device, i: usize) -> Result<Held<'a>> {
        let f = self.output(i)?;
        match self.grads.get(i).copied().flatten() {
            Some(g) if g.shape == f.shape => Ok(Held::B(g)),
            Some(g) => Err(CudaError::Kernel(format!(
                "the gradient of output {i} is {:?}, the output {:?}",
                g.shape, f.shape
            ))),
            None => Ok(Held::O(dev.zeros(DType::F32, &f.shape)?)),
        }
    }
    fn rule_cx(&self) -> Cx<'a> {
        Cx {
            node: self.node,
            inputs: self.inputs.clone(),
            opset: self.opset,
        }
    }
}

/// Where an op ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Device kernels.
    Device,
    /// The CPU kernel on downloaded inputs (integer shape computations).
    Host,
}

/// Where [`forward`] runs a node with these input facts: on the device when a
/// launcher handles the op for these dtypes (and attributes), else on the host.
pub fn forward_path(
    node: &Node,
    input_facts: &[Option<&Fact>],
    n_outputs: usize,
    opset: i64,
    extras: bool,
) -> Result<Path> {
    let op = node.op_type.as_str();
    let dt = |i: usize| input_facts.get(i).copied().flatten().map(|f| f.dtype);
    let f32_in = |i: usize| dt(i) == Some(DType::F32);
    let device = match op {
        _ if unary_code(op, &node.attrs)?.is_some() => f32_in(0),
        "Add" | "Sub" | "Mul" | "Div" | "Pow" => f32_in(0) && f32_in(1),
        "Equal" | "Less" | "LessOrEqual" | "Greater" | "GreaterOrEqual" => f32_in(0) && f32_in(1),
        "Where" => f32_in(1) && f32_in(2) && dt(0) == Some(DType::Bool),
        "Clip" | "Dropout" | "MaxPool" | "AveragePool" | "GlobalAveragePool" => f32_in(0),
        "LayerNormalization" | "Softmax" | "LogSoftmax" => f32_in(0),
        "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin" => f32_in(0),
        "MatMul" | "Gemm" => f32_in(0) && f32_in(1),
        "Conv" => {
            f32_in(0)
                && f32_in(1)
                && input_facts
                    .first()
                    .copied()
                    .flatten()
                    .is_some_and(|f| f.shape.len() <= 4)
        }
        "BatchNormalization" => {
            let training = extras
                || if opset >= 14 {
                    node.attrs.int_or("training_mode", 0) != 0
                } else {
                    n_outputs > 1
                };
            f32_in(0) && training
        }
        "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" | "Transpose" | "Expand" | "Concat"
        | "Split" => dt(0).is_some_and(|d| super::tensor::elem_size(d).is_ok()),
        "Gather" => f32_in(0) && dt(1) == Some(DType::I64),
        "Slice" => {
            dt(0).is_some_and(|d| super::tensor::elem_size(d).is_ok())
                && slice_block(input_facts, opset).is_some()
        }
        "GatherElements" => {
            dt(0).is_some_and(|d| super::tensor::elem_size(d).is_ok()) && dt(1) == Some(DType::I64)
        }
        "Cast" | "CastLike" => {
            let to = node.attrs.int("to").and_then(|c| ops::dtype_attr(c).ok());
            let to = if op == "CastLike" { dt(1) } else { to };
            dt(0).is_some_and(cast_code_ok) && to.is_some_and(cast_code_ok)
        }
        _ => false,
    };
    Ok(if device { Path::Device } else { Path::Host })
}

/// The forward of one node on the device: one tensor per declared output (omitted
/// ones included), then the extras when `cx.extras`, as [`crate::ops::Op::forward_cpu`].
/// [`forward_path`] decides between the device launchers and the host.
pub fn forward(dev: &Device, cx: &DevKernelCx) -> Result<(Vec<DeviceTensor>, Path)> {
    let op = cx.node.op_type.as_str();
    if forward_path(
        cx.node,
        &cx.input_facts,
        cx.outputs.len(),
        cx.opset,
        cx.extras,
    )? == Path::Host
    {
        return Ok((host_forward(dev, cx)?, Path::Host));
    }
    let outs = match op {
        _ if unary_code(op, cx.attrs())?.is_some() => unary_fwd(dev, cx)?,
        "Add" | "Sub" | "Mul" | "Div" | "Pow" => binary_fwd(dev, cx)?,
        "Equal" | "Less" | "LessOrEqual" | "Greater" | "GreaterOrEqual" => compare_fwd(dev, cx)?,
        "Where" => where_fwd(dev, cx)?,
        "Clip" => clip_fwd(dev, cx)?,
        "Dropout" => dropout_fwd(dev, cx)?,
        "MatMul" => matmul_fwd(dev, cx)?,
        "Gemm" => gemm_fwd(dev, cx)?,
        "Conv" => conv_fwd(dev, cx)?,
        "MaxPool" | "AveragePool" => pool_fwd(dev, cx)?,
        "GlobalAveragePool" => gap_fwd(dev, cx)?,
        "BatchNormalization" => bn_fwd(dev, cx)?,
        "LayerNormalization" => ln_fwd(dev, cx)?,
        "Softmax" | "LogSoftmax" => softmax_fwd(dev, cx)?,
        "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin" => reduce_fwd(dev, cx)?,
        "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" => {
            vec![copy_as(dev, cx.input(0)?, &cx.out(0)?.shape)?]
        }
        "Transpose" => transpose_fwd(dev, cx)?,
        "Expand" => {
            let x = cx.input(0)?;
            let out = &cx.out(0)?.shape;
            let d = Strided::broadcast(out, &[&x.shape])?;
            vec![strided_new(dev, x, out, d)?]
        }
        "Concat" => concat_fwd(dev, cx)?,
        "Split" => split_fwd(dev, cx)?,
        "Slice" => {
            let x = cx.input(0)?;
            let (ax, off) = slice_block(&cx.input_facts, cx.opset)
                .ok_or_else(|| CudaError::Kernel("Slice is not one block".into()))?;
            let part = dev.zeros(x.dtype(), &cx.out(0)?.shape)?;
            block_copy(dev, x, &part, ax, off, false)?;
            vec![part]
        }
        "Gather" => gather_fwd(dev, cx)?,
        "GatherElements" => gather_elements_fwd(dev, cx)?,
        "Cast" | "CastLike" => {
            let x = cx.input(0)?;
            let to = cx.out(0)?.dtype;
            let y = dev.zeros(to, &x.shape)?;
            let n = x.numel();
            dev.launch(
                "cast_any",
                n,
                &[
                    Arg::I32(cast_code(x.dtype())),
                    Arg::I32(cast_code(to)),
                    Arg::n(n),
                    Arg::t(x),
                    Arg::t(&y),
                ],
            )?;
            vec![y]
        }
        other => unreachable!("forward_path sends {other} to the host"),
    };
    Ok((outs, Path::Device))
}

/// Where [`backward`] runs a node with these input facts.
pub fn backward_path(node: &Node, input_facts: &[Option<&Fact>]) -> Path {
    let op = node.op_type.as_str();
    let dt = |i: usize| input_facts.get(i).copied().flatten().map(|f| f.dtype);
    let f32_in = |i: usize| dt(i) == Some(DType::F32);
    let device = match op {
        _ if unary_code(op, &node.attrs).ok().flatten().is_some() => f32_in(0),
        "Add" | "Sub" | "Mul" | "Div" | "Pow" | "MatMul" | "Gemm" | "Conv" => {
            f32_in(0) && f32_in(1)
        }
        "Where" => f32_in(1) && f32_in(2) && dt(0) == Some(DType::Bool),
        "Clip" | "Dropout" | "MaxPool" | "AveragePool" | "GlobalAveragePool" => f32_in(0),
        "BatchNormalization" | "LayerNormalization" | "Softmax" | "LogSoftmax" => f32_in(0),
        "ReduceSum" | "ReduceMean" | "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" => f32_in(0),
        "Transpose" | "Expand" | "Split" | "Gather" => f32_in(0),
        "Slice" => f32_in(0) && slice_block(input_facts, 13).is_some(),
        "Concat" => true,
        // A float32 gradient copied back (the only float type on the device).
        "Cast" | "CastLike" => f32_in(0),
        _ => false,
    };
    if device {
        Path::Device
    } else {
        Path::Host
    }
}

/// The backward of one node on the device: one entry per input slot, `Some`
/// exactly for the wanted ones, as [`crate::ops::Op::backward_cpu`];
/// [`backward_path`] decides between the device launchers and the host.
pub fn backward(dev: &Device, cx: &DevBackwardCx) -> Result<(Vec<Option<DeviceTensor>>, Path)> {
    let op = cx.node.op_type.as_str();
    if backward_path(cx.node, &cx.inputs) == Path::Host {
        return Ok((host_backward(dev, cx)?, Path::Host));
    }
    let mut res: Vec<(usize, DeviceTensor)> = match op {
        _ if unary_code(op, cx.attrs())?.is_some() => unary_bwd(dev, cx)?,
        "Add" | "Sub" | "Mul" | "Div" | "Pow" => binary_bwd(dev, cx)?,
        "Where" => where_bwd(dev, cx)?,
        "Clip" => clip_bwd(dev, cx)?,
        "Dropout" => dropout_bwd(dev, cx)?,
        "MatMul" => matmul_bwd(dev, cx)?,
        "Gemm" => gemm_bwd(dev, cx)?,
        "Conv" => conv_bwd(dev, cx)?,
        "MaxPool" | "AveragePool" => pool_bwd(dev, cx)?,
        "GlobalAveragePool" => {
            let x = cx.input(0)?;
            let g = cx.grad(dev, 0)?;
            let plane: usize = x.shape[2..].iter().product();
            let dx = dev.zeros(DType::F32, &x.shape)?;
            let planes = x.shape[0] * x.shape[1];
            dev.launch(
                "global_avgpool_bwd_f32",
                planes * plane,
                &[Arg::n(planes), Arg::n(plane), Arg::t(&g), Arg::t(&dx)],
            )?;
            vec![(0, dx)]
        }
        "BatchNormalization" => bn_bwd(dev, cx)?,
        "LayerNormalization" => ln_bwd(dev, cx)?,
        "Softmax" | "LogSoftmax" => softmax_bwd(dev, cx)?,
        "ReduceSum" | "ReduceMean" => reduce_bwd(dev, cx)?,
        "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" => {
            let g = cx.grad(dev, 0)?;
            vec![(0, copy_as(dev, &g, &cx.input(0)?.shape)?)]
        }
        "Transpose" => transpose_bwd(dev, cx)?,
        "Expand" => {
            let g = cx.grad(dev, 0)?;
            vec![(0, sum_to(dev, &g, &cx.input(0)?.shape, 1.0)?)]
        }
        "Concat" => concat_bwd(dev, cx)?,
        "Split" => split_bwd(dev, cx)?,
        "Slice" => {
            let f = cx.input(0)?;
            let (ax, off) = slice_block(&cx.inputs, 13)
                .ok_or_else(|| CudaError::Kernel("Slice is not one block".into()))?;
            let g = cx.grad(dev, 0)?;
            let dx = dev.zeros(DType::F32, &f.shape)?;
            block_copy(dev, &dx, &g, ax, off, true)?;
            vec![(0, dx)]
        }
        "Gather" => gather_bwd(dev, cx)?,
        "Cast" | "CastLike" => {
            let g = cx.grad(dev, 0)?;
            g.expect_f32("Cast's incoming gradient")?;
            vec![(0, copy_as(dev, &g, &cx.input(0)?.shape)?)]
        }
        other => unreachable!("backward_path sends {other} to the host"),
    };
    let mut out: Vec<Option<DeviceTensor>> = (0..cx.node.inputs.len()).map(|_| None).collect();
    for (slot, t) in res.drain(..) {
        if slot < out.len() && cx.wants(slot) {
            out[slot] = Some(t);
        }
    }
    Ok((out, Path::Device))
}

// ---------------------------------------------------------------- host fallback

fn host_forward(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let op = registry()
        .get(&cx.node.domain, &cx.node.op_type)
        .ok_or_else(|| CudaError::Kernel(format!("unsupported op {}", cx.node.op_type)))?;
    let host: Vec<Option<Tensor>> = cx
        .inputs
        .iter()
        .map(|t| t.map(|t| dev.download(t)).transpose())
        .collect::<Result<_>>()?;
    let kcx = KernelCx {
        node: cx.node,
        inputs: host.iter().map(|t| t.as_ref()).collect(),
        outputs: cx.outputs.clone(),
        opset: cx.opset,
        seed: cx.seed,
        dropout: cx.dropout,
        extras: cx.extras,
    };
    let outs = op.forward_cpu(&kcx)?;
    outs.iter().map(|t| dev.upload(t)).collect()
}

fn host_backward(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<Option<DeviceTensor>>> {
    let op = registry()
        .get(&cx.node.domain, &cx.node.op_type)
        .ok_or_else(|| CudaError::Kernel(format!("unsupported op {}", cx.node.op_type)))?;
    let saved: Vec<(Saved, Tensor)> = cx
        .saved
        .iter()
        .map(|(s, t)| Ok((*s, dev.download(t)?)))
        .collect::<Result<_>>()?;
    let grads: Vec<Option<Tensor>> = cx
        .grads
        .iter()
        .map(|t| t.map(|t| dev.download(t)).transpose())
        .collect::<Result<_>>()?;
    let bcx = BackwardCx {
        node: cx.node,
        inputs: cx.inputs.clone(),
        outputs: cx.outputs.clone(),
        opset: cx.opset,
        saved: saved.iter().map(|(s, t)| (*s, t)).collect(),
        grads: grads.iter().map(|t| t.as_ref()).collect(),
        wanted: cx.wanted.clone(),
        dropout: cx.dropout,
    };
    let res = op.backward_cpu(&bcx)?;
    res.iter()
        .map(|t| t.as_ref().map(|t| dev.upload(t)).transpose())
        .collect()
}

// ---------------------------------------------------------------- data movement

fn copy_kernel(dtype: DType) -> Result<&'static str> {
    Ok(match super::tensor::elem_size(dtype)? {
        1 => "strided_copy_b1",
        8 => "strided_copy_b8",
        _ => "strided_copy_b4",
    })
}

/// `dst[dst_base + Σ c·dst_st] = src[src_base + Σ c·src_st]` over `d` (its
/// operand 0 the source strides, operand 1 the destination's).
fn strided_copy(
    dev: &Device,
    src: &DeviceTensor,
    src_base: usize,
    dst: &DeviceTensor,
    dst_base: usize,
    n: usize,
    d: Strided,
) -> Result<()> {
    dev.launch(
        copy_kernel(src.dtype())?,
        n,
        &[
            Arg::n(n),
            Arg::Strided(Box::new(d)),
            Arg::n(src_base),
            Arg::t(src),
            Arg::n(dst_base),
            Arg::t(dst),
        ],
    )
}

/// A new contiguous tensor of `shape` read from `src` with `d`'s operand-0 strides.
fn strided_new(
    dev: &Device,
    src: &DeviceTensor,
    shape: &[usize],
    d: Strided,
) -> Result<DeviceTensor> {
    let out = dev.zeros(src.dtype(), shape)?;
    let n: usize = shape.iter().product();
    let mut d = d;
    let cont = Strided::contiguous(shape);
    let src_st = (0..shape.len()).map(|i| d_st(&d, 0, i)).collect::<Vec<_>>();
    d = Strided::new(shape, &[src_st, cont])?;
    strided_copy(dev, src, 0, &out, 0, n, d)?;
    Ok(out)
}

fn d_st(d: &Strided, k: usize, i: usize) -> i64 {
    // Strided's fields are private to keep the C layout in one place; read back
    // through its Debug-free accessor.
    d.stride(k, i)
}

/// A contiguous copy of `x` with the same elements and another shape.
fn copy_as(dev: &Device, x: &DeviceTensor, shape: &[usize]) -> Result<DeviceTensor> {
    let n = x.numel();
    if shape.iter().product::<usize>() != n {
        return Err(CudaError::Kernel(format!(
            "cannot view {:?} as {shape:?}",
            x.shape
        )));
    }
    let out = dev.zeros(x.dtype(), shape)?;
    let d = Strided::new(&[n], &[vec![1], vec![1]])?;
    strided_copy(dev, x, 0, &out, 0, n, d)?;
    Ok(out)
}

/// A copy of `x` (same shape and elements) in a new allocation made for `alloc`'s
/// element count: an expanded operand's copy is larger than `x` (counted in full, the
/// elements past `x`'s stay zero and unread); a summed one is smaller, and then `x`
/// is kept whole with only `alloc`'s bytes counted as a tensor, the rest as
/// workspace (memory the executor holds beyond what PyTorch saves).
pub(super) fn copy_into(dev: &Device, x: &DeviceTensor, alloc: &[usize]) -> Result<DeviceTensor> {
    let n = x.numel();
    let want: usize = alloc.iter().product();
    let mut out = dev.zeros(x.dtype(), if want >= n { alloc } else { &x.shape })?;
    let d = Strided::new(&[n], &[vec![1], vec![1]])?;
    strided_copy(dev, x, 0, &out, 0, n, d)?;
    out.shape = x.shape.clone();
    if want < n {
        out.count_as((want * super::tensor::elem_size(x.dtype())?) as u64);
    }
    Ok(out)
}

/// `scale · Σ` of `g` (shape `from`) over the axes broadcast to it from `target`
/// (numpy rules), in row-major order in f64 (exec::grad::sum_to).
fn sum_to(dev: &Device, g: &DeviceTensor, target: &[usize], scale: f64) -> Result<DeviceTensor> {
    let from = g.shape.clone();
    if from.as_slice() == target && scale == 1.0 {
        return copy_as(dev, g, target);
    }
    let r = from.len();
    let mut t2 = vec![1usize; r - target.len()];
    t2.extend_from_slice(target);
    let st = strides(&from);
    let reduced: Vec<usize> = (0..r).filter(|&i| t2[i] == 1 && from[i] != 1).collect();
    let keep_st: Vec<i64> = (0..r)
        .map(|i| {
            if reduced.contains(&i) {
                0
            } else {
                st[i] as i64
            }
        })
        .collect();
    let keep = Strided::new(&t2, &[keep_st])?;
    let red_shape: Vec<usize> = reduced.iter().map(|&i| from[i]).collect();
    let red = Strided::new(
        &red_shape,
        &[reduced.iter().map(|&i| st[i] as i64).collect()],
    )?;
    reduce_launch(
        dev,
        0,
        g,
        target,
        keep,
        red_shape.iter().product(),
        red,
        scale,
    )
}

#[allow(clippy::too_many_arguments)]
fn reduce_launch(
    dev: &Device,
    op: i32,
    x: &DeviceTensor,
    out_shape: &[usize],
    keep: Strided,
    n_red: usize,
    red: Strided,
    scale: f64,
) -> Result<DeviceTensor> {
    let y = dev.zeros(DType::F32, out_shape)?;
    let n_out = y.numel();
    dev.launch(
        "reduce_f32",
        n_out,
        &[
            Arg::I32(op),
            Arg::n(n_out),
            Arg::Strided(Box::new(keep)),
            Arg::n(n_red),
            Arg::Strided(Box::new(red)),
            Arg::t(x),
            Arg::t(&y),
            Arg::F64(scale),
        ],
    )?;
    Ok(y)
}

fn transpose_perm(attrs: &Attrs, rank: usize) -> Vec<usize> {
    match attrs.ints("perm") {
        Some(p) => p.iter().map(|&v| v.max(0) as usize).collect(),
        None => (0..rank).rev().collect(),
    }
}

fn permuted(dev: &Device, x: &DeviceTensor, perm: &[usize]) -> Result<DeviceTensor> {
    let st = strides(&x.shape);
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    let pst: Vec<i64> = perm.iter().map(|&p| st[p] as i64).collect();
    let d = Strided::new(&shape, &[pst])?;
    strided_new(dev, x, &shape, d)
}

fn transpose_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let x = cx.input(0)?;
    let perm = transpose_perm(cx.attrs(), x.shape.len());
    Ok(vec![permuted(dev, x, &perm)?])
}

fn transpose_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let rank = cx.input(0)?.shape.len();
    let perm = transpose_perm(cx.attrs(), rank);
    let mut inv = vec![0; rank];
    for (i, &p) in perm.iter().enumerate() {
        inv[p] = i;
    }
    let g = cx.grad(dev, 0)?;
    Ok(vec![(0, permuted(dev, &g, &inv)?)])
}

/// Copies `part` (its own contiguous layout) into / out of the block of `whole`
/// starting at `offset` along `ax`.
fn block_copy(
    dev: &Device,
    whole: &DeviceTensor,
    part: &DeviceTensor,
    ax: usize,
    offset: usize,
    into_whole: bool,
) -> Result<()> {
    let wst: Vec<i64> = Strided::contiguous(&whole.shape);
    let pst: Vec<i64> = Strided::contiguous(&part.shape);
    let base = offset * strides(&whole.shape)[ax];
    let n = part.numel();
    if into_whole {
        strided_copy(
            dev,
            part,
            0,
            whole,
            base,
            n,
            Strided::new(&part.shape, &[pst, wst])?,
        )
    } else {
        strided_copy(
            dev,
            whole,
            base,
            part,
            0,
            n,
            Strided::new(&part.shape, &[wst, pst])?,
        )
    }
}

fn concat_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let out = &cx.out(0)?.shape;
    let ax = axis(cx.attrs().int_or("axis", 0), out.len())?;
    let y = dev.zeros(cx.input(0)?.dtype(), out)?;
    let mut off = 0;
    for t in cx.inputs.iter().flatten() {
        block_copy(dev, &y, t, ax, off, true)?;
        off += t.shape[ax];
    }
    Ok(vec![y])
}

fn concat_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let out = &cx.output(0)?.shape;
    let ax = axis(cx.attrs().int_or("axis", 0), out.len())?;
    let g = cx.grad(dev, 0)?;
    let mut res = Vec::new();
    let mut off = 0;
    for (slot, f) in cx.inputs.iter().enumerate() {
        let Some(f) = f else { continue };
        if cx.wants(slot) {
            let part = dev.zeros(DType::F32, &f.shape)?;
            block_copy(dev, &g, &part, ax, off, false)?;
            res.push((slot, part));
        }
        off += f.shape[ax];
    }
    Ok(res)
}

fn split_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let x = cx.input(0)?;
    let ax = axis(cx.attrs().int_or("axis", 0), x.shape.len())?;
    let mut res = Vec::new();
    let mut off = 0;
    for f in cx.outputs.iter() {
        let f = f.ok_or_else(|| CudaError::Kernel("Split output without a fact".into()))?;
        let part = dev.zeros(x.dtype(), &f.shape)?;
        block_copy(dev, x, &part, ax, off, false)?;
        off += f.shape[ax];
        res.push(part);
    }
    Ok(res)
}

fn split_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let f = cx.input(0)?;
    let ax = axis(cx.attrs().int_or("axis", 0), f.shape.len())?;
    let dx = dev.zeros(DType::F32, &f.shape)?;
    let mut off = 0;
    for (i, of) in cx.outputs.iter().enumerate() {
        let of = of.ok_or_else(|| CudaError::Kernel("Split output without a fact".into()))?;
        if let Some(g) = cx.grads.get(i).copied().flatten() {
            block_copy(dev, &dx, g, ax, off, true)?;
        }
        off += of.shape[ax];
    }
    Ok(vec![(0, dx)])
}

/// A Slice (opset 10+, every argument a folded constant) that takes one
/// contiguous block along at most one axis with step 1 (`x[..., a:b]`, as
/// rotary embeddings' `rotate_half` does): that axis and the block's start.
/// Anything else (steps, several sliced axes) runs on the host.
fn slice_block(facts: &[Option<&Fact>], opset: i64) -> Option<(usize, usize)> {
    if opset < 10 {
        return None;
    }
    let x = facts
        .first()
        .copied()
        .flatten()
        .filter(|x| !x.shape.is_empty())?;
    let ints = |i: usize| -> Option<Option<Vec<i64>>> {
        match facts.get(i).copied().flatten() {
            None => Some(None),
            Some(f) => Some(Some(f.value.as_ref()?.to_ints())),
        }
    };
    let (starts, ends) = (ints(1)??, ints(2)??);
    let r = x.shape.len() as i64;
    let axes = match ints(3)? {
        Some(a) => a
            .iter()
            .map(|&v| usize::try_from(if v < 0 { v + r } else { v }).ok())
            .collect::<Option<Vec<_>>>()?,
        None => (0..starts.len()).collect(),
    };
    let steps = ints(4)?.unwrap_or_else(|| vec![1; starts.len()]);
    if steps.iter().any(|&s| s != 1) || axes.len() != starts.len() || ends.len() != starts.len() {
        return None;
    }
    let mut block = None;
    for (k, &a) in axes.iter().enumerate() {
        let d = *x.shape.get(a)? as i64;
        let norm = |v: i64| if v < 0 { v.saturating_add(d) } else { v }.clamp(0, d);
        let (b, e) = (norm(starts[k]), norm(ends[k]));
        if b == 0 && e >= d {
            continue;
        }
        if block.is_some() {
            return None;
        }
        block = Some((a, b as usize));
    }
    Some(block.unwrap_or((0, 0)))
}

fn gather_dims(data: &[usize], n_idx: usize, ax: usize) -> [usize; 4] {
    [
        data[..ax].iter().product(),
        data[ax],
        n_idx,
        data[ax + 1..].iter().product(),
    ]
}

fn gather_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (x, idx) = (cx.input(0)?, cx.input(1)?);
    let ax = axis(cx.attrs().int_or("axis", 0), x.shape.len())?;
    let [outer, ad, ni, inner] = gather_dims(&x.shape, idx.numel(), ax);
    let y = dev.zeros(DType::F32, &cx.out(0)?.shape)?;
    dev.launch(
        "gather_f32",
        outer * ni * inner,
        &[
            Arg::n(outer),
            Arg::n(ad),
            Arg::n(ni),
            Arg::n(inner),
            Arg::t(idx),
            Arg::t(x),
            Arg::t(&y),
        ],
    )?;
    Ok(vec![y])
}

fn cast_code_ok(d: DType) -> bool {
    matches!(d, DType::F32 | DType::I64 | DType::I32 | DType::Bool)
}

/// kernels/elementwise.cu `cast_any`'s type codes.
fn cast_code(d: DType) -> i32 {
    match d {
        DType::F32 => 0,
        DType::I64 => 1,
        DType::I32 => 2,
        _ => 3,
    }
}

fn gather_elements_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (x, idx) = (cx.input(0)?, cx.input(1)?);
    let a = axis(cx.attrs().int_or("axis", 0), x.shape.len())?;
    let xst = strides(&x.shape);
    let st: Vec<i64> = (0..x.shape.len())
        .map(|i| if i == a { 0 } else { xst[i] as i64 })
        .collect();
    let y = dev.zeros(x.dtype(), &idx.shape)?;
    let n = y.numel();
    let name = match super::tensor::elem_size(x.dtype())? {
        1 => "gather_elements_b1",
        8 => "gather_elements_b8",
        _ => "gather_elements_b4",
    };
    dev.launch(
        name,
        n,
        &[
            Arg::n(n),
            Arg::Strided(Box::new(Strided::new(&idx.shape, &[st])?)),
            Arg::n(xst[a]),
            Arg::n(x.shape[a]),
            Arg::t(idx),
            Arg::t(x),
            Arg::t(&y),
        ],
    )?;
    Ok(vec![y])
}

fn gather_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let f = cx.input(0)?;
    // A constant scalar index (a `select`) is not saved: its value, uploaded (a
    // launch temporary).
    let held;
    let idx = match cx.saved_opt(Saved::Input(1)) {
        Some(i) => i,
        None => {
            let v = cx
                .input(1)?
                .value
                .as_ref()
                .ok_or_else(|| {
                    CudaError::Kernel(
                        "the backward kernel reads Input(1), which was not saved for it".into(),
                    )
                })?
                .to_ints();
            let t = Tensor::from_i64(DType::I64, vec![v.len()], v).map_err(CudaError::Kernel)?;
            held = dev.upload(&t)?;
            &held
        }
    };
    let ax = axis(cx.attrs().int_or("axis", 0), f.shape.len())?;
    let [outer, ad, ni, inner] = gather_dims(&f.shape, idx.numel(), ax);
    let g = cx.grad(dev, 0)?;
    let dx = dev.zeros(DType::F32, &f.shape)?;
    dev.launch(
        "gather_bwd_f32",
        outer * inner,
        &[
            Arg::n(outer),
            Arg::n(ad),
            Arg::n(ni),
            Arg::n(inner),
            Arg::t(idx),
            Arg::t(&g),
            Arg::t(&dx),
        ],
    )?;
    Ok(vec![(0, dx)])
}

// ---------------------------------------------------------------- element-wise

/// kernels/elementwise.cu's unary op code and (alpha, beta) of `op`, `None`
/// for ops without a device kernel.
fn unary_code(op: &str, a: &Attrs) -> Result<Option<(i32, f32, f32)>> {
    let alpha = |d: f32| a.float("alpha").unwrap_or(d);
    Ok(Some(match op {
        "Identity" => (0, 0.0, 0.0),
        "Relu" => (1, 0.0, 0.0),
        "Neg" => (2, 0.0, 0.0),
        "Abs" => (3, 0.0, 0.0),
        "Sqrt" => (4, 0.0, 0.0),
        "Reciprocal" => (5, 0.0, 0.0),
        "Exp" => (6, 0.0, 0.0),
        "Log" => (7, 0.0, 0.0),
        "Erf" => (8, 0.0, 0.0),
        "Tanh" => (9, 0.0, 0.0),
        "Sigmoid" => (10, 0.0, 0.0),
        "Gelu" => match a.string("approximate").unwrap_or("none") {
            "none" => (11, 0.0, 0.0),
            "tanh" => (12, 0.0, 0.0),
            other => return Err(CudaError::Kernel(format!("unknown approximate '{other}'"))),
        },
        "LeakyRelu" => (13, alpha(0.01), 0.0),
        "Sin" => (14, 0.0, 0.0),
        "Cos" => (15, 0.0, 0.0),
        "Floor" => (16, 0.0, 0.0),
        "Ceil" => (17, 0.0, 0.0),
        "Softplus" => (18, 0.0, 0.0),
        "HardSigmoid" => (19, alpha(0.2), a.float("beta").unwrap_or(0.5)),
        "HardSwish" => (20, 0.0, 0.0),
        "Elu" => (21, alpha(1.0), 0.0),
        _ => return Ok(None),
    }))
}

/// What a unary op's derivative reads (unary_derivative on the CPU): the output
/// for these, nothing for those, the input otherwise.
fn unary_reads(op: &str) -> Option<Saved> {
    match op {
        "Relu" | "Sqrt" | "Reciprocal" | "Exp" | "Tanh" | "Sigmoid" | "Elu" => {
            Some(Saved::Output(0))
        }
        "Identity" | "Neg" | "Floor" | "Ceil" => None,
        _ => Some(Saved::Input(0)),
    }
}

fn unary_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (code, al, be) = unary_code(&cx.node.op_type, cx.attrs())?.expect("checked by forward");
    let x = cx.input(0)?;
    let y = dev.zeros(DType::F32, &x.shape)?;
    let n = x.numel();
    dev.launch(
        "unary_fwd_f32",
        n,
        &[
            Arg::I32(code),
            Arg::n(n),
            Arg::t(x),
            Arg::t(&y),
            Arg::F32(al),
            Arg::F32(be),
        ],
    )?;
    Ok(vec![y])
}

fn unary_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let op = cx.node.op_type.as_str();
    let (code, al, be) = unary_code(op, cx.attrs())?.expect("checked by backward");
    let s = unary_reads(op).map(|s| cx.saved(s)).transpose()?;
    let g = cx.grad(dev, 0)?;
    let dx = dev.zeros(DType::F32, &cx.input(0)?.shape)?;
    let n = dx.numel();
    dev.launch(
        "unary_bwd_f32",
        n,
        &[
            Arg::I32(code),
            Arg::n(n),
            Arg::t(&g),
            Arg::opt(s),
            Arg::t(&dx),
            Arg::F32(al),
            Arg::F32(be),
        ],
    )?;
    Ok(vec![(0, dx)])
}

fn binary_code(op: &str) -> i32 {
    match op {
        "Add" => 0,
        "Sub" => 1,
        "Mul" => 2,
        "Div" => 3,
        "Pow" => 4,
        "PRelu" => 5,
        _ => 6,
    }
}

fn binary_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (a, b) = (cx.input(0)?, cx.input(1)?);
    let out = &cx.out(0)?.shape;
    let y = dev.zeros(DType::F32, out)?;
    let n = y.numel();
    let d = Strided::broadcast(out, &[&a.shape, &b.shape])?;
    dev.launch(
        "binary_fwd_f32",
        n,
        &[
            Arg::I32(binary_code(&cx.node.op_type)),
            Arg::n(n),
            Arg::Strided(Box::new(d)),
            Arg::t(a),
            Arg::t(b),
            Arg::t(&y),
        ],
    )?;
    Ok(vec![y])
}

fn binary_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let out = cx.output(0)?.shape.clone();
    let (sa, sb) = (cx.input(0)?.shape.clone(), cx.input(1)?.shape.clone());
    let g = cx.grad(dev, 0)?;
    let code = binary_code(&cx.node.op_type);
    let d = Strided::broadcast(&out, &[&sa, &sb, &out])?;
    let mut res = Vec::new();
    for slot in [0usize, 1] {
        if !cx.wants(slot) {
            continue;
        }
        let full = dev.zeros(DType::F32, &out)?;
        let n = full.numel();
        dev.launch(
            "binary_bwd_f32",
            n,
            &[
                Arg::I32(code),
                Arg::I32(slot as i32),
                Arg::n(n),
                Arg::Strided(Box::new(d)),
                Arg::t(&g),
                Arg::opt(cx.saved_opt(Saved::Input(0))),
                Arg::opt(cx.saved_opt(Saved::Input(1))),
                Arg::opt(cx.saved_opt(Saved::Output(0))),
                Arg::t(&full),
            ],
        )?;
        let target = if slot == 0 { &sa } else { &sb };
        let r = if target == &out {
            full
        } else {
            sum_to(dev, &full, target, 1.0)?
        };
        res.push((slot, r));
    }
    Ok(res)
}

fn compare_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (a, b) = (cx.input(0)?, cx.input(1)?);
    let out = &cx.out(0)?.shape;
    let code = match cx.node.op_type.as_str() {
        "Equal" => 0,
        "Less" => 1,
        "LessOrEqual" => 2,
        "Greater" => 3,
        _ => 4,
    };
    let y = dev.zeros(DType::Bool, out)?;
    let n = y.numel();
    let d = Strided::broadcast(out, &[&a.shape, &b.shape])?;
    dev.launch(
        "compare_f32",
        n,
        &[
            Arg::I32(code),
            Arg::n(n),
            Arg::Strided(Box::new(d)),
            Arg::t(a),
            Arg::t(b),
            Arg::t(&y),
        ],
    )?;
    Ok(vec![y])
}

fn where_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (c, x, y) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
    if c.dtype() != DType::Bool {
        return Err(CudaError::Kernel("Where's condition must be bool".into()));
    }
    let out = &cx.out(0)?.shape;
    let o = dev.zeros(DType::F32, out)?;
    let n = o.numel();
    let d = Strided::broadcast(out, &[&c.shape, &x.shape, &y.shape])?;
    dev.launch(
        "where_f32",
        n,
        &[
            Arg::n(n),
            Arg::Strided(Box::new(d)),
            Arg::t(c),
            Arg::t(x),
            Arg::t(y),
            Arg::t(&o),
        ],
    )?;
    Ok(vec![o])
}

fn where_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let c = cx.saved(Saved::Input(0))?;
    let out = cx.output(0)?.shape.clone();
    let g = cx.grad(dev, 0)?;
    let d = Strided::broadcast(&out, &[&c.shape])?;
    let mut res = Vec::new();
    for slot in [1usize, 2] {
        if !cx.wants(slot) {
            continue;
        }
        let full = dev.zeros(DType::F32, &out)?;
        let n = full.numel();
        dev.launch(
            "where_bwd_f32",
            n,
            &[
                Arg::I32(slot as i32),
                Arg::n(n),
                Arg::Strided(Box::new(d)),
                Arg::t(c),
                Arg::t(&g),
                Arg::t(&full),
            ],
        )?;
        let target = &cx.input(slot)?.shape;
        let r = if target == &out {
            full
        } else {
            sum_to(dev, &full, target, 1.0)?
        };
        res.push((slot, r));
    }
    Ok(res)
}

/// Clip's bounds from the input facts (opset 11+, folded scalars) or attributes.
fn clip_bounds(inputs: &[Option<&Fact>], attrs: &Attrs, opset: i64) -> Result<(f32, f32)> {
    let bound = |i: usize, attr: &str| -> Result<Option<f32>> {
        if opset >= 11 {
            match inputs.get(i).copied().flatten() {
                None => Ok(None),
                Some(f) => f
                    .value
                    .as_ref()
                    .and_then(|v| v.scalar_float())
                    .map(|v| Some(v as f32))
                    .ok_or_else(|| CudaError::Kernel(format!("Clip bound {i} is not a constant"))),
            }
        } else {
            Ok(attrs.float(attr))
        }
    };
    Ok((
        bound(1, "min")?.unwrap_or(f32::NEG_INFINITY),
        bound(2, "max")?.unwrap_or(f32::INFINITY),
    ))
}

fn clip_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (lo, hi) = clip_bounds(&cx.input_facts, cx.attrs(), cx.opset)?;
    let x = cx.input(0)?;
    let y = dev.zeros(DType::F32, &x.shape)?;
    let n = x.numel();
    dev.launch(
        "clip_fwd_f32",
        n,
        &[Arg::n(n), Arg::t(x), Arg::t(&y), Arg::F32(lo), Arg::F32(hi)],
    )?;
    Ok(vec![y])
}

fn clip_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let (lo, hi) = clip_bounds(&cx.inputs, cx.attrs(), cx.opset)?;
    let x = cx.saved(Saved::Input(0))?;
    let g = cx.grad(dev, 0)?;
    let dx = dev.zeros(DType::F32, &x.shape)?;
    let n = x.numel();
    dev.launch(
        "clip_bwd_f32",
        n,
        &[
            Arg::n(n),
            Arg::t(&g),
            Arg::t(x),
            Arg::t(&dx),
            Arg::F32(lo),
            Arg::F32(hi),
        ],
    )?;
    Ok(vec![(0, dx)])
}

fn dropout_scale(ratio: f64) -> f32 {
    if ratio < 1.0 {
        (1.0 / (1.0 - ratio)) as f32
    } else {
        0.0
    }
}

/// Dropout as dropout_kernel: `[y, mask]` for the declared outputs, then the mask
/// as extra in training. Training mode and ratio come from the folded input
/// facts (the CPU reads the runtime inputs; they agree whenever those are
/// constants, as in every exported model).
fn dropout_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let rcx = cx.rule_cx();
    let x = cx.input(0)?;
    let n = x.numel();
    let training = !ops::elementwise::Dropout::is_identity(&rcx);
    let ratio = ops::elementwise::Dropout::ratio(&rcx);
    let y = dev.zeros(DType::F32, &x.shape)?;
    let mask = dev.zeros(DType::Bool, &x.shape)?;
    if training && cx.dropout {
        dev.launch(
            "dropout_fwd_f32",
            n,
            &[
                Arg::n(n),
                Arg::U64(cx.seed),
                Arg::F64(ratio),
                Arg::F32(dropout_scale(ratio)),
                Arg::t(x),
                Arg::t(&y),
                Arg::t(&mask),
            ],
        )?;
    } else {
        let d = Strided::new(&[n], &[vec![1], vec![1]])?;
        strided_copy(dev, x, 0, &y, 0, n, d)?;
        let ones = Tensor::bool(x.shape.clone(), vec![true; n]);
        let m = dev.upload(&ones)?;
        drop(mask);
        // Training with dropping switched off still saves its (all-true) mask,
        // as the CPU kernel does.
        return finish_dropout(dev, cx, y, m, training);
    }
    finish_dropout(dev, cx, y, mask, training)
}

fn finish_dropout(
    dev: &Device,
    cx: &DevKernelCx,
    y: DeviceTensor,
    mask: DeviceTensor,
    training: bool,
) -> Result<Vec<DeviceTensor>> {
    let mut outs = vec![y];
    let extra = cx.extras && training;
    if cx.outputs.len() > 1 {
        if extra {
            outs.push(copy_as(dev, &mask, &mask.shape.clone())?);
        } else {
            outs.push(mask);
            return Ok(outs);
        }
    }
    if extra {
        outs.push(mask);
    }
    Ok(outs)
}

fn dropout_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let rcx = cx.rule_cx();
    let g = cx.grad(dev, 0)?;
    if ops::elementwise::Dropout::is_identity(&rcx) || !cx.dropout {
        return Ok(vec![(0, copy_as(dev, &g, &g.shape.clone())?)]);
    }
    let ratio = ops::elementwise::Dropout::ratio(&rcx);
    let mask = cx.saved(Saved::Extra(0))?;
    let dx = dev.zeros(DType::F32, &g.shape)?;
    let n = dx.numel();
    dev.launch(
        "dropout_bwd_f32",
        n,
        &[
            Arg::n(n),
            Arg::F32(dropout_scale(ratio)),
            Arg::t(&g),
            Arg::t(mask),
            Arg::t(&dx),
        ],
    )?;
    Ok(vec![(0, dx)])
}

// ---------------------------------------------------------------- GEMMs (cuBLAS)

/// Row-major, strided batched: `C[p] = α·op(A[p])·op(B[p]) + β·C[p]`, `op(A)`
/// `[m, k]` (A stored `[k, m]` when `ta`), `op(B)` `[k, n]`, C `[m, n]`;
/// pointers in bytes, strides in elements (0: shared by the batch).
#[allow(clippy::too_many_arguments)]
fn sgemm(
    dev: &Device,
    (ta, tb): (bool, bool),
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    (a, sa): (u64, usize),
    (b, sb): (u64, usize),
    beta: f32,
    (c, sc): (u64, usize),
    batch: usize,
) -> Result<()> {
    use cudarc::cublas::sys::cublasOperation_t as Op;
    if m == 0 || n == 0 || batch == 0 {
        return Ok(());
    }
    let lda = if ta { m } else { k };
    let ldb = if tb { k } else { n };
    let op = |t: bool| if t { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N };
    let int = |v: usize| -> Result<i32> {
        i32::try_from(v).map_err(|_| CudaError::Blas(format!("dimension {v} exceeds cuBLAS's int")))
    };
    if let super::Backend::Emulated(_) = dev.backend() {
        // SAFETY: as below, host buffers of the emulated backend.
        unsafe {
            host_sgemm(
                (ta, tb),
                (m, n, k),
                alpha,
                (a, sa),
                (b, sb),
                beta,
                (c, sc),
                batch,
            )
        };
        return Ok(());
    }
    // Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ: swap the operands.
    // SAFETY: the pointers are live device allocations holding `batch` matrices
    // of the given strides (callers size them from the same shapes).
    unsafe {
        cudarc::cublas::result::sgemm_strided_batched(
            *dev.blas()?.handle(),
            op(tb),
            op(ta),
            int(n)?,
            int(m)?,
            int(k)?,
            &alpha,
            b as *const f32,
            int(ldb.max(1))?,
            sb as i64,
            a as *const f32,
            int(lda.max(1))?,
            sa as i64,
            &beta,
            c as *mut f32,
            int(n)?,
            sc as i64,
            int(batch)?,
        )?;
    }
    Ok(())
}

/// [`sgemm`] on host memory (the emulated backend): a naive loop, f32 sums.
///
/// # Safety
/// The addresses are live host buffers holding `batch` matrices of the strides.
#[allow(clippy::too_many_arguments)]
unsafe fn host_sgemm(
    (ta, tb): (bool, bool),
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    (a, sa): (u64, usize),
    (b, sb): (u64, usize),
    beta: f32,
    (c, sc): (u64, usize),
    batch: usize,
) {
    let (a, b, c) = (a as *const f32, b as *const f32, c as *mut f32);
    for p in 0..batch {
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0f32;
                for l in 0..k {
                    // SAFETY: the caller's contract.
                    let (x, y) = unsafe {
                        (
                            *a.add(p * sa + if ta { l * m + i } else { i * k + l }),
                            *b.add(p * sb + if tb { j * k + l } else { l * n + j }),
                        )
                    };
                    acc += x * y;
                }
                // SAFETY: the caller's contract.
                let o = unsafe { &mut *c.add(p * sc + i * n + j) };
                *o = alpha * acc + if beta == 0.0 { 0.0 } else { beta * *o };
            }
        }
    }
}

/// MatMul's operands as batched matrices: (`[.., m, k]`, `[.., k, n]`), batch
/// shapes, and the broadcast batch.
struct MatDims {
    a2: Vec<usize>,
    b2: Vec<usize>,
    m: usize,
    k: usize,
    n: usize,
    batch: Vec<usize>,
}

fn mat_dims(a: &[usize], b: &[usize]) -> Result<MatDims> {
    let a2: Vec<usize> = if a.len() == 1 {
        vec![1, a[0]]
    } else {
        a.to_vec()
    };
    let b2: Vec<usize> = if b.len() == 1 {
        vec![b[0], 1]
    } else {
        b.to_vec()
    };
    let (ra, rb) = (a2.len(), b2.len());
    let (m, k, n) = (a2[ra - 2], a2[ra - 1], b2[rb - 1]);
    let batch = ops::broadcast(&[&a2[..ra - 2], &b2[..rb - 2]])?;
    Ok(MatDims {
        a2,
        b2,
        m,
        k,
        n,
        batch,
    })
}

/// An operand broadcast to the full batch: its batch stride (0 when it has a
/// single matrix) and, when its batch shape differs otherwise, an expanded copy.
fn batched<'t>(
    dev: &Device,
    x: &'t DeviceTensor,
    x2: &[usize],
    batch: &[usize],
) -> Result<(Held<'t>, usize)> {
    let r = x2.len();
    let mat = x2[r - 2] * x2[r - 1];
    let xb: usize = x2[..r - 2].iter().product();
    if xb == 1 {
        return Ok((Held::B(x), 0));
    }
    if x2[..r - 2] == *batch {
        return Ok((Held::B(x), mat));
    }
    let mut full = batch.to_vec();
    full.extend_from_slice(&x2[r - 2..]);
    let d = Strided::broadcast(&full, &[x2])?;
    Ok((Held::O(strided_new(dev, x, &full, d)?), mat))
}

fn matmul_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (a, b) = (cx.input(0)?, cx.input(1)?);
    let d = mat_dims(&a.shape, &b.shape)?;
    let y = dev.zeros(DType::F32, &cx.out(0)?.shape)?;
    let nb: usize = d.batch.iter().product();
    let (ae, sa) = batched(dev, a, &d.a2, &d.batch)?;
    let (be, sb) = batched(dev, b, &d.b2, &d.batch)?;
    sgemm(
        dev,
        (false, false),
        (d.m, d.n, d.k),
        1.0,
        (ae.ptr(), sa),
        (be.ptr(), sb),
        0.0,
        (y.ptr(), d.m * d.n),
        nb,
    )?;
    Ok(vec![y])
}

fn matmul_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let (fa, fb) = (cx.input(0)?, cx.input(1)?);
    let d = mat_dims(&fa.shape, &fb.shape)?;
    let g = cx.grad(dev, 0)?;
    let nb: usize = d.batch.iter().product();
    let (m, k, n) = (d.m, d.k, d.n);
    let mut res = Vec::new();
    // The gradient of an operand at the full batch, summed back to its shape.
    let back = |full: DeviceTensor, x2: &[usize], shape: &[usize]| -> Result<DeviceTensor> {
        let r = if full.shape.as_slice() == x2 {
            full
        } else {
            sum_to(dev, &full, x2, 1.0)?
        };
        copy_as(dev, &r, shape)
    };
    let full_of = |rows: usize, cols: usize| -> Result<DeviceTensor> {
        let mut s = d.batch.clone();
        s.extend([rows, cols]);
        dev.zeros(DType::F32, &s)
    };
    if cx.wants(0) {
        let b = cx.saved(Saved::Input(1))?;
        let (be, sb) = batched(dev, b, &d.b2, &d.batch)?;
        let full = full_of(m, k)?;
        // dA = G·Bᵀ per matrix.
        sgemm(
            dev,
            (false, true),
            (m, k, n),
            1.0,
            (g.ptr(), m * n),
            (be.ptr(), sb),
            0.0,
            (full.ptr(), m * k),
            nb,
        )?;
        res.push((0, back(full, &d.a2, &fa.shape)?));
    }
    if cx.wants(1) {
        let a = cx.saved(Saved::Input(0))?;
        let (ae, sa) = batched(dev, a, &d.a2, &d.batch)?;
        let full = full_of(k, n)?;
        // dB = Aᵀ·G per matrix.
        sgemm(
            dev,
            (true, false),
            (k, n, m),
            1.0,
            (ae.ptr(), sa),
            (g.ptr(), m * n),
            0.0,
            (full.ptr(), k * n),
            nb,
        )?;
        res.push((1, back(full, &d.b2, &fb.shape)?));
    }
    Ok(res)
}

fn gemm_attrs(a: &Attrs) -> (bool, bool, f32, f32) {
    (
        a.int_or("transA", 0) != 0,
        a.int_or("transB", 0) != 0,
        a.float("alpha").unwrap_or(1.0),
        a.float("beta").unwrap_or(1.0),
    )
}

fn gemm_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (a, b) = (cx.input(0)?, cx.input(1)?);
    let out = cx.out(0)?.shape.clone();
    let (m, n) = (out[0], out[1]);
    let (ta, tb, alpha, beta) = gemm_attrs(cx.attrs());
    let k = if ta { a.shape[0] } else { a.shape[1] };
    let (y, beta_in) = match cx.opt(2) {
        Some(c) if beta != 0.0 => {
            let d = Strided::broadcast(&out, &[&c.shape])?;
            (strided_new(dev, c, &out, d)?, beta)
        }
        _ => (dev.zeros(DType::F32, &out)?, 0.0),
    };
    sgemm(
        dev,
        (ta, tb),
        (m, n, k),
        alpha,
        (a.ptr(), 0),
        (b.ptr(), 0),
        beta_in,
        (y.ptr(), 0),
        1,
    )?;
    Ok(vec![y])
}

fn gemm_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let fa = cx.input(0)?;
    let out = cx.output(0)?.shape.clone();
    let (m, n) = (out[0], out[1]);
    let (ta, tb, alpha, beta) = gemm_attrs(cx.attrs());
    let k = if ta { fa.shape[0] } else { fa.shape[1] };
    let g = cx.grad(dev, 0)?;
    let mut res = Vec::new();
    if cx.wants(0) {
        let b = cx.saved(Saved::Input(1))?;
        let d = dev.zeros(DType::F32, &fa.shape)?;
        if ta {
            // dA = α·B'·Gᵀ, [k, m].
            sgemm(
                dev,
                (tb, true),
                (k, m, n),
                alpha,
                (b.ptr(), 0),
                (g.ptr(), 0),
                0.0,
                (d.ptr(), 0),
                1,
            )?;
        } else {
            // dA = α·G·B'ᵀ, [m, k].
            sgemm(
                dev,
                (false, !tb),
                (m, k, n),
                alpha,
                (g.ptr(), 0),
                (b.ptr(), 0),
                0.0,
                (d.ptr(), 0),
                1,
            )?;
        }
        res.push((0, d));
    }
    if cx.wants(1) {
        let a = cx.saved(Saved::Input(0))?;
        let d = dev.zeros(DType::F32, &cx.input(1)?.shape)?;
        if tb {
            // dB = α·Gᵀ·A', [n, k].
            sgemm(
                dev,
                (true, ta),
                (n, k, m),
                alpha,
                (g.ptr(), 0),
                (a.ptr(), 0),
                0.0,
                (d.ptr(), 0),
                1,
            )?;
        } else {
            // dB = α·A'ᵀ·G, [k, n].
            sgemm(
                dev,
                (!ta, false),
                (k, n, m),
                alpha,
                (a.ptr(), 0),
                (g.ptr(), 0),
                0.0,
                (d.ptr(), 0),
                1,
            )?;
        }
        res.push((1, d));
    }
    if cx.wants(2) {
        res.push((2, sum_to(dev, &g, &cx.input(2)?.shape, beta as f64)?));
    }
    Ok(res)
}

// ---------------------------------------------------------------- conv and pooling

fn to_win(w: &ops::conv::Window) -> Win {
    Win {
        h: w.input[0] as i64,
        w: w.input[1] as i64,
        oh: w.output[0] as i64,
        ow: w.output[1] as i64,
        kh: w.kernel[0] as i64,
        kw: w.kernel[1] as i64,
        sh: w.strides[0] as i64,
        sw: w.strides[1] as i64,
        dh: w.dilations[0] as i64,
        dw: w.dilations[1] as i64,
        ph: w.pads[0] as i64,
        pw: w.pads[1] as i64,
        padded_h: w.padded[0] as i64,
        padded_w: w.padded[1] as i64,
    }
}

/// Conv's geometry: (n, c, m, group, window, direct 1×1).
fn conv_geom(
    attrs: &Attrs,
    x: &[usize],
    w: &[usize],
    out: &[usize],
) -> Result<(usize, usize, usize, usize, ops::conv::Window, bool)> {
    let group = attrs.int_or("group", 1).max(1) as usize;
    let win = ops::conv::window(attrs, &x[2..], &w[2..], &out[2..])?;
    let direct = win.kernel == [1, 1]
        && win.strides == [1, 1]
        && win.pads == [0, 0]
        && win.padded == win.input;
    Ok((x[0], x[1], w[0], group, win, direct))
}

fn conv_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let (x, wt) = (cx.input(0)?, cx.input(1)?);
    let out = cx.out(0)?.shape.clone();
    let (n, c, m, group, win, direct) = conv_geom(cx.attrs(), &x.shape, &wt.shape, &out)?;
    let (cg, mg) = (c / group, m / group);
    let k = to_win(&win);
    let plane = win.output[0] * win.output[1];
    let hw = win.input[0] * win.input[1];
    let kk = cg * win.kernel[0] * win.kernel[1];
    let y = dev.zeros(DType::F32, &out)?;
    let col: Option<Workspace> = if direct {
        None
    } else {
        Some(dev.workspace(kk * plane)?)
    };
    for img in 0..n {
        for g in 0..group {
            let xg = x.ptr() + 4 * ((img * c + g * cg) * hw) as u64;
            let src = match &col {
                None => xg,
                Some(col) => {
                    dev.launch(
                        "im2col_f32",
                        kk * plane,
                        &[Arg::n(cg), Arg::Win(k), Arg::Ptr(xg), Arg::Ptr(col.ptr())],
                    )?;
                    col.ptr()
                }
            };
            let wg = wt.ptr() + 4 * (g * mg * kk) as u64;
            let yg = y.ptr() + 4 * ((img * m + g * mg) * plane) as u64;
            sgemm(
                dev,
                (false, false),
                (mg, plane, kk),
                1.0,
                (wg, 0),
                (src, 0),
                0.0,
                (yg, 0),
                1,
            )?;
        }
    }
    if let Some(b) = cx.opt(2) {
        dev.launch(
            "conv_bias_f32",
            n * m * plane,
            &[Arg::n(n), Arg::n(m), Arg::n(plane), Arg::t(b), Arg::t(&y)],
        )?;
    }
    Ok(vec![y])
}

fn conv_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let (fx, fw) = (cx.input(0)?, cx.input(1)?);
    let out = cx.output(0)?.shape.clone();
    let (n, c, m, group, win, direct) = conv_geom(cx.attrs(), &fx.shape, &fw.shape, &out)?;
    let (cg, mg) = (c / group, m / group);
    let k = to_win(&win);
    let plane = win.output[0] * win.output[1];
    let hw = win.input[0] * win.input[1];
    let kk = cg * win.kernel[0] * win.kernel[1];
    let g = cx.grad(dev, 0)?;
    let g_of = |img: usize, gr: usize| g.ptr() + 4 * ((img * m + gr * mg) * plane) as u64;
    let col: Option<Workspace> = if direct || !(cx.wants(0) || cx.wants(1)) {
        None
    } else {
        Some(dev.workspace(kk * plane)?)
    };
    let mut res = Vec::new();
    if cx.wants(0) {
        let w = cx.saved(Saved::Input(1))?;
        let dx = dev.zeros(DType::F32, &fx.shape)?;
        for img in 0..n {
            for gr in 0..group {
                let wg = w.ptr() + 4 * (gr * mg * kk) as u64;
                let dxg = dx.ptr() + 4 * ((img * c + gr * cg) * hw) as u64;
                match &col {
                    None => sgemm(
                        dev,
                        (true, false),
                        (kk, plane, mg),
                        1.0,
                        (wg, 0),
                        (g_of(img, gr), 0),
                        0.0,
                        (dxg, 0),
                        1,
                    )?,
                    Some(col) => {
                        sgemm(
                            dev,
                            (true, false),
                            (kk, plane, mg),
                            1.0,
                            (wg, 0),
                            (g_of(img, gr), 0),
                            0.0,
                            (col.ptr(), 0),
                            1,
                        )?;
                        dev.launch(
                            "col2im_f32",
                            cg * hw,
                            &[Arg::n(cg), Arg::Win(k), Arg::Ptr(col.ptr()), Arg::Ptr(dxg)],
                        )?;
                    }
                }
            }
        }
        res.push((0, dx));
    }
    if cx.wants(1) {
        let x = cx.saved(Saved::Input(0))?;
        let dw = dev.zeros(DType::F32, &fw.shape)?;
        for gr in 0..group {
            let dwg = dw.ptr() + 4 * (gr * mg * kk) as u64;
            for img in 0..n {
                let xg = x.ptr() + 4 * ((img * c + gr * cg) * hw) as u64;
                let src = match &col {
                    None => xg,
                    Some(col) => {
                        dev.launch(
                            "im2col_f32",
                            kk * plane,
                            &[Arg::n(cg), Arg::Win(k), Arg::Ptr(xg), Arg::Ptr(col.ptr())],
                        )?;
                        col.ptr()
                    }
                };
                let beta = if img == 0 { 0.0 } else { 1.0 };
                sgemm(
                    dev,
                    (false, true),
                    (mg, kk, plane),
                    1.0,
                    (g_of(img, gr), 0),
                    (src, 0),
                    beta,
                    (dwg, 0),
                    1,
                )?;
            }
        }
        res.push((1, dw));
    }
    if cx.wants(2) {
        let db = dev.zeros(DType::F32, &[m])?;
        dev.launch(
            "channel_sum_f32",
            m,
            &[Arg::n(n), Arg::n(m), Arg::n(plane), Arg::t(&g), Arg::t(&db)],
        )?;
        res.push((2, db));
    }
    Ok(res)
}

fn pool_window(attrs: &Attrs, x: &[usize], out: &[usize]) -> Result<ops::conv::Window> {
    let ks: Vec<usize> = attrs
        .ints("kernel_shape")
        .ok_or_else(|| CudaError::Kernel("missing attribute 'kernel_shape'".into()))?
        .iter()
        .map(|&k| k.max(1) as usize)
        .collect();
    Ok(ops::conv::window(attrs, &x[2..], &ks, &out[2..])?)
}

fn pool_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let x = cx.input(0)?;
    let out = cx.out(0)?.shape.clone();
    let win = pool_window(cx.attrs(), &x.shape, &out)?;
    let k = to_win(&win);
    let planes = x.shape[0] * x.shape[1];
    let y = dev.zeros(DType::F32, &out)?;
    let n = y.numel();
    if cx.node.op_type == "MaxPool" {
        let idx = dev.zeros(DType::I64, &out)?;
        dev.launch(
            "maxpool2d_fwd_f32",
            n,
            &[
                Arg::n(planes),
                Arg::Win(k),
                Arg::t(x),
                Arg::t(&y),
                Arg::t(&idx),
            ],
        )?;
        let mut outs = vec![y];
        // Declared indices output, then the extra the backward rule saves.
        if cx.outputs.len() > 1 && cx.extras {
            outs.push(copy_as(dev, &idx, &out)?);
        }
        if cx.outputs.len() > 1 || cx.extras {
            outs.push(idx);
        }
        Ok(outs)
    } else {
        let include_pad = cx.attrs().int_or("count_include_pad", 0) != 0;
        dev.launch(
            "avgpool2d_fwd_f32",
            n,
            &[
                Arg::n(planes),
                Arg::Win(k),
                Arg::I32(include_pad as i32),
                Arg::t(x),
                Arg::t(&y),
            ],
        )?;
        Ok(vec![y])
    }
}

fn pool_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let f = cx.input(0)?;
    let out = cx.output(0)?.shape.clone();
    let win = pool_window(cx.attrs(), &f.shape, &out)?;
    let k = to_win(&win);
    let planes = f.shape[0] * f.shape[1];
    let g = cx.grad(dev, 0)?;
    let dx = dev.zeros(DType::F32, &f.shape)?;
    let n = dx.numel();
    if cx.node.op_type == "MaxPool" {
        let idx = cx.saved(Saved::Extra(0))?;
        dev.launch(
            "maxpool2d_bwd_f32",
            n,
            &[
                Arg::n(planes),
                Arg::Win(k),
                Arg::t(&g),
                Arg::t(idx),
                Arg::t(&dx),
            ],
        )?;
    } else {
        let include_pad = cx.attrs().int_or("count_include_pad", 0) != 0;
        dev.launch(
            "avgpool2d_bwd_f32",
            n,
            &[
                Arg::n(planes),
                Arg::Win(k),
                Arg::I32(include_pad as i32),
                Arg::t(&g),
                Arg::t(&dx),
            ],
        )?;
    }
    Ok(vec![(0, dx)])
}

fn gap_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let x = cx.input(0)?;
    let planes = x.shape[0] * x.shape[1];
    let plane: usize = x.shape[2..].iter().product();
    let y = dev.zeros(DType::F32, &cx.out(0)?.shape)?;
    if planes > 0 {
        dev.launch_cfg(
            "global_avgpool_fwd_f32",
            per_block(planes),
            &[Arg::n(planes), Arg::n(plane), Arg::t(x), Arg::t(&y)],
        )?;
    }
    Ok(vec![y])
}

// ---------------------------------------------------------------- normalization

/// BatchNormalization in training mode (inference mode runs on the host), as
/// batch_norm_kernel: y, the running statistics, (opset < 14) the batch mean and
/// variance, truncated to the declared outputs; then the extras (mean, invstd).
fn bn_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let x = cx.input(0)?;
    let [scale, bias, rm, rv] = [1, 2, 3, 4].map(|i| cx.input(i));
    let (scale, bias, rm, rv) = (scale?, bias?, rm?, rv?);
    for t in [scale, bias, rm, rv] {
        t.expect_f32("a BatchNormalization parameter")?;
    }
    let (n, c) = (x.shape[0], x.shape[1]);
    let plane: usize = x.shape[2..].iter().product();
    let eps = cx.attrs().float("epsilon").unwrap_or(1e-5) as f64;
    let momentum = cx.attrs().float("momentum").unwrap_or(0.9) as f64;
    // 2c doubles of statistics.
    let stats = dev.workspace(4 * c)?;
    if c > 0 {
        dev.launch_cfg(
            "bn_stats_f32",
            per_block(c),
            &[
                Arg::n(n),
                Arg::n(c),
                Arg::n(plane),
                Arg::t(x),
                Arg::Ptr(stats.ptr()),
            ],
        )?;
    }
    let y = dev.zeros(DType::F32, &x.shape)?;
    dev.launch(
        "bn_apply_f32",
        y.numel(),
        &[
            Arg::n(n),
            Arg::n(c),
            Arg::n(plane),
            Arg::t(x),
            Arg::t(scale),
            Arg::t(bias),
            Arg::Ptr(stats.ptr()),
            Arg::F64(eps),
            Arg::t(&y),
        ],
    )?;
    let n_out = cx.outputs.len().max(1);
    let mk = |want: bool| -> Result<Option<DeviceTensor>> {
        if want {
            Ok(Some(dev.zeros(DType::F32, &[c])?))
        } else {
            Ok(None)
        }
    };
    let new_mean = mk(n_out > 1)?;
    let new_var = mk(n_out > 2)?;
    let batch_mean = mk(cx.opset < 14 && n_out > 3)?;
    let batch_var = mk(cx.opset < 14 && n_out > 4)?;
    let mean = mk(cx.extras)?;
    let invstd = mk(cx.extras)?;
    dev.launch(
        "bn_finish_f32",
        c,
        &[
            Arg::n(c),
            Arg::Ptr(stats.ptr()),
            Arg::F64(eps),
            Arg::F64(momentum),
            Arg::t(rm),
            Arg::t(rv),
            Arg::opt(new_mean.as_ref()),
            Arg::opt(new_var.as_ref()),
            Arg::opt(mean.as_ref()),
            Arg::opt(invstd.as_ref()),
            Arg::opt(batch_mean.as_ref()),
            Arg::opt(batch_var.as_ref()),
        ],
    )?;
    let mut outs = vec![y];
    outs.extend(
        [new_mean, new_var, batch_mean, batch_var]
            .into_iter()
            .flatten(),
    );
    outs.extend([mean, invstd].into_iter().flatten());
    Ok(outs)
}

fn bn_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let f = cx.input(0)?;
    let (n, c) = (f.shape[0], f.shape[1]);
    let plane: usize = f.shape[2..].iter().product();
    let g = cx.grad(dev, 0)?;
    let need_x = cx.wants(0) || cx.wants(1);
    let (x, mean, invstd) = if need_x {
        (
            Some(cx.saved(Saved::Input(0))?),
            Some(cx.saved(Saved::Extra(0))?),
            Some(cx.saved(Saved::Extra(1))?),
        )
    } else {
        (None, None, None)
    };
    let sums = dev.workspace(4 * c)?;
    if c > 0 {
        dev.launch_cfg(
            "bn_bwd_reduce_f32",
            per_block(c),
            &[
                Arg::n(n),
                Arg::n(c),
                Arg::n(plane),
                Arg::t(&g),
                Arg::opt(x),
                Arg::opt(mean),
                Arg::opt(invstd),
                Arg::Ptr(sums.ptr()),
            ],
        )?;
    }
    let mut res = Vec::new();
    if cx.wants(0) {
        let scale = cx.saved(Saved::Input(1))?;
        let dx = dev.zeros(DType::F32, &f.shape)?;
        dev.launch(
            "bn_bwd_dx_f32",
            dx.numel(),
            &[
                Arg::n(n),
                Arg::n(c),
                Arg::n(plane),
                Arg::t(&g),
                Arg::opt(x),
                Arg::opt(mean),
                Arg::opt(invstd),
                Arg::t(scale),
                Arg::Ptr(sums.ptr()),
                Arg::t(&dx),
            ],
        )?;
        res.push((0, dx));
    }
    let ds = if cx.wants(1) {
        Some(dev.zeros(DType::F32, &[c])?)
    } else {
        None
    };
    let db = if cx.wants(2) {
        Some(dev.zeros(DType::F32, &[c])?)
    } else {
        None
    };
    dev.launch(
        "bn_bwd_params_f32",
        c,
        &[
            Arg::n(c),
            Arg::Ptr(sums.ptr()),
            Arg::opt(ds.as_ref()),
            Arg::opt(db.as_ref()),
        ],
    )?;
    res.extend(ds.map(|t| (1, t)));
    res.extend(db.map(|t| (2, t)));
    Ok(res)
}

/// A LayerNormalization parameter broadcast to the normalized shape (a copy only
/// when its shape differs).
fn ln_param<'t>(dev: &Device, t: &'t DeviceTensor, norm: &[usize]) -> Result<Held<'t>> {
    if t.shape == norm {
        return Ok(Held::B(t));
    }
    let d = Strided::broadcast(norm, &[&t.shape])?;
    Ok(Held::O(strided_new(dev, t, norm, d)?))
}

fn ln_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let x = cx.input(0)?;
    let a = axis(cx.attrs().int_or("axis", -1), x.shape.len())?;
    let eps = cx.attrs().float("epsilon").unwrap_or(1e-5) as f64;
    let norm = x.shape[a..].to_vec();
    let (rows, cols): (usize, usize) = (x.shape[..a].iter().product(), norm.iter().product());
    let scale = cx.opt(1).map(|t| ln_param(dev, t, &norm)).transpose()?;
    let bias = cx.opt(2).map(|t| ln_param(dev, t, &norm)).transpose()?;
    let y = dev.zeros(DType::F32, &x.shape)?;
    let mut stat_shape = x.shape[..a].to_vec();
    stat_shape.resize(x.shape.len(), 1);
    let mean = dev.zeros(DType::F32, &stat_shape)?;
    let invstd = dev.zeros(DType::F32, &stat_shape)?;
    if rows > 0 && cols > 0 {
        dev.launch_cfg(
            "ln_fwd_f32",
            per_block(rows),
            &[
                Arg::n(rows),
                Arg::n(cols),
                Arg::t(x),
                Arg::opt(scale.as_deref()),
                Arg::opt(bias.as_deref()),
                Arg::F64(eps),
                Arg::t(&y),
                Arg::t(&mean),
                Arg::t(&invstd),
            ],
        )?;
    }
    let mut outs = vec![y];
    for (i, src) in [(1usize, &mean), (2, &invstd)] {
        if let Some(Some(f)) = cx.outputs.get(i) {
            outs.push(copy_as(dev, src, &f.shape)?);
        } else if i < cx.outputs.len() {
            outs.push(dev.zeros(DType::F32, &[0])?);
        }
    }
    if cx.extras {
        outs.push(mean);
        outs.push(invstd);
    }
    Ok(outs)
}

fn ln_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let f = cx.input(0)?;
    let a = axis(cx.attrs().int_or("axis", -1), f.shape.len())?;
    let norm = f.shape[a..].to_vec();
    let (rows, cols): (usize, usize) = (f.shape[..a].iter().product(), norm.iter().product());
    let g = cx.grad(dev, 0)?;
    let mut res = Vec::new();
    let need_x = cx.wants(0) || cx.wants(1);
    let (x, mean, invstd) = if need_x {
        (
            Some(cx.saved(Saved::Input(0))?),
            Some(cx.saved(Saved::Extra(0))?),
            Some(cx.saved(Saved::Extra(1))?),
        )
    } else {
        (None, None, None)
    };
    if cx.wants(0) {
        let scale = ln_param(dev, cx.saved(Saved::Input(1))?, &norm)?;
        let dx = dev.zeros(DType::F32, &f.shape)?;
        if rows > 0 && cols > 0 {
            dev.launch_cfg(
                "ln_bwd_dx_f32",
                per_block(rows),
                &[
                    Arg::n(rows),
                    Arg::n(cols),
                    Arg::t(&g),
                    Arg::opt(x),
                    Arg::opt(mean),
                    Arg::opt(invstd),
                    Arg::t(&scale),
                    Arg::t(&dx),
                ],
            )?;
        }
        res.push((0, dx));
    }
    if cx.wants(1) || cx.wants(2) {
        let ds = if cx.wants(1) {
            Some(dev.zeros(DType::F32, &norm)?)
        } else {
            None
        };
        let db = if cx.wants(2) {
            Some(dev.zeros(DType::F32, &norm)?)
        } else {
            None
        };
        dev.launch(
            "ln_bwd_params_f32",
            cols,
            &[
                Arg::n(rows),
                Arg::n(cols),
                Arg::t(&g),
                Arg::opt(x),
                Arg::opt(mean),
                Arg::opt(invstd),
                Arg::opt(ds.as_ref()),
                Arg::opt(db.as_ref()),
            ],
        )?;
        for (slot, t) in [(1usize, ds), (2, db)] {
            if let Some(t) = t {
                res.push((slot, sum_to(dev, &t, &cx.input(slot)?.shape, 1.0)?));
            }
        }
    }
    Ok(res)
}

/// `(outer, n, inner)` of Softmax along `axis` (norm.rs softmax_dims).
fn softmax_dims(shape: &[usize], attrs: &Attrs, opset: i64) -> Result<(usize, usize, usize)> {
    let default = if opset >= 13 { -1 } else { 1 };
    let a = axis(attrs.int_or("axis", default), shape.len())?;
    Ok(if opset >= 13 {
        (
            shape[..a].iter().product(),
            shape[a],
            shape[a + 1..].iter().product(),
        )
    } else {
        (shape[..a].iter().product(), shape[a..].iter().product(), 1)
    })
}

fn softmax_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let x = cx.input(0)?;
    let (outer, n, inner) = softmax_dims(&x.shape, cx.attrs(), cx.opset)?;
    let log = (cx.node.op_type == "LogSoftmax") as i32;
    let y = dev.zeros(DType::F32, &x.shape)?;
    dev.launch(
        "softmax_fwd_f32",
        outer * inner,
        &[
            Arg::I32(log),
            Arg::n(outer),
            Arg::n(n),
            Arg::n(inner),
            Arg::t(x),
            Arg::t(&y),
        ],
    )?;
    Ok(vec![y])
}

fn softmax_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let f = cx.input(0)?;
    let (outer, n, inner) = softmax_dims(&f.shape, cx.attrs(), cx.opset)?;
    let log = (cx.node.op_type == "LogSoftmax") as i32;
    let y = cx.saved(Saved::Output(0))?;
    let g = cx.grad(dev, 0)?;
    let dx = dev.zeros(DType::F32, &f.shape)?;
    dev.launch(
        "softmax_bwd_f32",
        outer * inner,
        &[
            Arg::I32(log),
            Arg::n(outer),
            Arg::n(n),
            Arg::n(inner),
            Arg::t(y),
            Arg::t(&g),
            Arg::t(&dx),
        ],
    )?;
    Ok(vec![(0, dx)])
}

// ---------------------------------------------------------------- reductions

/// The reduced axes of a Reduce* node (reduce.rs `Reduce::axes`: from input 1 at
/// opset ≥ 13 for ReduceSum, ≥ 18 for the others, else the `axes` attribute).
fn reduce_axes(
    op: &str,
    inputs: &[Option<&Fact>],
    attrs: &Attrs,
    opset: i64,
    rank: usize,
) -> Result<Vec<usize>> {
    let from = if op == "ReduceSum" { 13 } else { 18 };
    let raw: Option<Vec<i64>> = if opset >= from {
        match inputs.get(1).copied().flatten() {
            None => None,
            Some(f) => Some(
                f.value
                    .as_ref()
                    .ok_or_else(|| CudaError::Kernel("the axes input must be a constant".into()))?
                    .to_ints(),
            ),
        }
    } else {
        attrs.ints("axes").map(|v| v.to_vec())
    };
    match raw {
        Some(a) if !a.is_empty() => Ok(a
            .iter()
            .map(|&x| axis(x, rank))
            .collect::<std::result::Result<_, _>>()?),
        _ if attrs.int_or("noop_with_empty_axes", 0) != 0 => Ok(Vec::new()),
        _ => Ok((0..rank).collect()),
    }
}

fn reduce_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let x = cx.input(0)?;
    let op = cx.node.op_type.as_str();
    let r = x.shape.len();
    let axes = reduce_axes(op, &cx.input_facts, cx.attrs(), cx.opset, r)?;
    let st = strides(&x.shape);
    let kept_shape: Vec<usize> = (0..r)
        .map(|i| if axes.contains(&i) { 1 } else { x.shape[i] })
        .collect();
    let keep_st: Vec<i64> = (0..r)
        .map(|i| if axes.contains(&i) { 0 } else { st[i] as i64 })
        .collect();
    let red_shape: Vec<usize> = axes.iter().map(|&i| x.shape[i]).collect();
    let red_st: Vec<i64> = axes.iter().map(|&i| st[i] as i64).collect();
    let count: usize = red_shape.iter().product();
    let (code, scale) = match op {
        "ReduceSum" => (0, 1.0),
        "ReduceMean" => (0, 1.0 / count.max(1) as f64),
        "ReduceMax" => (1, 1.0),
        _ => (2, 1.0),
    };
    let y = reduce_launch(
        dev,
        code,
        x,
        &cx.out(0)?.shape,
        Strided::new(&kept_shape, &[keep_st])?,
        count,
        Strided::new(&red_shape, &[red_st])?,
        scale,
    )?;
    Ok(vec![y])
}

fn reduce_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let f = cx.input(0)?;
    let op = cx.node.op_type.as_str();
    let r = f.shape.len();
    let axes = reduce_axes(op, &cx.inputs, cx.attrs(), cx.opset, r)?;
    let kept_shape: Vec<usize> = (0..r)
        .map(|i| if axes.contains(&i) { 1 } else { f.shape[i] })
        .collect();
    let count: usize = axes.iter().map(|&i| f.shape[i]).product();
    let g = cx.grad(dev, 0)?;
    // g viewed with the reduced axes kept (size 1), broadcast to the input.
    let d = Strided::new(
        &f.shape,
        &[bcast_strides(&kept_shape, &f.shape)
            .iter()
            .map(|&v| v as i64)
            .collect()],
    )?;
    let dx = strided_new(dev, &g, &f.shape, d)?;
    if op == "ReduceMean" {
        let n = dx.numel();
        let s = 1.0 / count.max(1) as f32;
        dev.launch(
            "scale_f32",
            n,
            &[Arg::n(n), Arg::F32(s), Arg::t(&dx), Arg::t(&dx)],
        )?;
    }
    Ok(vec![(0, dx)])
}
