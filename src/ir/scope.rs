//! PyTorch names from the exporter's scope names: a node's module path and a
//! parameter's name as `model.named_parameters()` gives it.

use super::{Graph, TensorId};

/// The module path of a node from its TorchScript-style name, as
/// `model.named_modules()` names it: `/layer1/layer1.0/conv1/Conv` → `layer1.0.conv1`
/// (each scope repeats its parent's path; `/transformer/h.0/attn` → `transformer.h.0.attn`).
/// `None` for names without a scope.
pub fn module_path(node: &str) -> Option<String> {
    let parts: Vec<&str> = node.trim_start_matches('/').split('/').collect();
    if parts.len() < 2 {
        return None;
    }
    let mut q = String::new();
    for c in &parts[..parts.len() - 1] {
        if q.is_empty() || c.starts_with(&format!("{q}.")) {
            q = c.to_string();
        } else {
            q = format!("{q}.{c}");
        }
    }
    (!q.is_empty()).then_some(q)
}

/// A parameter's name as PyTorch's `named_parameters()` gives it. The initializer's
/// own name, except where the TorchScript exporter made a new one (`onnx::MatMul_123`:
/// a Linear's weight it transposed and folded): then the module of the first node
/// that reads it, with `.weight` (`.bias` for rank 1), e.g.
/// `encoder.layer.0.attention.self.query.weight`.
pub fn parameter_name(g: &Graph, t: TensorId) -> String {
    let name = &g.tensor(t).name;
    if !name.starts_with("onnx::") {
        return name.clone();
    }
    let reader = g
        .order
        .iter()
        .map(|&ix| g.node(ix))
        .find(|n| n.inputs.contains(&Some(t)));
    let rank = g.tensor(t).init.as_ref().map_or(2, |d| d.dims.len());
    match reader.and_then(|n| module_path(&n.name)) {
        Some(m) => format!("{m}.{}", if rank == 1 { "bias" } else { "weight" }),
        None => name.clone(),
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
        assert_eq!(module_path("Relu_3"), None);
    }
}
