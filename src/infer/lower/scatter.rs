//! Slice assignments: a `ScatterND` whose indices are the coordinate grid of a box
//! (or a `ScatterElements` whose indices are one coordinate, constant elsewhere)
//! becomes a [`SLICE_SCATTER`] (domain [`LOWERED_DOMAIN`]), and the nodes that only
//! built the grid are dropped ([`Lowering::finish`]).
//!
//! The TorchScript exporter writes `x[:, :, 1:, 1:] = y` (or `+=`) as
//! `ScatterND(x, indices, y)` with `indices` the box's every coordinate: per axis a
//! `Range` over the shape, reshaped and `Expand`ed to the box, `Unsqueeze`d and
//! `Concat`ed along a last axis of k. PyTorch makes no such tensor: it copies (or
//! adds) into a slice view. The grid costs 8·k bytes an updated element, as much
//! again at every step of its construction, and `ScatterND`'s backward would save it
//! (MViT v2: 600 MiB a block at batch 1, 4.6x the activations PyTorch saves). A
//! grid is recognised from facts alone: each column must be a folded value, or one
//! broadcast (through `Expand`, and `Unsqueeze`/`Squeeze`/`Reshape` that add or
//! drop size-1 axes) along the box, counting up by one along its own axis and
//! constant along the others. Anything else stays a scatter. The dynamo exporter
//! writes a slice assignment on an inner axis as a `ScatterND` over one column
//! between two `Transpose`s, and `a[:, 1] = y` (`select_scatter`) as a
//! `ScatterElements` along the axis with a constant expanded to the update's shape:
//! both are recognised too.

use std::collections::HashSet;

use petgraph::stable_graph::NodeIndex;

use super::Lowering;
use crate::error::Result;
use crate::ir::{Attr, Attrs, Node, TensorId};
use crate::ops::shape::SLICE_SCATTER;
use crate::ops::LOWERED_DOMAIN;

/// Deepest chain of broadcasts and reshapes followed back from a grid column.
const MAX_DEPTH: usize = 8;

/// Most tensors [`Lowering::shape_seeds`] visits from one scatter.
const MAX_SEEDS: usize = 512;

/// The ops of the exporter's shape arithmetic around a slice assignment (and the
/// reshapes and broadcasts whose shape inputs it computes).
const SHAPE_ARITHMETIC: &[&str] = &[
    "Reshape",
    "Expand",
    "Concat",
    "Unsqueeze",
    "Squeeze",
    "Gather",
    "Where",
    "Equal",
    "ConstantOfShape",
    "Add",
    "Sub",
    "Mul",
    "Slice",
    "Range",
    "Cast",
    "Identity",
];

/// Whether `n` is a scatter that [`Lowering::lower_box_scatter`] may make a slice
/// assignment: a quick look at what writes its indices (a `Concat`, `Unsqueeze` or
/// `Expand`, as the exporters build grids), so that models whose scatters take
/// their indices from data are not walked for nothing.
pub(super) fn may_be_slice(model: &crate::ir::Model, n: &Node) -> bool {
    if !n.domain.is_empty()
        || !matches!(
            n.op_type.as_str(),
            "ScatterND" | "ScatterElements" | "Scatter"
        )
    {
        return false;
    }
    let g = &model.graph;
    let Some(Some(idx)) = n.inputs.get(1) else {
        return false;
    };
    g.tensors[*idx]
        .producer
        .and_then(|p| g.nodes.node_weight(p))
        .is_some_and(|p| {
            p.domain.is_empty() && matches!(p.op_type.as_str(), "Concat" | "Unsqueeze" | "Expand")
        })
}

