//! Corrupted files never panic: thousands of deterministic byte-level mutations and
//! truncations of real models must each load and infer to either a result or an
//! error.

mod common;

use memplan::infer::{infer, Bindings};
use memplan::memory::profile_inference;
use memplan::onnx::load_model;

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn exercise(path: &std::path::Path) {
    let Ok(model) = load_model(path) else { return };
    for batch in [1, 3] {
        let b = Bindings {
            batch: Some(batch),
            ..Default::default()
        };
        if let Ok(inf) = infer(&model, &b) {
            let p = profile_inference(&model.graph, &inf);
            assert!(p.peak_bytes() >= p.params_bytes);
        }
    }
}

#[test]
fn mutated_models_never_panic() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut cases = 0;
    for name in [
        "cnn.onnx",
        "transformer.onnx",
        "resnet18_dynamo.onnx",
        "bert_base.onnx",
    ] {
        let orig = std::fs::read(common::shipped(name)).unwrap();
        for i in 0..400 {
            let mut bytes = orig.clone();
            match i % 4 {
                0 => {
                    // flip a few bytes
                    for _ in 0..1 + rng.below(4) {
                        let at = rng.below(bytes.len());
                        bytes[at] ^= 1 << rng.below(8);
                    }
                }
                1 => {
                    // overwrite a byte with a varint-ish value
                    let at = rng.below(bytes.len());
                    bytes[at] = [0x00, 0x7f, 0x80, 0xff, 0x08, 0x12][rng.below(6)];
                }
                2 => bytes.truncate(rng.below(bytes.len())),
                _ => {
                    // duplicate a span (repeated fields, shifted lengths)
                    let a = rng.below(bytes.len());
                    let len = rng.below(64).min(bytes.len() - a);
                    let span = bytes[a..a + len].to_vec();
                    let at = rng.below(bytes.len());
                    bytes.splice(at..at, span);
                }
            }
            let p = dir.path().join(format!("m{cases}.onnx"));
            std::fs::write(&p, &bytes).unwrap();
            let r = std::panic::catch_unwind(|| exercise(&p));
            assert!(
                r.is_ok(),
                "{name} mutation {i} panicked (file kept at {p:?})"
            );
            std::fs::remove_file(&p).unwrap();
            cases += 1;
        }
    }
    assert_eq!(cases, 1600);
}

/// Structured mutations: decode, change one semantic field (a dim, an attribute, an
/// input), re-encode. These reach the shape rules with odd but well-formed input.
#[test]
fn semantically_mutated_models_never_panic() {
    use memplan::onnx::proto::ModelProto;
    use prost::Message;

    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng(0xD1B5_4A32_D192_ED03);
    let odd = [-3i64, -1, 0, 1, 2, 3, 5, 64, 1 << 40, i64::MAX];
    let mut cases = 0;
    for name in [
        "cnn.onnx",
        "transformer.onnx",
        "gpt2_dynamo.onnx",
        "vit_b_16.onnx",
        "mobilenet_v2.onnx",
    ] {
        let orig =
            ModelProto::decode(std::fs::read(common::shipped(name)).unwrap().as_slice()).unwrap();
        for i in 0..200 {
            let mut m = orig.clone();
            let g = m.graph.as_mut().unwrap();
            let v = odd[rng.below(odd.len())];
            match i % 5 {
                0 if !g.initializer.is_empty() => {
                    let k = rng.below(g.initializer.len());
                    let t = &mut g.initializer[k];
                    if !t.dims.is_empty() {
                        let d = rng.below(t.dims.len());
                        t.dims[d] = v;
                    }
                }
                1 => {
                    let k = rng.below(g.node.len());
                    let n = &mut g.node[k];
                    if !n.attribute.is_empty() {
                        let a = rng.below(n.attribute.len());
                        let at = &mut n.attribute[a];
                        if !at.ints.is_empty() {
                            let j = rng.below(at.ints.len());
                            at.ints[j] = v;
                        } else {
                            at.i = Some(v);
                        }
                    }
                }
                2 => {
                    let k = rng.below(g.node.len());
                    g.node[k].input.reverse();
                }
                3 => {
                    let k = rng.below(g.node.len());
                    g.node[k].input.pop();
                }
                _ => {
                    let k = rng.below(g.node.len());
                    let j = rng.below(g.node.len());
                    let other = g.node[j].op_type.clone();
                    g.node[k].op_type = other;
                }
            }
            let p = dir.path().join(format!("s{cases}.onnx"));
            std::fs::write(&p, m.encode_to_vec()).unwrap();
            let r = std::panic::catch_unwind(|| exercise(&p));
            assert!(r.is_ok(), "{name} structured mutation {i} panicked");
            cases += 1;
        }
    }
    assert_eq!(cases, 1000);
}
