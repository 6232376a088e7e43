//! The crate's error type.

use std::path::PathBuf;

use crate::policy::PolicyError;

/// A boxed error from aya or the OS, kept as the source of [`Error::Bpf`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong setting up or managing a pod's network path.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The kernel lacks something the path needs; nothing was attached, so the
    /// pod must not start (its network would be unfiltered otherwise).
    #[error("this kernel cannot run twig-net: {0}")]
    Unsupported(String),
    /// The pod's network namespace could not be entered.
    #[error("cannot enter network namespace {path}: {source}")]
    Netns {
        /// The namespace file given by the caller.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An interface named by the caller does not exist in the namespace.
    #[error("no interface {name:?} in network namespace {netns}")]
    NoInterface {
        /// The interface name.
        name: String,
        /// The namespace file.
        netns: PathBuf,
    },
    /// The veth has no Ethernet address to give the guest.
    #[error("interface {0:?} has no Ethernet address")]
    NoMac(String),
    /// The policy was rejected; nothing was changed.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The bpffs directory could not be prepared.
    #[error("bpffs at {path}: {source}")]
    Bpffs {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A pod directory already holds an attached path.
    #[error("a pod network is already pinned at {0} (detach it first)")]
    AlreadyAttached(PathBuf),
    /// A pod directory lacks a pin it should hold.
    #[error("no pod network pinned at {dir} (missing {pin})")]
    NotAttached {
        /// The pod directory.
        dir: PathBuf,
        /// The missing pin.
        pin: &'static str,
    },
    /// A directory given as a prepared set holds none (or only part of one).
    #[error("no prepared program set at {dir} (missing {pin})")]
    NotPrepared {
        /// The directory.
        dir: PathBuf,
        /// The missing pin.
        pin: &'static str,
    },
    /// A flow idle timeout does not fit in `pod_config` (whole milliseconds
    /// in 32 bits); nothing was changed.
    #[error(
        "{protocol} flow idle timeout {timeout:?} is too long (at most {} ms)",
        u32::MAX
    )]
    FlowTimeout {
        /// `tcp`, `udp` or `icmp`.
        protocol: &'static str,
        /// The timeout asked for.
        timeout: std::time::Duration,
    },
    /// A list of UDP reply ports was rejected; nothing was changed.
    #[error("UDP reply ports: {0}")]
    UdpReplyPorts(String),
    /// A BPF operation failed.
    #[error("{what}: {source}")]
    Bpf {
        /// What was being done.
        what: String,
        /// The error from aya or the kernel.
        #[source]
        source: BoxError,
    },
}

/// Adds what was being done to an aya or OS error.
pub(crate) trait Context<T> {
    /// Wraps the error in [`Error::Bpf`] with `what`.
    fn context(self, what: impl FnOnce() -> String) -> Result<T, Error>;
}

impl<T, E: std::error::Error + Send + Sync + 'static> Context<T> for Result<T, E> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T, Error> {
        self.map_err(|e| Error::Bpf {
            what: what(),
            source: Box::new(e),
        })
    }
}
