//! Recurrent layers: RNN, GRU and LSTM (one layer, one or two directions), as
//! `torch.nn.RNN/GRU/LSTM` export them.
//!
//! `X` is `[seq, batch, input]` (`layout` 1: `[batch, seq, input]`), `W`
//! `[dirs, G·hidden, input]`, `R` `[dirs, G·hidden, hidden]`, `B`
//! `[dirs, 2·G·hidden]`, with `G` gates (RNN 1, GRU 3, LSTM 4). Inputs after B:
//! `sequence_lens [batch]`, `initial_h [dirs, batch, hidden]`, and for LSTM
//! `initial_c` and the peepholes `P [dirs, 3·hidden]`. Outputs: `Y [seq, dirs,
//! batch, hidden]`, `Y_h [dirs, batch, hidden]` (LSTM also `Y_c`), batch-first
//! with `layout` 1.
//!
//! Shape rules, FLOPs, the backward rule and CPU kernels (forward in the ONNX
//! semantics with the default activations, backward through time).

use super::{
    Arity, Autocast, Backward, BackwardCx, CudaKernels, Cx, Fact, Grad, KernelCx, Op, Registry,
    RuleResult, Saved, Storage,
};
use crate::ir::{Attr, Attrs};
use crate::numeric::Tensor;

/// `(seq, batch, input, hidden, dirs, gates)` of a node, checked.
struct Dims {
    seq: usize,
    batch: usize,
    input: usize,
    hidden: usize,
    dirs: usize,
    gates: usize,
    batch_first: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Recurrent {
    Rnn,
    Gru,
    Lstm,
}

/// The recurrent layers' attributes.
struct RnnAttrs<'a> {
    /// `layout` 1: batch first (default 0).
    batch_first: bool,
    /// `direction` (default "forward").
    direction: &'a str,
    /// `hidden_size` (default: from W).
    hidden_size: Option<i64>,
    /// GRU's `linear_before_reset` (default 0).
    linear_before_reset: bool,
    /// Whether `clip` is given.
    clip: bool,
    /// LSTM's `input_forget` (default 0).
    input_forget: bool,
    /// `activations` (default: each gate's ONNX default).
    activations: Option<&'a [String]>,
}

impl RnnAttrs<'_> {
    fn of(attrs: &Attrs) -> RnnAttrs<'_> {
        RnnAttrs {
            batch_first: attrs.int_or("layout", 0) != 0,
            direction: attrs.string("direction").unwrap_or("forward"),
            hidden_size: attrs.int("hidden_size"),
            linear_before_reset: attrs.int_or("linear_before_reset", 0) != 0,
            clip: attrs.has("clip"),
            input_forget: attrs.int_or("input_forget", 0) != 0,
            activations: match attrs.get("activations") {
                Some(Attr::Strings(acts)) => Some(acts),
                _ => None,
            },
        }
    }
}

impl Recurrent {
    /// The ONNX op type.
    fn name(self) -> &'static str {
        match self {
            Recurrent::Rnn => "RNN",
            Recurrent::Gru => "GRU",
            Recurrent::Lstm => "LSTM",
        }
    }

    fn gates(self) -> usize {
        match self {
            Recurrent::Lstm => 4,
            Recurrent::Gru => 3,
            Recurrent::Rnn => 1,
        }
    }

    fn dims(self, cx: &Cx) -> RuleResult<Dims> {
        let x = cx.input(0)?;
        let (w, r) = (cx.input(1)?, cx.input(2)?);
        if x.rank() != 3 || w.rank() != 3 || r.rank() != 3 {
            return Err(format!(
                "X, W and R must be 3-D, got {:?}, {:?}, {:?}",
                x.shape, w.shape, r.shape
            )
            .into());
        }
        if !x.dtype.is_float() {
            return Err(format!("X must be floating point, got {}", x.dtype).into());
        }
        let at = RnnAttrs::of(cx.attrs());
        let batch_first = at.batch_first;
        let (seq, batch) = if batch_first {
            (x.shape[1], x.shape[0])
        } else {
            (x.shape[0], x.shape[1])
        };
        let dirs = match at.direction {
            "forward" | "reverse" => 1,
            "bidirectional" => 2,
            d => {
                return Err(
                    format!("direction '{d}' is not forward, reverse or bidirectional").into(),
                )
            }
        };
        let gates = self.gates();
        let hidden = match at.hidden_size {
            Some(h) if h > 0 => h as usize,
            Some(h) => return Err(format!("hidden_size {h} must be positive").into()),
            None => w.shape[1] / gates,
        };
        let input = x.shape[2];
        let want = |what: &str, f: &Fact, shape: Vec<usize>| -> RuleResult<()> {
            if f.shape == shape {
                Ok(())
            } else {
                Err(format!("{what} is {:?}, expected {shape:?}", f.shape).into())
            }
        };
        want("W", w, vec![dirs, gates * hidden, input])?;
        want("R", r, vec![dirs, gates * hidden, hidden])?;
        if let Some(b) = cx.opt(3) {
            want("B", b, vec![dirs, 2 * gates * hidden])?;
        }
        if let Some(l) = cx.opt(4) {
            want("sequence_lens", l, vec![batch])?;
        }
        let state = if batch_first {
            vec![batch, dirs, hidden]
        } else {
            vec![dirs, batch, hidden]
        };
        if let Some(h) = cx.opt(5) {
            want("initial_h", h, state.clone())?;
        }
        if gates == 4 {
            if let Some(c) = cx.opt(6) {
                want("initial_c", c, state)?;
            }
            if let Some(p) = cx.opt(7) {
                want("P", p, vec![dirs, 3 * hidden])?;
            }
        }
        Ok(Dims {
            seq,
            batch,
            input,
            hidden,
            dirs,
            gates,
            batch_first,
        })
    }
}