impl Lowering {
    /// Replaces the `ScatterND` `ix` with a [`SLICE_SCATTER`] when its indices are a
    /// box's grid; `false` (nothing changed) otherwise.
    pub(super) fn lower_box_scatter(&mut self, ix: NodeIndex, node: &Node) -> Result<bool> {
        let (Some(Some(data)), Some(Some(idx)), Some(Some(upd))) =
            (node.inputs.first(), node.inputs.get(1), node.inputs.get(2))
        else {
            return Ok(false);
        };
        let reduction = node.attrs.string("reduction").unwrap_or("none");
        if reduction != "none" && reduction != "add" {
            return Ok(false);
        }
        let starts = if node.op_type == "ScatterND" {
            self.box_of(*idx, *data, *upd)
        } else {
            self.elements_box_of(node, *idx, *data, *upd)
        };
        let Some(starts) = starts else {
            return Ok(false);
        };
        self.removed.push(ix);
        self.grids.push(*idx);
        let seeds = self.shape_seeds(&[*idx, *upd]);
        self.shaped.extend(seeds);
        self.m.opsets.insert(LOWERED_DOMAIN.to_string(), 1);
        let mut attrs = Attrs::from([("starts", Attr::Ints(starts))]);
        if reduction == "add" {
            attrs.insert("reduction", Attr::String("add".into()));
        }
        self.insert_node(Node {
            name: node.name.clone(),
            op_type: SLICE_SCATTER.into(),
            domain: LOWERED_DOMAIN.into(),
            inputs: vec![Some(*data), Some(*upd)].into(),
            outputs: node.outputs.clone(),
            attrs,
        })?;
        Ok(true)
    }

    /// The starts of the box whose grid `idx` is, in `data`, with `upd` of the box's
    /// shape (then every later axis of `data`).
    fn box_of(&self, idx: TensorId, data: TensorId, upd: TensorId) -> Option<Vec<i64>> {
        let (fi, fd, fu) = (self.fact(idx)?, self.fact(data)?, self.fact(upd)?);
        let k = *fi.shape.last()?;
        let s = &fi.shape[..fi.shape.len() - 1];
        if k == 0 || s.len() != k || k > fd.shape.len() {
            return None;
        }
        // The box then every later axis whole: the updates' shape.
        if fu.shape.len() != fd.shape.len() || fu.shape[..k] != *s || fu.shape[k..] != fd.shape[k..]
        {
            return None;
        }
        let columns: Vec<TensorId> = match self.producer(idx) {
            Some(n) if n.op_type == "Concat" && n.domain.is_empty() && k > 1 => {
                let axis = n.attrs.int("axis")?;
                if axis != -1 && axis != k as i64 {
                    return None;
                }
                n.inputs.iter().copied().collect::<Option<Vec<_>>>()?
            }
            _ if k == 1 => vec![idx],
            _ => return None,
        };
        if columns.len() != k {
            return None;
        }
        let mut starts = Vec::with_capacity(k);
        for (j, &c) in columns.iter().enumerate() {
            let (bs, v) = self.broadcast_of(c, 0)?;
            // Shape S ++ [1]: drop the last axis.
            let cs = &self.fact(c)?.shape;
            if bs.len() != k + 1 || bs[k] != 1 || cs.len() != k + 1 || cs[k] != 1 || cs[..k] != *s {
                return None;
            }
            starts.push(column_start(&bs[..k], &v, j, s[j], fd.shape[j])?);
        }
        Some(starts)
    }

    /// The same for `ScatterElements` (and its old name `Scatter`) along `axis`: the
    /// indices, of the updates' shape, must be `a` plus the coordinate along `axis`
    /// (what the dynamo exporter writes for `select_scatter`: a constant expanded);
    /// the box then starts at `a` on `axis` and at 0 on every other axis.
    fn elements_box_of(
        &self,
        node: &Node,
        idx: TensorId,
        data: TensorId,
        upd: TensorId,
    ) -> Option<Vec<i64>> {
        let (fi, fd, fu) = (self.fact(idx)?, self.fact(data)?, self.fact(upd)?);
        let r = fd.shape.len();
        if fi.shape != fu.shape || fu.shape.len() != r || r == 0 {
            return None;
        }
        let ax = node.attrs.int("axis").unwrap_or(0);
        let ax = if ax < 0 { ax + r as i64 } else { ax };
        if !(0..r as i64).contains(&ax) {
            return None;
        }
        let ax = ax as usize;
        let (bs, v) = self.broadcast_of(idx, 0)?;
        let a = column_start(&bs, &v, ax, fu.shape[ax], fd.shape[ax])?;
        if fu.shape.iter().zip(&fd.shape).any(|(u, d)| u > d) {
            return None;
        }
        let mut starts = vec![0; r];
        starts[ax] = a;
        Some(starts)
    }

