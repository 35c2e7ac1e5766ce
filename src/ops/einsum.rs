//! `Einsum` (opset 12+): any equation, explicit (`->`) or implicit output, ellipsis
//! broadcasting, repeated labels (diagonals), any number of operands; contracted
//! left to right pairwise, as `torch.einsum` does without opt_einsum.

use std::collections::BTreeSet;

use rayon::prelude::*;

use super::{
    layout, Arity, Autocast, Backward, BackwardCx, CudaKernels, Cx, Fact, Grad, KernelCx, Op,
    Registry, RuleResult, Saved, Storage,
};
use crate::numeric::broadcast::{affine_offsets, strides};
use crate::numeric::gemm::{sgemm, Mat};
use crate::numeric::grad::sum_to;
use crate::numeric::Tensor;

/// Label ids: letters `A-Z` are 0..26, `a-z` 26..52 (ASCII order, so sorting ids
/// sorts labels as the implicit output does); ellipsis dim `k` (of the broadcast
/// ellipsis, left to right) is `ELL + k`.
const ELL: usize = 52;

/// One token of a term.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tok {
    Letter(usize),
    Ellipsis,
}

fn label_name(l: usize) -> String {
    match l {
        0..=25 => ((b'A' + l as u8) as char).to_string(),
        26..=51 => ((b'a' + (l - 26) as u8) as char).to_string(),
        _ => format!("...[{}]", l - ELL),
    }
}

fn parse_term(t: &str) -> RuleResult<Vec<Tok>> {
    let b = t.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            c @ b'A'..=b'Z' => out.push(Tok::Letter((c - b'A') as usize)),
            c @ b'a'..=b'z' => out.push(Tok::Letter((c - b'a') as usize + 26)),
            b'.' => {
                if b.get(i..i + 3) != Some(b"...") {
                    return Err(format!("term '{t}': a '.' outside an ellipsis '...'").into());
                }
                if out.contains(&Tok::Ellipsis) {
                    return Err(format!("term '{t}' has more than one ellipsis").into());
                }
                out.push(Tok::Ellipsis);
                i += 2;
            }
            c => return Err(format!("term '{t}': unexpected character '{}'", c as char).into()),
        }
        i += 1;
    }
    Ok(out)
}

/// An equation resolved against operand shapes.
#[derive(Debug, Clone, PartialEq)]
struct Spec {
    /// Label of every axis of every operand (repeats: a diagonal).
    ops: Vec<Vec<usize>>,
    /// Output labels (distinct).
    out: Vec<usize>,
    /// Size of every label (ellipsis dims broadcast).
    dims: Vec<usize>,
}

impl Spec {
    /// Distinct labels of operand `i`, first occurrence order.
    fn unique(&self, i: usize) -> Vec<usize> {
        let mut u = Vec::new();
        for &l in &self.ops[i] {
            if !u.contains(&l) {
                u.push(l);
            }
        }
        u
    }
    fn numel(&self, labels: &[usize]) -> u64 {
        labels
            .iter()
            .fold(1u64, |a, &l| a.saturating_mul(self.dims[l] as u64))
    }
}

