//! The host side's Unix sockets: non-blocking send, receive and connect
//! without `SIGPIPE`, the `CONNECT <port>\n` / `OK <port>\n` handshake, and
//! [`host_connect`], its client side.

use std::io::{self, Read, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Longest `CONNECT <port>\n` line, newline included.
pub const MAX_HANDSHAKE: usize = 32;

/// Sends without blocking and without raising SIGPIPE.
pub fn send(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for reads of its length.
    let n = unsafe {
        libc::send(
            fd,
            buf.as_ptr().cast(),
            buf.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// Sends as much of `buf` as the stream takes now.
pub fn send_some(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match send(fd, &buf[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Receives without blocking; `flags` may add `MSG_PEEK`.
pub fn recv(fd: RawFd, buf: &mut [u8], flags: i32) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of its length.
    let n = unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            flags | libc::MSG_DONTWAIT,
        )
    };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// Whether the stream can neither be read nor written any more (the peer
/// closed it, or both directions were shut down).
pub fn hung_up(fd: RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: 0,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no waiting.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & libc::POLLHUP != 0
}

/// Connects to a Unix stream socket without blocking: a listener whose
/// backlog is full refuses the connection instead of stalling the caller.
pub fn connect_nonblocking(path: &Path) -> io::Result<UnixStream> {
    // SAFETY: sockaddr_un is plain old data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long",
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: plain socket creation; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nobody else.
    let stream = unsafe { UnixStream::from_raw_fd(fd) };
    // SAFETY: `addr` is a valid sockaddr_un of the size given.
    let r = unsafe {
        libc::connect(
            fd,
            (&addr as *const libc::sockaddr_un).cast(),
            std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(stream)
}

/// Parses a complete handshake line, newline included.
pub fn parse_connect(line: &[u8]) -> Option<u32> {
    let text = std::str::from_utf8(line.strip_suffix(b"\n")?).ok()?;
    text.strip_prefix("CONNECT ")?.trim().parse().ok()
}

/// The host side of the handshake, for callers of a VM's vsock socket:
/// connects to `uds`, asks for guest port `port` and returns the stream once
/// the guest accepted the connection. Refused (nothing listens on the port
/// yet), a bad answer and no answer within `timeout` are errors.
pub fn host_connect(uds: &Path, port: u32, timeout: Duration) -> Result<UnixStream> {
    let what = || format!("vsock port {port} through {}", uds.display());
    let io = |e: io::Error| Error::io(what(), e);
    let mut stream = UnixStream::connect(uds).map_err(io)?;
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .map_err(io)?;
    let deadline = Instant::now() + timeout;
    let mut line = Vec::with_capacity(MAX_HANDSHAKE);
    let mut byte = [0u8; 1];
    while line.last() != Some(&b'\n') {
        if line.len() >= MAX_HANDSHAKE || Instant::now() >= deadline {
            return Err(Error::Config(format!("{}: no answer to CONNECT", what())));
        }
        match stream.read(&mut byte).map_err(io)? {
            0 => {
                return Err(io(io::Error::new(
                    io::ErrorKind::ConnectionRefused,
                    "the guest refused the connection",
                )))
            }
            _ => line.push(byte[0]),
        }
    }
    if !line.starts_with(b"OK ") {
        return Err(Error::Config(format!(
            "{}: unexpected answer {:?}",
            what(),
            String::from_utf8_lossy(&line)
        )));
    }
    stream.set_read_timeout(None).map_err(io)?;
    Ok(stream)
}
