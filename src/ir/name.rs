//! [`Name`]: the IR's immutable string for node, op type, domain, tensor and
//! attribute names.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;

use bytes::Bytes;
use bytestring::ByteString;

/// A name in the IR: an immutable UTF-8 string that derefs to `str`. Names read from
/// a model file are slices of the file's buffer ([`Name::from_utf8_slice`]), so loading
/// allocates nothing per name and cloning one is a reference-count increment; common
/// attribute names are static ([`Name::from_static`]); `Name::from` copies a `&str` or takes a `String`. Compares, orders and hashes as
/// its `str`, so a `HashMap<Name, _>` is looked up with a `&str`.
#[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Name(ByteString);

impl Name {
    /// The empty name (no allocation).
    pub const fn new() -> Name {
        Name(ByteString::new())
    }

    /// The name `s`, a static string (no allocation, no reference count).
    pub const fn from_static(s: &'static str) -> Name {
        Name(ByteString::from_static(s))
    }

    /// The name `s`, sharing `buf`'s storage when `s` lies inside `buf` (no copy),
    /// else a copy of `s`.
    pub fn from_utf8_slice(buf: &Bytes, s: &str) -> Name {
        let (start, p) = (buf.as_ptr() as usize, s.as_ptr() as usize);
        if s.is_empty() {
            Name::new()
        } else if p >= start && p + s.len() <= start + buf.len() {
            // SAFETY: the bytes are exactly those of `s`, a `str`, so they are UTF-8.
            Name(unsafe { ByteString::from_bytes_unchecked(buf.slice_ref(s.as_bytes())) })
        } else {
            Name::from(s)
        }
    }

    /// The name as a `&str`.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Deref for Name {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for Name {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for Name {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self.as_str(), f)
    }
}

impl From<&str> for Name {
    fn from(s: &str) -> Name {
        Name(ByteString::from(s))
    }
}

impl From<String> for Name {
    fn from(s: String) -> Name {
        Name(ByteString::from(s))
    }
}

impl From<&String> for Name {
    fn from(s: &String) -> Name {
        Name::from(s.as_str())
    }
}

impl From<&Name> for Name {
    fn from(s: &Name) -> Name {
        s.clone()
    }
}

impl From<Name> for String {
    fn from(s: Name) -> String {
        s.as_str().to_string()
    }
}

impl PartialEq<str> for Name {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for Name {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<String> for Name {
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<Name> for str {
    fn eq(&self, other: &Name) -> bool {
        self == other.as_str()
    }
}

impl PartialEq<Name> for &str {
    fn eq(&self, other: &Name) -> bool {
        *self == other.as_str()
    }
}

impl PartialEq<Name> for String {
    fn eq(&self, other: &Name) -> bool {
        self == other.as_str()
    }
}

impl serde::Serialize for Name {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn slices_the_buffer_and_compares_as_str() {
        let buf = Bytes::from_static(b"xx/layer1/Conv yy");
        let s = std::str::from_utf8(&buf[2..14]).unwrap();
        let n = Name::from_utf8_slice(&buf, s);
        assert_eq!(n, "/layer1/Conv");
        assert_eq!(n.as_ptr(), s.as_ptr(), "not copied");
        let outside = Name::from_utf8_slice(&buf, "elsewhere");
        assert_eq!(outside, "elsewhere");
        assert_eq!(format!("{n:?} {n}"), "\"/layer1/Conv\" /layer1/Conv");
        let mut m: HashMap<Name, usize, crate::ir::NameHash> = HashMap::default();
        m.insert(n.clone(), 3);
        assert_eq!(m.get("/layer1/Conv"), Some(&3));
        let (a, b) = (Name::from("a"), Name::from("b"));
        assert!(a < b);
        assert_eq!(String::from(n), "/layer1/Conv");
    }
}
