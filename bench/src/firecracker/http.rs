//! A minimal blocking HTTP/1.1 client over a Unix socket, for Firecracker's
//! API. The workspace has hyper, but only async (tokio) and without a Unix
//! connector; a blocking request and read keeps Firecracker's calls the same
//! shape as twig-vmm's `Client` (one write, one blocking read, a kept-alive
//! connection), so both VMMs' call timings include the same client work.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crate::stats::{Context, Error};

/// One kept-alive connection to an API socket.
pub struct Http {
    stream: UnixStream,
    buf: Vec<u8>,
}

impl Http {
    pub fn connect(path: &Path, timeout: Duration) -> std::io::Result<Http> {
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        Ok(Http {
            stream,
            buf: Vec::with_capacity(4096),
        })
    }

    /// Sends `method path` with a JSON `body`; returns status and body.
    pub fn call(&mut self, method: &str, path: &str, body: &str) -> Result<(u16, String), Error> {
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        self.stream
            .write_all(req.as_bytes())
            .context(|| format!("sending {method} {path}"))?;
        self.read_response()
            .context(|| format!("reading the answer to {method} {path}"))
    }

    /// Like [`Http::call`], but any status other than 2xx is an error.
    pub fn ok(&mut self, method: &str, path: &str, body: &str) -> Result<String, Error> {
        let (status, text) = self.call(method, path, body)?;
        if !(200..300).contains(&status) {
            return Err(format!("{method} {path} {body}: HTTP {status}: {text}").into());
        }
        Ok(text)
    }

    fn read_response(&mut self) -> Result<(u16, String), Error> {
        let head_end = loop {
            if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                break i + 4;
            }
            self.fill()?;
        };
        let head = String::from_utf8_lossy(&self.buf[..head_end]).into_owned();
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        let status: u16 = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("bad status line {status_line:?}"))?;
        let mut len = 0usize;
        for l in lines {
            if let Some((k, v)) = l.split_once(':') {
                if k.trim().eq_ignore_ascii_case("content-length") {
                    len = v
                        .trim()
                        .parse()
                        .map_err(|e| format!("bad Content-Length {v:?}: {e}"))?;
                }
            }
        }
        while self.buf.len() < head_end + len {
            self.fill()?;
        }
        let body = String::from_utf8_lossy(&self.buf[head_end..head_end + len]).into_owned();
        self.buf.drain(..head_end + len);
        Ok((status, body))
    }

    fn fill(&mut self) -> Result<(), Error> {
        let mut chunk = [0u8; 4096];
        let n = self.stream.read(&mut chunk)?;
        if n == 0 {
            return Err("the server closed the connection".into());
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}
