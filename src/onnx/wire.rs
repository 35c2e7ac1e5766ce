//! A zero-copy reader of the ONNX protobuf wire format, for loading fast.
//!
//! prost decodes every string into its own allocation and the IR then copies it
//! again; on this path a model is read in place instead: [`model`] walks the
//! buffer once, checks every field it accepts as prost would (wire types, varints,
//! lengths, UTF-8), and returns views that borrow the buffer. The IR builder
//! ([`super::load`]) reads them through the traits of [`super::source`], as it reads
//! prost's structs, and copies each name once, into the IR.
//!
//! The reader accepts only what plain exported models hold: the fields the IR reads
//! and the documentation and metadata fields beside them. Anything else (a field it
//! does not know, a subgraph attribute, a non-tensor type, a training or function
//! section, a singular message given twice, anything malformed) makes [`model`]
//! return `None`, and loading falls back on prost, which decodes it, or reports the
//! error, exactly as before. Attributes are the one part checked late: [`model`]
//! checks that each is a length-delimited field and reads it only when the IR
//! builder asks for it, once; one that does not read is [`AttrSrc::malformed`], the
//! build stops there, and loading falls back on prost the same way. So this path
//! never accepts a file prost rejects, and gives the same IR for every file it
//! accepts.

use std::borrow::Cow;

use bytes::Bytes;

use super::source::{
    dim_decl, tensor_unmodelled, AttrSrc, Dims, GraphSrc, InfoSrc, NodeSrc, TensorSrc,
};
use crate::ir::{DType, DimDecl};

/// One field's payload, by wire type.
#[derive(Clone, Copy)]
enum Wire<'a> {
    Varint(u64),
    I64(u64),
    Len(&'a [u8]),
    I32(u32),
}

/// A protobuf varint at `*pos` (at most 10 bytes, the 10th 0 or 1, as prost reads it).
fn varint(buf: &[u8], pos: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for i in 0..10 {
        let b = *buf.get(*pos)?;
        *pos += 1;
        if i == 9 && b > 1 {
            return None;
        }
        v |= u64::from(b & 0x7f) << (7 * i);
        if b < 0x80 {
            return Some(v);
        }
    }
    None
}

/// The fields of one message, in order; an item is `None` (and the last) where the
/// bytes are not a well-formed field (groups included: no ONNX field is one).
struct Fields<'a> {
    buf: &'a [u8],
    pos: usize,
}

fn fields(buf: &[u8]) -> Fields<'_> {
    Fields { buf, pos: 0 }
}

