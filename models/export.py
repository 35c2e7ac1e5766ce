#!/usr/bin/env python3
"""Export the ONNX test models used by memplan (dev-time tool, not needed to build memplan).

Usage:
    python models/export.py                  # (re)generate every models/*.onnx + tests/data/pytorch/reference.json
    python models/export.py --only mlp,gpt2  # regenerate a subset (reference.json entries are merged)
    python models/export.py --big PATH [--gb 1.0]
                                             # write a ~1 GB ONNX MLP with inline weights to PATH
                                             # (for memory measurements; never commit it)
    python models/export.py --training [--only a,b] [--device cpu|cuda] [--out PATH]
                                             # measure one PyTorch training step (saved tensors,
                                             # peak memory) -> tests/data/pytorch/training_reference.json

Requirements: torch, torchvision, transformers, timm, onnx, onnxscript (dynamo exporter);
onnxruntime is optional (used only to check that the exported graphs run at batch 2 and 3).

All weights are randomly initialised (torch.manual_seed(0)); nothing is downloaded.

Conventions (the Rust side relies on them):
  * every model is exported in TRAINING mode (model.train(); TorchScript exporter with
    training=TrainingMode.TRAINING), so BatchNormalization/Dropout nodes stay in the graph;
  * the batch dimension of every graph input and output is dynamic and named "batch";
  * TorchScript exports use do_constant_folding=False, so the graph initializers are exactly the
    model's parameters plus its floating-point buffers (BatchNorm running stats);
  * dynamo exports are post-processed so that the same holds (see export_dynamo());
  * the "shape-only" files have all initializer data cleared (name, dims and data_type kept).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# The PyTorch references the tests compare with (reference.json, training_reference*.json).
DATA = os.path.join(os.path.dirname(HERE), "tests", "data", "pytorch")
BATCH = 2  # batch size used for tracing and for the reference outputs

FLOAT_TYPES = None  # filled lazily: ONNX TensorProto data types that are floating point


def _float_types():
    global FLOAT_TYPES
    if FLOAT_TYPES is None:
        from onnx import TensorProto as T

        FLOAT_TYPES = {T.FLOAT, T.DOUBLE, T.FLOAT16, T.BFLOAT16}
    return FLOAT_TYPES


# --------------------------------------------------------------------------------------
# Model definitions
# --------------------------------------------------------------------------------------


def _tiny_models():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(64, 128)
            self.fc2 = nn.Linear(128, 128)
            self.fc3 = nn.Linear(128, 10)

        def forward(self, x):
            return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))

    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(16)
            self.conv2 = nn.Conv2d(16, 32, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(32)
            self.pool = nn.MaxPool2d(2)
            self.gap = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(32, 10)

        def forward(self, x):
            x = F.relu(self.bn1(self.conv1(x)))
            x = F.relu(self.bn2(self.conv2(x)))
            x = self.pool(x)
            x = self.gap(x)
            x = torch.flatten(x, 1)
            return self.fc(x)

    class SelfAttention(nn.Module):
        """Multi-head self-attention written out explicitly (same parameters as nn.MultiheadAttention)."""

        def __init__(self, d_model, nhead, dropout):
            super().__init__()
            self.nhead = nhead
            self.head_dim = d_model // nhead
            self.in_proj = nn.Linear(d_model, 3 * d_model)
            self.out_proj = nn.Linear(d_model, d_model)
            self.attn_drop = nn.Dropout(dropout)

        def forward(self, x):
            b, t, c = x.shape
            qkv = self.in_proj(x).reshape(b, t, 3, self.nhead, self.head_dim).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]  # [b, h, t, d]
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            probs = self.attn_drop(torch.softmax(scores, dim=-1))
            y = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, c)
            return self.out_proj(y)

    class EncoderLayer(nn.Module):
        """Post-norm encoder layer, same structure and parameters as
        nn.TransformerEncoderLayer(d_model, nhead, dim_ff, dropout, activation="gelu", batch_first=True)."""

        def __init__(self, d_model=64, nhead=4, dim_ff=128, dropout=0.1):
            super().__init__()
            self.self_attn = SelfAttention(d_model, nhead, dropout)
            self.linear1 = nn.Linear(d_model, dim_ff)
            self.linear2 = nn.Linear(dim_ff, d_model)
            self.norm1 = nn.LayerNorm(d_model)
            self.norm2 = nn.LayerNorm(d_model)
            self.dropout = nn.Dropout(dropout)
            self.dropout1 = nn.Dropout(dropout)
            self.dropout2 = nn.Dropout(dropout)

        def forward(self, x):
            x = self.norm1(x + self.dropout1(self.self_attn(x)))
            ff = self.linear2(self.dropout(F.gelu(self.linear1(x))))  # exact (erf) GELU
            return self.norm2(x + self.dropout2(ff))

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([EncoderLayer() for _ in range(2)])
            self.head = nn.Linear(64, 10)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    return MLP, CNN, Transformer


def _patch_transformers():
    """transformers 5.x checks position_ids for "packed sequences" (torch.diff + data-dependent
    branch) when no attention mask is given. aten::diff is not exportable by the TorchScript
    exporter, and for single (unpacked) sequences the result is always "not packed", so we
    short-circuit it. The exported computation is unchanged for normal inputs."""
    import transformers.masking_utils as mu

    mu.find_packed_sequence_indices = lambda position_ids: None


def _unet_small():
    """Small U-Net (3 -> 2 classes, 32x32): DoubleConv = 2 x (Conv3x3 no bias - BatchNorm - ReLU),
    channels 8/16/32, two MaxPool-2 downsamplings, two bilinear x2 upsamplings
    (nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)) each followed by a channel
    Concat with the skip connection, final Conv1x1 8->2 (with bias)."""
    import torch
    import torch.nn as nn

    def double(cin, cout):
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
        )

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc1, self.enc2, self.mid = double(3, 8), double(8, 16), double(16, 32)
            self.pool = nn.MaxPool2d(2)
            self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
            self.dec2, self.dec1 = double(32 + 16, 16), double(16 + 8, 8)
            self.head = nn.Conv2d(8, 2, 1)

        def forward(self, x):
            e1 = self.enc1(x)
            e2 = self.enc2(self.pool(e1))
            m = self.mid(self.pool(e2))
            d2 = self.dec2(torch.cat([self.up(m), e2], dim=1))
            d1 = self.dec1(torch.cat([self.up(d2), e1], dim=1))
            return self.head(d1)

    return UNet()


def _video_cnn():
    """Small 3-D (video) CNN, 10 classes, clips [3, 8, 32, 32]: an R(2+1)D-style network in the
    manner of torchvision's video ResNets. Stem Conv3d 3->4 (3x5x5, stride (1,2,2), pad (1,2,2),
    no bias) - BatchNorm3d - ReLU - MaxPool3d((1,3,3), stride (1,2,2), pad (0,1,1)), widened by a
    1x1x1 Conv3d 4->16 - BatchNorm3d - ReLU (a narrow stem keeps PyTorch's CPU convolution_backward
    workspace, about the stem's output gradient, small beside the step's peak); three residual
    blocks of (2+1)-D convolutions (Conv3d 16->16 (1,3,3) then Conv3d 16->16 (3,1,1), each no bias -
    BatchNorm3d - ReLU, the second ReLU after the residual Add); a downsampling Conv3d 16->32
    (3x3x3, stride 2, pad 1, no bias) - BatchNorm3d - ReLU; AvgPool3d(2, ceil_mode) (from
    [2, 4, 4]: one step of depth); AdaptiveAvgPool3d(1) (GlobalAveragePool); flatten; Linear(32, 10).
    Ops: Conv (3-D), BatchNormalization (training), Relu, MaxPool, Add, AveragePool,
    GlobalAveragePool, Flatten, Gemm."""
    import torch
    import torch.nn as nn

    def cbr(cin, cout, k, stride=1, pad=0):
        return nn.Sequential(nn.Conv3d(cin, cout, k, stride, pad, bias=False), nn.BatchNorm3d(cout))

    class VideoCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = cbr(3, 4, (3, 5, 5), (1, 2, 2), (1, 2, 2))
            self.pool = nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1))
            self.widen = cbr(4, 16, 1)
            self.blocks = nn.ModuleList(
                nn.ModuleList([cbr(16, 16, (1, 3, 3), 1, (0, 1, 1)), cbr(16, 16, (3, 1, 1), 1, (1, 0, 0))])
                for _ in range(3)
            )
            self.down = cbr(16, 32, 3, 2, 1)
            self.avg = nn.AvgPool3d(2, ceil_mode=True)
            self.gap = nn.AdaptiveAvgPool3d(1)
            self.fc = nn.Linear(32, 10)

        def forward(self, x):
            x = torch.relu(self.widen(self.pool(torch.relu(self.stem(x)))))
            for spatial, temporal in self.blocks:
                x = torch.relu(x + temporal(torch.relu(spatial(x))))
            x = self.avg(torch.relu(self.down(x)))
            return self.fc(torch.flatten(self.gap(x), 1))

    return VideoCNN()


def _rnn_models():
    """lstm_lm: nn.Embedding(1000, 64) -> nn.LSTM(64, 64, num_layers=2, batch_first=True) ->
    nn.Linear(64, 1000) per token. gru_classifier: nn.Embedding(1000, 64) -> bidirectional
    nn.GRU(64, 64, batch_first=True) -> mean over time -> nn.Linear(128, 10)."""
    import torch.nn as nn

    class LSTMLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(1000, 64)
            self.lstm = nn.LSTM(64, 64, num_layers=2, batch_first=True)
            self.head = nn.Linear(64, 1000)

        def forward(self, ids):
            y, _ = self.lstm(self.embed(ids))
            return self.head(y)

    class GRUClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(1000, 64)
            self.gru = nn.GRU(64, 64, batch_first=True, bidirectional=True)
            self.head = nn.Linear(128, 10)

        def forward(self, ids):
            y, _ = self.gru(self.embed(ids))
            return self.head(y.mean(dim=1))

    class RNNTagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(1000, 64)
            self.rnn = nn.RNN(64, 64, num_layers=2, batch_first=True, bidirectional=True)
            self.head = nn.Linear(128, 10)

        def forward(self, ids):
            y, _ = self.rnn(self.embed(ids))
            return self.head(y)

    return LSTMLM, GRUClassifier, RNNTagger


LORA_RANK = 8
LORA_ALPHA = 16  # scale = alpha / rank = 2
LORA_TARGETS = ("attn.c_attn", "attn.c_proj")


def _add_lora(model):
    """Hand-written LoRA (rank 8, alpha 16, no LoRA dropout) on every GPT-2 block's attention
    projections: the Conv1D at `transformer.h.<i>.attn.c_attn` / `.c_proj` is replaced by a
    LoRAConv1D holding it as `base`, so the parameters are named `...c_attn.base.weight`,
    `...c_attn.base.bias`, `...c_attn.lora_A` [8, in], `...c_attn.lora_B` [out, 8].
    y = base(x) + (x @ lora_A.T) @ lora_B.T * scale. lora_B is initialised to small random values
    (not zero as in the LoRA paper) so that every gradient is non-trivial. Every parameter keeps
    requires_grad (freezing is the fine-tuning measurement's business: finetune_reference.py)."""
    import torch
    import torch.nn as nn

    class LoRAConv1D(nn.Module):
        def __init__(self, base, rank=LORA_RANK, alpha=LORA_ALPHA):
            super().__init__()
            n_in, n_out = base.weight.shape  # transformers' Conv1D stores weight as [in, out]
            self.base = base
            self.scale = alpha / rank
            self.lora_A = nn.Parameter(torch.randn(rank, n_in) / math.sqrt(n_in))
            self.lora_B = nn.Parameter(torch.randn(n_out, rank) * 0.01)

        def forward(self, x):
            return self.base(x) + (x @ self.lora_A.T) @ self.lora_B.T * self.scale

    for path in [n for n, _ in model.named_modules() if n.endswith(LORA_TARGETS)]:
        parent, _, child = path.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, LoRAConv1D(getattr(owner, child)))
    return model