fn spec(equation: &str, shapes: &[&[usize]]) -> RuleResult<Spec> {
    let eq: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => {
            if r.contains("->") {
                return Err(format!("equation '{equation}' has more than one '->'").into());
            }
            (l, Some(r))
        }
        None => (eq.as_str(), None),
    };
    let terms = lhs
        .split(',')
        .map(parse_term)
        .collect::<RuleResult<Vec<_>>>()?;
    if terms.len() != shapes.len() {
        return Err(format!(
            "equation '{equation}' has {} operand terms for {} inputs",
            terms.len(),
            shapes.len()
        )
        .into());
    }
    // Ellipsis ranks.
    let mut ells = Vec::with_capacity(terms.len());
    for (k, (t, s)) in terms.iter().zip(shapes).enumerate() {
        let letters = t.iter().filter(|x| matches!(x, Tok::Letter(_))).count();
        let has = t.contains(&Tok::Ellipsis);
        if s.len() < letters || (!has && s.len() != letters) {
            return Err(format!(
                "operand {k} of rank {} does not match its term of {letters} labels{} in '{equation}'",
                s.len(),
                if has { " and an ellipsis" } else { "" }
            ).into());
        }
        ells.push(s.len() - letters);
    }
    let e = ells.iter().copied().max().unwrap_or(0);
    let mut dims: Vec<Option<usize>> = vec![None; ELL + e];
    let mut ops = Vec::with_capacity(terms.len());
    for (k, (t, s)) in terms.iter().zip(shapes).enumerate() {
        let mut labels = Vec::with_capacity(s.len());
        for tok in t {
            match *tok {
                Tok::Letter(l) => labels.push(l),
                Tok::Ellipsis => labels.extend((0..ells[k]).map(|j| ELL + e - ells[k] + j)),
            }
        }
        for (&l, &d) in labels.iter().zip(s.iter()) {
            match dims[l] {
                None => dims[l] = Some(d),
                Some(c) if c == d => {}
                Some(c) if l >= ELL && (c == 1 || d == 1) => dims[l] = Some(c.max(d)),
                Some(c) => {
                    return Err(format!(
                    "label '{}' has sizes {c} and {d} in '{equation}' (operand shapes {shapes:?})",
                    label_name(l)
                )
                    .into())
                }
            }
        }
        ops.push(labels);
    }
    let mut count = [0usize; ELL];
    for o in &ops {
        for &l in o.iter().filter(|&&l| l < ELL) {
            count[l] += 1;
        }
    }
    let out: Vec<usize> = match rhs {
        Some(r) => {
            let mut out = Vec::new();
            for tok in parse_term(r)? {
                match tok {
                    Tok::Letter(l) => {
                        if count[l] == 0 {
                            return Err(format!(
                                "output label '{}' of '{equation}' is in no operand",
                                label_name(l)
                            )
                            .into());
                        }
                        if out.contains(&l) {
                            return Err(format!(
                                "output label '{}' of '{equation}' is repeated",
                                label_name(l)
                            )
                            .into());
                        }
                        out.push(l);
                    }
                    // Ellipsis dims missing from an explicit output are summed
                    // (torch.einsum's rule).
                    Tok::Ellipsis => out.extend(ELL..ELL + e),
                }
            }
            out
        }
        None => (ELL..ELL + e)
            .chain((0..ELL).filter(|&l| count[l] == 1))
            .collect(),
    };
    Ok(Spec {
        ops,
        out,
        dims: dims.into_iter().map(|d| d.unwrap_or(1)).collect(),
    })
}

/// FLOPs of contracting operands with (distinct) labels `ops` into `out`, left
/// to right, as [`engine`] does: a sum over labels needed nowhere later costs one
/// add per element summed; a pairwise contraction costs a multiply-add per element
/// of the pair's joint index space.
fn cost(s: &Spec, ops: &[Vec<usize>], out: &[usize]) -> u64 {
    let mut total = 0u64;
    let mut cur = ops[0].clone();
    for (i, b) in ops.iter().enumerate().skip(1) {
        let keep: BTreeSet<usize> = out
            .iter()
            .chain(ops[i + 1..].iter().flatten())
            .copied()
            .collect();
        let ck: Vec<usize> = cur
            .iter()
            .copied()
            .filter(|l| keep.contains(l) || b.contains(l))
            .collect();
        if ck.len() < cur.len() {
            total = total.saturating_add(s.numel(&cur));
        }
        let bk: Vec<usize> = b
            .iter()
            .copied()
            .filter(|l| keep.contains(l) || ck.contains(l))
            .collect();
        if bk.len() < b.len() {
            total = total.saturating_add(s.numel(b));
        }
        let mut union = ck.clone();
        union.extend(bk.iter().filter(|l| !ck.contains(l)));
        total = total.saturating_add(s.numel(&union).saturating_mul(2));
        cur = union.into_iter().filter(|l| keep.contains(l)).collect();
    }
    if cur.iter().any(|l| !out.contains(l)) {
        total = total.saturating_add(s.numel(&cur));
    }
    total
}

/// An operand in the engine: contiguous data, one distinct label per axis.
#[derive(Debug, Clone)]
struct Opnd {
    v: Vec<f32>,
    labels: Vec<usize>,
    shape: Vec<usize>,
}

fn gather(v: &[f32], offs: &[usize]) -> Vec<f32> {
    offs.iter().map(|&o| v[o]).collect()
}

/// The diagonal of an operand with repeated labels: offsets into it of every
/// element of the distinct-label view, the labels, the view's shape.
fn diagonal(labels: &[usize], shape: &[usize]) -> (Option<Vec<usize>>, Vec<usize>, Vec<usize>) {
    let st = strides(shape);
    let mut ul: Vec<usize> = Vec::new();
    let mut us: Vec<usize> = Vec::new();
    let mut ust: Vec<isize> = Vec::new();
    for (a, &l) in labels.iter().enumerate() {
        match ul.iter().position(|&x| x == l) {
            Some(p) => ust[p] += st[a] as isize,
            None => {
                ul.push(l);
                us.push(shape[a]);
                ust.push(st[a] as isize);
            }
        }
    }
    let offs = (ul.len() < labels.len()).then(|| affine_offsets(&us, 0, &ust));
    (offs, ul, us)
}

