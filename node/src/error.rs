//! The daemon's errors. Each has a kind that becomes the ttrpc status code
//! its callers see ([`Error::code`]); the message says what failed.

use std::io;

/// What went wrong in the node daemon.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request (or the configuration) is malformed; nothing changed.
    #[error("{0}")]
    InvalidArgument(String),
    /// The snapshot or template does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The request is valid but the node's state refuses it (a snapshot in
    /// use, a template that cannot be built, a corrupt template).
    #[error("{0}")]
    FailedPrecondition(String),
    /// A VMM did not come up in time.
    #[error("{0}")]
    Timeout(String),
    /// A VMM or a template build failed.
    #[error("{0}")]
    Internal(String),
    /// A system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The node store refused or failed.
    #[error("node store: {0}")]
    Store(#[from] twig_store::Error),
}

/// The daemon's result.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: io::Error) -> Error {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// The ttrpc status code of this error.
    pub fn code(&self) -> ttrpc::Code {
        use twig_store::Error as S;
        match self {
            Error::InvalidArgument(_) | Error::Store(S::InvalidArgument(_)) => {
                ttrpc::Code::INVALID_ARGUMENT
            }
            Error::NotFound(_) | Error::Store(S::NotFound(_)) => ttrpc::Code::NOT_FOUND,
            Error::FailedPrecondition(_)
            | Error::Store(S::FailedPrecondition(_) | S::AlreadyExists(_) | S::Corrupt { .. }) => {
                ttrpc::Code::FAILED_PRECONDITION
            }
            Error::Store(S::NoSpace { .. }) => ttrpc::Code::RESOURCE_EXHAUSTED,
            Error::Store(S::PermissionDenied(_)) => ttrpc::Code::PERMISSION_DENIED,
            Error::Timeout(_) => ttrpc::Code::DEADLINE_EXCEEDED,
            Error::Internal(_) | Error::Io { .. } | Error::Store(_) => ttrpc::Code::INTERNAL,
        }
    }
}

impl From<Error> for ttrpc::Error {
    fn from(e: Error) -> ttrpc::Error {
        ttrpc::Error::RpcStatus(ttrpc::get_status(e.code(), e.to_string()))
    }
}
