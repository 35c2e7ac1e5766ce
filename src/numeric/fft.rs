//! A complex discrete Fourier transform of any length, in f64: mixed-radix
//! Cooley–Tukey over the length's prime factors (a direct sum for each
//! factor, so a prime length costs `n²`). The signal ops (`ops::signal`) run
//! every transform here; results do not depend on the thread count.

use std::f64::consts::PI;
use std::ops::{Add, Mul};

/// A complex number.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct C64 {
    /// Real part.
    pub re: f64,
    /// Imaginary part.
    pub im: f64,
}

impl C64 {
    /// `re + i·im`.
    pub const fn new(re: f64, im: f64) -> C64 {
        C64 { re, im }
    }

    /// The complex conjugate.
    pub fn conj(self) -> C64 {
        C64::new(self.re, -self.im)
    }

    /// Scaled by a real factor.
    pub fn scale(self, s: f64) -> C64 {
        C64::new(self.re * s, self.im * s)
    }
}

impl Add for C64 {
    type Output = C64;
    fn add(self, o: C64) -> C64 {
        C64::new(self.re + o.re, self.im + o.im)
    }
}

impl Mul for C64 {
    type Output = C64;
    fn mul(self, o: C64) -> C64 {
        C64::new(
            self.re * o.re - self.im * o.im,
            self.re * o.im + self.im * o.re,
        )
    }
}

/// A transform of one length and direction: `X[k] = Σ_t x[t]·e^{∓2πi·kt/n}`
/// (`inverse`: the `+` sign, unnormalized).
pub struct Fft {
    n: usize,
    /// `e^{∓2πi·j/n}` for `j < n`.
    twiddles: Vec<C64>,
    /// The prime factors of `n`, smallest first.
    factors: Vec<usize>,
}

impl Fft {
    /// The plan for length `n` (any, 0 included).
    pub fn new(n: usize, inverse: bool) -> Fft {
        let sign = if inverse { 1.0 } else { -1.0 };
        let twiddles = (0..n)
            .map(|j| {
                let (s, c) = (2.0 * PI * j as f64 / n as f64).sin_cos();
                C64::new(c, sign * s)
            })
            .collect();
        let mut factors = Vec::new();
        let (mut m, mut p) = (n, 2);
        while m > 1 {
            if p * p > m {
                factors.push(m);
                break;
            }
            if m % p == 0 {
                factors.push(p);
                m /= p;
            } else {
                p += 1;
            }
        }
        Fft {
            n,
            twiddles,
            factors,
        }
    }

    /// The transform length.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether the length is 0.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Transforms `x` (length `n`) into `out` (length `n`).
    pub fn run(&self, x: &[C64], out: &mut [C64]) {
        assert_eq!((x.len(), out.len()), (self.n, self.n), "fft length");
        if self.n > 0 {
            self.rec(x, 1, self.n, out, &self.factors);
        }
    }

    /// The transform of the `n` elements `x[0], x[stride], …` into `out`:
    /// `p` transforms of length `n/p` over the residues mod `p` (`p` the first
    /// factor), then `n/p` direct transforms of length `p` across them.
    fn rec(&self, x: &[C64], stride: usize, n: usize, out: &mut [C64], factors: &[usize]) {
        if n == 1 {
            out[0] = x[0];
            return;
        }
        let p = factors[0];
        let m = n / p;
        for r in 0..p {
            self.rec(
                &x[r * stride..],
                stride * p,
                m,
                &mut out[r * m..(r + 1) * m],
                &factors[1..],
            );
        }
        // Twiddle index steps of this level over the full-length table.
        let step = self.n / n;
        let mut t = vec![C64::default(); p];
        for k in 0..m {
            for (r, tr) in t.iter_mut().enumerate() {
                *tr = out[r * m + k] * self.twiddles[(r * k * step) % self.n];
            }
            for q in 0..p {
                let mut s = C64::default();
                for (r, &tr) in t.iter().enumerate() {
                    s = s + tr * self.twiddles[(r * q * m * step) % self.n];
                }
                out[q * m + k] = s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, summed directly.
    fn direct(x: &[C64], inverse: bool) -> Vec<C64> {
        let n = x.len();
        let sign = if inverse { 1.0 } else { -1.0 };
        (0..n)
            .map(|k| {
                x.iter().enumerate().fold(C64::default(), |s, (t, &v)| {
                    let a = 2.0 * PI * ((k * t) % n) as f64 / n as f64;
                    s + v * C64::new(a.cos(), sign * a.sin())
                })
            })
            .collect()
    }

    #[test]
    fn mixed_radix_equals_the_definition() {
        for n in [1, 2, 3, 4, 6, 7, 12, 16, 25, 30, 49, 97, 400] {
            for inverse in [false, true] {
                let x: Vec<C64> = (0..n)
                    .map(|i| C64::new((i * 37 % 101) as f64 - 50.0, (i * 13 % 7) as f64))
                    .collect();
                let mut got = vec![C64::default(); n];
                Fft::new(n, inverse).run(&x, &mut got);
                let want = direct(&x, inverse);
                let worst = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a.re - b.re).abs().max((a.im - b.im).abs()))
                    .fold(0.0, f64::max);
                assert!(worst < 1e-9 * n as f64 * 50.0, "n {n}: {worst:e}");
            }
        }
    }

    #[test]
    fn inverse_undoes_forward() {
        let n = 360;
        let x: Vec<C64> = (0..n).map(|i| C64::new(i as f64, -(i as f64))).collect();
        let (mut y, mut z) = (vec![C64::default(); n], vec![C64::default(); n]);
        Fft::new(n, false).run(&x, &mut y);
        Fft::new(n, true).run(&y, &mut z);
        for (a, b) in x.iter().zip(&z) {
            assert!((a.re - b.re / n as f64).abs() < 1e-9);
            assert!((a.im - b.im / n as f64).abs() < 1e-9);
        }
    }
}