impl<'a> Fields<'a> {
    fn field(&mut self) -> Option<(u32, Wire<'a>)> {
        let key = varint(self.buf, &mut self.pos)?;
        let key = u32::try_from(key).ok()?;
        let tag = key >> 3;
        if tag == 0 {
            return None;
        }
        let wire = match key & 7 {
            0 => Wire::Varint(varint(self.buf, &mut self.pos)?),
            1 => {
                let b = self.buf.get(self.pos..self.pos + 8)?;
                self.pos += 8;
                Wire::I64(u64::from_le_bytes(b.try_into().ok()?))
            }
            2 => {
                let len = usize::try_from(varint(self.buf, &mut self.pos)?).ok()?;
                let end = self.pos.checked_add(len)?;
                let b = self.buf.get(self.pos..end)?;
                self.pos = end;
                Wire::Len(b)
            }
            5 => {
                let b = self.buf.get(self.pos..self.pos + 4)?;
                self.pos += 4;
                Wire::I32(u32::from_le_bytes(b.try_into().ok()?))
            }
            _ => return None,
        };
        Some((tag, wire))
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = Option<(u32, Wire<'a>)>;
    fn next(&mut self) -> Option<Self::Item> {
        if self.pos >= self.buf.len() {
            return None;
        }
        let f = self.field();
        if f.is_none() {
            self.pos = self.buf.len();
        }
        Some(f)
    }
}

/// A `string` field.
fn string(w: Wire<'_>) -> Option<&str> {
    match w {
        Wire::Len(b) => utf8(b),
        _ => None,
    }
}

/// `b` as UTF-8, checked; names are nearly always ASCII, checked a word at a time.
fn utf8(b: &[u8]) -> Option<&str> {
    if b.is_ascii() {
        // SAFETY: ASCII is UTF-8.
        Some(unsafe { std::str::from_utf8_unchecked(b) })
    } else {
        std::str::from_utf8(b).ok()
    }
}

/// A `bytes` field.
fn bytes(w: Wire<'_>) -> Option<&[u8]> {
    match w {
        Wire::Len(b) => Some(b),
        _ => None,
    }
}

/// A varint scalar field (`int32`, `int64`, `uint64`, enums).
fn int(w: Wire<'_>) -> Option<u64> {
    match w {
        Wire::Varint(v) => Some(v),
        _ => None,
    }
}

/// An embedded message field.
fn message(w: Wire<'_>) -> Option<&[u8]> {
    bytes(w)
}

/// Each element of a repeated varint field, packed or not.
fn each_varint(w: Wire<'_>, mut f: impl FnMut(u64)) -> Option<()> {
    match w {
        Wire::Varint(v) => f(v),
        Wire::Len(b) => {
            let mut pos = 0;
            while pos < b.len() {
                f(varint(b, &mut pos)?);
            }
        }
        _ => return None,
    }
    Some(())
}

/// Each element of a repeated 4-byte (`I32`) or 8-byte (`I64`) field, packed or not,
/// as its little-endian bits.
fn each_fixed<const W: usize>(w: Wire<'_>, mut f: impl FnMut(u64)) -> Option<()> {
    match (w, W) {
        (Wire::I32(v), 4) => f(u64::from(v)),
        (Wire::I64(v), 8) => f(v),
        (Wire::Len(b), _) if b.len() % W == 0 => {
            for c in b.chunks_exact(W) {
                let mut x = [0u8; 8];
                x[..W].copy_from_slice(c);
                f(u64::from_le_bytes(x));
            }
        }
        _ => return None,
    }
    Some(())
}

/// Checks a `StringStringEntryProto`; its key and value.
fn entry(b: &[u8]) -> Option<(Option<&str>, Option<&str>)> {
    let (mut key, mut value) = (None, None);
    for f in fields(b) {
        match f? {
            (1, w) => key = Some(string(w)?),
            (2, w) => value = Some(string(w)?),
            _ => return None,
        }
    }
    Some((key, value))
}

/// Sets a singular embedded message, refusing a second one (prost would merge them).
fn once<'a>(slot: &mut Option<&'a [u8]>, w: Wire<'a>) -> Option<()> {
    if slot.is_some() {
        return None;
    }
    *slot = Some(message(w)?);
    Some(())
}

/// A model read in place; see the module docs.
pub(crate) struct ModelV<'a> {
    pub ir_version: Option<i64>,
    /// `opset_import`: each domain and version.
    pub opsets: Vec<(Option<&'a str>, Option<i64>)>,
    pub producer_name: Option<&'a str>,
    pub producer_version: Option<&'a str>,
    pub graph: Option<GraphV<'a>>,
}

/// Reads a `ModelProto` in place; `None` where prost must decode it (module docs).
pub(crate) fn model(buf: &Bytes) -> Option<ModelV<'_>> {
    let mut m = ModelV {
        ir_version: None,
        opsets: Vec::new(),
        producer_name: None,
        producer_version: None,
        graph: None,
    };
    let mut graph = None;
    for f in fields(buf) {
        match f? {
            (1, w) => m.ir_version = Some(int(w)? as i64),
            (2, w) => m.producer_name = Some(string(w)?),
            (3, w) => m.producer_version = Some(string(w)?),
            (4 | 6, w) => {
                string(w)?;
            }
            (5, w) => {
                int(w)?;
            }
            (7, w) => once(&mut graph, w)?,
            (8, w) => {
                let (mut domain, mut version) = (None, None);
                for f in fields(message(w)?) {
                    match f? {
                        (1, w) => domain = Some(string(w)?),
                        (2, w) => version = Some(int(w)? as i64),
                        _ => return None,
                    }
                }
                m.opsets.push((domain, version));
            }
            (14, w) => {
                entry(message(w)?)?;
            }
            _ => return None,
        }
    }
    m.graph = match graph {
        Some(g) => Some(read_graph(buf, g)?),
        None => None,
    };
    Some(m)
}

