//! kubelet's atomic writer (`pkg/volume/util/atomic_writer.go`): the files
//! of a ConfigMap, Secret, projected or downward API volume live in a
//! timestamped directory `..<UTC time>.<random>`; the symlink `..data`
//! points at it and is replaced by renaming `..data_tmp` over it, so a
//! reader sees either the old set of files or the new one; each top-level
//! name the user sees is a symlink `<name> -> ..data/<name>`. A write that
//! changes nothing leaves the volume alone; the previous timestamped
//! directory is removed after the swap.

use std::collections::{BTreeMap, BTreeSet};
use std::io::ErrorKind;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use k8s_openapi::jiff::Timestamp;

use super::random_u32;

/// The symlink to the current timestamped directory.
pub const DATA_DIR: &str = "..data";
/// The symlink renamed over [`DATA_DIR`].
const NEW_DATA_DIR: &str = "..data_tmp";
const MAX_FILE_NAME: usize = 255;
const MAX_PATH: usize = 4096;

/// One file of a volume: its bytes and mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileProjection {
    /// The file's content.
    pub data: Vec<u8>,
    /// Its permission bits.
    pub mode: u32,
}

/// What a volume holds: relative path → file.
pub type Payload = BTreeMap<String, FileProjection>;

/// Why a volume could not be written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// A path of the payload kubelet would refuse.
    #[error("invalid path {path:?}: {why}")]
    InvalidPath {
        /// The path.
        path: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A file system call failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// On what.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> WriteError {
    let path = path.to_path_buf();
    move |source| WriteError::Io { what, path, source }
}

/// Checks a payload path as kubelet's `validatePath` does: relative, not
/// empty, no `..` element, not starting with `..`, names ≤ 255 bytes, the
/// whole ≤ 4096.
fn validate(path: &str) -> Result<(), WriteError> {
    let invalid = |why| WriteError::InvalidPath {
        path: path.to_string(),
        why,
    };
    if path.is_empty() {
        return Err(invalid("must not be empty"));
    }
    if path.starts_with('/') {
        return Err(invalid("must be a relative path"));
    }
    if path.len() > MAX_PATH {
        return Err(invalid("must be at most 4096 characters"));
    }
    let items: Vec<&str> = path.split('/').collect();
    if items.contains(&"..") {
        return Err(invalid("must not contain '..'"));
    }
    if items.iter().any(|i| i.len() > MAX_FILE_NAME) {
        return Err(invalid("file names must be at most 255 characters"));
    }
    if items[0].starts_with("..") && items[0].len() > 2 {
        return Err(invalid("must not start with '..'"));
    }
    Ok(())
}

