//! The files a user names, read as untrusted input: regular files only (a FIFO
//! would block the open forever, `/dev/zero` never ends), JSON inputs capped in
//! size, and a model's external data only from inside the model's own folder
//! (docs/SECURITY.md).

use std::fs::{File, Metadata};
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The largest JSON input (plan, costs, benchmark DAG) memplan reads: far above any
/// real one (a 200,000-node DAG is about 40 MiB).
pub const MAX_JSON_BYTES: u64 = 1 << 30;

fn io(path: &Path, e: std::io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source: e,
    }
}

/// Opens `path` for reading when it is a regular file (links followed); an error
/// naming what it is otherwise.
pub fn open_regular(path: &Path) -> Result<(File, Metadata)> {
    let meta = std::fs::metadata(path).map_err(|e| io(path, e))?;
    if meta.is_dir() {
        return Err(io(path, std::io::Error::other("is a directory")));
    }
    if !meta.is_file() {
        return Err(io(
            path,
            std::io::Error::other("is not a regular file (a device, FIFO or socket)"),
        ));
    }
    let file = File::open(path).map_err(|e| io(path, e))?;
    Ok((file, meta))
}

/// The bytes of a regular file of at most `cap` bytes (what was there when it was
/// opened: a file that grows meanwhile is cut at `cap + 1` and refused).
pub fn read_capped(path: &Path, cap: u64) -> Result<Vec<u8>> {
    let (file, meta) = open_regular(path)?;
    let too_big = || {
        io(
            path,
            std::io::Error::other(format!(
                "is larger than the {} memplan reads from such a file",
                crate::units::human_bytes(cap)
            )),
        )
    };
    if meta.len() > cap {
        return Err(too_big());
    }
    let mut buf = Vec::with_capacity(meta.len() as usize);
    file.take(cap + 1)
        .read_to_end(&mut buf)
        .map_err(|e| io(path, e))?;
    if buf.len() as u64 > cap {
        return Err(too_big());
    }
    Ok(buf)
}

/// A JSON input as text (at most [`MAX_JSON_BYTES`]).
pub fn read_json_text(path: &Path) -> Result<String> {
    let bytes = read_capped(path, MAX_JSON_BYTES)?;
    String::from_utf8(bytes).map_err(|_| {
        io(
            path,
            std::io::Error::new(std::io::ErrorKind::InvalidData, "is not UTF-8 text"),
        )
    })
}

/// The file an external-data `location` of the model in `dir` names, when it is a
/// regular file whose real path (links resolved) lies inside `dir`'s real path;
/// `None` for anything else (absolute, `..`, a link out of the folder, a device).
pub fn inside_model_dir(dir: &Path, location: &str) -> Option<PathBuf> {
    let plain = Path::new(location)
        .components()
        .all(|c| matches!(c, std::path::Component::Normal(_)));
    if !plain {
        return None;
    }
    let real_dir = std::fs::canonicalize(dir).ok()?;
    let real = std::fs::canonicalize(dir.join(location)).ok()?;
    let regular = std::fs::metadata(&real).is_ok_and(|m| m.is_file());
    (regular && real.starts_with(&real_dir)).then_some(real)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_files_and_oversized_inputs_are_refused() {
        let e = read_capped(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("big.json");
        std::fs::write(&p, vec![b' '; 100]).unwrap();
        assert!(read_capped(&p, 99).is_err());
        assert_eq!(read_capped(&p, 100).unwrap().len(), 100);
    }

    #[cfg(unix)]
    #[test]
    fn external_data_stays_in_the_model_folder() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("w.bin"), [0u8; 8]).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("link")).unwrap();
        std::os::unix::fs::symlink("w.bin", dir.path().join("inner")).unwrap();
        assert!(inside_model_dir(dir.path(), "w.bin").is_some());
        assert!(inside_model_dir(dir.path(), "inner").is_some());
        assert!(inside_model_dir(dir.path(), "link").is_none());
        assert!(inside_model_dir(dir.path(), "../w.bin").is_none());
        assert!(inside_model_dir(dir.path(), "/etc/passwd").is_none());
    }
}