/// A `GraphProto` read in place.
pub(crate) struct GraphV<'a> {
    name: Option<&'a str>,
    nodes: Vec<NodeV<'a>>,
    initializers: Vec<TensorV<'a>>,
    inputs: Vec<InfoV<'a>>,
    outputs: Vec<InfoV<'a>>,
    value_info: Vec<InfoV<'a>>,
}

fn read_graph<'a>(src: &'a Bytes, b: &'a [u8]) -> Option<GraphV<'a>> {
    // Count the repeated fields first (a scan of keys and lengths), so that each
    // vector is allocated once at its size.
    let mut counts = [0usize; 17];
    for f in fields(b) {
        let (tag, _) = f?;
        counts[(tag as usize).min(16)] += 1;
    }
    let mut g = GraphV {
        name: None,
        nodes: Vec::with_capacity(counts[1]),
        initializers: Vec::with_capacity(counts[5]),
        inputs: Vec::with_capacity(counts[11]),
        outputs: Vec::with_capacity(counts[12]),
        value_info: Vec::with_capacity(counts[13]),
    };
    for f in fields(b) {
        match f? {
            (1, w) => g.nodes.push(read_node(src, message(w)?)?),
            (2, w) => g.name = Some(string(w)?),
            (5, w) => g.initializers.push(read_tensor(src, message(w)?)?),
            (10, w) => {
                string(w)?;
            }
            (11, w) => g.inputs.push(read_info(message(w)?)?),
            (12, w) => g.outputs.push(read_info(message(w)?)?),
            (13, w) => g.value_info.push(read_info(message(w)?)?),
            (16, w) => {
                entry(message(w)?)?;
            }
            _ => return None,
        }
    }
    Some(g)
}

impl<'a> GraphSrc for GraphV<'a> {
    type Node = NodeV<'a>;
    type Tensor = TensorV<'a>;
    type Info = InfoV<'a>;
    fn name(&self) -> &str {
        self.name.unwrap_or("")
    }
    fn nodes(&self) -> &[Self::Node] {
        &self.nodes
    }
    fn initializers(&self) -> &[Self::Tensor] {
        &self.initializers
    }
    fn has_sparse_initializers(&self) -> bool {
        false
    }
    fn inputs(&self) -> &[Self::Info] {
        &self.inputs
    }
    fn outputs(&self) -> &[Self::Info] {
        &self.outputs
    }
    fn value_info(&self) -> &[Self::Info] {
        &self.value_info
    }
}

/// A `NodeProto` read in place: its singular fields, and its bytes for the
/// repeated ones (already checked, read again on demand).
pub(crate) struct NodeV<'a> {
    src: &'a Bytes,
    raw: &'a [u8],
    /// The part of `raw` from the first `input` or `output` field to the last.
    io: &'a [u8],
    /// The part of `raw` from the first `attribute` field to the last.
    attrs: &'a [u8],
    /// Number of `output` fields.
    n_outputs: u32,
    /// Number of `attribute` fields.
    n_attrs: u32,
    name: Option<&'a str>,
    op_type: Option<&'a str>,
    domain: Option<&'a str>,
    /// The tags present, one bit each (all ≤ 10), to skip reading absent fields.
    tags: u32,
}