    /// `t`'s value as a small folded value broadcast to `t`'s shape: the value and
    /// its shape, of `t`'s rank, each dim 1 or `t`'s.
    fn broadcast_of(&self, t: TensorId, depth: usize) -> Option<(Vec<usize>, Vec<i64>)> {
        let f = self.fact(t)?;
        if !f.dtype.is_int() {
            return None;
        }
        if let Some(v) = &f.value {
            return Some((f.shape.clone(), v.to_ints()));
        }
        if depth >= MAX_DEPTH {
            return None;
        }
        let n = self.producer(t)?;
        if !n.domain.is_empty() {
            return None;
        }
        let x = (*n.inputs.first()?)?;
        let (xs, v) = self.broadcast_of(x, depth + 1)?;
        let out = &f.shape;
        match n.op_type.as_str() {
            "Expand" => {
                if xs.len() > out.len() {
                    return None;
                }
                let mut bs = vec![1; out.len() - xs.len()];
                bs.extend(xs);
                bs.iter()
                    .zip(out)
                    .all(|(&b, &o)| b == 1 || b == o)
                    .then_some((bs, v))
            }
            // Size-1 axes added or dropped: the value keeps its order.
            "Unsqueeze" | "Squeeze" | "Reshape" | "Identity" => {
                let xf = &self.fact(x)?.shape;
                let big = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
                if big(xf) != big(out) {
                    return None;
                }
                // The broadcast dims follow their axes: the i-th axis over 1 of the
                // input is the i-th of the output.
                let mut src = xf.iter().zip(&xs).filter(|(&d, _)| d != 1).map(|(_, &b)| b);
                let bs: Vec<usize> = out
                    .iter()
                    .map(|&d| if d == 1 { Some(1) } else { src.next() })
                    .collect::<Option<_>>()?;
                // Broadcast over a size-1 axis of the input is a value of 1 there.
                (xs.iter().zip(xf).all(|(&b, &d)| d != 1 || b == 1)).then_some((bs, v))
            }
            _ => None,
        }
    }

    /// What the `Shape` nodes that a replaced scatter's indices and updates are
    /// shaped from read: back from them through the shape arithmetic (integer
    /// tensors only) and the shape inputs of the reshapes and broadcasts on the
    /// updates' path, at most [`MAX_SEEDS`] tensors.
    fn shape_seeds(&self, from: &[TensorId]) -> Vec<TensorId> {
        let mut seen: HashSet<TensorId> = from.iter().copied().collect();
        let mut work: Vec<TensorId> = from.to_vec();
        let mut seeds = Vec::new();
        while let Some(t) = work.pop() {
            let Some(n) = self.producer(t) else { continue };
            if !n.domain.is_empty() {
                continue;
            }
            if n.op_type == "Shape" {
                seeds.extend(n.inputs.first().copied().flatten());
                continue;
            }
            if !SHAPE_ARITHMETIC.contains(&n.op_type.as_str()) {
                continue;
            }
            for &i in n.inputs.iter().flatten() {
                let int = self.fact(i).is_some_and(|f| f.dtype.is_int());
                if int && seen.len() < MAX_SEEDS && seen.insert(i) {
                    work.push(i);
                }
            }
        }
        seeds
    }

    fn producer(&self, t: TensorId) -> Option<&Node> {
        let p = self.m.graph.tensors[t].producer?;
        self.m.graph.nodes.node_weight(p)
    }
}

/// Where a grid column starts: `v` (of broadcast shape `bs`) must hold `a` plus the
/// coordinate along axis `j` (of `n` elements, in a dimension of `dim`; negative
/// indices count from the end), whatever the other coordinates.
fn column_start(bs: &[usize], v: &[i64], j: usize, n: usize, dim: usize) -> Option<i64> {
    if (bs[j] == 1 && n != 1)
        || (bs[j] != 1 && bs[j] != n)
        || v.len() != bs.iter().product::<usize>()
    {
        return None;
    }
    let dim = dim as i64;
    let norm = |x: i64| if x < 0 { x + dim } else { x };
    let a = norm(*v.first()?);
    if a < 0 || a + n as i64 > dim {
        return None;
    }
    let stride: usize = bs[j + 1..].iter().product();
    let along = |i: usize| ((i / stride) % bs[j]) as i64;
    v.iter()
        .enumerate()
        .all(|(i, &x)| norm(x) == a + along(i))
        .then_some(a)
}
