//! Errors of twig-vmm. Every variant says what failed and why, so an API
//! caller can show it to a person as is, and [`Error::kind`] says what a
//! caller can do about it ([`ErrorKind`]).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Result alias used across the crate.
pub type Result<T> = std::result::Result<T, Error>;

/// What a caller can do about an error: the `kind` of an API error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Bad JSON, bad arguments or the wrong state for the operation; nothing
    /// changed. Fix the request.
    InvalidRequest,
    /// The operation failed and the VM still runs on its previous state
    /// (e.g. a snapshot or rollback that failed safely). The VM is usable.
    Refused,
    /// The snapshot (or file) named in the request does not exist; nothing
    /// changed.
    NotFound,
    /// The guest (a vCPU, or its readiness probe) did not respond in time.
    GuestNotAnswering,
    /// The guest has shut down or crashed; only rollback, stats and shutdown
    /// still make sense.
    GuestStopped,
    /// The VM can no longer be trusted: replace it (shut this VMM down).
    Lost,
    /// The VMM serves as many connections as it allows; retry later.
    Busy,
    /// The host failed the VMM (KVM, I/O); the VM's state is unknown.
    Internal,
}

/// Everything that can go wrong in the VMM.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `/dev/kvm` cannot be opened.
    #[error("cannot open /dev/kvm: {0} (is KVM available and do you have permission to use it?)")]
    KvmOpen(#[source] kvm_ioctls::Error),
    /// `/dev/kvm` answers with an unexpected API version.
    #[error("/dev/kvm is not a usable KVM device: KVM_GET_API_VERSION returned {0}, expected 12")]
    KvmApi(i32),
    /// KVM lacks a capability the VMM needs.
    #[error("KVM lacks a required capability: {0}")]
    KvmCapability(&'static str),
    /// A KVM ioctl failed.
    #[error("KVM {op} failed: {source}")]
    Kvm {
        /// The ioctl.
        op: &'static str,
        /// KVM's error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// A host I/O operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The host's error.
        #[source]
        source: std::io::Error,
    },
    /// The VM's configuration, or a request's arguments, are invalid.
    #[error("invalid VM configuration: {0}")]
    Config(String),
    /// The kernel image cannot be loaded.
    #[error("cannot load kernel {path}: {reason}")]
    Kernel {
        /// The kernel image.
        path: PathBuf,
        /// Why not.
        reason: String,
    },
    /// A snapshot is unusable (corrupt, truncated, mismatched) or cannot be
    /// written.
    #[error("snapshot {path}: {reason}")]
    Snapshot {
        /// The snapshot directory or file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The snapshot directory a request names does not exist.
    #[error("snapshot {0} does not exist")]
    SnapshotNotFound(PathBuf),
    /// A snapshot needs CPU features this host lacks.
    #[error("snapshot {path} was taken on a CPU with features this host lacks: {missing}")]
    CpuIncompatible {
        /// The snapshot directory.
        path: PathBuf,
        /// The missing features.
        missing: String,
    },
    /// The VM is in the wrong state for an operation.
    #[error("the VM is {state}; {op} needs it {needs}")]
    State {
        /// The operation.
        op: &'static str,
        /// The VM's state.
        state: &'static str,
        /// The state(s) the operation needs.
        needs: &'static str,
    },
    /// A vCPU thread failed or did not respond in time.
    #[error("vCPU {index}: {reason}")]
    Vcpu {
        /// The vCPU.
        index: usize,
        /// What happened.
        reason: String,
    },
    /// A pause timed out: a vCPU (or the device thread) did not stop in
    /// time, its thread busy in a device's host I/O (a guest's flush on a
    /// slow disk, a serial output that does not take bytes). The pause was
    /// withdrawn: everything it had stopped runs again, and the VM keeps
    /// running on its state.
    #[error("{what} did not pause within {waited:?} (busy in host I/O); the pause was withdrawn and the VM keeps running")]
    PauseTimedOut {
        /// What did not stop: "vCPU <i>" or "the device thread".
        what: String,
        /// How long the pause waited.
        waited: std::time::Duration,
    },
    /// A guest physical range outside guest RAM.
    #[error("guest address {addr:#x}+{len} is outside guest RAM")]
    GuestAddress {
        /// Start of the range.
        addr: u64,
        /// Its length.
        len: usize,
    },
    /// A template's guest did not become ready.
    #[error("template: {0}")]
    NotReady(String),
    /// A rollback failed before it changed the VM, or every change was
    /// undone: the VM is on exactly its previous state.
    #[error("rollback refused, the VM keeps running on its previous state: {0}")]
    Rollback(Box<Error>),
    /// A rollback failed after changing the VM, and neither undoing it nor
    /// completing it (rolling forward to the snapshot) worked: the VM is
    /// stopped and its state is unknown. Replace the VM (a later rollback
    /// may also revive it: it restores every part of the snapshot).
    #[error("rollback failed and the VM is lost (stopped; replace it): {0}")]
    VmLost(Box<Error>),
    /// An operation (e.g. a snapshot) failed and the VM keeps running on
    /// its previous state.
    #[error("{op} failed, the VM keeps running on its previous state: {source}")]
    Refused {
        /// The operation.
        op: &'static str,
        /// Why it failed.
        #[source]
        source: Box<Error>,
    },
    /// An attach or detach of a disk slot was refused: no such slot, the
    /// slot busy or empty, or an image that cannot be attached.
    #[error("disk slot {slot}: {reason}")]
    Slot {
        /// The slot.
        slot: usize,
        /// Why.
        reason: String,
    },
    /// Attaching a tap to the network device was refused: the VM has no
    /// network device, it has a tap already, or the descriptor sent is not
    /// a tap opened as the device needs.
    #[error("network device: {0}")]
    Net(String),
    /// The node store refused or failed an operation (staging, publishing).
    #[error("node store: {0}")]
    Store(#[from] twig_store::Error),
}

impl Error {
    /// Wraps an I/O error with a description of what was being done.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io {
            what: what.into(),
            source,
        }
    }

    /// Wraps a KVM ioctl error with the name of the operation.
    pub fn kvm(op: &'static str, source: kvm_ioctls::Error) -> Error {
        Error::Kvm { op, source }
    }

    /// A snapshot-format error about the file or directory at `path`.
    pub fn snapshot(path: impl Into<PathBuf>, reason: impl Into<String>) -> Error {
        Error::Snapshot {
            path: path.into(),
            reason: reason.into(),
        }
    }

    /// What a caller can do about this error. The one place where errors
    /// get their API kind.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Config(_)
            | Error::Kernel { .. }
            | Error::Snapshot { .. }
            | Error::CpuIncompatible { .. }
            | Error::GuestAddress { .. }
            | Error::Slot { .. }
            | Error::Net(_) => ErrorKind::InvalidRequest,
            Error::State { state, .. } if *state == "stopped" => ErrorKind::GuestStopped,
            Error::State { .. } => ErrorKind::InvalidRequest,
            Error::SnapshotNotFound(_) => ErrorKind::NotFound,
            Error::Vcpu { .. } | Error::NotReady(_) => ErrorKind::GuestNotAnswering,
            // A failed rollback left the VM on its previous state; a missing
            // snapshot or a stopped guest says more than "refused".
            Error::Rollback(inner) | Error::Refused { source: inner, .. } => match inner.kind() {
                k @ (ErrorKind::NotFound | ErrorKind::GuestStopped | ErrorKind::Lost) => k,
                _ => ErrorKind::Refused,
            },
            Error::PauseTimedOut { .. } => ErrorKind::Refused,
            Error::VmLost(_) => ErrorKind::Lost,
            Error::Store(e) => match e {
                twig_store::Error::NotFound(_) => ErrorKind::NotFound,
                twig_store::Error::AlreadyExists(_)
                | twig_store::Error::InvalidArgument(_)
                | twig_store::Error::PermissionDenied(_)
                | twig_store::Error::FailedPrecondition(_) => ErrorKind::InvalidRequest,
                twig_store::Error::NoSpace { .. }
                | twig_store::Error::NoReflink { .. }
                | twig_store::Error::Corrupt { .. }
                | twig_store::Error::Tool { .. }
                | twig_store::Error::Io { .. } => ErrorKind::Internal,
                twig_store::Error::Locked(_) => ErrorKind::Busy,
            },
            Error::KvmOpen(_)
            | Error::KvmApi(_)
            | Error::KvmCapability(_)
            | Error::Kvm { .. }
            | Error::Io { .. } => ErrorKind::Internal,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(state: &'static str) -> Error {
        Error::State {
            op: "resume",
            state,
            needs: "paused",
        }
    }

    #[test]
    fn every_error_has_the_kind_a_caller_can_act_on() {
        let io = || Error::io("writing", std::io::Error::other("disk full"));
        let cases = [
            (Error::Config("x".into()), ErrorKind::InvalidRequest),
            (Error::snapshot("/s", "bad crc"), ErrorKind::InvalidRequest),
            (state("created"), ErrorKind::InvalidRequest),
            (state("stopped"), ErrorKind::GuestStopped),
            (Error::SnapshotNotFound("/s".into()), ErrorKind::NotFound),
            (
                Error::Vcpu {
                    index: 0,
                    reason: "did not pause".into(),
                },
                ErrorKind::GuestNotAnswering,
            ),
            (Error::NotReady("x".into()), ErrorKind::GuestNotAnswering),
            (
                Error::PauseTimedOut {
                    what: "vCPU 0".into(),
                    waited: std::time::Duration::from_secs(5),
                },
                ErrorKind::Refused,
            ),
            (
                Error::Rollback(Box::new(Error::PauseTimedOut {
                    what: "vCPU 0".into(),
                    waited: std::time::Duration::from_secs(5),
                })),
                ErrorKind::Refused,
            ),
            (Error::Rollback(Box::new(io())), ErrorKind::Refused),
            (Error::VmLost(Box::new(io())), ErrorKind::Lost),
            (
                Error::Rollback(Box::new(Error::snapshot("/s", "bad crc"))),
                ErrorKind::Refused,
            ),
            (
                Error::Rollback(Box::new(Error::SnapshotNotFound("/s".into()))),
                ErrorKind::NotFound,
            ),
            (
                Error::Rollback(Box::new(state("stopped"))),
                ErrorKind::GuestStopped,
            ),
            (
                Error::Refused {
                    op: "snapshot",
                    source: Box::new(io()),
                },
                ErrorKind::Refused,
            ),
            (io(), ErrorKind::Internal),
            (
                twig_store::Error::NotFound("s".into()).into(),
                ErrorKind::NotFound,
            ),
            (
                twig_store::Error::AlreadyExists("s".into()).into(),
                ErrorKind::InvalidRequest,
            ),
            (Error::KvmApi(11), ErrorKind::Internal),
        ];
        for (e, kind) in cases {
            assert_eq!(e.kind(), kind, "{e}");
        }
    }

    #[test]
    fn kinds_have_stable_wire_names() {
        let names: Vec<String> = [
            ErrorKind::InvalidRequest,
            ErrorKind::Refused,
            ErrorKind::NotFound,
            ErrorKind::GuestNotAnswering,
            ErrorKind::GuestStopped,
            ErrorKind::Lost,
            ErrorKind::Busy,
            ErrorKind::Internal,
        ]
        .iter()
        .map(|k| serde_json::to_string(k).unwrap_or_default())
        .collect();
        assert_eq!(
            names,
            [
                "\"invalid_request\"",
                "\"refused\"",
                "\"not_found\"",
                "\"guest_not_answering\"",
                "\"guest_stopped\"",
                "\"lost\"",
                "\"busy\"",
                "\"internal\"",
            ]
        );
    }
}