# integer inputs are drawn from [0, high): class targets need the class count
INT_INPUT_HIGH = {"mlp_loss": 10}


def build(name):
    """Return (model, make_inputs(batch) -> tuple, input_specs, output_names).

    input_specs: list of (name, dtype_str, shape_without_batch)."""
    import torch

    torch.manual_seed(0)
    if name in ("mlp", "cnn", "transformer"):
        MLP, CNN, Transformer = _tiny_models()
        if name == "mlp":
            m, spec = MLP(), [("input", "float32", [64])]
        elif name == "cnn":
            m, spec = CNN(), [("input", "float32", [3, 32, 32])]
        else:
            m, spec = Transformer(), [("input", "float32", [16, 64])]
        outs = ["output"]
    elif name.startswith(("resnet18", "resnet50", "mobilenet_v2", "vit_b_16", "densenet121")):
        import torchvision

        base = name.replace("_dynamo", "")
        m = getattr(torchvision.models, base)(weights=None)
        spec, outs = [("input", "float32", [3, 224, 224])], ["output"]
    elif name.startswith("gpt2"):
        from transformers import GPT2Config, GPT2LMHeadModel

        _patch_transformers()

        class GPT2Export(GPT2LMHeadModel):
            def forward(self, input_ids):
                return super().forward(input_ids=input_ids, use_cache=False, return_dict=False)[0]

        m = GPT2Export(GPT2Config(attn_implementation="eager"))
        if name == "gpt2_lora":
            _add_lora(m)
        spec, outs = [("input_ids", "int64", [128])], ["logits"]
    elif name.startswith("bert_base"):
        from transformers import BertConfig, BertModel

        _patch_transformers()

        class BertExport(BertModel):
            def forward(self, input_ids):
                o = super().forward(input_ids=input_ids, return_dict=False)
                return o[0], o[1]

        m = BertExport(BertConfig(attn_implementation="eager"))
        spec, outs = [("input_ids", "int64", [128])], ["last_hidden_state", "pooler_output"]
    elif name in ("llama_small", "roberta_mlm"):
        # Small configs (hidden 128, 2 layers, vocab 1000, seq 64), eager attention:
        # llama_small is an untied decoder with SiLU-gated MLPs (the exporter writes
        # F.silu as Sigmoid + Mul); roberta_mlm a masked LM whose output projection is
        # tied to the word embeddings (one parameter read by a Gather and a MatMul).
        import transformers

        _patch_transformers()
        small = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                     vocab_size=1000, attn_implementation="eager")
        if name == "llama_small":
            cfg = transformers.LlamaConfig(num_key_value_heads=4, max_position_embeddings=128,
                                           use_cache=False, **small)
            base = transformers.LlamaForCausalLM
        else:
            cfg = transformers.RobertaConfig(max_position_embeddings=130, **small)
            base = transformers.RobertaForMaskedLM

        class LMExport(base):
            def forward(self, input_ids):
                return super().forward(input_ids=input_ids, return_dict=False)[0]

        m = LMExport(cfg)
        spec, outs = [("input_ids", "int64", [64])], ["logits"]
    elif name == "unet_small":
        m = _unet_small()
        spec, outs = [("input", "float32", [3, 32, 32])], ["output"]
    elif name == "fcn_resnet50":
        import torchvision

        class SegExport(torch.nn.Module):
            """torchvision's segmentation models return a dict; export its "out" entry."""

            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                return self.inner(x)["out"]

        m = SegExport(torchvision.models.segmentation.fcn_resnet50(weights=None, weights_backbone=None, aux_loss=False))
        spec, outs = [("input", "float32", [3, 64, 64])], ["output"]
    elif name == "transformer_dynamo_raw":
        _, _, Transformer = _tiny_models()
        m, spec, outs = Transformer(), [("input", "float32", [16, 64])], ["output"]
    elif name == "mlp_loss":
        import torch.nn.functional as F

        MLP, _, _ = _tiny_models()

        class WithLoss(torch.nn.Module):
            """forward(input, target) -> F.cross_entropy(mlp(input), target): the loss is in the graph."""

            def __init__(self):
                super().__init__()
                self.mlp = MLP()

            def forward(self, x, target):
                return F.cross_entropy(self.mlp(x), target)

        m = WithLoss()
        m._memplan_graph_loss = True  # training measurement: loss = out, not out.mean()
        spec, outs = [("input", "float32", [64]), ("target", "int64", [])], ["loss"]
    elif name == "whisper_mini":
        # Whisper encoder-decoder, small config (d_model 64, 2+2 layers, 4 heads, FF 128, 80 mel
        # bins x 100 frames, 16 decoder tokens, vocab 1000), eager attention, tied proj_out.
        import transformers

        _patch_transformers()
        cfg = transformers.WhisperConfig(
            vocab_size=1000, num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
            max_source_positions=50, max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            decoder_start_token_id=1, use_cache=False, attn_implementation="eager",
        )

        class WhisperExport(transformers.WhisperForConditionalGeneration):
            def forward(self, input_features, decoder_input_ids):
                return super().forward(input_features=input_features, decoder_input_ids=decoder_input_ids,
                                       use_cache=False, return_dict=False)[0]

        m = WhisperExport(cfg)
        # The encoder's sinusoidal position table is a frozen nn.Embedding (requires_grad False);
        # memplan trains every float initializer, so it is made trainable here.
        m.model.encoder.embed_positions.weight.requires_grad_(True)
        spec = [("input_features", "float32", [80, 100]), ("decoder_input_ids", "int64", [16])]
        outs = ["logits"]
    elif name in ("lstm_lm", "gru_classifier", "rnn_tagger"):
        LSTMLM, GRUClassifier, RNNTagger = _rnn_models()
        m = {"lstm_lm": LSTMLM, "gru_classifier": GRUClassifier, "rnn_tagger": RNNTagger}[name]()
        spec, outs = [("input_ids", "int64", [32])], ["logits"]
    elif name in ("mixer_tiny", "cait_tiny", "convit_tiny", "tnt_tiny"):
        # timm models, random init, 32x32 images, 10 classes, drop_path_rate 0.1: in train mode
        # timm's DropPath is active (x * bernoulli(keep)/keep per sample; the TorchScript exporter
        # writes bernoulli_ as RandomUniformLike + Less + Cast).
        # mixer_tiny: MLP-Mixer, patch 4 (64 tokens), 4 blocks, 64 wide, token MLP 32, channel MLP 256.
        # cait_tiny: CaiT, 2 LayerScale blocks with talking-heads attention over the patches, then 2
        # class-attention blocks (only the class token attends), 64 wide, 4 heads, patch 4.
        # convit_tiny: ConViT, 2 gated positional self-attention blocks (content and positional
        # attention mixed by a learned per-head sigmoid gate) then 2 self-attention blocks after the
        # class token joins, 4 heads x 16 = 64 wide, patch 4.
        # tnt_tiny: Transformer-in-Transformer, 8x8 patches each unfolded into 4x4 "pixels" (inner
        # dim 16, first stride 2) with an inner transformer per patch and an outer one over the
        # patches (64 wide, 4 heads), 2 layers.
        import timm.models.cait as cait
        import timm.models.convit as convit
        import timm.models.mlp_mixer as mlp_mixer
        import timm.models.tnt as tnt

        common = dict(img_size=32, num_classes=10, drop_path_rate=0.1)
        if name == "mixer_tiny":
            m = mlp_mixer.MlpMixer(patch_size=4, num_blocks=4, embed_dim=64, mlp_ratio=(0.5, 4.0), **common)
        elif name == "cait_tiny":
            m = cait.Cait(patch_size=4, embed_dim=64, depth=2, num_heads=4, depth_token_only=2, init_values=1e-5,
                          **common)
        elif name == "convit_tiny":
            m = convit.ConVit(patch_size=4, embed_dim=16, depth=4, num_heads=4, local_up_to_layer=2, **common)
            # GPSA builds its relative-position table (a non-persistent buffer) in its first
            # forward; do that now, as any training step after the first sees it, so that the
            # export writes the table as a Constant instead of tracing its construction
            with torch.no_grad():
                m(torch.zeros(1, 3, 32, 32))
        else:
            m = tnt.TNT(patch_size=8, embed_dim=64, inner_dim=16, depth=2, num_heads_inner=2, num_heads_outer=4,
                        first_stride=2, **common)
        spec, outs = [("input", "float32", [3, 32, 32])], ["logits"]
    elif name == "wav2vec2_tiny":
        # Wav2Vec2ForCTC, data2vec_audio_tiny's sizes with wav2vec 2.0's own layers: the first conv
        # layer's GroupNorm (one group per channel, feat_extract_norm="group"), GELU conv layers,
        # feature projection, a weight-normalized positional Conv1d (kernel 8, 4 groups; weight_norm
        # over dim 2), 2 post-norm encoder layers (hidden 64, 4 heads, FF 128), CTC head to 32
        # symbols; 1600 samples -> 79 frames. SpecAugment masking and LayerDrop off.
        import transformers

        _patch_transformers()
        cfg = transformers.Wav2Vec2Config(
            vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=8,
            num_conv_pos_embedding_groups=4, feat_extract_norm="group", mask_time_prob=0.0, layerdrop=0.0,
            attn_implementation="eager",
        )

        class W2VExport(transformers.Wav2Vec2ForCTC):
            def forward(self, input_values):
                return super().forward(input_values=input_values, return_dict=False)[0]

        m = W2VExport(cfg)
        spec, outs = [("input_values", "float32", [1600])], ["logits"]
    elif name == "poolformer_tiny":
        # timm PoolFormer (MetaFormer with poolformer_s12's settings: pooling token mixer,
        # GroupNorm1 = nn.GroupNorm(1, C) norms, GELU MLPs, layer scale 1e-5), dims 16/32/64/128,
        # depths 1/1/2/1, drop path 0.1, 32x32 images, 10 classes. The exporter writes each
        # GroupNorm as Reshape, InstanceNormalization, Reshape, Mul, Add (one native_group_norm
        # in PyTorch).
        import timm.models.metaformer as metaformer

        m = metaformer.MetaFormer(
            depths=(1, 1, 2, 1), dims=(16, 32, 64, 128), downsample_norm=None, mlp_act=torch.nn.GELU,
            mlp_bias=True, norm_layers=metaformer.GroupNorm1, layer_scale_init_values=1e-5,
            res_scale_init_values=None, use_mlp_head=False, num_classes=10, drop_path_rate=0.1,
        )
        spec, outs = [("input", "float32", [3, 32, 32])], ["logits"]
    elif name == "clip_tiny":
        # CLIPModel, small text (hidden 64, 2 layers, 4 heads, FF 128, vocab 1000, 16 tokens) and
        # vision (hidden 64, 2 layers, 4 heads, FF 128, 32x32 images, patch 8) towers, projection
        # 32; output logits_per_image [batch, batch] (image-text similarities).
        import transformers

        _patch_transformers()
        small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        cfg = transformers.CLIPConfig(
            text_config=dict(vocab_size=1000, max_position_embeddings=16, pad_token_id=1, bos_token_id=0,
                             eos_token_id=2, **small),
            vision_config=dict(image_size=32, patch_size=8, **small),
            projection_dim=32, attn_implementation="eager",
        )

        class CLIPExport(transformers.CLIPModel):
            def forward(self, input_ids, pixel_values):
                return super().forward(input_ids=input_ids, pixel_values=pixel_values, return_dict=False)[0]

        m = CLIPExport(cfg)
        spec = [("input_ids", "int64", [16]), ("pixel_values", "float32", [3, 32, 32])]
        outs = ["logits_per_image"]
    elif name == "data2vec_audio_tiny":
        # Data2VecAudioForCTC, small config: conv feature extractor (3 x Conv1d 32 channels, kernels
        # 10/3/3, strides 5/2/2, each with LayerNorm over channels and GELU), feature projection,
        # positional embedding of 2 grouped Conv1d (kernel 7, 4 groups) + affine-free LayerNorm +
        # GELU, 2 post-norm encoder layers (hidden 64, 4 heads, FF 128), CTC head to 32 symbols;
        # 1600 samples -> 79 frames. SpecAugment masking and LayerDrop off (random, data-dependent).
        import transformers

        _patch_transformers()
        cfg = transformers.Data2VecAudioConfig(
            vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), conv_pos_kernel_size=7,
            num_conv_pos_embeddings=2, num_conv_pos_embedding_groups=4, mask_time_prob=0.0, layerdrop=0.0,
            attn_implementation="eager",
        )

        class D2VExport(transformers.Data2VecAudioForCTC):
            def forward(self, input_values):
                return super().forward(input_values=input_values, return_dict=False)[0]

        m = D2VExport(cfg)
        spec, outs = [("input_values", "float32", [1600])], ["logits"]
    elif name == "siglip_tiny":
        # SiglipModel: text (hidden 64, 2 layers, 4 heads, FF 128, vocab 1000, 16 tokens, last-token
        # pooling + head) and vision (same sizes, 32x32 images, patch 8, attention-pooling head with
        # nn.MultiheadAttention) towers, sigmoid-loss logit scale and bias; output logits_per_image
        # [batch, batch].
        import transformers

        _patch_transformers()
        small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        cfg = transformers.SiglipConfig(
            text_config=dict(vocab_size=1000, max_position_embeddings=16, pad_token_id=1, bos_token_id=0,
                             eos_token_id=2, **small),
            vision_config=dict(image_size=32, patch_size=8, **small),
            attn_implementation="eager",
        )

        class SiglipExport(transformers.SiglipModel):
            def forward(self, input_ids, pixel_values):
                return super().forward(input_ids=input_ids, pixel_values=pixel_values, return_dict=False)[0]

        m = SiglipExport(cfg)
        spec = [("input_ids", "int64", [16]), ("pixel_values", "float32", [3, 32, 32])]
        outs = ["logits_per_image"]
    elif name == "video_cnn":
        m, spec, outs = _video_cnn(), [("input", "float32", [3, 8, 32, 32])], ["output"]
    else:
        raise KeyError(name)
    int_high = INT_INPUT_HIGH.get(name, 1000)

    def make_inputs(batch, seed=1):
        g = torch.Generator().manual_seed(seed)
        res = []
        for _, dt, shape in spec:
            if dt == "int64":
                res.append(torch.randint(0, int_high, [batch] + shape, generator=g, dtype=torch.int64))
            else:
                res.append(torch.randn([batch] + shape, generator=g))
        return tuple(res)

    m.train()
    return m, make_inputs, spec, outs


