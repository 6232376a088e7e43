//! A small port of the ideas of containerd's `fstest`: appliers that change a
//! directory tree, and a comparison of two trees (types, modes, owners,
//! contents, symlink targets, hard-link grouping).

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

#[derive(Debug, Clone)]
pub enum Op {
    File(&'static str, &'static [u8], u32),
    Dir(&'static str, u32),
    RemoveAll(&'static str),
    Chown(&'static str, u32, u32),
    Link(&'static str, &'static str),
    Symlink(&'static str, &'static str),
    Rename(&'static str, &'static str),
}

fn at(root: &Path, p: &str) -> std::path::PathBuf {
    root.join(p.trim_start_matches('/'))
}

/// Applies `ops` under `root`, setting exact modes regardless of the umask.
pub fn apply(root: &Path, ops: &[Op]) {
    for op in ops {
        match op {
            Op::File(p, data, mode) => {
                let path = at(root, p);
                fs::write(&path, data).unwrap_or_else(|e| panic!("{op:?}: {e}"));
                fs::set_permissions(&path, fs::Permissions::from_mode(*mode)).unwrap();
            }
            Op::Dir(p, mode) => {
                let path = at(root, p);
                fs::create_dir(&path).unwrap_or_else(|e| panic!("{op:?}: {e}"));
                fs::set_permissions(&path, fs::Permissions::from_mode(*mode)).unwrap();
            }
            Op::RemoveAll(p) => {
                let path = at(root, p);
                if path.is_dir() {
                    fs::remove_dir_all(&path).unwrap_or_else(|e| panic!("{op:?}: {e}"));
                } else {
                    fs::remove_file(&path).unwrap_or_else(|e| panic!("{op:?}: {e}"));
                }
            }
            Op::Chown(p, uid, gid) => {
                std::os::unix::fs::lchown(at(root, p), Some(*uid), Some(*gid))
                    .unwrap_or_else(|e| panic!("{op:?}: {e}"));
            }
            Op::Link(old, new) => fs::hard_link(at(root, old), at(root, new))
                .unwrap_or_else(|e| panic!("{op:?}: {e}")),
            Op::Symlink(target, link) => std::os::unix::fs::symlink(target, at(root, link))
                .unwrap_or_else(|e| panic!("{op:?}: {e}")),
            Op::Rename(old, new) => {
                fs::rename(at(root, old), at(root, new)).unwrap_or_else(|e| panic!("{op:?}: {e}"))
            }
        }
    }
}

/// What is compared about one path.
#[derive(Debug, PartialEq, Eq)]
pub struct Entry {
    pub kind: &'static str,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub content: Vec<u8>,
    /// For hard links: the first path (by sort order) with the same inode.
    pub link_of: Option<String>,
}

/// Walks `root` (excluding it) into path → entry.
pub fn snapshot_tree(root: &Path) -> BTreeMap<String, Entry> {
    let mut raw = Vec::new();
    walk(root, root, &mut raw);
    raw.sort_by(|a, b| a.0.cmp(&b.0));
    let mut first_of_inode: BTreeMap<u64, String> = BTreeMap::new();
    let mut out = BTreeMap::new();
    for (rel, meta, content) in raw {
        let kind = if meta.file_type().is_dir() {
            "dir"
        } else if meta.file_type().is_symlink() {
            "symlink"
        } else if meta.file_type().is_file() {
            "file"
        } else {
            "other"
        };
        let link_of = if kind == "file" {
            let first = first_of_inode
                .entry(meta.ino())
                .or_insert_with(|| rel.clone());
            (*first != rel).then(|| first.clone())
        } else {
            None
        };
        out.insert(
            rel,
            Entry {
                kind,
                mode: meta.mode() & 0o7777,
                uid: meta.uid(),
                gid: meta.gid(),
                content,
                link_of,
            },
        );
    }
    out
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, fs::Metadata, Vec<u8>)>) {
    for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display())) {
        let entry = entry.unwrap();
        let path = entry.path();
        let meta = fs::symlink_metadata(&path).unwrap();
        let rel = path
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let content = if meta.file_type().is_file() {
            fs::read(&path).unwrap()
        } else if meta.file_type().is_symlink() {
            fs::read_link(&path)
                .unwrap()
                .to_string_lossy()
                .into_owned()
                .into_bytes()
        } else {
            Vec::new()
        };
        let is_dir = meta.is_dir();
        out.push((rel, meta, content));
        if is_dir {
            walk(root, &path, out);
        }
    }
}

/// Asserts that `actual` holds the tree that `layers` applied in order to an
/// empty directory produce.
pub fn assert_tree_equals(actual: &Path, layers: &[&[Op]]) {
    let expected_dir = tempfile::tempdir().expect("temp dir");
    for ops in layers {
        apply(expected_dir.path(), ops);
    }
    assert_same_tree(expected_dir.path(), actual);
}

/// Asserts that two trees are equal (below their roots).
pub fn assert_same_tree(expected: &Path, actual: &Path) {
    let want = snapshot_tree(expected);
    let got = snapshot_tree(actual);
    if want != got {
        let keys: std::collections::BTreeSet<&String> = want.keys().chain(got.keys()).collect();
        let mut diff = String::new();
        for k in keys {
            if want.get(k) != got.get(k) {
                diff += &format!(
                    "  {k}: want {:?}\n       got  {:?}\n",
                    want.get(k),
                    got.get(k)
                );
            }
        }
        panic!(
            "{} differs from the expected tree:\n{diff}",
            actual.display()
        );
    }
}