impl Op for Recurrent {
    fn arity(&self) -> Arity {
        Arity::new(3, 8, 0, 3)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let d = self.dims(cx)?;
        let dt = cx.input(0)?.dtype;
        let n_out = cx.n_outputs();
        if n_out > if d.gates == 4 { 3 } else { 2 } {
            return Err(format!("{} has {n_out} outputs", self.name()).into());
        }
        let (y, state) = if d.batch_first {
            (
                vec![d.batch, d.seq, d.dirs, d.hidden],
                vec![d.batch, d.dirs, d.hidden],
            )
        } else {
            (
                vec![d.seq, d.dirs, d.batch, d.hidden],
                vec![d.dirs, d.batch, d.hidden],
            )
        };
        let mut out = Vec::with_capacity(n_out);
        for i in 0..n_out {
            out.push(Fact::new(
                dt,
                if i == 0 { y.clone() } else { state.clone() },
            ));
        }
        Ok(out)
    }
    /// Per step, direction and batch row: `2·G·hidden·(input + hidden)` for the
    /// two products, and per gate element the bias adds and activation (3), plus
    /// 3 per hidden element for the state update.
    fn flops(&self, cx: &Cx, _out: &[Fact]) -> u64 {
        let Ok(d) = self.dims(cx) else { return 0 };
        // Saturating: u64::MAX is the overflow inference refuses in one line.
        let u = |v: usize| v as u64;
        let gh = u(d.gates).saturating_mul(u(d.hidden));
        let per = gh
            .saturating_mul(2)
            .saturating_mul(u(d.input).saturating_add(u(d.hidden)))
            .saturating_add(gh.saturating_mul(3))
            .saturating_add(u(d.hidden).saturating_mul(3));
        u(d.seq)
            .saturating_mul(u(d.dirs))
            .saturating_mul(u(d.batch))
            .saturating_mul(per)
    }
    /// As cuDNN's RNN backward in PyTorch (`_cudnn_rnn`): it saves the input, the
    /// weights, the initial states, the output `Y` (all hidden states) and the
    /// reserve space of every step's gate activations, modelled as
    /// `seq·dirs·batch·G·hidden` elements (cuDNN's reserve holds at least these).
    /// `Y` is output 0 when the node declares it, else an extra. Gradients for X,
    /// W, R, B and the initial states. Backward FLOPs: twice the forward's.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let d = self.dims(cx)?;
        let dt = cx.input(0)?.dtype;
        let reserve = Fact::new(dt, vec![d.seq * d.dirs * d.batch * d.gates * d.hidden]);
        let (y, extras) = if cx.has_output(0) {
            (Saved::Output(0), vec![reserve])
        } else {
            let shape = vec![d.seq, d.dirs, d.batch, d.hidden];
            (Saved::Extra(1), vec![reserve, Fact::new(dt, shape)])
        };
        let mut needs = vec![
            Saved::Input(0),
            Saved::Input(1),
            Saved::Input(2),
            y,
            Saved::Extra(0),
        ];
        for i in [5, 6] {
            if cx.opt(i).is_some() && (i == 5 || d.gates == 4) {
                needs.push(Saved::Input(i));
            }
        }
        // GRU with `linear_before_reset` needs the recurrent bias of the h gate
        // (`r ⊙ (R_h·h + Rb_h)`); cuDNN keeps the biases in its weight buffer,
        // which PyTorch saves. Peepholes (no cuDNN form) need P.
        let lbr = RnnAttrs::of(cx.attrs()).linear_before_reset;
        if d.gates == 3 && lbr && cx.opt(3).is_some() {
            needs.push(Saved::Input(3));
        }
        if d.gates == 4 && cx.opt(7).is_some() {
            needs.push(Saved::Input(7));
        }
        let mut slots = vec![0, 1, 2, 3, 5];
        if d.gates == 4 {
            slots.extend([6, 7]);
        }
        let grads = slots
            .into_iter()
            .filter(|&i| cx.opt(i).is_some())
            .map(|input| Grad {
                input,
                needs: needs.clone(),
            })
            .collect();
        Ok(Some(Backward {
            grads,
            extras,
            flops: self.flops(cx, out).saturating_mul(2),
        }))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// The ONNX semantics in f64, default activations only (no `clip`, no
    /// `input_forget`, `sequence_lens` only when every length is the full
    /// sequence). Y, Y_h (and Y_c) for every declared slot; with
    /// [`KernelCx::extras`], the reserve `[seq, dirs, batch, G·hidden]` of gate
    /// activations (RNN: h; GRU: z, r, h̃; LSTM: i, o, f, c̃) and, when output 0
    /// is not declared, `Y` as `[seq, dirs, batch, hidden]`.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let op = self.name();
        let facts: Vec<Option<Fact>> = cx
            .inputs
            .iter()
            .map(|t| t.map(|t| Fact::new(t.dtype(), t.shape.clone())))
            .collect();
        let rcx = Cx {
            node: cx.node,
            inputs: facts.iter().map(|f| f.as_ref()).collect(),
            opset: cx.opset,
        };
        let d = self.dims(&rcx)?;
        let cfg = Config::new(&RnnAttrs::of(cx.attrs()), op, &d)?;
        check_lens(op, cx.opt(4), d.seq)?;
        let x = cx.input(0)?;
        let dt = x.dtype();
        let bias = f64s(cx.opt(3));
        let h0 = f64s(cx.opt(5));
        let (c0, p) = if d.gates == 4 {
            (f64s(cx.opt(6)), f64s(cx.opt(7)))
        } else {
            (None, None)
        };
        let (y, cs, res) = run_forward(
            &d,
            &cfg,
            &x.to_f64s(),
            &cx.input(1)?.to_f64s(),
            &cx.input(2)?.to_f64s(),
            bias.as_deref(),
            h0.as_deref(),
            c0.as_deref(),
            p.as_deref(),
        );
        let f32s = |v: &[f64]| v.iter().map(|&a| a as f32).collect::<Vec<f32>>();
        let state = if d.batch_first {
            vec![d.batch, d.dirs, d.hidden]
        } else {
            vec![d.dirs, d.batch, d.hidden]
        };
        let mut out = Vec::with_capacity(cx.n_outputs() + 2);
        for i in 0..cx.n_outputs() {
            let (shape, v) = match i {
                0 => {
                    let shape = if d.batch_first {
                        vec![d.batch, d.seq, d.dirs, d.hidden]
                    } else {
                        vec![d.seq, d.dirs, d.batch, d.hidden]
                    };
                    (shape, relayout(&d, &y, false))
                }
                1 => (state.clone(), last_state(&d, &cfg, &y, h0.as_deref())),
                _ => (state.clone(), last_state(&d, &cfg, &cs, c0.as_deref())),
            };
            out.push(Tensor::from_f32(dt, shape, f32s(&v))?);
        }
        if cx.extras {
            out.push(Tensor::from_f32(dt, vec![res.len()], f32s(&res))?);
            if !rcx.has_output(0) {
                let shape = vec![d.seq, d.dirs, d.batch, d.hidden];
                out.push(Tensor::from_f32(dt, shape, f32s(&y))?);
            }
        }
        Ok(out)
    }
    /// Backpropagation through time from the saved X, W, R, Y, the reserve, the
    /// initial states (B for GRU's `linear_before_reset`, P for peepholes); the
    /// cell states of LSTM are recomputed from the reserve.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let rcx = cx.rule_cx();
        let d = self.dims(&rcx)?;
        let cfg = Config::new(&RnnAttrs::of(cx.attrs()), self.name(), &d)?;
        let x = cx.saved(Saved::Input(0))?.to_f64s();
        let w = cx.saved(Saved::Input(1))?.to_f64s();
        let r = cx.saved(Saved::Input(2))?.to_f64s();
        let y = if rcx.has_output(0) {
            relayout(&d, &cx.saved(Saved::Output(0))?.to_f64s(), true)
        } else {
            cx.saved(Saved::Extra(1))?.to_f64s()
        };
        let res = cx.saved(Saved::Extra(0))?.to_f64s();
        let opt = |i: usize, when: bool| -> RuleResult<Option<Vec<f64>>> {
            if when && rcx.opt(i).is_some() {
                Ok(Some(cx.saved(Saved::Input(i))?.to_f64s()))
            } else {
                Ok(None)
            }
        };
        let h0 = opt(5, true)?;
        let c0 = opt(6, d.gates == 4)?;
        let bias = opt(3, d.gates == 3 && cfg.lbr)?;
        let p = opt(7, d.gates == 4)?;
        let grad = |i: usize, n: usize| -> RuleResult<Vec<f64>> {
            if rcx.has_output(i) {
                Ok(cx.grad(i)?.iter().map(|&v| v as f64).collect())
            } else {
                Ok(vec![0f64; n])
            }
        };
        let n_state = d.dirs * d.batch * d.hidden;
        let dy = relayout(&d, &grad(0, d.seq * n_state)?, true);
        let dyh = grad(1, n_state)?;
        let dyc = if d.gates == 4 {
            grad(2, n_state)?
        } else {
            Vec::new()
        };
        let fwd = Fwd {
            x: &x,
            w: &w,
            r: &r,
            bias: bias.as_deref(),
            y: &y,
            res: &res,
            h0: h0.as_deref(),
            c0: c0.as_deref(),
            p: p.as_deref(),
        };
        let g = run_backward(&d, &cfg, &fwd, &dy, &dyh, &dyc);
        let f32s = |v: &[f64]| v.iter().map(|&a| a as f32).collect::<Vec<f32>>();
        let mut ans = Vec::new();
        for &i in &cx.wanted {
            let v = match i {
                0 => &g.dx,
                1 => &g.dw,
                2 => &g.dr,
                3 => &g.db,
                5 => &g.dh0,
                6 => &g.dc0,
                7 => &g.dp,
                _ => return Err(format!("{}: input {i} has no gradient", self.name()).into()),
            };
            ans.push((i, f32s(v)));
        }
        cx.answer(ans)
    }
    /// No device kernels: the CPU kernel runs on the host.
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    /// cuDNN RNNs are on autocast's lower-precision list.
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Half
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// `out[r] += Σ_c m[r·cols + c]·v[c]`.
fn mv(m: &[f64], cols: usize, v: &[f64], out: &mut [f64]) {
    for (r, o) in out.iter_mut().enumerate() {
        let row = &m[r * cols..(r + 1) * cols];
        *o += row.iter().zip(v).map(|(a, b)| a * b).sum::<f64>();
    }
}

