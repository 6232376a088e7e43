//! The host side of the vsock handshake of Firecracker-style VMMs (twig-vmm,
//! Firecracker, cloud-hypervisor): the VMM listens on a Unix socket; a host
//! client connects, writes `CONNECT <port>\n` and reads one line back. `OK
//! <host port>\n` means a guest process listening on vsock port `<port>`
//! accepted, and from then on the stream carries that connection's bytes.
//! A VMM closes the stream without an answer when nothing in the guest
//! listens on the port.
//!
//! [`connect`] (sync) and `connect_async` (feature `async`) do the
//! handshake within a deadline and return the stream ready for the
//! protocol (ttrpc for the agent), with no timeouts left set on it.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The longest answer line accepted (without its newline); a VMM's `OK
/// <u32>` is at most 13 bytes.
pub const MAX_ANSWER: usize = 64;

/// Why a vsock connection could not be made.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The VMM's Unix socket could not be reached: no such file, nobody
    /// listening, no permission.
    #[error("connecting to the VMM's vsock socket {path}: {source}")]
    Connect {
        /// The VMM's vsock Unix socket.
        path: PathBuf,
        /// The error of `connect(2)`.
        source: io::Error,
    },
    /// The VMM closed the connection without an answer: nothing in the guest
    /// accepted a connection on the port.
    #[error(
        "vsock port {port} through {path}: refused (the VMM closed the connection without an \
         answer; is anything in the guest listening on the port?)"
    )]
    Refused {
        /// The VMM's vsock Unix socket.
        path: PathBuf,
        /// The guest port asked for.
        port: u32,
    },
    /// The VMM answered something other than `OK <n>` (e.g. `FAILURE`), or a
    /// line longer than [`MAX_ANSWER`], or closed the stream mid-line.
    #[error(
        "vsock port {port} through {path}: unexpected answer {answer:?} (expected \"OK <n>\")"
    )]
    BadAnswer {
        /// The VMM's vsock Unix socket.
        path: PathBuf,
        /// The guest port asked for.
        port: u32,
        /// What the VMM sent (lossy UTF-8, without the newline).
        answer: String,
    },
    /// No complete answer arrived before the deadline.
    #[error("vsock port {port} through {path}: no answer within {timeout:?}")]
    Timeout {
        /// The VMM's vsock Unix socket.
        path: PathBuf,
        /// The guest port asked for.
        port: u32,
        /// The deadline that passed.
        timeout: Duration,
    },
    /// Writing the request or reading the answer failed.
    #[error("vsock port {port} through {path}: {what}: {source}")]
    Io {
        /// The VMM's vsock Unix socket.
        path: PathBuf,
        /// The guest port asked for.
        port: u32,
        /// The step that failed.
        what: &'static str,
        /// The underlying error.
        source: io::Error,
    },
}

/// Result of this module.
pub type Result<T> = std::result::Result<T, Error>;

/// One handshake's parameters, to build errors from.
struct Attempt<'a> {
    uds: &'a Path,
    port: u32,
    timeout: Duration,
}

