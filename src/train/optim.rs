//! What each optimizer keeps per trainable parameter, and what its update allocates
//! while it runs. Every size names its source:
//!
//! | optimizer | state per parameter tensor of `n` elements | update temporaries |
//! |---|---|---|
//! | sgd | none | none (in place) |
//! | momentum | `n` in the parameter dtype (`momentum_buffer`, torch.optim.SGD) | none |
//! | adam, adamw | `2n` in the parameter dtype (`exp_avg`, `exp_avg_sq`, torch.optim.Adam) | `sqrt(exp_avg_sq)` of every parameter at once (the foreach path, CUDA's default) |
//! | adam8bit | `n < 4096`: `2n` fp32; else `2n` bytes (uint8 `state1`, `state2`) + `2·⌈n/2048⌉` fp32 absmax; plus two shared 256-entry fp32 quantization maps | none (one fused kernel per tensor) |
//! | lion | `n` in the parameter dtype (`exp_avg`) | one parameter-sized tensor at a time |
//! | adafactor | `≥2-D` `[.., r, c]`: `numel/c + numel/r` fp32 (row and column factors); `≤1-D`: `n` fp32; no first moment | two fp32 parameter-sized tensors at a time |
//!
//! Sources: bitsandbytes `Optimizer2State.init_state` (bitsandbytes/optim/optimizer.py):
//! a parameter with fewer than `min_8bit_size = 4096` elements gets fp32 `state1`/
//! `state2`; otherwise uint8 states, and with `block_wise=True` (the default)
//! `absmax1`/`absmax2` of `⌈n/2048⌉` fp32 each; `qmap1`/`qmap2` are the optimizer's
//! shared `dynamic`/`udynamic` maps of 256 fp32 values, counted once. The update is
//! `optimizer_update_8bit_blockwise`, in place. Lion: Chen et al. 2023, "Symbolic
//! Discovery of Optimization Algorithms", Program 1, as lion-pytorch implements it
//! (`exp_avg = zeros_like(p)`; per parameter `update = exp_avg.clone().mul_(β1)
//! .add(grad, 1−β1).sign_()`). Adafactor: Shazeer & Stern 2018, as Hugging Face
//! transformers' `Adafactor` implements it with its defaults (`beta1=None`: no
//! `exp_avg`; a parameter of 2 or more dims keeps `exp_avg_sq_row` of shape
//! `shape[:-1]` and `exp_avg_sq_col` of `shape[:-2] + shape[-1:]`, others a full
//! `exp_avg_sq`; states are made `.to(grad)` after a half gradient is cast to fp32,
//! so fp32). Its update holds `grad**2 + eps` while `_approx_sq_grad` builds the
//! full-size product, and `-update` beside `update` at the end: two fp32 tensors of
//! one parameter.

use super::Optimizer;
use crate::ir::DType;

/// bitsandbytes' 8-bit block-wise optimizer state: elements per fp32 absmax.
pub const BNB_STATE_BLOCK: u64 = 2048;
/// bitsandbytes' `min_8bit_size`: smaller parameters keep fp32 states.
pub const BNB_MIN_8BIT_SIZE: u64 = 4096;
/// Entries of one bitsandbytes quantization map (`dynamic`, `udynamic`), fp32.
pub const BNB_QMAP_ENTRIES: u64 = 256;

impl Optimizer {
    /// Full-size states in the parameter dtype that memplan's executor keeps (the
    /// optimizers it runs: sgd, momentum, adam, adamw); 0 for the others.
    pub fn states(self) -> u64 {
        match self {
            Optimizer::Sgd => 0,
            Optimizer::Momentum => 1,
            Optimizer::Adam | Optimizer::Adamw => 2,
            Optimizer::Adam8bit | Optimizer::Lion | Optimizer::Adafactor => 0,
        }
    }

    /// Whether memplan's executor (`verify`) runs this optimizer's update.
    pub fn executable(self) -> bool {
        matches!(
            self,
            Optimizer::Sgd | Optimizer::Momentum | Optimizer::Adam | Optimizer::Adamw
        )
    }

    /// State bytes of one trainable parameter of shape `shape` stored as `dtype`.
    pub fn state_bytes(self, shape: &[usize], dtype: DType) -> u64 {
        self.state_tensors(shape, dtype)
            .iter()
            .fold(0u64, |a, &b| a.saturating_add(b))
    }