/// `out[c] += Σ_r m[r·cols + c]·v[r]`.
fn mtv(m: &[f64], cols: usize, v: &[f64], out: &mut [f64]) {
    for (r, &g) in v.iter().enumerate() {
        if g == 0.0 {
            continue;
        }
        for (o, &a) in out.iter_mut().zip(&m[r * cols..(r + 1) * cols]) {
            *o += a * g;
        }
    }
}

/// `out[i] += v[i]` over `v`.
fn add(out: &mut [f64], v: &[f64]) {
    for (o, &a) in out.iter_mut().zip(v) {
        *o += a;
    }
}

/// `dm[r·cols + c] += u[r]·v[c]`.
fn outer(dm: &mut [f64], cols: usize, u: &[f64], v: &[f64]) {
    for (r, &g) in u.iter().enumerate() {
        if g == 0.0 {
            continue;
        }
        for (o, &b) in dm[r * cols..(r + 1) * cols].iter_mut().zip(v) {
            *o += g * b;
        }
    }
}

/// What the kernels support of a node's attributes, checked.
struct Config {
    /// GRU's `linear_before_reset`.
    lbr: bool,
    /// Direction of each direction slot: true where it runs from the end.
    reverse: [bool; 2],
}

impl Config {
    fn new(at: &RnnAttrs, op: &str, d: &Dims) -> RuleResult<Config> {
        if at.clip {
            return Err(format!("{op}: the CPU kernel does not support `clip`").into());
        }
        if at.input_forget {
            return Err(format!("{op}: the CPU kernel does not support `input_forget`").into());
        }
        if let Some(acts) = at.activations {
            let one: &[&str] = match d.gates {
                4 => &["sigmoid", "tanh", "tanh"],
                3 => &["sigmoid", "tanh"],
                _ => &["tanh"],
            };
            let ok = acts.len() == one.len() * d.dirs
                && acts
                    .iter()
                    .enumerate()
                    .all(|(i, a)| a.eq_ignore_ascii_case(one[i % one.len()]));
            if !ok {
                return Err(format!(
                    "{op}: the CPU kernel supports only the default activations, got {acts:?}"
                )
                .into());
            }
        }
        Ok(Config {
            lbr: at.linear_before_reset,
            reverse: [at.direction == "reverse", true],
        })
    }
}

