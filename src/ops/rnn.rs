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
//! Shape rules, FLOPs and the backward rule; no CPU kernels yet (each says so).

use super::{
    no_backward_kernel, no_kernel, Arity, Autocast, Backward, BackwardCx, CudaKernels, Cx, Fact,
    Grad, KernelCx, Op, Registry, RuleResult, Saved, Storage,
};
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

struct Recurrent;

impl Recurrent {
    fn gates(op: &str) -> usize {
        match op {
            "LSTM" => 4,
            "GRU" => 3,
            _ => 1,
        }
    }

    fn dims(cx: &Cx) -> RuleResult<Dims> {
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
        let batch_first = cx.attrs().int_or("layout", 0) != 0;
        let (seq, batch) = if batch_first {
            (x.shape[1], x.shape[0])
        } else {
            (x.shape[0], x.shape[1])
        };
        let dirs = match cx.attrs().string("direction").unwrap_or("forward") {
            "forward" | "reverse" => 1,
            "bidirectional" => 2,
            d => {
                return Err(
                    format!("direction '{d}' is not forward, reverse or bidirectional").into(),
                )
            }
        };
        let gates = Self::gates(&cx.node.op_type);
        let hidden = match cx.attrs().int("hidden_size") {
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
        let d = Self::dims(cx)?;
        let dt = cx.input(0)?.dtype;
        let n_out = cx.n_outputs();
        if n_out > if d.gates == 4 { 3 } else { 2 } {
            return Err(format!("{} has {n_out} outputs", cx.node.op_type).into());
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
        let Ok(d) = Self::dims(cx) else { return 0 };
        let gh = (d.gates * d.hidden) as u64;
        let per = 2 * gh * (d.input + d.hidden) as u64 + 3 * gh + 3 * d.hidden as u64;
        ((d.seq * d.dirs * d.batch) as u64).saturating_mul(per)
    }
    /// As cuDNN's RNN backward in PyTorch (`_cudnn_rnn`): it saves the input, the
    /// weights, the initial states, the output `Y` (all hidden states) and the
    /// reserve space of every step's gate activations, modelled as
    /// `seq·dirs·batch·G·hidden` elements (cuDNN's reserve holds at least these).
    /// `Y` is output 0 when the node declares it, else an extra. Gradients for X,
    /// W, R, B and the initial states. Backward FLOPs: twice the forward's.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let d = Self::dims(cx)?;
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
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        no_kernel(cx)
    }
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        no_backward_kernel(cx)
    }
    /// No CPU kernel to run on the host yet, no device kernels.
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    /// cuDNN RNNs are on autocast's lower-precision list.
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Half
    }
}

pub(super) fn register(r: &mut Registry) {
    for op in ["RNN", "GRU", "LSTM"] {
        r.add(op, Recurrent);
    }
}
