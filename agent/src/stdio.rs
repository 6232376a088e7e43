//! Process stdio on the agent's side: pipes or a pseudo-terminal, output
//! drained by one thread per stream into a bounded buffer, served to the
//! host by long-polling reads.

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket;

use crate::error::{AgentError, Result};
use crate::reaper::lock;

/// How much output one stream buffers before the agent stops reading it
/// (and so the process blocks writing): nothing is ever dropped.
pub const OUTPUT_BUFFER_BYTES: usize = 1 << 20;

/// Default and largest amount one read returns.
pub const DEFAULT_READ_BYTES: usize = 64 << 10;
/// ttrpc messages are limited to 4 MiB; stay well below.
pub const MAX_READ_BYTES: usize = 1 << 20;

#[derive(Debug, Default)]
struct BufState {
    data: VecDeque<u8>,
    eof: bool,
}

/// One output stream's buffer.
#[derive(Debug, Default)]
pub struct OutputBuffer {
    state: Mutex<BufState>,
    readable: Condvar,
    writable: Condvar,
}

impl OutputBuffer {
    /// A buffer that is already closed and empty (stderr of a TTY process).
    pub fn closed() -> Arc<OutputBuffer> {
        let b = OutputBuffer::default();
        lock(&b.state).eof = true;
        Arc::new(b)
    }

    /// Takes up to `max` bytes, waiting up to `timeout` for at least one byte
    /// or the end of the stream. Returns the bytes and whether the stream is
    /// closed and fully read.
    pub fn read(&self, max: usize, timeout: Duration) -> (Vec<u8>, bool) {
        self.read_until(max, Some(Instant::now() + timeout))
    }

    /// Takes up to `max` bytes, waiting for as long as it takes for at least
    /// one byte or the end of the stream (envd's output streams).
    pub fn read_blocking(&self, max: usize) -> (Vec<u8>, bool) {
        self.read_until(max, None)
    }

    fn read_until(&self, max: usize, deadline: Option<Instant>) -> (Vec<u8>, bool) {
        let mut st = lock(&self.state);
        loop {
            if !st.data.is_empty() || st.eof {
                break;
            }
            st = match deadline {
                None => self.readable.wait(st).unwrap_or_else(|e| e.into_inner()),
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    self.readable
                        .wait_timeout(st, left)
                        .map(|(g, _)| g)
                        .unwrap_or_else(|e| e.into_inner().0)
                }
            };
        }
        let n = max.min(st.data.len());
        let data: Vec<u8> = st.data.drain(..n).collect();
        let eof = st.eof && st.data.is_empty();
        if n > 0 {
            self.writable.notify_all();
        }
        (data, eof)
    }

    /// Waits until there is room; returns how many bytes fit.
    fn wait_room(&self) -> usize {
        let mut st = lock(&self.state);
        while st.data.len() >= OUTPUT_BUFFER_BYTES {
            st = self.writable.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        OUTPUT_BUFFER_BYTES - st.data.len()
    }

    fn push(&self, bytes: &[u8]) {
        lock(&self.state).data.extend(bytes);
        self.readable.notify_all();
    }

    fn close(&self) {
        lock(&self.state).eof = true;
        self.readable.notify_all();
    }

    /// Starts the thread that drains `fd` into this buffer until end of file
    /// (for a pty master: until EIO, when the last slave closes).
    pub fn drain(self: &Arc<Self>, fd: OwnedFd, name: String) {
        let buf = self.clone();
        let spawned = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || buf.drain_loop(fd));
        if let Err(e) = spawned {
            tracing::error!("starting the output thread {name}: {e}");
            self.close();
        }
    }

    fn drain_loop(&self, fd: OwnedFd) {
        let mut chunk = vec![0u8; 64 << 10];
        loop {
            let room = self.wait_room().min(chunk.len());
            let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    tracing::warn!("poll on an output stream: {e}");
                    break;
                }
            }
            match nix::unistd::read(&fd, &mut chunk[..room]) {
                Ok(0) => break,
                Ok(n) => self.push(&chunk[..n]),
                Err(nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN) => {}
                // A pty master reads EIO once every slave is closed.
                Err(nix::errno::Errno::EIO) => break,
                Err(e) => {
                    tracing::warn!("reading an output stream: {e}");
                    break;
                }
            }
        }
        self.close();
    }
}

