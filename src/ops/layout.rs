//! Strides: where each element of a tensor sits in its storage, as PyTorch lays it
//! out. A view op (reshape, transpose, slice, select, expand...) aliases its input's
//! storage under new strides; whether a later reshape can stay a view, or must copy,
//! depends on them (PyTorch's `computeStride`, aten/src/ATen/TensorUtils.cpp), and so
//! does whether `torch.matmul` copies an operand before `bmm` saves it
//! ([`crate::ops::linalg`]). Strides count elements; offsets do not matter here.

/// Row-major strides of `shape`.
pub fn contiguous(shape: &[usize]) -> Vec<usize> {
    let mut st = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        st[d] = st[d + 1].saturating_mul(shape[d + 1].max(1));
    }
    st
}

/// PyTorch's `is_contiguous`: row-major up to size-1 dims (whose stride is free);
/// an empty tensor is contiguous.
pub fn is_contiguous(shape: &[usize], strides: &[usize]) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let mut expected = 1usize;
    for d in (0..shape.len()).rev() {
        if shape[d] != 1 {
            if strides[d] != expected {
                return false;
            }
            expected = expected.saturating_mul(shape[d]);
        }
    }
    true
}

/// The strides of `shape`/`strides` viewed as `new` (same element count), or `None`
/// where no view exists and a reshape copies: PyTorch's `computeStride`. Old dims
/// are taken in chunks that are contiguous with respect to each other (a size-1 dim
/// never breaks a chunk); each chunk must be covered exactly by consecutive new dims.
pub fn view(shape: &[usize], strides: &[usize], new: &[usize]) -> Option<Vec<usize>> {
    if shape.is_empty() {
        return Some(vec![1; new.len()]);
    }
    let numel: usize = shape.iter().product();
    if numel == 0 {
        return Some(if shape == new {
            strides.to_vec()
        } else {
            contiguous(new)
        });
    }
    let mut out = vec![0usize; new.len()];
    let mut view_d = new.len() as isize - 1;
    let mut chunk_base = *strides.last().expect("rank > 0");
    let mut tensor_numel = 1usize;
    let mut view_numel = 1usize;
    for d in (0..shape.len()).rev() {
        tensor_numel = tensor_numel.saturating_mul(shape[d]);
        let chunk_ends = d == 0
            || (shape[d - 1] != 1 && strides[d - 1] != tensor_numel.saturating_mul(chunk_base));
        if chunk_ends {
            while view_d >= 0 && (view_numel < tensor_numel || new[view_d as usize] == 1) {
                out[view_d as usize] = view_numel.saturating_mul(chunk_base);
                view_numel = view_numel.saturating_mul(new[view_d as usize]);
                view_d -= 1;
            }
            if view_numel != tensor_numel {
                return None;
            }
            if d > 0 {
                chunk_base = strides[d - 1];
                tensor_numel = 1;
                view_numel = 1;
            }
        }
    }
    (view_d == -1).then_some(out)
}

/// The strides of `shape`/`strides` expanded to `to` (numpy broadcasting, as
/// `Tensor.expand`): new leading dims and stretched size-1 dims get stride 0.
pub fn expand(shape: &[usize], strides: &[usize], to: &[usize]) -> Vec<usize> {
    let lead = to.len().saturating_sub(shape.len());
    (0..to.len())
        .map(|j| {
            if j < lead {
                0
            } else {
                let d = j - lead;
                if shape[d] == 1 && to[j] != 1 {
                    0
                } else {
                    strides[d]
                }
            }
        })
        .collect()
}

/// Strides of a dense tensor of `shape` whose dims lie in memory in the order
/// `phys` (outermost first): a permutation of a contiguous tensor.
pub fn permuted(shape: &[usize], phys: &[usize]) -> Vec<usize> {
    let mut st = vec![0usize; shape.len()];
    let mut acc = 1usize;
    for &d in phys.iter().rev() {
        st[d] = acc;
        acc = acc.saturating_mul(shape[d]);
    }
    st
}

/// The strides of a new output of an element-wise op (PyTorch's TensorIterator,
/// aten/src/ATen/TensorIterator.cpp): contiguous when every input is; the inputs'
/// strides when they all share one dense layout (same shape); otherwise the dims
/// sorted by the inputs' strides (`reorder_dimensions`: the first input that orders
/// two dims decides, broadcast dims never do, equal strides put the smaller dim
/// inner) and the output laid out densely in that order, so an element-wise op on a
/// transposed tensor gives a transposed result. `inputs`: each input's shape and
/// strides, `None` when unknown (then contiguous).
pub fn elementwise(out: &[usize], inputs: &[(&[usize], Option<&[usize]>)]) -> Vec<usize> {
    let n = out.len();
    let known: Option<Vec<(&[usize], &[usize])>> = inputs
        .iter()
        .map(|&(sh, st)| st.map(|st| (sh, st)))
        .collect();
    let Some(ins) = known else {
        return contiguous(out);
    };
    if n <= 1 || ins.is_empty() || ins.iter().all(|(sh, st)| is_contiguous(sh, st)) {
        return contiguous(out);
    }
    if ins.iter().all(|(sh, _)| *sh == out) {
        let st0 = ins[0].1;
        if ins.iter().all(|(_, st)| *st == st0) && is_dense(out, st0) {
            return st0.to_vec();
        }
    }
    // Broadcast strides per input, over the output's dims.
    let bst: Vec<Vec<usize>> = ins.iter().map(|(sh, st)| expand(sh, st, out)).collect();
    // perm[0] is the fastest dim; start from row-major (n-1, ..., 0).
    let mut perm: Vec<usize> = (0..n).rev().collect();
    let should_swap = |d0: usize, d1: usize| -> i32 {
        for st in &bst {
            let (s0, s1) = (st[d0], st[d1]);
            if s0 == 0 || s1 == 0 {
                continue;
            }
            if s0 < s1 {
                return -1;
            }
            if s0 > s1 {
                return 1;
            }
            if out[d0] > out[d1] {
                return 1;
            }
        }
        0
    };
    for i in 1..n {
        let mut d1 = i;
        for d0 in (0..i).rev() {
            let c = should_swap(perm[d0], perm[d1]);
            if c > 0 {
                perm.swap(d0, d1);
                d1 = d0;
            } else if c < 0 {
                break;
            }
        }
    }
    let mut st = vec![0usize; n];
    let mut acc = 1usize;
    for &d in &perm {
        st[d] = acc;
        acc = acc.saturating_mul(out[d].max(1));
    }
    st
}

