//! Random ops: `RandomUniform`, `RandomNormal` (shape from an attribute),
//! `RandomUniformLike`, `RandomNormalLike` (shape of the input) and `Bernoulli`
//! (one draw per input probability).
//!
//! Exporters write these for stochastic depth (torchvision's `StochasticDepth`,
//! timm's `DropPath`): `RandomUniformLike(ConstantOfShape([B, 1, ..])) < 1 - p`,
//! cast, divided by `1 - p`, multiplied into the residual branch. PyTorch's
//! `input * noise` saves only `noise` (the operand that does not require grad is
//! the one the other's gradient reads), which the Mul rule already gives: the
//! random tensors themselves carry no gradient.
//!
//! Kernels draw from the node's SplitMix64 stream ([`KernelCx::seed`], see
//! `exec::rng`), element `i` a pure function of `(seed, i)`. A node's `seed`
//! attribute, when present, is mixed into that stream, so the same node always
//! draws the same numbers: a recomputed drop-path mask equals the first one, as
//! `torch.utils.checkpoint` makes it by restoring the RNG state.
//!
//! FLOPs: one per element drawn (uniform: a draw and a scale-and-shift counted as
//! one; normal likewise; Bernoulli: a draw and a compare counted as one).
//!
//! On the GPU backend they run on the host (`CudaKernels::HOST`): the masks they
//! make are `[batch, 1, ..]`, a few bytes, and their inputs carry no data the device
//! needs.

use super::{
    dtype_attr, no_gradient, Arity, Autocast, Backward, BackwardCx, CudaKernels, Cx, Fact,
    KernelCx, Op, Registry, RuleResult, Storage,
};
use crate::ir::DType;
use crate::numeric::{rng, Tensor};

/// Which distribution, and where the shape comes from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `RandomUniform` / `RandomUniformLike`: `low + (high - low) · U[0, 1)`.
    Uniform,
    /// `RandomNormal` / `RandomNormalLike`: `mean + scale · N(0, 1)`.
    Normal,
}

/// `RandomUniform`, `RandomNormal` (`like = false`: no input, `shape` and `dtype`
/// attributes, default float32) and `RandomUniformLike`, `RandomNormalLike`
/// (`like = true`: the input's shape, `dtype` attribute or the input's type).
/// Random numbers do not depend differentiably on anything (the `*Like` input
/// gives only a shape); host kernels: see the module documentation.
struct Random {
    kind: Kind,
    like: bool,
}

/// The float output type from a `dtype` attribute (or `default`).
fn float_dtype(cx: &Cx, default: Option<DType>) -> RuleResult<DType> {
    let dt = match cx.attrs().int("dtype") {
        Some(code) => dtype_attr(code)?,
        None => default.ok_or("dtype is required")?,
    };
    if !dt.is_float() {
        return Err(format!("dtype {dt} is not a floating-point type").into());
    }
    Ok(dt)
}

/// The node's stream: the executor's per-node seed, with the `seed` attribute
/// mixed in when the model sets one.
fn stream(cx: &KernelCx) -> u64 {
    match cx.attrs().float("seed") {
        Some(s) => rng::mix(cx.seed ^ rng::mix(s.to_bits() as u64)),
        None => cx.seed,
    }
}

impl Op for Random {
    fn arity(&self) -> Arity {
        if self.like {
            Arity::new(1, 1, 1, 1)
        } else {
            Arity::new(0, 0, 1, 1)
        }
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        if self.like {
            let x = cx.input(0)?;
            let dt = float_dtype(cx, Some(x.dtype))?;
            return Ok(vec![Fact::new(dt, x.shape.clone())]);
        }
        let shape = cx
            .attrs()
            .ints("shape")
            .ok_or("the shape attribute is required")?;
        let shape = shape
            .iter()
            .map(|&d| super::dim(d, "dimension"))
            .collect::<RuleResult<Vec<usize>>>()?;
        Ok(vec![Fact::new(float_dtype(cx, Some(DType::F32))?, shape)])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel()
    }
    no_gradient_source!();
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let f = cx.out(0)?;
        let seed = stream(cx);
        let n = f.shape.iter().product::<usize>();
        let a = cx.attrs();
        let v: Vec<f32> = match self.kind {
            Kind::Uniform => {
                let (lo, hi) = (
                    a.float("low").unwrap_or(0.0),
                    a.float("high").unwrap_or(1.0),
                );
                (0..n)
                    .map(|i| lo + (hi - lo) * rng::unit_f32(seed, i as u64))
                    .collect()
            }
            Kind::Normal => {
                let (mean, scale) = (
                    a.float("mean").unwrap_or(0.0),
                    a.float("scale").unwrap_or(1.0),
                );
                (0..n)
                    .map(|i| mean + scale * rng::normal_f32(seed, i as u64))
                    .collect()
            }
        };
        Ok(vec![Tensor::from_f32(f.dtype, f.shape.clone(), v)?])
    }
}

