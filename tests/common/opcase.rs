//! One op application checked against finite differences (`check`), and the
//! seeded test data it runs on; shared by tests/exec_backward.rs (the op-by-op
//! sweeps) and tests/op_registry.rs (one row per registered op). The method is
//! described in tests/exec_backward.rs.
#![allow(dead_code, clippy::needless_range_loop)]

use memplan::exec::Tensor;
use memplan::ir::{Attr, Attrs, Data, Node, Value};
use memplan::ops::{registry, Backward, BackwardCx, Cx, Fact, KernelCx, Op, Saved};

/// SplitMix64 for test data.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [lo, hi).
    pub fn f(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
    /// Uniform in [lo, hi] (integers).
    pub fn u(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
    pub fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
    pub fn shape(&mut self, rank: usize, lo: usize, hi: usize) -> Vec<usize> {
        (0..rank).map(|_| self.u(lo, hi)).collect()
    }
    /// Uniform in [-1, 1) values.
    pub fn t(&mut self, shape: &[usize]) -> Tensor {
        self.range(shape, -1.0, 1.0)
    }
    pub fn range(&mut self, shape: &[usize], lo: f32, hi: f32) -> Tensor {
        let n = shape.iter().product();
        Tensor::f32(shape.to_vec(), (0..n).map(|_| self.f(lo, hi)).collect())
    }
    /// Magnitudes in [0.1, 1.5), random signs: away from kinks at 0.
    pub fn away_from_zero(&mut self, shape: &[usize]) -> Tensor {
        let n = shape.iter().product();
        let v = (0..n)
            .map(|_| {
                let m = self.f(0.1, 1.5);
                if self.coin() {
                    m
                } else {
                    -m
                }
            })
            .collect();
        Tensor::f32(shape.to_vec(), v)
    }
    /// Distinct values 0.1 apart, shuffled (no near-ties for max selection).
    pub fn distinct(&mut self, shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        let mut v: Vec<f32> = (0..n).map(|i| (i as f32 - n as f32 / 2.0) * 0.1).collect();
        for i in (1..n).rev() {
            let j = self.u(0, i);
            v.swap(i, j);
        }
        Tensor::f32(shape.to_vec(), v)
    }
}

pub fn ints(v: &[i64]) -> Attr {
    Attr::Ints(v.to_vec())
}

pub fn i64s(v: &[i64]) -> Tensor {
    Tensor::i64(vec![v.len()], v.to_vec())
}

pub fn scalar(v: f32) -> Tensor {
    Tensor::f32(vec![], vec![v])
}

/// One op application to check.
pub struct Case {
    pub op: &'static str,
    /// The op's domain ("" for ONNX's; memplan::ops::LOWERED_DOMAIN for lowering's).
    pub domain: &'static str,
    pub attrs: Vec<(&'static str, Attr)>,
    pub inputs: Vec<Tensor>,
    /// Inputs that are constants (folded into their facts, never differentiated).
    pub consts: Vec<usize>,
    pub n_out: usize,
    /// The leading outputs that receive a gradient.
    pub grad_outs: usize,
    pub opset: i64,
}

impl Case {
    pub fn new(op: &'static str, inputs: Vec<Tensor>) -> Case {
        Case {
            op,
            domain: "",
            attrs: Vec::new(),
            inputs,
            consts: Vec::new(),
            n_out: 1,
            grad_outs: 1,
            opset: 17,
        }
    }
    pub fn domain(mut self, d: &'static str) -> Case {
        self.domain = d;
        self
    }
    pub fn attr(mut self, k: &'static str, a: Attr) -> Case {
        self.attrs.push((k, a));
        self
    }
    pub fn consts(mut self, c: &[usize]) -> Case {
        self.consts = c.to_vec();
        self
    }
    pub fn outs(mut self, n_out: usize, grad_outs: usize) -> Case {
        self.n_out = n_out;
        self.grad_outs = grad_outs;
        self
    }
    pub fn opset(mut self, o: i64) -> Case {
        self.opset = o;
        self
    }
    pub fn node(&self) -> Node {
        Node {
            name: format!("test_{}", self.op).into(),
            op_type: self.op.into(),
            domain: self.domain.into(),
            inputs: (0..self.inputs.len()).map(Some).collect(),
            outputs: (0..self.n_out).map(|i| Some(100 + i)).collect(),
            attrs: Attrs::from_iter(self.attrs.iter().map(|(k, a)| (k.to_string(), a.clone()))),
        }
    }
    /// The rule's inferred outputs for this case.
    pub fn infer(&self) -> Result<Vec<Fact>, String> {
        let (node, facts) = (self.node(), self.facts());
        let cx = Cx {
            node: &node,
            inputs: facts.iter().map(Some).collect(),
            opset: self.opset,
        };
        registry()
            .get(self.domain, self.op)
            .ok_or("no rule")?
            .infer(&cx)
            .map_err(|e| e.to_string())
    }
    /// The rule's backward for this case, given its inferred outputs (`None`: no
    /// gradient).
    pub fn backward_rule(&self, out: &[Fact]) -> Result<Option<Backward>, String> {
        let (node, facts) = (self.node(), self.facts());
        let cx = Cx {
            node: &node,
            inputs: facts.iter().map(Some).collect(),
            opset: self.opset,
        };
        registry()
            .get(self.domain, self.op)
            .ok_or("no rule")?
            .backward(&cx, out)
            .map_err(|e| e.to_string())
    }
    /// Facts of the inputs: integer inputs and declared constants carry values.
    pub fn facts(&self) -> Vec<Fact> {
        self.inputs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let mut f = Fact::new(t.dtype(), t.shape.clone());
                if !t.dtype().is_float() && t.numel() <= 64 {
                    f.value = Some(Box::new(Value::ints(t.shape.clone(), t.to_i64s())));
                } else if self.consts.contains(&i) {
                    f.value = Some(Box::new(Value {
                        shape: t.shape.clone(),
                        data: Data::Float(t.to_f64s()),
                    }));
                }
                f
            })
            .collect()
    }
}

