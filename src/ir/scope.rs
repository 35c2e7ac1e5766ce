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

/// Joins a scope to its parent's path as TorchScript writes them: a container's
/// child is named with the container's attribute (`layer1` + `layer1.0` →
/// `layer1.0`; `layer1.0.downsample` + `downsample.0` → `layer1.0.downsample.0`), a
/// child of a module that is not called keeps it (`transformer` + `h.0` →
/// `transformer.h.0`).
pub fn join(parent: &str, scope: &str) -> String {
    if parent.is_empty() {
        return scope.to_string();
    }
    if let Some((head, rest)) = scope.split_once('.') {
        if parent == head || parent.ends_with(&format!(".{head}")) {
            return format!("{parent}.{rest}");
        }
    }
    format!("{parent}.{scope}")
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
        assert_eq!(module_path("Relu_3"), None);
    }
}
