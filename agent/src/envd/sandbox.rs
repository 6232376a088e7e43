//! What envd works on: the pod's main container, the user a request runs
//! as, and file operations done inside the container.
//!
//! File operations run on a short-lived thread that leaves the agent's
//! file-system context (`unshare(CLONE_FS)`), joins the container's mount
//! namespace, `chroot`s to its init's root (`/proc/<init>/root`, opened
//! before: right after a pivot_root or a move-and-chroot alike) and takes
//! the user's file-system credentials (`setfsuid`/`setfsgid` and the
//! groups, all per thread). Paths then resolve exactly as they do for the
//! container's own processes: its mounts and volumes, symlinks confined to
//! its root by the kernel, permission checks and the owner of what is
//! created those of the user (a non-root fsuid drops the file-system
//! capabilities). Nothing else of the agent changes, and the thread ends
//! with the operation.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::os::fd::AsFd;

use base64::Engine;
use nix::sched::{setns, unshare, CloneFlags};
use serde_json::Value;

use super::connect::{Code, RpcError};
use crate::container::{Registry, State};
use crate::reaper::lock;

/// The most of `/etc/passwd` or `/etc/group` read.
const MAX_DB_BYTES: u64 = 4 << 20;

/// The container envd runs commands in and works on files of.
#[derive(Debug, Clone)]
pub struct Target {
    /// Its id.
    pub container_id: String,
    /// Its init's pid (in the agent's pid namespace).
    pub init_pid: i32,
    /// Its spec's `process`, the base of every command.
    pub process: Value,
}

/// The pod's main container: the first started app container (not a
/// pause) whose init still runs. A VM holds one pod, so every app
/// container is the pod's; ids are not compared with the sandbox's (a
/// restored pod keeps the guest ids of its snapshot while CRI gives its
/// new containers the new sandbox's).
pub fn main_container(registry: &Registry) -> Result<Target, RpcError> {
    let mut best: Option<(u64, Target)> = None;
    for c in registry.all() {
        let c = lock(&c);
        let State::Started(init) = &c.state else {
            continue;
        };
        if c.pause || init.exited().is_some() {
            continue;
        }
        if best.as_ref().is_some_and(|(o, _)| *o < c.start_order) {
            continue;
        }
        let process = c
            .spec
            .process()
            .as_ref()
            .and_then(|p| serde_json::to_value(p).ok())
            .unwrap_or(Value::Null);
        best = Some((
            c.start_order,
            Target {
                container_id: c.id.clone(),
                init_pid: init.pid,
                process,
            },
        ));
    }
    best.map(|(_, t)| t).ok_or_else(|| {
        RpcError::new(
            Code::FailedPrecondition,
            "the pod has no running container to run commands or work on files in",
        )
    })
}

/// A user of the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// Its name (or its uid, without a passwd entry).
    pub name: String,
    /// Its uid.
    pub uid: u32,
    /// Its primary gid.
    pub gid: u32,
    /// Its supplementary gids.
    pub groups: Vec<u32>,
    /// Its home directory.
    pub home: String,
}

/// The user named by `Authorization: Basic base64("<user>:")`, if any.
pub fn user_from_auth(header: Option<&str>) -> Result<Option<String>, RpcError> {
    let Some(h) = header else { return Ok(None) };
    let Some(b64) = h
        .strip_prefix("Basic ")
        .or_else(|| h.strip_prefix("basic "))
    else {
        return Err(RpcError::new(
            Code::Unauthenticated,
            "the Authorization header is not Basic",
        ));
    };
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|e| RpcError::new(Code::Unauthenticated, format!("Authorization: {e}")))?;
    let text = String::from_utf8(raw)
        .map_err(|_| RpcError::new(Code::Unauthenticated, "Authorization is not UTF-8"))?;
    let name = text.split(':').next().unwrap_or("");
    Ok((!name.is_empty()).then(|| name.to_string()))
}

/// One `/etc/passwd` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PasswdEntry {
    name: String,
    uid: u32,
    gid: u32,
    home: String,
}