fn read_node<'a>(src: &'a Bytes, b: &'a [u8]) -> Option<NodeV<'a>> {
    let mut n = NodeV {
        src,
        raw: b,
        io: &[],
        attrs: &[],
        n_outputs: 0,
        n_attrs: 0,
        name: None,
        op_type: None,
        domain: None,
        tags: 0,
    };
    // Byte ranges [start, end) of the input/output fields and of the attributes.
    let (mut io, mut attrs) = ((usize::MAX, 0), (usize::MAX, 0));
    let mut it = fields(b);
    loop {
        let start = it.pos;
        let Some(f) = it.next() else { break };
        let (tag, w) = f?;
        n.tags |= 1 << tag.min(31);
        let span = |r: &mut (usize, usize)| *r = (r.0.min(start), it.pos);
        match (tag, w) {
            (1 | 2, w) => {
                string(w)?;
                span(&mut io);
                n.n_outputs += u32::from(tag == 2);
            }
            (6 | 8, w) => {
                string(w)?;
            }
            (3, w) => n.name = Some(string(w)?),
            (4, w) => n.op_type = Some(string(w)?),
            (7, w) => n.domain = Some(string(w)?),
            (5, w) => {
                // Read (and checked) when the builder asks for it (module docs).
                message(w)?;
                span(&mut attrs);
                n.n_attrs += 1;
            }
            (9, w) => {
                entry(message(w)?)?;
            }
            _ => return None,
        }
    }
    if io.0 < io.1 {
        n.io = &b[io.0..io.1];
    }
    if attrs.0 < attrs.1 {
        n.attrs = &b[attrs.0..attrs.1];
    }
    Some(n)
}

impl<'a> NodeV<'a> {
    /// The string fields `input` (tag 1) or `output` (tag 2).
    fn strings(&self, tag: u32) -> impl Iterator<Item = &'a str> {
        debug_assert!(tag == 1 || tag == 2);
        fields(self.io)
            .flatten()
            .filter(move |&(t, _)| t == tag)
            .filter_map(|(_, w)| match w {
                // SAFETY: `read_node` checked that every field with tag 1 or 2 is
                // UTF-8 (`string`) before this view was made, and `raw` is immutable.
                Wire::Len(b) => Some(unsafe { std::str::from_utf8_unchecked(b) }),
                _ => None,
            })
    }
}

impl NodeSrc for NodeV<'_> {
    type Attr<'s>
        = AttrV<'s>
    where
        Self: 's;
    fn name(&self) -> &str {
        self.name.unwrap_or("")
    }
    fn op_type(&self) -> &str {
        self.op_type.unwrap_or("")
    }
    fn domain(&self) -> &str {
        self.domain.unwrap_or("")
    }
    fn inputs(&self) -> impl Iterator<Item = &str> {
        self.strings(1)
    }
    fn outputs(&self) -> impl Iterator<Item = &str> {
        self.strings(2)
    }
    fn output_count(&self) -> usize {
        self.n_outputs as usize
    }
    fn attribute_count(&self) -> usize {
        self.n_attrs as usize
    }
    fn attributes(&self) -> impl Iterator<Item = AttrV<'_>> {
        let src = self.src;
        fields(self.attrs)
            .flatten()
            .filter(|&(t, _)| t == 5)
            .map(move |(_, w)| {
                message(w)
                    .and_then(|b| read_attr(src, b))
                    .unwrap_or(AttrV::MALFORMED)
            })
    }
    fn metadata(&self, key: &str) -> Option<&str> {
        if self.tags & (1 << 9) == 0 {
            return None;
        }
        fields(self.raw)
            .flatten()
            .filter(|&(t, _)| t == 9)
            .filter_map(|(_, w)| entry(message(w)?))
            .find(|&(k, _)| k.unwrap_or("") == key)
            .map(|(_, v)| v.unwrap_or(""))
    }
}