/// Operand `i` ready for the engine: diagonals taken, ellipsis dims of size 1
/// broadcast to their size.
fn prep(s: &Spec, i: usize, v: &[f32], shape: &[usize]) -> Opnd {
    let (offs, ul, us) = diagonal(&s.ops[i], shape);
    let mut v = match offs {
        Some(o) => gather(v, &o),
        None => v.to_vec(),
    };
    let full: Vec<usize> = ul.iter().map(|&l| s.dims[l]).collect();
    if full != us {
        let st = strides(&us);
        let bst: Vec<isize> = (0..us.len())
            .map(|a| if us[a] == full[a] { st[a] as isize } else { 0 })
            .collect();
        v = gather(&v, &affine_offsets(&full, 0, &bst));
    }
    Opnd {
        v,
        labels: ul,
        shape: full,
    }
}

/// The operand's data laid out in label order `order` (a permutation of its labels).
fn permute(o: Opnd, order: &[usize]) -> Opnd {
    if o.labels == order {
        return o;
    }
    let st = strides(&o.shape);
    let pos: Vec<usize> = order
        .iter()
        .map(|l| o.labels.iter().position(|x| x == l).unwrap())
        .collect();
    let shape: Vec<usize> = pos.iter().map(|&p| o.shape[p]).collect();
    let pst: Vec<isize> = pos.iter().map(|&p| st[p] as isize).collect();
    Opnd {
        v: gather(&o.v, &affine_offsets(&shape, 0, &pst)),
        labels: order.to_vec(),
        shape,
    }
}

/// Sums the labels `keep` rejects (f64 accumulation, row-major order).
fn sum_out(o: Opnd, keep: impl Fn(usize) -> bool) -> Opnd {
    let (kept, summed): (Vec<usize>, Vec<usize>) = o.labels.iter().partition(|&&l| keep(l));
    if summed.is_empty() {
        return o;
    }
    let order: Vec<usize> = kept.iter().chain(&summed).copied().collect();
    let p = permute(o, &order);
    let n_kept = kept.len();
    let chunk: usize = p.shape[n_kept..].iter().product();
    let rows: usize = p.shape[..n_kept].iter().product();
    let v: Vec<f32> = if chunk == 0 {
        vec![0.0; rows]
    } else {
        p.v.chunks(chunk)
            .map(|c| c.iter().map(|&x| x as f64).sum::<f64>() as f32)
            .collect()
    };
    Opnd {
        v,
        labels: kept,
        shape: p.shape[..n_kept].to_vec(),
    }
}

/// One pairwise contraction as a batched matrix product: labels in both and
/// kept are the batch, in both and not kept contracted, the rest rows (`a`) and
/// columns (`b`). Every label of `a` or `b` is in both or kept.
fn contract(a: Opnd, b: Opnd, keep: &BTreeSet<usize>) -> Opnd {
    // `o`'s labels, in order, that `keep` and `other` do (or do not) hold.
    let pick = |o: &Opnd, other: &Opnd, in_other: bool, kept: Option<bool>| -> Vec<usize> {
        let want = |l: &usize| {
            other.labels.contains(l) == in_other && kept.is_none_or(|k| keep.contains(l) == k)
        };
        o.labels.iter().copied().filter(want).collect()
    };
    let batch = pick(&a, &b, true, Some(true));
    let con = pick(&a, &b, true, Some(false));
    let m_l = pick(&a, &b, false, None);
    let n_l = pick(&b, &a, false, None);
    let size = |o: &Opnd, ls: &[usize]| -> usize {
        ls.iter()
            .map(|l| o.shape[o.labels.iter().position(|x| x == l).unwrap()])
            .product()
    };
    let (bs, m, k) = (size(&a, &batch), size(&a, &m_l), size(&a, &con));
    let n = size(&b, &n_l);
    let mut shape: Vec<usize> = Vec::new();
    for l in &batch {
        shape.push(a.shape[a.labels.iter().position(|x| x == l).unwrap()]);
    }
    for l in &m_l {
        shape.push(a.shape[a.labels.iter().position(|x| x == l).unwrap()]);
    }
    for l in &n_l {
        shape.push(b.shape[b.labels.iter().position(|x| x == l).unwrap()]);
    }
    let pa = permute(
        a,
        &batch
            .iter()
            .chain(&m_l)
            .chain(&con)
            .copied()
            .collect::<Vec<_>>(),
    );
    let pb = permute(
        b,
        &batch
            .iter()
            .chain(&con)
            .chain(&n_l)
            .copied()
            .collect::<Vec<_>>(),
    );
    let mut c = vec![0f32; bs * m * n];
    if m * n > 0 && k > 0 {
        let one = |i: usize, cm: &mut [f32]| {
            let am = Mat::new(&pa.v[i * m * k..(i + 1) * m * k], m, k, false);
            let bm = Mat::new(&pb.v[i * k * n..(i + 1) * k * n], k, n, false);
            sgemm(1.0, am, bm, 0.0, cm);
        };
        if bs == 1 {
            one(0, &mut c);
        } else {
            c.par_chunks_mut(m * n)
                .enumerate()
                .for_each(|(i, cm)| one(i, cm));
        }
    }
    Opnd {
        v: c,
        labels: batch.into_iter().chain(m_l).chain(n_l).collect(),
        shape,
    }
}

