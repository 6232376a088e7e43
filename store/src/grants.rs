//! Read grants of jailed VMM users on published snapshots: a POSIX ACL
//! entry on a snapshot's directory per user, and a ledger per user
//! (`<store>/grants/<uid>`, root's, `0700` directory) naming the snapshots
//! that user was granted, so taking them back reads one small file instead
//! of walking the store. A grant is written to the ledger before the ACL
//! entry is made, and both happen under the ledger's `flock`, as does a
//! revoke: a ledger never misses an entry its user holds.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{ctx, Error, Result};
use crate::fsops;
use crate::layout::{validate_id, Manifest, GRANTS_DIR, MANIFEST, SNAPSHOTS_DIR};

/// User `uid`'s ledger, created if missing, and locked.
fn ledger(root: &Path, uid: u32) -> Result<File> {
    let dir = root.join(GRANTS_DIR);
    match fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(Error::io(format!("creating {}", dir.display()), e)),
    }
    let path = dir.join(uid.to_string());
    let file = open_locked(&path, true).map_err(ctx(format!("opening {}", path.display())))?;
    Ok(file)
}

/// The ledger at `path`, opened for reading and appending (created if
/// `create`), under its `flock`.
fn open_locked(path: &Path, create: bool) -> std::io::Result<File> {
    let file = File::options()
        .read(true)
        .append(true)
        .create(create)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?;
    fsops::flock(&file)?;
    Ok(file)
}

/// Lets user `uid` read snapshot directory `dir` (published, or being
/// published as `id`), recorded in its ledger `file` first.
fn grant_dir(file: &mut File, dir: &Path, id: &str, uid: u32) -> std::io::Result<()> {
    file.write_all(format!("{id}\n").as_bytes())?;
    fsops::acl_grant(dir, uid, fsops::ACL_READ_SEARCH)
}

/// Lets user `uid` (a jailed VMM's) read the staging directory `dir` of
/// snapshot `id` it wrote, about to be published (see
/// [`crate::Staging::publish`]).
pub(crate) fn grant_writer(root: &Path, dir: &Path, id: &str, uid: u32) -> Result<()> {
    let mut file = ledger(root, uid)?;
    grant_dir(&mut file, dir, id, uid).map_err(ctx(format!(
        "an ACL entry granting {} to its writer",
        dir.display()
    )))
}

/// Lets user `uid` (a jailed VMM's) read the staging directory `dir` of
/// snapshot `id`, written by another (a VM restored while the snapshot's
/// memory arrives): read and search only, so it can neither change nor
/// replace what will be published; the grant moves with the directory
/// when it is published and is taken back as any other.
pub(crate) fn grant_reader(root: &Path, dir: &Path, id: &str, uid: u32) -> Result<()> {
    let mut file = ledger(root, uid)?;
    grant_dir(&mut file, dir, id, uid).map_err(ctx(format!(
        "an ACL entry granting {} to user {uid}",
        dir.display()
    )))
}

/// Lets user `uid` (a jailed VMM's) read published snapshot `id` of the
/// store at `root` and every parent it names (what a restore reads), by
/// an ACL entry on each directory; taken back by [`revoke_grants`].
pub fn grant_chain(root: &Path, id: &str, uid: u32) -> Result<()> {
    let mut file = ledger(root, uid)?;
    let mut next = Some(id.to_string());
    let mut seen = std::collections::HashSet::new();
    while let Some(id) = next.take() {
        validate_id(&id)?;
        if !seen.insert(id.clone()) {
            return Err(Error::InvalidArgument(format!(
                "VM snapshot {id:?} is its own ancestor"
            )));
        }
        let dir = root.join(SNAPSHOTS_DIR).join(&id);
        grant_dir(&mut file, &dir, &id, uid).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                Error::NotFound(format!("VM snapshot {id:?}"))
            } else {
                Error::io(
                    format!("an ACL entry granting {} to user {uid}", dir.display()),
                    e,
                )
            }
        })?;
        let path = dir.join(MANIFEST);
        let bytes = fs::read(&path).map_err(ctx(format!("reading {}", path.display())))?;
        let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| Error::Corrupt {
            path: path.clone(),
            detail: e.to_string(),
        })?;
        next = m.parent;
    }
    Ok(())
}

/// Takes back every grant user `uid` holds on the store at `root` (those
/// of [`grant_chain`] and of a publish to its writer), as its ledger names
/// them, and empties the ledger. Returns how many directories changed.
pub fn revoke_grants(root: &Path, uid: u32) -> Result<usize> {
    let path = root.join(GRANTS_DIR).join(uid.to_string());
    let mut file = match open_locked(&path, false) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(Error::io(format!("opening {}", path.display()), e)),
    };
    let mut text = String::new();
    file.read_to_string(&mut text)
        .map_err(ctx(format!("reading {}", path.display())))?;
    let mut ids: Vec<&str> = text.lines().collect();
    ids.sort_unstable();
    ids.dedup();
    let mut changed = 0;
    for id in ids {
        if validate_id(id).is_err() {
            tracing::warn!(path = %path.display(), id, "skipping a malformed grant");
            continue;
        }
        // A snapshot published under this name by then has this
        // directory: `id` names where the grant was, whatever is there now.
        let dir = root.join(SNAPSHOTS_DIR).join(id);
        changed += usize::from(revoke_on(&dir, |u| u == uid)?);
    }
    file.set_len(0)
        .map_err(ctx(format!("emptying {}", path.display())))?;
    Ok(changed)
}

/// Takes back the grants to users `which` selects from directory `dir`
/// (gone: nothing to take back).
fn revoke_on(dir: &Path, which: impl Fn(u32) -> bool) -> Result<bool> {
    match fsops::acl_revoke(dir, which) {
        Ok(changed) => Ok(changed),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io(
            format!("revoking grants on {}", dir.display()),
            e,
        )),
    }
}

/// Takes back every grant to the users `which` selects from every
/// published snapshot of the store at `root`, and empties their ledgers: a
/// walk of the store, for a daemon's start (when the ledgers of a crashed
/// one may lag a publish). Returns how many directories changed.
pub fn revoke_reads(root: &Path, which: impl Fn(u32) -> bool) -> Result<usize> {
    let mut changed = 0;
    for dir in published_dirs(root)? {
        changed += usize::from(revoke_on(&dir, &which)?);
    }
    let grants = root.join(GRANTS_DIR);
    let entries = match fs::read_dir(&grants) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(changed),
        Err(e) => return Err(Error::io(format!("listing {}", grants.display()), e)),
    };
    for entry in entries {
        let entry = entry.map_err(ctx(format!("listing {}", grants.display())))?;
        let uid = entry.file_name().to_str().and_then(|n| n.parse().ok());
        if uid.is_some_and(&which) {
            fs::remove_file(entry.path())
                .map_err(ctx(format!("removing {}", entry.path().display())))?;
        }
    }
    Ok(changed)
}

/// The directories in `<root>/snapshots` (not following links).
pub(crate) fn published_dirs(root: &Path) -> Result<Vec<PathBuf>> {
    let snapshots = root.join(SNAPSHOTS_DIR);
    let mut dirs = Vec::new();
    for entry in
        fs::read_dir(&snapshots).map_err(ctx(format!("listing {}", snapshots.display())))?
    {
        let entry = entry.map_err(ctx(format!("listing {}", snapshots.display())))?;
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            dirs.push(entry.path());
        }
    }
    Ok(dirs)
}
