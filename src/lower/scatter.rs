//! Slice assignments: a `ScatterND` whose indices are the coordinate grid of a box
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
//! constant along the others. Anything else stays a `ScatterND`.

use petgraph::stable_graph::NodeIndex;

use super::Lowering;
use crate::error::Result;
use crate::ir::{Attr, Attrs, Node, TensorId};
use crate::onnx::LOWERED_DOMAIN;
use crate::ops::shape::SLICE_SCATTER;

/// Deepest chain of broadcasts and reshapes followed back from a grid column.
const MAX_DEPTH: usize = 8;

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
        let Some(starts) = self.box_of(*idx, *data, *upd) else {
            return Ok(false);
        };
        self.removed.push(ix);
        self.grids.push(*idx);
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
            if bs.len() != k + 1 || bs[k] != 1 || self.fact(c)?.shape[..k] != *s {
                return None;
            }
            if (bs[j] == 1 && s[j] != 1) || v.len() != bs.iter().product::<usize>() {
                return None;
            }
            let dim = fd.shape[j] as i64;
            let norm = |x: i64| if x < 0 { x + dim } else { x };
            let a = norm(*v.first()?);
            if a < 0 || a + s[j] as i64 > dim {
                return None;
            }
            // a + the coordinate along axis j, whatever the others.
            let stride: usize = bs[j + 1..].iter().product();
            let along = |i: usize| ((i / stride) % bs[j]) as i64;
            if v.iter().enumerate().any(|(i, &x)| norm(x) != a + along(i)) {
                return None;
            }
            starts.push(a);
        }
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

    fn producer(&self, t: TensorId) -> Option<&Node> {
        let p = self.m.graph.tensors[t].producer?;
        self.m.graph.nodes.node_weight(p)
    }
}
