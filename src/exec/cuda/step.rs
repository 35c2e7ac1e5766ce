//! The training step on a [`Device`]: [`DeviceStep`] is the
//! [`StepBackend`] that `exec::train::train_step_on` drives over a plan, so the
//! device follows the same schedule, storages and checks as the CPU executor.
//!
//! Every value the step holds is a [`DeviceTensor`] counted by the device's
//! [`super::MemCounter`] from allocation to drop, and each lives exactly as long
//! as its schedule storage: a whole-tensor view (reshape, flatten, squeeze,
//! unsqueeze, identity) is an alias of its source ([`DeviceTensor::alias`],
//! counting nothing) instead of the launcher's copy, on the forward and for its
//! gradient; a view the kernels must copy (a strided view, a Split, an inner
//! Slice) is counted apart, as workspace ([`DeviceTensor::set_apart`]). So the
//! counted tensor peak equals `remat::graph::replay`'s peak of the same plan.
//!
//! Half-precision policies: float16/bfloat16 values are held in their storage's
//! type and computed in f32, as on the CPU: a kernel's half inputs (and a
//! backward kernel's saved tensors and gradients) are widened to f32 launch
//! temporaries before the f32 launcher, and its outputs rounded into their
//! storages' type ([`StepBackend::cast`], kernels/half.cu, bitwise the CPU's
//! rounding); half partial gradients are added in f32 and rounded
//! (`accumulate_half`), a pure-bf16 SGD step updates in f32 and rounds back
//! (`sgd_half`).
//!
//! The sum loss's gradient, a broadcast scalar (an uncounted expand view on the
//! CPU), is materialised: its scalar storage's bytes counted as the tensor, the
//! rest apart, as workspace ([`DeviceTensor::count_as`]).
//!
//! Device glue: gradient accumulation (`accumulate_f32`), SGD (`sgd_f32`); the
//! other optimizers (momentum, Adam, AdamW, weight decay) run on the host from
//! downloaded gradients and write the parameters and state back into their device
//! tensors (their storages never move); the loss is summed on the host from the
//! downloaded output (a scalar).
//!
//! Fused patterns (exact GELU, SiLU, SDPA) run op by op as on the CPU: each node on its
//! device kernel; the SDPA logsumexp, which has no device kernel, from the
//! downloaded scores by the CPU's code, kept on the host (a transient host value,
//! not device memory) until the pattern's last forward step uploads it into its
//! Extra storage, so the device counts exactly the schedule's bytes. The inner
//! values recomputed at the pattern's first backward step come from the device
//! kernels and are never held in a schedule storage: launch temporaries, outside
//! the tensor count (inside the fused kernel on the CPU's accounting too).
//!
//! Resident gradients (`grads_resident`): each parameter's persistent `.grad` is a
//! zeroed device tensor from before the first instruction (the schedule counts it
//! from the start), its first gradient copied into it on the device
//! ([`StepBackend::write_into`], written as the CPU writes it), later ones added
//! in place (`accumulate_f32` / `accumulate_half`); the storage never moves.

use std::cell::Cell;

use super::ops::{backward as node_backward, forward as node_forward};
use super::ops::{DevBackwardCx, DevKernelCx};
use super::tensor::Arg;
use super::{Device, DeviceTensor, MemoryReport};
use crate::exec::train::{logsumexp_last, optimizer_step, StepBackend, StepOptions};
use crate::infer::Inferred;
use crate::ir::{DType, Model, Node};
use crate::numeric::{rng, Tensor};
use crate::ops::Saved;
use crate::train::{Optimizer, Schedule};

/// A training step's backend on a [`Device`]; its counts start at
/// [`StepBackend::begin`].
pub struct DeviceStep<'a> {
    dev: &'a Device,
    base: Cell<u64>,
    driver: Cell<bool>,
}