impl Attempt<'_> {
    fn request(&self) -> String {
        format!("CONNECT {}\n", self.port)
    }

    fn connect_error(&self, source: io::Error) -> Error {
        Error::Connect {
            path: self.uds.to_path_buf(),
            source,
        }
    }

    fn io(&self, what: &'static str, source: io::Error) -> Error {
        Error::Io {
            path: self.uds.to_path_buf(),
            port: self.port,
            what,
            source,
        }
    }

    fn timed_out(&self) -> Error {
        Error::Timeout {
            path: self.uds.to_path_buf(),
            port: self.port,
            timeout: self.timeout,
        }
    }

    fn bad_answer(&self, line: &[u8]) -> Error {
        Error::BadAnswer {
            path: self.uds.to_path_buf(),
            port: self.port,
            answer: String::from_utf8_lossy(line).into_owned(),
        }
    }

    /// Feeds one byte of the answer (`None`: end of stream). `Ok(true)` once
    /// a complete `OK <n>` line has been read.
    fn feed(&self, line: &mut Vec<u8>, byte: Option<u8>) -> Result<bool> {
        match byte {
            None if line.is_empty() => Err(Error::Refused {
                path: self.uds.to_path_buf(),
                port: self.port,
            }),
            None => Err(self.bad_answer(line)),
            Some(b'\n') => {
                let ok = line
                    .strip_prefix(b"OK ")
                    .is_some_and(|n| !n.is_empty() && n.iter().all(u8::is_ascii_digit));
                if ok {
                    Ok(true)
                } else {
                    Err(self.bad_answer(line))
                }
            }
            Some(b) if line.len() >= MAX_ANSWER => {
                line.push(b);
                Err(self.bad_answer(line))
            }
            Some(b) => {
                line.push(b);
                Ok(false)
            }
        }
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Connects to guest vsock `port` through the VMM's Unix socket `uds`: sends
/// `CONNECT <port>\n` and waits up to `timeout` for `OK <n>\n`. The answer is
/// read byte by byte, so nothing the guest sends after it is lost. The
/// returned stream is blocking, with no read or write timeout.
///
/// `connect(2)` itself is not bounded by `timeout`: on a Unix socket it
/// returns at once unless the VMM's accept backlog is full.
pub fn connect(uds: &Path, port: u32, timeout: Duration) -> Result<UnixStream> {
    let deadline = Instant::now() + timeout;
    let attempt = Attempt { uds, port, timeout };
    let mut stream = UnixStream::connect(uds).map_err(|e| attempt.connect_error(e))?;
    let left = |now: Instant| deadline.saturating_duration_since(now);
    stream
        .set_write_timeout(Some(left(Instant::now()).max(Duration::from_millis(1))))
        .map_err(|e| attempt.io("setting a write timeout", e))?;
    stream
        .write_all(attempt.request().as_bytes())
        .map_err(|e| {
            if is_timeout(&e) {
                attempt.timed_out()
            } else {
                attempt.io("writing CONNECT", e)
            }
        })?;
    let mut line = Vec::new();
    loop {
        let left = left(Instant::now());
        if left.is_zero() {
            return Err(attempt.timed_out());
        }
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| attempt.io("setting a read timeout", e))?;
        let mut byte = [0u8; 1];
        let got = match stream.read(&mut byte) {
            Ok(0) => None,
            Ok(_) => Some(byte[0]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if is_timeout(&e) => return Err(attempt.timed_out()),
            Err(e) => return Err(attempt.io("reading the answer", e)),
        };
        if attempt.feed(&mut line, got)? {
            break;
        }
    }
    stream
        .set_read_timeout(None)
        .and_then(|()| stream.set_write_timeout(None))
        .map_err(|e| attempt.io("clearing the timeouts", e))?;
    Ok(stream)
}

/// [`connect`] for tokio: the whole handshake, `connect(2)` included, is
/// bounded by `timeout`. The stream converts into a ttrpc async socket with
/// `ttrpc::r#async::transport::Socket::from`.
#[cfg(feature = "async")]
pub async fn connect_async(
    uds: &Path,
    port: u32,
    timeout: Duration,
) -> Result<tokio::net::UnixStream> {
    let attempt = Attempt { uds, port, timeout };
    match tokio::time::timeout(timeout, handshake_async(&attempt)).await {
        Ok(result) => result,
        Err(_) => Err(attempt.timed_out()),
    }
}

#[cfg(feature = "async")]
async fn handshake_async(attempt: &Attempt<'_>) -> Result<tokio::net::UnixStream> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let mut stream = tokio::net::UnixStream::connect(attempt.uds)
        .await
        .map_err(|e| attempt.connect_error(e))?;
    stream
        .write_all(attempt.request().as_bytes())
        .await
        .map_err(|e| attempt.io("writing CONNECT", e))?;
    let mut line = Vec::new();
    loop {
        let mut byte = [0u8; 1];
        let got = match stream.read(&mut byte).await {
            Ok(0) => None,
            Ok(_) => Some(byte[0]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(attempt.io("reading the answer", e)),
        };
        if attempt.feed(&mut line, got)? {
            return Ok(stream);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed_all(bytes: &[u8], eof: bool) -> Result<bool> {
        let attempt = Attempt {
            uds: Path::new("/x"),
            port: 7,
            timeout: Duration::ZERO,
        };
        let mut line = Vec::new();
        for b in bytes {
            if attempt.feed(&mut line, Some(*b))? {
                return Ok(true);
            }
        }
        if eof {
            attempt.feed(&mut line, None)
        } else {
            Ok(false)
        }
    }

    #[test]
    fn answers_are_parsed_strictly() {
        assert!(feed_all(b"OK 1073741824\n", false).unwrap());
        assert!(!feed_all(b"OK 12", false).unwrap());
        for bad in [
            &b"OK \n"[..],
            b"OK x\n",
            b"FAILURE\n",
            b"ok 1\n",
            b"OK 1 \n",
            b"\n",
        ] {
            let e = feed_all(bad, false).unwrap_err();
            assert!(matches!(e, Error::BadAnswer { .. }), "{bad:?}: {e}");
        }
        assert!(matches!(
            feed_all(b"", true).unwrap_err(),
            Error::Refused { port: 7, .. }
        ));
        assert!(matches!(
            feed_all(b"OK 1", true).unwrap_err(),
            Error::BadAnswer { answer, .. } if answer == "OK 1"
        ));
        let long = vec![b'9'; MAX_ANSWER + 1];
        assert!(matches!(
            feed_all(&long, false).unwrap_err(),
            Error::BadAnswer { answer, .. } if answer.len() == MAX_ANSWER + 1
        ));
    }
}
