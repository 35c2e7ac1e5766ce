//! Memory-mapped, zero-copy loading of an ONNX file into the IR.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use bytes::Bytes;
use petgraph::stable_graph::StableGraph;
use prost::Message;

use super::source::{AttrSrc, GraphSrc, InfoSrc, NodeSrc, TensorSrc};
use super::{proto, wire};
use crate::error::{Error, Result};
use crate::ir::{
    Attr, Attrs, DType, Data, Edge, Graph, Model, Name, NameIndex, Node, Payload, TensorData,
    TensorId, TensorInfo, TensorKind,
};

/// Files up to this size are read into memory rather than mapped ([`map_file`]).
pub const READ_BELOW: u64 = 1 << 20;

/// Maps a file read-only and wraps the mapping in [`Bytes`] (no copy); a file of at
/// most [`READ_BELOW`] bytes is read instead.
pub fn map_file(path: &Path) -> Result<Bytes> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let (mut file, meta) = crate::files::open_regular(path)?;
    // A small file (a model without its weights, or with external data) is read:
    // one read costs less than mapping, faulting the pages in and unmapping.
    if meta.len() <= READ_BELOW {
        let mut buf = Vec::with_capacity(meta.len() as usize + 1);
        std::io::Read::read_to_end(&mut file, &mut buf).map_err(io)?;
        return Ok(Bytes::from(buf));
    }
    // SAFETY: the map is read-only. A concurrent truncation of the file by another
    // process could fault, as with any mmap-based reader; memplan never writes it.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
    Ok(Bytes::from_owner(map))
}

/// Decodes a `ModelProto` from bytes; `bytes` fields become slices of `buf`.
pub fn decode_model(buf: Bytes) -> std::result::Result<proto::ModelProto, prost::DecodeError> {
    proto::ModelProto::decode(buf)
}

/// The newest version of the default ONNX domain (onnx 1.23.2's `onnx_opset_version()`).
pub const NEWEST_OPSET: i64 = 28;

/// Loads an ONNX file: map, decode, check, and build the IR graph.
pub fn load_model(path: &Path) -> Result<Model> {
    let buf = map_file(path)?;
    let not_onnx = |reason: String| Error::NotOnnx {
        path: path.to_path_buf(),
        reason,
    };
    if buf.is_empty() {
        return Err(not_onnx("file is empty".into()));
    }
    // Plain exported models are read in place; anything else goes through prost,
    // which decodes it or names what is wrong (module docs of `wire`). A model the
    // in-place build rejects (a malformed attribute, or an invalid graph) is built
    // again from prost's decoding, so that every error comes from that one path.
    let in_place = wire::model(&buf).map(|m| {
        build_model(Header {
            names: Names(buf.clone()),
            ir_version: m.ir_version,
            opsets: m.opsets,
            producer_name: m.producer_name,
            producer_version: m.producer_version,
            graph: m.graph.as_ref(),
        })
    });
    let built = match in_place {
        Some(Ok(model)) => Ok(model),
        _ => {
            let proto =
                decode_model(buf).map_err(|e| not_onnx(format!("protobuf decode failed ({e})")))?;
            from_proto(proto)
        }
    };
    let mut model = built.map_err(|e| match e {
        Error::NotOnnx { reason, .. } => not_onnx(reason),
        other => other,
    })?;
    map_external_data(path, &mut model);
    Ok(model)
}

/// Maps the files that hold initializers' external data (`data_location =
/// EXTERNAL`, what the dynamo exporter writes beside the model) and makes each
/// such initializer's payload a slice of its file, as for data inside the model:
/// nothing is read until the executor or a folded value needs it. A location that
/// leaves the model's directory (absolute, through `..`, or a link whose target is
/// outside it; [`crate::files::inside_model_dir`]), a file that cannot be
/// mapped or a range past its end leaves the payload external: profiling never
/// needs the data, and the executor says which file it could not read.
pub(crate) fn map_external_data(path: &Path, model: &mut Model) {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut files: HashMap<String, Option<Bytes>> = HashMap::new();
    for t in &mut model.graph.tensors {
        let Some(init) = t.init.as_deref_mut() else {
            continue;
        };
        let Payload::External {
            location,
            offset,
            length,
        } = &init.payload
        else {
            continue;
        };
        if !files.contains_key(location) {
            // A regular file inside the model's folder, links resolved: never a
            // file elsewhere that a link in the folder points at.
            let mapped =
                crate::files::inside_model_dir(dir, location).and_then(|file| map_file(&file).ok());
            files.insert(location.clone(), mapped);
        }
        let Some(file) = files[location].as_ref() else {
            continue;
        };
        // The tensor's bytes, as for data inside the model; a `length` that says
        // otherwise leaves it external.
        let needed = init
            .dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
            .and_then(|n| init.dtype.bytes_for(n));
        let Some(len) = needed.filter(|&n| length.is_none_or(|l| l == n)) else {
            continue;
        };
        let Some(end) = offset.checked_add(len).filter(|&e| e <= file.len() as u64) else {
            continue;
        };
        init.payload = Payload::Raw(file.slice(*offset as usize..end as usize));
    }
}

