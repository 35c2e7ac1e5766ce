//! `RotaryEmbedding(input, cos_cache, sin_cache, position_ids?)` (opset 23):
//! rotary position embedding as LLaMA-style models apply it to queries and keys.
//!
//! `input` is `[B, heads, S, head]`, or `[B, S, heads·head]` with `num_heads`.
//! The first `rotary_embedding_dim` (default: all) of each head's elements turn
//! by position: pairs `(x1, x2)` (the two halves, or even and odd elements when
//! `interleaved`) become `(cos·x1 − sin·x2, sin·x1 + cos·x2)`, cos and sin read
//! at `position_ids[b, s]` of caches `[positions, rot/2]`, or at `[b, s]` of
//! caches `[B, S, rot/2]` without position ids. The rest passes through.

use super::{
    Arity, Autocast, Backward, BackwardCx, CudaKernels, Cx, Fact, KernelCx, Op, Registry,
    RuleResult, Saved, Storage,
};
use crate::numeric::Tensor;

/// The layout: `(B, heads, S, head, rot)` and whether the input is 3-D.
struct Dims {
    b: usize,
    h: usize,
    s: usize,
    d: usize,
    rot: usize,
    three_d: bool,
}

impl Dims {
    fn of(cx_attrs: &crate::ir::Attrs, shape: &[usize]) -> RuleResult<Dims> {
        let (b, h, s, d, three_d) = match *shape {
            [b, h, s, d] => (b, h, s, d, false),
            [b, s, hidden] => {
                let h = cx_attrs.int_or("num_heads", 0);
                if h < 1 || hidden % h as usize != 0 {
                    return Err(format!(
                        "a 3-D input [B, S, {hidden}] needs num_heads dividing {hidden}, got {h}"
                    )
                    .into());
                }
                (b, h as usize, s, hidden / h as usize, true)
            }
            _ => {
                return Err(format!("input must be 3-D or 4-D, got {shape:?}").into());
            }
        };
        let rot = match cx_attrs.int_or("rotary_embedding_dim", 0) {
            0 => d,
            r if r > 0 && r as usize <= d && r % 2 == 0 => r as usize,
            r => return Err(format!("rotary_embedding_dim {r} does not fit head size {d}").into()),
        };
        if rot % 2 != 0 {
            return Err(format!("the rotated size {rot} must be even").into());
        }
        Ok(Dims {
            b,
            h,
            s,
            d,
            rot,
            three_d,
        })
    }

    /// Flat index of element `k` of head `hh` at `(bb, ss)`.
    fn at(&self, bb: usize, hh: usize, ss: usize, k: usize) -> usize {
        if self.three_d {
            ((bb * self.s + ss) * self.h + hh) * self.d + k
        } else {
            ((bb * self.h + hh) * self.s + ss) * self.d + k
        }
    }

    /// The indices of pair `i`'s two elements within a head.
    fn pair(&self, i: usize, interleaved: bool) -> (usize, usize) {
        if interleaved {
            (2 * i, 2 * i + 1)
        } else {
            (i, i + self.rot / 2)
        }
    }
}

/// The cache row of `(b, s)`: the position id's, or `b·S + s` without ids.
fn cache_row(
    pos: Option<&[i64]>,
    dims: &Dims,
    b: usize,
    s: usize,
    rows: usize,
) -> RuleResult<usize> {
    let r = match pos {
        Some(p) => p[b * dims.s + s],
        None => (b * dims.s + s) as i64,
    };
    if r < 0 || r as usize >= rows {
        return Err(format!("position {r} is outside the cache's {rows} rows").into());
    }
    Ok(r as usize)
}

struct Rotary;

