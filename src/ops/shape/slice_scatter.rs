//! `SliceScatter(data, updates)` (domain `ai.memplan`, attributes `starts` and
//! `reduction`): `data` with the box that starts at `starts` (one start per leading
//! axis; the box's sizes are `updates`' leading dims, every later axis whole)
//! replaced by `updates` (`reduction` "none") or incremented by it ("add").
//!
//! It is what PyTorch runs for `x[:, :, 1:, 1:] = y` or `+= y`: a copy into (or an
//! add onto) a slice view, with no index tensor. The TorchScript exporter writes the
//! same assignment as a `ScatterND` whose indices are the box's whole coordinate
//! grid, built from shapes (`Range` → `Expand` → `Unsqueeze` → `Concat`): an int64
//! tensor of 8·k bytes per updated element that PyTorch never makes, and which the
//! scatter's backward would save (MViT v2's relative-position add: 600 MiB a block
//! at batch 1). Lowering (src/infer/lower) replaces such scatters with this op and drops the
//! grid's nodes. Its backward saves nothing: `updates`' gradient is the box of the
//! output's, `data`'s the output's with the box zeroed ("none") or whole ("add").

use super::*;

/// The internal op lowering (src/infer/lower) writes for a box-shaped `ScatterND`.
pub const SLICE_SCATTER: &str = "SliceScatter";

pub(super) struct SliceScatter;

/// Whether a box of `upd`'s shape at `starts` (every later axis whole) lies in `data`.
fn check_box(starts: &[i64], data: &[usize], upd: &[usize]) -> RuleResult<()> {
    if upd.len() != data.len() || starts.len() > data.len() {
        return Err(format!(
            "updates {upd:?} and {} starts do not fit data {data:?}",
            starts.len()
        )
        .into());
    }
    for (a, (&d, &u)) in data.iter().zip(upd).enumerate() {
        let s = starts.get(a).copied().unwrap_or(0);
        let whole = a >= starts.len();
        if s < 0 || (whole && u != d) || s as usize + u > d {
            return Err(format!(
                "a box of {upd:?} at {starts:?} does not fit data {data:?} (axis {a})"
            )
            .into());
        }
    }
    Ok(())
}

/// Each updated element's flat offset in `data`, row-major over `updates`.
fn offsets(starts: &[i64], data: &[usize], upd: &[usize]) -> RuleResult<Vec<usize>> {
    check_box(starts, data, upd)?;
    let st = strides(data);
    let n: usize = upd.iter().product();
    let ust = strides(upd);
    Ok((0..n)
        .map(|i| {
            (0..upd.len())
                .map(|a| {
                    let c = (i / ust[a]) % upd[a] + starts.get(a).copied().unwrap_or(0) as usize;
                    c * st[a]
                })
                .sum()
        })
        .collect())
}

fn starts(attrs: &crate::ir::Attrs) -> &[i64] {
    attrs.ints("starts").unwrap_or(&[])
}

fn adds(attrs: &crate::ir::Attrs) -> RuleResult<bool> {
    match attrs.string("reduction").unwrap_or("none") {
        "none" => Ok(false),
        "add" => Ok(true),
        r => Err(format!("reduction '{r}' is not none or add").into()),
    }
}

impl Op for SliceScatter {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (x, u) = (cx.input(0)?, cx.input(1)?);
        adds(cx.attrs())?;
        check_box(starts(cx.attrs()), &x.shape, &u.shape)?;
        Ok(vec![Fact::new(x.dtype, x.shape.clone())])
    }
    no_flops!();
    /// Both gradients are slices of the incoming one; nothing is saved.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if !out[0].dtype.is_float() {
            return Ok(None);
        }
        Ok(Some(Backward::each(&[0, 1], &[], 0)))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// A copy of `data` with the box written (or added to).
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let (x, u) = (cx.input(0)?, cx.input(1)?);
        let f = cx.out(0)?;
        let add = adds(cx.attrs())?;
        let offs = offsets(starts(cx.attrs()), &x.shape, &u.shape)?;
        let (mut out, upd) = (x.to_f64s(), u.to_f64s());
        for (&o, &v) in offs.iter().zip(&upd) {
            out[o] = if add { out[o] + v } else { v };
        }
        Ok(vec![Tensor::from_f64(f.dtype, x.shape.clone(), out)?])
    }
    /// `updates`: the box of the gradient; `data`: the gradient, its box zeroed
    /// unless the box was added to.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let (x, u) = (cx.input(0)?, cx.input(1)?);
        let offs = offsets(starts(cx.attrs()), &x.shape, &u.shape)?;
        let g = cx.grad(0)?;
        let mut res = Vec::new();
        if cx.wants(1) {
            res.push((1, offs.iter().map(|&o| g[o]).collect()));
        }
        if cx.wants(0) {
            let mut dx = g.to_vec();
            if !adds(cx.attrs())? {
                offs.iter().for_each(|&o| dx[o] = 0.0);
            }
            res.push((0, dx));
        }
        cx.answer(res)
    }
    /// Runs on the host on the GPU backend (no device kernel yet).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

#[cfg(test)]
mod tests {
    use super::offsets;

    #[test]
    fn box_offsets() {
        // data [2, 3, 4], box [2, 2, 4] at (0, 1): rows 1 and 2 of each plane.
        let o = offsets(&[0, 1], &[2, 3, 4], &[2, 2, 4]).unwrap();
        let want: Vec<usize> = [4..12, 16..24].into_iter().flatten().collect();
        assert_eq!(o, want);
        assert!(offsets(&[0, 2], &[2, 3, 4], &[2, 2, 4]).is_err());
        assert!(offsets(&[0], &[2, 3, 4], &[2, 2, 4]).is_err());
    }
}
