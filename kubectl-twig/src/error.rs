//! The plugin's errors, printed as kubectl prints its own.

/// Everything a command can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No usable kubeconfig (or in-cluster configuration).
    #[error("{0}")]
    Config(String),
    /// The API server refused a request; printed as kubectl does.
    #[error("Error from server ({}): {}", reason_or_code(.0), .0.message)]
    Server(Box<kube::core::Status>),
    /// The API server could not be reached or answered nonsense.
    #[error("{0}")]
    Client(String),
    /// The object named on the command line was not found.
    #[error("{0}")]
    NotFound(String),
    /// What the command needs is not running (the controller on the pod's node).
    #[error("{0}")]
    Unavailable(String),
    /// The object reached a phase it will not leave (Failed, Lost).
    #[error("{object} {phase}: {message}")]
    Failed {
        /// `<resource>.<group>/<name>`.
        object: String,
        /// The phase, lower case.
        phase: String,
        /// `status.message`, or the failing condition's.
        message: String,
    },
    /// The wait ran out.
    #[error("timed out waiting for the condition on {0}")]
    Timeout(String),
    /// Bad input the argument parser could not catch.
    #[error("{0}")]
    Usage(String),
    /// Writing the output failed.
    #[error("writing the output: {0}")]
    Output(String),
}

fn reason_or_code(status: &kube::core::Status) -> String {
    if status.reason.is_empty() {
        status.code.to_string()
    } else {
        status.reason.clone()
    }
}

impl From<kube::Error> for Error {
    fn from(error: kube::Error) -> Self {
        match error {
            kube::Error::Api(status) => Error::Server(status),
            other => Error::Client(chain(&other)),
        }
    }
}

/// An error with its causes: `a: b: c`.
pub fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

impl Error {
    /// Says which server a connection failure was with.
    pub fn at_server(self, server: &str) -> Self {
        match self {
            Error::Client(message) => {
                Error::Client(format!("talking to the server {server}: {message}"))
            }
            other => other,
        }
    }

    /// How kubectl prints it: server errors as `Error from server (...)`, the rest as `error: ...`.
    pub fn render(&self) -> String {
        match self {
            Error::Server(_) => self.to_string(),
            other => format!("error: {other}"),
        }
    }
}
