//! Errors, by what a caller does about them.

/// What went wrong moving a snapshot to or from a registry.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A reference, credential file or argument is malformed.
    #[error("{0}")]
    Invalid(String),
    /// The registry could not be reached or broke off a transfer: retry.
    #[error("registry unreachable: {0}")]
    Unreachable(String),
    /// The registry refused the credentials, or has none for this node.
    #[error("registry refused access: {0}")]
    Denied(String),
    /// The registry has no such manifest or blob.
    #[error("not in the registry: {0}")]
    NotFound(String),
    /// The registry answered something else than the protocol says.
    #[error("registry error: {0}")]
    Registry(String),
    /// A transfer failed midway (the connection dropped, a body ended early).
    #[error("transfer failed: {0}")]
    Transfer(String),
    /// What arrived is not what was asked for: a digest or size mismatch,
    /// a malformed manifest or blob. Nothing of it is kept.
    #[error("corrupt artifact: {0}")]
    Corrupt(String),
    /// The snapshot belongs to another namespace than the one asking.
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    /// The node store refused (full disk, a missing parent, ...).
    #[error("node store: {0}")]
    Store(#[from] twig_store::Error),
    /// A snapshot's state could not be read or rewritten.
    #[error("snapshot state: {0}")]
    State(String),
    /// The node store's filesystem is full: nothing of the snapshot was kept.
    #[error("no space left: {0}")]
    NoSpace(String),
    /// A local file operation failed.
    #[error("{what}: {source}")]
    Local {
        /// What was being done.
        what: String,
        /// Why it failed.
        source: std::io::Error,
    },
}

impl Error {
    /// A closure turning an I/O error into [`Error::Local`] about `what`.
    pub(crate) fn local(what: &str) -> impl FnOnce(std::io::Error) -> Error + '_ {
        move |source| match source.raw_os_error() {
            Some(libc::ENOSPC | libc::EDQUOT) => Error::NoSpace(format!("{what}: {source}")),
            _ => Error::Local {
                what: what.to_string(),
                source,
            },
        }
    }
}

/// This crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
