//! `GatherND` (opsets 11, 12, 13): slices of `data` picked by index tuples, with
//! leading batch dimensions (`batch_dims`, opset 12+), as the ONNX spec defines it
//! (<https://onnx.ai/onnx/operators/onnx__GatherND.html>) and the TorchScript
//! exporter writes PyTorch's advanced indexing `x[i0, i1]` with tensor indices.

use super::{
    input0_backward, no_gradient, Arity, Autocast, Backward, BackwardCx, CudaKernels, Cx, Fact,
    KernelCx, Op, Registry, RuleError, RuleResult, Saved, Storage,
};
use crate::ir::value::MAX_FOLD_ELEMS;
use crate::ir::{Attrs, Value};
use crate::numeric::Tensor;

/// The index arithmetic of one GatherND: tuple `t` (row-major over
/// `indices.shape[..q-1]`) reads the slice of `slice` elements at
/// `(t / per_batch) · batch_stride + Σ_j index_j · strides[j]`.
#[derive(Debug, Clone, PartialEq)]
struct Plan {
    /// Output shape: `indices.shape[..q-1] + data.shape[b+k..]`.
    out: Vec<usize>,
    /// Index tuple length `k = indices.shape[-1]`.
    k: usize,
    /// Tuples per batch: `Π indices.shape[b..q-1]`.
    per_batch: usize,
    /// Elements per batch of `data`: `Π data.shape[b..]`.
    batch_stride: usize,
    /// Sizes of the indexed axes `data.shape[b..b+k]`.
    dims: Vec<usize>,
    /// Row-major strides of the indexed axes.
    strides: Vec<usize>,
    /// Elements per gathered slice: `Π data.shape[b+k..]`.
    slice: usize,
}

/// `batch_dims` (an attribute since opset 12; GatherND-11 has none).
fn batch_dims(attrs: &Attrs, opset: i64) -> RuleResult<usize> {
    let b = attrs.int_or("batch_dims", 0);
    if opset < 12 && b != 0 {
        return Err(
            format!("batch_dims {b} needs opset 12 (GatherND-11 has no batch dimensions)").into(),
        );
    }
    Ok(usize::try_from(b).map_err(|_| format!("batch_dims {b} is negative"))?)
}

fn plan(data: &[usize], ind: &[usize], b: usize) -> RuleResult<Plan> {
    let (r, q) = (data.len(), ind.len());
    if r == 0 || q == 0 {
        return Err(format!("data {data:?} and indices {ind:?} must both have rank >= 1").into());
    }
    if b >= r.min(q) {
        return Err(format!(
            "batch_dims {b} must be less than the ranks of data {data:?} and indices {ind:?}"
        )
        .into());
    }
    if data[..b] != ind[..b] {
        return Err(format!(
            "the {b} batch dimensions of data {data:?} and indices {ind:?} differ"
        )
        .into());
    }
    let k = ind[q - 1];
    if k < 1 || k > r - b {
        return Err(format!(
            "indices {ind:?}: the last dimension {k} must be between 1 and the rank of data {data:?} less batch_dims {b} ({})",
            r - b
        ).into());
    }
    let mut out = ind[..q - 1].to_vec();
    out.extend(&data[b + k..]);
    let slice: usize = data[b + k..].iter().product();
    let mut strides = vec![slice; k];
    for j in (0..k.saturating_sub(1)).rev() {
        strides[j] = strides[j + 1] * data[b + j + 1];
    }
    Ok(Plan {
        out,
        k,
        per_batch: ind[b..q - 1].iter().product(),
        batch_stride: data[b..].iter().product(),
        dims: data[b..b + k].to_vec(),
        strides,
        slice,
    })
}

