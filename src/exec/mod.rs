//! The CPU executor: runs memplan's IR forward, node by node in execution order,
//! with each op's CPU kernel ([`crate::ops::Op::forward_cpu`], written beside the
//! op's shape rule, FLOPs and backward rule in `src/ops/`).
//!
//! Values are [`Tensor`]s (contiguous, row-major, typed). Parameters come from the
//! initializers' data; shape-only initializers (the large models in `models/` ship
//! without weights) get deterministic seeded random values, see
//! [`random_parameter`]. Every kernel output is checked against the dtype and shape
//! that inference gave it (and against the folded value of small integer tensors),
//! so a kernel and its shape rule can never silently disagree.
//!
//! [`Executor::forward`] frees every value after its last reader, as the inference
//! profile assumes; [`Executor::forward_all`] keeps every value (tests).
//!
//! Values and the kernel machinery ops and executors share live in
//! [`crate::numeric`] (a leaf module: `ops` and `exec` both use it, it uses neither).

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod cuda_src;
pub mod train;
pub mod verify;

pub use crate::numeric::{rng, Elems, Tensor};

use crate::error::{Error, Result};
use crate::infer::Inferred;
use crate::ir::{DType, Model, Payload, TensorId};
use crate::ops::{registry, Fact, KernelCx, RuleError, RuleResult};

/// Options of a forward run.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Seed of every random stream: shape-only parameters and Dropout masks.
    pub seed: u64,
    /// Whether training-mode Dropout drops (with a mask seeded by the node name);
    /// `false` makes every Dropout the identity.
    pub dropout: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            seed: 0,
            dropout: true,
        }
    }
}

/// A model ready to run: its parameters materialized once, reused by every run.
pub struct Executor<'m> {
    model: &'m Model,
    inferred: &'m Inferred,
    /// Initializer values by tensor id (`None` for every other tensor).
    params: Vec<Option<Tensor>>,
    opts: Options,
}

/// Seeded parameter for a shape-only initializer named `name`.
///
/// Distribution (each tensor its own SplitMix64 stream, seeded by `seed` and the
/// name, so values do not depend on graph order):
/// - floating point, rank ≥ 2 (weights): uniform in `[-b, b)`, `b = 1/√fan_in`,
///   `fan_in = dims[1] · dims[2] · …` (PyTorch's default init of Linear and Conv
///   weights, `kaiming_uniform_(a=√5)`);
/// - floating point, rank ≤ 1 (biases, norm scales and shifts, running statistics):
///   uniform in `[0.5, 1.5)`, positive so that it is valid as a variance or scale.
///
/// Integer initializers hold indices or shapes, which random numbers would make
/// meaningless: without data they are an error.
pub fn random_parameter(name: &str, dtype: DType, dims: &[usize], seed: u64) -> RuleResult<Tensor> {
    use rayon::prelude::*;
    if !dtype.is_float() {
        return Err(format!(
            "{dtype} initializer without data: only floating-point parameters can be made up"
        )
        .into());
    }
    let n: usize = dims.iter().product();
    let s = rng::name_seed(seed, name);
    let (lo, hi) = if dims.len() >= 2 {
        let fan_in: usize = dims[1..].iter().product();
        let b = 1.0 / (fan_in.max(1) as f32).sqrt();
        (-b, b)
    } else {
        (0.5, 1.5)
    };
    let v: Vec<f32> = (0..n as u64)
        .into_par_iter()
        .map(|i| lo + (hi - lo) * rng::unit_f32(s, i))
        .collect();
    Tensor::from_f32(dtype, dims.to_vec(), v)
}

/// A seeded random value for a graph input of the given fact: floats standard
/// normal, integers uniform in `[0, int_high)` (token ids), bools fair coins.
pub fn random_input(fact: &Fact, seed: u64, int_high: i64) -> RuleResult<Tensor> {
    let n: usize = fact.shape.iter().product();
    let shape = fact.shape.clone();
    if fact.dtype.is_float() {
        Ok(Tensor::from_f32(
            fact.dtype,
            shape,
            (0..n as u64).map(|i| rng::normal_f32(seed, i)).collect(),
        )?)
    } else {
        let high = int_high.max(1) as u64;
        Ok(Tensor::from_i64(
            fact.dtype,
            shape,
            (0..n as u64)
                .map(|i| (rng::at(seed, i) % high) as i64)
                .collect(),
        )?)
    }
}