/// The header fields of a model and its graph, from either source.
struct Header<'a, G> {
    names: Names,
    ir_version: Option<i64>,
    opsets: Vec<(Option<&'a str>, Option<i64>)>,
    producer_name: Option<&'a str>,
    producer_version: Option<&'a str>,
    graph: Option<&'a G>,
}

/// Builds the IR from a decoded model.
pub fn from_proto(m: proto::ModelProto) -> Result<Model> {
    build_model(Header {
        names: Names(Bytes::new()),
        ir_version: m.ir_version,
        opsets: m
            .opset_import
            .iter()
            .map(|o| (o.domain.as_deref(), o.version))
            .collect(),
        producer_name: m.producer_name.as_deref(),
        producer_version: m.producer_version.as_deref(),
        graph: m.graph.as_ref(),
    })
}

/// Makes the IR's names: a name that lies in the mapped file (the in-place reader's
/// strings) becomes a slice of it, anything else (prost's strings) a copy.
struct Names(Bytes);

impl Names {
    fn name(&self, s: &str) -> Name {
        Name::from_utf8_slice(&self.0, s)
    }
}

fn build_model<G: GraphSrc>(m: Header<'_, G>) -> Result<Model> {
    let structural = |reason: &str| Error::NotOnnx {
        path: Default::default(),
        reason: reason.to_string(),
    };
    let ir_version = m
        .ir_version
        .ok_or_else(|| structural("no ir_version field"))?;
    if !(1..=64).contains(&ir_version) {
        return Err(structural(&format!(
            "ir_version {ir_version} is out of range"
        )));
    }
    let graph = m.graph.ok_or_else(|| structural("no graph"))?;
    let mut opsets = BTreeMap::new();
    for (domain, version) in m.opsets {
        let domain = match domain.unwrap_or("") {
            "ai.onnx" => "",
            d => d,
        };
        opsets.insert(domain.to_string(), version.unwrap_or(0));
    }
    if ir_version >= 3 && !opsets.contains_key("") {
        return Err(structural("no opset_import for the default ONNX domain"));
    }
    if let Some(v) = opsets.get("").filter(|v| !(1..=NEWEST_OPSET).contains(*v)) {
        return Err(structural(&format!(
            "opset {v} of the default ONNX domain is out of range (1 to {NEWEST_OPSET}, the newest onnx 1.23 defines)"
        )));
    }
    let producer = format!(
        "{} {}",
        m.producer_name.unwrap_or_default(),
        m.producer_version.unwrap_or_default()
    )
    .trim()
    .to_string();
    let mut folded = Folded::default();
    let graph = build_graph(graph, &m.names, &mut folded)?;
    Ok(Model {
        ir_version,
        opsets,
        producer,
        graph,
        folded_batch_norms: folded.batch_norms,
        folded_constants: folded.constants,
    })
}

/// Refuses a graph input or output of a type memplan does not model.
fn check_modelled(vi: &impl InfoSrc, role: &'static str) -> Result<()> {
    match vi.unmodelled() {
        Some(kind) => Err(Error::UnsupportedType {
            role,
            tensor: vi.name().unwrap_or_default().to_string(),
            kind,
        }),
        None => Ok(()),
    }
}

/// Converts a `TensorProto` without copying `raw_data`.
pub fn tensor_data(t: &proto::TensorProto) -> std::result::Result<TensorData, String> {
    tensor_data_of(t)
}