impl Plan {
    /// The flat offset in `data` of each tuple's slice; negative indices count
    /// from the end, out-of-range ones are an error.
    fn bases(&self, idx: &[i64]) -> RuleResult<Vec<usize>> {
        idx.chunks(self.k.max(1))
            .enumerate()
            .map(|(t, tuple)| {
                let batch = t / self.per_batch.max(1);
                let mut off = batch * self.batch_stride;
                for (j, &i) in tuple.iter().enumerate() {
                    let d = self.dims[j] as i64;
                    if i < -d || i >= d {
                        return Err(RuleError::from(format!(
                            "index {i} out of range for axis {j} of size {d} (index tuple {t})"
                        )));
                    }
                    off += (if i < 0 { i + d } else { i }) as usize * self.strides[j];
                }
                Ok(off)
            })
            .collect()
    }

    /// Flat offsets in `data` of every output element, row-major.
    fn offsets(&self, idx: &[i64]) -> RuleResult<Vec<usize>> {
        let bases = self.bases(idx)?;
        let mut flat = Vec::with_capacity(bases.len() * self.slice);
        for b in bases {
            flat.extend(b..b + self.slice);
        }
        Ok(flat)
    }
}

/// `GatherND(data, indices)`.
///
/// Output shape: `indices.shape[..q-1] + data.shape[b + k..]`, `k =
/// indices.shape[-1]` with `1 ≤ k ≤ rank(data) − b` and `b = batch_dims <
/// min(rank(data), rank(indices))`; the first `b` dimensions of data and indices
/// must be equal. Indices int64 (the spec) or int32; negative ones count from the
/// end, out-of-range ones are an error. Folds its value when data and indices are
/// small constants with values (as Gather does).
///
/// FLOPs: 0 (data movement).
struct GatherND;

impl Op for GatherND {
    fn arity(&self) -> Arity {
        Arity::new(2, 2, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (x, ind) = (cx.input(0)?, cx.input(1)?);
        if !ind.dtype.is_int() {
            return Err(format!("indices must be int64 or int32, got {}", ind.dtype).into());
        }
        let b = batch_dims(cx.attrs(), cx.opset)?;
        let p = plan(&x.shape, &ind.shape, b)?;
        let value = match (&x.value, &ind.value) {
            (Some(v), Some(iv)) if super::numel(&p.out) <= MAX_FOLD_ELEMS as u64 => {
                let flat = p.offsets(&iv.to_ints())?;
                Some(Value {
                    shape: p.out.clone(),
                    data: v.data.gather(flat.into_iter()),
                })
            }
            _ => None,
        };
        Ok(vec![Fact {
            dtype: x.dtype,
            shape: p.out,
            value: value.map(Box::new),
        }])
    }
    fn flops(&self, _cx: &Cx, _out: &[Fact]) -> u64 {
        0
    }
    /// PyTorch's advanced indexing (`IndexBackward0`) saves the indices, not the
    /// data: the gradient is zeros with the output gradient added at the indices.
    /// Backward FLOPs: one add per output element (the scatter-add).
    fn backward(&self, _cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        input0_backward(out, &[Saved::Input(1)])
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// The slices of `data` (any dtype) at the runtime indices.
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let (x, ind) = (cx.input(0)?, cx.input(1)?);
        let b = batch_dims(cx.attrs(), cx.opset)?;
        let p = plan(&x.shape, &ind.shape, b)?;
        let flat = p.offsets(&ind.to_i64s())?;
        Ok(vec![x.select(&flat, p.out)])
    }
    /// Zeros with each output gradient slice added at its tuple's slice of `data`
    /// (repeated tuples add), tuples in order: deterministic.
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        if !cx.output(0)?.dtype.is_float() {
            return no_gradient(cx);
        }
        let x = cx.input(0)?;
        let ind = cx.saved(Saved::Input(1))?;
        let b = batch_dims(cx.attrs(), cx.opset)?;
        let p = plan(&x.shape, &ind.shape, b)?;
        let bases = p.bases(&ind.to_i64s())?;
        let g = cx.grad(0)?;
        let mut dx = vec![0f32; x.shape.iter().product()];
        for (t, base) in bases.into_iter().enumerate() {
            let src = &g[t * p.slice..(t + 1) * p.slice];
            for (d, &gv) in dx[base..base + p.slice].iter_mut().zip(src) {
                *d += gv;
            }
        }
        cx.answer(vec![(0, dx)])
    }
    /// No device kernel: the host path (downloaded inputs, the CPU kernels).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

/// Registers GatherND.
pub fn register(r: &mut Registry) {
    r.add("GatherND", GatherND);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attr, DType, Data, Node};