impl Rotary {
    /// Runs the rotation (`sign` 1) or its transpose (`sign` −1, the gradient)
    /// of `x` in f32.
    fn turn(
        x: &[f32],
        dims: &Dims,
        cos: &[f32],
        sin: &[f32],
        pos: Option<&[i64]>,
        interleaved: bool,
        sign: f32,
    ) -> RuleResult<Vec<f32>> {
        let half = dims.rot / 2;
        let rows = cos.len() / half.max(1);
        let mut y = x.to_vec();
        for b in 0..dims.b {
            for s in 0..dims.s {
                let row = cache_row(pos, dims, b, s, rows)?;
                for h in 0..dims.h {
                    for i in 0..half {
                        let (c, sn) = (cos[row * half + i], sign * sin[row * half + i]);
                        let (p, q) = dims.pair(i, interleaved);
                        let (ip, iq) = (dims.at(b, h, s, p), dims.at(b, h, s, q));
                        let (x1, x2) = (x[ip], x[iq]);
                        y[ip] = c * x1 - sn * x2;
                        y[iq] = sn * x1 + c * x2;
                    }
                }
            }
        }
        Ok(y)
    }
}

impl Op for Rotary {
    fn arity(&self) -> Arity {
        Arity::new(3, 4, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        if !x.dtype.is_float() {
            return Err(format!("input must be floating point, got {}", x.dtype).into());
        }
        let d = Dims::of(cx.attrs(), &x.shape)?;
        let want = match cx.opt(3) {
            Some(p) => {
                if p.shape != [d.b, d.s] {
                    return Err(format!(
                        "position_ids is {:?}, expected [{}, {}]",
                        p.shape, d.b, d.s
                    )
                    .into());
                }
                None
            }
            None => Some(vec![d.b, d.s, d.rot / 2]),
        };
        for (i, name) in [(1, "cos_cache"), (2, "sin_cache")] {
            let c = cx.input(i)?;
            let ok = match &want {
                Some(w) => c.shape == *w,
                None => c.rank() == 2 && c.shape[1] == d.rot / 2,
            };
            if !ok {
                return Err(format!(
                    "{name} is {:?}, which does not fit rotating {} of {} elements",
                    c.shape, d.rot, d.d
                )
                .into());
            }
        }
        Ok(vec![Fact::new(x.dtype, x.shape.clone())])
    }
    /// 3 per rotated element (two multiplies and an add); the rest is a copy.
    fn flops(&self, cx: &Cx, _out: &[Fact]) -> u64 {
        let Ok(x) = cx.input(0) else { return 0 };
        let Ok(d) = Dims::of(cx.attrs(), &x.shape) else {
            return 0;
        };
        ((d.b * d.h * d.s * d.rot) as u64).saturating_mul(3)
    }
    /// As `x·cos + rotate_half(x)·sin` (LLaMA): the multiplications save cos and
    /// sin (here the caches, and the position ids that index them); the input
    /// needs none. Backward FLOPs: the forward's.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let mut needs = vec![Saved::Input(1), Saved::Input(2)];
        if cx.opt(3).is_some() {
            needs.push(Saved::Input(3));
        }
        Ok(Some(Backward::each(&[0], &needs, self.flops(cx, out))))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// As the module documents, in f32.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let d = Dims::of(cx.attrs(), &x.shape)?;
        let pos = cx.opt(3).map(|p| p.to_i64s());
        let y = Self::turn(
            &x.to_f32()?,
            &d,
            &cx.input(1)?.to_f32()?,
            &cx.input(2)?.to_f32()?,
            pos.as_deref(),
            cx.attrs().int_or("interleaved", 0) != 0,
            1.0,
        )?;
        Ok(vec![Tensor::from_f32(x.dtype(), x.shape.clone(), y)?])
    }
    /// The transposed rotation (sin negated) of the incoming gradient.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let f = cx.input(0)?;
        let d = Dims::of(cx.attrs(), &f.shape)?;
        let pos = match cx.inputs.get(3).copied().flatten() {
            Some(_) => Some(cx.saved(Saved::Input(3))?.to_i64s()),
            None => None,
        };
        let dx = Self::turn(
            &cx.grad(0)?,
            &d,
            &cx.saved(Saved::Input(1))?.to_f32()?,
            &cx.saved(Saved::Input(2))?.to_f32()?,
            pos.as_deref(),
            cx.attrs().int_or("interleaved", 0) != 0,
            -1.0,
        )?;
        cx.answer(vec![(0, dx)])
    }
    /// Runs on the host on the GPU backend (no device kernels yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

pub(super) fn register(r: &mut Registry) {
    r.add("RotaryEmbedding", Rotary);
}