/// Index of `(t, dir, b)`'s row of `hidden` in `Y` (`layout` 1:
/// `[batch, seq, dirs, hidden]`, else `[seq, dirs, batch, hidden]`).
fn y_at(d: &Dims, batch_first: bool, t: usize, dir: usize, b: usize) -> usize {
    let i = if batch_first {
        (b * d.seq + t) * d.dirs + dir
    } else {
        (t * d.dirs + dir) * d.batch + b
    };
    i * d.hidden
}

/// Index of `(dir, b)`'s row in a state (`layout` 1: `[batch, dirs, hidden]`).
fn s_at(d: &Dims, dir: usize, b: usize) -> usize {
    let i = if d.batch_first {
        b * d.dirs + dir
    } else {
        dir * d.batch + b
    };
    i * d.hidden
}

/// The time index of processing step `s` of direction `dir`.
fn time(d: &Dims, cfg: &Config, dir: usize, s: usize) -> usize {
    if cfg.reverse[dir] {
        d.seq - 1 - s
    } else {
        s
    }
}

fn f64s(t: Option<&Tensor>) -> Option<Vec<f64>> {
    t.map(|t| t.to_f64s())
}

/// The state after the last step of each direction, `[dirs, batch, hidden]`
/// (`layout` 1: `[batch, dirs, hidden]`), from per-step states `buf` in
/// `[seq, dirs, batch, hidden]`, or `init` when the sequence is empty.
fn last_state(d: &Dims, cfg: &Config, buf: &[f64], init: Option<&[f64]>) -> Vec<f64> {
    let h = d.hidden;
    let mut out = vec![0f64; d.dirs * d.batch * h];
    for dir in 0..d.dirs {
        for b in 0..d.batch {
            let o = s_at(d, dir, b);
            if d.seq > 0 {
                let t = time(d, cfg, dir, d.seq - 1);
                let i = ((t * d.dirs + dir) * d.batch + b) * h;
                out[o..o + h].copy_from_slice(&buf[i..i + h]);
            } else if let Some(v) = init {
                out[o..o + h].copy_from_slice(&v[o..o + h]);
            }
        }
    }
    out
}