impl<'m> Executor<'m> {
    /// Materializes the parameters of `model` (inferred as `inferred`).
    pub fn new(model: &'m Model, inferred: &'m Inferred, opts: Options) -> Result<Executor<'m>> {
        let g = &model.graph;
        let mut params = Vec::with_capacity(g.tensors.len());
        for info in &g.tensors {
            let Some(init) = &info.init else {
                params.push(None);
                continue;
            };
            let t = match init.payload {
                Payload::ShapeOnly => {
                    random_parameter(&info.name, init.dtype, &init.dims, opts.seed)
                }
                _ => Tensor::from_data(init),
            }
            .map_err(|e| Error::Graph(format!("initializer '{}': {e}", info.name)))?;
            params.push(Some(t));
        }
        Ok(Executor {
            model,
            inferred,
            params,
            opts,
        })
    }

    /// Initializer values by tensor id.
    pub fn params(&self) -> &[Option<Tensor>] {
        &self.params
    }

    /// Runs the graph on `inputs` (one per graph input, in declaration order) and
    /// returns the graph outputs in declaration order. Values are freed after their
    /// last reader.
    pub fn forward(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let mut values = self.run(inputs, false)?;
        Ok(self
            .model
            .graph
            .outputs
            .iter()
            .map(|&t| self.value(&mut values, t))
            .collect())
    }

    /// Runs the graph and returns every tensor's value by tensor id (graph inputs,
    /// initializers and every node output).
    pub fn forward_all(&self, inputs: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let mut values = self.run(inputs, true)?;
        for (t, p) in self.params.iter().enumerate() {
            if let Some(p) = p {
                values[t] = Some(p.clone());
            }
        }
        Ok(values)
    }

    fn value(&self, values: &mut [Option<Tensor>], t: TensorId) -> Tensor {
        values[t]
            .take()
            .or_else(|| self.params[t].clone())
            .expect("graph outputs are computed")
    }

    fn run(&self, inputs: &[Tensor], keep_all: bool) -> Result<Vec<Option<Tensor>>> {
        let g = &self.model.graph;
        let facts = &self.inferred.facts;
        if inputs.len() != g.inputs.len() {
            return Err(Error::Binding(format!(
                "the model has {} inputs, {} were given",
                g.inputs.len(),
                inputs.len()
            )));
        }
        let mut values: Vec<Option<Tensor>> = vec![None; g.tensors.len()];
        for (&t, x) in g.inputs.iter().zip(inputs) {
            let f = &facts[t];
            if x.dtype() != f.dtype || x.shape != f.shape {
                return Err(Error::Binding(format!(
                    "input '{}' is {} {:?}, the model was inferred with {} {:?}",
                    g.tensor(t).name,
                    x.dtype(),
                    x.shape,
                    f.dtype,
                    f.shape
                )));
            }
            values[t] = Some(x.clone());
        }
        // Last step reading each tensor; graph outputs live to the end.
        let mut last: Vec<Option<usize>> =
            g.uses_by_step().iter().map(|u| u.last().copied()).collect();
        for &t in &g.outputs {
            last[t] = Some(usize::MAX);
        }
        let reg = registry();
        let opset = self.model.opset();
        for (step, &ix) in g.order.iter().enumerate() {
            let node = g.node(ix);
            let err = |reason: String| Error::node(&node.name, &node.op_type, reason);
            let rule_err = |e: RuleError| Error::rule(&node.name, &node.op_type, e);
            let op = reg
                .get(&node.domain, &node.op_type)
                .ok_or_else(|| err("unsupported op".into()))?;
            let outs = {
                let ins = node
                    .inputs
                    .iter()
                    .map(|t| t.and_then(|t| self.params[t].as_ref().or(values[t].as_ref())))
                    .collect();
                let cx = KernelCx {
                    node,
                    inputs: ins,
                    outputs: node.outputs.iter().map(|t| t.map(|t| &facts[t])).collect(),
                    opset,
                    seed: rng::name_seed(self.opts.seed, &node.name),
                    dropout: self.opts.dropout,
                    extras: false,
                };
                if let Some(i) = node
                    .inputs
                    .iter()
                    .zip(&cx.inputs)
                    .position(|(t, v)| t.is_some() && v.is_none())
                {
                    return Err(err(format!("input {i} has no value (freed too early?)")));
                }
                op.forward_cpu(&cx).map_err(rule_err)?
            };
            if outs.len() < node.outputs.len() {
                return Err(err(format!(
                    "the kernel gave {} outputs for {} declared",
                    outs.len(),
                    node.outputs.len()
                )));
            }
            for (slot, (t, v)) in node.outputs.iter().zip(outs).enumerate() {
                let Some(t) = *t else { continue };
                check_output(&v, &facts[t])
                    .map_err(|e| err(format!("output {slot} '{}': {e}", g.tensor(t).name)))?;
                if keep_all || last[t].is_some() {
                    values[t] = Some(v);
                }
            }
            if !keep_all {
                for t in node.inputs.iter().flatten() {
                    if last[*t] == Some(step) {
                        values[*t] = None;
                    }
                }
            }
        }
        Ok(values)
    }
}

/// A kernel's output against its inferred fact: same dtype and shape, and the same
/// elements as a folded integer value.
fn check_output(v: &Tensor, f: &Fact) -> std::result::Result<(), String> {
    if v.dtype() != f.dtype || v.shape != f.shape {
        return Err(format!(
            "the kernel produced {} {:?}, inference says {} {:?}",
            v.dtype(),
            v.shape,
            f.dtype,
            f.shape
        ));
    }
    if let Some(val) = &f.value {
        if !f.dtype.is_float() && v.to_i64s() != val.to_ints() {
            return Err("the kernel's values differ from the folded constant".into());
        }
    }
    Ok(())
}

/// Runs `model` once on `inputs` with default options (seed 0, dropout as the graph
/// says) and returns the graph outputs.
pub fn forward(model: &Model, inferred: &Inferred, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
    Executor::new(model, inferred, Options::default())?.forward(inputs)
}