fn tensor_data_of(t: &impl TensorSrc) -> std::result::Result<TensorData, String> {
    let code = t.data_type().unwrap_or(0);
    let dtype = DType::from_onnx(code).ok_or_else(|| format!("unknown data_type {code}"))?;
    let t_dims = t.dims();
    let mut dims = Vec::with_capacity(t_dims.len());
    for &d in t_dims.iter() {
        dims.push(usize::try_from(d).map_err(|_| format!("negative dimension {d}"))?);
    }
    let td = TensorData {
        dtype,
        dims,
        payload: Payload::ShapeOnly,
    };
    let numel = td
        .numel()
        .ok_or_else(|| format!("shape {:?} overflows", td.dims))?;
    let expected_bytes = dtype
        .bytes_for(numel)
        .ok_or_else(|| format!("shape {:?} overflows", td.dims))?;
    let payload = if t.data_location() == Some(proto::tensor_proto::DataLocation::External as i32) {
        let get = |k: &str| t.external(k);
        let location = get("location").ok_or("external data without a location")?;
        let num = |k: &str| -> std::result::Result<Option<u64>, String> {
            get(k)
                .map(|v| {
                    v.parse::<u64>()
                        .map_err(|_| format!("external data {k} '{v}' is not a number"))
                })
                .transpose()
        };
        Payload::External {
            location,
            offset: num("offset")?.unwrap_or(0),
            length: num("length")?,
        }
    } else if let Some(raw) = t.raw_data().filter(|r| !r.is_empty()) {
        if dtype != DType::String && raw.len() as u64 != expected_bytes {
            return Err(format!(
                "raw_data holds {} bytes, its shape {:?} of {dtype} needs {expected_bytes}",
                raw.len(),
                td.dims
            ));
        }
        Payload::Raw(raw)
    } else {
        // The first typed field that holds anything.
        let typed = nonempty(t.int64_data())
            .map(|v| Data::Int(v.into_owned()))
            .or_else(|| {
                nonempty(t.int32_data()).map(|v| match dtype {
                    // Half types store their bit patterns in int32_data; the values
                    // are not needed for shapes, so keep only the count.
                    DType::F16 | DType::BF16 => Data::Float(vec![0.0; v.len()]),
                    _ => Data::Int(v.iter().map(|&v| v as i64).collect()),
                })
            })
            .or_else(|| {
                nonempty(t.uint64_data()).map(|v| Data::Int(v.iter().map(|&v| v as i64).collect()))
            })
            .or_else(|| {
                nonempty(t.float_data()).map(|v| Data::Float(v.iter().map(|&v| v as f64).collect()))
            })
            .or_else(|| nonempty(t.double_data()).map(|v| Data::Float(v.into_owned())));
        match typed {
            Some(d) => {
                if d.len() as u64 != numel {
                    return Err(format!(
                        "holds {} elements, its shape {:?} needs {numel}",
                        d.len(),
                        td.dims
                    ));
                }
                Payload::Typed(d)
            }
            // A 0-element tensor needs no data: it is a complete constant (the
            // dims [0] shape list transformers' mask code feeds ConstantOfShape).
            None if numel == 0 && dtype.is_float() => Payload::Typed(Data::Float(Vec::new())),
            None if numel == 0 && dtype != DType::String => Payload::Typed(Data::Int(Vec::new())),
            None => Payload::ShapeOnly,
        }
    };
    Ok(TensorData { payload, ..td })
}