    fn node(b: Option<i64>) -> Node {
        Node {
            name: "g".into(),
            op_type: "GatherND".into(),
            domain: Default::default(),
            inputs: vec![Some(0), Some(1)].into(),
            outputs: vec![Some(100)].into(),
            attrs: Attrs::from_iter(b.map(|b| ("batch_dims".to_string(), Attr::Int(b)))),
        }
    }

    fn infer(b: Option<i64>, opset: i64, x: Fact, ind: Fact) -> RuleResult<Fact> {
        let n = node(b);
        let cx = Cx {
            node: &n,
            inputs: smallvec::smallvec![Some(&x), Some(&ind)],
            opset,
        };
        let out = GatherND.infer(&cx)?;
        assert_eq!(GatherND.flops(&cx, &out), 0, "data movement");
        Ok(out.into_iter().next().unwrap())
    }

    fn f(shape: &[usize]) -> Fact {
        Fact::new(DType::F32, shape.to_vec())
    }

    fn i(shape: &[usize]) -> Fact {
        Fact::new(DType::I64, shape.to_vec())
    }

    #[test]
    fn shapes_of_every_opset_form() {
        // Opset 11: no batch_dims; full tuples give elements, short ones slices.
        let sh = |b, opset, x: &[usize], ind: &[usize]| {
            infer(b, opset, f(x), i(ind)).map(|o| o.shape).unwrap()
        };
        assert_eq!(sh(None, 11, &[2, 2], &[2, 2]), vec![2]);
        assert_eq!(sh(None, 11, &[2, 2], &[2, 1]), vec![2, 2]);
        assert_eq!(sh(None, 11, &[2, 2, 2], &[2, 1, 2]), vec![2, 1, 2]);
        assert_eq!(sh(None, 11, &[5, 6, 7, 8], &[3, 4, 2]), vec![3, 4, 7, 8]);
        // Opset 12/13: batch_dims.
        assert_eq!(sh(Some(1), 12, &[2, 2, 2], &[2, 1]), vec![2, 2]);
        assert_eq!(sh(Some(1), 13, &[2, 3, 4, 5], &[2, 6, 2]), vec![2, 6, 5]);
        assert_eq!(sh(Some(2), 13, &[2, 3, 4, 5], &[2, 3, 7, 2]), vec![2, 3, 7]);
        assert_eq!(sh(Some(0), 13, &[4], &[3, 1]), vec![3]);
        // int32 indices.
        let o = infer(None, 13, f(&[4, 5]), Fact::new(DType::I32, vec![3, 1])).unwrap();
        assert_eq!(o.shape, vec![3, 5]);
        assert_eq!(o.dtype, DType::F32);
    }

    #[test]
    fn folds_small_constants() {
        // data [[0,1],[2,3]], indices [[1],[0]] → [[2,3],[0,1]]; [[0,1],[1,-2]] → [1,2].
        let data = Fact::with_value(DType::I64, Value::ints(vec![2, 2], vec![0, 1, 2, 3]));
        let ind = Fact::with_value(DType::I64, Value::ints(vec![2, 1], vec![1, 0]));
        let o = infer(None, 13, data.clone(), ind).unwrap();
        assert_eq!(o.value.unwrap().data, Data::Int(vec![2, 3, 0, 1]));
        let ind = Fact::with_value(DType::I64, Value::ints(vec![2, 2], vec![0, 1, 1, -2]));
        let o = infer(None, 13, data.clone(), ind).unwrap();
        assert_eq!(o.value.unwrap().data, Data::Int(vec![1, 2]));
        // batch_dims 1, indices [2, 1]: batch j picks data[j, ind[j]].
        let ind = Fact::with_value(DType::I64, Value::ints(vec![2, 1], vec![1, 0]));
        let o = infer(Some(1), 13, data, ind).unwrap();
        assert_eq!(o.value.unwrap().data, Data::Int(vec![1, 2]));
    }