/// `Bernoulli(p) -> y`: `y[i] = 1` with probability `p[i]`, of the `dtype` attribute
/// or `p`'s type. PyTorch's `bernoulli` is differentiable with a zero gradient
/// (`self: zeros_like(grad)`, nothing saved): when `p` requires grad, its gradient
/// is a zero tensor of `p`'s size, which is what the rule gives.
struct Bernoulli;

impl Op for Bernoulli {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let p = cx.input(0)?;
        if !p.dtype.is_float() {
            return Err(format!("input is {}, not floating point", p.dtype).into());
        }
        let dt = match cx.attrs().int("dtype") {
            Some(code) => dtype_attr(code)?,
            None => p.dtype,
        };
        if dt == DType::String {
            return Err("dtype string is not a number type".into());
        }
        Ok(vec![Fact::new(dt, p.shape.clone())])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel()
    }
    /// A zero gradient for `p` that reads nothing.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if !out[0].dtype.is_float() {
            return Ok(None);
        }
        let _ = cx;
        Ok(Some(Backward::each(&[0], &[], 0)))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let f = cx.out(0)?;
        let p = cx.input(0)?.to_f32()?;
        let seed = stream(cx);
        if let Some(bad) = p.iter().find(|&&p| !(0.0..=1.0).contains(&p)) {
            return Err(format!("probability {bad} is outside [0, 1]").into());
        }
        let v: Vec<f64> = p
            .iter()
            .enumerate()
            .map(|(i, &p)| f64::from(u8::from(rng::unit_f32(seed, i as u64) < p)))
            .collect();
        Ok(vec![Tensor::from_f64(f.dtype, f.shape.clone(), v)?])
    }
    /// Zeros of `p`'s shape.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        if !cx.wants(0) {
            return no_gradient(cx);
        }
        let n = cx.input(0)?.shape.iter().product();
        cx.answer(vec![(0, vec![0.0; n])])
    }
    /// Host: see the module documentation.
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// Registers the random ops.
pub fn register(r: &mut Registry) {
    use Kind::*;
    r.add(
        "RandomUniform",
        Random {
            kind: Uniform,
            like: false,
        },
    );
    r.add(
        "RandomNormal",
        Random {
            kind: Normal,
            like: false,
        },
    );
    r.add(
        "RandomUniformLike",
        Random {
            kind: Uniform,
            like: true,
        },
    );
    r.add(
        "RandomNormalLike",
        Random {
            kind: Normal,
            like: true,
        },
    );
    r.add("Bernoulli", Bernoulli);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attr, Attrs, Node};

    fn node(op: &str, attrs: Vec<(&str, Attr)>, n_in: usize) -> Node {
        Node {
            name: op.into(),
            op_type: op.into(),
            domain: Default::default(),
            inputs: (0..n_in).map(Some).collect(),
            outputs: vec![Some(n_in)].into(),
            attrs: Attrs::from_iter(attrs.into_iter().map(|(k, v)| (k.to_string(), v))),
        }
    }

    fn infer(op: &str, attrs: Vec<(&str, Attr)>, inputs: &[Fact]) -> RuleResult<Vec<Fact>> {
        let n = node(op, attrs, inputs.len());
        let cx = Cx {
            node: &n,
            inputs: inputs.iter().map(Some).collect(),
            opset: 17,
        };
        super::super::registry().get("", op).unwrap().infer(&cx)
    }

    #[test]
    fn shapes_and_types() {
        let x = Fact::new(DType::F32, vec![4, 1, 1, 1]);
        let y = infer("RandomUniformLike", vec![], std::slice::from_ref(&x)).unwrap();
        assert_eq!(y[0], x);
        let h = infer(
            "RandomNormalLike",
            vec![("dtype", Attr::Int(10))],
            std::slice::from_ref(&x),
        )
        .unwrap();
        assert_eq!(h[0].dtype, DType::F16);
        let r = infer(
            "RandomUniform",
            vec![("shape", Attr::Ints(vec![2, 3]))],
            &[],
        )
        .unwrap();
        assert_eq!((r[0].dtype, r[0].shape.clone()), (DType::F32, vec![2, 3]));
        let b = infer("Bernoulli", vec![], std::slice::from_ref(&x)).unwrap();
        assert_eq!(b[0], x);
    }

    #[test]
    fn bad_input() {
        let x = Fact::new(DType::F32, vec![2]);
        assert!(infer("RandomUniform", vec![], &[])
            .unwrap_err()
            .to_string()
            .contains("shape"));
        assert!(
            infer("RandomUniform", vec![("shape", Attr::Ints(vec![-1]))], &[])
                .unwrap_err()
                .to_string()
                .contains("negative")
        );
        assert!(infer(
            "RandomUniformLike",
            vec![("dtype", Attr::Int(7))],
            std::slice::from_ref(&x)
        )
        .unwrap_err()
        .to_string()
        .contains("not a floating-point"));
        let i = Fact::new(DType::I64, vec![2]);
        assert!(infer("Bernoulli", vec![], &[i]).is_err());
    }

    fn run(
        op: &str,
        attrs: Vec<(&str, Attr)>,
        input: Option<Tensor>,
        out: Fact,
        seed: u64,
    ) -> Tensor {
        let n = node(op, attrs, usize::from(input.is_some()));
        let cx = KernelCx {
            node: &n,
            inputs: input.iter().map(Some).collect(),
            outputs: vec![Some(&out)],
            opset: 17,
            seed,
            dropout: true,
            extras: false,
        };
        super::super::registry()
            .get("", op)
            .unwrap()
            .forward_cpu(&cx)
            .unwrap()
            .remove(0)
    }

    #[test]
    fn kernels_draw_the_right_distribution() {
        let n = 20_000;
        let f = Fact::new(DType::F32, vec![n]);
        let u = run(
            "RandomUniform",
            vec![("low", Attr::Float(-2.0)), ("high", Attr::Float(6.0))],
            None,
            f.clone(),
            7,
        );
        let u = u.as_f32().unwrap().to_vec();
        assert!(u.iter().all(|&v| (-2.0..6.0).contains(&v)));
        let mean = u.iter().sum::<f32>() / n as f32;
        assert!((mean - 2.0).abs() < 0.1, "{mean}");
        let z = run(
            "RandomNormalLike",
            vec![("mean", Attr::Float(1.0)), ("scale", Attr::Float(3.0))],
            Some(Tensor::f32(vec![n], vec![0.0; n])),
            f.clone(),
            7,
        );
        let z = z.as_f32().unwrap();
        let m = z.iter().sum::<f32>() / n as f32;
        let var = z.iter().map(|v| (v - m) * (v - m)).sum::<f32>() / n as f32;
        assert!(
            (m - 1.0).abs() < 0.1 && (var.sqrt() - 3.0).abs() < 0.1,
            "{m} {var}"
        );
        // Same node, same stream: a recomputation draws the same numbers.
        let again = run(
            "RandomNormalLike",
            vec![("mean", Attr::Float(1.0)), ("scale", Attr::Float(3.0))],
            Some(Tensor::f32(vec![n], vec![0.0; n])),
            f.clone(),
            7,
        );
        assert_eq!(again.as_f32().unwrap(), z);
        let p: Vec<f32> = (0..n).map(|i| if i % 2 == 0 { 0.0 } else { 0.8 }).collect();
        let b = run("Bernoulli", vec![], Some(Tensor::f32(vec![n], p)), f, 3);
        let b = b.as_f32().unwrap();
        assert!(b.iter().step_by(2).all(|&v| v == 0.0));
        let ones = b.iter().skip(1).step_by(2).filter(|&&v| v == 1.0).count();
        assert!((ones as f64 / (n / 2) as f64 - 0.8).abs() < 0.02, "{ones}");
    }
}