/// Runs the forward kernel with extras on `inputs`: declared outputs, then extras.
pub fn forward(case: &Case, node: &Node, out_facts: &[Fact], inputs: &[Tensor]) -> Vec<Tensor> {
    let rule = registry().get(case.domain, case.op).unwrap();
    let kcx = KernelCx {
        node,
        inputs: inputs.iter().map(Some).collect(),
        outputs: out_facts.iter().take(case.n_out).map(Some).collect(),
        opset: case.opset,
        seed: 7,
        dropout: true,
        extras: true,
    };
    rule.forward_cpu(&kcx)
        .unwrap_or_else(|e| panic!("{} forward: {e}", case.op))
}

/// `L = Σ_o ⟨g_o, y_o⟩` in f64, and `Σ_o |g_o|·|y_o|`.
pub fn loss(outs: &[Tensor], gs: &[Tensor]) -> (f64, f64) {
    let mut l = (0.0, 0.0);
    for (g, y) in gs.iter().zip(outs) {
        let (g, y) = (g.to_f32().unwrap(), y.to_f32().unwrap());
        for (&a, &b) in g.iter().zip(y.iter()) {
            l.0 += a as f64 * b as f64;
            l.1 += (a as f64 * b as f64).abs();
        }
    }
    l
}

/// Statistics of a run of checks.
#[derive(Default)]
pub struct Stats {
    pub checks: usize,
    pub worst: f64,
}

/// Checks every differentiable input's gradient of `case` against finite
/// differences, as described at the top.
pub fn check(case: &Case, rng: &mut Rng, stats: &mut Stats) {
    let what = format!(
        "{} {:?} attrs {:?}",
        case.op,
        case.inputs
            .iter()
            .map(|t| t.shape.clone())
            .collect::<Vec<_>>(),
        case.attrs
    );
    let rule = registry().get(case.domain, case.op).unwrap();
    let (node, facts) = (case.node(), case.facts());
    let out_facts = case.infer().unwrap_or_else(|e| panic!("{what}: {e}"));
    let bw = case
        .backward_rule(&out_facts)
        .unwrap()
        .unwrap_or_else(|| panic!("{what}: no backward rule"));
    let outs = forward(case, &node, &out_facts, &case.inputs);
    assert_eq!(
        outs.len(),
        case.n_out + bw.extras.len(),
        "{what}: outputs then the rule's extras"
    );
    for (k, f) in bw.extras.iter().enumerate() {
        let e = &outs[case.n_out + k];
        assert_eq!(
            (e.dtype(), &e.shape),
            (f.dtype, &f.shape),
            "{what}: extra {k}"
        );
    }
    let gs: Vec<Tensor> = (0..case.grad_outs).map(|o| rng.t(&outs[o].shape)).collect();
    let diff: Vec<usize> = bw
        .grads
        .iter()
        .map(|g| g.input)
        .filter(|&i| {
            i < case.inputs.len() && case.inputs[i].dtype().is_float() && !case.consts.contains(&i)
        })
        .collect();
    assert!(!diff.is_empty(), "{what}: nothing to differentiate");
    let run_backward = |wanted: &[usize]| -> Vec<Option<Tensor>> {
        let run = Run {
            rule,
            case,
            node: &node,
            facts: &facts,
            out_facts: &out_facts,
            bw: &bw,
            outs: &outs,
        };
        run.backward(&gs, wanted)
            .unwrap_or_else(|e| panic!("{what}: backward of {wanted:?}: {e}"))
    };
    let all = run_backward(&diff);
    for &i in &diff {
        let alone = run_backward(&[i]);
        assert_eq!(
            alone.len(),
            case.inputs.len(),
            "{what}: one entry per input"
        );
        for (j, d) in alone.iter().enumerate() {
            assert_eq!(d.is_some(), j == i, "{what}: only wanted gradients");
        }
        let dx = alone[i].clone().unwrap();
        assert_eq!(
            all[i].as_ref(),
            Some(&dx),
            "{what}: alone and together agree"
        );
        let x = &case.inputs[i];
        assert_eq!(
            (dx.dtype(), &dx.shape),
            (x.dtype(), &x.shape),
            "{what}: dx {i}"
        );
        let v = rng.t(&x.shape);
        let (dxs, vs) = (dx.to_f32().unwrap(), v.to_f32().unwrap());
        let an: f64 = dxs
            .iter()
            .zip(vs.iter())
            .map(|(&a, &b)| a as f64 * b as f64)
            .sum();
        let scale: f64 = dxs
            .iter()
            .zip(vs.iter())
            .map(|(&a, &b)| (a as f64 * b as f64).abs())
            .sum();
        let eps = 1e-2f32;
        let shifted = |sign: f32| -> (f64, f64) {
            let mut ins = case.inputs.clone();
            let xs = x.to_f32().unwrap();
            let moved = xs
                .iter()
                .zip(vs.iter())
                .map(|(&a, &b)| a + sign * eps * b)
                .collect();
            ins[i] = Tensor::from_f32(x.dtype(), x.shape.clone(), moved).unwrap();
            loss(&forward(case, &node, &out_facts, &ins), &gs)
        };
        let ((hi, mag), (lo, _)) = (shifted(1.0), shifted(-1.0));
        let fd = (hi - lo) / (2.0 * eps as f64);
        let err = (fd - an).abs();
        assert!(
            err <= 2e-3 * scale + 1e-5 * (1.0 + mag),
            "{what}: input {i}: finite difference {fd:.6e}, kernel {an:.6e} (terms {scale:.3e}); inputs {:?}",
            case.inputs
        );
        stats.checks += 1;
        stats.worst = stats.worst.max(err / (scale + 1e-12));
    }
}