/// Contracts `ops` left to right into the labels `out` (row-major in that order);
/// labels of `out` in no operand are broadcast (the backward's case).
fn engine(s: &Spec, ops: Vec<Opnd>, out: &[usize]) -> Vec<f32> {
    let all: Vec<Vec<usize>> = ops.iter().map(|o| o.labels.clone()).collect();
    let mut it = ops.into_iter();
    let mut cur = it.next().expect("at least one operand");
    for (i, b) in it.enumerate() {
        let keep: BTreeSet<usize> = out
            .iter()
            .chain(all[i + 2..].iter().flatten())
            .copied()
            .collect();
        let cur2 = sum_out(cur, |l| keep.contains(&l) || b.labels.contains(&l));
        let b = sum_out(b, |l| keep.contains(&l) || cur2.labels.contains(&l));
        cur = contract(cur2, b, &keep);
    }
    let cur = sum_out(cur, |l| out.contains(&l));
    let present: Vec<usize> = out
        .iter()
        .copied()
        .filter(|l| cur.labels.contains(l))
        .collect();
    let cur = permute(cur, &present);
    if present.len() == out.len() {
        return cur.v;
    }
    let st = strides(&cur.shape);
    let shape: Vec<usize> = out.iter().map(|&l| s.dims[l]).collect();
    let bst: Vec<isize> = out
        .iter()
        .map(|l| {
            present
                .iter()
                .position(|x| x == l)
                .map_or(0, |p| st[p] as isize)
        })
        .collect();
    gather(&cur.v, &affine_offsets(&shape, 0, &bst))
}

fn spec_of(equation: Option<&str>, shapes: &[&[usize]]) -> RuleResult<Spec> {
    spec(equation.ok_or("missing attribute 'equation'")?, shapes)
}