/// The entries of an `/etc/passwd`; malformed lines are skipped.
pub fn parse_passwd(text: &str) -> Vec<PasswdEntry> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            Some(PasswdEntry {
                name: f.first().filter(|n| !n.is_empty())?.to_string(),
                uid: f.get(2)?.parse().ok()?,
                gid: f.get(3)?.parse().ok()?,
                home: f.get(5)?.to_string(),
            })
        })
        .collect()
}

/// `/etc/group`: (name, gid, members).
pub fn parse_group(text: &str) -> Vec<(String, u32, Vec<String>)> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            let members = f
                .get(3)
                .map(|m| {
                    m.split(',')
                        .filter(|s| !s.is_empty())
                        .map(String::from)
                        .collect()
                })
                .unwrap_or_default();
            Some((f.first()?.to_string(), f.get(2)?.parse().ok()?, members))
        })
        .collect()
}

/// Reads at most [`MAX_DB_BYTES`] of a text file; missing is empty.
pub fn read_db(path: &str) -> String {
    let mut s = String::new();
    if let Ok(f) = File::open(path) {
        let _ = f.take(MAX_DB_BYTES).read_to_string(&mut s);
    }
    s
}

/// uid → name and gid → name of the container (for owners of entries).
#[derive(Debug, Default)]
pub struct Names {
    users: HashMap<u32, String>,
    groups: HashMap<u32, String>,
}

impl Names {
    /// Reads the container's databases (call inside the container).
    pub fn load() -> Names {
        Names {
            users: parse_passwd(&read_db("/etc/passwd"))
                .into_iter()
                .map(|e| (e.uid, e.name))
                .collect(),
            groups: parse_group(&read_db("/etc/group"))
                .into_iter()
                .map(|(n, g, _)| (g, n))
                .collect(),
        }
    }

    /// The name of uid `id` (its number without one).
    pub fn user(&self, id: u32) -> String {
        self.users
            .get(&id)
            .cloned()
            .unwrap_or_else(|| id.to_string())
    }

    /// The name of gid `id` (its number without one).
    pub fn group(&self, id: u32) -> String {
        self.groups
            .get(&id)
            .cloned()
            .unwrap_or_else(|| id.to_string())
    }
}

/// The user `name` of the container ("root" is uid 0 with or without an
/// entry), or, without a name, the container's own user. Call inside the
/// container.
pub fn lookup_user(name: Option<&str>, process: &Value) -> Result<User, RpcError> {
    let passwd = parse_passwd(&read_db("/etc/passwd"));
    let groups = parse_group(&read_db("/etc/group"));
    let cwd = process
        .get("cwd")
        .and_then(Value::as_str)
        .unwrap_or("/")
        .to_string();
    let asked = name;
    let (entry, uid, gid) = match name {
        Some(n) => match passwd.iter().find(|e| e.name == n) {
            Some(e) => (Some(e.clone()), e.uid, e.gid),
            None if n == "root" => (None, 0, 0),
            None => {
                return Err(RpcError::new(
                    Code::Unauthenticated,
                    format!("no user {n:?} in the container's /etc/passwd"),
                ))
            }
        },
        None => {
            let uid = json_u32(process.pointer("/user/uid"));
            let gid = json_u32(process.pointer("/user/gid"));
            (passwd.iter().find(|e| e.uid == uid).cloned(), uid, gid)
        }
    };
    let name = match (&entry, name) {
        (Some(e), _) => e.name.clone(),
        (None, Some(n)) => n.to_string(),
        (None, None) => uid.to_string(),
    };
    let home = match &entry {
        Some(e) if !e.home.is_empty() => e.home.clone(),
        _ if uid == 0 => "/root".to_string(),
        _ => cwd,
    };
    let supplementary: Vec<u32> = match (&entry, asked) {
        (Some(_), _) => groups
            .iter()
            .filter(|(_, g, members)| *g != gid && members.contains(&name))
            .map(|(_, g, _)| *g)
            .collect(),
        (None, None) => process
            .pointer("/user/additionalGids")
            .and_then(Value::as_array)
            .map(|gids| gids.iter().map(|g| json_u32(Some(g))).collect())
            .unwrap_or_default(),
        (None, Some(_)) => Vec::new(),
    };
    Ok(User {
        name,
        uid,
        gid,
        groups: supplementary,
        home,
    })
}