fn nonempty<T: Clone>(v: Cow<'_, [T]>) -> Option<Cow<'_, [T]>> {
    (!v.is_empty()).then_some(v)
}

pub(crate) fn attrs_of(node: &proto::NodeProto, node_name: &str) -> Result<Attrs> {
    attrs_from(node, node_name, &Names(Bytes::new()))
}

fn attrs_from(node: &impl NodeSrc, node_name: &str, names: &Names) -> Result<Attrs> {
    use proto::attribute_proto::AttributeType as T;
    let mut out = Attrs::with_capacity(node.attribute_count());
    for a in node.attributes() {
        if a.malformed() {
            // Only from the in-place reader: `load_model` falls back on prost.
            return Err(Error::node(
                node_name,
                node.op_type(),
                "an attribute is malformed",
            ));
        }
        let name =
            crate::ir::attr::common_attr_name(a.name()).unwrap_or_else(|| names.name(a.name()));
        let s = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        // Prefer the declared type; old exporters sometimes omit it, so fall back on
        // whichever field is set.
        let kind = a.kind().and_then(|t| T::try_from(t).ok());
        let v = match kind {
            Some(T::Int) => Attr::Int(a.i().unwrap_or(0)),
            Some(T::Float) => Attr::Float(a.f().unwrap_or(0.0)),
            Some(T::String) => Attr::String(a.s().map(s).unwrap_or_default()),
            Some(T::Ints) => Attr::Ints(a.ints().into_owned()),
            Some(T::Floats) => Attr::Floats(a.floats().into_owned()),
            Some(T::Strings) => Attr::Strings(a.strings().map(s).collect()),
            Some(T::Tensor) => {
                let t = a.t().ok_or_else(|| {
                    Error::node(
                        node_name,
                        node.op_type(),
                        format!("attribute '{name}' has no tensor"),
                    )
                })?;
                Attr::Tensor(Box::new(tensor_data_of(t).map_err(|e| {
                    Error::node(
                        node_name,
                        node.op_type(),
                        format!("attribute '{name}': {e}"),
                    )
                })?))
            }
            Some(T::Graph) => match a.g() {
                Some(g) => Attr::Graph(g),
                None => Attr::Other("graph"),
            },
            Some(other) => Attr::Other(other.as_str_name()),
            None if a.i().is_some() => Attr::Int(a.i().unwrap_or(0)),
            None if a.f().is_some() => Attr::Float(a.f().unwrap_or(0.0)),
            None if a.s().is_some() => Attr::String(a.s().map(s).unwrap_or_default()),
            None if !a.ints().is_empty() => Attr::Ints(a.ints().into_owned()),
            None if !a.floats().is_empty() => Attr::Floats(a.floats().into_owned()),
            None => Attr::Other("undefined"),
        };
        out.insert(name, v);
    }
    Ok(out)
}

struct Builder {
    g: Graph,
}

impl Builder {
    fn add_tensor(&mut self, info: TensorInfo) -> TensorId {
        let id = self.g.tensors.len();
        self.g.tensors.push(info);
        self.g.by_name.insert(&self.g.tensors, id);
        id
    }
}

/// What the dynamo exporter's optimizer folded, as its metadata says
/// ([`Model::folded_batch_norms`], [`Model::folded_constants`]).
#[derive(Default)]
struct Folded {
    batch_norms: usize,
    constants: usize,
}

/// Builds the main graph, counting in `folded` what the exporter's optimizer folded.
#[allow(clippy::too_many_lines)] // Long by design: one pass over the file's nodes, initializers and value infos, in the order ONNX defines them.
fn build_graph<G: GraphSrc>(gp: &G, names: &Names, folded: &mut Folded) -> Result<Graph> {
    let (n_nodes, n_inits) = (gp.nodes().len(), gp.initializers().len());
    // Every tensor is an initializer, a graph input or a node's output; every node
    // reads about two.
    let n_outputs: usize = gp.nodes().iter().map(|n| n.output_count()).sum();
    let n_tensors = n_inits + gp.inputs().len() + n_outputs;
    let mut b = Builder {
        g: Graph {
            name: gp.name().to_string(),
            nodes: StableGraph::with_capacity(n_nodes, 2 * n_nodes),
            tensors: Vec::with_capacity(n_tensors),
            by_name: NameIndex::with_capacity(n_tensors),
            ..Default::default()
        },
    };
    let bad = |msg: String| Error::Graph(msg);

    // Initializers: parameters (floating, but for the dynamo exporter's scalar
    // constants) or constants.
    for t in gp.initializers() {
        let name = names.name(t.name());
        if name.is_empty() {
            return Err(bad("an initializer has no name".into()));
        }
        if b.g.tensor_id(&name).is_some() {
            return Err(bad(format!("initializer '{name}' is defined twice")));
        }
        let data = tensor_data_of(t).map_err(|e| bad(format!("initializer '{name}': {e}")))?;
        let kind = if data.dtype.is_float() && !exporter_scalar(&name, &data) {
            TensorKind::Parameter
        } else {
            TensorKind::Constant
        };
        b.add_tensor(TensorInfo {
            name,
            kind,
            declared_dtype: Some(data.dtype),
            declared_shape: None,
            producer: None,
            init: Some(Box::new(data)),
            buffer: false,
        });
    }
    if gp.has_sparse_initializers() {
        return Err(bad("sparse initializers are not supported".into()));
    }

    // Graph inputs that are not initializers are fed by the user.
    for vi in gp.inputs() {
        check_modelled(vi, "input")?;
        let name = vi.name().unwrap_or_default();
        let (dtype, shape) = vi.decl_type();
        if let Some(id) = b.g.tensor_id(name) {
            // An initializer listed as an input (older exporters): a default value.
            if b.g.tensors[id].producer.is_none() && b.g.tensors[id].init.is_some() {
                continue;
            }
            return Err(bad(format!("graph input '{name}' is declared twice")));
        }
        let id = b.add_tensor(TensorInfo {
            name: names.name(name),
            kind: TensorKind::Input,
            declared_dtype: dtype,
            declared_shape: shape,
            producer: None,
            init: None,
            buffer: false,
        });
        b.g.inputs.push(id);
    }

    // Nodes, first pass: create nodes and their outputs.
    let mut node_ix = Vec::with_capacity(n_nodes);
    for (i, n) in gp.nodes().iter().enumerate() {
        let op_type = n.op_type();
        let name = match n.name() {
            "" => Name::from(format!("{op_type}_{i}")),
            s => names.name(s),
        };
        let name = scoped_name(n, name);
        if n.metadata("pkg.onnxscript.rewriter.rule_name")
            .is_some_and(|rules| rules.contains("FuseBatchNormInto"))
        {
            folded.batch_norms += 1;
        }
        let domain = match n.domain() {
            "ai.onnx" => Name::new(),
            d => names.name(d),
        };
        let attrs = attrs_from(n, &name, names)?;
        let ix = b.g.nodes.add_node(Node {
            name,
            op_type: names.name(op_type),
            domain,
            inputs: Default::default(),
            outputs: Default::default(),
            attrs,
        });
        let mut outputs = crate::ir::Outputs::new();
        for o in n.outputs() {
            if o.is_empty() {
                outputs.push(None);
                continue;
            }
            if let Some(prev) = b.g.tensor_id(o) {
                let who = match b.g.tensors[prev].producer {
                    Some(p) => format!("node '{}'", b.g.nodes[p].name),
                    None => "a graph input or initializer".to_string(),
                };
                return Err(bad(format!(
                    "node '{}' ({op_type}) writes '{o}', already written by {who}",
                    b.g.nodes[ix].name
                )));
            }
            let kind = if op_type == "Constant" && n.domain().is_empty() {
                TensorKind::Constant
            } else {
                TensorKind::Activation
            };
            outputs.push(Some(b.add_tensor(TensorInfo {
                name: names.name(o),
                kind,
                declared_dtype: None,
                declared_shape: None,
                producer: Some(ix),
                init: None,
                buffer: false,
            })));
        }
        b.g.nodes[ix].outputs = outputs;
        node_ix.push(ix);
    }

    // Second pass: resolve inputs, add edges.
    for (n, &ix) in gp.nodes().iter().zip(&node_ix) {
        let mut inputs = crate::ir::Inputs::new();
        for (slot, inp) in n.inputs().enumerate() {
            if inp.is_empty() {
                inputs.push(None);
                continue;
            }
            let Some(t) = b.g.tensor_id(inp) else {
                let node = &b.g.nodes[ix];
                return Err(bad(format!(
                    "node '{}' ({}) reads undefined tensor '{inp}'{}",
                    node.name,
                    node.op_type,
                    missing_parameter_hint(inp)
                )));
            };
            if let Some(p) = b.g.tensors[t].producer {
                b.g.nodes.add_edge(p, ix, Edge { tensor: t, slot });
            }
            inputs.push(Some(t));
        }
        b.g.nodes[ix].inputs = inputs;
    }

    // Graph outputs.
    for vi in gp.outputs() {
        check_modelled(vi, "output")?;
        let name = vi.name().unwrap_or_default();
        let Some(t) = b.g.tensor_id(name) else {
            return Err(bad(format!(
                "graph output '{name}' is not produced by any node"
            )));
        };
        let (dtype, shape) = vi.decl_type();
        let info = &mut b.g.tensors[t];
        if info.kind == TensorKind::Activation {
            info.kind = TensorKind::Output;
        }
        info.declared_dtype = info.declared_dtype.or(dtype);
        if info.declared_shape.is_none() {
            info.declared_shape = shape;
        }
        b.g.outputs.push(t);
    }
    for vi in gp.value_info() {
        if let Some(t) = vi.name().and_then(|n| b.g.tensor_id(n)) {
            let (dtype, shape) = vi.decl_type();
            let info = &mut b.g.tensors[t];
            info.buffer |= info.init.is_some()
                && vi
                    .metadata("pkg.torch.export.graph_signature.InputSpec.kind")
                    .is_some_and(|kind| matches!(kind, "BUFFER" | "CONSTANT_TENSOR"));
            if info.kind == TensorKind::Parameter
                && vi
                    .metadata("pkg.onnxscript.optimizer.folded_from")
                    .and_then(py_str_list)
                    .is_some_and(|from| from.len() > 1)
            {
                folded.constants += 1;
            }
            info.declared_dtype = info.declared_dtype.or(dtype);
            if info.declared_shape.is_none() {
                info.declared_shape = shape;
            }
        }
    }

    // Execution order: the model's, if it is topological.
    // Nodes were added in model order and never removed, so a node's index is its
    // position: an edge is forward iff its source index is below its target's.
    let topological = b.g.nodes.edge_indices().all(|e| {
        let (src, dst) = b.g.nodes.edge_endpoints(e).expect("edge exists");
        src.index() < dst.index()
    });
    b.g.order = if topological {
        node_ix
    } else {
        petgraph::algo::toposort(&b.g.nodes, None).map_err(|cycle| {
            let node = &b.g.nodes[cycle.node_id()];
            bad(format!(
                "the graph has a cycle through node '{}' ({})",
                node.name, node.op_type
            ))
        })?
    };
    b.g.model_order_is_topological = topological;
    Ok(b.g)
}

/// The dynamo exporter's module scopes, written into the node's name the way the
/// TorchScript exporter writes its scopes, so that one parser
/// ([`crate::ir::module_path`]) names both exporters' modules. Its metadata
/// `pkg.torch.onnx.name_scopes` is the Python `repr` of the full module paths from
/// the root (`''`) to the innermost module, then the fx node's name:
/// `['', 'layer1', 'layer1.0', 'layer1.0.conv1', 'convolution']` makes
/// `node_Conv_3` into `/layer1/0/conv1/node_Conv_3`. A name that already has a
/// scope, or a node without the metadata, keeps its name.
fn scoped_name(n: &impl NodeSrc, name: Name) -> Name {
    if name.starts_with('/') {
        return name;
    }
    let Some(scopes) = n
        .metadata("pkg.torch.onnx.name_scopes")
        .and_then(py_str_list)
    else {
        return name;
    };
    let mut parts: Vec<&str> = Vec::new();
    let mut prev = "";
    for m in scopes[..scopes.len().saturating_sub(1)]
        .iter()
        .filter(|m| !m.is_empty())
    {
        let rel = m
            .strip_prefix(prev)
            .and_then(|r| r.strip_prefix('.'))
            .filter(|_| !prev.is_empty())
            .unwrap_or(m);
        parts.push(rel);
        prev = m;
    }
    if parts.is_empty() || parts.iter().any(|p| p.contains('/')) {
        return name;
    }
    Name::from(format!("/{}/{name}", parts.join("/")))
}

/// A Python `repr` of a list of strings (`['', 'a.b']`); `None` if it is not one.
fn py_str_list(text: &str) -> Option<Vec<String>> {
    let inner = text.trim().strip_prefix('[')?.strip_suffix(']')?;
    let mut out = Vec::new();
    let mut chars = inner.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace() || *c == ',') {
            chars.next();
        }
        let Some(q) = chars.next() else { break };
        if q != '\'' && q != '"' {
            return None;
        }
        let mut s = String::new();
        loop {
            match chars.next()? {
                '\\' => s.push(chars.next()?),
                c if c == q => break,
                c => s.push(c),
            }
        }
        out.push(s);
    }
    Some(out)
}

