//! The training step: autodiff over the forward graph, a loss, the optimizer
//! update, and the precision policy, producing a [`Schedule`] whose memory
//! `memory::simulate` replays.

pub mod autodiff;
pub mod fusion;
pub mod inference_export;
mod module_args;
pub mod optim;
pub mod params;
pub mod policy;
pub mod quant;
pub mod schedule;

pub use autodiff::build_schedule;
pub use fusion::{
    fake_quant_roles, fused_patterns, FakeQuant, FakeQuantRole, FusedKind, FusedPattern,
    SDPA_F32_LAYOUT,
};
pub use params::ParamSelection;
pub use policy::Precision;
pub use quant::WeightDtype;
pub use schedule::{Schedule, Step, StepKind, Storage, StorageId, StorageKind};

/// The optimizer. Its state and temporaries per parameter are in [`optim`], each
/// size with its source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Optimizer {
    /// Plain SGD: no state.
    Sgd,
    /// SGD with momentum: one buffer.
    Momentum,
    /// Adam: exp_avg and exp_avg_sq.
    Adam,
    /// AdamW: as Adam (decoupled weight decay needs no extra state).
    Adamw,
    /// bitsandbytes' `Adam8bit`: both moments in 8 bits, block-wise quantized.
    Adam8bit,
    /// Lion (Chen et al. 2023): one momentum.
    Lion,
    /// Adafactor (Shazeer & Stern 2018), Hugging Face's defaults: factored second
    /// moment, no first moment.
    Adafactor,
}

crate::choice::choice!(Optimizer {
    Sgd => "sgd", "Plain SGD: no state";
    Momentum => "momentum", "SGD with momentum: one buffer";
    Adam => "adam", "Adam: exp_avg and exp_avg_sq";
    Adamw => "adamw", "AdamW: as Adam (decoupled weight decay needs no extra state)";
    Adam8bit => "adam8bit", "bitsandbytes Adam8bit: 2 bytes per parameter plus an fp32 absmax per 2048";
    Lion => "lion", "Lion: one momentum";
    Adafactor => "adafactor", "Adafactor: factored second moment (rows + columns), no first moment";
});

/// How the first graph output becomes a scalar loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Loss {
    /// `out.mean()`: its backward writes a full-size gradient.
    Mean,
    /// `out.sum()`: its backward is a broadcast view of the scalar gradient.
    Sum,
    /// The first output is the loss the model computes itself (an in-graph
    /// SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss or reduction): a scalar,
    /// differentiated as `loss.backward()` (a scalar gradient of one).
    Graph,
}

crate::choice::choice!(Loss {
    Mean => "mean", "`out.mean()`: its backward writes a full-size gradient";
    Sum => "sum", "`out.sum()`: its backward is a broadcast view of the scalar gradient";
    Graph => "graph", "the first output is the model's own scalar loss: `loss.backward()`";
});

/// Options of one training step.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// Optimizer.
    pub optimizer: Optimizer,
    /// Precision policy.
    pub precision: Precision,
    /// Loss.
    pub loss: Loss,
    /// Gradients stay allocated for the whole step (gradient accumulation across
    /// micro-batches) instead of being set to None before the forward pass.
    pub grads_resident: bool,
    /// Which parameters train (`--freeze`, `--trainable`); the rest are frozen.
    pub params: ParamSelection,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            optimizer: Optimizer::Adam,
            precision: Precision::Fp32,
            loss: Loss::Mean,
            grads_resident: false,
            params: ParamSelection::all(),
        }
    }
}
