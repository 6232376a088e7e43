//! The shim's errors and their mapping onto containerd's errdefs codes.
//!
//! containerd turns the ttrpc status code of a failed call into its errdefs
//! error (`NotFound`, `AlreadyExists`, `FailedPrecondition`,
//! `InvalidArgument`, `NotImplemented`, …), and CRI and `ctr` act on it
//! (a `NotFound` on delete is success for CRI, for instance). So every
//! error says which of those it is.

use containerd_shim_protos::ttrpc;
use twig_agent::client::Error as AgentError;
use twig_vmm::api::ClientError;

/// Why a shim operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No such container, process or file.
    #[error("{0}")]
    NotFound(String),
    /// The container or exec id is taken.
    #[error("{0}")]
    AlreadyExists(String),
    /// The object is in the wrong state for the call.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The request itself is wrong.
    #[error("{0}")]
    InvalidArgument(String),
    /// The shim does not do this (yet).
    #[error("{0}")]
    Unimplemented(String),
    /// twig-agent refused or failed a call.
    #[error("{what}: twig-agent: {source}")]
    Agent {
        /// What the shim was doing.
        what: String,
        /// The agent client's error.
        #[source]
        source: AgentError,
    },
    /// twig-vmm refused or failed a call.
    #[error("{what}: {source}")]
    Vmm {
        /// What the shim was doing.
        what: String,
        /// The VMM client's error.
        #[source]
        source: ClientError,
    },
    /// The node store refused or failed an operation.
    #[error("{what}: {source}")]
    Store {
        /// What the shim was doing.
        what: String,
        /// The store's error.
        #[source]
        source: twig_store::Error,
    },
    /// twig-net refused or failed to set up or tear down a pod's network
    /// path.
    #[error("{what}: {source}")]
    Network {
        /// What the shim was doing.
        what: String,
        /// twig-net's error.
        #[source]
        source: twig_net::Error,
    },
    /// The call's deadline passed before it could run.
    #[error("{0}")]
    Deadline(String),
    /// A host I/O operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What the shim was doing.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Anything else.
    #[error("{0}")]
    Internal(String),
}

/// Result of shim operations.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An [`Error::Io`] with its context.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io {
            what: what.into(),
            source,
        }
    }

    /// An [`Error::Agent`] with its context.
    pub fn agent(what: impl Into<String>, source: AgentError) -> Error {
        Error::Agent {
            what: what.into(),
            source,
        }
    }

    /// Whether twig-vmm said the VM is gone (`lost`): it is stopped and
    /// cannot be trusted; the pod's processes no longer run.
    pub fn is_vm_lost(&self) -> bool {
        self.vmm_kind() == Some(twig_vmm::ErrorKind::Lost)
    }

    /// The kind of a twig-vmm error answer.
    pub fn vmm_kind(&self) -> Option<twig_vmm::ErrorKind> {
        match self {
            Error::Vmm { source, .. } => source.kind(),
            _ => None,
        }
    }

    /// The ttrpc (gRPC) code containerd's errdefs map this error to.
    pub fn code(&self) -> ttrpc::Code {
        match self {
            Error::NotFound(_) => ttrpc::Code::NOT_FOUND,
            Error::AlreadyExists(_) => ttrpc::Code::ALREADY_EXISTS,
            Error::FailedPrecondition(_) => ttrpc::Code::FAILED_PRECONDITION,
            Error::InvalidArgument(_) => ttrpc::Code::INVALID_ARGUMENT,
            Error::Unimplemented(_) => ttrpc::Code::UNIMPLEMENTED,
            Error::Agent { source, .. } => agent_code(source),
            Error::Vmm { source, .. } => match source.kind() {
                Some(twig_vmm::ErrorKind::InvalidRequest) => ttrpc::Code::FAILED_PRECONDITION,
                Some(twig_vmm::ErrorKind::NotFound) => ttrpc::Code::NOT_FOUND,
                Some(twig_vmm::ErrorKind::Busy) => ttrpc::Code::UNAVAILABLE,
                _ => ttrpc::Code::INTERNAL,
            },
            Error::Store { source, .. } => match source {
                twig_store::Error::NotFound(_) => ttrpc::Code::NOT_FOUND,
                twig_store::Error::AlreadyExists(_) => ttrpc::Code::ALREADY_EXISTS,
                twig_store::Error::FailedPrecondition(_) | twig_store::Error::NoReflink { .. } => {
                    ttrpc::Code::FAILED_PRECONDITION
                }
                twig_store::Error::InvalidArgument(_) => ttrpc::Code::INVALID_ARGUMENT,
                twig_store::Error::PermissionDenied(_) => ttrpc::Code::PERMISSION_DENIED,
                twig_store::Error::NoSpace { .. } => ttrpc::Code::RESOURCE_EXHAUSTED,
                twig_store::Error::Locked(_) => ttrpc::Code::UNAVAILABLE,
                twig_store::Error::Corrupt { .. }
                | twig_store::Error::Tool { .. }
                | twig_store::Error::Io { .. } => ttrpc::Code::INTERNAL,
            },
            Error::Network { source, .. } => match source {
                twig_net::Error::Unsupported(_) => ttrpc::Code::FAILED_PRECONDITION,
                twig_net::Error::Policy(_) => ttrpc::Code::INVALID_ARGUMENT,
                _ => ttrpc::Code::INTERNAL,
            },
            Error::Deadline(_) => ttrpc::Code::DEADLINE_EXCEEDED,
            Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                ttrpc::Code::NOT_FOUND
            }
            Error::Io { .. } | Error::Internal(_) => ttrpc::Code::INTERNAL,
        }
    }
}