# name -> (exporter, shape_only)
MODELS = collections.OrderedDict(
    [
        ("mlp", ("torchscript", False)),
        ("cnn", ("torchscript", False)),
        ("transformer", ("torchscript", False)),
        ("resnet18", ("torchscript", True)),
        ("resnet50", ("torchscript", True)),
        ("mobilenet_v2", ("torchscript", True)),
        ("vit_b_16", ("torchscript", True)),
        ("bert_base", ("torchscript", True)),
        ("gpt2", ("torchscript", True)),
        ("gpt2_lora", ("torchscript", True)),
        ("llama_small", ("torchscript", False)),
        ("roberta_mlm", ("torchscript", False)),
        ("resnet18_dynamo", ("dynamo", True)),
        ("gpt2_dynamo", ("dynamo", True)),
        ("unet_small", ("torchscript", False)),
        ("fcn_resnet50", ("torchscript", True)),
        ("transformer_dynamo_raw", ("dynamo", False)),
        ("mlp_loss", ("torchscript", False)),
        ("whisper_mini", ("torchscript", False)),
        ("lstm_lm", ("torchscript", False)),
        ("gru_classifier", ("torchscript", False)),
        ("rnn_tagger", ("torchscript", False)),
        ("mixer_tiny", ("torchscript", False)),
        ("cait_tiny", ("torchscript", False)),
        ("convit_tiny", ("torchscript", False)),
        ("tnt_tiny", ("torchscript", False)),
        ("clip_tiny", ("torchscript", False)),
        ("siglip_tiny", ("torchscript", False)),
        ("data2vec_audio_tiny", ("torchscript", False)),
        ("poolformer_tiny", ("torchscript", False)),
        ("wav2vec2_tiny", ("torchscript", False)),
        ("video_cnn", ("torchscript", False)),
        ("densenet121", ("torchscript", True)),
    ]
)
# dynamo exports written as torch.onnx.export(..., optimize=False) returns them: none of
# export_dynamo()'s onnxscript passes (only the initializer/Constant and metadata clean-up)
DYNAMO_UNOPTIMIZED = {"transformer_dynamo_raw"}
TORCHSCRIPT_OPSET = 17


# --------------------------------------------------------------------------------------
# Exporters
# --------------------------------------------------------------------------------------


def export_torchscript(model, args, spec, outs, path):
    import torch

    in_names = [s[0] for s in spec]
    dyn = {n: {0: "batch"} for n in in_names + outs}
    torch.onnx.export(
        model,
        args,
        path,
        dynamo=False,
        opset_version=TORCHSCRIPT_OPSET,
        training=torch.onnx.TrainingMode.TRAINING,
        do_constant_folding=False,
        input_names=in_names,
        output_names=outs,
        dynamic_axes=dyn,
    )
    import onnx

    return onnx.load(path)


def export_dynamo(model, args, spec, outs, passes=True):
    """Dynamo (torch.export) exporter, model in train mode.

    We export with optimize=False and then run the onnxscript optimizer passes ourselves,
    with two changes from the default optimize=True pipeline, so that the graph initializers stay
    exactly the model's parameters/buffers (as in the TorchScript files):
      * constant folding is disabled for any node that consumes a parameter/buffer
        (the default would e.g. fold the position-embedding Gather of GPT-2);
      * the BatchNormalization->Conv fusion rewrite is dropped (the default folds BN away).
    The "remove all-zero optional bias" rewrite is value dependent (GPT-2 biases are zero at init),
    so before exporting every floating parameter/buffer is refilled with random non-zero values
    (values are irrelevant: the committed files are shape-only).
    Finally every initializer that is not a parameter/buffer (folded shape constants, masks) is
    turned back into a Constant node, and torch metadata_props are stripped (file size).
    passes=False skips the onnxscript passes: the graph is what optimize=False exports.
    """
    import torch
    import onnx
    import onnx_ir as ir
    import onnx_ir.passes.common as cp
    from onnxscript import rewriter
    from onnxscript.optimizer import _constant_folding
    from onnxscript.rewriter import _fuse_batchnorm

    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_floating_point():
                t.copy_(torch.rand(t.shape, generator=g) * 0.5 + 0.25)

    in_names = [s[0] for s in spec]
    batch = torch.export.Dim("batch")
    dynamic_shapes = tuple({0: batch} for _ in spec)
    prog = torch.onnx.export(
        model,
        args,
        None,
        dynamo=True,
        input_names=in_names,
        output_names=outs,
        dynamic_shapes=dynamic_shapes,
        external_data=False,
        optimize=False,
    )
    irm = prog.model
    pnames = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    pnames |= {n for n, _ in model.named_buffers(remove_duplicate=False)}

    def should_fold(node):
        if node.op_type in ("Shape", "Size"):
            return None
        for v in node.inputs:
            if v is not None and v.is_initializer() and v.name in pnames:
                return False
        return None

    rules = [r for r in rewriter._DEFAULT_REWRITE_RULES if r not in _fuse_batchnorm.rules]
    pipeline = ir.passes.Sequential(
        cp.InlinePass(),
        ir.passes.PassManager(
            [
                _constant_folding.FoldConstantsPass(
                    shape_inference=True,
                    input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                    output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
                    should_fold=should_fold,
                ),
                rewriter.RewritePass(rules),
                cp.RemoveUnusedNodesPass(),
                cp.RemoveUnusedFunctionsPass(),
                cp.RemoveUnusedOpsetsPass(),
            ],
            steps=2,
            early_stop=True,
        ),
        cp.RemoveUnusedNodesPass(),
        cp.CommonSubexpressionEliminationPass(),
        cp.NameFixPass(),
    )
    if passes:
        pipeline(irm)
    mp = ir.serde.serialize_model(irm)

    # non-parameter initializers -> Constant nodes at the start of the graph
    keep, consts = [], []
    for init in mp.graph.initializer:
        if init.name in pnames:
            keep.append(init)
        else:
            t = onnx.TensorProto()
            t.CopyFrom(init)
            consts.append(onnx.helper.make_node("Constant", [], [init.name], value=t, name="const_" + init.name))
    gi_names = {i.name for i in mp.graph.input}
    assert not (gi_names & {c.output[0] for c in consts})
    del mp.graph.initializer[:]
    mp.graph.initializer.extend(keep)
    nodes = consts + list(mp.graph.node)
    del mp.graph.node[:]
    mp.graph.node.extend(nodes)

    def strip(msg_list):
        for x in msg_list:
            del x.metadata_props[:]

    del mp.metadata_props[:]
    strip(mp.graph.node)
    strip(mp.graph.input)
    strip(mp.graph.output)
    strip(mp.graph.value_info)
    strip(mp.graph.initializer)
    onnx.checker.check_model(mp)
    return mp


def clear_initializer_data(mp):
    """Shape-only: keep name/dims/data_type of every initializer, drop the data."""
    for t in mp.graph.initializer:
        for f in (
            "raw_data",
            "float_data",
            "int32_data",
            "int64_data",
            "double_data",
            "uint64_data",
            "string_data",
            "external_data",
            "data_location",
        ):
            t.ClearField(f)


# --------------------------------------------------------------------------------------
# Checks / reporting
# --------------------------------------------------------------------------------------


def numel(dims):
    n = 1
    for d in dims:
        n *= int(d)
    return n


def torch_dtype_str(t):
    return str(t.dtype).replace("torch.", "")


def torch_counts(model):
    params = sum(p.numel() for p in model.parameters())
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Non-persistent buffers (e.g. rotary inv_freq) are not in the state dict; the
    # exporter inlines them as constants of the computation, not initializers.
    persistent = [
        b
        for mod in model.modules()
        for n, b in mod.named_buffers(recurse=False)
        if n not in getattr(mod, "_non_persistent_buffers_set", set())
    ]
    fb = [b for b in persistent if b.is_floating_point()]
    nfb = [b for b in persistent if not b.is_floating_point()]
    buffers = sum(b.numel() for b in fb)
    bbytes = sum(b.numel() * b.element_size() for b in fb)
    return {
        "params_count": params + buffers,
        "params_bytes": pbytes + bbytes,
        "trainable_params_count": params,
        "buffers_count": buffers,
        "nonfloat_buffers_count": sum(b.numel() for b in nfb),
    }