/// What `torch.einsum` saves of two operands in place of the operands themselves
/// (aten/src/ATen/native/Linear.cpp, `einsum` and `sumproduct_pair`): each operand is
/// permuted to one label order (the output's labels, then the contracted ones in
/// label order) with size-1 dims for its missing labels; a contracted label only
/// one operand has is summed out at once; then left is permuted to (both, left only,
/// contracted) and right to (both, contracted, right only), each reshaped to 3-D
/// for `bmm`, whose backward saves them. An operand summed early, or whose reshape
/// is no view ([`layout::view`]), is saved as a new tensor of the 3-D shape.
/// Equations with a repeated label in one operand (a diagonal) or nothing to
/// contract (an outer product, run as `mul`) save the operands as they are.
fn pair_copies(
    s: &Spec,
    shapes: &[&[usize]],
    strides: &[Option<&[usize]>],
) -> Vec<(usize, Vec<usize>)> {
    if s.ops
        .iter()
        .any(|o| (0..o.len()).any(|i| o[i + 1..].contains(&o[i])))
    {
        return Vec::new();
    }
    let mut order = s.out.clone();
    let mut contracted: Vec<usize> = s
        .ops
        .iter()
        .flatten()
        .copied()
        .filter(|l| !s.out.contains(l))
        .collect();
    contracted.sort_unstable();
    contracted.dedup();
    if contracted.is_empty() {
        return Vec::new();
    }
    let n_out = order.len();
    order.extend(&contracted);
    // Each operand in the global order: (size, stride) per label.
    let global = |j: usize| -> Vec<(usize, Option<usize>)> {
        order
            .iter()
            .map(|l| match s.ops[j].iter().position(|x| x == l) {
                Some(a) => (
                    shapes[j][a],
                    strides.get(j).copied().flatten().map(|st| st[a]),
                ),
                None => (1, Some(0)),
            })
            .collect()
    };
    let (mut left, mut right) = (global(0), global(1));
    let mut summed = [false, false];
    let (mut lro, mut lo, mut ro, mut sum) = (vec![], vec![], vec![], vec![]);
    for i in 0..order.len() {
        let (sl, sr) = (left[i].0 != 1, right[i].0 != 1);
        if i >= n_out {
            if sl && sr {
                sum.push(i);
            } else if sl {
                left[i].0 = 1;
                summed[0] = true;
            } else if sr {
                right[i].0 = 1;
                summed[1] = true;
            }
        } else if sl && sr {
            lro.push(i);
        } else if sl {
            lo.push(i);
        } else {
            ro.push(i);
        }
    }
    let size = |t: &[(usize, Option<usize>)], dims: &[usize]| -> usize {
        dims.iter().map(|&d| t[d].0).product()
    };
    let lperm: Vec<usize> = [&lro[..], &lo, &sum, &ro].concat();
    let rperm: Vec<usize> = [&lro[..], &sum, &ro, &lo].concat();
    let lnew = vec![size(&left, &lro), size(&left, &lo), size(&left, &sum)];
    let rnew = vec![size(&right, &lro), size(&right, &sum), size(&right, &ro)];
    let mut out = Vec::new();
    for (j, t, perm, new) in [(0, &left, &lperm, lnew), (1, &right, &rperm, rnew)] {
        let sh: Vec<usize> = perm.iter().map(|&d| t[d].0).collect();
        let st: Option<Vec<usize>> = perm.iter().map(|&d| t[d].1).collect();
        let copies = summed[j]
            || match st {
                Some(st) => layout::view(&sh, &st, &new).is_none(),
                None => true,
            };
        if copies {
            out.push((j, new));
        }
    }
    out
}

/// `Einsum(inputs...)` with attribute `equation`.
///
/// Shape: the output labels' sizes; a letter's sizes must agree everywhere,
/// ellipsis dims broadcast (numpy rules); implicit output: the ellipsis dims, then
/// the letters appearing once, sorted. All operands share the output's dtype.
///
/// FLOPs, contracting left to right pairwise as torch.einsum does without
/// opt_einsum: a multiply-add (2) per element of each pair's joint index space
/// (for two operands `2 · Π` of every distinct label's size), plus one add per
/// element of an operand summed over labels needed nowhere later (a final
/// reduction of a single operand too); diagonals and permutations are free.
struct Einsum;

