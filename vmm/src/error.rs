//! Errors of twig-vmm. Every variant says what failed and why, so an API
//! caller can show it to a person as is.

use std::path::PathBuf;

/// Result alias used across the crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong in the VMM.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot open /dev/kvm: {0} (is KVM available and do you have permission to use it?)")]
    KvmOpen(#[source] kvm_ioctls::Error),
    #[error("/dev/kvm is not a usable KVM device: KVM_GET_API_VERSION returned {0}, expected 12")]
    KvmApi(i32),
    #[error("KVM lacks a required capability: {0}")]
    KvmCapability(&'static str),
    #[error("KVM {op} failed: {source}")]
    Kvm {
        op: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid VM configuration: {0}")]
    Config(String),
    #[error("cannot load kernel {path}: {reason}")]
    Kernel { path: PathBuf, reason: String },
    #[error("snapshot {path}: {reason}")]
    Snapshot { path: PathBuf, reason: String },
    #[error("snapshot {path} was taken on a CPU with features this host lacks: {missing}")]
    CpuIncompatible { path: PathBuf, missing: String },
    #[error("the VM is {state}; {op} needs it {needs}")]
    State {
        op: &'static str,
        state: &'static str,
        needs: &'static str,
    },
    #[error("vCPU {index}: {reason}")]
    Vcpu { index: usize, reason: String },
    #[error("guest address {addr:#x}+{len} is outside guest RAM")]
    GuestAddress { addr: u64, len: usize },
    #[error("template: {0}")]
    NotReady(String),
    #[error("rollback refused, the VM keeps running on its previous state: {0}")]
    Rollback(Box<Error>),
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
}