/// A shape that broadcasts to `out`: some dims set to 1, some leading dims dropped.
pub fn broadcast_operand(rng: &mut Rng, out: &[usize]) -> Vec<usize> {
    let drop = rng.u(0, out.len());
    out[drop..]
        .iter()
        .map(|&d| if rng.u(0, 2) == 0 { 1 } else { d })
        .collect()
}

pub const SEEDS: u64 = 4;

pub fn report(name: &str, stats: &Stats) {
    eprintln!(
        "{name}: {} gradient checks, worst |fd − an| / Σ|terms| = {:.2e}",
        stats.checks, stats.worst
    );
}

/// Runs `case`'s forward (with extras) and its backward for the `wanted`
/// inputs under the output gradients `gs`, the backward given only the saved
/// tensors its rule lists for them (as `check` does): the outputs (declared, then
/// the rule's extras) and one gradient entry per input.
pub fn forward_backward(
    case: &Case,
    gs: &[Tensor],
    wanted: &[usize],
) -> Result<(Vec<Tensor>, Vec<Option<Tensor>>), String> {
    let rule = registry().get(case.domain, case.op).unwrap();
    let (node, facts) = (case.node(), case.facts());
    let out_facts = case.infer()?;
    let bw = case.backward_rule(&out_facts)?.ok_or("no backward rule")?;
    let outs = forward(case, &node, &out_facts, &case.inputs);
    let run = Run {
        rule,
        case,
        node: &node,
        facts: &facts,
        out_facts: &out_facts,
        bw: &bw,
        outs: &outs,
    };
    let grads = run.backward(gs, wanted).map_err(|e| e.to_string())?;
    Ok((outs, grads))
}

/// One forward run of a case and its rule's backward, shared by [`check`] and
/// [`forward_backward`].
struct Run<'a> {
    rule: &'a dyn Op,
    case: &'a Case,
    node: &'a Node,
    facts: &'a [Fact],
    out_facts: &'a [Fact],
    bw: &'a Backward,
    /// The forward's outputs, then the rule's extras.
    outs: &'a [Tensor],
}

impl Run<'_> {
    /// The backward for the `wanted` inputs under the output gradients `gs`,
    /// given only the saved tensors their gradients list.
    fn backward(
        &self,
        gs: &[Tensor],
        wanted: &[usize],
    ) -> memplan::numeric::RuleResult<Vec<Option<Tensor>>> {
        let n_out = self.case.n_out;
        let mut saved: Vec<(Saved, &Tensor)> = Vec::new();
        for g in self.bw.grads.iter().filter(|g| wanted.contains(&g.input)) {
            for &s in &g.needs {
                if saved.iter().all(|(k, _)| *k != s) {
                    let t = match s {
                        Saved::Input(i) => &self.case.inputs[i],
                        Saved::Output(i) => &self.outs[i],
                        Saved::Extra(i) => &self.outs[n_out + i],
                    };
                    saved.push((s, t));
                }
            }
        }
        let bcx = BackwardCx {
            node: self.node,
            inputs: self.facts.iter().map(Some).collect(),
            outputs: self.out_facts.iter().take(n_out).map(Some).collect(),
            opset: self.case.opset,
            saved,
            grads: (0..n_out).map(|o| gs.get(o)).collect(),
            wanted: wanted.to_vec(),
            dropout: true,
        };
        self.rule.backward_cpu(&bcx)
    }
}
