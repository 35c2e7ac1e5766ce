//! Loading: zero-copy weights, external data described without reading it,
//! shape-only initializers, initializers listed as inputs, optional inputs.

mod common;

use common::*;
use memplan::infer::{infer, Bindings};
use memplan::ir::{Payload, TensorKind};
use memplan::memory::profile_inference;
use memplan::onnx::proto::StringStringEntryProto;
use memplan::onnx::{decode_model, load_model, map_file};

#[test]
fn weights_are_slices_of_the_mapped_file() {
    let path = shipped("mlp.onnx");
    let buf = map_file(&path).unwrap();
    let range = buf.as_ptr() as usize..buf.as_ptr() as usize + buf.len();
    let m = decode_model(buf.clone()).unwrap();
    let inits = &m.graph.as_ref().unwrap().initializer;
    assert!(!inits.is_empty());
    for t in inits {
        let raw = t.raw_data.as_ref().expect("tiny models keep their weights");
        assert!(
            range.contains(&(raw.as_ptr() as usize)),
            "{:?} was copied out of the map",
            t.name
        );
    }
    // And the IR keeps those same slices.
    let model = load_model(&path).unwrap();
    let raw = model
        .graph
        .tensors
        .iter()
        .filter_map(|t| match t.init.as_ref().map(|d| &d.payload) {
            Some(Payload::Raw(b)) => Some(b.len()),
            _ => None,
        })
        .sum::<usize>();
    assert_eq!(raw as u64, 26122 * 4);
}

