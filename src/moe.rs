//! Mixture-of-experts routing: the one data-dependent size memplan assumes.
//!
//! A mixture-of-experts layer sends each of its T tokens to k of its E experts (a `TopK`
//! over the router's scores), and each expert runs on the tokens sent to it. The
//! exported graph finds them with `NonZero(Equal(expert_indices, e))` (transformers'
//! eager experts, as `memplan-export` writes them): a data-dependent size, which sets
//! the rows of everything the expert computes, saves and differentiates. memplan sizes
//! each such `NonZero` by an assumption, `--moe-routing`, and states it in its output;
//! shape inference carries the count through the gathers, the expert MLP and the
//! scatter back.
//!
//! | assumption | tokens of expert e | what it bounds |
//! |---|---|---|
//! | `balanced` (default) | ⌊T·k/E⌋, one more for the first T·k mod E experts | a router kept level by its load-balancing loss; the total is T·k, as in any routing |
//! | `capacity=F` | min(T, ⌈F·T·k/E⌉) | every expert at the capacity of factor F (Switch Transformer, Fedus et al. 2021, §2.2): an upper bound for routings within F |
//! | `worst` | the first expert T, the others ⌈T·(k−1)/(E−1)⌉ at most, T·k in all | the largest expert any routing makes (T: a token picks an expert once) |
//!
//! A `NonZero` that is not such a mask stays an error: its size depends on data.

use std::fmt;

use serde::Serialize;

use crate::ir::{DType, Model};
use crate::ops::Fact;
use petgraph::stable_graph::NodeIndex;

/// How many tokens each expert receives (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Routing {
    /// T·k slots spread evenly over the E experts.
    #[default]
    Balanced,
    /// Every expert at capacity ⌈F·T·k/E⌉ (at most T).
    Capacity(f64),
    /// One expert takes every token, the rest share the remaining slots.
    Worst,
}

/// The largest capacity factor accepted: beyond E/k every expert already holds every
/// token, so larger factors change nothing.
const MAX_CAPACITY_FACTOR: f64 = 1e6;

impl Routing {
    /// `balanced`, `capacity=F` (F > 0) or `worst`.
    pub fn parse(text: &str) -> Result<Routing, String> {
        let t = text.trim();
        match t {
            "balanced" => return Ok(Routing::Balanced),
            "worst" => return Ok(Routing::Worst),
            _ => {}
        }
        let Some(f) = t.strip_prefix("capacity=") else {
            return Err(format!(
                "'{t}' is not a routing assumption (balanced, capacity=F, worst)"
            ));
        };
        match f.trim().parse::<f64>() {
            Ok(v) if v > 0.0 && v <= MAX_CAPACITY_FACTOR => Ok(Routing::Capacity(v)),
            _ => Err(format!(
                "capacity factor '{f}' must be a number above 0 and at most {MAX_CAPACITY_FACTOR}"
            )),
        }
    }

    /// Tokens routed to expert `e` of a layer of `site.experts`, `site.tokens` tokens
    /// and top-`site.top_k`.
    pub fn tokens(&self, site: &Site, e: u64) -> u64 {
        let (t, k, n) = (site.tokens, site.top_k, site.experts);
        if e >= n {
            return 0; // a sentinel index past the experts (expert parallelism)
        }
        let slots = t * k;
        match *self {
            Routing::Balanced => slots / n + u64::from(e < slots % n),
            Routing::Capacity(f) => ((f * slots as f64 / n as f64).ceil() as u64).min(t),
            Routing::Worst if n == 1 || e == 0 => t,
            Routing::Worst => {
                let rest = slots - t;
                let others = n - 1;
                (rest / others + u64::from(e - 1 < rest % others)).min(t)
            }
        }
    }
}

impl fmt::Display for Routing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Routing::Balanced => write!(f, "balanced"),
            Routing::Capacity(c) => write!(f, "capacity={c}"),
            Routing::Worst => write!(f, "worst"),
        }
    }
}

/// One expert's token selection: `NonZero(Equal(indices, expert))` where `indices`
/// are a `TopK`'s indices over the experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Site {
    /// Experts in the layer (the TopK's axis).
    pub experts: u64,
    /// Experts per token (the TopK's k).
    pub top_k: u64,
    /// Tokens routed by the layer.
    pub tokens: u64,
    /// The expert this selection is for.
    pub expert: u64,
}

/// Ops that keep the indices' values, only reshaping or retyping them.
const PASS_THROUGH: &[&str] = &[
    "Reshape",
    "Cast",
    "Squeeze",
    "Unsqueeze",
    "Identity",
    "Flatten",
];

/// Whether node `ix` is an expert's token selection, and of which layer shape.
/// `facts` are those inferred so far (every input of `ix` is known).
pub fn site(model: &Model, ix: NodeIndex, facts: &[Option<Fact>]) -> Option<Site> {
    let g = &model.graph;
    let node = g.node(ix);
    if node.op_type != "NonZero" || !node.domain.is_empty() {
        return None;
    }
    let mask = node.inputs.first().copied().flatten()?;
    let eq = g.node(g.tensor(mask).producer?);
    if eq.op_type != "Equal" || !eq.domain.is_empty() {
        return None;
    }
    let (a, b) = (eq.inputs.first().copied()??, eq.inputs.get(1).copied()??);
    let scalar = |t: usize| -> Option<i64> {
        let f = facts[t].as_ref()?;
        let v = f.value.as_ref()?;
        (v.data.len() == 1 && !f.dtype.is_float()).then(|| v.data.int(0))
    };
    let (indices, expert) = match (scalar(a), scalar(b)) {
        (None, Some(e)) => (a, e),
        (Some(e), None) => (b, e),
        _ => return None,
    };
    let topk = topk_indices(model, indices)?;
    let scores = facts[topk.inputs.first().copied()??].as_ref()?;
    let out = facts[topk.outputs.get(1).copied()??].as_ref()?;
    let axis = normalise_axis(topk.attrs.int("axis").unwrap_or(-1), scores.rank())?;
    let experts = *scores.shape.get(axis)? as u64;
    let top_k = *out.shape.get(axis)? as u64;
    if top_k == 0 || top_k > experts {
        return None;
    }
    Some(Site {
        experts,
        top_k,
        tokens: out.numel() / top_k,
        expert: u64::try_from(expert).unwrap_or(u64::MAX),
    })
}

