//! Convolutions and pooling over `[N, C, spatial...]` tensors.

use super::{
    dim, numel, Arity, Backward, Cx, Fact, Grad, Op, Registry, RuleResult, Saved, Storage,
};
use crate::ir::{Attrs, DType};

/// Output spatial size of a sliding window (Conv, MaxPool, AveragePool), following
/// ONNX `auto_pad`, `pads`, `strides`, `dilations` and `ceil_mode`.
pub fn window_out(
    input: &[usize],
    kernel: &[usize],
    attrs: &Attrs,
    ceil_mode: bool,
) -> RuleResult<Vec<usize>> {
    let nd = input.len();
    let list = |name: &str, default: i64| -> RuleResult<Vec<i64>> {
        match attrs.ints(name) {
            Some(v) if v.len() == nd => Ok(v.to_vec()),
            Some(v) => Err(format!(
                "attribute '{name}' has {} values for {nd} spatial dims",
                v.len()
            )),
            None => Ok(vec![default; nd]),
        }
    };
    let strides = list("strides", 1)?;
    let dil = list("dilations", 1)?;
    if strides.iter().chain(&dil).any(|&s| s < 1) {
        return Err("strides and dilations must be >= 1".into());
    }
    let pads = match attrs.ints("pads") {
        Some(p) if p.len() == 2 * nd => p.to_vec(),
        Some(p) => {
            return Err(format!(
                "attribute 'pads' has {} values for {nd} spatial dims",
                p.len()
            ))
        }
        None => vec![0; 2 * nd],
    };
    if pads.iter().any(|&p| p < 0) {
        return Err(format!("negative pads {pads:?}"));
    }
    let auto = attrs.string("auto_pad").unwrap_or("NOTSET");
    let mut out = Vec::with_capacity(nd);
    for i in 0..nd {
        // i128: attribute values can be anything a file says; nothing here may overflow.
        let (x, s, d) = (input[i] as i128, strides[i] as i128, dil[i] as i128);
        let (pb, pe) = (pads[i] as i128, pads[i + nd] as i128);
        let span = d * (kernel[i] as i128 - 1) + 1;
        let o = match auto {
            "SAME_UPPER" | "SAME_LOWER" => (x + s - 1) / s,
            "VALID" => {
                if x < span {
                    0
                } else {
                    (x - span) / s + 1
                }
            }
            "NOTSET" | "" => {
                let padded = x + pb + pe;
                if padded < span {
                    return Err(format!(
                        "window {span} is larger than padded input {padded} on spatial dim {i}"
                    ));
                }
                if ceil_mode {
                    let mut o = (padded - span + s - 1) / s + 1;
                    // The last window must start inside the input or left padding.
                    if (o - 1) * s >= x + pb {
                        o -= 1;
                    }
                    o
                } else {
                    (padded - span) / s + 1
                }
            }
            other => return Err(format!("unknown auto_pad '{other}'")),
        };
        let o = i64::try_from(o).map_err(|_| format!("output size {o} is too large"))?;
        out.push(dim(o, "output size")?);
    }
    Ok(out)
}

fn check_nc(x: &Fact, what: &str) -> RuleResult<()> {
    if x.rank() < 3 {
        return Err(format!(
            "{what} input must be [N, C, spatial...], got {:?}",
            x.shape
        ));
    }
    Ok(())
}

/// Backward of Conv and ConvTranspose: the weight for the input's gradient, the
/// input for the weight's, nothing for the bias's; the forward's FLOPs per gradient.
fn conv_backward(forward_flops: u64) -> Backward {
    Backward {
        grads: vec![
            Grad {
                input: 0,
                needs: vec![Saved::Input(1)],
            },
            Grad {
                input: 1,
                needs: vec![Saved::Input(0)],
            },
            Grad {
                input: 2,
                needs: vec![],
            },
        ],
        extras: Vec::new(),
        flops: forward_flops.saturating_mul(2),
    }
}

/// `Conv(X, W, B?)`, W = `[M, C/group, k...]`.
/// FLOPs: 2·(C/group)·prod(k) per output element (multiply-adds), + 1 per element for bias.
struct Conv;