/// An `AttributeProto` read in place.
pub(crate) struct AttrV<'a> {
    raw: &'a [u8],
    name: Option<&'a str>,
    kind: Option<i32>,
    i: Option<i64>,
    f: Option<f32>,
    s: Option<&'a [u8]>,
    t: Option<TensorV<'a>>,
    /// The tags present, one bit each (all ≤ 21), to skip reading absent fields.
    tags: u32,
    /// It did not read ([`AttrSrc::malformed`]).
    bad: bool,
}

impl AttrV<'_> {
    const MALFORMED: Self = AttrV {
        raw: &[],
        name: None,
        kind: None,
        i: None,
        f: None,
        s: None,
        t: None,
        tags: 0,
        bad: true,
    };
}

fn read_attr<'a>(src: &'a Bytes, b: &'a [u8]) -> Option<AttrV<'a>> {
    let mut a = AttrV {
        raw: b,
        bad: false,
        ..AttrV::MALFORMED
    };
    let mut t = None;
    for f in fields(b) {
        let (tag, w) = f?;
        a.tags |= 1 << tag.min(31);
        match (tag, w) {
            (1, w) => a.name = Some(string(w)?),
            (13 | 21, w) => {
                string(w)?;
            }
            (20, w) => a.kind = Some(int(w)? as i32),
            (2, Wire::I32(v)) => a.f = Some(f32::from_bits(v)),
            (3, w) => a.i = Some(int(w)? as i64),
            (4, w) => a.s = Some(bytes(w)?),
            (5, w) => once(&mut t, w)?,
            (7, w) => each_fixed::<4>(w, |_| ())?,
            (8, w) => each_varint(w, |_| ())?,
            (9, w) => {
                bytes(w)?;
            }
            _ => return None,
        }
    }
    a.t = match t {
        Some(t) => Some(read_tensor(src, t)?),
        None => None,
    };
    Some(a)
}

impl<'a> AttrSrc for AttrV<'a> {
    type Tensor = TensorV<'a>;
    fn name(&self) -> &str {
        self.name.unwrap_or("")
    }
    fn kind(&self) -> Option<i32> {
        self.kind
    }
    fn i(&self) -> Option<i64> {
        self.i
    }
    fn f(&self) -> Option<f32> {
        self.f
    }
    fn s(&self) -> Option<&[u8]> {
        self.s
    }
    fn ints(&self) -> Cow<'_, [i64]> {
        if self.tags & (1 << 8) == 0 {
            return Cow::Borrowed(&[]);
        }
        Cow::Owned(varints(self.raw, 8, |v| v as i64))
    }
    fn floats(&self) -> Cow<'_, [f32]> {
        if self.tags & (1 << 7) == 0 {
            return Cow::Borrowed(&[]);
        }
        Cow::Owned(fixeds::<4, _>(self.raw, 7, |v| f32::from_bits(v as u32)))
    }
    fn strings(&self) -> impl Iterator<Item = &[u8]> {
        fields(self.raw)
            .flatten()
            .filter(|&(t, _)| t == 9)
            .filter_map(|(_, w)| bytes(w))
    }
    fn t(&self) -> Option<&Self::Tensor> {
        self.t.as_ref()
    }
    fn g(&self) -> Option<Bytes> {
        // A subgraph makes the reader fall back on prost (`read_attr`).
        None
    }
    fn malformed(&self) -> bool {
        self.bad
    }
}

/// The elements of the (checked) repeated varint field `tag` of a message.
fn varints<T>(raw: &[u8], tag: u32, conv: impl Fn(u64) -> T) -> Vec<T> {
    let mut out = Vec::new();
    for (_, w) in fields(raw).flatten().filter(|&(t, _)| t == tag) {
        let _ = each_varint(w, |v| out.push(conv(v)));
    }
    out
}

/// The elements of the (checked) repeated fixed-width field `tag` of a message.
fn fixeds<const W: usize, T>(raw: &[u8], tag: u32, conv: impl Fn(u64) -> T) -> Vec<T> {
    let mut out = Vec::new();
    for (_, w) in fields(raw).flatten().filter(|&(t, _)| t == tag) {
        let _ = each_fixed::<W>(w, |v| out.push(conv(v)));
    }
    out
}