/// `path` cleaned as Go's `filepath.Clean` cleans a relative path without
/// `..`: no empty or `.` elements.
fn clean(path: &str) -> String {
    Path::new(path)
        .components()
        .filter_map(|c| match c {
            Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("/")
}

/// Projects payloads into one volume directory.
pub struct AtomicWriter {
    target: PathBuf,
}

impl AtomicWriter {
    /// A writer for the existing directory `target`.
    pub fn new(target: &Path) -> AtomicWriter {
        AtomicWriter {
            target: target.to_path_buf(),
        }
    }

    /// Makes the volume hold exactly `payload`; `Ok(false)` when it did
    /// already and nothing was written.
    pub fn write(&self, payload: &Payload) -> Result<bool, WriteError> {
        let mut clean_payload = Payload::new();
        for (path, file) in payload {
            validate(path)?;
            clean_payload.insert(clean(path), file.clone());
        }
        let data_dir = self.target.join(DATA_DIR);
        let old_ts = match std::fs::read_link(&data_dir) {
            Ok(p) => Some(p),
            Err(e) if e.kind() == ErrorKind::NotFound => None,
            Err(e) => return Err(io("reading the link", &data_dir)(e)),
        };
        let old_ts_path = old_ts.as_ref().map(|p| self.target.join(p));
        let mut remove = BTreeSet::new();
        if let Some(old) = &old_ts_path {
            remove = paths_to_remove(&clean_payload, old)?;
            if remove.is_empty() && !changed(&clean_payload, old)? {
                return Ok(false);
            }
        }
        let ts_dir = self.new_timestamp_dir()?;
        let written = write_payload(&clean_payload, &ts_dir)
            .and_then(|()| self.create_user_visible(&clean_payload));
        if let Err(e) = written {
            let _ = std::fs::remove_dir_all(&ts_dir);
            return Err(e);
        }
        let ts_name = ts_dir
            .file_name()
            .map(PathBuf::from)
            .unwrap_or_else(|| ts_dir.clone());
        let new_data_dir = self.target.join(NEW_DATA_DIR);
        let _ = std::fs::remove_file(&new_data_dir);
        if let Err(e) = std::os::unix::fs::symlink(&ts_name, &new_data_dir) {
            let _ = std::fs::remove_dir_all(&ts_dir);
            return Err(io("creating the symlink", &new_data_dir)(e));
        }
        if let Err(e) = std::fs::rename(&new_data_dir, &data_dir) {
            let _ = std::fs::remove_file(&new_data_dir);
            let _ = std::fs::remove_dir_all(&ts_dir);
            return Err(io("renaming over", &data_dir)(e));
        }
        for p in remove.iter().filter(|p| !p.contains('/')) {
            let path = self.target.join(p);
            std::fs::remove_file(&path).map_err(io("removing the old path", &path))?;
        }
        if let Some(old) = old_ts_path {
            std::fs::remove_dir_all(&old).map_err(io("removing the old data directory", &old))?;
        }
        Ok(true)
    }

    /// A new `..<UTC time>.<random>` directory, mode 0755 whatever the umask.
    fn new_timestamp_dir(&self) -> Result<PathBuf, WriteError> {
        let prefix =
            k8s_openapi::jiff::fmt::strtime::format("..%Y_%m_%d_%H_%M_%S.", Timestamp::now())
                .unwrap_or_else(|_| "..".into());
        loop {
            let dir = self.target.join(format!("{prefix}{}", random_u32()));
            match std::fs::create_dir(&dir) {
                Ok(()) => {
                    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
                        .map_err(io("setting the mode of", &dir))?;
                    return Ok(dir);
                }
                Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io("creating", &dir)(e)),
            }
        }
    }

    /// The symlink `<first element> -> ..data/<first element>` of every
    /// path, where there is none yet.
    fn create_user_visible(&self, payload: &Payload) -> Result<(), WriteError> {
        for path in payload.keys() {
            let first = path.split('/').next().unwrap_or(path);
            let visible = self.target.join(first);
            if std::fs::symlink_metadata(&visible).is_ok() {
                continue;
            }
            std::os::unix::fs::symlink(Path::new(DATA_DIR).join(first), &visible)
                .map_err(io("creating the symlink", &visible))?;
        }
        Ok(())
    }
}

/// Whether any file of `payload` differs from (or is missing in) `old`.
fn changed(payload: &Payload, old: &Path) -> Result<bool, WriteError> {
    for (path, file) in payload {
        let on_disk = old.join(path);
        match std::fs::read(&on_disk) {
            Ok(data) if data == file.data => {}
            Ok(_) => return Ok(true),
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(true),
            Err(e) => return Err(io("reading", &on_disk)(e)),
        }
    }
    Ok(false)
}

/// The paths under `old` (relative) that are neither in `payload` nor a
/// directory of one of its paths.
fn paths_to_remove(payload: &Payload, old: &Path) -> Result<BTreeSet<String>, WriteError> {
    let mut present = BTreeSet::new();
    let mut dirs = vec![old.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(BTreeSet::new()),
            Err(e) => return Err(io("listing", &dir)(e)),
        };
        for entry in entries {
            let entry = entry.map_err(io("listing", &dir))?;
            let path = entry.path();
            if let Ok(rel) = path.strip_prefix(old) {
                present.insert(rel.to_string_lossy().into_owned());
            }
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                dirs.push(path);
            }
        }
    }
    let mut wanted = BTreeSet::new();
    for path in payload.keys() {
        let mut p = path.as_str();
        loop {
            wanted.insert(p.to_string());
            match p.rfind('/') {
                Some(i) => p = &p[..i],
                None => break,
            }
        }
    }
    Ok(present.difference(&wanted).cloned().collect())
}

