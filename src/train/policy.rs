//! Precision policies, following PyTorch autocast.
//!
//! | op class | fp32 | amp-fp16 / amp-bf16 | bf16 |
//! |---|---|---|---|
//! | Conv, ConvTranspose, MatMul, Gemm ("lower precision" list) | fp32 | inputs cast to half, output half | bf16 |
//! | Softmax, LogSoftmax, LayerNorm, Group/InstanceNorm, LpNorm, sum-like Reduce*, CumSum, Pow, Exp, Log, Softplus, losses ("fp32" list) | fp32 | inputs cast to fp32, output fp32 | bf16 |
//! | ReduceL1, ReduceL2 (`norm`: "fp32_append_dtype") | fp32 | inputs read as they are, output fp32 | bf16 |
//! | Cast to a float type (`.float()`, `.to(dtype)`) | fp32 | the type it names | bf16 |
//! | everything else (element-wise, BatchNorm, data movement) | fp32 | runs in the widest input type | bf16 |
//!
//! Each op states its class beside its other rules ([`crate::ops::Op::autocast`]).
//!
//! Under AMP the parameters stay fp32 (master weights), each weight read by a
//! lower-precision op is cast to half once and the copy is cached for the step
//! (autocast's weight cache), and gradients and optimizer states are fp32. `bf16` is
//! pure bf16 training: parameters, activations, gradients and states all bf16.

use crate::ir::DType;
use crate::ops::Autocast;

/// A precision policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Precision {
    /// Everything float32.
    #[serde(rename = "fp32")]
    Fp32,
    /// torch.autocast(dtype=float16).
    #[serde(rename = "amp-fp16")]
    AmpFp16,
    /// torch.autocast(dtype=bfloat16).
    #[serde(rename = "amp-bf16")]
    AmpBf16,
    /// Model and optimizer in bfloat16.
    #[serde(rename = "bf16")]
    Bf16,
}

crate::choice::choice!(Precision {
    Fp32 => "fp32", "Everything float32";
    AmpFp16 => "amp-fp16", "torch.autocast(dtype=float16)";
    AmpBf16 => "amp-bf16", "torch.autocast(dtype=bfloat16)";
    Bf16 => "bf16", "Model and optimizer in bfloat16";
});

impl Precision {
    /// The half type used by lower-precision ops (`None` for fp32).
    pub fn half(self) -> Option<DType> {
        match self {
            Precision::Fp32 => None,
            Precision::AmpFp16 => Some(DType::F16),
            Precision::AmpBf16 | Precision::Bf16 => Some(DType::BF16),
        }
    }

    /// True for the autocast policies.
    pub fn is_amp(self) -> bool {
        matches!(self, Precision::AmpFp16 | Precision::AmpBf16)
    }

    /// Storage type of parameters, gradients and optimizer states.
    pub fn master(self) -> DType {
        match self {
            Precision::Bf16 => DType::BF16,
            _ => DType::F32,
        }
    }

    /// The float type autocast casts an op's float inputs to (`None`: left as they are).
    pub fn input_dtype(self, class: Autocast) -> Option<DType> {
        if !self.is_amp() {
            return None;
        }
        match class {
            Autocast::Half => self.half(),
            Autocast::Full => Some(DType::F32),
            Autocast::Widen | Autocast::AsWritten | Autocast::Promote => None,
        }
    }

    /// Output float type of an op of autocast class `class` given its float inputs'
    /// types and the type the graph writes it in.
    pub fn output_dtype(
        self,
        class: Autocast,
        input_float: Option<DType>,
        written: DType,
    ) -> DType {
        let widest = input_float.unwrap_or(DType::F32);
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::AmpFp16 | Precision::AmpBf16 => match class {
                Autocast::Half => self.half().expect("amp has a half type"),
                Autocast::Full | Autocast::Widen => DType::F32,
                Autocast::AsWritten => written,
                Autocast::Promote => widest,
            },
        }
    }
}