impl Op for Conv {
    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (x, w) = (cx.input(0)?, cx.input(1)?);
        check_nc(x, "Conv")?;
        if w.rank() != x.rank() {
            return Err(format!(
                "weight {:?} does not match input {:?}",
                w.shape, x.shape
            ));
        }
        let group = cx.attrs().int_or("group", 1);
        if group < 1 || x.shape[1] as i64 % group != 0 || w.shape[0] as i64 % group != 0 {
            return Err(format!("group {group} does not divide the channels"));
        }
        if w.shape[1] as i128 * group as i128 != x.shape[1] as i128 {
            return Err(format!(
                "input has {} channels, weight {:?} with group {group} expects {}",
                x.shape[1],
                w.shape,
                w.shape[1] as i128 * group as i128
            ));
        }
        if let Some(b) = cx.opt(2) {
            if b.shape != [w.shape[0]] {
                return Err(format!("bias {:?} must be [{}]", b.shape, w.shape[0]));
            }
        }
        let kernel = &w.shape[2..];
        if let Some(ks) = cx.attrs().ints("kernel_shape") {
            if ks.iter().map(|&k| k as usize).ne(kernel.iter().copied()) {
                return Err(format!(
                    "kernel_shape {ks:?} differs from weight {:?}",
                    w.shape
                ));
            }
        }
        let mut shape = vec![x.shape[0], w.shape[0]];
        shape.extend(window_out(&x.shape[2..], kernel, cx.attrs(), false)?);
        Ok(vec![Fact::new(x.dtype, shape)])
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let Some(w) = cx.inputs[1] else { return 0 };
        let per = numel(&w.shape[1..]).saturating_mul(2);
        let bias = cx.opt(2).is_some() as u64;
        per.saturating_add(bias).saturating_mul(out[0].numel())
    }
    /// ConvolutionBackward saves the input (for the weight's gradient) and the weight
    /// (for the input's). Backward FLOPs: the forward's multiply-adds once per gradient.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(Some(conv_backward(self.flops(cx, out))))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
}

/// `ConvTranspose(X, W, B?)`, W = `[C, M/group, k...]`.
/// FLOPs: 2·(M/group)·prod(k) per input element, + 1 per output element for bias.
struct ConvTranspose;

impl Op for ConvTranspose {
    fn arity(&self) -> Arity {
        Arity::new(2, 3, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let (x, w) = (cx.input(0)?, cx.input(1)?);
        check_nc(x, "ConvTranspose")?;
        if w.rank() != x.rank() || w.shape[0] != x.shape[1] {
            return Err(format!(
                "weight {:?} does not match input {:?}",
                w.shape, x.shape
            ));
        }
        let group = cx.attrs().int_or("group", 1).max(1) as usize;
        let nd = x.rank() - 2;
        let a = cx.attrs();
        let get =
            |n: &str, d: i64, len: usize| a.ints(n).map(|v| v.to_vec()).unwrap_or(vec![d; len]);
        let (s, d, op, p) = (
            get("strides", 1, nd),
            get("dilations", 1, nd),
            get("output_padding", 0, nd),
            get("pads", 0, 2 * nd),
        );
        if s.len() != nd || d.len() != nd || op.len() != nd || p.len() != 2 * nd {
            return Err("strides/dilations/pads do not match the spatial rank".into());
        }
        let w_shape = &w.shape;
        let out_channels = w.shape[1]
            .checked_mul(group)
            .ok_or_else(|| format!("group {group} is out of range"))?;
        let mut shape = vec![x.shape[0], out_channels];
        if let Some(os) = a.ints("output_shape") {
            let os = &os[os.len().saturating_sub(nd)..];
            for &v in os {
                shape.push(dim(v, "output_shape")?);
            }
        } else {
            for i in 0..nd {
                let w = |v: i64| v as i128;
                let o = w(s[i]) * (x.shape[2 + i] as i128 - 1)
                    + w(op[i])
                    + (w_shape[2 + i] as i128 - 1) * w(d[i])
                    + 1
                    - w(p[i])
                    - w(p[i + nd]);
                let o = i64::try_from(o).map_err(|_| format!("output size {o} is too large"))?;
                shape.push(dim(o, "output size")?);
            }
        }
        Ok(vec![Fact::new(x.dtype, shape)])
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let (Some(x), Some(w)) = (cx.inputs[0], cx.inputs[1]) else {
            return 0;
        };
        numel(&w.shape[1..])
            .saturating_mul(2)
            .saturating_mul(x.numel())
            .saturating_add(cx.opt(2).map_or(0, |_| out[0].numel()))
    }
    /// As Conv: input for the weight's gradient, weight for the input's.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(Some(conv_backward(self.flops(cx, out))))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
}

/// `MaxPool` / `AveragePool` / `LpPool`. MaxPool's optional second output is int64
/// indices. FLOPs: prod(kernel) per output element (compares or adds).
struct Pool {
    max: bool,
}

impl Op for Pool {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, if self.max { 2 } else { 1 })
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        check_nc(x, "pooling")?;
        let ks = cx
            .attrs()
            .ints("kernel_shape")
            .ok_or("missing attribute 'kernel_shape'")?;
        if ks.len() != x.rank() - 2 || ks.iter().any(|&k| k < 1) {
            return Err(format!(
                "kernel_shape {ks:?} does not fit input {:?}",
                x.shape
            ));
        }
        let kernel: Vec<usize> = ks.iter().map(|&k| k as usize).collect();
        let ceil = cx.attrs().int_or("ceil_mode", 0) != 0;
        let mut shape = x.shape[..2].to_vec();
        shape.extend(window_out(&x.shape[2..], &kernel, cx.attrs(), ceil)?);
        let mut out = vec![Fact::new(x.dtype, shape.clone())];
        if cx.n_outputs() > 1 {
            out.push(Fact::new(DType::I64, shape));
        }
        Ok(out)
    }
    fn flops(&self, cx: &Cx, out: &[Fact]) -> u64 {
        let k: u64 = cx.attrs().ints("kernel_shape").map_or(1, |ks| {
            ks.iter()
                .fold(1u64, |a, &k| a.saturating_mul(k.max(0) as u64))
        });
        k.saturating_mul(out[0].numel())
    }
    /// MaxPool saves its input and the int64 argmax indices (shaped like the output);
    /// average pooling needs only shapes. Backward FLOPs: one per input element.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let n = cx.inputs[0].map_or(0, Fact::numel);
        if self.max {
            Ok(Some(Backward {
                grads: vec![Grad {
                    input: 0,
                    needs: vec![Saved::Input(0), Saved::Extra(0)],
                }],
                extras: vec![Fact::new(DType::I64, out[0].shape.clone())],
                flops: n,
            }))
        } else {
            Ok(Some(Backward::each(&[0], &[], n)))
        }
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
}