/// Refuses `sequence_lens` unless every length is the full sequence.
fn check_lens(op: &str, lens: Option<&Tensor>, seq: usize) -> RuleResult<()> {
    if let Some(l) = lens {
        if l.to_i64s().iter().any(|&v| v != seq as i64) {
            return Err(format!(
                "{op}: the CPU kernel supports sequence_lens only when every length is the \
                 sequence length {seq}"
            )
            .into());
        }
    }
    Ok(())
}

/// The forward pass in f64: `Y` as `[seq, dirs, batch, hidden]`, the cell
/// states of LSTM (same layout) and the reserve `[seq, dirs, batch, G·hidden]`
/// (RNN: h; GRU: z, r, h̃; LSTM: i, o, f, c̃).
#[allow(clippy::too_many_arguments)]
fn run_forward(
    d: &Dims,
    cfg: &Config,
    x: &[f64],
    w: &[f64],
    r: &[f64],
    bias: Option<&[f64]>,
    h0: Option<&[f64]>,
    c0: Option<&[f64]>,
    p: Option<&[f64]>,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (h, g, inp) = (d.hidden, d.gates, d.input);
    let gh = g * h;
    let n = d.seq * d.dirs * d.batch * h;
    let mut y = vec![0f64; n];
    let mut cs = vec![0f64; if g == 4 { n } else { 0 }];
    let mut res = vec![0f64; n * g];
    let at = |t: usize, dir: usize, b: usize| ((t * d.dirs + dir) * d.batch + b) * h;
    let mut ax = vec![0f64; gh];
    let mut ah = vec![0f64; gh];
    let mut rh = vec![0f64; h];
    for dir in 0..d.dirs {
        let wd = &w[dir * gh * inp..(dir + 1) * gh * inp];
        let rd = &r[dir * gh * h..(dir + 1) * gh * h];
        let zero = vec![0f64; 2 * gh];
        let bd = bias.map_or(&zero[..], |b| &b[dir * 2 * gh..(dir + 1) * 2 * gh]);
        let (wb, rb) = bd.split_at(gh);
        for s in 0..d.seq {
            let t = time(d, cfg, dir, s);
            for b in 0..d.batch {
                let xb = if d.batch_first {
                    (b * d.seq + t) * inp
                } else {
                    (t * d.batch + b) * inp
                };
                let xt = &x[xb..xb + inp];
                let zeros = vec![0f64; h];
                let hp: Vec<f64> = if s > 0 {
                    let o = at(time(d, cfg, dir, s - 1), dir, b);
                    y[o..o + h].to_vec()
                } else {
                    h0.map_or(zeros.clone(), |v| {
                        let o = s_at(d, dir, b);
                        v[o..o + h].to_vec()
                    })
                };
                let cp: Vec<f64> = if g != 4 {
                    Vec::new()
                } else if s > 0 {
                    let o = at(time(d, cfg, dir, s - 1), dir, b);
                    cs[o..o + h].to_vec()
                } else {
                    c0.map_or(zeros.clone(), |v| {
                        let o = s_at(d, dir, b);
                        v[o..o + h].to_vec()
                    })
                };
                ax.copy_from_slice(wb);
                mv(wd, inp, xt, &mut ax);
                ah.copy_from_slice(rb);
                mv(rd, h, &hp, &mut ah);
                let o = at(t, dir, b);
                let rs = &mut res[o * g..(o + h) * g];
                match g {
                    1 => {
                        for j in 0..h {
                            let v = (ax[j] + ah[j]).tanh();
                            rs[j] = v;
                            y[o + j] = v;
                        }
                    }
                    3 => {
                        for j in 0..2 * h {
                            rs[j] = sigmoid(ax[j] + ah[j]);
                        }
                        if !cfg.lbr {
                            for j in 0..h {
                                rh[j] = rs[h + j] * hp[j];
                            }
                            let mut a = rb[2 * h..].to_vec();
                            mv(&rd[2 * h * h..], h, &rh, &mut a);
                            for j in 0..h {
                                rs[2 * h + j] = (ax[2 * h + j] + a[j]).tanh();
                            }
                        } else {
                            for j in 0..h {
                                rs[2 * h + j] = (ax[2 * h + j] + rs[h + j] * ah[2 * h + j]).tanh();
                            }
                        }
                        for j in 0..h {
                            let z = rs[j];
                            y[o + j] = (1.0 - z) * rs[2 * h + j] + z * hp[j];
                        }
                    }
                    _ => {
                        for j in 0..h {
                            let (pi, po, pf) = p.map_or((0.0, 0.0, 0.0), |p| {
                                let q = &p[dir * 3 * h..];
                                (q[j], q[h + j], q[2 * h + j])
                            });
                            let i = sigmoid(ax[j] + ah[j] + pi * cp[j]);
                            let f = sigmoid(ax[2 * h + j] + ah[2 * h + j] + pf * cp[j]);
                            let c = (ax[3 * h + j] + ah[3 * h + j]).tanh();
                            let cn = f * cp[j] + i * c;
                            let og = sigmoid(ax[h + j] + ah[h + j] + po * cn);
                            rs[j] = i;
                            rs[h + j] = og;
                            rs[2 * h + j] = f;
                            rs[3 * h + j] = c;
                            cs[o + j] = cn;
                            y[o + j] = og * cn.tanh();
                        }
                    }
                }
            }
        }
    }
    (y, cs, res)
}