/// Writes every file of `payload` under `dir` with its mode.
fn write_payload(payload: &Payload, dir: &Path) -> Result<(), WriteError> {
    for (path, file) in payload {
        let full = dir.join(path);
        if let Some(parent) = full.parent() {
            std::fs::create_dir_all(parent).map_err(io("creating", parent))?;
        }
        std::fs::write(&full, &file.data).map_err(io("writing", &full))?;
        std::fs::set_permissions(&full, std::fs::Permissions::from_mode(file.mode))
            .map_err(io("setting the mode of", &full))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(files: &[(&str, &str, u32)]) -> Payload {
        files
            .iter()
            .map(|(p, d, m)| {
                (
                    p.to_string(),
                    FileProjection {
                        data: d.as_bytes().to_vec(),
                        mode: *m,
                    },
                )
            })
            .collect()
    }

    fn names(dir: &Path) -> BTreeSet<String> {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    }

    fn ts_dirs(dir: &Path) -> Vec<String> {
        names(dir)
            .into_iter()
            .filter(|n| n.starts_with("..") && n != DATA_DIR)
            .collect()
    }

    #[test]
    fn a_write_lays_out_data_dir_symlinks_and_modes() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let w = AtomicWriter::new(dir.path());
        let first = payload(&[("a", "1", 0o644), ("sub/b", "2", 0o400)]);
        assert!(w.write(&first).unwrap_or_else(|e| panic!("{e}")));
        assert_eq!(
            names(dir.path()),
            [DATA_DIR, "a", "sub"]
                .into_iter()
                .map(String::from)
                .chain(ts_dirs(dir.path()))
                .collect()
        );
        let ts = ts_dirs(dir.path());
        assert_eq!(ts.len(), 1, "{ts:?}");
        assert!(ts[0].starts_with("..20"), "{ts:?}");
        let link = |p: &str| std::fs::read_link(dir.path().join(p)).unwrap_or_default();
        assert_eq!(link(DATA_DIR), PathBuf::from(&ts[0]));
        assert_eq!(link("a"), PathBuf::from("..data/a"));
        assert_eq!(link("sub"), PathBuf::from("..data/sub"));
        let read = |p: &str| std::fs::read_to_string(dir.path().join(p)).unwrap_or_default();
        assert_eq!((read("a"), read("sub/b")), ("1".into(), "2".into()));
        let mode = |p: &str| {
            std::fs::metadata(dir.path().join(p))
                .map(|m| m.permissions().mode() & 0o7777)
                .unwrap_or_default()
        };
        assert_eq!(
            (mode("a"), mode("sub/b"), mode(&ts[0])),
            (0o644, 0o400, 0o755)
        );
    }

    #[test]
    fn an_update_swaps_the_data_dir_and_removes_the_old_one_and_gone_keys() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let w = AtomicWriter::new(dir.path());
        let ok = |r: Result<bool, WriteError>| r.unwrap_or_else(|e| panic!("{e}"));
        assert!(ok(
            w.write(&payload(&[("a", "1", 0o644), ("b", "x", 0o644)]))
        ));
        let before = ts_dirs(dir.path());
        // The same payload again writes nothing.
        assert!(!ok(
            w.write(&payload(&[("a", "1", 0o644), ("b", "x", 0o644)]))
        ));
        assert_eq!(ts_dirs(dir.path()), before);
        // A changed value and a removed key: a new data dir, the old one gone.
        assert!(ok(w.write(&payload(&[("a", "2", 0o644)]))));
        let after = ts_dirs(dir.path());
        assert_eq!(after.len(), 1);
        assert_ne!(after, before);
        assert_eq!(
            std::fs::read_to_string(dir.path().join("a")).unwrap_or_default(),
            "2"
        );
        assert!(std::fs::symlink_metadata(dir.path().join("b")).is_err());
        assert!(std::fs::symlink_metadata(dir.path().join(NEW_DATA_DIR)).is_err());
    }

    #[test]
    fn paths_kubelet_refuses_are_refused() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let w = AtomicWriter::new(dir.path());
        for bad in ["", "/abs", "a/../b", "..hidden", "../up"] {
            assert!(
                matches!(
                    w.write(&payload(&[(bad, "x", 0o644)])),
                    Err(WriteError::InvalidPath { .. })
                ),
                "{bad:?}"
            );
        }
        assert!(names(dir.path()).is_empty());
        assert_eq!(clean("./a//b/"), "a/b");
    }
}