def onnx_init_stats(mp):
    fl = [t for t in mp.graph.initializer if t.data_type in _float_types()]
    return {
        "onnx_initializers": len(mp.graph.initializer),
        "onnx_float_initializer_count": sum(numel(t.dims) for t in fl),
        "onnx_nonfloat_initializer_count": sum(
            numel(t.dims) for t in mp.graph.initializer if t.data_type not in _float_types()
        ),
    }


def run_outputs(model, make_inputs, batch, values=None):
    import torch

    with torch.no_grad():
        torch.manual_seed(0)
        out = model(*make_inputs(batch))
    if not isinstance(out, (tuple, list)):
        out = (out,)
    if values is not None:
        values[batch] = [o.numpy() for o in out]
    return [(list(o.shape), torch_dtype_str(o)) for o in out]


def ort_check(mp, make_inputs, spec, expected, values=None):
    """Run the (still weight-carrying) model with onnxruntime at the given batches and compare output
    shapes with PyTorch's. Returns a short status string."""
    try:
        import onnxruntime as ort
    except ImportError:
        return "skipped (onnxruntime not installed)"
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        sess = ort.InferenceSession(mp.SerializeToString(), so, providers=["CPUExecutionProvider"])
        for batch, exp in expected.items():
            feeds = {s[0]: t.numpy() for s, t in zip(spec, make_inputs(batch))}
            res = sess.run(None, feeds)
            got = [list(r.shape) for r in res]
            want = [e[0] for e in exp]
            if got != want:
                return f"MISMATCH at batch {batch}: ort {got} vs torch {want}"
            if values is not None and batch in values:
                diff = max(float(abs(r - v).max()) for r, v in zip(res, values[batch]))
                if diff > 1e-4:
                    return f"VALUE MISMATCH at batch {batch}: max abs diff {diff}"
                values["maxdiff"] = max(values.get("maxdiff", 0.0), diff)
        msg = "ok (batches %s" % ",".join(str(b) for b in expected)
        if values is not None and "maxdiff" in values:
            msg += "; values match torch, max abs diff %.2g" % values["maxdiff"]
        return msg + ")"
    except Exception as e:  # noqa: BLE001
        return "ort failed: %s" % (str(e).splitlines()[0][:300])


def dims_str(vi):
    tt = vi.type.tensor_type
    ds = []
    for d in tt.shape.dim:
        if d.HasField("dim_param"):
            ds.append(repr(d.dim_param))
        elif d.HasField("dim_value"):
            ds.append(str(d.dim_value))
        else:
            ds.append("?")
    import onnx

    return "%s[%s]" % (onnx.TensorProto.DataType.Name(tt.elem_type), ", ".join(ds))


def _attr_value(a):
    import onnx

    v = onnx.helper.get_attribute_value(a)
    if isinstance(v, onnx.TensorProto):
        return "tensor(%s%s)" % (onnx.TensorProto.DataType.Name(v.data_type), list(v.dims))
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, list):
        return [x.decode() if isinstance(x, bytes) else x for x in v]
    return v


