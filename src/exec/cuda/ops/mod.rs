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

mod conv;
mod elementwise;
mod linalg;
mod norm;
mod reduce;
mod shape;

use conv::*;
use elementwise::*;
use linalg::*;
use norm::*;
use reduce::*;
use shape::*;
pub(crate) use shape::{copy_into, write_values};

use std::ops::Deref;

use super::tensor::{per_block, Arg, Strided, Win, Workspace};
use super::{CudaError, Device, DeviceTensor, Result};
use crate::ir::{Attrs, DType, Node};
use crate::numeric::broadcast::{bcast_strides, strides};
use crate::numeric::Tensor;
use crate::ops::{
    self, axis, registry, BackwardCx, CudaKernels, Cx, Fact, KernelCx, Launch, Saved,
};

/// Everything a device forward launcher sees of one node (as [`KernelCx`], with
/// device inputs and the input facts, which hold the folded constants).
pub struct DevKernelCx<'a> {
    /// The node.
    pub node: &'a Node,
    /// Input values; `None` for omitted optional inputs.
    pub inputs: Vec<Option<&'a DeviceTensor>>,
    /// Input facts (dtype, shape, folded value).
    pub input_facts: crate::ops::CxInputs<'a>,
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
    pub inputs: crate::ops::CxInputs<'a>,
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

/// The kernels and launcher the op's rule names ([`ops::Op::cuda_kernels`]).
fn kernels_of(node: &Node) -> Result<CudaKernels> {
    let rule = registry()
        .get(&node.domain, &node.op_type)
        .ok_or_else(|| CudaError::Kernel(format!("unsupported op {}", node.op_type)))?;
    Ok(rule.cuda_kernels(&node.op_type))
}

/// Whether a Conv's or pool's input is `[N, C, L]` or `[N, C, H, W]`: the
/// device's window kernels are planar (kernels/common.cuh `Win`), so 3-D
/// convolutions and pools run on the host.
fn planar(input_facts: &[Option<&Fact>]) -> bool {
    input_facts
        .first()
        .copied()
        .flatten()
        .is_some_and(|f| f.shape.len() <= 4)
}

/// Where [`forward`] runs a node with these input facts: on the device when the
/// op's launcher ([`Launch`]) handles these dtypes (and attributes), else on the host.
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
    let movable = || dt(0).is_some_and(|d| super::tensor::elem_size(d).is_ok());
    let device = match kernels_of(node)?.launch {
        Launch::Host => false,
        // The parameters are checked here, so that a bad attribute fails in one line.
        Launch::Unary => unary_code(op, &node.attrs)?.is_some() && f32_in(0),
        Launch::Binary | Launch::Compare | Launch::MatMul | Launch::Gemm => f32_in(0) && f32_in(1),
        Launch::Where => f32_in(1) && f32_in(2) && dt(0) == Some(DType::Bool),
        Launch::Clip
        | Launch::Dropout
        | Launch::GlobalAveragePool
        | Launch::LayerNorm
        | Launch::Softmax
        | Launch::Reduce => f32_in(0),
        Launch::Pool => f32_in(0) && planar(input_facts),
        Launch::Conv => f32_in(0) && f32_in(1) && planar(input_facts),
        Launch::BatchNorm => {
            let training = extras
                || if opset >= 14 {
                    node.attrs.int_or("training_mode", 0) != 0
                } else {
                    n_outputs > 1
                };
            f32_in(0) && training
        }
        Launch::Reshape | Launch::Transpose | Launch::Expand | Launch::Concat | Launch::Split => {
            movable()
        }
        Launch::Gather => f32_in(0) && dt(1) == Some(DType::I64),
        Launch::Slice => movable() && slice_block(input_facts, opset).is_some(),
        Launch::GatherElements => movable() && dt(1) == Some(DType::I64),
        Launch::Cast => {
            let to = node.attrs.int("to").and_then(|c| ops::dtype_attr(c).ok());
            let to = if op == "CastLike" { dt(1) } else { to };
            dt(0).is_some_and(cast_code_ok) && to.is_some_and(cast_code_ok)
        }
    };
    Ok(if device { Path::Device } else { Path::Host })
}

