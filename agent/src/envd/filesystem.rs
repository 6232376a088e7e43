//! `filesystem.Filesystem`'s unary methods (`Stat`, `ListDir`, `MakeDir`,
//! `Move`, `Remove`), each done inside the main container as the caller's
//! user (`sandbox::in_container`); the watcher methods are `watch.rs`'s.
//! Relative paths (and `~`) are the user's home's.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::time::UNIX_EPOCH;

use serde::Deserialize;
use serde_json::{json, Value};

use super::connect::{decode, Code, RpcError};
use super::sandbox::{in_container, lookup_user, main_container, Names, Target, User};
use super::{Caller, Shared};

/// The most entries one ListDir answers.
const MAX_ENTRIES: usize = 100_000;
/// The deepest ListDir goes.
const MAX_DEPTH: u32 = 64;
/// The longest path a request may name.
pub const MAX_PATH_BYTES: usize = 4096;

/// `path` made absolute against `home` (`~` is `home`) and normalized
/// lexically (the kernel confines `..` to the container's root anyway).
pub fn resolve(path: &str, home: &str) -> Result<PathBuf, RpcError> {
    if path.is_empty() {
        return Err(RpcError::invalid("the path is empty"));
    }
    if path.len() > MAX_PATH_BYTES || path.contains('\0') {
        return Err(RpcError::invalid(format!(
            "the path is over {MAX_PATH_BYTES} bytes or holds a NUL"
        )));
    }
    let joined = if path == "~" {
        PathBuf::from(home)
    } else if let Some(rest) = path.strip_prefix("~/") {
        Path::new(home).join(rest)
    } else {
        Path::new(home).join(path)
    };
    let mut out = PathBuf::from("/");
    for c in joined.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            _ => {}
        }
    }
    Ok(out)
}

/// Go's `FileMode.String()` of a mode: type letters, then `rwxrwxrwx`.
pub fn permissions(mode: u32) -> String {
    let mut s = String::new();
    match mode & libc::S_IFMT {
        libc::S_IFDIR => s.push('d'),
        libc::S_IFLNK => s.push('L'),
        libc::S_IFIFO => s.push('p'),
        libc::S_IFSOCK => s.push('S'),
        libc::S_IFBLK => s.push('D'),
        libc::S_IFCHR => s.push_str("Dc"),
        _ => {}
    }
    for (bit, c) in [
        (libc::S_ISUID, 'u'),
        (libc::S_ISGID, 'g'),
        (libc::S_ISVTX, 't'),
    ] {
        if mode & bit != 0 {
            s.push(c);
        }
    }
    if s.is_empty() {
        s.push('-');
    }
    for (i, c) in "rwxrwxrwx".chars().enumerate() {
        s.push(if mode & (1 << (8 - i)) != 0 { c } else { '-' });
    }
    s
}

/// RFC 3339 (UTC) of a time since the epoch.
pub fn rfc3339(secs: i64, nanos: u32) -> String {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let frac = if nanos == 0 {
        String::new()
    } else {
        format!(".{nanos:09}")
    };
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}{frac}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// The EntryInfo of `path` (not following a final symlink).
pub fn entry_info(path: &Path, names: &Names) -> std::io::Result<Value> {
    let meta = std::fs::symlink_metadata(path)?;
    let ft = meta.file_type();
    let kind = if ft.is_dir() {
        "FILE_TYPE_DIRECTORY"
    } else if ft.is_symlink() {
        "FILE_TYPE_SYMLINK"
    } else if ft.is_file() {
        "FILE_TYPE_FILE"
    } else {
        "FILE_TYPE_UNSPECIFIED"
    };
    let modified = meta.modified().ok().and_then(|t| {
        t.duration_since(UNIX_EPOCH)
            .ok()
            .map(|d| rfc3339(i64::try_from(d.as_secs()).unwrap_or(0), d.subsec_nanos()))
    });
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "/".to_string());
    let mut e = json!({
        "name": name,
        "type": kind,
        "path": path.to_string_lossy(),
        "size": meta.len().to_string(),
        "mode": meta.permissions().mode() & 0o7777,
        "permissions": permissions(meta.mode()),
        "owner": names.user(meta.uid()),
        "group": names.group(meta.gid()),
    });
    if let Some(m) = modified {
        e["modifiedTime"] = json!(m);
    }
    if ft.is_symlink() {
        let target = std::fs::canonicalize(path).or_else(|_| std::fs::read_link(path))?;
        e["symlinkTarget"] = json!(target.to_string_lossy());
    }
    Ok(e)
}

#[derive(Debug, Deserialize)]
struct PathRequest {
    path: String,
}

#[derive(Debug, Deserialize)]
struct ListRequest {
    path: String,
    #[serde(default)]
    depth: u32,
}

#[derive(Debug, Deserialize)]
struct MoveRequest {
    source: String,
    destination: String,
}

/// The caller's user and the main container (the user looked up there).
pub fn caller_context(shared: &Shared, user: Option<&str>) -> Result<(Target, User), RpcError> {
    let target = main_container(&shared.registry)?;
    let name = user
        .map(String::from)
        .or_else(|| shared.settings().default_user);
    let user = in_container(&target, None, || {
        lookup_user(name.as_deref(), &target.process)
    })?;
    Ok((target, user))
}

