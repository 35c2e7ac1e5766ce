//! Deterministic random numbers: SplitMix64 (Steele, Lea, Flood 2014), counter-based
//! so that element `i` of a stream is a pure function of `(seed, i)`. Large tensors
//! are therefore filled in parallel with the same result as sequentially, on any
//! machine and any thread count.

/// SplitMix64's increment (the golden ratio in 64 bits).
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The `i`-th 64-bit output of the SplitMix64 stream started at `seed`.
pub fn at(seed: u64, i: u64) -> u64 {
    mix(seed.wrapping_add(i.wrapping_add(1).wrapping_mul(GAMMA)))
}

/// A uniform f32 in `[0, 1)` from 24 random bits of element `i`.
pub fn unit_f32(seed: u64, i: u64) -> f32 {
    (at(seed, i) >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
}

/// A standard normal f32 for element `i` (Box–Muller on two 32-bit halves of one
/// output; the cosine branch).
pub fn normal_f32(seed: u64, i: u64) -> f32 {
    let r = at(seed, i);
    // u1 in (0, 1], u2 in [0, 1).
    let u1 = ((r >> 32) as f64 + 1.0) / 4_294_967_296.0;
    let u2 = (r & 0xFFFF_FFFF) as f64 / 4_294_967_296.0;
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

/// A seed derived from `seed` and a name (FNV-1a of the name, then mixed), so each
/// named tensor gets its own stream independent of graph order.
pub fn name_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    mix(seed ^ mix(h))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_reference_values() {
        // SplitMix64 seeded with 0: the published first outputs.
        assert_eq!(at(0, 0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(at(0, 1), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn uniform_and_normal_moments() {
        let n = 20_000;
        let u: f64 = (0..n).map(|i| unit_f32(7, i) as f64).sum::<f64>() / n as f64;
        assert!((u - 0.5).abs() < 0.01, "{u}");
        let z: Vec<f64> = (0..n).map(|i| normal_f32(7, i) as f64).collect();
        let mean = z.iter().sum::<f64>() / n as f64;
        let var = z.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(
            mean.abs() < 0.03 && (var - 1.0).abs() < 0.05,
            "{mean} {var}"
        );
        assert_ne!(name_seed(1, "a"), name_seed(1, "b"));
    }
}
