//! Errors of Twig's stores: the node store here and twig-snapshotter's
//! image store, which shares them. Each names one class a caller acts on
//! (the node daemon, the shim and the snapshotter map them to ttrpc/gRPC
//! codes).

use std::io;
use std::path::PathBuf;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the node store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No snapshot (or artefact) by that id.
    #[error("{0} not found")]
    NotFound(String),
    /// The id is taken.
    #[error("{0} already exists")]
    AlreadyExists(String),
    /// The request is well-formed but the store's state forbids it.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The request itself is invalid.
    #[error("{0}")]
    InvalidArgument(String),
    /// The caller may not use that snapshot (another tenant's).
    #[error("{0}")]
    PermissionDenied(String),
    /// The filesystem under the store is full; nothing was changed.
    #[error("{context}: no space left on the store's filesystem")]
    NoSpace {
        /// What was being done.
        context: String,
    },
    /// The store's filesystem cannot reflink and the copy fallback is off.
    #[error(
        "{root} does not support reflinks (FICLONE failed: {source}); put the store on a \
         reflink-capable filesystem (XFS made with `mkfs.xfs -m reflink=1`, or btrfs), or \
         start with --allow-copy to copy images in full (slow, no shared blocks)"
    )]
    NoReflink {
        /// The store's root.
        root: PathBuf,
        /// Why FICLONE failed.
        source: io::Error,
    },
    /// Another process holds the store.
    #[error("store {0} is locked by another process")]
    Locked(PathBuf),
    /// An external tool (mkfs.ext4, debugfs) failed.
    #[error("{context}: {detail}")]
    Tool {
        /// What was being done.
        context: String,
        /// What the tool said.
        detail: String,
    },
    /// A manifest or metadata file could not be parsed.
    #[error("corrupt metadata in {path}: {detail}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
    /// Any other I/O failure.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        source: io::Error,
    },
}

impl Error {
    /// Wraps an I/O error with context; ENOSPC/EDQUOT become [`Error::NoSpace`].
    pub fn io(context: impl Into<String>, source: io::Error) -> Error {
        let context = context.into();
        match source.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => Error::NoSpace { context },
            _ => Error::Io { context, source },
        }
    }
}

/// `.map_err(ctx("doing x"))` shorthand for [`Error::io`].
pub fn ctx<S: Into<String>>(context: S) -> impl FnOnce(io::Error) -> Error {
    move |e| Error::io(context, e)
}
