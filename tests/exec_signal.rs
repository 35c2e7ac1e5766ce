//! The signal ops' and Det's CPU kernels against their references:
//! - DFT (fft, ifft with truncation, rfft with zero padding, irfft of even and
//!   odd length, a 400-point mixed-radix rfft), STFT (a Hann window; a complex
//!   signal without window) and Det (a batch, an exactly singular matrix):
//!   values and input gradients against torch 2.15's `torch.fft`, `torch.stft`
//!   and `torch.linalg.det` with autograd;
//! - the window generators and MelWeightMatrix against the onnx package's
//!   reference implementation.
//!
//! The constants are tests/exec_signal/signal_ref.rs, written by
//! tests/data/ops/reference_signal.py. Each case runs the op's shape rule, its
//! forward kernel (with the extras a training step makes) and its backward
//! kernel, which gets only the saved tensors its rule lists, for the output
//! gradient `seq(out_shape, 0.01)`. Error metric: the max-norm relative error
//! `max_i |got_i − want_i| / max(max_i |want_i|, 1e-6)`.

// Reference constants are printed with 9 significant digits (f32 round trip).
#![allow(clippy::excessive_precision)]

#[path = "exec_signal/signal_ref.rs"]
mod signal_ref;

use memplan::exec::Tensor;
use memplan::ir::{Attr, Attrs, Node, Value};
use memplan::ops::{registry, BackwardCx, Cx, Fact, KernelCx, RuleResult, Saved};
use signal_ref::*;

/// `((i·37 mod 101) − 50)·scale` over the row-major index, as the script.
fn seq(shape: &[usize], scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v = (0..n)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) * scale)
        .collect();
    Tensor::f32(shape.to_vec(), v)
}

fn int(v: i64) -> Option<Tensor> {
    Some(Tensor::i64(vec![], vec![v]))
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths");
    let scale = want.iter().fold(1e-6f64, |m, &w| m.max(w.abs() as f64));
    got.iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w as f64).abs())
        .fold(0.0, f64::max)
        / scale
}

fn close(got: &Tensor, want: &[f32], tol: f64, what: &str) {
    let e = rel_err(got.as_f32().unwrap(), want);
    eprintln!("{what}: relative error {e:.2e}");
    assert!(e < tol, "{what}: relative error {e:.3e}");
}

/// One node of `op` over `inputs` (`None`: omitted).
struct Run {
    node: Node,
    inputs: Vec<Option<Tensor>>,
    facts: Vec<Option<Fact>>,
    outs: Vec<Fact>,
    opset: i64,
}

impl Run {
    fn new(op: &str, attrs: &[(&str, i64)], inputs: Vec<Option<Tensor>>, opset: i64) -> Run {
        let node = Node {
            name: format!("test_{op}").into(),
            op_type: op.into(),
            domain: Default::default(),
            inputs: inputs
                .iter()
                .enumerate()
                .map(|(i, t)| t.as_ref().map(|_| i))
                .collect(),
            outputs: vec![Some(100)].into(),
            attrs: Attrs::from_iter(attrs.iter().map(|(k, v)| (k.to_string(), Attr::Int(*v)))),
        };
        let facts: Vec<Option<Fact>> = inputs
            .iter()
            .map(|t| {
                t.as_ref().map(|t| {
                    let mut f = Fact::new(t.dtype(), t.shape.clone());
                    if !t.dtype().is_float() || t.rank() == 0 {
                        f.value = Some(Box::new(Value {
                            shape: t.shape.clone(),
                            data: if t.dtype().is_float() {
                                memplan::ir::Data::Float(t.to_f64s())
                            } else {
                                memplan::ir::Data::Int(t.to_i64s())
                            },
                        }));
                    }
                    f
                })
            })
            .collect();
        let cx = Cx {
            node: &node,
            inputs: facts.iter().map(Option::as_ref).collect(),
            opset,
        };
        let outs = registry().get("", op).unwrap().infer(&cx).unwrap();
        drop(cx);
        Run {
            node,
            inputs,
            facts,
            outs,
            opset,
        }
    }

    /// The declared output, then the extras.
    fn forward(&self, extras: bool) -> Vec<Tensor> {
        let ys = self.try_forward(extras).unwrap();
        assert_eq!(
            (ys[0].dtype(), &ys[0].shape),
            (self.outs[0].dtype, &self.outs[0].shape)
        );
        ys
    }

    fn try_forward(&self, extras: bool) -> RuleResult<Vec<Tensor>> {
        let rule = registry().get("", &self.node.op_type).unwrap();
        let kcx = KernelCx {
            node: &self.node,
            inputs: self.inputs.iter().map(Option::as_ref).collect(),
            outputs: self.outs.iter().map(Some).collect(),
            opset: self.opset,
            seed: 1,
            dropout: true,
            extras,
        };
        rule.forward_cpu(&kcx)
    }