    #[test]
    fn bad_inputs_are_errors() {
        let err = |b, opset, x: Fact, ind: Fact| infer(b, opset, x, ind).unwrap_err();
        assert!(err(None, 13, f(&[2, 3]), i(&[4, 3]))
            .to_string()
            .contains("between 1 and"));
        assert!(err(Some(1), 13, f(&[2, 3]), i(&[2, 2]))
            .to_string()
            .contains("between 1 and"));
        assert!(err(None, 13, f(&[2, 3]), i(&[4, 0]))
            .to_string()
            .contains("between 1 and"));
        assert!(err(Some(2), 13, f(&[2, 3]), i(&[2, 3, 1]))
            .to_string()
            .contains("less than"));
        assert!(err(Some(1), 13, f(&[2, 3]), i(&[3, 1]))
            .to_string()
            .contains("batch dimensions"));
        assert!(err(Some(-1), 13, f(&[2, 3]), i(&[2, 1]))
            .to_string()
            .contains("negative"));
        assert!(err(Some(1), 11, f(&[2, 3]), i(&[2, 1]))
            .to_string()
            .contains("opset 12"));
        assert!(err(None, 13, f(&[]), i(&[1]))
            .to_string()
            .contains("rank >= 1"));
        assert!(err(None, 13, f(&[3]), i(&[]))
            .to_string()
            .contains("rank >= 1"));
        assert!(err(None, 13, f(&[3]), f(&[1]))
            .to_string()
            .contains("int64 or int32"));
        // An out-of-range constant index while folding.
        let data = Fact::with_value(DType::I64, Value::ints(vec![2], vec![5, 6]));
        let ind = Fact::with_value(DType::I64, Value::ints(vec![1, 1], vec![2]));
        assert!(err(None, 13, data, ind)
            .to_string()
            .contains("out of range"));
    }

    #[test]
    fn kernel_rejects_out_of_range_indices() {
        let n = node(None);
        let out = f(&[1]);
        let xt = Tensor::f32(vec![2, 3], vec![0.0; 6]);
        let it = Tensor::i64(vec![1, 2], vec![1, -4]);
        let kcx = KernelCx {
            node: &n,
            inputs: vec![Some(&xt), Some(&it)],
            outputs: vec![Some(&out)],
            opset: 13,
            seed: 0,
            dropout: false,
            extras: false,
        };
        let e = GatherND.forward_cpu(&kcx).unwrap_err();
        assert!(
            e.to_string()
                .contains("index -4 out of range for axis 1 of size 3"),
            "{e}"
        );
    }

    #[test]
    fn saves_the_indices_only() {
        let n = node(None);
        let (x, ind) = (f(&[4, 5]), i(&[3, 1]));
        let cx = Cx {
            node: &n,
            inputs: smallvec::smallvec![Some(&x), Some(&ind)],
            opset: 13,
        };
        let out = GatherND.infer(&cx).unwrap();
        let bw = GatherND.backward(&cx, &out).unwrap().unwrap();
        assert_eq!(bw, Backward::each(&[0], &[Saved::Input(1)], 15));
        assert_eq!(GatherND.storage(&cx), Storage::New);
        // Integer data: no gradient.
        let xi = i(&[4, 5]);
        let cx = Cx {
            node: &n,
            inputs: smallvec::smallvec![Some(&xi), Some(&ind)],
            opset: 13,
        };
        let out = GatherND.infer(&cx).unwrap();
        assert_eq!(GatherND.backward(&cx, &out).unwrap(), None);
    }

    #[test]
    fn runs_on_the_host_on_cuda() {
        assert_eq!(GatherND.cuda_kernels("GatherND"), CudaKernels::HOST);
    }
}