/// `Y` in the node's layout from `[seq, dirs, batch, hidden]` (`back`: the other way).
fn relayout(d: &Dims, v: &[f64], back: bool) -> Vec<f64> {
    if !d.batch_first {
        return v.to_vec();
    }
    let h = d.hidden;
    let mut out = vec![0f64; v.len()];
    for t in 0..d.seq {
        for dir in 0..d.dirs {
            for b in 0..d.batch {
                let i = ((t * d.dirs + dir) * d.batch + b) * h;
                let o = y_at(d, true, t, dir, b);
                if back {
                    out[i..i + h].copy_from_slice(&v[o..o + h]);
                } else {
                    out[o..o + h].copy_from_slice(&v[i..i + h]);
                }
            }
        }
    }
    out
}

/// Gradients of every differentiable input.
struct Grads {
    dx: Vec<f64>,
    dw: Vec<f64>,
    dr: Vec<f64>,
    db: Vec<f64>,
    dh0: Vec<f64>,
    dc0: Vec<f64>,
    dp: Vec<f64>,
}

/// Forward tensors the backward reads, `y` as `[seq, dirs, batch, hidden]`.
struct Fwd<'a> {
    x: &'a [f64],
    w: &'a [f64],
    r: &'a [f64],
    /// The bias (read only for GRU's `linear_before_reset`).
    bias: Option<&'a [f64]>,
    y: &'a [f64],
    res: &'a [f64],
    h0: Option<&'a [f64]>,
    c0: Option<&'a [f64]>,
    p: Option<&'a [f64]>,
}

/// An LSTM's cell states over the sequence (`[seq, hidden]`, in step order) for
/// direction `dir` and batch row `b`, replayed from the saved gates.
fn lstm_cells(
    d: &Dims,
    cfg: &Config,
    f: &Fwd,
    (dir, b): (usize, usize),
    init_c: &[f64],
) -> Vec<f64> {
    let (h, g) = (d.hidden, d.gates);
    let mut cst = vec![0f64; d.seq * h];
    let mut c = init_c.to_vec();
    for s in 0..d.seq {
        let o = (((time(d, cfg, dir, s) * d.dirs + dir) * d.batch + b) * h) * g;
        let rs = &f.res[o..o + g * h];
        for j in 0..h {
            c[j] = rs[2 * h + j] * c[j] + rs[j] * rs[3 * h + j];
        }
        cst[s * h..(s + 1) * h].copy_from_slice(&c);
    }
    cst
}

