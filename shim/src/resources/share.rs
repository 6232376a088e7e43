//! Filesystem volumes — a hostPath directory, a filesystem PersistentVolume
//! (CSI, NFS, local, …) or a subPath of one — shared with the guest over
//! 9P2000.L, decided over virtio-fs and block devices (README, "Filesystem
//! volumes"): per volume of a container, the shim opens a file-share
//! connection to the agent (`CONNECT 1026` on the VM's vsock socket, the
//! share's random id), starts a jailed server on its end
//! ([`crate::share_server`]: the shim binary again, chrooted into the
//! directory as the container's user), and asks the agent to mount it on
//! the guest volume (`PrepareVolume.share`), which the container binds as
//! it binds any guest volume. Reads and writes go to the host directory at
//! once: another pod, a runc container or the node sees them. The server
//! runs in the pod's cgroup, with its VMM.
//!
//! Such a volume lives outside the VM: a snapshot could not rewind it, so
//! Snapshot and Rollback of the pod are refused while a container has one
//! (`crate::twig_service`), as for raw block volumes.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use twig_agent::proto::agent::PrepareVolumeRequest;
use twig_agent::proto::{file_share, FILE_SHARE_VSOCK_PORT};

use crate::error::{Error, Result};
use crate::sandbox::Sandbox;
use crate::share_server::{ServeArgs, SERVE_ARG};

/// The shim's own binary, by the running process's inode: file servers
/// are the shim again, the same build even after an upgrade replaced the
/// file at its path.
const SELF_EXE: &str = "/proc/self/exe";

/// How much of a server's standard error is logged when it ends.
const STDERR_BYTES: u64 = 4096;

/// A host directory shared with the guest as guest volume `name`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    /// The guest volume.
    pub name: String,
    /// The directory, and the identity its server takes.
    pub serve: ServeArgs,
}

/// The container's identity for its shares: the spec's `process.user`
/// (uid, gid, additional gids) and effective capabilities.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    /// Its uid.
    pub uid: u32,
    /// Its gid.
    pub gid: u32,
    /// Its supplementary groups.
    pub groups: Vec<u32>,
    /// Its effective capabilities, by number.
    pub caps: u64,
}

impl Identity {
    /// The identity of OCI spec `spec`'s process.
    pub fn of(spec: &Value) -> Result<Identity> {
        let user = &spec["process"]["user"];
        let id = |v: &Value, what: &str| -> Result<u32> {
            match v {
                Value::Null => Ok(0),
                v => v
                    .as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| Error::InvalidArgument(format!("process.user.{what}: {v}"))),
            }
        };
        let groups = match &user["additionalGids"] {
            Value::Null => Vec::new(),
            Value::Array(a) => a
                .iter()
                .map(|g| id(g, "additionalGids"))
                .collect::<Result<_>>()?,
            v => {
                return Err(Error::InvalidArgument(format!(
                    "process.user.additionalGids: {v}"
                )))
            }
        };
        let caps = spec["process"]["capabilities"]["effective"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .filter_map(cap_number)
            .fold(0u64, |m, n| m | 1 << n);
        Ok(Identity {
            uid: id(&user["uid"], "uid")?,
            gid: id(&user["gid"], "gid")?,
            groups,
            caps,
        })
    }
}

/// The number of a file capability a share server may keep; `None` for
/// any other.
fn cap_number(name: &str) -> Option<u8> {
    match name {
        "CAP_CHOWN" => Some(0),
        "CAP_DAC_OVERRIDE" => Some(1),
        "CAP_FOWNER" => Some(3),
        "CAP_FSETID" => Some(4),
        _ => None,
    }
}

/// A running share server; killed when dropped (the guest unmounting the
/// volume ends it first).
pub struct Server {
    pid: nix::unistd::Pid,
    exited: Arc<AtomicBool>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "share server {}", self.pid)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if !self.exited.load(Ordering::SeqCst) {
            let _ = nix::sys::signal::kill(self.pid, nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// A random share id.
fn new_id() -> Result<String> {
    let mut bytes = [0u8; file_share::ID_LEN / 2];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| Error::io("reading /dev/urandom for a share id", e))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Shares `share` with the guest: the connection, its server, the guest
/// mount (module doc).
pub fn attach(sandbox: &dyn Sandbox, share: &Share, timeout: Duration) -> Result<Server> {
    let id = new_id()?;
    let request = file_share::encode(&id)
        .ok_or_else(|| Error::Internal(format!("share id {id} is malformed")))?;
    let mut stream = sandbox.open_port(FILE_SHARE_VSOCK_PORT, timeout)?;
    stream
        .write_all(&request)
        .map_err(|e| Error::io("sending the file-share request", e))?;
    let dir = share.serve.dir.display().to_string();
    let output = stream
        .try_clone()
        .map_err(|e| Error::io("the file-share connection", e))?;
    let mut child = Command::new(SELF_EXE)
        .arg(SERVE_ARG)
        .args(share.serve.to_args())
        .stdin(Stdio::from(OwnedFd::from(stream)))
        .stdout(Stdio::from(OwnedFd::from(output)))
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::io(format!("starting the file server of {dir}"), e))?;
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let exited = Arc::new(AtomicBool::new(false));
    let server = Server {
        pid,
        exited: exited.clone(),
    };

    let stderr = child.stderr.take();
    let (name, shown) = (share.name.clone(), dir.clone());
    std::thread::Builder::new()
        .name("share-wait".into())
        .spawn(move || {
            let mut said = String::new();
            if let Some(e) = stderr {
                let _ = e.take(STDERR_BYTES).read_to_string(&mut said);
            }
            let status = child.wait();
            exited.store(true, Ordering::SeqCst);
            match status {
                Ok(s) if s.success() => tracing::info!(name, dir = shown, "file server ended"),
                Ok(s) => tracing::warn!(
                    name,
                    dir = shown,
                    "file server ended ({s}): {}",
                    said.trim()
                ),
                Err(e) => tracing::warn!(name, dir = shown, "file server: {e}"),
            }
        })
        .map_err(|e| Error::io("starting the file server's waiter", e))?;
    // The pod pays for its file servers as for its VMM (killed with
    // `server` on a failure).
    sandbox.charge(pid.as_raw().unsigned_abs())?;
    let request = PrepareVolumeRequest {
        name: share.name.clone(),
        share: id,
        read_only: share.serve.read_only,
        ..Default::default()
    };
    sandbox
        .agent()
        .prepare_volume(&request, timeout)
        .map_err(|e| Error::agent(format!("mounting {dir} on guest volume {}", share.name), e))?;
    Ok(server)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_identity_is_the_containers_user_with_its_file_capabilities() {
        let spec = json!({"process": {
            "user": {"uid": 1000, "gid": 3000, "additionalGids": [2000]},
            "capabilities": {"effective": ["CAP_CHOWN", "CAP_SYS_ADMIN", "CAP_FSETID",
                                           "CAP_SYS_CHROOT", "CAP_DAC_READ_SEARCH"]}}});
        let id = Identity::of(&spec).unwrap();
        assert_eq!(
            id,
            Identity {
                uid: 1000,
                gid: 3000,
                groups: vec![2000],
                caps: 1 << 0 | 1 << 4
            }
        );
        assert_eq!(Identity::of(&json!({})).unwrap(), Identity::default());
        let bad = json!({"process": {"user": {"uid": -1}}});
        assert!(Identity::of(&bad).is_err());
    }
}
