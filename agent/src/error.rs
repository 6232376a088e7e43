//! The agent's error type and its mapping onto ttrpc status codes.

/// An error the agent replies with.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The request is malformed (bad id, bad JSON, unsupported feature).
    #[error("{0}")]
    InvalidArgument(String),
    /// No such container or process.
    #[error("{0}")]
    NotFound(String),
    /// The container or exec id is taken.
    #[error("{0}")]
    AlreadyExists(String),
    /// The object is in the wrong state (not started, exited, stdin closed).
    #[error("{0}")]
    FailedPrecondition(String),
    /// The system refused (mount, clone, ioctl failed).
    #[error("{0}")]
    Internal(String),
}

/// Result of the agent's operations.
pub type Result<T> = std::result::Result<T, AgentError>;

impl AgentError {
    /// An [`AgentError::Internal`] saying what failed and why.
    pub fn sys(what: impl std::fmt::Display, e: impl std::fmt::Display) -> Self {
        AgentError::Internal(format!("{what}: {e}"))
    }

    /// The same error, its message prefixed with `what: `.
    pub fn context(self, what: &str) -> Self {
        let wrap = |m: String| format!("{what}: {m}");
        match self {
            AgentError::InvalidArgument(m) => AgentError::InvalidArgument(wrap(m)),
            AgentError::NotFound(m) => AgentError::NotFound(wrap(m)),
            AgentError::AlreadyExists(m) => AgentError::AlreadyExists(wrap(m)),
            AgentError::FailedPrecondition(m) => AgentError::FailedPrecondition(wrap(m)),
            AgentError::Internal(m) => AgentError::Internal(wrap(m)),
        }
    }
}

impl From<AgentError> for ttrpc::Error {
    fn from(e: AgentError) -> Self {
        let code = match e {
            AgentError::InvalidArgument(_) => ttrpc::Code::INVALID_ARGUMENT,
            AgentError::NotFound(_) => ttrpc::Code::NOT_FOUND,
            AgentError::AlreadyExists(_) => ttrpc::Code::ALREADY_EXISTS,
            AgentError::FailedPrecondition(_) => ttrpc::Code::FAILED_PRECONDITION,
            AgentError::Internal(_) => ttrpc::Code::INTERNAL,
        };
        ttrpc::Error::RpcStatus(ttrpc::get_status(code, e.to_string()))
    }
}
