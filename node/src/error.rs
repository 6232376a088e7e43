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
    /// The caller may not do this (another namespace's snapshot or repository).
    #[error("{0}")]
    PermissionDenied(String),
    /// A push to or pull from a registry failed.
    #[error("{0}")]
    Registry(#[from] twig_oci::Error),
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
        match self {
            Error::InvalidArgument(_) => ttrpc::Code::INVALID_ARGUMENT,
            Error::NotFound(_) => ttrpc::Code::NOT_FOUND,
            Error::FailedPrecondition(_) => ttrpc::Code::FAILED_PRECONDITION,
            Error::Store(s) => store_code(s),
            Error::Timeout(_) => ttrpc::Code::DEADLINE_EXCEEDED,
            Error::PermissionDenied(_) => ttrpc::Code::PERMISSION_DENIED,
            Error::Registry(e) => registry_code(e),
            Error::Internal(_) | Error::Io { .. } => ttrpc::Code::INTERNAL,
        }
    }
}

/// The ttrpc status code of a node store error.
fn store_code(e: &twig_store::Error) -> ttrpc::Code {
    use twig_store::Error as S;
    match e {
        S::InvalidArgument(_) => ttrpc::Code::INVALID_ARGUMENT,
        S::NotFound(_) => ttrpc::Code::NOT_FOUND,
        S::FailedPrecondition(_) | S::AlreadyExists(_) | S::Corrupt { .. } => {
            ttrpc::Code::FAILED_PRECONDITION
        }
        S::NoSpace { .. } => ttrpc::Code::RESOURCE_EXHAUSTED,
        S::PermissionDenied(_) => ttrpc::Code::PERMISSION_DENIED,
        _ => ttrpc::Code::INTERNAL,
    }
}

/// The ttrpc status code of a registry error.
fn registry_code(e: &twig_oci::Error) -> ttrpc::Code {
    use twig_oci::Error as R;
    match e {
        R::Invalid(_) => ttrpc::Code::INVALID_ARGUMENT,
        R::Unreachable(_) | R::Transfer(_) => ttrpc::Code::UNAVAILABLE,
        R::Denied(_) | R::PermissionDenied(_) => ttrpc::Code::PERMISSION_DENIED,
        R::NotFound(_) => ttrpc::Code::NOT_FOUND,
        R::Corrupt(_) => ttrpc::Code::DATA_LOSS,
        R::NoSpace(_) => ttrpc::Code::RESOURCE_EXHAUSTED,
        R::Store(s) => store_code(s),
        R::Registry(_) | R::State(_) | R::Local { .. } => ttrpc::Code::INTERNAL,
    }
}

impl From<Error> for ttrpc::Error {
    fn from(e: Error) -> ttrpc::Error {
        ttrpc::Error::RpcStatus(ttrpc::get_status(e.code(), e.to_string()))
    }
}
