//! The wire types of the API: one [`Request`] per line from the client, one
//! [`Response`] per line back.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind};
use crate::snapshot::Kind;
use crate::vm::{RollbackInfo, RunState, SnapshotInfo, Stats};

/// The protocol version this build speaks. A client refuses a VMM whose
/// [`Hello::protocol`] differs; it changes whenever a request, a reply or an
/// error kind changes incompatibly.
pub const PROTOCOL_VERSION: u32 = 3;

/// Longest request line the server accepts, in bytes.
pub const MAX_REQUEST: usize = 64 * 1024;

/// Longest response line the client accepts, in bytes.
pub const MAX_RESPONSE: usize = 1 << 20;

fn default_mem() -> usize {
    128
}
fn default_vcpus() -> usize {
    1
}
fn default_kind() -> Kind {
    Kind::Full
}

/// A request: a JSON object whose `op` names the operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// The VMM's protocol and build versions ([`Reply::Hello`]).
    Hello {},
    /// Boot a kernel in a new VM ([`Reply::State`]).
    Boot {
        /// ELF vmlinux or bzImage.
        kernel: PathBuf,
        /// An initramfs.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        initrd: Option<PathBuf>,
        /// The kernel command line (the virtio devices are appended).
        #[serde(default)]
        cmdline: String,
        /// Guest RAM, MiB.
        #[serde(default = "default_mem")]
        mem_mib: usize,
        /// vCPUs.
        #[serde(default = "default_vcpus")]
        vcpus: usize,
    },
    /// Restore a snapshot into a new VM and run it ([`Reply::Restored`]).
    Restore {
        /// The snapshot directory.
        dir: PathBuf,
        /// Images for the snapshot's attached disk slots, each the next
        /// file descriptor sent with this request (`SCM_RIGHTS`, in this
        /// order), attached as it is (see [`crate::SlotImage`]): how a
        /// jailed VMM restores a pod snapshot whose containers' disks it
        /// cannot open. Every attached slot of the snapshot needs one
        /// (unless the VMM was started with a `--slot-file` for it).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        slots: Vec<RestoreSlot>,
        /// Restore lazily (`twig_vmm::uffd`): guest memory comes from a
        /// page server, on demand, and the snapshot's memory files are not
        /// read. After the slot images, two more descriptors come with the
        /// request: an open `/dev/userfaultfd`, then a connected Unix
        /// stream socket to the page server.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        lazy: bool,
    },
    /// Park the vCPUs ([`Reply::State`]).
    Pause {},
    /// Run the vCPUs ([`Reply::State`]).
    Resume {},
    /// Snapshot into a node store's staging directory ([`Reply::Snapshot`]);
    /// the store publishes it once this answers.
    Snapshot {
        /// The staging directory (`twig_store::NodeStore::stage`:
        /// `<store>/tmp/<lease>/<id>`, empty, named by the new id).
        dir: PathBuf,
        /// Full, or incremental from the VM's baseline.
        #[serde(default = "default_kind")]
        kind: Kind,
    },
    /// Roll the VM back in place ([`Reply::Rollback`]).
    Rollback {
        /// The snapshot directory.
        dir: PathBuf,
    },
    /// The VM's counters ([`Reply::Stats`]).
    Stats {},
    /// Attach a disk image to a free disk slot of the running VM
    /// ([`Reply::DiskAttached`]).
    AttachDisk {
        /// The slot, `0..` the VMM's `--disk-slots`.
        slot: usize,
        /// A raw image whose size is a multiple of 512 bytes; with `fd`,
        /// only its name (logs, the device id).
        path: PathBuf,
        /// Attach read-only.
        #[serde(default)]
        read_only: bool,
        /// The image is the file descriptor sent with this request
        /// (`SCM_RIGHTS`), opened by the caller: how a jailed VMM, which
        /// cannot open the caller's files, gets its disks.
        /// [`super::Client::attach_disk`] sends one whenever it can open
        /// the file.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        fd: bool,
    },
    /// Empty a disk slot of the VM ([`Reply::DiskDetached`]); the guest
    /// must have stopped using the disk.
    DetachDisk {
        /// The slot.
        slot: usize,
    },
    /// Attach the tap sent with this request (`SCM_RIGHTS`: opened by the
    /// caller with `IFF_TAP|IFF_NO_PI|IFF_VNET_HDR`, e.g. in a pod's network
    /// namespace, where a jailed VMM cannot create one) to the VM's
    /// detached network device ([`Reply::NetAttached`]).
    AttachNet {},
    /// Stop the VM and exit the VMM process ([`Reply::ShutDown`]).
    Shutdown {},
    /// Make a system call no seccomp filter allows ([`Reply::Triggered`]
    /// when the filters are off). Only with the `test-trigger` feature.
    #[cfg(feature = "test-trigger")]
    TestTrigger {},
}