/// Makes `fd` non-blocking.
pub fn set_nonblocking(fd: BorrowedFd<'_>) -> Result<()> {
    let flags = fcntl(fd, FcntlArg::F_GETFL).map_err(|e| AgentError::sys("F_GETFL", e))?;
    let flags = OFlag::from_bits_truncate(flags) | OFlag::O_NONBLOCK;
    fcntl(fd, FcntlArg::F_SETFL(flags)).map_err(|e| AgentError::sys("F_SETFL", e))?;
    Ok(())
}

/// Writes as much of `data` as the process accepts within `timeout` to a
/// non-blocking fd. Returns the count (0 only for empty data).
pub fn write_with_deadline(fd: BorrowedFd<'_>, data: &[u8], timeout: Duration) -> Result<usize> {
    let deadline = Instant::now() + timeout;
    let mut written = 0;
    while written < data.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut fds = [PollFd::new(fd, PollFlags::POLLOUT)];
        let ms = u16::try_from(left.as_millis()).unwrap_or(u16::MAX);
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(0) if written > 0 => return Ok(written),
            Ok(0) => {
                return Err(AgentError::FailedPrecondition(format!(
                    "the process did not read its stdin within {timeout:?}"
                )))
            }
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(AgentError::sys("poll on stdin", e)),
        }
        match nix::unistd::write(fd, &data[written..]) {
            Ok(n) => written += n,
            Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => {}
            Err(nix::errno::Errno::EPIPE) if written == 0 => {
                return Err(AgentError::FailedPrecondition(
                    "the process has closed its stdin".to_string(),
                ))
            }
            Err(nix::errno::Errno::EPIPE) => return Ok(written),
            Err(e) => return Err(AgentError::sys("writing stdin", e)),
        }
        if Instant::now() >= deadline {
            break;
        }
    }
    Ok(written)
}

/// A pipe whose both ends are close-on-exec.
pub fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| AgentError::sys("pipe2", e))
}

/// A connected pair of Unix stream sockets, both close-on-exec. For a
/// terminal process the agent keeps one end and the helper gets the other
/// as its stdio: the helper opens the pty *inside the container* (its own
/// devpts instance, so `tty` and `ttyname` resolve there) and sends the
/// master back on it, as runc's console socket does.
pub fn console_socket() -> Result<(OwnedFd, OwnedFd)> {
    socket::socketpair(
        socket::AddressFamily::Unix,
        socket::SockType::Stream,
        None,
        socket::SockFlag::SOCK_CLOEXEC,
    )
    .map_err(|e| AgentError::sys("socketpair for the console", e))
}

/// Sends `fd` (with one marker byte) on the Unix socket `sock`.
pub fn send_fd(sock: BorrowedFd<'_>, fd: BorrowedFd<'_>) -> Result<()> {
    let fds = [fd.as_raw_fd()];
    let cmsg = [socket::ControlMessage::ScmRights(&fds)];
    let iov = [std::io::IoSlice::new(b"T")];
    socket::sendmsg::<()>(
        sock.as_raw_fd(),
        &iov,
        &cmsg,
        socket::MsgFlags::empty(),
        None,
    )
    .map_err(|e| AgentError::sys("sending the pty master", e))?;
    Ok(())
}

/// Receives the fd a helper sent on `sock` with [`send_fd`], waiting up to
/// `timeout`; the fd arrives close-on-exec.
pub fn recv_fd(sock: BorrowedFd<'_>, timeout: Duration) -> Result<OwnedFd> {
    let ms = u16::try_from(timeout.as_millis()).unwrap_or(u16::MAX);
    let mut fds = [PollFd::new(sock, PollFlags::POLLIN)];
    let ready = poll(&mut fds, PollTimeout::from(ms))
        .map_err(|e| AgentError::sys("waiting for the pty master", e))?;
    if ready == 0 {
        return Err(AgentError::Internal(
            "the container's helper sent no pty master".into(),
        ));
    }
    let mut byte = [0u8; 1];
    let mut iov = [std::io::IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let msg = socket::recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        socket::MsgFlags::MSG_CMSG_CLOEXEC | socket::MsgFlags::MSG_DONTWAIT,
    )
    .map_err(|e| AgentError::sys("receiving the pty master", e))?;
    for c in msg
        .cmsgs()
        .map_err(|e| AgentError::sys("reading the pty master's message", e))?
    {
        if let socket::ControlMessageOwned::ScmRights(received) = c {
            let owned: Vec<OwnedFd> = received
                .into_iter()
                // SAFETY: SCM_RIGHTS installed these fds in this process
                // just now; nothing else owns them (extras are closed).
                .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
                .collect();
            if let Some(first) = owned.into_iter().next() {
                return Ok(first);
            }
        }
    }
    Err(AgentError::Internal(
        "the container's helper closed the console socket without a pty master".into(),
    ))
}