/// The agent answers with gRPC status names; its transport failures are
/// the VM's, not the request's.
fn agent_code(e: &AgentError) -> ttrpc::Code {
    match e.status_code() {
        Some("NOT_FOUND") => ttrpc::Code::NOT_FOUND,
        Some("ALREADY_EXISTS") => ttrpc::Code::ALREADY_EXISTS,
        Some("FAILED_PRECONDITION") => ttrpc::Code::FAILED_PRECONDITION,
        Some("INVALID_ARGUMENT") => ttrpc::Code::INVALID_ARGUMENT,
        Some("UNIMPLEMENTED") => ttrpc::Code::UNIMPLEMENTED,
        Some("DEADLINE_EXCEEDED") => ttrpc::Code::DEADLINE_EXCEEDED,
        _ => match e {
            AgentError::Timeout { .. } | AgentError::Deadline(_) => ttrpc::Code::DEADLINE_EXCEEDED,
            _ => ttrpc::Code::INTERNAL,
        },
    }
}

impl From<Error> for ttrpc::Error {
    fn from(e: Error) -> ttrpc::Error {
        ttrpc::Error::RpcStatus(ttrpc::get_status(e.code(), e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_containerd_errdefs_codes() {
        let cases = [
            (Error::NotFound("x".into()), ttrpc::Code::NOT_FOUND),
            (
                Error::AlreadyExists("x".into()),
                ttrpc::Code::ALREADY_EXISTS,
            ),
            (
                Error::FailedPrecondition("x".into()),
                ttrpc::Code::FAILED_PRECONDITION,
            ),
            (
                Error::InvalidArgument("x".into()),
                ttrpc::Code::INVALID_ARGUMENT,
            ),
            (Error::Unimplemented("x".into()), ttrpc::Code::UNIMPLEMENTED),
            (
                Error::io(
                    "opening",
                    std::io::Error::from(std::io::ErrorKind::NotFound),
                ),
                ttrpc::Code::NOT_FOUND,
            ),
            (Error::Internal("x".into()), ttrpc::Code::INTERNAL),
        ];
        for (e, code) in cases {
            let msg = e.to_string();
            match ttrpc::Error::from(e) {
                ttrpc::Error::RpcStatus(s) => {
                    assert_eq!(s.code(), code, "{msg}");
                    assert_eq!(s.message(), msg);
                }
                other => panic!("not a status: {other:?}"),
            }
        }
    }

    #[test]
    fn agent_statuses_keep_their_code() {
        let status = |code: &str| AgentError::Status {
            call: "CreateContainer",
            code: code.to_string(),
            message: "m".into(),
        };
        assert_eq!(
            Error::agent("c", status("NOT_FOUND")).code(),
            ttrpc::Code::NOT_FOUND
        );
        assert_eq!(
            Error::agent("c", status("ALREADY_EXISTS")).code(),
            ttrpc::Code::ALREADY_EXISTS
        );
        assert_eq!(
            Error::agent("c", status("INTERNAL")).code(),
            ttrpc::Code::INTERNAL
        );
    }
}
