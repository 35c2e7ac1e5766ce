//! Numpy (multidirectional) broadcasting for element-wise kernels.

/// Row-major strides of `shape`.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Strides of an input of shape `shape` read at the coordinates of an output of
/// shape `out` (right-aligned; 0 along broadcast axes).
pub fn bcast_strides(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let off = out.len() - shape.len();
    let st = strides(shape);
    (0..out.len())
        .map(|i| {
            if i < off || shape[i - off] == 1 {
                0
            } else {
                st[i - off]
            }
        })
        .collect()
}

/// For every output element in row-major order, the flat offsets of the `N` inputs
/// that broadcast to it. Calls `f(out_index, offsets)`.
pub fn for_each<const N: usize>(
    out: &[usize],
    ins: [&[usize]; N],
    mut f: impl FnMut(usize, [usize; N]),
) {
    let total: usize = out.iter().product();
    if total == 0 {
        return;
    }
    let st: Vec<Vec<usize>> = ins.iter().map(|s| bcast_strides(s, out)).collect();
    if out.is_empty() {
        f(0, [0; N]);
        return;
    }
    let r = out.len();
    let inner = out[r - 1];
    let inner_st: [usize; N] = std::array::from_fn(|k| st[k][r - 1]);
    let mut coord = vec![0usize; r - 1];
    let mut base = [0usize; N];
    let mut o = 0;
    loop {
        let mut off = base;
        for _ in 0..inner {
            f(o, off);
            o += 1;
            for k in 0..N {
                off[k] += inner_st[k];
            }
        }
        // Next outer coordinate.
        let mut i = r - 1;
        loop {
            if i == 0 {
                return;
            }
            i -= 1;
            coord[i] += 1;
            for k in 0..N {
                base[k] += st[k][i];
            }
            if coord[i] < out[i] {
                break;
            }
            for k in 0..N {
                base[k] -= st[k][i] * out[i];
            }
            coord[i] = 0;
        }
    }
}

/// `out[i] = f(a[ia], b[ib])` over the broadcast shape `out`, with fast paths for
/// equal shapes and scalar operands.
pub fn zip2<A: Copy, B: Copy, O>(
    out: &[usize],
    (a, sa): (&[A], &[usize]),
    (b, sb): (&[B], &[usize]),
    f: impl Fn(A, B) -> O,
) -> Vec<O> {
    if sa == out && sb == out {
        return a.iter().zip(b).map(|(&x, &y)| f(x, y)).collect();
    }
    if sa == out && b.len() == 1 {
        let y = b[0];
        return a.iter().map(|&x| f(x, y)).collect();
    }
    if sb == out && a.len() == 1 {
        let x = a[0];
        return b.iter().map(|&y| f(x, y)).collect();
    }
    let mut v = Vec::with_capacity(out.iter().product());
    for_each(out, [sa, sb], |_, [i, j]| v.push(f(a[i], b[j])));
    v
}

/// `base + Σ cᵢ·stridesᵢ` for every coordinate `c` of `shape`, in row-major order:
/// the source offsets of a strided view (transpose, slice with steps) of a
/// contiguous tensor. Callers keep every offset inside their data.
pub fn affine_offsets(shape: &[usize], base: isize, strides: &[isize]) -> Vec<usize> {
    let total: usize = shape.iter().product();
    let mut v = Vec::with_capacity(total);
    if total == 0 {
        return v;
    }
    let r = shape.len();
    if r == 0 {
        v.push(base as usize);
        return v;
    }
    let mut coord = vec![0usize; r];
    let mut off = base;
    loop {
        let (inner, st) = (shape[r - 1], strides[r - 1]);
        let mut o = off;
        for _ in 0..inner {
            v.push(o as usize);
            o += st;
        }
        let mut i = r - 1;
        loop {
            if i == 0 {
                return v;
            }
            i -= 1;
            coord[i] += 1;
            off += strides[i];
            if coord[i] < shape[i] {
                break;
            }
            off -= strides[i] * shape[i] as isize;
            coord[i] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_offsets() {
        let mut seen = Vec::new();
        for_each(&[2, 3], [&[2, 1][..], &[3][..]], |o, [i, j]| {
            seen.push((o, i, j))
        });
        assert_eq!(
            seen,
            vec![
                (0, 0, 0),
                (1, 0, 1),
                (2, 0, 2),
                (3, 1, 0),
                (4, 1, 1),
                (5, 1, 2)
            ]
        );
        let v = zip2(&[2, 2], (&[1, 2], &[2, 1]), (&[10, 20], &[2]), |a, b| a + b);
        assert_eq!(v, vec![11, 21, 12, 22]);
        let mut n = 0;
        for_each(&[], [&[][..]], |_, _| n += 1);
        assert_eq!(n, 1);
        // Transpose of a 2×3: offsets of the 3×2 view.
        assert_eq!(affine_offsets(&[3, 2], 0, &[1, 3]), vec![0, 3, 1, 4, 2, 5]);
        // Reversed slice.
        assert_eq!(affine_offsets(&[3], 4, &[-2]), vec![4, 2, 0]);
    }
}