/// PyTorch's `is_non_overlapping_and_dense`: some order of the dims is contiguous.
fn is_dense(shape: &[usize], strides: &[usize]) -> bool {
    let mut dims: Vec<usize> = (0..shape.len()).filter(|&d| shape[d] != 1).collect();
    dims.sort_by_key(|&d| (strides[d], shape[d]));
    let mut expected = 1usize;
    for d in dims {
        if strides[d] != expected {
            return false;
        }
        expected = expected.saturating_mul(shape[d]);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_strides() {
        assert_eq!(contiguous(&[2, 3, 4]), vec![12, 4, 1]);
        assert!(is_contiguous(&[2, 1, 4], &[4, 99, 1]));
        assert!(!is_contiguous(&[2, 3], &[1, 2]));
    }

    #[test]
    fn views_follow_compute_stride() {
        // A contiguous tensor views as anything.
        assert_eq!(view(&[2, 3, 4], &[12, 4, 1], &[6, 4]), Some(vec![4, 1]));
        // [B, S, H, D] transposed to [B, H, S, D]: B and H cannot merge.
        let (sh, st) = ([2, 4, 3, 5], [60, 5, 20, 1]);
        assert_eq!(view(&sh, &st, &[8, 3, 5]), None);
        // ... but S and D can be split further, and a batch of one merges freely.
        assert_eq!(
            view(&[1, 4, 3, 5], &[60, 5, 20, 1], &[4, 3, 5]),
            Some(vec![5, 20, 1])
        );
        // The last two dims of a transpose are a chunk each.
        assert_eq!(
            view(&[6, 5, 4], &[20, 1, 5], &[6, 5, 4]),
            Some(vec![20, 1, 5])
        );
        assert_eq!(
            view(&[2, 3, 5, 4], &[60, 20, 1, 5], &[6, 5, 4]),
            Some(vec![20, 1, 5])
        );
        assert_eq!(view(&[6, 5, 4], &[20, 1, 5], &[6, 20]), None);
    }

    #[test]
    fn permuted_is_a_transpose_of_contiguous() {
        // [B, H, S, D] laid out as [B, S, H, D].
        assert_eq!(permuted(&[2, 3, 4, 5], &[0, 2, 1, 3]), vec![60, 5, 15, 1]);
    }

    #[test]
    fn elementwise_follows_the_input_layout() {
        let out = [2, 4, 6, 4];
        // Contiguous in, contiguous out.
        assert_eq!(
            elementwise(&out, &[(&out, Some(&contiguous(&out)))]),
            contiguous(&out)
        );
        // A transposed dense input keeps its layout.
        let t = permuted(&out, &[0, 2, 1, 3]);
        assert_eq!(elementwise(&out, &[(&out, Some(&t))]), t);
        // A select of a permuted qkv (not dense): [B, H, N, D] strides of
        // [B, N, 3, H, D] → dims sorted by stride: laid out as [B, N, H, D].
        let q = [288, 4, 48, 1];
        assert_eq!(
            elementwise(&out, &[(&out, Some(&q))]),
            permuted(&out, &[0, 2, 1, 3])
        );
        // A broadcast operand does not decide; the strided one does.
        let bias = [4];
        assert_eq!(
            elementwise(&out, &[(&bias, Some(&[1])), (&out, Some(&q))]),
            permuted(&out, &[0, 2, 1, 3])
        );
        // Unknown strides: contiguous.
        assert_eq!(elementwise(&out, &[(&out, None)]), contiguous(&out));
    }

    #[test]
    fn expanded_dims_merge_only_with_expanded_dims() {
        // A weight [K, N] expanded to [B, H, K, N]: both new dims stride 0, merge.
        let st = expand(&[4, 5], &[5, 1], &[2, 3, 4, 5]);
        assert_eq!(st, vec![0, 0, 5, 1]);
        assert_eq!(view(&[2, 3, 4, 5], &st, &[6, 4, 5]), Some(vec![0, 5, 1]));
        // GQA: [B, 1, S, D] expanded over heads cannot merge B with H.
        let st = expand(&[2, 1, 4, 5], &[20, 20, 5, 1], &[2, 3, 4, 5]);
        assert_eq!(st, vec![20, 0, 5, 1]);
        assert_eq!(view(&[2, 3, 4, 5], &st, &[6, 4, 5]), None);
    }
}
