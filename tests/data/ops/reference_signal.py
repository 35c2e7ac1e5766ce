"""Expected values of tests/exec_signal.rs: DFT, STFT and Det against PyTorch
(torch.fft, torch.stft, torch.linalg.det and their autograd gradients, float32
on the CPU), the window generators and MelWeightMatrix against the onnx
package's reference implementation (onnx.reference, ONNX 1.23).

Run with python3 from the repository root; it writes
tests/exec_signal/signal_ref.rs.

Inputs follow the Rust test helper `seq(shape, scale)`:
((i * 37 % 101) - 50) * scale over the row-major index i; the output gradients
of the backward cases are `seq(out_shape, 0.01)`.
"""
import io

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

OUT = io.StringIO()


def seq(shape, scale):
    n = 1
    for d in shape:
        n *= d
    v = [((i * 37 % 101) - 50) * scale for i in range(n)]
    return torch.tensor(v, dtype=torch.float32).reshape(shape)


def fmt(t):
    return ", ".join(f"{x:.8e}" for x in t.flatten().tolist())


def const(name, desc, t):
    t = torch.as_tensor(t).to(torch.float32)
    OUT.write(f"// {desc}: shape {list(t.shape)}\n")
    OUT.write(f"pub const {name}: [f32; {t.numel()}] = [{fmt(t)}];\n")


def pairs(z):
    return torch.view_as_real(z).contiguous()


def cplx(x):
    # [..., 2] real pairs -> complex; [..., 1] real -> complex.
    if x.shape[-1] == 1:
        return x[..., 0].to(torch.complex64)
    return torch.view_as_complex(x.contiguous())


def grad_of(f, x):
    """f(x) and d<seq(out, 0.01), f(x)>/dx by autograd."""
    x = x.clone().requires_grad_(True)
    y = f(x)
    g = seq(list(y.shape), 0.01)
    (y * g).sum().backward()
    return y.detach(), x.grad


def dft():
    # fft of a real signal along axis 1, prime length (opset 17 attribute).
    x = seq([2, 7, 3, 1], 0.1)
    y, dx = grad_of(lambda x: pairs(torch.fft.fft(cplx(x), dim=1)), x)
    const("DFT_REAL_AXIS1", "view_as_real(fft(seq([2,7,3,1],0.1)[...,0], dim=1))", y)
    const("DFT_REAL_AXIS1_DX", "its gradient", dx)
    # ifft of a complex signal truncated to 6 (dft_length 6 of 12).
    x = seq([2, 12, 2], 0.1)
    y, dx = grad_of(lambda x: pairs(torch.fft.ifft(cplx(x), n=6, dim=1)), x)
    const("DFT_IFFT_TRUNC", "view_as_real(ifft(complex seq([2,12,2],0.1), n=6, dim=1))", y)
    const("DFT_IFFT_TRUNC_DX", "its gradient", dx)
    # rfft zero-padded to 16 (onesided, dft_length 16 of 10).
    x = seq([3, 10, 1], 0.1)
    y, dx = grad_of(lambda x: pairs(torch.fft.rfft(x[..., 0], n=16, dim=1)), x)
    const("DFT_RFFT_PAD", "view_as_real(rfft(seq([3,10,1],0.1)[...,0], n=16, dim=1))", y)
    const("DFT_RFFT_PAD_DX", "its gradient", dx)
    # irfft, even default length 2*(5-1) = 8 and odd 9.
    x = seq([2, 5, 2], 0.1)
    y, dx = grad_of(lambda x: torch.fft.irfft(cplx(x), dim=1)[..., None], x)
    const("DFT_IRFFT_8", "irfft(complex seq([2,5,2],0.1), dim=1)[..., None]", y)
    const("DFT_IRFFT_8_DX", "its gradient", dx)
    y, dx = grad_of(lambda x: torch.fft.irfft(cplx(x), n=9, dim=1)[..., None], x)
    const("DFT_IRFFT_9", "irfft(complex seq([2,5,2],0.1), n=9, dim=1)[..., None]", y)
    const("DFT_IRFFT_9_DX", "its gradient", dx)
    # A long mixed-radix transform (400 = 2^4 * 5^2, Whisper's n_fft).
    x = seq([1, 400, 1], 0.01)
    y = pairs(torch.fft.rfft(x[..., 0], dim=1))
    const("DFT_RFFT_400", "view_as_real(rfft(seq([1,400,1],0.01)[...,0], dim=1))", y)


