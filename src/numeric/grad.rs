//! Shared machinery of the backward kernels: summing a broadcast gradient back to
//! an operand's shape.

use super::broadcast::for_each;

/// Sums a gradient `g` of the broadcast shape `out` back to the shape `target` that
/// was broadcast to it (numpy rules: right-aligned, size-1 or missing axes summed),
/// accumulating in f64 in row-major order (deterministic). Equal shapes copy.
pub fn sum_to(g: &[f32], out: &[usize], target: &[usize]) -> Vec<f32> {
    if out == target {
        return g.to_vec();
    }
    let n: usize = target.iter().product();
    let mut acc = vec![0f64; n];
    for_each(out, [target], |o, [i]| acc[i] += g[o] as f64);
    acc.into_iter().map(|v| v as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_over_broadcast_axes() {
        let g: Vec<f32> = (0..6).map(|v| v as f32).collect();
        assert_eq!(sum_to(&g, &[2, 3], &[3]), vec![3.0, 5.0, 7.0]);
        assert_eq!(sum_to(&g, &[2, 3], &[2, 1]), vec![3.0, 12.0]);
        assert_eq!(sum_to(&g, &[2, 3], &[]), vec![15.0]);
        assert_eq!(sum_to(&g, &[2, 3], &[2, 3]), g);
    }
}