impl Request {
    /// The request's `op`, for messages.
    pub fn op(&self) -> &'static str {
        match self {
            Request::Hello {} => "hello",
            Request::Boot { .. } => "boot",
            Request::Restore { .. } => "restore",
            Request::Pause {} => "pause",
            Request::Resume {} => "resume",
            Request::Snapshot { .. } => "snapshot",
            Request::Rollback { .. } => "rollback",
            Request::Stats {} => "stats",
            Request::AttachDisk { .. } => "attach_disk",
            Request::DetachDisk { .. } => "detach_disk",
            Request::AttachNet {} => "attach_net",
            Request::Shutdown {} => "shutdown",
            #[cfg(feature = "test-trigger")]
            Request::TestTrigger {} => "test_trigger",
        }
    }
}

/// A disk slot's image sent with a [`Request::Restore`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoreSlot {
    /// The slot, `0..` the VMM's `--disk-slots`.
    pub slot: usize,
    /// A name for the image (logs, the device id); never opened.
    pub path: PathBuf,
}

/// The answer to `hello`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hello {
    /// The VMM's [`PROTOCOL_VERSION`].
    pub protocol: u32,
    /// The VMM's build (crate) version.
    pub version: String,
}

/// A successful result, one variant per kind of answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    /// To `hello`.
    Hello(Hello),
    /// To `boot`, `pause` and `resume`: the VM's state afterwards.
    State {
        /// The VM's state.
        state: RunState,
    },
    /// To `restore`: the snapshot the VM now runs from.
    Restored {
        /// The snapshot's id.
        id: String,
    },
    /// To `snapshot`.
    Snapshot(SnapshotInfo),
    /// To `rollback`.
    Rollback(RollbackInfo),
    /// To `stats`.
    Stats(Stats),
    /// To `attach_disk`.
    DiskAttached {
        /// The slot the disk is in.
        slot: usize,
    },
    /// To `detach_disk`.
    DiskDetached {
        /// The slot now empty.
        slot: usize,
    },
    /// To `attach_net`.
    NetAttached {
        /// The name of the tap's interface.
        tap: String,
    },
    /// To `shutdown`: the VM is gone and the process exits.
    ShutDown {},
    /// To `test_trigger` when no filter stopped it: the call's result.
    #[cfg(feature = "test-trigger")]
    Triggered {
        /// What the forbidden system call returned.
        result: i64,
    },
}

/// An error answer: what went wrong and what the caller can do about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiError {
    /// What the caller can do about it.
    pub kind: ErrorKind,
    /// A message for a person.
    pub message: String,
}

impl ApiError {
    /// An error of `kind`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> ApiError {
        ApiError {
            kind,
            message: message.into(),
        }
    }
}

impl From<&Error> for ApiError {
    fn from(e: &Error) -> ApiError {
        ApiError::new(e.kind(), e.to_string())
    }
}

/// One response line: `{"ok":{…}}` or `{"error":{"kind":…,"message":…}}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Response {
    /// The operation succeeded.
    Ok(Reply),
    /// It did not.
    Error(ApiError),
}

impl Response {
    /// The response as one JSON line, without the newline.
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| {
            // Only a non-finite float could fail; answer with the reason.
            format!(
                r#"{{"error":{{"kind":"internal","message":"cannot encode the response: {}"}}}}"#,
                e.to_string().replace(['"', '\\'], "'")
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_reject_unknown_fields() {
        let reqs = [
            Request::Hello {},
            Request::Boot {
                kernel: "/k".into(),
                initrd: None,
                cmdline: "console=ttyS0".into(),
                mem_mib: 64,
                vcpus: 2,
            },
            Request::Snapshot {
                dir: "/s".into(),
                kind: Kind::Incremental,
            },
            Request::AttachDisk {
                slot: 1,
                path: "/d.img".into(),
                read_only: true,
                fd: false,
            },
            Request::AttachDisk {
                slot: 0,
                path: "/e.img".into(),
                read_only: false,
                fd: true,
            },
            Request::DetachDisk { slot: 1 },
            Request::AttachNet {},
            Request::Shutdown {},
        ];
        for r in reqs {
            let line = serde_json::to_string(&r).unwrap_or_default();
            let back: Request = serde_json::from_str(&line).unwrap_or(Request::Hello {});
            assert_eq!(back, r, "{line}");
        }
        let e = serde_json::from_str::<Request>(r#"{"op":"stats","x":1}"#)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("unknown field"), "{e}");
        let r: Request =
            serde_json::from_str(r#"{"op":"boot","kernel":"/k"}"#).unwrap_or(Request::Hello {});
        assert_eq!(
            r,
            Request::Boot {
                kernel: "/k".into(),
                initrd: None,
                cmdline: String::new(),
                mem_mib: 128,
                vcpus: 1
            }
        );
    }

    #[test]
    fn responses_have_the_documented_shape() {
        let ok = Response::Ok(Reply::State {
            state: RunState::Paused,
        });
        assert_eq!(ok.to_line(), r#"{"ok":{"state":{"state":"paused"}}}"#);
        let err = Response::Error(ApiError::new(ErrorKind::NotFound, "no \"s\""));
        let line = err.to_line();
        assert_eq!(
            line,
            r#"{"error":{"kind":"not_found","message":"no \"s\""}}"#
        );
        let back: Response = serde_json::from_str(&line).unwrap_or(ok);
        assert!(matches!(back, Response::Error(e) if e.kind == ErrorKind::NotFound));
    }
}