/// A `TensorProto` read in place.
pub(crate) struct TensorV<'a> {
    src: &'a Bytes,
    raw: &'a [u8],
    name: Option<&'a str>,
    data_type: Option<i32>,
    data_location: Option<i32>,
    raw_data: Option<&'a [u8]>,
    /// The tags present, one bit each (all ≤ 16), to skip reading absent fields.
    tags: u32,
}

fn read_tensor<'a>(src: &'a Bytes, b: &'a [u8]) -> Option<TensorV<'a>> {
    let mut t = TensorV {
        src,
        raw: b,
        name: None,
        data_type: None,
        data_location: None,
        raw_data: None,
        tags: 0,
    };
    for f in fields(b) {
        let (tag, w) = f?;
        t.tags |= 1 << tag.min(31);
        match (tag, w) {
            (1 | 5 | 7 | 11, w) => each_varint(w, |_| ())?,
            (2, w) => t.data_type = Some(int(w)? as i32),
            (4, w) => each_fixed::<4>(w, |_| ())?,
            (10, w) => each_fixed::<8>(w, |_| ())?,
            (6, w) => {
                bytes(w)?;
            }
            (8, w) => t.name = Some(string(w)?),
            (12, w) => {
                string(w)?;
            }
            (9, w) => t.raw_data = Some(bytes(w)?),
            (13 | 16, w) => {
                entry(message(w)?)?;
            }
            (14, w) => t.data_location = Some(int(w)? as i32),
            _ => return None,
        }
    }
    Some(t)
}

impl TensorV<'_> {
    /// The repeated varint field `tag`, if present.
    fn varints<T>(&self, tag: u32, conv: impl Fn(u64) -> T) -> Vec<T> {
        if self.tags & (1 << tag) == 0 {
            return Vec::new();
        }
        varints(self.raw, tag, conv)
    }

    /// The repeated fixed-width field `tag`, if present.
    fn fixeds<const W: usize, T>(&self, tag: u32, conv: impl Fn(u64) -> T) -> Vec<T> {
        if self.tags & (1 << tag) == 0 {
            return Vec::new();
        }
        fixeds::<W, T>(self.raw, tag, conv)
    }
}

impl TensorSrc for TensorV<'_> {
    fn name(&self) -> &str {
        self.name.unwrap_or("")
    }
    fn data_type(&self) -> Option<i32> {
        self.data_type
    }
    fn dims(&self) -> Dims {
        let mut out = Dims::new();
        if self.tags & (1 << 1) != 0 {
            for (_, w) in fields(self.raw).flatten().filter(|&(t, _)| t == 1) {
                let _ = each_varint(w, |v| out.push(v as i64));
            }
        }
        out
    }
    fn data_location(&self) -> Option<i32> {
        self.data_location
    }
    fn external(&self, key: &str) -> Option<String> {
        if self.tags & (1 << 13) == 0 {
            return None;
        }
        fields(self.raw)
            .flatten()
            .filter(|&(t, _)| t == 13)
            .filter_map(|(_, w)| entry(message(w)?))
            .find(|&(k, _)| k == Some(key))
            .and_then(|(_, v)| v.map(str::to_string))
    }
    fn raw_data(&self) -> Option<Bytes> {
        self.raw_data.map(|r| self.src.slice_ref(r))
    }
    fn int64_data(&self) -> Cow<'_, [i64]> {
        Cow::Owned(self.varints(7, |v| v as i64))
    }
    fn int32_data(&self) -> Cow<'_, [i32]> {
        Cow::Owned(self.varints(5, |v| v as i32))
    }
    fn uint64_data(&self) -> Cow<'_, [u64]> {
        Cow::Owned(self.varints(11, |v| v))
    }
    fn float_data(&self) -> Cow<'_, [f32]> {
        Cow::Owned(self.fixeds::<4, _>(4, |v| f32::from_bits(v as u32)))
    }
    fn double_data(&self) -> Cow<'_, [f64]> {
        Cow::Owned(self.fixeds::<8, _>(10, f64::from_bits))
    }
}

