//! The harness's errors: each names what it was doing and carries the
//! output or log that explains it.

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

/// What went wrong while setting up, driving or tearing down the node.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What the harness was doing.
        what: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A program the harness needs is not on `PATH`.
    #[error("{program} is not on PATH ({hint})")]
    Missing {
        /// The program's file name.
        program: String,
        /// Where it comes from.
        hint: String,
    },
    /// The environment lacks something (root, a variable).
    #[error("{0}")]
    Environment(String),
    /// A command did not finish within its deadline and was killed.
    #[error("{what} did not finish within {within:?} and was killed; its output:\n{output}")]
    Timeout {
        /// The command.
        what: String,
        /// Its deadline.
        within: Duration,
        /// What it printed until then.
        output: String,
    },
    /// A command exited with a failure status.
    #[error("{what} failed with {status}:\n{output}")]
    Failed {
        /// The command.
        what: String,
        /// Its exit status.
        status: ExitStatus,
        /// What it printed.
        output: String,
    },
    /// A CRI call failed (what the test did, the call's error, the node's
    /// logs).
    #[error("CRI: {0}")]
    Cri(String),
    /// A daemon exited, or did not open its socket, within its deadline.
    #[error("{what} did not come up ({why}); its log {log}:\n{tail}")]
    Start {
        /// The daemon.
        what: String,
        /// Why it counts as not started.
        why: String,
        /// Its log file.
        log: PathBuf,
        /// The end of that log.
        tail: String,
    },
}

/// The harness's result type.
pub type Result<T> = std::result::Result<T, Error>;

/// An `Io` error with context, for `map_err`.
pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}
