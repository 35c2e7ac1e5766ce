//! The backend a training step runs on ([`StepBackend`]): where values live and how
//! kernels run; [`Cpu`] runs the ops' CPU kernels (the device step is
//! `exec::cuda::step`).

#[allow(unused_imports)]
use super::*;

/// What the training step needs of the machine it runs on: values of type `T`,
/// the kernels, and the few pieces of step glue (casts, gradient accumulation,
/// the optimizer). [`train_step_on`] follows the plan, the schedule's storages
/// and its checks once for every backend; [`Cpu`] is the CPU executor, and
/// `exec::cuda::step::DeviceStep` (feature `cuda`) a CUDA device.
pub trait StepBackend {
    /// A value (tensor) held by the step.
    type T;
    /// Element type of `t`.
    fn dtype(t: &Self::T) -> DType;
    /// Shape of `t`.
    fn shape(t: &Self::T) -> &[usize];
    /// Element count of `t`.
    fn numel(t: &Self::T) -> usize {
        Self::shape(t).iter().product()
    }
    /// Refuses, in one line naming it, what this backend cannot run of the step
    /// (checked before anything runs).
    fn check(&self, _s: &Schedule, _opts: &StepOptions) -> Result<()> {
        Ok(())
    }
    /// Called once before the step's first allocation.
    fn begin(&self) -> Result<()> {
        Ok(())
    }
    /// Called after every plan instruction.
    fn after_instruction(&self) -> Result<()> {
        Ok(())
    }
    /// A host value held by the step (counted where the backend counts).
    fn put(&self, t: Tensor) -> Result<Self::T>;
    /// A host value the step uses transiently, in no schedule storage (a folded
    /// shape argument): not counted as a tensor of the step.
    fn put_apart(&self, t: Tensor) -> Result<Self::T> {
        self.put(t)
    }
    /// A host value the step made as a kernel makes its output, which it then
    /// stores ([`StepBackend::hold`]) or sets apart: counted where the backend
    /// counts outputs in flight until then.
    fn put_output(&self, t: Tensor) -> Result<Self::T> {
        self.put(t)
    }
    /// A host value held in a storage of `bytes` though it has more elements (the
    /// sum loss's gradient: a scalar broadcast to the output's shape, an expand
    /// view on the CPU): where the backend counts, `bytes` as the storage and
    /// the rest apart, as workspace (a view the kernels copy).
    fn put_broadcast(&self, t: Tensor, _bytes: u64) -> Result<Self::T> {
        self.put(t)
    }
    /// The host copy of `t`.
    fn get(&self, t: &Self::T) -> Result<Tensor>;
    /// `t` converted to `dt`.
    fn cast(&self, t: &Self::T, dt: DType) -> Result<Self::T>;
    /// A copy of `t` in memory of its own, allocated for `alloc` elements' shape
    /// (a [`StorageKind::Copy`] storage: larger than `t` where PyTorch copies an
    /// expanded operand), holding `t`'s values under `t`'s shape.
    fn copy(&self, t: &Self::T, alloc: &[usize]) -> Result<Self::T>;
    /// `t`'s elements under `shape` (a view: no allocation where the backend
    /// can alias).
    fn reshaped(&self, t: &Self::T, shape: Vec<usize>) -> Result<Self::T>;
    /// Another handle on `t` (same shape).
    fn dup(&self, t: &Self::T) -> Result<Self::T> {
        self.reshaped(t, Self::shape(t).to_vec())
    }
    /// Whether whole-tensor views (reshape-like ops, the identity) are made by
    /// aliasing their source instead of running their kernel.
    fn aliases_views(&self) -> bool {
        false
    }
    /// A kernel's output held in no storage of its own (a view the kernel
    /// copied): the backend stops counting it as a tensor of the step.
    fn set_apart(&self, t: Self::T) -> Self::T {
        t
    }
    /// A kernel's output the step stores in its own schedule storage (written
    /// by the step): counted from now on. A backend may count what its kernels
    /// allocate apart until then (their temporaries, outputs in flight).
    fn hold(&self, t: Self::T) -> Self::T {
        t
    }
    /// The f64 sum of `t`'s elements.
    fn sum_f64(&self, t: &Self::T) -> Result<f64>;
    /// Runs the forward kernel of `node` on `ins`.
    fn forward(
        &self,
        model: &Model,
        inf: &Inferred,
        node: &crate::ir::Node,
        ins: Vec<Option<&Self::T>>,
        opts: &StepOptions,
        extras: bool,
    ) -> Result<Vec<Self::T>>;
    /// Runs the backward kernel of `node`: one gradient per input slot (`None`
    /// where not wanted).
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        model: &Model,
        inf: &Inferred,
        node: &crate::ir::Node,
        saved: Vec<(Saved, &Self::T)>,
        grads: Vec<Option<&Self::T>>,
        wanted: Vec<usize>,
        opts: &StepOptions,
    ) -> Result<Vec<Option<Self::T>>>;
    /// `acc += d` (f32 addition, rounded to `acc`'s type).
    fn accumulate(&self, acc: &mut Self::T, d: &Self::T) -> Result<()>;
    /// `d`'s values written into `dst` (same type and element count), which keeps
    /// its memory and takes `d`'s shape: a resident `.grad` receiving its
    /// parameter's first gradient (the CPU executor's semantics: written, not
    /// added to the zeros, so a `-0.0` stays `-0.0`).
    fn write_into(&self, dst: &mut Self::T, d: Self::T) -> Result<()>;
    /// The optimizer update in place (see [`StepOptions`]); the foreach Adam
    /// temporary, `None` for the others.
    fn optimizer(
        &self,
        s: &Schedule,
        gval: &[Option<Self::T>],
        params: &mut [Option<Self::T>],
        state: Option<&mut Self::T>,
        opts: &StepOptions,
    ) -> Result<Option<Self::T>>;
    /// `log Σ exp` along the last axis (f32, accumulated in f64), as a host value:
    /// the step keeps it on the host (transient, not a tensor of the step) until the
    /// SDPA's last forward step puts it into its Extra storage.
    fn logsumexp_last(&self, x: &Self::T) -> Result<Tensor>;
    /// Live bytes of the step's tensors as the backend counts them (`None`:
    /// the schedule's [`Allocator`] is the count).
    fn live_bytes(&self) -> Option<u64> {
        None
    }
    /// Peak of [`StepBackend::live_bytes`] since [`StepBackend::begin`].
    fn peak_bytes(&self) -> Option<u64> {
        None
    }
}

