//! DepthToSpace and SpaceToDepth: a 6-D reshape, a transpose and a reshape back
//! (PyTorch's pixel_shuffle / pixel_unshuffle), as a gather by flat index.

#[allow(unused_imports)]
use super::*;
use crate::ir::Attrs;

/// `DepthToSpace(x)` (`to_space`) or `SpaceToDepth(x)` of 4-D `x`, attribute
/// `blocksize`; DepthToSpace's `mode` DCR (default) or CRD. A new tensor (the
/// transpose makes a copy in PyTorch); nothing saved for backward. FLOPs: 0.
pub(super) struct DepthSpace {
    pub(super) to_space: bool,
}

impl DepthSpace {
    /// The output shape, and the input's 6-D view with the permutation that
    /// orders it as the output.
    fn plan(
        &self,
        cx_attrs: &Attrs,
        x: &[usize],
    ) -> RuleResult<(Vec<usize>, [usize; 6], [usize; 6])> {
        let &[n, c, h, w] = x else {
            return Err(format!("the input must be 4-D, got {x:?}").into());
        };
        let b = dim(
            cx_attrs.int("blocksize").ok_or("blocksize is required")?,
            "blocksize",
        )?;
        if b == 0 {
            return Err("blocksize must be positive".into());
        }
        let too_large = || format!("blocksize {b} makes the output too large");
        if self.to_space {
            let bb = b.checked_mul(b).ok_or_else(too_large)?;
            if c % bb != 0 {
                return Err(format!("{c} channels do not divide by blocksize² = {bb}").into());
            }
            let cc = c / bb;
            let (oh, ow) = (h.checked_mul(b), w.checked_mul(b));
            let (Some(oh), Some(ow)) = (oh, ow) else {
                return Err(too_large().into());
            };
            let out = vec![n, cc, oh, ow];
            Ok(match cx_attrs.string("mode").unwrap_or("DCR") {
                "DCR" => (out, [n, b, b, cc, h, w], [0, 3, 4, 1, 5, 2]),
                "CRD" => (out, [n, cc, b, b, h, w], [0, 1, 4, 2, 5, 3]),
                other => return Err(format!("unknown mode '{other}'").into()),
            })
        } else {
            if h % b != 0 || w % b != 0 {
                return Err(format!("{h}×{w} does not divide by blocksize {b}").into());
            }
            let oc = b.checked_mul(b).and_then(|bb| c.checked_mul(bb));
            let out = vec![n, oc.ok_or_else(too_large)?, h / b, w / b];
            Ok((out, [n, c, h / b, b, w / b, b], [0, 3, 5, 1, 2, 4]))
        }
    }

    /// For every output element (row-major), the flat input index it reads.
    fn sources(&self, attrs: &Attrs, x: &[usize]) -> RuleResult<(Vec<usize>, Vec<usize>)> {
        let (out, v6, perm) = self.plan(attrs, x)?;
        let st = strides(&v6);
        let od: Vec<usize> = perm.iter().map(|&p| v6[p]).collect();
        let ost = strides(&od);
        let total: usize = od.iter().product();
        let idx = (0..total)
            .map(|k| (0..6).map(|j| (k / ost[j]) % od[j] * st[perm[j]]).sum())
            .collect();
        Ok((out, idx))
    }
}

impl Op for DepthSpace {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let (shape, _, _) = self.plan(cx.attrs(), &x.shape)?;
        Ok(vec![Fact::new(x.dtype, shape)])
    }
    no_flops!();
    /// The inverse rearrangement of the gradient: nothing saved.
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        if !out[0].dtype.is_float() {
            return Ok(None);
        }
        Ok(Some(Backward::each(&[0], &[], 0)))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let x = cx.input(0)?;
        let (shape, idx) = self.sources(cx.attrs(), &x.shape)?;
        Ok(vec![x.select(&idx, shape)])
    }
    /// Each output element's gradient back to the element it read.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let x = cx.input(0)?;
        let (_, idx) = self.sources(cx.attrs(), &x.shape)?;
        let g = cx.grad(0)?;
        let mut dx = vec![0f32; idx.len()];
        for (k, &i) in idx.iter().enumerate() {
            dx[i] = g[k];
        }
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
