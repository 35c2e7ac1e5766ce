//! PyTorch names from the exporter's scope names: a node's module path and a
//! parameter's name as `model.named_parameters()` gives it.

use super::{Graph, TensorId};

/// The module path of a node from its TorchScript-style name, as
/// `model.named_modules()` names it: `/layer1/layer1.0/conv1/Conv` → `layer1.0.conv1`
/// (scopes joined by [`join`]; `/transformer/h.0/attn/X` → `transformer.h.0.attn`).
/// `None` for names without a scope.
pub fn module_path(node: &str) -> Option<String> {
    let q = scopes(node)
        .into_iter()
        .fold(String::new(), |q, c| join(&q, c));
    (!q.is_empty()).then_some(q)
}

/// The scope components of a node name, the op's own part dropped:
/// `/layer1/layer1.0/conv1/Conv` → `["layer1", "layer1.0", "conv1"]`; none for a
/// name without a scope.
pub fn scopes(node: &str) -> Vec<&str> {
    let parts: Vec<&str> = node.trim_start_matches('/').split('/').collect();
    parts[..parts.len() - 1]
        .iter()
        .copied()
        .filter(|c| !c.is_empty())
        .collect()
}

/// Joins a scope to its parent's path as TorchScript writes them. The exporter names
/// a module by its attribute path from an ancestor, so the longest tail of the parent's
/// path that begins the scope is written once: `layer1` + `layer1.0` → `layer1.0`;
/// `layer1.0.downsample` + `downsample.0` → `layer1.0.downsample.0`;
/// `features.2.conv.0` + `conv.0.2` → `features.2.conv.0.2` (MobileNetV2's ReLU6);
/// `blocks.0.0` + `blocks.0.0.1` → `blocks.0.0.1`. A child of a module that is not
/// called keeps its whole name (`transformer` + `h.0` → `transformer.h.0`), and so
/// does a one-name scope (`blocks.0.attn` + `attn` → `blocks.0.attn.attn`).
pub fn join(parent: &str, scope: &str) -> String {
    if parent.is_empty() {
        return scope.to_string();
    }
    let p: Vec<&str> = parent.split('.').collect();
    let s: Vec<&str> = scope.split('.').collect();
    // A scope of one name is a child (`attn` inside `blocks.0.attn`), never a repeat.
    let overlap = (1..=p.len().min(s.len() - 1))
        .rev()
        .find(|&k| p[p.len() - k..] == s[..k])
        .unwrap_or(0);
    format!("{parent}.{}", s[overlap..].join("."))
}

/// A parameter's name as PyTorch's `named_parameters()` gives it. The initializer's
/// own name, except where an exporter made a new one (the TorchScript exporter's
/// `onnx::MatMul_123`, the dynamo exporter's optimizer's `val_123`: a Linear's
/// weight transposed and folded): then the module of the first node that reads it,
/// with `.weight` (`.bias` for rank 1), e.g. `encoder.layer.0.attention.self.query.weight`.
pub fn parameter_name(g: &Graph, t: TensorId) -> String {
    let name = &g.tensor(t).name;
    let made = name.starts_with("onnx::")
        || name
            .strip_prefix("val_")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    if !made {
        return name.to_string();
    }
    let reader = g
        .order
        .iter()
        .map(|&ix| g.node(ix))
        .find(|n| n.inputs.contains(&Some(t)));
    let rank = g.tensor(t).init.as_ref().map_or(2, |d| d.dims.len());
    match reader.and_then(|n| module_path(&n.name)) {
        Some(m) => format!("{m}.{}", if rank == 1 { "bias" } else { "weight" }),
        None => name.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::module_path;

    #[test]
    fn module_paths() {
        assert_eq!(
            module_path("/layer1/layer1.0/conv1/Conv").as_deref(),
            Some("layer1.0.conv1")
        );
        assert_eq!(
            module_path("/transformer/h.0/attn/c_attn/Gemm").as_deref(),
            Some("transformer.h.0.attn.c_attn")
        );
        assert_eq!(
            module_path("/layer1/layer1.0/downsample/downsample.0/Conv").as_deref(),
            Some("layer1.0.downsample.0")
        );
        assert_eq!(
            module_path("/encoder/layer.0/attention/self/query/MatMul").as_deref(),
            Some("encoder.layer.0.attention.self.query")
        );
        assert_eq!(
            module_path("/features/features.2/conv/conv.0/conv.0.2/Clip").as_deref(),
            Some("features.2.conv.0.2")
        );
        // A Sequential inside a ModuleList: the exporter writes full paths.
        assert_eq!(
            module_path("/blocks.0.0/blocks.0.0.1/BatchNormalization").as_deref(),
            Some("blocks.0.0.1")
        );
        assert_eq!(module_path("Relu_3"), None);
    }
}
