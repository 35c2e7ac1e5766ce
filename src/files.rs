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

/// The temporary file [`write_atomic`] writes beside `path` before renaming it.
fn temp_beside(path: &Path) -> Result<PathBuf> {
    let name = path.file_name().ok_or_else(|| {
        io(
            path,
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "is not a file name"),
        )
    })?;
    let mut tmp = std::ffi::OsString::from(".");
    tmp.push(name);
    tmp.push(format!(".memplan-{}.tmp", std::process::id()));
    Ok(path.with_file_name(tmp))
}

/// Writes `bytes` to `path` all at once: into a temporary file in the same folder,
/// then renamed over `path` (an existing file keeps its permissions). A failure
/// leaves any earlier file as it was and no partial file behind.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let tmp = temp_beside(path)?;
    let write = || -> std::io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        if let Ok(meta) = std::fs::metadata(path) {
            std::fs::set_permissions(&tmp, meta.permissions())?;
        }
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::Write {
            path: path.to_path_buf(),
            source: e,
        }
    })
}

/// Fails now, before any work, where [`write_atomic`] could not write `path` later
/// (a missing folder, no permission): creates and removes its temporary file.
pub fn check_writable(path: &Path) -> Result<()> {
    let tmp = temp_beside(path)?;
    File::create(&tmp)
        .and_then(|_| std::fs::remove_file(&tmp))
        .map_err(|e| Error::Write {
            path: path.to_path_buf(),
            source: e,
        })
}

/// Whether `out` is the same file as one of `inputs` (links resolved; an `out` that
/// does not exist yet is none of them).
pub fn same_file(out: &Path, inputs: &[&Path]) -> Option<PathBuf> {
    let real = std::fs::canonicalize(out).ok()?;
    inputs
        .iter()
        .find(|i| std::fs::canonicalize(i).is_ok_and(|r| r == real))
        .map(|i| i.to_path_buf())
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

    #[test]
    fn atomic_writes_leave_the_old_file_on_failure() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("out.json");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        // A folder that does not exist: an error, nothing written.
        let missing = dir.path().join("no/such/out.json");
        assert!(write_atomic(&missing, b"x").is_err());
        assert!(check_writable(&missing).is_err());
        check_writable(&p).unwrap();
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temporary left"
        );
        assert_eq!(same_file(&p, &[Path::new("x"), &p]), Some(p.clone()));
        assert_eq!(same_file(&dir.path().join("new"), &[&p]), None);
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