    /// The output and input 0's gradient for the output gradient
    /// `seq(out, 0.01)`, the backward seeing only what its rule saves.
    fn grad(&self) -> (Tensor, Tensor) {
        let rule = registry().get("", &self.node.op_type).unwrap();
        let cx = Cx {
            node: &self.node,
            inputs: self.facts.iter().map(Option::as_ref).collect(),
            opset: self.opset,
        };
        let bw = rule.backward(&cx, &self.outs).unwrap().unwrap();
        let ys = self.forward(true);
        let needs: Vec<Saved> = bw
            .grads
            .iter()
            .filter(|g| g.input == 0)
            .flat_map(|g| g.needs.clone())
            .collect();
        let saved = needs
            .iter()
            .map(|&s| {
                let t = match s {
                    Saved::Input(i) => self.inputs[i].as_ref().unwrap(),
                    Saved::Output(i) => &ys[i],
                    Saved::Extra(i) => &ys[1 + i],
                };
                (s, t)
            })
            .collect();
        let g = seq(&self.outs[0].shape, 0.01);
        let bcx = BackwardCx {
            node: &self.node,
            inputs: self.facts.iter().map(Option::as_ref).collect(),
            outputs: self.outs.iter().map(Some).collect(),
            opset: self.opset,
            saved,
            grads: vec![Some(&g)],
            wanted: vec![0],
            dropout: true,
        };
        let mut dx = rule.backward_cpu(&bcx).unwrap();
        (ys[0].clone(), dx.remove(0).unwrap())
    }
}

/// Value and gradient against PyTorch's.
fn check(run: Run, y: &[f32], dx: &[f32], what: &str) {
    let (got_y, got_dx) = run.grad();
    close(&got_y, y, 1e-6, what);
    close(&got_dx, dx, 1e-6, &format!("{what}, gradient"));
}

#[test]
fn dft_matches_torch_fft() {
    // fft along axis 1 of a real signal of prime length (opset 17 attribute).
    let x = seq(&[2, 7, 3, 1], 0.1);
    let run = Run::new("DFT", &[("axis", 1)], vec![Some(x)], 17);
    check(run, &DFT_REAL_AXIS1, &DFT_REAL_AXIS1_DX, "fft, n 7");
    // ifft truncated to 6 of 12 (opset 20, axis input -2 by default).
    let x = seq(&[2, 12, 2], 0.1);
    let run = Run::new("DFT", &[("inverse", 1)], vec![Some(x), int(6)], 20);
    check(run, &DFT_IFFT_TRUNC, &DFT_IFFT_TRUNC_DX, "ifft, n 6 of 12");
    // rfft zero-padded to 16.
    let x = seq(&[3, 10, 1], 0.1);
    let run = Run::new(
        "DFT",
        &[("onesided", 1)],
        vec![Some(x), int(16), int(1)],
        20,
    );
    check(run, &DFT_RFFT_PAD, &DFT_RFFT_PAD_DX, "rfft, n 16 of 10");
    // irfft, even (default 2·(5 − 1)) and odd lengths.
    let x = seq(&[2, 5, 2], 0.1);
    let attrs = [("onesided", 1), ("inverse", 1), ("axis", 1)];
    let run = Run::new("DFT", &attrs, vec![Some(x.clone())], 17);
    check(run, &DFT_IRFFT_8, &DFT_IRFFT_8_DX, "irfft, n 8");
    let run = Run::new("DFT", &attrs, vec![Some(x), int(9)], 17);
    check(run, &DFT_IRFFT_9, &DFT_IRFFT_9_DX, "irfft, n 9");
    // 400 = 2⁴·5², Whisper's n_fft.
    let x = seq(&[1, 400, 1], 0.01);
    let run = Run::new("DFT", &[("onesided", 1)], vec![Some(x)], 20);
    close(&run.forward(false)[0], &DFT_RFFT_400, 1e-6, "rfft, n 400");
}

#[test]
fn stft_matches_torch_stft() {
    // A periodic Hann window of 16 by 4, from the HannWindow kernel.
    let w = Run::new("HannWindow", &[], vec![int(16)], 17).forward(false)[0].clone();
    let x = seq(&[2, 64, 1], 0.1);
    let run = Run::new("STFT", &[], vec![Some(x), int(4), Some(w)], 17);
    check(run, &STFT_HANN, &STFT_HANN_DX, "stft, hann 16 by 4");
    // A complex signal, no window (frame_length 8), by 3, two-sided.
    let x = seq(&[1, 20, 2], 0.1);
    let ins = vec![Some(x), int(3), None, int(8)];
    let run = Run::new("STFT", &[("onesided", 0)], ins, 17);
    check(
        run,
        &STFT_COMPLEX,
        &STFT_COMPLEX_DX,
        "stft, complex, no window",
    );
}