impl Op for Einsum {
    fn arity(&self) -> Arity {
        Arity::new(1, usize::MAX, 1, 1)
    }
    fn infer(&self, cx: &Cx) -> RuleResult<Vec<Fact>> {
        let facts = (0..cx.inputs.len())
            .map(|i| cx.input(i))
            .collect::<RuleResult<Vec<_>>>()?;
        let dtype = facts[0].dtype;
        if let Some(f) = facts.iter().find(|f| f.dtype != dtype) {
            return Err(format!("operands have different types ({dtype} and {})", f.dtype).into());
        }
        let shapes: Vec<&[usize]> = facts.iter().map(|f| f.shape.as_slice()).collect();
        let s = spec_of(cx.attrs().string("equation"), &shapes)?;
        Ok(vec![Fact::new(
            dtype,
            s.out.iter().map(|&l| s.dims[l]).collect(),
        )])
    }
    fn flops(&self, cx: &Cx, _out: &[Fact]) -> u64 {
        let Some(shapes) = cx
            .inputs
            .iter()
            .map(|f| f.map(|f| f.shape.as_slice()))
            .collect::<Option<Vec<_>>>()
        else {
            return 0;
        };
        let Ok(s) = spec_of(cx.attrs().string("equation"), &shapes) else {
            return 0;
        };
        let ops: Vec<Vec<usize>> = (0..s.ops.len()).map(|i| s.unique(i)).collect();
        cost(&s, &ops, &s.out)
    }
    /// PyTorch's einsum runs as permutes, reshapes and bmm (sumproduct_pair), whose
    /// backward saves the operands: every float operand's gradient reads all the
    /// OTHER operands (a one-operand einsum, a sum/diagonal/permute, saves
    /// nothing). Modelled as saving the inputs themselves; where torch's reshape
    /// has to copy a permuted operand it saves that copy instead (same size).
    /// Backward FLOPs: for each operand, the einsum of the output gradient with
    /// the other operands into it, counted as the forward ([`cost`]): about twice
    /// the forward for two operands.
    fn backward(&self, cx: &Cx, _out: &[Fact]) -> RuleResult<Option<Backward>> {
        let n = cx.inputs.len();
        let facts = (0..n)
            .map(|i| cx.input(i))
            .collect::<RuleResult<Vec<_>>>()?;
        if !facts[0].dtype.is_float() {
            return Ok(None);
        }
        let shapes: Vec<&[usize]> = facts.iter().map(|f| f.shape.as_slice()).collect();
        let s = spec_of(cx.attrs().string("equation"), &shapes)?;
        let mut flops = 0u64;
        let mut grads = Vec::with_capacity(n);
        for i in 0..n {
            if n > 1 {
                let mut ops = vec![s.out.clone()];
                ops.extend((0..n).filter(|&j| j != i).map(|j| s.unique(j)));
                flops = flops.saturating_add(cost(&s, &ops, &s.unique(i)));
            }
            grads.push(Grad {
                input: i,
                needs: (0..n).filter(|&j| j != i).map(Saved::Input).collect(),
            });
        }
        Ok(Some(Backward {
            grads,
            extras: vec![],
            flops,
        }))
    }
    /// New, to be safe: a pure permutation or diagonal is a view in PyTorch.
    fn storage(&self, _cx: &Cx) -> Storage {
        Storage::New
    }
    /// The `bmm` operands of a two-operand einsum ([`pair_copies`]).
    fn saved_copies(
        &self,
        cx: &Cx,
        strides: &[Option<&[usize]>],
        _requires: &[bool],
    ) -> Vec<(usize, Vec<usize>)> {
        let Some(shapes) = cx
            .inputs
            .iter()
            .map(|f| f.map(|f| f.shape.as_slice()))
            .collect::<Option<Vec<_>>>()
        else {
            return Vec::new();
        };
        match spec_of(cx.attrs().string("equation"), &shapes) {
            Ok(s) if shapes.len() == 2 => pair_copies(&s, &shapes, strides),
            _ => Vec::new(),
        }
    }
    /// f32 (half types widened, rounded back): each operand's diagonals taken and
    /// broadcast ellipsis dims expanded, labels needed nowhere later summed, then
    /// pairwise left to right as batched GEMMs (`exec::gemm::sgemm`).
    fn forward_cpu(&self, cx: &KernelCx) -> RuleResult<Vec<Tensor>> {
        let ins = (0..cx.inputs.len())
            .map(|i| cx.input(i))
            .collect::<RuleResult<Vec<_>>>()?;
        let shapes: Vec<&[usize]> = ins.iter().map(|t| t.shape.as_slice()).collect();
        let s = spec_of(cx.attrs().string("equation"), &shapes)?;
        let out = cx.out(0)?;
        if !out.dtype.is_float() {
            return Err(format!(
                "the CPU executor has no kernel for Einsum on {} tensors",
                out.dtype
            )
            .into());
        }
        let ops = ins
            .iter()
            .enumerate()
            .map(|(i, t)| Ok(prep(&s, i, &t.to_f32()?, &t.shape)))
            .collect::<RuleResult<Vec<_>>>()?;
        let v = engine(&s, ops, &s.out);
        Ok(vec![Tensor::from_f32(out.dtype, out.shape.clone(), v)?])
    }
    /// Operand i's gradient: the einsum of the output gradient with the other
    /// (saved) operands into operand i's distinct labels (labels summed in the
    /// forward broadcast back), summed over its broadcast ellipsis dims
    /// (`exec::grad::sum_to`), then scattered onto its diagonal(s).
    fn backward_cpu(&self, cx: &BackwardCx) -> RuleResult<Vec<Option<Tensor>>> {
        let n = cx.inputs.len();
        let facts = (0..n)
            .map(|i| cx.input(i))
            .collect::<RuleResult<Vec<_>>>()?;
        let shapes: Vec<&[usize]> = facts.iter().map(|f| f.shape.as_slice()).collect();
        let s = spec_of(cx.attrs().string("equation"), &shapes)?;
        let g = cx.grad(0)?;
        let mut res = Vec::new();
        for i in (0..n).filter(|&i| cx.wants(i)) {
            let mut ops = vec![Opnd {
                v: g.to_vec(),
                labels: s.out.clone(),
                shape: s.out.iter().map(|&l| s.dims[l]).collect(),
            }];
            for j in (0..n).filter(|&j| j != i) {
                let t = cx.saved(Saved::Input(j))?;
                ops.push(prep(&s, j, &t.to_f32()?, &t.shape));
            }
            let (offs, ul, us) = diagonal(&s.ops[i], &facts[i].shape);
            let full: Vec<usize> = ul.iter().map(|&l| s.dims[l]).collect();
            let gu = sum_to(&engine(&s, ops, &ul), &full, &us);
            let dx = match offs {
                None => gu,
                Some(offs) => {
                    let mut dx = vec![0f32; facts[i].numel() as usize];
                    for (&o, &v) in offs.iter().zip(&gu) {
                        dx[o] = v;
                    }
                    dx
                }
            };
            res.push((i, dx));
        }
        cx.answer(res)
    }
    /// No device kernel: the host path (downloaded operands, the CPU kernel).
    fn cuda_kernels(&self, _op_type: &str) -> CudaKernels {
        CudaKernels::HOST
    }
    fn autocast(&self, _op_type: &str) -> Autocast {
        Autocast::Half
    }
}