def describe(name, mp):
    """Text block for /tmp/optypes.txt."""
    import onnx

    lines = [f"=== {name} ==="]
    lines.append("ir_version %d; opset_import %s" % (mp.ir_version, [(o.domain or "ai.onnx", o.version) for o in mp.opset_import]))
    lines.append("producer %s %s" % (mp.producer_name, mp.producer_version))
    for vi in mp.graph.input:
        lines.append("  input  %s: %s" % (vi.name, dims_str(vi)))
    for vi in mp.graph.output:
        lines.append("  output %s: %s" % (vi.name, dims_str(vi)))
    st = onnx_init_stats(mp)
    lines.append(
        "  initializers: %d (float numel %d, non-float numel %d); value_info entries: %d; nodes: %d"
        % (st["onnx_initializers"], st["onnx_float_initializer_count"], st["onnx_nonfloat_initializer_count"], len(mp.graph.value_info), len(mp.graph.node))
    )
    hist = collections.Counter(f"{n.domain or 'ai.onnx'}:{n.op_type}" for n in mp.graph.node)
    lines.append("  op histogram:")
    for k, v in sorted(hist.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"    {v:5d} {k}")
    # per op type: arity variants and attribute values seen
    lines.append("  per-op inputs/outputs arity and attributes (distinct values, truncated):")
    by_op = collections.OrderedDict()
    for n in mp.graph.node:
        d = by_op.setdefault(n.op_type, {"arity": collections.Counter(), "attrs": collections.OrderedDict()})
        d["arity"]["%d->%d" % (len(n.input), len(n.output))] += 1
        for a in n.attribute:
            vals = d["attrs"].setdefault(a.name, [])
            s = repr(_attr_value(a))
            if s not in vals:
                vals.append(s)
    for op in sorted(by_op):
        d = by_op[op]
        ar = ", ".join(f"{k} x{v}" for k, v in sorted(d["arity"].items()))
        lines.append(f"    {op}: inputs->outputs {ar}")
        for an, vals in d["attrs"].items():
            shown = vals[:8]
            more = "" if len(vals) <= 8 else f" ... (+{len(vals) - 8} more)"
            lines.append(f"        {an}: {'; '.join(shown)}{more}")
    used = {i for n in mp.graph.node for i in n.input} | {o.name for o in mp.graph.output}
    dangling = collections.Counter(
        f"{n.op_type} output#{k}" for n in mp.graph.node for k, o in enumerate(n.output) if o and o not in used
    )
    if dangling:
        lines.append("  unused node outputs: %s" % dict(dangling))
    init_names = {t.name for t in mp.graph.initializer}
    consumers = collections.Counter(n.op_type for n in mp.graph.node for i in n.input if i in init_names)
    lines.append("  initializer uses by consumer op type: %s" % dict(sorted(consumers.items())))
    # empty-string inputs (omitted optional inputs)
    opt = collections.Counter(n.op_type for n in mp.graph.node if any(i == "" for i in n.input))
    if opt:
        lines.append("  nodes with omitted optional inputs (''): %s" % dict(opt))
    # Dropout / BatchNormalization details matter for training-memory modelling
    const_vals = {}
    for n in mp.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            t = n.attribute[0].t
            if numel(t.dims) <= 4:
                try:
                    const_vals[n.output[0]] = onnx.numpy_helper.to_array(t).tolist()
                except Exception:  # noqa: BLE001
                    pass
    drop = collections.Counter()
    for n in mp.graph.node:
        if n.op_type == "Dropout":
            ratio = const_vals.get(n.input[1], "?") if len(n.input) > 1 and n.input[1] else "default(0.5)"
            tm = const_vals.get(n.input[2], "?") if len(n.input) > 2 and n.input[2] else "absent(=false)"
            drop["ratio=%s training_mode=%s outputs=%d" % (ratio, tm, len(n.output))] += 1
    for k, v in drop.items():
        lines.append(f"  Dropout variant: {k}  x{v}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# Main export
# --------------------------------------------------------------------------------------


def export_one(name, log):
    import onnx
    import torch

    exporter, shape_only = MODELS[name]
    model, make_inputs, spec, outs = build(name)
    counts = torch_counts(model)
    args = make_inputs(BATCH)
    t0 = time.time()
    if exporter == "torchscript":
        with tempfile.TemporaryDirectory() as td:
            mp = export_torchscript(model, args, spec, outs, os.path.join(td, name + ".onnx"))
        opset = TORCHSCRIPT_OPSET
    else:
        mp = export_dynamo(model, args, spec, outs, passes=name not in DYNAMO_UNOPTIMIZED)
        opset = [o.version for o in mp.opset_import if o.domain in ("", "ai.onnx")][0]
    t_export = time.time() - t0

    onnx_out_names = [o.name for o in mp.graph.output]
    # outputs are only value-comparable when the graph is deterministic (no Dropout) and has real weights
    deterministic = not shape_only and not any(n.op_type == "Dropout" for n in mp.graph.node)
    values = {} if deterministic else None
    ref_out = {b: run_outputs(model, make_inputs, b, values) for b in (BATCH, 3)}
    ort_status = ort_check(mp, make_inputs, spec, ref_out, values)

    st = onnx_init_stats(mp)
    # name-level check: initializers == parameters + floating buffers
    expected_names = {n for n, _ in model.named_parameters()} | {
        n for n, b in model.named_buffers() if b.is_floating_point()
    }
    init_names = {t.name for t in mp.graph.initializer}
    name_check = {
        "params_not_in_onnx": sorted(expected_names - init_names)[:10],
        "onnx_not_params": sorted(init_names - expected_names)[:10],
    }
    if shape_only:
        clear_initializer_data(mp)
    path = os.path.join(HERE, name + ".onnx")
    onnx.save(mp, path)
    size = os.path.getsize(path)

    entry = {
        "exporter": exporter,
        "opset": opset,
        **{k: counts[k] for k in ("params_count", "params_bytes", "trainable_params_count", "buffers_count")},
        "nonfloat_buffers_count": counts["nonfloat_buffers_count"],
        "batch": BATCH,
        "inputs": [
            {"name": s[0], "shape": [BATCH] + s[2], "dtype": s[1]} for s in spec
        ],
        "outputs": [
            {"name": n, "shape": sh, "dtype": dt} for n, (sh, dt) in zip(onnx_out_names, ref_out[BATCH])
        ],
        "inputs_batch3": [{"name": s[0], "shape": [3] + s[2], "dtype": s[1]} for s in spec],
        "outputs_batch3": [
            {"name": n, "shape": sh, "dtype": dt} for n, (sh, dt) in zip(onnx_out_names, ref_out[3])
        ],
        "shape_only": shape_only,
        "onnx_float_initializer_count": st["onnx_float_initializer_count"],
        "onnx_initializers": st["onnx_initializers"],
        "onnx_nodes": len(mp.graph.node),
        "file_bytes": size,
    }
    ok = st["onnx_float_initializer_count"] == counts["params_count"]
    log(
        f"{name}: {exporter} opset {opset} export {t_export:.1f}s size {size} bytes; "
        f"torch params+fbuffers {counts['params_count']} onnx float init {st['onnx_float_initializer_count']} "
        f"{'OK' if ok else 'MISMATCH (%+d)' % (st['onnx_float_initializer_count'] - counts['params_count'])}; "
        f"names {name_check}; ort {ort_status}"
    )
    if name in DYNAMO_UNOPTIMIZED:
        entry["dynamo_passes"] = False  # optimize=False output, no onnxscript passes
    if getattr(model, "_memplan_graph_loss", False):
        entry["loss"] = "graph"  # the first output is the model's own scalar loss
    entry["check"] = {
        "float_initializers_equal_params": ok,
        "ort_runs_batch2_and_3": ort_status,
    }
    return entry, describe(name, mp)


OPTYPES_HEADER = """# Op-type report for models/*.onnx, written by `python models/export.py` (versions: %s)
# Per model: opset, graph inputs/outputs with dims ('name' = dim_param, number = dim_value),
# initializer stats, op histogram (domain:op_type), and per op type the inputs->outputs arity
# variants and the distinct attribute values used.
# General notes:
#  * TorchScript files (opset 17): Dropout is always 3->2 (data, ratio Constant, training_mode
#    Constant true) -> (output, mask BOOL); BatchNormalization has training_mode=1 and 5->3
#    (Y, running_mean, running_var outputs; the last two are unused). No value_info in the files.
#    nn.Linear on >2-D inputs = Transpose(weight, perm [1,0]) + MatMul + Add (so weights are consumed
#    through Transpose nodes), on 2-D inputs = Gemm transB=1; GPT-2's Conv1D = Gemm without transB.
#    GPT-2's tied lm_head is Transpose(transformer.wte.weight) + MatMul (wte also feeds the Gather).
#  * Dynamo files (opset 20, ir_version 10): BatchNormalization is INFERENCE mode (no
#    training_mode attribute, 5->1) even though the model was exported in train mode (torch-onnx
#    limitation), Dropout is 3->1 with training_mode Constant true. value_info is present for
#    every intermediate tensor.
#  * Shape-only files: initializers have name/dims/data_type but no data (onnx.checker rejects
#    them: "should contain one and only one value field"); onnx.shape_inference works on them.
#  * Graph-output dims named like 'MatMullogits_dim_1' are the TorchScript exporter's own
#    symbolic names for dims it could not infer; PyTorch's real shapes are in tests/data/pytorch/reference.json.

"""


def write_big(path, gb):
    """~gb GiB ONNX MLP with inline weights, built directly with onnx.helper."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    hidden = 4096
    layer_bytes = hidden * hidden * 4
    n_layers = max(1, round(gb * (1 << 30) / layer_bytes))
    rng = np.random.default_rng(0)
    inits, nodes = [], []
    x = "input"
    for i in range(n_layers):
        w = (rng.standard_normal((hidden, hidden), dtype=np.float32) * 0.01)
        b = np.zeros((hidden,), dtype=np.float32)
        inits.append(helper.make_tensor(f"fc{i}.weight", TensorProto.FLOAT, w.shape, w.tobytes(), raw=True))
        inits.append(helper.make_tensor(f"fc{i}.bias", TensorProto.FLOAT, b.shape, b.tobytes(), raw=True))
        del w
        nodes.append(helper.make_node("MatMul", [x, f"fc{i}.weight"], [f"mm{i}"], name=f"MatMul_{i}"))
        nodes.append(helper.make_node("Add", [f"mm{i}", f"fc{i}.bias"], [f"add{i}"], name=f"Add_{i}"))
        if i < n_layers - 1:
            nodes.append(helper.make_node("Relu", [f"add{i}"], [f"relu{i}"], name=f"Relu_{i}"))
            x = f"relu{i}"
        else:
            nodes[-1].output[0] = "output"
    graph = helper.make_graph(
        nodes,
        "big_mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", hidden])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", hidden])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="memplan-export-big")
    onnx.save(model, path)  # inline (no external data); must stay < 2 GiB
    print(f"wrote {path}: {n_layers} x Linear({hidden},{hidden}), {os.path.getsize(path)} bytes, "
          f"{n_layers * (hidden * hidden + hidden)} params")


# --------------------------------------------------------------------------------------
# Training-step memory reference (--training)
# --------------------------------------------------------------------------------------

TRAIN_BATCHES = (2, 4)
TRAIN_SEED = 1234  # torch.manual_seed(TRAIN_SEED) before every step / analysis forward
TRAIN_OPTIMIZERS = ("sgd", "adam")
# the *_dynamo files come from the very same PyTorch model as their TorchScript twin
TRAIN_TWINS = {"resnet18_dynamo": "resnet18", "gpt2_dynamo": "gpt2", "transformer_dynamo_raw": "transformer"}
# left out of a plain `--training` run (measured only when named in --only): memplan's step peak
# misses PyTorch's CPU figure by more than tests/training.rs's 5 % (see models/README.md). unet_small
# and fcn_resnet50 were left out until the device-equivalent peak took the CPU convolution kernels'
# scratch out (2026-12-02); they are within 0.2 % of it.
TRAIN_EXCLUDED = {
    # memplan's RNN/GRU/LSTM rule saves what cuDNN's _cudnn_rnn keeps (X, W, R, Y, a reserve of
    # seq*dirs*batch*gates*hidden elements, initial states); PyTorch on CPU runs something else
    "lstm_lm": "CPU runs oneDNN's mkldnn_rnn_layer, whose workspace is ~4x memplan's cuDNN-style reserve; "
    "the exporter's gate-reordered W/R copies are saved by memplan only: saved -25..-44 %",
    "gru_classifier": "CPU GRU is the per-step GRUCell (7*hidden floats saved per step and row vs memplan's 4); "
    "the bidirectional W/R copies are saved by memplan only: saved +33 % (batch 2) / -5 % (batch 4), SGD peak +11 %",
    "rnn_tagger": "CPU RNN is the per-step cell (one h per step; memplan's rule keeps Y and a reserve of h); "
    "the bidirectional W/R copies are saved by memplan only: saved +128 % (batch 2) / +79 % (batch 4), SGD peak +29 %",
}
# models whose first output is their own loss: the step uses loss = out (memplan: --loss graph)
TRAIN_GRAPH_LOSS = ("mlp_loss",)
# models whose per-tensor saved list is written to the JSON ("saved_detail")
TRAIN_DETAIL_MODELS = ("mlp", "cnn", "transformer", "mlp_loss")
PHASES = ("zero_grad", "forward", "backward", "optimizer")

TRAINING_DEFINITIONS = {
    "step": (
        "model.train(); model, parameters and inputs float32 (input_ids int64) on the device; inputs "
        "made before measuring. One step = opt.zero_grad(set_to_none=True); out = model(x) "
        "(the whole output tuple stays referenced until the end of the step); first = first output "
        "(= first ONNX graph output: logits for gpt2, last_hidden_state for bert_base); "
        "loss = first.mean(); loss.backward(); opt.step(); then out/first/loss are released. "
        "One warm-up step, then the measured step. torch.manual_seed(%d) before each step. "
        "Fresh model (build() of export.py: seed 0, same construction as the ONNX export) and "
        "fresh optimizer per optimizer." % TRAIN_SEED
    ),
    "optimizers": {
        "sgd": "torch.optim.SGD(params, lr=1e-3) (no momentum: no state)",
        "adam": "torch.optim.Adam(params, lr=1e-3, foreach=True) (multi-tensor path)",
    },
    "saved_bytes": (
        "bytes autograd saves during forward+loss: torch.autograd.graph.saved_tensors_hooks pack hook "
        "records every packed tensor's untyped storage (data_ptr -> storage nbytes), deduplicated by "
        "storage data_ptr, storages of parameters and buffers excluded, the model input included. "
        "Measured in a separate forward+loss after the SGD measured step (same seed; the pack hook "
        "keeps a reference so no storage address can be reused during the pass)"
    ),
    "saved_tensors": "number of distinct storages counted in saved_bytes",
    "saved_bytes_by_view": (
        "sum over saved tensors of numel*element_size, deduplicated by (data_ptr, shape, stride, dtype); "
        "differs from saved_bytes where a saved tensor is a view of a bigger storage (or several "
        "views of one storage are saved); see view_vs_storage"
    ),
    "saved_by_grad_fn": (
        "graph walk from loss.grad_fn (then from the other outputs' grad_fns) over next_functions, "
        "reading every '_saved_*' attribute; each storage attributed to the first grad_fn (BFS order) "
        "that saves it; same dedup/exclusion as saved_bytes"
    ),
    "dropout": (
        "dropout calls with p > 0 in training mode during forward: counted by a TorchFunctionMode "
        "(catches nn.Dropout and functional F.dropout / torch.dropout, e.g. the HF eager attention "
        "dropout); module_calls = forward hooks on nn.Dropout modules with p > 0; numel = total mask "
        "elements. On CPU dropout saves a float32 noise tensor (4 B/element), on CUDA native_dropout "
        "saves a bool mask (1 B/element)"
    ),
    "saved_bytes_cuda_equivalent": "CPU: saved_bytes - 3 * dropout.numel; on cuda: saved_bytes",
    "resident_bytes_before_step": (
        "distinct storages of parameters + all buffers + optimizer state + inputs, after the warm-up "
        "step (gradients of the warm-up step are not included: zero_grad(set_to_none=True) frees them "
        "first thing in the step)"
    ),
    "step_peak_delta_bytes": (
        "peak allocated bytes during the measured step minus allocated bytes right after its "
        "zero_grad. CPU: torch.profiler (profile_memory=True) allocation/free events, ordered by time, "
        "running sum; cuda: torch.cuda.max_memory_allocated() per phase (reset_peak_memory_stats at "
        "each phase start) minus memory_allocated() after zero_grad"
    ),
    "step_peak_bytes": (
        "CPU: resident_bytes_before_step + step_peak_delta_bytes; cuda: torch.cuda.max_memory_allocated() "
        "over the step (absolute; includes e.g. cuBLAS workspaces kept by the caching allocator, see "
        "other_allocated_bytes)"
    ),
    "phase_peak_delta_bytes": "max over each phase of allocated bytes, relative to after zero_grad",
    "peak_phase": "phase (zero_grad/forward/backward/optimizer/release) where step_peak_delta_bytes is reached",
    "peak_alive_dropout_noise_bytes": "CPU dropout's float noise (4 B per element where CUDA keeps a 1-byte mask) "
    "alive at the step peak's instant (_alloc_kind)",
    "peak_alive_rng_state_bytes": "CPU RNG states kept by non-reentrant checkpoint calls alive at the step peak",
    "peak_alive_cpu_kernel_copy_bytes": "copies a CPU kernel made of its operands (aten::contiguous inside "
    "convolution_backward / mkldnn_convolution; the float32 copy CPU's mean sums of a half tensor) alive at the "
    "step peak",
    "peak_alive_cpu_kernel_scratch_bytes": "memory a CPU convolution kernel allocated itself (not through a "
    "factory op) and freed before it returned, alive at the step peak (_collect_profile)",
    "device_equivalent_step_peak_delta_bytes": "the step timeline's peak after taking out, at every instant, what "
    "is alive there that a CUDA run would not hold (the peak_alive_* kinds, dropout noise at 3/4); relative to "
    "after zero_grad like step_peak_delta_bytes",
    "device_equivalent_peak_phase": "phase where device_equivalent_step_peak_delta_bytes is reached",
    "forward_end_delta_bytes": "allocated bytes after loss = out.mean() (end of forward), relative to after zero_grad",
    "end_delta_bytes": "allocated bytes at the end of the step relative to after zero_grad (should equal grads_bytes)",
    "grads_bytes": "distinct storages of p.grad after the measured step",
    "params_bytes": "trainable parameters (distinct storages; gpt2's tied wte/lm_head counted once)",
    "buffers_bytes": "all buffers incl. integer ones; buffers_float_bytes: floating-point buffers only",
    "optimizer_state_bytes": "distinct tensor storages in opt.state after the measured step (Adam: exp_avg, exp_avg_sq, step)",
}


def _storage_id(t):
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def _sum_storages(tensors, seen=None):
    """Sum of distinct untyped storages (by data_ptr). Updates `seen` if given."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        p, nb = _storage_id(t)
        if nb == 0 or p in seen:
            continue
        seen.add(p)
        total += nb
    return total


def _opt_state_tensors(opt):
    import torch

    res = []
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                res.append(v)
    return res


def _train_step(model, opt, inputs, phase):
    """The measured training step. `phase(name)` is a context manager marking phases."""
    with phase("zero_grad"):
        opt.zero_grad(set_to_none=True)
    with phase("forward"):
        out = model(*inputs)
        first = out[0] if isinstance(out, (tuple, list)) else out
        loss = first if getattr(model, "_memplan_graph_loss", False) else first.mean()
    with phase("backward"):
        loss.backward()
    with phase("optimizer"):
        opt.step()
    del out, first, loss


class _NullPhase:
    def __call__(self, name):
        import contextlib

        return contextlib.nullcontext()


class _ProfilerPhase:
    def __call__(self, name):
        from torch.profiler import record_function

        return record_function("memplan::" + name)


class _CudaPhase:
    """Per-phase peak via reset_peak_memory_stats / max_memory_allocated."""

    def __init__(self):
        self.peak, self.end, self.start = {}, {}, {}

    def __call__(self, name):
        import contextlib
        import torch
        from torch.profiler import record_function

        @contextlib.contextmanager
        def cm():
            torch.cuda.reset_peak_memory_stats()
            self.start[name] = torch.cuda.memory_allocated()
            with record_function("memplan::" + name):  # for the profiler cross-check
                yield
            self.peak[name] = torch.cuda.max_memory_allocated()
            self.end[name] = torch.cuda.memory_allocated()

        return cm()


def _make_optimizer(kind, model):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-3)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    return torch.optim.Adam(params, lr=1e-3, foreach=True)