/// A scalar the dynamo exporter made an initializer (`val_<n>`: `x * 0.5`, an
/// attention scale), where the TorchScript exporter writes a Constant node: a
/// Python number in the model, not a parameter. A 0-d parameter of the model keeps
/// its module path (CLIP's `logit_scale`).
fn exporter_scalar(name: &str, data: &crate::ir::TensorData) -> bool {
    data.dims.is_empty()
        && name
            .strip_prefix("val_")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// What to say after "reads undefined tensor NAME" when NAME looks like a module's
/// parameter or buffer (`model.layers.0.mlp.up_proj.weight`): the exporter was told
/// to leave the weights out (`ONNXProgram.save(path, include_initializers=False)`),
/// which drops their names and shapes too.
fn missing_parameter_hint(name: &str) -> &'static str {
    const LEAVES: [&str; 7] = [
        "weight",
        "bias",
        "inv_freq",
        "running_mean",
        "running_var",
        "position_ids",
        "embed_positions",
    ];
    let leaf = name.rsplit('.').next().unwrap_or(name);
    if name.contains('.') && (LEAVES.contains(&leaf) || leaf.starts_with("lora_")) {
        ": it looks like a parameter the export left out (a save with \
         include_initializers=False drops their names and shapes); export without \
         weights with memplan-export, which keeps them (docs/usage/llm.md)"
    } else {
        ""
    }
}
