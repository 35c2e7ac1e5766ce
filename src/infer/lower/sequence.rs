//! Sequences and optionals, lowered to the tensors they hold (see the parent
//! module's docs).

use super::{fail, value_dependent, Lowering};
use crate::error::Result;
use crate::ir::{Attr, Attrs, DType, Node, TensorId};
use crate::ops::Fact;

impl Lowering {
    // ---- optionals -------------------------------------------------------------

    /// `Optional` wraps a tensor (or nothing); `OptionalHasElement` folds to a
    /// constant; `OptionalGetElement` is the tensor (from opset 18 both also take
    /// a plain tensor, which is always present).
    pub(super) fn lower_optional(&mut self, n: &Node) -> Result<()> {
        let input = n.inputs.first().copied().flatten();
        let out = n.outputs.first().copied().flatten();
        if let Some(t) = input.filter(|t| self.seqs.contains_key(t)) {
            return Err(fail(
                n,
                format!(
                    "'{}' is a sequence: optional sequences are not supported",
                    self.name(t)
                ),
            ));
        }
        let held = |l: &Self| match input {
            None => None,
            Some(t) => l.optionals.get(&t).copied().unwrap_or(Some(t)),
        };
        match n.op_type.as_str() {
            "Optional" => {
                if let Some(o) = out {
                    self.optionals.insert(o, input);
                }
            }
            "OptionalHasElement" => {
                let has = i64::from(held(self).is_some());
                let c = self.constant(&format!("{}/has", n.name), DType::Bool, vec![], vec![has]);
                self.link(c, out, &n.name)?;
            }
            _ => {
                let t = held(self).ok_or_else(|| fail(n, "reads an empty optional"))?;
                self.link(t, out, &n.name)?;
            }
        }
        Ok(())
    }

    // ---- sequences -------------------------------------------------------------

    fn seq(&self, n: &Node, slot: usize) -> Result<Vec<TensorId>> {
        let t = n
            .inputs
            .get(slot)
            .copied()
            .flatten()
            .ok_or_else(|| fail(n, format!("input {slot} is missing")))?;
        self.seqs.get(&t).cloned().ok_or_else(|| {
            fail(
                n,
                format!(
                    "input '{}' is not a sequence memplan could follow (a graph input, or \
                     one whose length depends on values)",
                    self.name(t)
                ),
            )
        })
    }

    /// A constant position input, or `default` when absent.
    fn position(&self, n: &Node, slot: usize, default: i64) -> Result<i64> {
        match n.inputs.get(slot).copied().flatten() {
            None => Ok(default),
            Some(p) => self
                .ints_of(p)
                .filter(|v| v.len() == 1)
                .map(|v| v[0])
                .ok_or_else(|| {
                    value_dependent(n, "its position depends on input values: memplan lowers only static sequences")
                }),
        }
    }

    pub(super) fn lower_sequence(&mut self, n: &Node) -> Result<()> {
        let out = n.outputs.first().copied().flatten();
        let bad_pos = |p: i64, len: usize| {
            fail(
                n,
                format!("position {p} is out of range for a sequence of {len}"),
            )
        };
        match n.op_type.as_str() {
            "SequenceEmpty" => {
                if let Some(o) = out {
                    self.seqs.insert(o, Vec::new());
                }
            }
            "SequenceConstruct" => {
                let list: Vec<TensorId> = n.inputs.iter().flatten().copied().collect();
                if let Some(t) = list.iter().find(|t| self.seqs.contains_key(t)) {
                    return Err(fail(
                        n,
                        format!(
                            "'{}' is a sequence: nested sequences are not supported",
                            self.name(*t)
                        ),
                    ));
                }
                if let Some(o) = out {
                    self.seqs.insert(o, list);
                }
            }
            "SequenceInsert" => {
                let mut list = self.seq(n, 0)?;
                let t = n
                    .inputs
                    .get(1)
                    .copied()
                    .flatten()
                    .ok_or_else(|| fail(n, "has no tensor to insert"))?;
                let len = list.len() as i64;
                let p = self.position(n, 2, len)?;
                if !(-len..=len).contains(&p) {
                    return Err(bad_pos(p, list.len()));
                }
                list.insert(if p < 0 { p + len } else { p } as usize, t);
                if let Some(o) = out {
                    self.seqs.insert(o, list);
                }
            }
            "SequenceErase" => {
                let mut list = self.seq(n, 0)?;
                let len = list.len() as i64;
                let p = self.position(n, 1, -1)?;
                if !(-len..len).contains(&p) {
                    return Err(bad_pos(p, list.len()));
                }
                list.remove(if p < 0 { p + len } else { p } as usize);
                if let Some(o) = out {
                    self.seqs.insert(o, list);
                }
            }
            "SequenceAt" => {
                let list = self.seq(n, 0)?;
                let len = list.len() as i64;
                let p = self.position(n, 1, i64::MIN)?;
                if !(-len..len).contains(&p) {
                    return Err(bad_pos(p, list.len()));
                }
                let t = list[if p < 0 { p + len } else { p } as usize];
                self.link(t, out, &n.name)?;
            }
            "SequenceLength" => {
                let len = self.seq(n, 0)?.len() as i64;
                if let Some(o) = out {
                    let c =
                        self.constant(&format!("{}/length", n.name), DType::I64, vec![], vec![len]);
                    self.link(c, Some(o), &n.name)?;
                }
            }
            "ConcatFromSequence" => {
                let list = self.seq(n, 0)?;
                let Some(o) = out else { return Ok(()) };
                if list.is_empty() {
                    return Err(fail(n, "concatenates an empty sequence"));
                }
                let axis = n
                    .attrs
                    .int("axis")
                    .ok_or_else(|| fail(n, "has no 'axis' attribute"))?;
                if n.attrs.int_or("new_axis", 0) != 0 {
                    let r = self.fact(list[0]).map_or(0, Fact::rank) as i64 + 1;
                    if !(-r..r).contains(&axis) {
                        return Err(fail(n, format!("axis {axis} is out of range for rank {r}")));
                    }
                    self.stack(&n.name, &list, axis.rem_euclid(r), o)?;
                } else {
                    let attrs = Attrs::from([("axis", Attr::Int(axis))]);
                    self.add_node(
                        &n.name,
                        "Concat",
                        list.into_iter().map(Some).collect(),
                        vec![Some(o)],
                        attrs,
                    )?;
                }
            }
            "SplitToSequence" => self.split_to_sequence(n)?,
            other => unreachable!("{other} is not a sequence op"),
        }
        Ok(())
    }

