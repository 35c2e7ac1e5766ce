//! Signs that a file was exported for inference, which a training step of it
//! misstates.
//!
//! Exporting a model in eval mode is the usual way to make an ONNX file, and both
//! PyTorch exporters then rewrite what training needs: the TorchScript exporter's
//! constant folding folds each BatchNorm into the convolution before it (the folded
//! weights become initializers named `onnx::Conv_<n>`), the dynamo exporter's
//! optimizer does the same even in training mode (its `FuseBatchNormInto*` rules,
//! named in each node's `pkg.onnxscript.rewriter.rule_name` metadata), and an
//! eval-mode export drops Dropout. A training step of such a file saves less than
//! PyTorch's: measured with torch 2.15 on torchvision's ResNet-18 at batch 2,
//! 24,489,984 bytes saved for backward against 44,398,080 for the training-mode
//! export. The dynamo exporter's optimizer also folds constants computed from
//! buffers into initializers (a rotary embedding's cos/sin tables) that memplan
//! cannot tell from parameters. Nothing counts dropout a file does not have, so
//! memplan says what the file shows and how to export it instead
//! (docs/usage/exporting.md).

use crate::ir::Model;
use crate::ops::norm::batch_norm_training_mode;

/// What a file shows of an export for inference.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InferenceExport {
    /// Nodes the dynamo exporter's optimizer folded a BatchNorm into.
    pub folded_batch_norms: usize,
    /// Float initializers the dynamo exporter's optimizer computed from several
    /// values ([`Model::folded_constants`]): trained here, constants in PyTorch.
    pub folded_constants: usize,
    /// Convolutions whose weight and bias are initializers named `onnx::Conv_<n>`:
    /// what the TorchScript exporter's constant folding makes of a convolution with
    /// a BatchNorm folded in.
    pub folded_conv_weights: usize,
    /// BatchNormalization nodes written in inference mode by an eval-mode export:
    /// the TorchScript exporter's `training_mode` = 0 (one output before opset 14),
    /// or a dynamo node named for `_native_batch_norm_legit_no_training`.
    pub inference_batch_norms: usize,
}

impl InferenceExport {
    /// What `m` shows.
    pub fn of(m: &Model) -> InferenceExport {
        let g = &m.graph;
        let opset = m.opset();
        let mut found = InferenceExport {
            folded_batch_norms: m.folded_batch_norms,
            folded_constants: m.folded_constants,
            ..Default::default()
        };
        for &ix in &g.order {
            let n = &g.nodes[ix];
            if !n.domain.is_empty() {
                continue;
            }
            match &*n.op_type {
                "BatchNormalization" => {
                    // The dynamo exporter writes every BatchNorm in inference form,
                    // in training mode too (onnxscript's torch_lib): only what says
                    // eval counts, the TorchScript exporter's explicit mode (its
                    // outputs before opset 14) or the fx node's name.
                    let written = opset < 14 || n.attrs.has("training_mode");
                    let inference =
                        written && !batch_norm_training_mode(opset, &n.attrs, n.outputs.len());
                    if inference || n.name.contains("_native_batch_norm_legit_no_training") {
                        found.inference_batch_norms += 1;
                    }
                }
                "Conv" => {
                    // A folded BatchNorm makes both a new weight and a new bias; a
                    // weight alone folded from parameters (weight_norm, a cast) is
                    // not this.
                    let made = |k: usize| {
                        n.inputs.get(k).copied().flatten().is_some_and(|w| {
                            let t = g.tensor(w);
                            t.init.is_some() && t.name.starts_with("onnx::Conv_")
                        })
                    };
                    if made(1) && made(2) {
                        found.folded_conv_weights += 1;
                    }
                }
                _ => {}
            }
        }
        found
    }

    /// One line for each sign found (none for a training-mode export).
    pub fn warnings(&self) -> Vec<String> {
        const HOW: &str = "export in training mode (docs/usage/exporting.md)";
        let mut out = Vec::new();
        if self.folded_batch_norms > 0 {
            out.push(format!(
                "the exporter's optimizer folded BatchNorm into {} nodes (the dynamo \
                 exporter's optimize=True): the training step counted here has no \
                 BatchNorm there and saves less than PyTorch's; export with \
                 optimize=False (docs/usage/exporting.md)",
                self.folded_batch_norms
            ));
        } else if self.folded_conv_weights > 0 {
            out.push(format!(
                "{} convolution weights were made by the exporter's constant folding \
                 (initializers named onnx::Conv_*: an export in eval mode, BatchNorm \
                 folded into the convolutions, Dropout dropped): the training step \
                 counted here has neither and saves less than PyTorch's; {HOW}",
                self.folded_conv_weights
            ));
        }
        if self.folded_constants > 0 {
            out.push(format!(
                "the exporter's optimizer computed {} float initializers from other values \
                 (the dynamo exporter's optimize=True, e.g. rotary cos/sin tables from a \
                 buffer): memplan cannot tell them from parameters and trains them, so the \
                 step counted here saves more than PyTorch's; export with optimize=False \
                 (docs/usage/exporting.md)",
                self.folded_constants
            ));
        }
        if self.inference_batch_norms > 0 {
            out.push(format!(
                "{} BatchNormalization nodes are in inference mode (an export in eval \
                 mode): they are counted as training-mode BatchNorm, as model.train() \
                 runs them, but an eval-mode export has no Dropout; if the model has \
                 any, {HOW}",
                self.inference_batch_norms
            ));
        }
        out
    }
}