/// A new pseudo-terminal: (master, slave), both close-on-exec. The slave is
/// opened from the master (TIOCGPTPEER), so no /dev/pts path is involved.
pub fn open_pty() -> Result<(OwnedFd, OwnedFd)> {
    let master = nix::pty::posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC)
        .map_err(|e| AgentError::sys("opening /dev/ptmx", e))?;
    nix::pty::grantpt(&master).map_err(|e| AgentError::sys("grantpt", e))?;
    nix::pty::unlockpt(&master).map_err(|e| AgentError::sys("unlockpt", e))?;
    // TIOCGPTPEER = _IO('T', 0x41)
    const TIOCGPTPEER: libc::c_ulong = 0x5441;
    // SAFETY: ioctl on a valid master fd; returns a new fd or -1.
    let slave = unsafe {
        libc::ioctl(
            master.as_raw_fd(),
            TIOCGPTPEER as _,
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    };
    if slave < 0 {
        return Err(AgentError::sys(
            "opening the pty slave (TIOCGPTPEER)",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: `slave` was just returned by the kernel and is owned here.
    Ok((OwnedFd::from(master), unsafe {
        OwnedFd::from_raw_fd(slave)
    }))
}

/// Sets a terminal's window size.
pub fn set_winsize(fd: BorrowedFd<'_>, rows: u16, cols: u16) -> Result<()> {
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a winsize struct that lives for the call.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
    if rc < 0 {
        return Err(AgentError::sys(
            "setting the window size",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffer_read_waits_and_reports_eof_after_drain() {
        let (r, w) = pipe().unwrap();
        let buf = Arc::new(OutputBuffer::default());
        buf.drain(r, "test-drain".into());
        assert_eq!(buf.read(10, Duration::from_millis(20)), (vec![], false));
        nix::unistd::write(&w, b"hello").unwrap();
        let (d, eof) = buf.read(3, Duration::from_secs(10));
        assert_eq!((d.as_slice(), eof), (&b"hel"[..], false));
        drop(w);
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut rest = Vec::new();
        loop {
            let (d, eof) = buf.read(100, Duration::from_secs(1));
            rest.extend(d);
            if eof {
                break;
            }
            assert!(Instant::now() < deadline, "no eof");
        }
        assert_eq!(rest, b"lo");
    }

    #[test]
    fn full_buffer_stops_reading_without_dropping() {
        let (r, w) = pipe().unwrap();
        let buf = Arc::new(OutputBuffer::default());
        buf.drain(r, "test-full".into());
        set_nonblocking(w.as_fd()).unwrap();
        // Write until the pipe is full: the buffer (1 MiB) plus the pipe.
        let block = vec![7u8; 64 << 10];
        let mut total = 0usize;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            assert!(
                Instant::now() < deadline,
                "the buffer never filled: {total} bytes written"
            );
            // Full before the write, and the pipe full too: the drain has
            // stopped reading with data still in the pipe. (A full buffer
            // seen only after a refused write may just have taken the
            // pipe's last bytes.)
            let full = lock(&buf.state).data.len() >= OUTPUT_BUFFER_BYTES;
            match nix::unistd::write(&w, &block) {
                Ok(n) => total += n,
                Err(nix::errno::Errno::EAGAIN) if full => break,
                Err(nix::errno::Errno::EAGAIN) => {}
                Err(e) => panic!("{e}"),
            }
        }
        assert!(total > OUTPUT_BUFFER_BYTES, "{total} bytes written");
        drop(w);
        let mut got = 0usize;
        loop {
            let (d, eof) = buf.read(MAX_READ_BYTES, Duration::from_secs(5));
            assert!(d.iter().all(|&b| b == 7));
            got += d.len();
            if eof {
                break;
            }
        }
        assert_eq!(got, total);
    }

    #[test]
    fn pty_pair_is_a_terminal() {
        let (master, slave) = open_pty().unwrap();
        assert!(nix::unistd::isatty(&slave).unwrap());
        set_winsize(master.as_fd(), 40, 100).unwrap();
        // SAFETY: winsize is plain old data; all zeroes is a valid value.
        let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
        assert_eq!(
            // SAFETY: TIOCGWINSZ writes one winsize into `ws`, which lives
            // across the call; `slave` is an open terminal.
            unsafe { libc::ioctl(slave.as_raw_fd(), libc::TIOCGWINSZ, &mut ws) },
            0
        );
        assert_eq!((ws.ws_row, ws.ws_col), (40, 100));
    }
}