/// The CPU executor: host [`Tensor`]s, the CPU kernels of src/ops; half-precision
/// values computed in f32.
#[derive(Debug, Clone, Copy, Default)]
pub struct Cpu;

impl StepBackend for Cpu {
    type T = Tensor;
    fn dtype(t: &Tensor) -> DType {
        t.dtype()
    }
    fn shape(t: &Tensor) -> &[usize] {
        &t.shape
    }
    fn put(&self, t: Tensor) -> Result<Tensor> {
        Ok(t)
    }
    fn get(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn cast(&self, t: &Tensor, dt: DType) -> Result<Tensor> {
        Ok(t.cast(dt)?)
    }
    /// Memory is the schedule's here: the value alone.
    fn copy(&self, t: &Tensor, _alloc: &[usize]) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn reshaped(&self, t: &Tensor, shape: Vec<usize>) -> Result<Tensor> {
        Ok(t.reshaped(shape)?)
    }
    fn sum_f64(&self, t: &Tensor) -> Result<f64> {
        Ok(t.to_f64s().iter().sum())
    }
    fn forward(
        &self,
        model: &Model,
        inf: &Inferred,
        node: &crate::ir::Node,
        ins: Vec<Option<&Tensor>>,
        opts: &StepOptions,
        extras: bool,
    ) -> Result<Vec<Tensor>> {
        run_kernel(model, inf, node, ins, opts, extras)
    }
    fn backward(
        &self,
        model: &Model,
        inf: &Inferred,
        node: &crate::ir::Node,
        saved: Vec<(Saved, &Tensor)>,
        grads: Vec<Option<&Tensor>>,
        wanted: Vec<usize>,
        opts: &StepOptions,
    ) -> Result<Vec<Option<Tensor>>> {
        // Half-precision values are computed in f32.
        let widen = |v: &Tensor| -> Result<Option<Tensor>> {
            if v.dtype().is_float() && v.dtype() != DType::F32 {
                Ok(v.cast(DType::F32).map(Some)?)
            } else {
                Ok(None)
            }
        };
        let wide_saved: Vec<Option<Tensor>> = saved
            .iter()
            .map(|(_, v)| widen(v))
            .collect::<std::result::Result<_, _>>()?;
        let saved: Vec<(Saved, &Tensor)> = saved
            .iter()
            .zip(&wide_saved)
            .map(|(&(sv, v), w)| (sv, w.as_ref().unwrap_or(v)))
            .collect();
        let wide_grads: Vec<Option<Tensor>> = grads
            .iter()
            .map(|g| match g {
                Some(g) => widen(g),
                None => Ok(None),
            })
            .collect::<std::result::Result<_, _>>()?;
        let grads: Vec<Option<&Tensor>> = grads
            .iter()
            .zip(&wide_grads)
            .map(|(g, w)| w.as_ref().or(*g))
            .collect();
        let (op, cx) = rule_cx(model, inf, node)?;
        let bcx = BackwardCx {
            node,
            inputs: cx.inputs.clone(),
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
        Ok(op.backward_cpu(&bcx)?)
    }
    fn accumulate(&self, acc: &mut Tensor, d: &Tensor) -> Result<()> {
        let dt = acc.dtype();
        if let crate::numeric::Elems::F32(a) = &mut acc.elems {
            for (a, b) in a.iter_mut().zip(d.as_f32()?) {
                *a += b;
            }
        } else {
            let sum: Vec<f32> = acc
                .to_f32()?
                .iter()
                .zip(d.to_f32()?.iter())
                .map(|(a, b)| a + b)
                .collect();
            *acc = Tensor::from_f32(dt, acc.shape.clone(), sum)?;
        }
        Ok(())
    }
    fn write_into(&self, dst: &mut Tensor, d: Tensor) -> Result<()> {
        if dst.dtype() != d.dtype() || dst.numel() != d.numel() {
            return Err(format!(
                "writing a {} {:?} tensor into a {} {:?} one",
                d.dtype(),
                d.shape,
                dst.dtype(),
                dst.shape
            )
            .into());
        }
        *dst = d;
        Ok(())
    }
    fn optimizer(
        &self,
        s: &Schedule,
        gval: &[Option<Tensor>],
        params: &mut [Option<Tensor>],
        state: Option<&mut Tensor>,
        opts: &StepOptions,
    ) -> Result<Option<Tensor>> {
        optimizer_step(s, gval, params, state, opts)
    }
    fn logsumexp_last(&self, x: &Tensor) -> Result<Tensor> {
        logsumexp_last(x)
    }
}