impl<'a> DeviceStep<'a> {
    /// The backend on `dev`.
    pub fn new(dev: &'a Device) -> DeviceStep<'a> {
        DeviceStep {
            dev,
            base: Cell::new(0),
            driver: Cell::new(false),
        }
    }

    /// The device.
    pub fn device(&self) -> &Device {
        self.dev
    }

    /// The device's memory counts now (tensors, workspace apart).
    pub fn memory(&self) -> MemoryReport {
        self.dev.memory()
    }

    /// `cuMemGetInfo`'s largest drop in free bytes during the step (GPU only;
    /// sampled after every plan instruction).
    pub fn mem_get_info_peak_delta_bytes(&self) -> Option<u64> {
        self.dev
            .counter()
            .driver_check()
            .map(|c| c.mem_get_info_peak_delta_bytes)
    }
}

/// The launch bucket on while a launcher runs (as it was again on drop, errors
/// too).
struct Launching<'a>(&'a Device, bool);

impl<'a> Launching<'a> {
    fn new(dev: &'a Device) -> Launching<'a> {
        let was = dev.counter().launching();
        dev.counter().set_launching(true);
        Launching(dev, was)
    }
}

impl Drop for Launching<'_> {
    fn drop(&mut self) {
        self.0.counter().set_launching(self.1);
    }
}

/// Float16/bfloat16 tensors among `ts` widened to f32 launch temporaries (the
/// CPU computes every kernel in f32 from widened inputs); `None` for the others.
fn widen_all(
    dev: &Device,
    ts: &[Option<&DeviceTensor>],
) -> Result<Vec<Option<DeviceTensor>>, String> {
    ts.iter()
        .map(|t| match t {
            Some(t) => dev.widened(t).map_err(e),
            None => Ok(None),
        })
        .collect()
}

fn e<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