/// A unary method.
pub fn unary(
    shared: &Shared,
    caller: &Caller,
    method: &str,
    body: &[u8],
) -> Result<Value, RpcError> {
    if matches!(
        method,
        "CreateWatcher" | "GetWatcherEvents" | "RemoveWatcher"
    ) {
        return super::watch::unary(shared, caller, method, body);
    }
    if !matches!(method, "Stat" | "ListDir" | "MakeDir" | "Move" | "Remove") {
        return Err(RpcError::new(
            Code::Unimplemented,
            format!("filesystem.Filesystem/{method}"),
        ));
    }
    let (target, user) = caller_context(shared, caller.user.as_deref())?;
    let home = user.home.clone();
    in_container(&target, Some(&user), || {
        let names = Names::load();
        let io = |what: &Path| {
            let what = what.display().to_string();
            move |e: std::io::Error| RpcError::io(&what, &e)
        };
        match method {
            "Stat" => {
                let req: PathRequest = decode(body)?;
                let path = resolve(&req.path, &home)?;
                let entry = entry_info(&path, &names).map_err(io(&path))?;
                Ok(json!({ "entry": entry }))
            }
            "ListDir" => {
                let req: ListRequest = decode(body)?;
                let path = resolve(&req.path, &home)?;
                let meta = std::fs::metadata(&path).map_err(io(&path))?;
                if !meta.is_dir() {
                    return Err(RpcError::invalid(format!(
                        "{} is not a directory",
                        path.display()
                    )));
                }
                let mut entries = Vec::new();
                list(&path, req.depth.clamp(1, MAX_DEPTH), &names, &mut entries)?;
                Ok(json!({ "entries": entries }))
            }
            "MakeDir" => {
                let req: PathRequest = decode(body)?;
                let path = resolve(&req.path, &home)?;
                if std::fs::symlink_metadata(&path).is_ok() {
                    return Err(RpcError::new(
                        Code::AlreadyExists,
                        format!("{} already exists", path.display()),
                    ));
                }
                std::fs::create_dir_all(&path).map_err(io(&path))?;
                let entry = entry_info(&path, &names).map_err(io(&path))?;
                Ok(json!({ "entry": entry }))
            }
            "Move" => {
                let req: MoveRequest = decode(body)?;
                let from = resolve(&req.source, &home)?;
                let to = resolve(&req.destination, &home)?;
                std::fs::symlink_metadata(&from).map_err(io(&from))?;
                if let Some(parent) = to.parent() {
                    std::fs::create_dir_all(parent).map_err(io(parent))?;
                }
                std::fs::rename(&from, &to).map_err(io(&to))?;
                let entry = entry_info(&to, &names).map_err(io(&to))?;
                Ok(json!({ "entry": entry }))
            }
            _ => {
                let req: PathRequest = decode(body)?;
                let path = resolve(&req.path, &home)?;
                let meta = std::fs::symlink_metadata(&path).map_err(io(&path))?;
                if path == Path::new("/") {
                    return Err(RpcError::invalid("removing / is refused"));
                }
                if meta.is_dir() {
                    std::fs::remove_dir_all(&path).map_err(io(&path))?;
                } else {
                    std::fs::remove_file(&path).map_err(io(&path))?;
                }
                Ok(json!({}))
            }
        }
    })
}

/// Appends the entries under `dir` to `depth` levels (symlinks to
/// directories are not followed).
fn list(dir: &Path, depth: u32, names: &Names, out: &mut Vec<Value>) -> Result<(), RpcError> {
    let rd = std::fs::read_dir(dir).map_err(|e| RpcError::io(dir.display(), &e))?;
    let mut children: Vec<(PathBuf, bool)> = rd
        .filter_map(|e| e.ok())
        .map(|e| (e.path(), e.file_type().is_ok_and(|t| t.is_dir())))
        .collect();
    children.sort();
    for (path, is_dir) in children {
        if out.len() >= MAX_ENTRIES {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!("over {MAX_ENTRIES} entries: list less deep"),
            ));
        }
        match entry_info(&path, names) {
            Ok(e) => out.push(e),
            // Gone since read_dir saw it.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(RpcError::io(path.display(), &e)),
        }
        if is_dir && depth > 1 {
            match list(&path, depth - 1, names, out) {
                Err(e) if e.code == Code::PermissionDenied => {}
                other => other?,
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_against_home_and_stay_absolute() {
        let r = |p: &str| resolve(p, "/home/user").map(|p| p.display().to_string());
        assert_eq!(r("a/b").unwrap(), "/home/user/a/b");
        assert_eq!(r("~").unwrap(), "/home/user");
        assert_eq!(r("~/x").unwrap(), "/home/user/x");
        assert_eq!(r("/etc/../../../x").unwrap(), "/x");
        assert_eq!(r("../../../..").unwrap(), "/");
        assert_eq!(r("/a/./b/").unwrap(), "/a/b");
        assert!(r("").is_err());
        assert!(r("a\0b").is_err());
        assert!(r(&"x".repeat(MAX_PATH_BYTES + 1)).is_err());
    }

    #[test]
    fn modes_and_times_read_as_go_writes_them() {
        assert_eq!(permissions(libc::S_IFDIR | 0o755), "drwxr-xr-x");
        assert_eq!(permissions(libc::S_IFREG | 0o644), "-rw-r--r--");
        assert_eq!(permissions(libc::S_IFLNK | 0o777), "Lrwxrwxrwx");
        assert_eq!(
            permissions(libc::S_IFREG | libc::S_ISUID | 0o755),
            "urwxr-xr-x"
        );
        assert_eq!(rfc3339(0, 0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400, 5), "2000-02-29T00:00:00.000000005Z");
        assert_eq!(rfc3339(1_700_000_000, 0), "2023-11-14T22:13:20Z");
        assert_eq!(rfc3339(-1, 0), "1969-12-31T23:59:59Z");
    }
}