def _collect_profile(prof, device_type="cpu"):
    """Allocation events (time-ordered) and memplan:: ranges from a finished torch.profiler run."""
    from torch._C._profiler import _EventType

    tree = prof.profiler.kineto_results.experimental_event_tree()
    allocs, ranges = [], {}
    stack = [(e, (), None) for e in reversed(tree)]
    seq = 0
    scratch_candidates = {}  # index in allocs -> end time of the kernel that allocated it
    while stack:
        e, chain, parent_end = stack.pop()
        tag, f = e.typed
        if tag == _EventType.Allocation:
            if f.device.type == device_type:
                kind = _alloc_kind(chain, f.alloc_size)
                if kind is None and f.alloc_size > 0 and chain and chain[-1] in _CPU_CONV_KERNELS:
                    scratch_candidates[len(allocs)] = parent_end
                allocs.append([e.start_time_ns, seq, f.ptr, f.alloc_size, f.total_allocated, kind])
                seq += 1
            continue
        if e.name.startswith("memplan::"):
            ranges[e.name[len("memplan::"):]] = (e.start_time_ns, e.end_time_ns)
            end = parent_end
        else:
            chain = chain + (e.name,)
            end = e.end_time_ns
        stack.extend((c, chain, end) for c in reversed(e.children))
    # A CPU convolution kernel's own scratch: memory the kernel itself (oneDNN, the slow conv3d
    # path) allocates, not through a factory op, and frees before it returns (weight reorders,
    # column buffers). The CUDA kernels use a cuDNN workspace instead.
    order = sorted(range(len(allocs)), key=lambda i: (allocs[i][0], allocs[i][1]))
    open_at = {}
    for i in order:
        t, _, ptr, size = allocs[i][:4]
        if size > 0:
            open_at[ptr] = i
        elif ptr in open_at:
            j = open_at.pop(ptr)
            end = scratch_candidates.get(j)
            if end is not None and t <= end:
                allocs[j][5] = "cpu_kernel_scratch"
    allocs = [tuple(allocs[i]) for i in order]
    return allocs, ranges


# torch.get_rng_state() on CPU: the mt19937 state, a 5,056-byte uint8 tensor, allocated outside any
# aten op the profiler records (non-reentrant checkpoint keeps one per call: preserve_rng_state).
_RNG_STATE_BYTES = 5056
_DROPOUT_OPS = ("aten::dropout", "aten::feature_dropout", "aten::alpha_dropout", "aten::feature_alpha_dropout")


def _alloc_kind(chain, size):
    """What a CPU allocation is, where a CUDA run would hold something else:
    'dropout_noise': CPU dropout's float noise (at::native::dropout: empty_like(input).bernoulli_,
    then input * noise), 4 bytes per element where CUDA's native_dropout keeps a 1-byte mask;
    'rng_state': a CPU RNG state kept by checkpoint (host memory on a GPU run); 'cpu_kernel_copy': see
    _CPU_CONV_KERNELS; None otherwise. A TorchDispatchMode (memplan's op-plan runtime) shows in the
    chain as 'PythonDispatchMode' between an op and what it calls: left out."""
    chain = tuple(op for op in chain if op != "PythonDispatchMode")
    if size > 0 and any(op in chain for op in _DROPOUT_OPS) and chain[-1] in (
            "aten::empty_like", "aten::empty_strided", "aten::empty"):
        i = max(i for i, op in enumerate(chain) if op in _DROPOUT_OPS)
        if all(op in ("aten::empty_like", "aten::empty_strided", "aten::empty") for op in chain[i + 1:]):
            return "dropout_noise"
    if size == _RNG_STATE_BYTES and not chain:
        return "rng_state"
    if size > 0 and "aten::contiguous" in chain:
        i = chain.index("aten::contiguous")
        if any(op in _CPU_CONV_KERNELS for op in chain[:i]):
            return "cpu_kernel_copy"
    if size > 0 and "aten::mean" in chain:
        # CPU's mean of a bfloat16 or float16 tensor sums a float32 copy of it (ReduceOps.cpp:
        # make_reduction casts the input on the CPU); CUDA's reduces it in place, accumulating
        # in float32
        i = chain.index("aten::mean")
        if any(op in ("aten::to", "aten::_to_copy") for op in chain[i + 1:]):
            return "cpu_kernel_copy"
    return None


# A copy a CPU convolution kernel makes of an operand (`aten::contiguous` inside the kernel). The
# operands the dispatcher hands these kernels are contiguous (checked for ResNet-50 at batch 8 with a
# TorchDispatchMode around backward): the copy is the CPU kernel's own layout choice (oneDNN), not
# something the CUDA step does.
_CPU_CONV_KERNELS = ("aten::convolution_backward", "aten::mkldnn_convolution", "aten::_convolution")