/// A `ValueInfoProto` read in place: its name and, when its type is a tensor, the
/// tensor type's element type and shape (a `TensorShapeProto`, checked).
pub(crate) struct InfoV<'a> {
    name: Option<&'a str>,
    tensor: Option<(Option<i32>, Option<&'a [u8]>)>,
    /// The whole message, when it has `metadata_props` (read on demand).
    meta: Option<&'a [u8]>,
}

fn read_info(b: &[u8]) -> Option<InfoV<'_>> {
    let mut info = InfoV {
        name: None,
        tensor: None,
        meta: None,
    };
    let mut ty = None;
    for f in fields(b) {
        match f? {
            (1, w) => info.name = Some(string(w)?),
            (2, w) => once(&mut ty, w)?,
            (3, w) => {
                string(w)?;
            }
            (4, w) => {
                entry(message(w)?)?;
                info.meta = Some(b);
            }
            _ => return None,
        }
    }
    let Some(ty) = ty else {
        return Some(info);
    };
    // TypeProto: only `tensor_type` (a oneof; a second one would replace or merge).
    let mut tensor = None;
    for f in fields(ty) {
        match f? {
            (1, w) => once(&mut tensor, w)?,
            (6, w) => {
                string(w)?;
            }
            _ => return None,
        }
    }
    let Some(tensor) = tensor else {
        return Some(info);
    };
    let (mut elem_type, mut shape) = (None, None);
    for f in fields(tensor) {
        match f? {
            (1, w) => elem_type = Some(int(w)? as i32),
            (2, w) => once(&mut shape, w)?,
            _ => return None,
        }
    }
    for f in fields(shape.unwrap_or(&[])) {
        match f? {
            (1, w) => {
                read_dim(message(w)?)?;
            }
            _ => return None,
        }
    }
    info.tensor = Some((elem_type, shape));
    Some(info)
}

/// A `TensorShapeProto.Dimension`: `dim_value` (`Ok`) or `dim_param` (`Err`),
/// at most one of them.
fn read_dim(b: &[u8]) -> Option<Option<Result<i64, &str>>> {
    let mut value = None;
    for f in fields(b) {
        match f? {
            (1, w) if value.is_none() => value = Some(Ok(int(w)? as i64)),
            (2, w) if value.is_none() => value = Some(Err(string(w)?)),
            (3, w) => {
                string(w)?;
            }
            _ => return None,
        }
    }
    Some(value)
}