/// Registers Einsum.
pub fn register(r: &mut Registry) {
    r.add("Einsum", Einsum);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attr, Attrs, DType, Node};

    fn node(eq: &str, n: usize) -> Node {
        Node {
            name: "e".into(),
            op_type: "Einsum".into(),
            domain: Default::default(),
            inputs: (0..n).map(Some).collect(),
            outputs: vec![Some(100)].into(),
            attrs: Attrs::from_iter([("equation".to_string(), Attr::String(eq.into()))]),
        }
    }

    /// Inferred shape, forward FLOPs and backward FLOPs, or the error.
    fn run(eq: &str, shapes: &[&[usize]]) -> RuleResult<(Vec<usize>, u64, u64)> {
        let facts: Vec<Fact> = shapes
            .iter()
            .map(|s| Fact::new(DType::F32, s.to_vec()))
            .collect();
        let n = node(eq, facts.len());
        let cx = Cx {
            node: &n,
            inputs: facts.iter().map(Some).collect(),
            opset: 17,
        };
        let out = Einsum.infer(&cx)?;
        let fl = Einsum.flops(&cx, &out);
        let bw = Einsum.backward(&cx, &out)?.unwrap();
        Ok((out[0].shape.clone(), fl, bw.flops))
    }

    #[test]
    fn shapes() {
        let sh = |eq: &str, s: &[&[usize]]| run(eq, s).unwrap().0;
        assert_eq!(sh("bij,bjk->bik", &[&[2, 3, 4], &[2, 4, 5]]), vec![2, 3, 5]);
        // The TorchScript exporter keeps torch's spaces.
        assert_eq!(
            sh(
                "b h i d, b h j d -> b h i j",
                &[&[2, 3, 4, 8], &[2, 3, 5, 8]]
            ),
            vec![2, 3, 4, 5]
        );
        // Implicit output: letters appearing once, sorted (uppercase first).
        assert_eq!(sh("ij,jk", &[&[2, 3], &[3, 4]]), vec![2, 4]);
        assert_eq!(sh("ba", &[&[2, 3]]), vec![3, 2]);
        assert_eq!(sh("aB", &[&[2, 3]]), vec![3, 2]);
        assert_eq!(sh("ii", &[&[3, 3]]), Vec::<usize>::new(), "a trace");
        // Ellipsis with broadcasting.
        assert_eq!(
            sh("...ij,...jk->...ik", &[&[2, 1, 3, 4], &[5, 4, 6]]),
            vec![2, 5, 3, 6]
        );
        assert_eq!(sh("...ij,jk", &[&[7, 3, 4], &[4, 2]]), vec![7, 3, 2]);
        assert_eq!(sh("...ii->...i", &[&[2, 4, 4]]), vec![2, 4]);
        assert_eq!(sh("ii->i", &[&[4, 4]]), vec![4]);
        assert_eq!(sh("ij->", &[&[4, 5]]), Vec::<usize>::new());
        assert_eq!(sh("ab,bc,cd->ad", &[&[2, 3], &[3, 4], &[4, 5]]), vec![2, 5]);
        assert_eq!(sh("...->...", &[&[]]), Vec::<usize>::new());
    }

    #[test]
    fn flops() {
        // 2 · b·i·j·k.
        let (_, f, b) = run("bij,bjk->bik", &[&[2, 3, 4], &[2, 4, 5]]).unwrap();
        assert_eq!(f, 2 * 2 * 3 * 4 * 5);
        assert_eq!(b, 2 * f, "two gradients, each a product of the same size");
        // Left to right: (ab,bc) costs 2·a·b·c, then (ac,cd) 2·a·c·d.
        let (_, f, _) = run("ab,bc,cd->ad", &[&[2, 3], &[3, 4], &[4, 5]]).unwrap();
        assert_eq!(f, 2 * 2 * 3 * 4 + 2 * 2 * 4 * 5);
        // A single-operand sum: one add per element; a diagonal is free.
        assert_eq!(run("ij->", &[&[4, 5]]).unwrap().1, 20);
        assert_eq!(run("ii->i", &[&[4, 4]]).unwrap().1, 0);
        assert_eq!(run("ij->ji", &[&[4, 5]]).unwrap().1, 0);
        // A label only in operand 0 and not in the output is summed first.
        let (_, f, _) = run("ij,j->", &[&[3, 4], &[4]]).unwrap();
        assert_eq!(f, 12 + 2 * 4);
        let (_, f, _) = run("ij,k->k", &[&[3, 4], &[5]]).unwrap();
        assert_eq!(f, 12 + 2 * 5);
    }

    #[test]
    fn bad_equations_are_errors() {
        let err = |eq: &str, s: &[&[usize]]| run(eq, s).unwrap_err();
        assert!(err("ij,jk->ik", &[&[2, 3], &[4, 5]])
            .to_string()
            .contains("label 'j' has sizes 3 and 4"));
        assert!(err("ij,jk->ik", &[&[2, 3]])
            .to_string()
            .contains("2 operand terms for 1 inputs"));
        assert!(err("ijk->i", &[&[2, 3]]).to_string().contains("rank 2"));
        assert!(err("ij->k", &[&[2, 3]])
            .to_string()
            .contains("in no operand"));
        assert!(err("ij->ii", &[&[2, 3]]).to_string().contains("repeated"));
        assert!(err("i.j->i", &[&[2, 3]]).to_string().contains("ellipsis"));
        assert!(err("......->", &[&[2, 3]])
            .to_string()
            .contains("more than one ellipsis"));
        assert!(err("i1->i", &[&[2]])
            .to_string()
            .contains("unexpected character"));
        assert!(err("i->i->i", &[&[2]])
            .to_string()
            .contains("more than one '->'"));
        assert!(err("...i,...i->...i", &[&[2, 3], &[4, 3]])
            .to_string()
            .contains("sizes 2 and 4"));
        let n = Node {
            attrs: Attrs::default(),
            ..node("", 1)
        };
        let f = Fact::new(DType::F32, vec![2]);
        let cx = Cx {
            node: &n,
            inputs: smallvec::smallvec![Some(&f)],
            opset: 17,
        };
        assert!(Einsum
            .infer(&cx)
            .unwrap_err()
            .to_string()
            .contains("equation"));
        let g = Fact::new(DType::F16, vec![2]);
        let n = node("i,i->", 2);
        let cx = Cx {
            node: &n,
            inputs: smallvec::smallvec![Some(&f), Some(&g)],
            opset: 17,
        };
        assert!(Einsum
            .infer(&cx)
            .unwrap_err()
            .to_string()
            .contains("different types"));
    }

    #[test]
    fn saved_tensors_are_the_other_operands() {
        let facts = [
            Fact::new(DType::F32, vec![2, 3]),
            Fact::new(DType::F32, vec![3, 4]),
        ];
        let n = node("ij,jk->ik", 2);
        let cx = Cx {
            node: &n,
            inputs: facts.iter().map(Some).collect(),
            opset: 17,
        };
        let out = Einsum.infer(&cx).unwrap();
        let bw = Einsum.backward(&cx, &out).unwrap().unwrap();
        assert_eq!(bw.grads[0].needs, vec![Saved::Input(1)]);
        assert_eq!(bw.grads[1].needs, vec![Saved::Input(0)]);
        let n = node("ii->i", 1);
        let cx = Cx {
            node: &n,
            inputs: smallvec::smallvec![Some(&facts[0])],
            opset: 17,
        };
        assert!(Einsum.infer(&cx).is_err(), "3 ≠ 2");
        assert_eq!(Einsum.cuda_kernels("Einsum"), CudaKernels::HOST);
    }
}