def _analyse_timeline(allocs, ranges):
    """Running allocated bytes over the measured step (range 'step').

    Returns (result dict, check dict). Values are relative to the allocated bytes right after the
    step's zero_grad."""
    t0, t1 = ranges["step"]
    live = {}  # ptr -> size, over the whole session (to pair frees with their allocation)
    unmatched = {"count": 0, "bytes": 0}
    order_violations = 0
    prev_total = None
    run = 0
    window = []  # (t, running value after event)
    kinds = {}  # ptr -> kind (see _alloc_kind) of the live allocations that have one
    kind_live = collections.Counter()  # kind -> bytes alive now
    best, at_best = None, {}
    dev_best, dev_t = None, None
    for t, _, ptr, size, total, kind in allocs:
        if prev_total is not None and total != prev_total + size:
            order_violations += 1
        prev_total = total
        in_win = t0 <= t <= t1
        if size > 0:
            live[ptr] = size
            if kind:
                kinds[ptr] = kind
                kind_live[kind] += size
        else:
            if live.get(ptr) == -size:
                del live[ptr]
                k = kinds.pop(ptr, None)
                if k:
                    kind_live[k] -= -size
            elif in_win:
                unmatched["count"] += 1
                unmatched["bytes"] += -size
        if in_win:
            run += size
            window.append((t, run))
            if best is None or run > best:
                best, at_best = run, {k: v for k, v in kind_live.items() if v}
            # What a CUDA run would hold: without the host-only kinds (3 of every 4 bytes of dropout
            # noise: CUDA keeps a 1-byte mask).
            dev = run - sum(v * 3 // 4 if k == "dropout_noise" else v for k, v in kind_live.items())
            if dev_best is None or dev > dev_best:
                dev_best, dev_t = dev, t

    def level_at(t):  # running value after the last event at or before t
        v = 0
        for tt, r in window:
            if tt > t:
                break
            v = r
        return v

    z = level_at(ranges["zero_grad"][1]) if "zero_grad" in ranges else 0
    phase_peak = {}
    for ph in PHASES:
        if ph not in ranges:
            continue
        a, b = ranges[ph]
        vals = [level_at(a)] + [r for tt, r in window if a <= tt <= b]
        phase_peak[ph] = max(vals) - z
    last_phase_end = max(ranges[p][1] for p in PHASES if p in ranges)
    rel = [r for tt, r in window if tt > last_phase_end]
    if rel:
        phase_peak["release"] = max(rel) - z
    peak = max([0] + [r for _, r in window]) - z
    peak_phase = max(phase_peak, key=lambda k: phase_peak[k]) if phase_peak else None
    res = {
        "step_peak_delta_bytes": peak,
        "phase_peak_delta_bytes": phase_peak,
        "peak_phase": peak_phase,
        "forward_end_delta_bytes": level_at(ranges["forward"][1]) - z if "forward" in ranges else None,
        "end_delta_bytes": (window[-1][1] if window else 0) - z,
        "freed_in_zero_grad_bytes": -z,
        # alive at the step's peak: CPU dropout noise and checkpoint RNG states (see _alloc_kind)
        "peak_alive_dropout_noise_bytes": at_best.get("dropout_noise", 0),
        "peak_alive_rng_state_bytes": at_best.get("rng_state", 0),
        "peak_alive_cpu_kernel_copy_bytes": at_best.get("cpu_kernel_copy", 0),
        "peak_alive_cpu_kernel_scratch_bytes": at_best.get("cpu_kernel_scratch", 0),
        # the peak of the same timeline less every host-only kind alive at each instant
        "device_equivalent_step_peak_delta_bytes": (dev_best if dev_best is not None else 0) - z,
        "device_equivalent_peak_phase": next(
            (p for p in PHASES if p in ranges and ranges[p][0] <= dev_t <= ranges[p][1]), None)
        if dev_t is not None else None,
    }
    check = {
        "alloc_events_in_step": len(window),
        "unmatched_frees_in_step": unmatched,
        "total_allocated_order_violations": order_violations,
    }
    return res, check


def profiler_selfcheck():
    """Validate the CPU profiler-based peak on known allocation patterns."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    MB = 1 << 20
    out = {}
    # 1) raw allocations: 1 MiB, 2 MiB, free 1, 3 MiB, free all -> peak 5 MiB, end 0
    pre = torch.empty(7 * MB, dtype=torch.uint8)  # allocated before profiling, freed inside
    phase = _ProfilerPhase()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with phase("step"):
            with phase("zero_grad"):
                pass
            with phase("forward"):
                a = torch.empty(MB, dtype=torch.uint8)
                b = torch.empty(2 * MB, dtype=torch.uint8)
                del a
                c = torch.empty(3 * MB, dtype=torch.uint8)
                del b, c, pre
    res, chk = _analyse_timeline(*_collect_profile(prof))
    out["raw_alloc"] = {
        "expected_peak": 5 * MB,
        "measured_peak": res["step_peak_delta_bytes"],
        "measured_end": res["end_delta_bytes"],
        "unmatched_frees": chk["unmatched_frees_in_step"],
        "ok": res["step_peak_delta_bytes"] == 5 * MB and res["end_delta_bytes"] == 0,
        "note": "a 7 MiB tensor allocated before profiling and freed inside is not reported by the "
        "profiler (shows up as nothing); memplan sessions therefore cover model construction too",
    }
    # 2) real ops: A(4 MiB); B=A@A; C=B@B; del B; D=C+1 -> peak A+B+C = 12 MiB (+ a few scalar bytes)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with phase("step"):
            with phase("zero_grad"):
                pass
            with phase("forward"):
                A = torch.randn(1024, 1024)
                B = A @ A
                C = B @ B
                del B
                D = C + 1
                del A, C, D
    res, chk = _analyse_timeline(*_collect_profile(prof))
    out["matmul"] = {
        "expected_peak": 12 * MB,
        "measured_peak": res["step_peak_delta_bytes"],
        "measured_end": res["end_delta_bytes"],
        "ok": 0 <= res["step_peak_delta_bytes"] - 12 * MB < 1024 and res["end_delta_bytes"] == 0,
    }
    return out


DROPOUT_FUNCS = {
    "dropout", "dropout_", "feature_dropout", "feature_dropout_", "alpha_dropout", "alpha_dropout_",
    "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d", "native_dropout",
}


def _dropout_call(func, args, kwargs):
    """(name, p, numel) when a __torch_function__ call is a training-mode dropout with p > 0, else None;
    numel is 0 where the input needs no gradient (no noise tensor is kept)."""
    import torch

    name = getattr(func, "__name__", "")
    if name not in DROPOUT_FUNCS:
        return None
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    tr = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
    if tr and p and p > 0:
        # CPU dropout saves its float32 noise only for backward: an input that needs no
        # gradient (after frozen embeddings) makes a temporary noise tensor, freed at once.
        x = args[0]
        saved = x.requires_grad and torch.is_grad_enabled()
        return name, float(p), x.numel() if saved else 0
    return None


def _saved_analysis(model, inputs, detail=False, walk=True, storages_out=None):
    """Forward+loss with saved_tensors_hooks + dropout tracking; graph walk for attribution.

    walk=False skips the graph walk (reading `_saved_*` attributes of nodes inside a
    torch.utils.checkpoint region would recompute it); storages_out (a dict) receives the
    hook's storages (data_ptr -> nbytes)."""
    import torch
    import torch.nn as nn
    from torch.overrides import TorchFunctionMode

    excl = {_storage_id(t)[0] for t in list(model.parameters()) + list(model.buffers())}
    stor = collections.OrderedDict()  # storage ptr -> nbytes
    views = {}  # (data_ptr, shape, stride, dtype) -> bytes
    view_storage = {}  # same key -> storage ptr
    keep = []

    def pack(t):
        p, nb = _storage_id(t)
        if nb and p not in excl:
            stor[p] = max(stor.get(p, 0), nb)
            k = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype))
            views[k] = t.numel() * t.element_size()
            view_storage[k] = p
        keep.append(t)
        return t

    def unpack(t):
        return t

    class DropoutMode(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []
            self.attention = collections.Counter()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            d = _dropout_call(func, args, kwargs)
            if d is not None:
                self.calls.append(d)
            elif name == "scaled_dot_product_attention":
                dp = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
                self.attention["sdpa dropout_p=%g" % dp] += 1
            elif name == "multi_head_attention_forward":
                dp = kwargs.get("dropout_p", args[10] if len(args) > 10 else None)
                tr = kwargs.get("training", args[13] if len(args) > 13 else True)
                self.attention["multi_head_attention_forward dropout_p=%s training=%s" % (dp, tr)] += 1
            return func(*args, **kwargs)

    mod_calls = []
    handles = []
    n_dropout_modules = collections.Counter()
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            n_dropout_modules["p>0" if m.p > 0 else "p=0"] += 1
            if m.p > 0:
                handles.append(m.register_forward_hook(lambda mod, i, o: mod_calls.append(o.numel())))

    torch.manual_seed(TRAIN_SEED)
    dm = DropoutMode()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        with dm:
            out = model(*inputs)
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            loss = outs[0] if getattr(model, "_memplan_graph_loss", False) else outs[0].mean()
    for h in handles:
        h.remove()

    # graph walk: loss first, then the other outputs
    owner = collections.OrderedDict()  # storage ptr -> (grad_fn, attr, shape, dtype, storage bytes, view bytes)
    errors = []
    seen = set()
    reachable_from_loss = None
    roots = [loss.grad_fn] + [o.grad_fn for o in outs[1:] if isinstance(o, torch.Tensor)]
    if storages_out is not None:
        storages_out.update(stor)
    for ri, root in enumerate(roots if walk else []):
        queue = collections.deque([root] if root is not None else [])
        while queue:
            node = queue.popleft()
            if node in seen:
                continue
            seen.add(node)
            cls = type(node).__name__
            attrs = sorted(a for a in dir(node) if a.startswith("_saved_"))
            if hasattr(node, "saved_tensors") and not attrs:
                attrs = ["saved_tensors"]
            for a in attrs:
                try:
                    v = getattr(node, a)
                except Exception as e:  # noqa: BLE001
                    errors.append("%s.%s: %s" % (cls, a, str(e).splitlines()[0][:120]))
                    continue
                ts = [v] if isinstance(v, torch.Tensor) else [x for x in v if isinstance(x, torch.Tensor)] if isinstance(v, (list, tuple)) else []
                for t in ts:
                    p, nb = _storage_id(t)
                    if nb == 0 or p in excl or p in owner:
                        continue
                    owner[p] = (cls, a, list(t.shape), str(t.dtype).replace("torch.", ""), nb, t.numel() * t.element_size())
            for nxt, _ in node.next_functions:
                if nxt is not None and nxt not in seen:
                    queue.append(nxt)
        if ri == 0:
            reachable_from_loss = sum(v[4] for v in owner.values())

    saved_bytes = sum(stor.values())
    walk_bytes = sum(v[4] for v in owner.values())
    by_fn = collections.Counter()
    by_fn_attr = collections.Counter()
    for cls, a, shape, dt, nb, vb in owner.values():
        by_fn[cls] += nb
        by_fn_attr["%s.%s" % (cls, a)] += nb
    # view vs storage, per storage
    vsum = collections.Counter()
    for k, b in views.items():
        vsum[view_storage[k]] += b
    vdiff = collections.OrderedDict()
    for p, nb in stor.items():
        if vsum[p] != nb:
            who = owner.get(p)
            key = "%s.%s" % (who[0], who[1]) if who else "(not in graph walk)"
            d = vdiff.setdefault(key, {"storages": 0, "storage_bytes": 0, "view_bytes": 0, "example": None})
            d["storages"] += 1
            d["storage_bytes"] += nb
            d["view_bytes"] += vsum[p]
            if d["example"] is None:
                shapes = sorted({str(list(k[1])) for k in views if view_storage[k] == p})
                d["example"] = "storage %d B, saved views %s" % (nb, ", ".join(shapes))
    drop_numel = sum(c[2] for c in dm.calls)
    res = {
        "saved_bytes": saved_bytes,
        "saved_tensors": len(stor),
        "saved_bytes_by_view": sum(views.values()),
        "saved_bytes_graph_walk": walk_bytes,
        "saved_bytes_reachable_from_loss": reachable_from_loss,
        "saved_hook_minus_walk_bytes": saved_bytes - walk_bytes,
        "saved_by_grad_fn": dict(sorted(by_fn.items(), key=lambda kv: -kv[1])),
        "saved_by_grad_fn_attr": dict(sorted(by_fn_attr.items(), key=lambda kv: -kv[1])),
        "view_vs_storage": vdiff,
        "dropout": {
            "count": len(dm.calls),
            "numel": drop_numel,
            "module_calls": len(mod_calls),
            "module_numel": sum(mod_calls),
            "functional_calls": len(dm.calls) - len(mod_calls),
            "functional_numel": drop_numel - sum(mod_calls),
            "p_values": sorted({c[1] for c in dm.calls}),
            "dropout_modules": dict(n_dropout_modules),
            "attention_calls": dict(dm.attention),
        },
        "first_output": {"shape": list(outs[0].shape), "bytes": outs[0].numel() * outs[0].element_size()},
    }
    if errors:
        res["graph_walk_errors"] = errors[:20]
    missing = set(stor) - set(owner)
    extra = set(owner) - set(stor)
    if missing or extra:
        res["walk_mismatch"] = {
            "hook_only_storages": len(missing),
            "hook_only_bytes": sum(stor[p] for p in missing),
            "walk_only_storages": len(extra),
            "walk_only_bytes": sum(owner[p][4] for p in extra),
        }
    if detail:
        res["saved_detail"] = [
            [cls, a, shape, dt, nb] + ([vb] if vb != nb else []) for cls, a, shape, dt, nb, vb in owner.values()
        ]
    del keep, out, outs, loss
    return res


def _measure_one_optimizer(name, batch, kind, device, analyse, prepare=None, analysis_kwargs=None, builder=None):
    """Build, warm up and measure one step. Returns (opt entry, common facts, analysis or None).

    prepare(model), if given, runs right after build() inside the profiling session (freezing,
    activation checkpointing: finetune_reference.py); analysis_kwargs go to _saved_analysis;
    builder(name), if given, replaces build() (tools/llm/reference.py)."""
    import gc
    import torch

    gc.collect()
    on_cpu = device == "cpu"
    prof = None
    if on_cpu:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        prof.__enter__()  # session covers construction too: every freed block was allocated inside it
    try:
        model, make_inputs, spec, _ = (builder or build)(name)
        model.to(device)
        model.train()
        if prepare is not None:
            prepare(model)
        inputs = tuple(t.to(device) for t in make_inputs(batch))
        opt = _make_optimizer(kind, model)
        torch.manual_seed(TRAIN_SEED)
        _train_step(model, opt, inputs, _NullPhase())  # warm-up
        if not on_cpu:
            torch.cuda.synchronize()

        params = [p for p in model.parameters()]
        buffers = list(model.buffers())
        seen = set()
        params_bytes = _sum_storages(params, seen)
        buffers_bytes = _sum_storages(buffers, seen)
        state_before = _opt_state_tensors(opt)
        opt_state_bytes_before = _sum_storages(state_before, seen)
        input_bytes = _sum_storages(inputs, seen)
        resident = params_bytes + buffers_bytes + opt_state_bytes_before + input_bytes
        old_grads = _sum_storages([p.grad for p in params])

        torch.manual_seed(TRAIN_SEED)
        if on_cpu:
            ph = _ProfilerPhase()
            with ph("step"):
                _train_step(model, opt, inputs, ph)
        else:
            from torch.profiler import ProfilerActivity, profile, record_function

            torch.cuda.synchronize()
            ph = _CudaPhase()
            alloc_before = torch.cuda.memory_allocated()
            # the profiler also records the caching allocator's events: the CPU timeline analysis
            # run on them must reproduce max_memory_allocated (cross-check of the CPU method)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as cprof:
                with record_function("memplan::step"):
                    _train_step(model, opt, inputs, ph)
            torch.cuda.synchronize()
            alloc_end = torch.cuda.memory_allocated()
    finally:
        if prof is not None:
            prof.__exit__(None, None, None)

    grads = [p.grad for p in params if p.grad is not None]
    grads_bytes = _sum_storages(grads)
    grads_numel_bytes = sum(g.numel() * g.element_size() for g in grads)
    state = _opt_state_tensors(opt)
    opt_state_bytes = _sum_storages(state)
    # Adam's per-parameter `step` counters (not every numel-1 tensor: the exp_avg/exp_avg_sq of a
    # 0-dim or [1] parameter such as CLIP's logit_scale are numel 1 too)
    scalar_state = _sum_storages(
        [st["step"] for st in opt.state.values() if isinstance(st.get("step"), torch.Tensor)]
    )
    entry = {
        "resident_bytes_before_step": resident,
        "optimizer_state_bytes": opt_state_bytes,
        "optimizer_state_scalar_bytes": scalar_state,
    }
    if on_cpu:
        res, chk = _analyse_timeline(*_collect_profile(prof))
        entry["step_peak_bytes"] = resident + res["step_peak_delta_bytes"]
        entry.update(res)
        chk["end_delta_equals_grads_bytes"] = res["end_delta_bytes"] == grads_bytes
        chk["freed_in_zero_grad_equals_old_grads"] = res["freed_in_zero_grad_bytes"] == old_grads
        entry["check"] = chk
    else:
        state_dev = _sum_storages([t for t in state if t.device.type == "cuda"])
        entry["optimizer_state_cpu_bytes"] = opt_state_bytes - state_dev
        entry["optimizer_state_bytes"] = state_dev
        entry["resident_bytes_before_step"] = resident - (opt_state_bytes - state_dev)
        base = ph.end["zero_grad"]
        entry["step_peak_bytes"] = max(ph.peak.values())
        entry["step_peak_delta_bytes"] = entry["step_peak_bytes"] - base
        entry["phase_peak_delta_bytes"] = {k: v - base for k, v in ph.peak.items()}
        entry["peak_phase"] = max(ph.peak, key=lambda k: ph.peak[k])
        entry["forward_end_delta_bytes"] = ph.end["forward"] - base
        entry["end_delta_bytes"] = alloc_end - base
        entry["memory_allocated_before_step"] = alloc_before
        entry["memory_allocated_after_zero_grad"] = base
        entry["other_allocated_bytes"] = base - entry["resident_bytes_before_step"]
        # memory_allocated() counts the caching allocator's rounded blocks (multiples of 512 B)
        entry["check"] = {"end_delta_minus_grads_bytes": alloc_end - base - grads_bytes}
        try:
            res, chk = _analyse_timeline(*_collect_profile(cprof, "cuda"))
            entry["check"]["profiler_events"] = {
                "step_peak_delta_bytes": res["step_peak_delta_bytes"],
                "peak_phase": res["peak_phase"],
                "equals_cuda_stats": res["step_peak_delta_bytes"] == entry["step_peak_delta_bytes"],
                "order_violations": chk["total_allocated_order_violations"],
                "events": chk["alloc_events_in_step"],
            }
        except Exception as e:  # noqa: BLE001
            entry["check"]["profiler_events"] = "failed: %s" % e
    common = {
        "inputs": [{"name": s[0], "shape": list(t.shape), "dtype": torch_dtype_str(t)} for s, t in zip(spec, inputs)],
        "input_bytes": input_bytes,
        "params_count": sum(p.numel() for p in params),
        "params_bytes": params_bytes,
        "buffers_bytes": buffers_bytes,
        "buffers_float_bytes": _sum_storages([b for b in buffers if b.is_floating_point()]),
        "grads_bytes": grads_bytes,
    }
    if grads_numel_bytes != grads_bytes:
        common["grads_bytes_by_numel"] = grads_numel_bytes
    analysis = None
    if analyse:
        opt.zero_grad(set_to_none=True)
        analysis = _saved_analysis(model, inputs, detail=name in TRAIN_DETAIL_MODELS, **(analysis_kwargs or {}))
    del model, opt, inputs, params, buffers, grads, state, state_before
    gc.collect()
    if not on_cpu:
        torch.cuda.empty_cache()
    return entry, common, analysis


def measure_training(name, batch, device, log):
    t0 = time.time()
    opt_entries = {}
    common = analysis = None
    for kind in TRAIN_OPTIMIZERS:
        e, c, a = _measure_one_optimizer(name, batch, kind, device, analyse=(kind == "sgd"))
        opt_entries[kind] = e
        common = common or c
        analysis = analysis or a
    d = analysis["dropout"]["numel"]
    entry = dict(common)
    if name in TRAIN_GRAPH_LOSS:
        entry["loss"] = "graph"  # loss = out (the model's own scalar loss), not out.mean()
    entry["saved_bytes"] = analysis.pop("saved_bytes")
    entry["saved_tensors"] = analysis.pop("saved_tensors")
    entry["saved_bytes_by_view"] = analysis.pop("saved_bytes_by_view")
    entry["saved_bytes_cuda_equivalent"] = entry["saved_bytes"] - 3 * d if device == "cpu" else entry["saved_bytes"]
    entry.update(analysis)
    entry.update(opt_entries)
    log(
        "%s batch %d: saved %d B (%d storages, by view %d, walk diff %d, cuda-eq %d), dropout %d/%d el; "
        "sgd peak %d (+%d, %s); adam peak %d (+%d, %s); %.1fs"
        % (
            name, batch, entry["saved_bytes"], entry["saved_tensors"], entry["saved_bytes_by_view"],
            entry["saved_hook_minus_walk_bytes"], entry["saved_bytes_cuda_equivalent"], entry["dropout"]["count"],
            d, opt_entries["sgd"]["step_peak_bytes"], opt_entries["sgd"]["step_peak_delta_bytes"],
            opt_entries["sgd"]["peak_phase"], opt_entries["adam"]["step_peak_bytes"],
            opt_entries["adam"]["step_peak_delta_bytes"], opt_entries["adam"]["peak_phase"], time.time() - t0,
        )
    )
    for kind in TRAIN_OPTIMIZERS:
        chk = opt_entries[kind].get("check", {})
        if device == "cpu" and (
            chk.get("unmatched_frees_in_step", {}).get("count") or not chk.get("end_delta_equals_grads_bytes")
        ):
            log("  WARNING %s %s: profiler check %s" % (name, kind, chk))
    return entry


def _json_compact(obj, indent=1, level=0):
    """json.dumps(indent=...) but lists that hold only scalars / scalar lists stay on one line."""

    def flat(o):
        return not isinstance(o, dict) and (
            not isinstance(o, list) or all(not isinstance(x, (dict, list)) or (isinstance(x, list) and flat(x)) for x in o)
        )

    if flat(obj):
        return json.dumps(obj)
    pad, pad1 = " " * (indent * level), " " * (indent * (level + 1))
    if isinstance(obj, dict):
        items = ["%s%s: %s" % (pad1, json.dumps(k), _json_compact(v, indent, level + 1)) for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}" if items else "{}"
    items = ["%s%s" % (pad1, _json_compact(v, indent, level + 1)) for v in obj]
    return "[\n" + ",\n".join(items) + "\n" + pad + "]" if items else "[]"


def _train_versions():
    v = {"python": sys.version.split()[0]}
    for mod in ("torch", "torchvision", "transformers", "timm"):
        try:
            v[mod] = __import__(mod).__version__
        except ImportError:
            v[mod] = None
    return v


def main_training(a):
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    device = a.device
    if device == "cpu":
        torch.set_num_threads(2)
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch.cuda.is_available() is False")
    default_out = "training_reference.json" if device == "cpu" else "training_reference_%s.json" % device
    out_path = a.out or os.path.join(DATA, default_out)
    names = [n for n in MODELS if n not in TRAIN_EXCLUDED] if not a.only else a.only.split(",")
    for n in names:
        if n not in MODELS:
            sys.exit("unknown model %r (known: %s)" % (n, ",".join(MODELS)))
    ref = {}
    if a.only and os.path.exists(out_path):
        with open(out_path) as f:
            ref = json.load(f)

    def log(msg):
        print(msg, flush=True)

    meta = {
        "generated_by": "python models/export.py --training --device %s" % device,
        "versions": _train_versions(),
        "device": device if device == "cpu" else "%s (%s)" % (device, torch.cuda.get_device_name()),
        "torch_num_threads": torch.get_num_threads(),
        "batches": list(TRAIN_BATCHES),
        "seed": TRAIN_SEED,
        "definitions": TRAINING_DEFINITIONS,
        "excluded": TRAIN_EXCLUDED,
    }
    if device == "cpu":
        meta["profiler_selfcheck"] = profiler_selfcheck()
        log("profiler self-check: %s" % {k: v["ok"] for k, v in meta["profiler_selfcheck"].items()})
    skipped = dict(ref.get("_meta", {}).get("skipped", {}))
    failed = {}
    done = {}
    for name in names:
        base = TRAIN_TWINS.get(name, name)
        entry = {}
        try:
            for b in TRAIN_BATCHES:
                if base in done and ("batch_%d" % b) in done[base]:
                    entry["batch_%d" % b] = done[base]["batch_%d" % b]
                else:
                    entry["batch_%d" % b] = measure_training(base, b, device, log)
        except ImportError as e:
            log("SKIP %s: %s" % (name, e))
            skipped[name] = "ImportError: %s" % e
            continue
        except Exception as e:  # noqa: BLE001  (keep going; reported in _meta.failed, exit code 1)
            import traceback

            traceback.print_exc()
            log("FAILED %s: %s: %s" % (name, type(e).__name__, str(e).splitlines()[0][:300] if str(e) else ""))
            failed[name] = "%s: %s" % (type(e).__name__, str(e)[:300])
            continue
        skipped.pop(name, None)
        done[base] = entry
        if base != name:
            entry = {"same_pytorch_model_as": base, **entry}
            log("%s: same PyTorch model as %s (entry copied)" % (name, base))
        ref[name] = entry
        meta["skipped"] = skipped
        if failed:
            meta["failed"] = failed
        ordered = {"_meta": meta}
        ordered.update({n: ref[n] for n in MODELS if n in ref})
        with open(out_path, "w") as f:
            f.write(_json_compact(ordered) + "\n")
    meta["skipped"] = skipped
    if failed:
        meta["failed"] = failed
    ordered = {"_meta": meta}
    ordered.update({n: ref[n] for n in MODELS if n in ref})
    with open(out_path, "w") as f:
        f.write(_json_compact(ordered) + "\n")
    log("wrote %s" % out_path)
    if failed:
        sys.exit("failed: %s" % ", ".join(failed))


def versions():
    import onnx
    import torch

    v = {"python": sys.version.split()[0], "torch": torch.__version__, "onnx": onnx.__version__}
    for mod in ("torchvision", "transformers", "timm", "onnxscript", "onnxruntime"):
        try:
            v[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big", metavar="PATH", help="write a large inline-weight ONNX MLP to PATH and exit")
    ap.add_argument("--gb", type=float, default=1.0, help="size of --big model in GiB (default 1.0, max ~1.9)")
    ap.add_argument("--only", help="comma-separated subset of: " + ",".join(MODELS))
    ap.add_argument("--optypes", default="/tmp/optypes.txt", help="where to write the op-type report")
    ap.add_argument("--training", action="store_true",
                    help="measure one PyTorch training step per model (batches 2 and 4, SGD and Adam) and "
                    "write tests/data/pytorch/training_reference.json (no ONNX export)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="--training: device (default cpu)")
    ap.add_argument("--out", help="--training: output path (default tests/data/pytorch/training_reference.json, "
                    "tests/data/pytorch/training_reference_cuda.json with --device cuda)")
    a = ap.parse_args()

    if a.training:
        main_training(a)
        return

    if a.big:
        if a.gb > 1.9:
            ap.error("--gb must be < 1.9 (inline protobuf limit is 2 GiB)")
        write_big(a.big, a.gb)
        return

    import warnings

    warnings.filterwarnings("ignore")
    names = list(MODELS) if not a.only else a.only.split(",")
    ref_path = os.path.join(DATA, "reference.json")
    ref = {}
    if a.only and os.path.exists(ref_path):
        with open(ref_path) as f:
            ref = json.load(f)
    ref["_meta"] = {"generated_by": "python models/export.py", "versions": versions()}
    descs = {}
    if a.only and os.path.exists(a.optypes):
        # keep blocks of models not regenerated
        with open(a.optypes) as f:
            cur = None
            for line in f:
                if line.startswith("=== ") and line.rstrip().endswith(" ==="):
                    cur = line.strip()[4:-4]
                    descs[cur] = ""
                if cur:
                    descs[cur] += line

    def log(msg):
        print(msg, flush=True)

    for name in names:
        entry, desc = export_one(name, log)
        ref[name] = entry
        descs[name] = desc + "\n"
        with open(a.optypes, "w") as f:
            f.write(OPTYPES_HEADER % json.dumps(ref["_meta"]["versions"]))
            for n in MODELS:
                if n in descs:
                    f.write(descs[n])
        ordered = {"_meta": ref["_meta"]}
        ordered.update({n: ref[n] for n in MODELS if n in ref})
        with open(ref_path, "w") as f:
            json.dump(ordered, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