/// Backpropagation through time; `dy` as `[seq, dirs, batch, hidden]`, `dyh`
/// and `dyc` in the state layout.
fn run_backward(d: &Dims, cfg: &Config, f: &Fwd, dy: &[f64], dyh: &[f64], dyc: &[f64]) -> Grads {
    let (h, g, inp) = (d.hidden, d.gates, d.input);
    let gh = g * h;
    let mut gr = Grads {
        dx: vec![0f64; f.x.len()],
        dw: vec![0f64; f.w.len()],
        dr: vec![0f64; f.r.len()],
        db: vec![0f64; d.dirs * 2 * gh],
        dh0: vec![0f64; d.dirs * d.batch * h],
        dc0: vec![0f64; d.dirs * d.batch * h],
        dp: vec![0f64; d.dirs * 3 * h],
    };
    let at = |t: usize, dir: usize, b: usize| ((t * d.dirs + dir) * d.batch + b) * h;
    let xat = |t: usize, b: usize| {
        if d.batch_first {
            (b * d.seq + t) * inp
        } else {
            (t * d.batch + b) * inp
        }
    };
    let mut ga = vec![0f64; gh];
    for dir in 0..d.dirs {
        let wd = &f.w[dir * gh * inp..(dir + 1) * gh * inp];
        let rd = &f.r[dir * gh * h..(dir + 1) * gh * h];
        let (w0, r0, b0) = (dir * gh * inp, dir * gh * h, dir * 2 * gh);
        let zero_p = vec![0f64; 3 * h];
        let pd =
            f.p.map_or(&zero_p[..], |p| &p[dir * 3 * h..(dir + 1) * 3 * h]);
        let zero_b = vec![0f64; h];
        let rbh = f
            .bias
            .map_or(&zero_b[..], |b| &b[b0 + gh + 2 * h..b0 + gh + 3 * h]);
        for b in 0..d.batch {
            let so = s_at(d, dir, b);
            let init_h = f.h0.map_or(vec![0f64; h], |v| v[so..so + h].to_vec());
            let init_c = f.c0.map_or(vec![0f64; h], |v| v[so..so + h].to_vec());
            let cst = if g == 4 {
                lstm_cells(d, cfg, f, (dir, b), &init_c)
            } else {
                Vec::new()
            };
            let mut dh = dyh[so..so + h].to_vec();
            let mut dc = if g == 4 {
                dyc[so..so + h].to_vec()
            } else {
                Vec::new()
            };
            for s in (0..d.seq).rev() {
                let t = time(d, cfg, dir, s);
                let o = at(t, dir, b);
                let rs = &f.res[o * g..o * g + gh];
                let hp: Vec<f64> = if s > 0 {
                    let q = at(time(d, cfg, dir, s - 1), dir, b);
                    f.y[q..q + h].to_vec()
                } else {
                    init_h.clone()
                };
                for j in 0..h {
                    dh[j] += dy[o + j];
                }
                let mut dhp = vec![0f64; h];
                // Gate rows whose recurrent product reads `hp` directly.
                let mut direct = gh;
                match g {
                    1 => {
                        for j in 0..h {
                            ga[j] = dh[j] * (1.0 - rs[j] * rs[j]);
                        }
                        add(&mut gr.db[b0 + gh..], &ga[..h]);
                    }
                    3 => {
                        direct = 2 * h;
                        let mut dr = vec![0f64; h];
                        for j in 0..h {
                            let (z, hh) = (rs[j], rs[2 * h + j]);
                            ga[j] = dh[j] * (hp[j] - hh) * z * (1.0 - z);
                            dhp[j] += dh[j] * z;
                            ga[2 * h + j] = dh[j] * (1.0 - z) * (1.0 - hh * hh);
                        }
                        let rdh = &rd[2 * h * h..];
                        let drh = &mut gr.dr[r0 + 2 * h * h..r0 + 3 * h * h];
                        if !cfg.lbr {
                            let rhv: Vec<f64> = (0..h).map(|j| rs[h + j] * hp[j]).collect();
                            let mut d_rh = vec![0f64; h];
                            mtv(rdh, h, &ga[2 * h..], &mut d_rh);
                            for j in 0..h {
                                dr[j] = d_rh[j] * hp[j];
                                dhp[j] += d_rh[j] * rs[h + j];
                                gr.db[b0 + gh + 2 * h + j] += ga[2 * h + j];
                            }
                            outer(drh, h, &ga[2 * h..], &rhv);
                        } else {
                            let mut hr = rbh.to_vec();
                            mv(rdh, h, &hp, &mut hr);
                            let dhr: Vec<f64> = (0..h).map(|j| ga[2 * h + j] * rs[h + j]).collect();
                            for j in 0..h {
                                dr[j] = ga[2 * h + j] * hr[j];
                                gr.db[b0 + gh + 2 * h + j] += dhr[j];
                            }
                            outer(drh, h, &dhr, &hp);
                            mtv(rdh, h, &dhr, &mut dhp);
                        }
                        for j in 0..h {
                            let rr = rs[h + j];
                            ga[h + j] = dr[j] * rr * (1.0 - rr);
                        }
                        add(&mut gr.db[b0 + gh..], &ga[..2 * h]);
                    }
                    _ => {
                        let mut dcn = vec![0f64; h];
                        for j in 0..h {
                            let (i, og, fg, cc) = (rs[j], rs[h + j], rs[2 * h + j], rs[3 * h + j]);
                            let c = cst[s * h + j];
                            let cp = if s > 0 {
                                cst[(s - 1) * h + j]
                            } else {
                                init_c[j]
                            };
                            let tc = c.tanh();
                            let gao = dh[j] * tc * og * (1.0 - og);
                            let dcj = dc[j] + dh[j] * og * (1.0 - tc * tc) + pd[h + j] * gao;
                            let gai = dcj * cc * i * (1.0 - i);
                            let gaf = dcj * cp * fg * (1.0 - fg);
                            let gac = dcj * i * (1.0 - cc * cc);
                            dcn[j] = dcj * fg + pd[j] * gai + pd[2 * h + j] * gaf;
                            gr.dp[dir * 3 * h + j] += gai * cp;
                            gr.dp[dir * 3 * h + h + j] += gao * c;
                            gr.dp[dir * 3 * h + 2 * h + j] += gaf * cp;
                            ga[j] = gai;
                            ga[h + j] = gao;
                            ga[2 * h + j] = gaf;
                            ga[3 * h + j] = gac;
                        }
                        add(&mut gr.db[b0 + gh..], &ga[..gh]);
                        dc = dcn;
                    }
                }
                let xo = xat(t, b);
                outer(&mut gr.dw[w0..w0 + gh * inp], inp, &ga, &f.x[xo..xo + inp]);
                mtv(wd, inp, &ga, &mut gr.dx[xo..xo + inp]);
                add(&mut gr.db[b0..], &ga);
                outer(&mut gr.dr[r0..r0 + direct * h], h, &ga[..direct], &hp);
                mtv(&rd[..direct * h], h, &ga[..direct], &mut dhp);
                dh = dhp;
            }
            gr.dh0[so..so + h].copy_from_slice(&dh);
            if g == 4 {
                gr.dc0[so..so + h].copy_from_slice(&dc);
            }
        }
    }
    gr
}