fn json_u32(v: Option<&Value>) -> u32 {
    v.and_then(Value::as_u64)
        .and_then(|n| u32::try_from(n).ok())
        .unwrap_or(0)
}

/// Runs `f` inside container `target` (its mount namespace and root),
/// with `user`'s file-system credentials if given.
pub fn in_container<R: Send>(
    target: &Target,
    user: Option<&User>,
    f: impl FnOnce() -> Result<R, RpcError> + Send,
) -> Result<R, RpcError> {
    let pid = target.init_pid;
    let root = File::open(format!("/proc/{pid}/root"))
        .map_err(|e| RpcError::io(format!("the container's root (pid {pid})"), &e))?;
    let mnt = File::open(format!("/proc/{pid}/ns/mnt"))
        .map_err(|e| RpcError::io(format!("the container's mount namespace (pid {pid})"), &e))?;
    std::thread::scope(|s| {
        let worker = std::thread::Builder::new()
            .name("envd-fs".into())
            .spawn_scoped(s, || {
                enter(&root, &mnt, user)?;
                f()
            })
            .map_err(|e| RpcError::internal(format!("starting a file thread: {e}")))?;
        worker
            .join()
            .unwrap_or_else(|_| Err(RpcError::internal("a file thread panicked")))
    })
}

fn enter(root: &File, mnt: &File, user: Option<&User>) -> Result<(), RpcError> {
    let sys = |what: &str, e: nix::errno::Errno| RpcError::internal(format!("{what}: {e}"));
    unshare(CloneFlags::CLONE_FS).map_err(|e| sys("unshare(CLONE_FS)", e))?;
    setns(mnt.as_fd(), CloneFlags::CLONE_NEWNS)
        .map_err(|e| sys("joining the mount namespace", e))?;
    nix::unistd::fchdir(root.as_fd()).map_err(|e| sys("fchdir to the root", e))?;
    nix::unistd::chroot(".").map_err(|e| sys("chroot", e))?;
    nix::unistd::chdir("/").map_err(|e| sys("chdir /", e))?;
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o022));
    if let Some(u) = user {
        let groups: Vec<libc::gid_t> = u.groups.clone();
        // SAFETY: setgroups(2) reads `groups.len()` gids from a live
        // vector. The raw call changes this thread only (glibc's wrapper
        // would change every thread of the agent).
        let rc = unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) };
        if rc != 0 {
            return Err(RpcError::internal(format!(
                "setgroups: {}",
                std::io::Error::last_os_error()
            )));
        }
        // setfsgid/setfsuid change this thread's credentials only.
        nix::unistd::setfsgid(nix::unistd::Gid::from_raw(u.gid));
        nix::unistd::setfsuid(nix::unistd::Uid::from_raw(u.uid));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn basic_auth_names_the_user() {
        assert_eq!(user_from_auth(None).unwrap(), None);
        assert_eq!(
            user_from_auth(Some("Basic dXNlcjo=")).unwrap().as_deref(),
            Some("user")
        );
        assert_eq!(user_from_auth(Some("Basic Og==")).unwrap(), None);
        for bad in ["Bearer x", "Basic !!!", "Basic //79"] {
            assert_eq!(
                user_from_auth(Some(bad)).unwrap_err().code,
                Code::Unauthenticated,
                "{bad}"
            );
        }
    }

    #[test]
    fn passwd_and_group_parsing_skip_garbage() {
        let p = parse_passwd("root:x:0:0:root:/root:/bin/sh\nbad\nu:x:nan:1::/h:\nuser:x:1000:100::/home/user:/bin/sh\n");
        assert_eq!(p.len(), 2);
        assert_eq!(
            (p[1].uid, p[1].gid, p[1].home.as_str()),
            (1000, 100, "/home/user")
        );
        let g = parse_group("wheel:x:10:user,other\nx\nusers:x:100:\n");
        assert_eq!(g.len(), 2);
        assert_eq!(g[0].2, vec!["user".to_string(), "other".to_string()]);
        let names = Names {
            users: [(0, "root".into())].into(),
            groups: HashMap::new(),
        };
        assert_eq!(
            (names.user(0), names.user(7), names.group(3)),
            ("root".into(), "7".into(), "3".into())
        );
        assert_eq!(json_u32(Some(&json!(-1))), 0);
    }
}
