//! Stdio between containerd and the agent.
//!
//! containerd hands a process's stdio as paths in the Create and Exec
//! requests: FIFOs it created and holds open (`ctr`, CRI), or `file://`
//! URIs (`ctr run --log-uri file://…`). Output is copied from the agent's
//! streams (long-polling `read_stream`) into them until the agent says
//! end of file, then closed, so containerd's reader sees EOF. Input is
//! copied from the stdin FIFO to `write_stdin` until containerd's
//! `CloseIO`, which drains what is buffered, then closes the process's
//! stdin.
//!
//! FIFOs are opened read-write: that never blocks (containerd may open its
//! end later), and a read-write stdin FIFO never reports end of file when a
//! writer comes and goes — stdin ends with `CloseIO`, as in runc's shim.

use std::path::Path;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use twig_agent::client::StreamChunk;

use crate::error::{Error, Result};

/// Bytes asked for in one agent read.
pub const CHUNK: u32 = 64 * 1024;

/// A process's stdio as containerd named it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StdioPaths {
    /// Stdin FIFO, or empty.
    pub stdin: String,
    /// Stdout FIFO or `file://` URI, or empty.
    pub stdout: String,
    /// Stderr FIFO or `file://` URI, or empty (always unused with a TTY).
    pub stderr: String,
    /// The process has a terminal: one output stream.
    pub terminal: bool,
}

/// Where output goes.
pub type Output = Box<dyn AsyncWrite + Send + Unpin>;

/// The opened ends of a process's stdio.
#[derive(Default)]
pub struct OpenedStdio {
    /// The stdin FIFO.
    pub stdin: Option<pipe::Receiver>,
    /// Where stdout goes.
    pub stdout: Option<Output>,
    /// Where stderr goes.
    pub stderr: Option<Output>,
}

impl StdioPaths {
    /// Opens every named path; a bad path is an error naming it.
    pub async fn open(&self) -> Result<OpenedStdio> {
        let stdin = match self.stdin.as_str() {
            "" => None,
            p => Some(
                pipe::OpenOptions::new()
                    .read_write(true)
                    .open_receiver(p)
                    .map_err(|e| Error::io(format!("opening the stdin FIFO {p}"), e))?,
            ),
        };
        let stdout = open_output(&self.stdout).await?;
        let stderr = if self.terminal {
            None
        } else {
            open_output(&self.stderr).await?
        };
        Ok(OpenedStdio {
            stdin,
            stdout,
            stderr,
        })
    }
}

/// Opens an output path: a FIFO, or `file://<absolute path>` (appended).
pub async fn open_output(uri: &str) -> Result<Option<Output>> {
    if uri.is_empty() {
        return Ok(None);
    }
    if let Some(path) = uri.strip_prefix("file://") {
        if !Path::new(path).is_absolute() {
            return Err(Error::InvalidArgument(format!(
                "stdio {uri}: the path must be absolute"
            )));
        }
        let f = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .await
            .map_err(|e| Error::io(format!("opening the log file {path}"), e))?;
        return Ok(Some(Box::new(f)));
    }
    if uri.contains("://") {
        return Err(Error::InvalidArgument(format!(
            "stdio {uri}: only FIFOs and file:// are supported by the twig runtime"
        )));
    }
    let tx = pipe::OpenOptions::new()
        .read_write(true)
        .open_sender(uri)
        .map_err(|e| Error::io(format!("opening the output FIFO {uri}"), e))?;
    Ok(Some(Box::new(tx)))
}

/// One blocking read of an output stream (the agent's `read_stream`).
pub type ReadFn = Arc<dyn Fn() -> Result<StreamChunk> + Send + Sync>;
/// One blocking write to stdin (the agent's `write_stdin`): bytes taken.
pub type WriteFn = Arc<dyn Fn(&[u8]) -> Result<u32> + Send + Sync>;
/// Closes the process's stdin (the agent's `close_stdin`).
pub type CloseFn = Arc<dyn Fn() -> Result<()> + Send + Sync>;

/// Copies a stream into `out` until the agent reports end of file, then
/// closes `out`. A failed read or write ends the copy (logged).
pub fn copy_out(read: ReadFn, mut out: Output) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let r = read.clone();
            let chunk = match tokio::task::spawn_blocking(move || r()).await {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    tracing::warn!("reading process output: {e}");
                    break;
                }
                Err(e) => {
                    tracing::warn!("output copier: {e}");
                    break;
                }
            };
            if !chunk.data.is_empty() {
                if let Err(e) = out.write_all(&chunk.data).await {
                    tracing::warn!("writing process output: {e}");
                    break;
                }
            }
            if chunk.eof {
                break;
            }
        }
        if let Err(e) = out.shutdown().await {
            tracing::debug!("closing process output: {e}");
        }
    })
}