impl StepBackend for DeviceStep<'_> {
    type T = DeviceTensor;

    fn dtype(t: &DeviceTensor) -> DType {
        t.dtype()
    }

    fn shape(t: &DeviceTensor) -> &[usize] {
        &t.shape
    }

    fn begin(&self) -> crate::Result<()> {
        self.dev.preload().map_err(e)?;
        self.dev.synchronize().map_err(e)?;
        let c = self.dev.counter();
        c.reset_peak();
        self.base.set(c.report().live_bytes);
        if let Ok((free, _)) = self.dev.mem_get_info() {
            c.mark(free as u64);
            self.driver.set(true);
        }
        Ok(())
    }

    fn after_instruction(&self) -> crate::Result<()> {
        if self.driver.get() {
            self.dev.synchronize().map_err(e)?;
            let (free, _) = self.dev.mem_get_info().map_err(e)?;
            self.dev.counter().sample(free as u64);
        }
        Ok(())
    }

    fn put(&self, t: Tensor) -> crate::Result<DeviceTensor> {
        Ok(self.dev.upload(&t).map_err(e)?)
    }

    fn put_apart(&self, t: Tensor) -> crate::Result<DeviceTensor> {
        let mut d = self.dev.upload(&t).map_err(e)?;
        d.set_apart();
        Ok(d)
    }

    /// Made in the launch bucket, as a kernel's output: the executor then holds
    /// it in its storage or sets it apart.
    fn put_output(&self, t: Tensor) -> crate::Result<DeviceTensor> {
        let _launching = Launching::new(self.dev);
        Ok(self.dev.upload(&t).map_err(e)?)
    }

    /// Materialised on the device (the sum loss's gradient: ones of the output's
    /// shape); `bytes` counted as its storage, the rest as workspace, as a view
    /// the kernels copy.
    fn put_broadcast(&self, t: Tensor, bytes: u64) -> crate::Result<DeviceTensor> {
        let mut d = self.dev.upload(&t).map_err(e)?;
        d.count_as(bytes);
        Ok(d)
    }

    fn get(&self, t: &DeviceTensor) -> crate::Result<Tensor> {
        Ok(self.dev.download(t).map_err(e)?)
    }

    /// Float32, float16 and bfloat16 converted on the device (kernels/half.cu,
    /// bitwise the CPU's rounding), in the launch bucket: the executor holds the
    /// result in its storage (a kernel's output rounded to its storage's type, an
    /// autocast copy, a gradient in its storage's type) or sets it apart.
    fn cast(&self, t: &DeviceTensor, dt: DType) -> crate::Result<DeviceTensor> {
        if t.dtype() == dt {
            return self.dup(t);
        }
        let _launching = Launching::new(self.dev);
        Ok(self.dev.convert(t, dt).map_err(e)?)
    }

    /// Made in the launch bucket: the executor then holds it at its counted size.
    fn copy(&self, t: &DeviceTensor, alloc: &[usize]) -> crate::Result<DeviceTensor> {
        let _launching = Launching::new(self.dev);
        Ok(super::ops::copy_into(self.dev, t, alloc).map_err(e)?)
    }

    fn reshaped(&self, t: &DeviceTensor, shape: Vec<usize>) -> crate::Result<DeviceTensor> {
        Ok(t.alias(shape).map_err(e)?)
    }

    fn aliases_views(&self) -> bool {
        true
    }

    fn set_apart(&self, mut t: DeviceTensor) -> DeviceTensor {
        t.set_apart();
        t
    }

    fn hold(&self, mut t: DeviceTensor) -> DeviceTensor {
        t.hold();
        t
    }

    fn sum_f64(&self, t: &DeviceTensor) -> crate::Result<f64> {
        Ok(self.get(t)?.to_f64s().iter().sum())
    }

    fn forward(
        &self,
        model: &Model,
        inf: &Inferred,
        node: &Node,
        ins: Vec<Option<&DeviceTensor>>,
        opts: &StepOptions,
        extras: bool,
    ) -> crate::Result<Vec<DeviceTensor>> {
        let _l = Launching::new(self.dev);
        // Half-precision values computed in f32: widened inputs.
        let wide = widen_all(self.dev, &ins)?;
        let ins = ins
            .iter()
            .zip(&wide)
            .map(|(v, w)| w.as_ref().or(*v))
            .collect();
        let cx = DevKernelCx {
            node,
            inputs: ins,
            input_facts: node
                .inputs
                .iter()
                .map(|t| t.map(|t| &inf.facts[t]))
                .collect(),
            outputs: node
                .outputs
                .iter()
                .map(|t| t.map(|t| &inf.facts[t]))
                .collect(),
            opset: model.opset(),
            seed: rng::name_seed(opts.seed, &node.name),
            dropout: opts.dropout,
            extras,
        };
        Ok(node_forward(self.dev, &cx).map_err(e)?.0)
    }

    fn backward(
        &self,
        model: &Model,
        inf: &Inferred,
        node: &Node,
        saved: Vec<(Saved, &DeviceTensor)>,
        grads: Vec<Option<&DeviceTensor>>,
        wanted: Vec<usize>,
        opts: &StepOptions,
    ) -> crate::Result<Vec<Option<DeviceTensor>>> {
        let _l = Launching::new(self.dev);
        // Half-precision saved tensors and gradients computed in f32: widened.
        let wide_saved = widen_all(
            self.dev,
            &saved.iter().map(|(_, v)| Some(*v)).collect::<Vec<_>>(),
        )?;
        let saved = saved
            .iter()
            .zip(&wide_saved)
            .map(|(&(sv, v), w)| (sv, w.as_ref().unwrap_or(v)))
            .collect();
        let wide_grads = widen_all(self.dev, &grads)?;
        let grads = grads
            .iter()
            .zip(&wide_grads)
            .map(|(g, w)| w.as_ref().or(*g))
            .collect();
        let cx = DevBackwardCx {
            node,
            inputs: node
                .inputs
                .iter()
                .map(|t| t.map(|t| &inf.facts[t]))
                .collect(),
            outputs: node
                .outputs
                .iter()
                .map(|t| t.map(|t| &inf.facts[t]))
                .collect(),
            opset: model.opset(),
            saved,
            grads,
            wanted,
            dropout: opts.dropout,
        };
        Ok(node_backward(self.dev, &cx).map_err(e)?.0)
    }

    fn accumulate(&self, acc: &mut DeviceTensor, d: &DeviceTensor) -> crate::Result<()> {
        if acc.dtype() != DType::F32 {
            // A half-precision gradient: added in f32, rounded back.
            return Ok(self.dev.accumulate_half(acc, d).map_err(e)?);
        }
        acc.expect_f32("an accumulated gradient").map_err(e)?;
        d.expect_f32("a partial gradient").map_err(e)?;
        if acc.numel() != d.numel() {
            return Err("a partial gradient does not match its gradient".into());
        }
        let n = acc.numel();
        Ok(self
            .dev
            .launch("accumulate_f32", n, &[Arg::n(n), Arg::t(d), Arg::t(acc)])
            .map_err(e)?)
    }

    /// A device-to-device copy into `dst`'s memory (a resident `.grad`, counted
    /// since before the first instruction); `d`, a launch temporary or a tensor
    /// held nowhere else, is then dropped.
    fn write_into(&self, dst: &mut DeviceTensor, d: DeviceTensor) -> crate::Result<()> {
        super::ops::write_values(self.dev, dst, &d).map_err(e)?;
        dst.shape = d.shape.clone();
        Ok(())
    }

    fn optimizer(
        &self,
        s: &Schedule,
        gval: &[Option<DeviceTensor>],
        params: &mut [Option<DeviceTensor>],
        state: Option<&mut DeviceTensor>,
        opts: &StepOptions,
    ) -> crate::Result<Option<DeviceTensor>> {
        let wd = opts.weight_decay.unwrap_or(0.0);
        // Plain SGD where each parameter and its gradient have one type.
        let sgd_here = opts.optimizer == Optimizer::Sgd
            && wd == 0.0
            && s.with_grad.iter().all(|&t| {
                matches!(
                    (&gval[t], &params[t]),
                    (Some(g), Some(p)) if g.dtype() == p.dtype() && p.dtype().is_float()
                )
            });
        if sgd_here {
            // On the device: p -= lr·g, the CPU's f32 formula (a bf16 parameter
            // updated in f32 and rounded back).
            for &t in &s.with_grad {
                let g = gval[t].as_ref().ok_or("a parameter has no gradient")?;
                let p = params[t].as_ref().ok_or("a parameter has no value")?;
                if g.numel() != p.numel() {
                    return Err("a gradient does not match its parameter".into());
                }
                if p.dtype() != DType::F32 {
                    self.dev.sgd_half(p, g, opts.lr).map_err(e)?;
                    continue;
                }
                let n = p.numel();
                self.dev
                    .launch(
                        "sgd_f32",
                        n,
                        &[Arg::n(n), Arg::F32(opts.lr), Arg::t(g), Arg::t(p)],
                    )
                    .map_err(e)?;
            }
            return Ok(None);
        }
        // On the host: the CPU's update from downloaded values, written back in
        // place (each parameter and the state keep their device storage).
        let n_t = params.len();
        let mut hg: Vec<Option<Tensor>> = vec![None; n_t];
        let mut hp: Vec<Option<Tensor>> = vec![None; n_t];
        for &t in &s.with_grad {
            hg[t] = gval[t].as_ref().map(|v| self.get(v)).transpose()?;
            hp[t] = params[t].as_ref().map(|v| self.get(v)).transpose()?;
        }
        let mut hs = state.as_ref().map(|v| self.get(v)).transpose()?;
        let temp = optimizer_step(s, &hg, &mut hp, hs.as_mut(), opts)?;
        for &t in &s.with_grad {
            if let (Some(d), Some(h)) = (params[t].as_mut(), hp[t].as_ref()) {
                self.dev.write(d, h).map_err(e)?;
            }
        }
        if let (Some(d), Some(h)) = (state, hs.as_ref()) {
            self.dev.write(d, h).map_err(e)?;
        }
        temp.map(|t| self.put(t)).transpose()
    }

    fn logsumexp_last(&self, x: &DeviceTensor) -> crate::Result<Tensor> {
        // No device kernel: the scores downloaded, the CPU's logsumexp, kept on the
        // host until the attention's last forward step uploads it into its Extra.
        logsumexp_last(&self.get(x)?)
    }

    fn live_bytes(&self) -> Option<u64> {
        Some(
            self.dev
                .counter()
                .report()
                .live_bytes
                .saturating_sub(self.base.get()),
        )
    }

    fn peak_bytes(&self) -> Option<u64> {
        Some(
            self.dev
                .counter()
                .report()
                .peak_bytes
                .saturating_sub(self.base.get()),
        )
    }
}