def stft():
    # Real signal, periodic Hann window of 16, hop 4, onesided.
    x = seq([2, 64, 1], 0.1)
    w = torch.hann_window(16)

    def f(x):
        s = torch.stft(x[..., 0], 16, hop_length=4, window=w, center=False,
                       onesided=True, return_complex=True)
        return pairs(s.transpose(1, 2))

    y, dx = grad_of(f, x)
    const("STFT_HANN", "stft(seq([2,64,1],0.1), 16, hop 4, hann_window(16), center=False) as [b, frames, bins, 2]", y)
    const("STFT_HANN_DX", "its gradient", dx)
    # Complex signal, no window (frame_length 8), hop 3, two-sided.
    x = seq([1, 20, 2], 0.1)

    def g(x):
        s = torch.stft(cplx(x), 8, hop_length=3, center=False, onesided=False,
                       return_complex=True)
        return pairs(s.transpose(1, 2))

    y, dx = grad_of(g, x)
    const("STFT_COMPLEX", "stft(complex seq([1,20,2],0.1), 8, hop 3, no window, onesided=False, center=False)", y)
    const("STFT_COMPLEX_DX", "its gradient", dx)


def run_onnx(op, inputs, attrs, opset=17):
    names = [f"i{k}" for k in range(len(inputs))]
    node = helper.make_node(op, names, ["y"], **attrs)
    ins = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for n, v in zip(names, inputs)]
    graph = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return ReferenceEvaluator(model).run(None, dict(zip(names, inputs)))[0]


def generators():
    for op in ["HannWindow", "HammingWindow", "BlackmanWindow"]:
        for periodic in [1, 0]:
            y = run_onnx(op, [np.array(10, dtype=np.int64)], {"periodic": periodic})
            const(f"{op.upper()}_{periodic}", f"onnx reference {op}(10, periodic={periodic})", torch.from_numpy(y))
    # torch's periodic Hann window is the same.
    y = run_onnx("HannWindow", [np.array(16, dtype=np.int64)], {})
    assert np.allclose(y, torch.hann_window(16).numpy(), atol=1e-7)
    for name, args in [
        ("MEL_8_16", (8, 16, 8192, 0.0, 4096.0)),
        ("MEL_10_64", (10, 64, 16000, 20.0, 7600.0)),
    ]:
        ins = [np.array(args[0], dtype=np.int64), np.array(args[1], dtype=np.int64),
               np.array(args[2], dtype=np.int64), np.array(args[3], dtype=np.float32),
               np.array(args[4], dtype=np.float32)]
        y = run_onnx("MelWeightMatrix", ins, {})
        const(name, f"onnx reference MelWeightMatrix{args}", torch.from_numpy(y))


def det():
    x = seq([3, 4, 4], 0.1)
    y, dx = grad_of(torch.linalg.det, x)
    const("DET_3X4X4", "linalg.det(seq([3,4,4],0.1))", y)
    const("DET_3X4X4_DX", "its gradient", dx)
    # Exactly singular (LU pivot 0): PyTorch's gradient is 0.
    x = torch.tensor([[[1.0, 2.0], [2.0, 4.0]], [[0.5, -1.0], [2.0, 3.0]]])
    y, dx = grad_of(torch.linalg.det, x)
    const("DET_SINGULAR", "linalg.det([[[1,2],[2,4]], [[0.5,-1],[2,3]]])", y)
    const("DET_SINGULAR_DX", "its gradient", dx)


if __name__ == "__main__":
    OUT.write("//! Reference values of tests/exec_signal.rs, written by\n")
    OUT.write(f"//! tests/data/ops/reference_signal.py (torch {torch.__version__.split('+')[0]}, onnx {onnx.__version__}).\n")
    OUT.write("#![cfg_attr(rustfmt, rustfmt_skip)]\n\n")
    dft()
    stft()
    generators()
    det()
    with open("tests/exec_signal/signal_ref.rs", "w") as f:
        f.write(OUT.getvalue())