/// Hands stdin over to the process, blocking; stops when the process
/// takes nothing or the write fails.
async fn forward(write: &WriteFn, data: Vec<u8>) -> bool {
    let w = write.clone();
    let res = tokio::task::spawn_blocking(move || {
        let mut at = 0;
        while at < data.len() {
            match w(&data[at..]) {
                Ok(0) => {
                    return Err(Error::Internal(
                        "the process does not read its stdin".into(),
                    ))
                }
                Ok(n) => at += n as usize,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    })
    .await;
    match res {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            tracing::warn!("writing stdin: {e}");
            false
        }
        Err(e) => {
            tracing::warn!("stdin copier: {e}");
            false
        }
    }
}

/// Copies the stdin FIFO into the process until `close` fires (containerd's
/// CloseIO): then what is already in the FIFO is forwarded and the
/// process's stdin is closed.
pub fn copy_in(
    mut fifo: pipe::Receiver,
    mut close: oneshot::Receiver<()>,
    write: WriteFn,
    close_stdin: CloseFn,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut buf = vec![0u8; CHUNK as usize];
        let mut ok = true;
        loop {
            tokio::select! {
                _ = &mut close => break,
                r = fifo.read(&mut buf) => match r {
                    Ok(0) => break,
                    Ok(n) => {
                        if !forward(&write, buf[..n].to_vec()).await {
                            ok = false;
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!("reading the stdin FIFO: {e}");
                        break;
                    }
                },
            }
        }
        // Drain what containerd wrote before it asked to close. A plain
        // non-blocking read: tokio's `try_read` trusts its cached readiness
        // and may answer "would block" with bytes in the FIFO.
        while ok {
            match nix::unistd::read(&fifo, &mut buf) {
                Ok(0) => break,
                Ok(n) => ok = forward(&write, buf[..n].to_vec()).await,
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(e) => {
                    tracing::warn!("draining the stdin FIFO: {e}");
                    break;
                }
            }
        }
        let c = close_stdin.clone();
        match tokio::task::spawn_blocking(move || c()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!("closing stdin: {e}"),
            Err(e) => tracing::warn!("closing stdin: {e}"),
        }
    })
}

#[cfg(test)]
mod tests {
    use std::ffi::CString;
    use std::sync::Mutex;
    use std::time::Duration;

    use tokio::io::AsyncReadExt;

    use super::*;

    fn mkfifo(path: &Path) {
        let c = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
        let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
        assert_eq!(
            rc,
            0,
            "mkfifo {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        );
    }

    #[tokio::test]
    async fn output_reaches_the_fifo_and_ends_with_eof() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("stdout");
        mkfifo(&fifo);
        let mut reader = pipe::OpenOptions::new().open_receiver(&fifo).unwrap();
        let chunks = Mutex::new(vec![
            StreamChunk {
                data: b"hello ".to_vec(),
                eof: false,
            },
            StreamChunk {
                data: vec![],
                eof: false,
            },
            StreamChunk {
                data: b"world\n".to_vec(),
                eof: true,
            },
        ]);
        let read: ReadFn = Arc::new(move || Ok(chunks.lock().unwrap().remove(0)));
        let out = open_output(fifo.to_str().unwrap()).await.unwrap().unwrap();
        let copier = copy_out(read, out);
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), reader.read_to_end(&mut got))
            .await
            .expect("EOF on the FIFO")
            .unwrap();
        assert_eq!(got, b"hello world\n");
        copier.await.unwrap();
    }

    #[tokio::test]
    async fn file_uris_append_and_bad_uris_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log");
        std::fs::write(&log, "old\n").unwrap();
        let uri = format!("file://{}", log.display());
        let read: ReadFn = Arc::new(|| {
            Ok(StreamChunk {
                data: b"new\n".to_vec(),
                eof: true,
            })
        });
        copy_out(read, open_output(&uri).await.unwrap().unwrap())
            .await
            .unwrap();
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "old\nnew\n");
        assert!(matches!(
            open_output("binary:///bin/logger").await,
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            open_output("file://relative").await,
            Err(Error::InvalidArgument(_))
        ));
        let missing = dir.path().join("nofifo");
        let e = open_output(missing.to_str().unwrap()).await.err().unwrap();
        assert!(e.to_string().contains("nofifo"), "{e}");
    }

    #[tokio::test]
    async fn stdin_is_forwarded_drained_on_close_then_closed() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("stdin");
        mkfifo(&fifo);
        let paths = StdioPaths {
            stdin: fifo.to_str().unwrap().into(),
            ..Default::default()
        };
        let opened = paths.open().await.unwrap();
        let got = Arc::new(Mutex::new(Vec::new()));
        let closed = Arc::new(Mutex::new(false));
        let g = got.clone();
        // Takes at most 3 bytes a call: partial writes must be continued.
        let write: WriteFn = Arc::new(move |d: &[u8]| {
            let n = d.len().min(3);
            g.lock().unwrap().extend_from_slice(&d[..n]);
            Ok(n as u32)
        });
        let c = closed.clone();
        let close_stdin: CloseFn = Arc::new(move || {
            *c.lock().unwrap() = true;
            Ok(())
        });
        let (tx, rx) = oneshot::channel();
        let copier = copy_in(opened.stdin.unwrap(), rx, write, close_stdin);
        let mut w = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
        std::io::Write::write_all(&mut w, b"line one\n").unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while got.lock().unwrap().len() < 9 {
            assert!(std::time::Instant::now() < deadline, "stdin not forwarded");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // A writer that goes away is not the end of stdin.
        drop(w);
        assert!(!*closed.lock().unwrap());
        let mut w = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
        std::io::Write::write_all(&mut w, b"tail").unwrap();
        tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(10), copier)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&got.lock().unwrap()[..], b"line one\ntail");
        assert!(*closed.lock().unwrap());
    }
}