#[test]
fn windows_and_mel_weights_match_the_onnx_reference() {
    let cases: [(&str, i64, &[f32]); 6] = [
        ("HannWindow", 1, &HANNWINDOW_1),
        ("HannWindow", 0, &HANNWINDOW_0),
        ("HammingWindow", 1, &HAMMINGWINDOW_1),
        ("HammingWindow", 0, &HAMMINGWINDOW_0),
        ("BlackmanWindow", 1, &BLACKMANWINDOW_1),
        ("BlackmanWindow", 0, &BLACKMANWINDOW_0),
    ];
    for (op, periodic, want) in cases {
        let y = Run::new(op, &[("periodic", periodic)], vec![int(10)], 17).forward(false);
        let got = y[0].as_f32().unwrap();
        // Absolute: the reference computes in float32.
        let e = got
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(e < 1e-6, "{op} periodic {periodic}: {e:e}");
    }
    let mel = |b: i64, n: i64, rate: i64, lo: f32, hi: f32| {
        let s = |v: f32| Some(Tensor::f32(vec![], vec![v]));
        let ins = vec![int(b), int(n), int(rate), s(lo), s(hi)];
        Run::new("MelWeightMatrix", &[], ins, 17).forward(false)[0].clone()
    };
    // Exact: the weights are ratios of small integers.
    let y = mel(8, 16, 8192, 0.0, 4096.0);
    assert_eq!(y.shape, vec![9, 8]);
    assert_eq!(y.as_f32().unwrap(), &MEL_8_16[..]);
    let y = mel(10, 64, 16000, 20.0, 7600.0);
    assert_eq!(y.shape, vec![33, 10]);
    assert_eq!(y.as_f32().unwrap(), &MEL_10_64[..]);
}

#[test]
fn det_matches_torch_linalg_det() {
    let run = Run::new("Det", &[], vec![Some(seq(&[3, 4, 4], 0.1))], 11);
    check(run, &DET_3X4X4, &DET_3X4X4_DX, "det of 3 4×4");
    // An exactly singular matrix beside a regular one: PyTorch's gradient of
    // the singular one is 0 (a zero pivot perturbed by eps, times det = 0).
    let x = Tensor::f32(vec![2, 2, 2], vec![1.0, 2.0, 2.0, 4.0, 0.5, -1.0, 2.0, 3.0]);
    let run = Run::new("Det", &[], vec![Some(x)], 11);
    check(run, &DET_SINGULAR, &DET_SINGULAR_DX, "det, singular");
}

/// The extras are PyTorch's: the LU factors of `Aᵀ` and LAPACK's pivots
/// (values from `torch.ops.aten._linalg_det`, torch 2.15).
#[test]
fn det_saves_the_factors_of_the_transpose() {
    let x = Tensor::f32(
        vec![3, 3],
        vec![1.0, 5.0, 2.0, 3.0, 1.0, 0.0, 2.0, 2.0, 7.0],
    );
    let ys = Run::new("Det", &[], vec![Some(x)], 11).forward(true);
    assert_eq!(ys[0].as_f32().unwrap(), &[-90.0]);
    let lu = [5.0, 1.0, 2.0, 0.2, 2.8, 1.6, 0.4, -1.0 / 7.0, 6.428_571_5];
    close(&ys[1], &lu, 1e-6, "LU of the transpose");
    assert_eq!(ys[2].to_i64s(), vec![2, 2, 3]);
}

/// Inputs the ops cannot take are refused in one line, never a panic.
#[test]
fn bad_inputs_are_refused_in_one_line() {
    let one_line = |e: String, has: &str| {
        assert!(e.contains(has) && !e.contains('\n'), "{e}");
    };
    // A zero-length transform.
    let node = Run::new("DFT", &[], vec![Some(seq(&[1, 4, 1], 0.1))], 17).node;
    let x = Fact::new(memplan::ir::DType::F32, vec![1, 4, 1]);
    let zero = Fact::with_value(memplan::ir::DType::I64, Value::ints(vec![], vec![0]));
    let cx = Cx {
        node: &node,
        inputs: smallvec::smallvec![Some(&x), Some(&zero)],
        opset: 17,
    };
    let e = registry().get("", "DFT").unwrap().infer(&cx).unwrap_err();
    one_line(e.to_string(), "transform length is 0");
    // Mel points beyond the DFT's bins (an upper edge above Nyquist): the
    // reference's indexing fails there too.
    let s = |v: f32| Some(Tensor::f32(vec![], vec![v]));
    let ins = vec![int(4), int(16), int(8000), s(0.0), s(16000.0)];
    let e = Run::new("MelWeightMatrix", &[], ins, 17).try_forward(false);
    one_line(e.unwrap_err().to_string(), "outside the 9 DFT bins");
    // A double window: the executor holds no float64 tensors.
    let run = Run::new("HannWindow", &[("output_datatype", 11)], vec![int(4)], 17);
    let e = run.try_forward(false).unwrap_err().to_string();
    one_line(e, "float64");
}