/// `GlobalAveragePool` / `GlobalMaxPool` / `GlobalLpPool`: `[N, C, 1, ...]`.
/// FLOPs: one add or compare per input element.
struct GlobalPool;

impl Op for GlobalPool {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        check_nc(x, "global pooling")?;
        let mut shape = x.shape[..2].to_vec();
        shape.resize(x.rank(), 1);
        Ok(vec![Fact::new(x.dtype, shape)])
    }
    fn flops(&self, cx: &Cx, _out: &[Fact]) -> u64 {
        cx.inputs[0].map_or(0, Fact::numel)
    }
    /// Global average pooling needs only shapes; global max pooling saves input and
    /// indices (adaptive max pool). Backward FLOPs: one per input element.
    fn backward(&self, cx: &Cx, out: &[Fact]) -> RuleResult<Option<Backward>> {
        let n = cx.inputs[0].map_or(0, Fact::numel);
        if cx.node.op_type == "GlobalMaxPool" {
            return Ok(Some(Backward {
                grads: vec![Grad {
                    input: 0,
                    needs: vec![Saved::Input(0), Saved::Extra(0)],
                }],
                extras: vec![Fact::new(DType::I64, out[0].shape.clone())],
                flops: n,
            }));
        }
        Ok(Some(Backward::each(&[0], &[], n)))
    }
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
}

/// Registers convolution and pooling ops.
pub fn register(r: &mut Registry) {
    r.add("Conv", Conv);
    r.add("ConvTranspose", ConvTranspose);
    r.add("MaxPool", Pool { max: true });
    r.add("AveragePool", Pool { max: false });
    r.add("LpPool", Pool { max: false });
    r.add("GlobalAveragePool", GlobalPool);
    r.add("GlobalMaxPool", GlobalPool);
    r.add("GlobalLpPool", GlobalPool);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Attr;

    fn attrs(v: &[(&str, Attr)]) -> Attrs {
        Attrs(v.iter().map(|(k, a)| (k.to_string(), a.clone())).collect())
    }

    #[test]
    fn resnet_stem() {
        // 224 → conv 7x7 s2 p3 → 112 → maxpool 3x3 s2 p1 → 56
        let a = attrs(&[
            ("strides", Attr::Ints(vec![2, 2])),
            ("pads", Attr::Ints(vec![3, 3, 3, 3])),
        ]);
        assert_eq!(
            window_out(&[224, 224], &[7, 7], &a, false).unwrap(),
            vec![112, 112]
        );
        let a = attrs(&[
            ("strides", Attr::Ints(vec![2, 2])),
            ("pads", Attr::Ints(vec![1, 1, 1, 1])),
        ]);
        assert_eq!(
            window_out(&[112, 112], &[3, 3], &a, false).unwrap(),
            vec![56, 56]
        );
    }

    #[test]
    fn ceil_mode_and_same() {
        let a = attrs(&[("strides", Attr::Ints(vec![2]))]);
        assert_eq!(window_out(&[5], &[2], &a, false).unwrap(), vec![2]);
        assert_eq!(window_out(&[5], &[2], &a, true).unwrap(), vec![3]);
        let a = attrs(&[
            ("strides", Attr::Ints(vec![2])),
            ("auto_pad", Attr::String("SAME_UPPER".into())),
        ]);
        assert_eq!(window_out(&[5], &[3], &a, false).unwrap(), vec![3]);
    }

    #[test]
    fn window_too_large_is_an_error() {
        assert!(window_out(&[2], &[3], &Attrs::default(), false).is_err());
    }
}
