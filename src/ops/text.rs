//! Text features: `TfIdfVectorizer(X) -> Y`, n-gram counts of integer token ids
//! (`[C]` or `[N, C]`) into `[max(ngram_indexes) + 1]` or `[N, ...]` floats.
//! String tokens are refused with the other string tensors (an unsupported type).
//!
//! Shape rule and FLOPs; no CPU kernel yet.

use super::{Arity, Autocast, Backward, Cx, Fact, Op, Registry, RuleResult};
use crate::ir::DType;

/// FLOPs: 1 per output element for the weighting (the matching is integer work).
struct TfIdf;

impl Op for TfIdf {
    fn arity(&self) -> Arity {
        Arity::new(1, 1, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let x = cx.input(0)?;
        let idx = cx
            .attrs()
            .ints("ngram_indexes")
            .ok_or("attribute 'ngram_indexes' is required")?;
        let width = match idx.iter().copied().max() {
            Some(m) if m >= 0 => m as usize + 1,
            _ => return Err("ngram_indexes must be non-negative and not empty".into()),
        };
        let shape = match x.rank() {
            1 => vec![width],
            2 => vec![x.shape[0], width],
            _ => return Err(format!("input must be [C] or [N, C], got {:?}", x.shape).into()),
        };
        Ok(vec![Fact::new(DType::F32, shape)])
    }
    fn flops(&self, _cx: &Cx, out: &[Fact]) -> u64 {
        out[0].numel()
    }
    /// Integer input: no gradient.
    fn backward(&self, _cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        Ok(None)
    }
    shape_only!(no_gradient);
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Promote
    }
}

pub(super) fn register(r: &mut Registry) {
    r.add("TfIdfVectorizer", TfIdf);
}