pub(super) fn register(r: &mut Registry) {
    for op in [Recurrent::Rnn, Recurrent::Gru, Recurrent::Lstm] {
        r.add(op.name(), op);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Node;

    fn t(shape: &[usize], seed: usize) -> Tensor {
        let n: usize = shape.iter().product();
        let v = (0..n)
            .map(|i| (((i * 7 + seed * 13) % 17) as f32 - 8.0) * 0.05)
            .collect();
        Tensor::f32(shape.to_vec(), v)
    }

    /// With `Y` not declared, the forward makes it an extra and the backward
    /// reads it there: the gradients equal those with `Y` declared.
    #[test]
    fn y_as_an_extra() {
        let ins = [
            t(&[3, 2, 4], 1),
            t(&[2, 20, 4], 2),
            t(&[2, 20, 5], 3),
            t(&[2, 40], 4),
        ];
        let mut attrs = Attrs::default();
        attrs.insert("hidden_size", Attr::Int(5));
        attrs.insert("direction", Attr::String("bidirectional".into()));
        let node = |y: bool| Node {
            name: "lstm".into(),
            op_type: "LSTM".into(),
            domain: Default::default(),
            inputs: (0..4).map(Some).collect(),
            outputs: vec![y.then_some(10), Some(11), Some(12)].into(),
            attrs: attrs.clone(),
        };
        let facts: Vec<Fact> = ins
            .iter()
            .map(|t| Fact::new(t.dtype(), t.shape.clone()))
            .collect();
        let gh = t(&[2, 2, 5], 5);
        let gc = t(&[2, 2, 5], 6);
        let mut answers = Vec::new();
        for y in [true, false] {
            let n = node(y);
            let rcx = Cx {
                node: &n,
                inputs: facts.iter().map(Some).collect(),
                opset: 14,
            };
            let outs = Recurrent::Lstm.infer(&rcx).unwrap();
            let out_facts: Vec<Option<&Fact>> = outs
                .iter()
                .enumerate()
                .map(|(i, f)| (i > 0 || y).then_some(f))
                .collect();
            let kcx = KernelCx {
                node: &n,
                inputs: ins.iter().map(Some).collect(),
                outputs: out_facts.clone(),
                opset: 14,
                seed: 0,
                dropout: false,
                extras: true,
            };
            let fwd = Recurrent::Lstm.forward_cpu(&kcx).unwrap();
            assert_eq!(fwd.len(), if y { 4 } else { 5 });
            let mut saved = vec![
                (Saved::Input(0), &ins[0]),
                (Saved::Input(1), &ins[1]),
                (Saved::Input(2), &ins[2]),
                (Saved::Extra(0), &fwd[3]),
            ];
            saved.push(if y {
                (Saved::Output(0), &fwd[0])
            } else {
                (Saved::Extra(1), &fwd[4])
            });
            let bcx = BackwardCx {
                node: &n,
                inputs: facts.iter().map(Some).collect(),
                outputs: out_facts,
                opset: 14,
                saved,
                grads: vec![None, Some(&gh), Some(&gc)],
                wanted: vec![0, 1, 2, 3],
                dropout: false,
            };
            let g = Recurrent::Lstm.backward_cpu(&bcx).unwrap();
            answers.push(
                g.into_iter()
                    .map(|t| t.map(|t| t.to_f64s()))
                    .collect::<Vec<_>>(),
            );
        }
        assert_eq!(answers[0], answers[1]);
        assert!(answers[0][1].as_ref().unwrap().iter().any(|&v| v != 0.0));
    }
}