    fn split_to_sequence(&mut self, n: &Node) -> Result<()> {
        let x = n
            .inputs
            .first()
            .copied()
            .flatten()
            .ok_or_else(|| fail(n, "has no input"))?;
        let fact = self
            .fact(x)
            .ok_or_else(|| fail(n, "its input has no shape"))?
            .clone();
        let r = fact.rank() as i64;
        let axis = n.attrs.int_or("axis", 0);
        if !(-r..r).contains(&axis) {
            return Err(fail(n, format!("axis {axis} is out of range for rank {r}")));
        }
        let a = axis.rem_euclid(r) as usize;
        let d = fact.shape[a] as i64;
        let split = n.inputs.get(1).copied().flatten();
        let (sizes, squeeze) = match split {
            None => (vec![1; d as usize], n.attrs.int_or("keepdims", 1) == 0),
            Some(s) => {
                let sf = self
                    .fact(s)
                    .ok_or_else(|| fail(n, "its split has no shape"))?;
                let scalar = sf.rank() == 0;
                let v = self.ints_of(s).ok_or_else(|| {
                    value_dependent(
                        n,
                        "its split depends on input values: memplan lowers only static sequences",
                    )
                })?;
                if scalar {
                    let c = v[0];
                    if c <= 0 {
                        return Err(fail(n, format!("split {c} is not positive")));
                    }
                    let mut sizes = vec![c; (d / c) as usize];
                    if d % c != 0 {
                        sizes.push(d % c);
                    }
                    (sizes, false)
                } else {
                    if v.iter().any(|&c| c < 0) || v.iter().sum::<i64>() != d {
                        return Err(fail(
                            n,
                            format!("split {v:?} does not add up to the axis length {d}"),
                        ));
                    }
                    (v, false)
                }
            }
        };
        let mut list = Vec::with_capacity(sizes.len());
        let mut start = 0i64;
        for (i, len) in sizes.into_iter().enumerate() {
            let base = format!("{}/{i}", n.name);
            let starts = self.constant(&format!("{base}/starts"), DType::I64, vec![1], vec![start]);
            let ends = self.constant(
                &format!("{base}/ends"),
                DType::I64,
                vec![1],
                vec![start + len],
            );
            let axes = self.constant(&format!("{base}/axes"), DType::I64, vec![1], vec![a as i64]);
            let mut t = self.op(&base, "Slice", vec![x, starts, ends, axes], vec![])?;
            if squeeze {
                t = if self.m.opset() >= 13 {
                    let sq = self.constant(
                        &format!("{base}/squeeze_axes"),
                        DType::I64,
                        vec![1],
                        vec![a as i64],
                    );
                    self.op(&format!("{base}/squeeze"), "Squeeze", vec![t, sq], vec![])?
                } else {
                    self.op(
                        &format!("{base}/squeeze"),
                        "Squeeze",
                        vec![t],
                        vec![("axes", Attr::Ints(vec![a as i64]))],
                    )?
                };
            }
            start += len;
            list.push(t);
        }
        if let Some(o) = n.outputs.first().copied().flatten() {
            self.seqs.insert(o, list);
        }
        Ok(())
    }
}