impl InfoSrc for InfoV<'_> {
    fn name(&self) -> Option<&str> {
        self.name
    }
    fn metadata(&self, key: &str) -> Option<&str> {
        fields(self.meta?)
            .flatten()
            .filter(|&(t, _)| t == 4)
            .filter_map(|(_, w)| entry(message(w)?))
            .find(|&(k, _)| k.unwrap_or("") == key)
            .map(|(_, v)| v.unwrap_or(""))
    }
    fn unmodelled(&self) -> Option<&'static str> {
        tensor_unmodelled(self.tensor?.0)
    }
    fn decl_type(&self) -> (Option<DType>, Option<Vec<DimDecl>>) {
        let Some((elem_type, shape)) = self.tensor else {
            return (None, None);
        };
        let dims = shape.map(|s| {
            fields(s)
                .flatten()
                .filter_map(|(_, w)| read_dim(message(w)?))
                .map(dim_decl)
                .collect()
        });
        (elem_type.and_then(DType::from_onnx), dims)
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::ir::Model;
    use crate::onnx::load::{from_proto, map_external_data};
    use crate::onnx::{decode_model, load_model, map_file};

    /// Everything the IR holds, in an order that does not depend on hashing.
    fn ir_text(m: &Model) -> String {
        let g = &m.graph;
        let mut by_name: Vec<_> = g.by_name.ids().map(|t| (&g.tensors[t].name, t)).collect();
        by_name.sort();
        let nodes: Vec<_> = g.nodes.node_indices().map(|ix| &g.nodes[ix]).collect();
        let edges: Vec<_> = g
            .nodes
            .edge_indices()
            .map(|e| (g.nodes.edge_endpoints(e), g.nodes[e]))
            .collect();
        format!(
            "{} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {by_name:?}",
            m.ir_version,
            m.opsets,
            m.producer,
            g.name,
            nodes,
            edges,
            g.order,
            g.model_order_is_topological,
            g.tensors,
            g.inputs,
            g.outputs
        )
    }

    fn onnx_files(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                onnx_files(&p, out);
            } else if p.extension().is_some_and(|x| x == "onnx") {
                out.push(p);
            }
        }
    }

    /// Every ONNX file in the repository loads to the same IR (or the same error)
    /// in place as through prost, and the exported models are read in place.
    #[test]
    fn same_ir_as_prost() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut files = Vec::new();
        onnx_files(&root.join("models"), &mut files);
        onnx_files(&root.join("tests/data"), &mut files);
        assert!(files.len() > 20, "{files:?}");
        let mut in_place = 0;
        for p in &files {
            let buf = map_file(p).unwrap();
            let fast = load_model(p)
                .map(|m| ir_text(&m))
                .map_err(|e| e.to_string());
            let slow = decode_model(buf.clone())
                .map_err(|e| e.to_string())
                .and_then(|m| from_proto(m).map_err(|e| e.to_string()))
                .map(|mut m| {
                    map_external_data(p, &mut m);
                    ir_text(&m)
                });
            match (&fast, &slow) {
                (Ok(f), Ok(s)) => assert!(f == s, "{} differs", p.display()),
                (Err(_), Err(_)) => {}
                _ => panic!("{}: {fast:?} vs {slow:?}", p.display()),
            }
            in_place += usize::from(model(&buf).is_some());
        }
        for name in [
            "resnet50",
            "gpt2",
            "bert_base",
            "mobilenet_v2",
            "whisper_mini",
        ] {
            let buf = map_file(&root.join(format!("models/{name}.onnx"))).unwrap();
            assert!(model(&buf).is_some(), "{name} is not read in place");
        }
        assert!(in_place * 2 > files.len(), "{in_place} of {}", files.len());
    }

    #[test]
    fn varints_as_prost_reads_them() {
        let mut pos = 0;
        assert_eq!(varint(&[0x96, 0x01], &mut pos), Some(150));
        assert_eq!(pos, 2);
        // Ten bytes, the last above 1: prost's "invalid varint".
        let mut bad = [0xff; 10];
        bad[9] = 0x02;
        assert_eq!(varint(&bad, &mut 0), None);
        bad[9] = 0x01;
        assert_eq!(varint(&bad, &mut 0), Some(u64::MAX));
        // Cut short.
        assert_eq!(varint(&[0x80], &mut 0), None);
    }

    #[test]
    fn refuses_what_it_does_not_check() {
        // Field 7 (graph) twice: prost merges them, the reader leaves it to prost.
        let graph = [0x12, 0x01, b'g']; // name "g"
        let mut buf = vec![0x08, 0x07]; // ir_version 7
        for _ in 0..2 {
            buf.push(0x3a);
            buf.push(graph.len() as u8);
            buf.extend_from_slice(&graph);
        }
        assert!(model(&Bytes::from(buf.clone())).is_none());
        buf.truncate(2 + 2 + graph.len());
        assert!(model(&Bytes::from(buf.clone())).is_some());
        // An unknown field, a group, and a string that is not UTF-8.
        for extra in [&[0xf8, 0x01, 0x00][..], &[0x0b], &[0x12, 0x01, 0xff]] {
            let mut b = buf.clone();
            b.extend_from_slice(extra);
            assert!(model(&Bytes::from(b)).is_none(), "{extra:?}");
        }
    }
}