/// The TopK node whose indices (output 1) `t` is, through reshapes and casts.
fn topk_indices(model: &Model, mut t: usize) -> Option<&crate::ir::Node> {
    let g = &model.graph;
    for _ in 0..16 {
        let ix = g.tensor(t).producer?;
        let n = g.node(ix);
        if !n.domain.is_empty() {
            return None;
        }
        if n.op_type == "TopK" {
            return (n.outputs.get(1).copied().flatten() == Some(t)).then_some(n);
        }
        if !PASS_THROUGH.contains(&n.op_type.as_ref()) {
            return None;
        }
        t = n.inputs.first().copied()??;
    }
    None
}

/// A negative axis counted from the end.
fn normalise_axis(axis: i64, rank: usize) -> Option<usize> {
    let a = if axis < 0 {
        i64::try_from(rank).ok()? + axis
    } else {
        axis
    };
    usize::try_from(a).ok().filter(|&a| a < rank)
}

/// The fact of a token selection under `routing`: `[rank of the mask, tokens]` int64.
pub fn selection_fact(site: &Site, mask_rank: usize, routing: Routing) -> Fact {
    Fact::new(
        DType::I64,
        vec![mask_rank, routing.tokens(site, site.expert) as usize],
    )
}

/// What the routing assumption decided, for reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoutingSummary {
    /// The assumption: `balanced`, `capacity=F` or `worst`.
    pub assumption: String,
    /// Token selections sized by it (one per expert per layer).
    pub selections: usize,
    /// Experts per layer (the largest, where layers differ).
    pub experts: u64,
    /// Experts per token.
    pub top_k: u64,
    /// Tokens per layer.
    pub tokens: u64,
    /// The most tokens any expert receives.
    pub max_expert_tokens: u64,
}

impl RoutingSummary {
    /// The summary of `sites` under `routing`; `None` when there are none.
    pub fn of(sites: &[Site], routing: Routing) -> Option<RoutingSummary> {
        let first = sites.first()?;
        Some(RoutingSummary {
            assumption: routing.to_string(),
            selections: sites.len(),
            experts: sites
                .iter()
                .map(|s| s.experts)
                .max()
                .unwrap_or(first.experts),
            top_k: first.top_k,
            tokens: sites.iter().map(|s| s.tokens).max().unwrap_or(first.tokens),
            max_expert_tokens: sites
                .iter()
                .map(|s| routing.tokens(s, s.expert))
                .max()
                .unwrap_or(0),
        })
    }

    /// One line for the text reports.
    pub fn line(&self) -> String {
        format!(
            "MoE routing assumed {}: {} expert selections, {} experts, top-{}, \
             {} tokens a layer, at most {} to one expert",
            self.assumption,
            self.selections,
            self.experts,
            self.top_k,
            self.tokens,
            self.max_expert_tokens
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn site(experts: u64, top_k: u64, tokens: u64) -> Site {
        Site {
            experts,
            top_k,
            tokens,
            expert: 0,
        }
    }

    fn all(r: Routing, s: &Site) -> Vec<u64> {
        (0..s.experts).map(|e| r.tokens(s, e)).collect()
    }

    #[test]
    fn balanced_spreads_every_slot() {
        let s = site(8, 2, 4097);
        let t = all(Routing::Balanced, &s);
        assert_eq!(t.iter().sum::<u64>(), 2 * 4097);
        assert_eq!(t[0], 1025);
        assert_eq!(t[7], 1024);
    }

    #[test]
    fn capacity_is_capped_at_every_token() {
        let s = site(8, 2, 4096);
        assert_eq!(all(Routing::Capacity(1.25), &s), vec![1280; 8]);
        assert_eq!(Routing::Capacity(100.0).tokens(&s, 3), 4096);
    }

    #[test]
    fn worst_gives_one_expert_everything_and_keeps_the_total() {
        let s = site(8, 2, 4096);
        let t = all(Routing::Worst, &s);
        assert_eq!(t[0], 4096);
        assert_eq!(t.iter().sum::<u64>(), 2 * 4096);
        let one = site(4, 1, 100);
        assert_eq!(all(Routing::Worst, &one), vec![100, 0, 0, 0]);
        assert_eq!(Routing::Worst.tokens(&one, 9), 0);
    }

    #[test]
    fn parse_refuses_what_is_not_an_assumption() {
        assert_eq!(Routing::parse("capacity=1.5"), Ok(Routing::Capacity(1.5)));
        assert_eq!(Routing::parse("worst"), Ok(Routing::Worst));
        for bad in [
            "even",
            "capacity=0",
            "capacity=-1",
            "capacity=nan",
            "capacity=inf",
        ] {
            assert!(Routing::parse(bad).is_err(), "{bad}");
        }
    }
}
