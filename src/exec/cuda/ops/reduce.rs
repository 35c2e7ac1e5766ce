//! Reductions.

#[allow(unused_imports)]
use super::*;

/// The reduced axes of a Reduce* node (reduce.rs `Reduce::axes`: from input 1 at
/// opset ≥ 13 for ReduceSum, ≥ 18 for the others, else the `axes` attribute).
pub(super) fn reduce_axes(
    op: &str,
    inputs: &[Option<&Fact>],
    attrs: &Attrs,
    opset: i64,
    rank: usize,
) -> Result<Vec<usize>> {
    let from = if op == "ReduceSum" { 13 } else { 18 };
    let raw: Option<Vec<i64>> = if opset >= from {
        match inputs.get(1).copied().flatten() {
            None => None,
            Some(f) => Some(
                f.value
                    .as_ref()
                    .ok_or_else(|| CudaError::Kernel("the axes input must be a constant".into()))?
                    .to_ints(),
            ),
        }
    } else {
        attrs.ints("axes").map(|v| v.to_vec())
    };
    match raw {
        Some(a) if !a.is_empty() => Ok(a
            .iter()
            .map(|&x| axis(x, rank))
            .collect::<std::result::Result<_, _>>()?),
        _ if attrs.int_or("noop_with_empty_axes", 0) != 0 => Ok(Vec::new()),
        _ => Ok((0..rank).collect()),
    }
}

pub(super) fn reduce_fwd(dev: &Device, cx: &DevKernelCx) -> Result<Vec<DeviceTensor>> {
    let x = cx.input(0)?;
    let op = cx.node.op_type.as_str();
    let r = x.shape.len();
    let axes = reduce_axes(op, &cx.input_facts, cx.attrs(), cx.opset, r)?;
    let st = strides(&x.shape);
    let kept_shape: Vec<usize> = (0..r)
        .map(|i| if axes.contains(&i) { 1 } else { x.shape[i] })
        .collect();
    let keep_st: Vec<i64> = (0..r)
        .map(|i| if axes.contains(&i) { 0 } else { st[i] as i64 })
        .collect();
    let red_shape: Vec<usize> = axes.iter().map(|&i| x.shape[i]).collect();
    let red_st: Vec<i64> = axes.iter().map(|&i| st[i] as i64).collect();
    let count: usize = red_shape.iter().product();
    let (code, scale) = match op {
        "ReduceSum" => (0, 1.0),
        "ReduceMean" => (0, 1.0 / count.max(1) as f64),
        "ReduceMax" => (1, 1.0),
        _ => (2, 1.0),
    };
    let y = reduce_launch(
        dev,
        code,
        x,
        &cx.out(0)?.shape,
        Strided::new(&kept_shape, &[keep_st])?,
        count,
        Strided::new(&red_shape, &[red_st])?,
        scale,
    )?;
    Ok(vec![y])
}

pub(super) fn reduce_bwd(dev: &Device, cx: &DevBackwardCx) -> Result<Vec<(usize, DeviceTensor)>> {
    let f = cx.input(0)?;
    let op = cx.node.op_type.as_str();
    let r = f.shape.len();
    let axes = reduce_axes(op, &cx.inputs, cx.attrs(), cx.opset, r)?;
    let kept_shape: Vec<usize> = (0..r)
        .map(|i| if axes.contains(&i) { 1 } else { f.shape[i] })
        .collect();
    let count: usize = axes.iter().map(|&i| f.shape[i]).product();
    let g = cx.grad(dev, 0)?;
    // g viewed with the reduced axes kept (size 1), broadcast to the input.
    let d = Strided::new(
        &f.shape,
        &[bcast_strides(&kept_shape, &f.shape)
            .iter()
            .map(|&v| v as i64)
            .collect()],
    )?;
    let dx = strided_new(dev, &g, &f.shape, d)?;
    if op == "ReduceMean" {
        let n = dx.numel();
        let s = 1.0 / count.max(1) as f32;
        dev.launch(
            "scale_f32",
            n,
            &[Arg::n(n), Arg::F32(s), Arg::t(&dx), Arg::t(&dx)],
        )?;
    }
    Ok(vec![(0, dx)])
}