#[test]
fn external_data_is_described_not_read() {
    let mut w = weight("w", &[1024, 1024]);
    w.raw_data = None;
    w.data_location = Some(1);
    w.external_data = vec![
        StringStringEntryProto {
            key: Some("location".into()),
            value: Some("weights.bin".into()),
        },
        StringStringEntryProto {
            key: Some("offset".into()),
            value: Some("4096".into()),
        },
        StringStringEntryProto {
            key: Some("length".into()),
            value: Some("4194304".into()),
        },
    ];
    let m = model(
        vec![node("MatMul", "mm", &["x", "w"], &["y"])],
        vec![w],
        vec![value_info("x", 1, &[D::S("batch"), D::N(1024)])],
        vec![value_info("y", 1, &[D::S("batch"), D::N(1024)])],
    );
    let dir = tempfile::tempdir().unwrap();
    // weights.bin does not exist: loading must not need it.
    let p = write_tmp(&dir, "ext.onnx", &encode(&m));
    let model = load_model(&p).unwrap();
    let t = &model.graph.tensors[model.graph.tensor_id("w").unwrap()];
    match &t.init.as_ref().unwrap().payload {
        Payload::External {
            location,
            offset,
            length,
        } => {
            assert_eq!(location, "weights.bin");
            assert_eq!(*offset, 4096);
            assert_eq!(*length, Some(4 << 20));
        }
        other => panic!("{other:?}"),
    }
    let inf = infer(
        &model,
        &Bindings {
            batch: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    let p = profile_inference(&model.graph, &inf);
    assert_eq!(p.params_bytes, 4 << 20);
    assert_eq!(p.params_count, 1 << 20);
}

/// A model whose weight lives at `location`, bytes 16.. of it (4 × 3 floats).
fn external_model(location: &str) -> memplan::onnx::proto::ModelProto {
    let mut w = weight("w", &[4, 3]);
    w.raw_data = None;
    w.data_location = Some(1);
    let entry = |k: &str, v: &str| StringStringEntryProto {
        key: Some(k.into()),
        value: Some(v.into()),
    };
    w.external_data = vec![entry("location", location), entry("offset", "16")];
    model(
        vec![node("MatMul", "mm", &["x", "w"], &["y"])],
        vec![w],
        vec![value_info("x", 1, &[D::S("batch"), D::N(4)])],
        vec![value_info("y", 1, &[D::S("batch"), D::N(3)])],
    )
}

#[test]
fn external_data_is_mapped_when_its_file_is_there() {
    // dir/sub/m.onnx, with the same data in dir/sub/w.bin and in dir/w.bin.
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    let floats: Vec<u8> = (0..12u32)
        .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
        .collect();
    let mut file = vec![0xAB; 16];
    file.extend_from_slice(&floats);
    std::fs::write(sub.join("w.bin"), &file).unwrap();
    std::fs::write(dir.path().join("w.bin"), &file).unwrap();
    std::fs::write(sub.join("short.bin"), &file[..40]).unwrap();
    let payload = |location: &str| {
        let p = sub.join("m.onnx");
        std::fs::write(&p, encode(&external_model(location))).unwrap();
        let m = load_model(&p).unwrap();
        let t = &m.graph.tensors[m.graph.tensor_id("w").unwrap()];
        t.init.as_ref().unwrap().payload.clone()
    };
    // Beside the model: a slice of the file, from the offset, the tensor's size
    // (no length given).
    match payload("w.bin") {
        Payload::Raw(b) => assert_eq!(&b[..], &floats[..]),
        other => panic!("{other:?}"),
    }
    // Outside the model's directory (the same bytes, through `..` or an absolute
    // path), too short for its range, or missing: left external (profiling does not
    // need it; the executor says it could not read it).
    let absolute = dir.path().join("w.bin");
    // A link in the model's folder to a file outside it (issue 49: `link` ->
    // /etc/passwd loaded that file) is outside too; a link to a file beside the
    // model is not; a device is never read.
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(&absolute, sub.join("out")).unwrap();
        std::os::unix::fs::symlink("w.bin", sub.join("beside")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", sub.join("zero")).unwrap();
        assert!(matches!(payload("beside"), Payload::Raw(_)));
    }
    for location in [
        "../w.bin",
        absolute.to_str().unwrap(),
        "short.bin",
        "gone.bin",
        #[cfg(unix)]
        "out",
        #[cfg(unix)]
        "zero",
    ] {
        assert!(
            matches!(payload(location), Payload::External { .. }),
            "{location}"
        );
    }
}

#[test]
fn shape_only_and_inputs_listing_initializers() {
    let mut w = weight("w", &[4, 3]);
    w.raw_data = None; // shape-only
    let mut inputs = vec![value_info("x", 1, &[D::S("batch"), D::N(4)])];
    // Older exporters list initializers as graph inputs too.
    inputs.push(value_info("w", 1, &[D::N(4), D::N(3)]));
    let m = model(
        vec![node("MatMul", "mm", &["x", "w"], &["y"])],
        vec![w],
        inputs,
        vec![value_info("y", 1, &[D::S("batch"), D::N(3)])],
    );
    let dir = tempfile::tempdir().unwrap();
    let p = write_tmp(&dir, "so.onnx", &encode(&m));
    let model = load_model(&p).unwrap();
    assert_eq!(model.graph.inputs.len(), 1);
    let w = model.graph.tensor_id("w").unwrap();
    assert_eq!(model.graph.tensors[w].kind, TensorKind::Parameter);
    let inf = infer(
        &model,
        &Bindings {
            batch: Some(5),
            ..Default::default()
        },
    )
    .unwrap();
    let y = model.graph.tensor_id("y").unwrap();
    assert_eq!(inf.facts[y].shape, vec![5, 3]);
}

#[test]
fn omitted_optional_inputs_and_outputs() {
    // Clip with only max given (min omitted as ""), Dropout without its mask output.
    let m = model(
        vec![
            node("Clip", "clip", &["x", "", "mx"], &["c"]),
            node("Dropout", "drop", &["c"], &["y"]),
        ],
        vec![weight("mx", &[])],
        vec![value_info("x", 1, &[D::S("batch"), D::N(4)])],
        vec![value_info("y", 1, &[D::S("batch"), D::N(4)])],
    );
    let dir = tempfile::tempdir().unwrap();
    let p = write_tmp(&dir, "opt.onnx", &encode(&m));
    let model = load_model(&p).unwrap();
    let clip = model.graph.order[0];
    assert_eq!(model.graph.node(clip).inputs[1], None);
    assert!(model.graph.node(clip).inputs[2].is_some());
    let inf = infer(
        &model,
        &Bindings {
            batch: Some(3),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(
        inf.facts[model.graph.tensor_id("y").unwrap()].shape,
        vec![3, 4]
    );
}

#[test]
fn non_topological_order_is_sorted() {
    // Nodes listed consumer-first: valid graph, order repaired by a topological sort.
    let m = model(
        vec![
            node("Relu", "second", &["h"], &["y"]),
            node("Neg", "first", &["x"], &["h"]),
        ],
        vec![],
        vec![value_info("x", 1, &[D::N(2)])],
        vec![value_info("y", 1, &[D::N(2)])],
    );
    let dir = tempfile::tempdir().unwrap();
    let p = write_tmp(&dir, "order.onnx", &encode(&m));
    let model = load_model(&p).unwrap();
    assert!(!model.graph.model_order_is_topological);
    let names: Vec<&str> = model
        .graph
        .order
        .iter()
        .map(|&i| model.graph.node(i).name.as_str())
        .collect();
    assert_eq!(names, ["first", "second"]);
    assert!(infer(&model, &Bindings::default()).is_ok());
}

/// The dynamo exporter's module scopes (node metadata `pkg.torch.onnx.name_scopes`)
/// give the same module paths as the TorchScript exporter's scoped node names.
#[test]
fn dynamo_name_scopes_give_module_paths() {
    let scoped = |mut n: memplan::onnx::proto::NodeProto, scopes: &str| {
        n.metadata_props.push(StringStringEntryProto {
            key: Some("pkg.torch.onnx.name_scopes".into()),
            value: Some(scopes.into()),
        });
        n
    };
    let mut m = common::mlp();
    let g = m.graph.as_mut().unwrap();
    g.node[0] = scoped(
        g.node[0].clone(),
        "['', 'layer1', 'layer1.0', 'layer1.0.downsample', 'layer1.0.downsample.0', 'addmm']",
    );
    g.node[1] = scoped(
        g.node[1].clone(),
        "['', 'encoder', 'encoder.layer.0', 'relu']",
    );
    // Not a list: the name stays as it is.
    g.node[2] = scoped(g.node[2].clone(), "layer2");
    let dir = tempfile::tempdir().unwrap();
    let model = load_model(&common::write_tmp(&dir, "m.onnx", &common::encode(&m))).unwrap();
    let paths: Vec<Option<String>> = model
        .graph
        .order
        .iter()
        .map(|&ix| memplan::ir::module_path(&model.graph.node(ix).name))
        .collect();
    assert_eq!(
        paths,
        [
            Some("layer1.0.downsample.0".to_string()),
            Some("encoder.layer.0".to_string()),
            None
        ]
    );
    assert_eq!(model.graph.node(model.graph.order[2]).name, "fc2");
}

/// A Transpose whose `perm` attribute is patched in the encoded file, for the
/// in-place reader's late check of attributes (src/onnx/wire.rs).
fn patched_transpose(patch: impl Fn(&mut Vec<u8>, usize)) -> Vec<u8> {
    let n = with_ints(node("Transpose", "t", &["x"], &["y"]), "perm", &[1, 0]);
    let m = model(
        vec![n],
        vec![],
        vec![value_info("x", 1, &[D::N(2), D::N(3)])],
        vec![value_info("y", 1, &[D::N(3), D::N(2)])],
    );
    let mut bytes = encode(&m);
    let at = bytes
        .windows(4)
        .position(|w| w == b"perm")
        .expect("the attribute's name is in the file");
    patch(&mut bytes, at + 4);
    bytes
}

#[test]
fn an_attribute_the_in_place_reader_rejects_loads_through_prost() {
    // The attribute's `type` field (tag 20, key bytes A0 01) renumbered to tag 24
    // (C0 01), which AttributeProto does not use: prost skips the unknown field, the in-place reader does not accept
    // it, and the builder falls back on the field that is set (`ints`).
    let bytes = patched_transpose(|b, from| {
        let k = from
            + b[from..]
                .windows(2)
                .position(|w| w == [0xA0, 0x01])
                .unwrap();
        b[k] = 0xC0;
    });
    let dir = tempfile::tempdir().unwrap();
    let p = write_tmp(&dir, "unknown_field.onnx", &bytes);
    let m = load_model(&p).unwrap_or_else(|e| panic!("{e}"));
    let ix = m.graph.order[0];
    assert_eq!(m.graph.node(ix).attrs.ints("perm"), Some(&[1i64, 0][..]));
    let inf = infer(&m, &Bindings::default()).unwrap();
    let y = m.graph.tensor_id("y").unwrap();
    assert_eq!(inf.facts[y].shape, vec![3, 2]);
}

#[test]
fn a_malformed_attribute_is_a_decode_error() {
    // The `ints` field's key (tag 8) given wire type 7, which protobuf does not have.
    let bytes = patched_transpose(|b, from| {
        let k = from
            + b[from..]
                .iter()
                .position(|&x| x == 0x40 || x == 0x42)
                .unwrap();
        b[k] = 0x47;
    });
    let dir = tempfile::tempdir().unwrap();
    let p = write_tmp(&dir, "bad_wire_type.onnx", &bytes);
    let e = load_model(&p).unwrap_err().to_string();
    assert!(e.contains("not a valid ONNX model"), "{e}");
}