/// The forward of one node on the device: one tensor per declared output (omitted
/// ones included), then the extras when `cx.extras`, as [`crate::ops::Op::forward_cpu`].
/// [`forward_path`] decides between the device launchers and the host.
pub fn forward(dev: &Device, cx: &DevKernelCx) -> Result<(Vec<DeviceTensor>, Path)> {
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
    let outs = match kernels_of(cx.node)?.launch {
        Launch::Host => unreachable!("forward_path sends host ops to the host"),
        Launch::Unary => unary_fwd(dev, cx)?,
        Launch::Binary => binary_fwd(dev, cx)?,
        Launch::Compare => compare_fwd(dev, cx)?,
        Launch::Where => where_fwd(dev, cx)?,
        Launch::Clip => clip_fwd(dev, cx)?,
        Launch::Dropout => dropout_fwd(dev, cx)?,
        Launch::MatMul => matmul_fwd(dev, cx)?,
        Launch::Gemm => gemm_fwd(dev, cx)?,
        Launch::Conv => conv_fwd(dev, cx)?,
        Launch::Pool => pool_fwd(dev, cx)?,
        Launch::GlobalAveragePool => gap_fwd(dev, cx)?,
        Launch::BatchNorm => bn_fwd(dev, cx)?,
        Launch::LayerNorm => ln_fwd(dev, cx)?,
        Launch::Softmax => softmax_fwd(dev, cx)?,
        Launch::Reduce => reduce_fwd(dev, cx)?,
        Launch::Reshape => vec![copy_as(dev, cx.input(0)?, &cx.out(0)?.shape)?],
        Launch::Transpose => transpose_fwd(dev, cx)?,
        Launch::Expand => {
            let x = cx.input(0)?;
            let out = &cx.out(0)?.shape;
            let d = Strided::broadcast(out, &[&x.shape])?;
            vec![strided_new(dev, x, out, d)?]
        }
        Launch::Concat => concat_fwd(dev, cx)?,
        Launch::Split => split_fwd(dev, cx)?,
        Launch::Slice => {
            let x = cx.input(0)?;
            let (ax, off) = slice_block(&cx.input_facts, cx.opset)
                .ok_or_else(|| CudaError::Kernel("Slice is not one block".into()))?;
            let part = dev.zeros(x.dtype(), &cx.out(0)?.shape)?;
            block_copy(dev, x, &part, ax, off, false)?;
            vec![part]
        }
        Launch::Gather => gather_fwd(dev, cx)?,
        Launch::GatherElements => gather_elements_fwd(dev, cx)?,
        Launch::Cast => {
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
    };
    Ok((outs, Path::Device))
}

/// Where [`backward`] runs a node with these input facts: on the device when the
/// op's launcher has backward kernels for these dtypes, else on the host.
pub fn backward_path(node: &Node, input_facts: &[Option<&Fact>]) -> Path {
    let dt = |i: usize| input_facts.get(i).copied().flatten().map(|f| f.dtype);
    let f32_in = |i: usize| dt(i) == Some(DType::F32);
    let Ok(k) = kernels_of(node) else {
        return Path::Host;
    };
    let device = !k.backward.is_empty()
        && match k.launch {
            Launch::Host | Launch::Compare => false,
            Launch::Unary => {
                unary_code(&node.op_type, &node.attrs).ok().flatten().is_some() && f32_in(0)
            }
            Launch::Binary | Launch::MatMul | Launch::Gemm => f32_in(0) && f32_in(1),
            Launch::Conv => f32_in(0) && f32_in(1) && planar(input_facts),
            Launch::Pool => f32_in(0) && planar(input_facts),
            Launch::Where => f32_in(1) && f32_in(2) && dt(0) == Some(DType::Bool),
            Launch::Clip
            | Launch::Dropout
            | Launch::GlobalAveragePool
            | Launch::BatchNorm
            | Launch::LayerNorm
            | Launch::Softmax
            | Launch::Reduce
            | Launch::Reshape
            | Launch::Transpose
            | Launch::Expand
            | Launch::Split
            | Launch::Gather
            // A float32 gradient copied back (the only float type on the device).
            | Launch::Cast => f32_in(0),
            Launch::Slice => f32_in(0) && slice_block(input_facts, 13).is_some(),
            Launch::Concat => true,
            // Its backward is a scatter the device has no kernel for.
            Launch::GatherElements => false,
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
    if backward_path(cx.node, &cx.inputs) == Path::Host {
        return Ok((host_backward(dev, cx)?, Path::Host));
    }
    let mut res: Vec<(usize, DeviceTensor)> = match kernels_of(cx.node)?.launch {
        Launch::Host | Launch::Compare | Launch::GatherElements => {
            unreachable!("backward_path sends these to the host")
        }
        Launch::Unary => unary_bwd(dev, cx)?,
        Launch::Binary => binary_bwd(dev, cx)?,
        Launch::Where => where_bwd(dev, cx)?,
        Launch::Clip => clip_bwd(dev, cx)?,
        Launch::Dropout => dropout_bwd(dev, cx)?,
        Launch::MatMul => matmul_bwd(dev, cx)?,
        Launch::Gemm => gemm_bwd(dev, cx)?,
        Launch::Conv => conv_bwd(dev, cx)?,
        Launch::Pool => pool_bwd(dev, cx)?,
        Launch::GlobalAveragePool => {
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
        Launch::BatchNorm => bn_bwd(dev, cx)?,
        Launch::LayerNorm => ln_bwd(dev, cx)?,
        Launch::Softmax => softmax_bwd(dev, cx)?,
        Launch::Reduce => reduce_bwd(dev, cx)?,
        Launch::Reshape => {
            let g = cx.grad(dev, 0)?;
            vec![(0, copy_as(dev, &g, &cx.input(0)?.shape)?)]
        }
        Launch::Transpose => transpose_bwd(dev, cx)?,
        Launch::Expand => {
            let g = cx.grad(dev, 0)?;
            vec![(0, sum_to(dev, &g, &cx.input(0)?.shape, 1.0)?)]
        }
        Launch::Concat => concat_bwd(dev, cx)?,
        Launch::Split => split_bwd(dev, cx)?,
        Launch::Slice => {
            let f = cx.input(0)?;
            let (ax, off) = slice_block(&cx.inputs, 13)
                .ok_or_else(|| CudaError::Kernel("Slice is not one block".into()))?;
            let g = cx.grad(dev, 0)?;
            let dx = dev.zeros(DType::F32, &f.shape)?;
            block_copy(dev, &dx, &g, ax, off, true)?;
            vec![(0, dx)]
        }
        Launch::Gather => gather_bwd(dev, cx)?,
        Launch::Cast => {
            let g = cx.grad(dev, 0)?;
            g.expect_f32("Cast's incoming gradient")?;
            vec![(0, copy_as(dev, &g, &cx.input(0)?.shape)?)]
        }
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
        // A new list: `SmallVec` is invariant in its lifetime, so the clone's would
        // have to outlive `saved` and `grads` below.
        inputs: cx.inputs.iter().copied().collect(),
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