    /// The state tensors of one parameter, in the order the optimizer allocates
    /// them (`exp_avg`, then `exp_avg_sq`; bitsandbytes' `state1`, `state2`,
    /// `absmax1`, `absmax2`; Adafactor's row and column factors), in bytes.
    pub fn state_tensors(self, shape: &[usize], dtype: DType) -> Vec<u64> {
        let n: u64 = shape.iter().map(|&d| d as u64).product();
        let f32b = |k: u64| k.saturating_mul(4);
        let own = |k: u64| dtype.bytes_for(k).unwrap_or(u64::MAX);
        match self {
            Optimizer::Sgd => vec![],
            Optimizer::Momentum | Optimizer::Lion => vec![own(n)],
            Optimizer::Adam | Optimizer::Adamw => vec![own(n), own(n)],
            Optimizer::Adam8bit => {
                if n < BNB_MIN_8BIT_SIZE {
                    vec![f32b(n), f32b(n)]
                } else {
                    let absmax = f32b(n.div_ceil(BNB_STATE_BLOCK));
                    vec![n, n, absmax, absmax]
                }
            }
            Optimizer::Adafactor => {
                if shape.len() >= 2 {
                    let c = shape[shape.len() - 1] as u64;
                    let r = shape[shape.len() - 2] as u64;
                    let row = n.checked_div(c).unwrap_or(0);
                    let col = n.checked_div(r).unwrap_or(0);
                    vec![f32b(row), f32b(col)]
                } else {
                    vec![f32b(n)]
                }
            }
        }
    }

    /// State bytes shared by all parameters (bitsandbytes' two quantization maps,
    /// when some parameter has 8-bit states), given the parameters' element counts.
    pub fn shared_state_bytes(self, numels: &[u64]) -> u64 {
        match self {
            Optimizer::Adam8bit if numels.iter().any(|&n| n >= BNB_MIN_8BIT_SIZE) => {
                2 * BNB_QMAP_ENTRIES * 4
            }
            _ => 0,
        }
    }

    /// Temporary bytes of one update: `grad_bytes` are all gradients' bytes,
    /// `largest` the largest trainable parameter's element count, `dtype` the
    /// parameters' storage type.
    pub fn temp_bytes(self, grad_bytes: u64, largest: u64, dtype: DType) -> u64 {
        match self {
            // torch.optim.Adam's foreach path: `exp_avg_sq_sqrt = torch._foreach_sqrt(...)`
            // for every parameter at once.
            Optimizer::Adam | Optimizer::Adamw => grad_bytes,
            Optimizer::Sgd | Optimizer::Momentum | Optimizer::Adam8bit => 0,
            Optimizer::Lion => dtype.bytes_for(largest).unwrap_or(u64::MAX),
            Optimizer::Adafactor => largest.saturating_mul(8),
        }
    }

    /// FLOPs of the update per trainable element (estimates: one per arithmetic
    /// operation of the formula).
    pub fn flops_per_element(self) -> u64 {
        match self {
            Optimizer::Sgd => 2,
            Optimizer::Momentum => 4,
            Optimizer::Lion => 6,
            Optimizer::Adam | Optimizer::Adamw | Optimizer::Adafactor => 12,
            // Adam's 12 plus dequantizing and requantizing both states.
            Optimizer::Adam8bit => 16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_sizes_by_hand() {
        let f = DType::F32;
        // A 64×128 weight (8192 elements) and a 128 bias.
        assert_eq!(Optimizer::Adam.state_bytes(&[64, 128], f), 2 * 8192 * 4);
        assert_eq!(
            Optimizer::Adam.state_bytes(&[128], DType::BF16),
            2 * 128 * 2
        );
        // 8-bit: 2 bytes each + 4 blocks of 2048 × 2 states × 4 bytes.
        assert_eq!(
            Optimizer::Adam8bit.state_bytes(&[64, 128], f),
            2 * 8192 + 2 * 4 * 4
        );
        assert_eq!(
            Optimizer::Adam8bit.state_bytes(&[4097], f),
            2 * 4097 + 2 * 3 * 4
        );
        // Below min_8bit_size: fp32 states whatever the parameter dtype.
        assert_eq!(
            Optimizer::Adam8bit.state_bytes(&[128], DType::BF16),
            2 * 128 * 4
        );
        assert_eq!(Optimizer::Lion.state_bytes(&[64, 128], f), 8192 * 4);
        // Adafactor: rows (64) + columns (128), fp32; conv [8, 4, 3, 3]: 8·4·3 + 8·4·3.
        assert_eq!(
            Optimizer::Adafactor.state_bytes(&[64, 128], f),
            (64 + 128) * 4
        );
        assert_eq!(
            Optimizer::Adafactor.state_bytes(&[8, 4, 3, 3], f),
            (96 + 96) * 4
        );
        assert_eq!(
            Optimizer::Adafactor.state_bytes(&[128], DType::BF16),
            128 * 4
        );
        assert_eq!(Optimizer::Adam8bit.shared_state_bytes(&[128]), 0);
        assert_eq!(Optimizer::Adam8bit.shared_state_bytes(&[8192]), 2048);
    }
}
