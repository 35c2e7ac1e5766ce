//! Casts back to a norm's input type (`.to(input_dtype)`), which an export writes as
//! a cast to float32.
//!
//! Hugging Face's RMSNorms (Llama and its descendants) compute in float32 and
//! return to the type they were given:
//! `input_dtype = x.dtype; h = x.to(torch.float32); ...; weight * h.to(input_dtype)`
//! (OLMo2: `(weight * h).to(input_dtype)`). Exported in float32, both casts are
//! `Cast(to=FLOAT)`. Under autocast a norm on a projection's output (Qwen3's and
//! OLMo2's q/k norms, OLMo2's post-norms) is given a half tensor: the first cast
//! makes a float32 copy, and the last one returns to half, which is what the
//! weight's multiply then saves. The first is an explicit cast
//! ([`crate::ops::Autocast::AsWritten`]); this finds the last, so that the schedule
//! gives it the type of the norm's input.

use std::collections::HashMap;

use petgraph::stable_graph::NodeIndex;

use super::{consumers, FusedKind, FusedPattern};
use crate::ir::{DType, Model, TensorId};

/// For each cast back found: the `Cast` node and the norm's input before its cast
/// to float32 (whose type the cast returns to). Found from the RMSNorm statistics
/// patterns ([`FusedKind::Rsqrt`], reading `x` and `r`): `x` is a `Cast(to=FLOAT)`
/// of `x0`; `Mul(x, r)` feeds, alone, either that cast back or a `Mul` by a weight
/// that alone feeds it.
pub(crate) fn cast_backs(model: &Model, patterns: &[FusedPattern]) -> HashMap<NodeIndex, TensorId> {
    let g = &model.graph;
    let to_float = |n: NodeIndex| {
        let node = g.node(n);
        node.op_type == "Cast"
            && i32::try_from(node.attrs.int_or("to", 0))
                .ok()
                .and_then(DType::from_onnx)
                == Some(DType::F32)
    };
    let only = |t: TensorId| match consumers(model, t).as_slice() {
        [c] if !g.outputs.contains(&t) => Some(*c),
        _ => None,
    };
    let out0 = |n: NodeIndex| g.node(n).outputs.first().copied().flatten();
    let mut out = HashMap::new();
    for p in patterns.iter().filter(|p| p.kind == FusedKind::Rsqrt) {
        let found = (|| {
            let (x, r) = (p.reads[0], *p.reads.get(1)?);
            let up = g.tensor(x).producer.filter(|&c| to_float(c))?;
            let x0 = g.node(up).inputs.first().copied().flatten()?;
            let mul = consumers(model, r)
                .into_iter()
                .find(|&m| g.node(m).op_type == "Mul" && g.node(m).inputs.contains(&Some(x)))?;
            let mut n = only(out0(mul)?)?;
            if g.node(n).op_type == "Mul" {
                n = only(out0(n)?)?;
            }
            to_float(n).then_some((n, x0))
        })();
        if let Some((n, x0)) = found {
            out.insert(n, x0);
        }
    }
    out
}
