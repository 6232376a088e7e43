//! The client side: a blocking client with a deadline on every call. Async
//! callers run it on a blocking thread (`tokio::task::spawn_blocking`).

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, ErrorKind as IoKind, IoSlice, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};

use super::types::{
    ApiError, Hello, Reply, Request, Response, RestoreSlot, MAX_RESPONSE, PROTOCOL_VERSION,
};
use crate::error::ErrorKind;
use crate::snapshot::Kind;
use crate::vm::{RollbackInfo, RunState, SnapshotInfo, Stats};

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The VMM answered with an error.
    #[error("twig-vmm: {message} ({kind:?})")]
    Vmm {
        /// What the caller can do about it.
        kind: ErrorKind,
        /// The VMM's message.
        message: String,
    },
    /// No answer within the deadline. The connection is dropped: a late
    /// answer is never taken for the next call's.
    #[error("twig-vmm at {path}: no answer to {op} within {after:?}")]
    Timeout {
        /// The API socket.
        path: PathBuf,
        /// The operation.
        op: &'static str,
        /// The deadline.
        after: Duration,
    },
    /// The socket failed (the VMM exited, refused the connection, …).
    #[error("twig-vmm at {path}: {what}: {source}")]
    Io {
        /// The API socket.
        path: PathBuf,
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The VMM's answer is not what the protocol allows.
    #[error("twig-vmm at {path}: {reason}")]
    Protocol {
        /// The API socket.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// The VMM speaks another protocol version.
    #[error(
        "twig-vmm at {path} speaks protocol {vmm} (version {version}); this client speaks {client}"
    )]
    Version {
        /// The API socket.
        path: PathBuf,
        /// The VMM's protocol version.
        vmm: u32,
        /// The VMM's build version.
        version: String,
        /// This client's [`PROTOCOL_VERSION`].
        client: u32,
    },
}

impl ClientError {
    /// The VMM's error kind, when the VMM answered with an error.
    pub fn kind(&self) -> Option<ErrorKind> {
        match self {
            ClientError::Vmm { kind, .. } => Some(*kind),
            _ => None,
        }
    }
}

/// How long a connect polls a missing socket every 50 µs before every 1 ms.
const FINE_POLL: Duration = Duration::from_millis(50);

/// A connection to one `twig-vmm serve` process.
///
/// Each call sends one request and waits for its answer up to the call's
/// timeout. After a timeout, an I/O error or a protocol error the
/// connection is dropped, and the next call connects again (and checks the
/// protocol version again); so does a call finding that the VMM closed an
/// idle connection.
pub struct Client {
    path: PathBuf,
    conn: Option<BufReader<UnixStream>>,
    connect_timeout: Duration,
}

impl Client {
    /// Connects to the VMM at `path`, retrying until it listens or `timeout`
    /// passes, and checks that it speaks this client's protocol.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Client, ClientError> {
        let mut c = Client {
            path: path.to_path_buf(),
            conn: None,
            connect_timeout: timeout,
        };
        c.reconnect(Instant::now() + timeout)?;
        Ok(c)
    }

    /// The API socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn io(&self, what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ClientError + '_ {
        let what = what.into();
        move |source| ClientError::Io {
            path: self.path.clone(),
            what,
            source,
        }
    }

    fn protocol(&self, reason: impl Into<String>) -> ClientError {
        ClientError::Protocol {
            path: self.path.clone(),
            reason: reason.into(),
        }
    }

    fn reconnect(&mut self, deadline: Instant) -> Result<(), ClientError> {
        self.conn = None;
        let start = Instant::now();
        let stream = loop {
            match UnixStream::connect(&self.path) {
                Ok(s) => break s,
                // Not there yet, or not listening yet: a VMM starting. A
                // VMM listens a few ms after its spawn: poll finely at
                // first, so the wait ends within 50 µs of it.
                Err(e)
                    if matches!(e.kind(), IoKind::NotFound | IoKind::ConnectionRefused)
                        && Instant::now() < deadline =>
                {
                    std::thread::sleep(if start.elapsed() < FINE_POLL {
                        Duration::from_micros(50)
                    } else {
                        Duration::from_millis(1)
                    });
                }
                Err(e) => return Err(self.io("connecting")(e)),
            }
        };
        self.conn = Some(BufReader::new(stream));
        let budget = self.connect_timeout;
        let hello = match self.exchange(&Request::Hello {}, &[], deadline, budget)? {
            Reply::Hello(h) => h,
            other => return Err(self.unexpected("hello", &other)),
        };
        if hello.protocol != PROTOCOL_VERSION {
            self.conn = None;
            return Err(ClientError::Version {
                path: self.path.clone(),
                vmm: hello.protocol,
                version: hello.version,
                client: PROTOCOL_VERSION,
            });
        }
        Ok(())
    }

    /// Whether the open connection can carry a request: the VMM has not
    /// closed it and nothing unasked-for waits in it.
    fn usable(&self) -> bool {
        let Some(conn) = &self.conn else {
            return false;
        };
        if !conn.buffer().is_empty() {
            return false;
        }
        let mut byte = 0u8;
        // SAFETY: recv writes at most one byte into `byte`, which outlives
        // the call; the descriptor belongs to the open stream.
        let n = unsafe {
            libc::recv(
                conn.get_ref().as_raw_fd(),
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        // Nothing to read and not closed: the connection is idle and usable.
        n < 0 && std::io::Error::last_os_error().kind() == IoKind::WouldBlock
    }

    /// Sends `req` and returns the VMM's reply, within `timeout`.
    pub fn call(&mut self, req: &Request, timeout: Duration) -> Result<Reply, ClientError> {
        self.call_with(req, &[], timeout)
    }

    /// [`Client::call`], sending `fds` with the request (`SCM_RIGHTS`).
    fn call_with(
        &mut self,
        req: &Request,
        fds: &[BorrowedFd<'_>],
        timeout: Duration,
    ) -> Result<Reply, ClientError> {
        let deadline = Instant::now() + timeout;
        let reused = self.usable();
        if !reused {
            self.reconnect(deadline.min(Instant::now() + self.connect_timeout))?;
        }
        match self.exchange(req, fds, deadline, timeout) {
            // The VMM closed the idle connection just as the request went
            // out, without reading it: sending it again on a new
            // connection cannot run it twice.
            Err(e) if reused && never_read(&e) => {
                self.reconnect(deadline.min(Instant::now() + self.connect_timeout))?;
                self.exchange(req, fds, deadline, timeout)
            }
            r => r,
        }
    }

    /// One request and its answer on the open connection; drops the
    /// connection on anything but an answer.
    fn exchange(
        &mut self,
        req: &Request,
        fds: &[BorrowedFd<'_>],
        deadline: Instant,
        budget: Duration,
    ) -> Result<Reply, ClientError> {
        let r = self.exchange_inner(req, fds, deadline, budget);
        if !matches!(r, Ok(_) | Err(ClientError::Vmm { .. })) {
            self.conn = None;
        }
        r
    }

    fn exchange_inner(
        &mut self,
        req: &Request,
        fds: &[BorrowedFd<'_>],
        deadline: Instant,
        budget: Duration,
    ) -> Result<Reply, ClientError> {
        let op = req.op();
        let timeout = |c: &Client| ClientError::Timeout {
            path: c.path.clone(),
            op,
            after: budget,
        };
        let mut line =
            serde_json::to_vec(req).map_err(|e| self.protocol(format!("encoding {op}: {e}")))?;
        line.push(b'\n');
        let left = remaining(deadline).ok_or_else(|| timeout(self))?;
        let Some(conn) = self.conn.as_mut() else {
            return Err(self.protocol("not connected"));
        };
        let stream = conn.get_mut();
        let r = stream
            .set_write_timeout(Some(left))
            .and_then(|_| send(stream, &line, fds));
        let write_err = match r {
            Ok(()) => None,
            Err(e) if is_timeout(&e) => return Err(timeout(self)),
            // The VMM may have answered and closed (a `busy` refusal): read
            // what it said before reporting the broken pipe.
            Err(e) if e.kind() == IoKind::BrokenPipe => Some(e),
            Err(e) => return Err(self.io(format!("sending {op}"))(e)),
        };
        let mut answer = Vec::new();
        loop {
            let Some(left) = remaining(deadline) else {
                return Err(timeout(self));
            };
            let Some(conn) = self.conn.as_mut() else {
                return Err(self.protocol("not connected"));
            };
            if let Err(e) = conn.get_ref().set_read_timeout(Some(left)) {
                return Err(self.io("setting the read timeout")(e));
            }
            let buf = match conn.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == IoKind::Interrupted => continue,
                Err(e) if is_timeout(&e) => return Err(timeout(self)),
                Err(e) => return Err(self.io(format!("reading the answer to {op}"))(e)),
            };
            if buf.is_empty() {
                if let Some(e) = write_err {
                    return Err(self.io(format!("sending {op}"))(e));
                }
                return Err(self.protocol(format!("the VMM closed the connection during {op}")));
            }
            let (take, done) = match buf.iter().position(|b| *b == b'\n') {
                Some(i) => (i + 1, true),
                None => (buf.len(), false),
            };
            answer.extend_from_slice(&buf[..take]);
            conn.consume(take);
            if answer.len() > MAX_RESPONSE {
                return Err(
                    self.protocol(format!("answer to {op} longer than {MAX_RESPONSE} bytes"))
                );
            }
            if done {
                break;
            }
        }
        match serde_json::from_slice::<Response>(&answer) {
            Ok(Response::Ok(reply)) => Ok(reply),
            Ok(Response::Error(ApiError { kind, message })) => {
                Err(ClientError::Vmm { kind, message })
            }
            Err(e) => Err(self.protocol(format!(
                "cannot parse the answer to {op} ({e}): {:?}",
                String::from_utf8_lossy(&answer)
            ))),
        }
    }

    fn unexpected(&mut self, op: &str, reply: &Reply) -> ClientError {
        self.conn = None;
        self.protocol(format!("unexpected answer to {op}: {reply:?}"))
    }

    /// The VMM's protocol and build versions.
    pub fn hello(&mut self, timeout: Duration) -> Result<Hello, ClientError> {
        match self.call(&Request::Hello {}, timeout)? {
            Reply::Hello(h) => Ok(h),
            other => Err(self.unexpected("hello", &other)),
        }
    }

    /// Boots `kernel` in a new VM of `mem_mib` MiB and `vcpus` vCPUs.
    pub fn boot(
        &mut self,
        kernel: &Path,
        initrd: Option<&Path>,
        cmdline: &str,
        mem_mib: usize,
        vcpus: usize,
        timeout: Duration,
    ) -> Result<RunState, ClientError> {
        let req = Request::Boot {
            kernel: kernel.to_path_buf(),
            initrd: initrd.map(Path::to_path_buf),
            cmdline: cmdline.to_string(),
            mem_mib,
            vcpus,
        };
        self.state_call(&req, timeout)
    }

    /// Restores the snapshot in `dir` into a new VM and runs it; returns the
    /// snapshot's id.
    pub fn restore(&mut self, dir: &Path, timeout: Duration) -> Result<String, ClientError> {
        self.restore_with(dir, &[], timeout)
    }

    /// [`Client::restore`] with an image for each of the snapshot's
    /// attached disk slots: `(slot, name, file)`, each file opened by the
    /// caller (read-write for a slot attached read-write) and already
    /// holding the snapshot's copy of that slot's disk; its descriptor is
    /// sent with the request (`SCM_RIGHTS`), so a jailed VMM, which cannot
    /// open the caller's files, serves it. `name` names it (logs, the
    /// device id).
    pub fn restore_with(
        &mut self,
        dir: &Path,
        slots: &[(usize, &Path, &File)],
        timeout: Duration,
    ) -> Result<String, ClientError> {
        self.restore_call(dir, slots, None, timeout)
    }

    /// [`Client::restore_with`], lazily (see [`crate::uffd`]): guest
    /// memory comes on demand from the page server at the other end of
    /// `page_server` (a connected Unix stream socket), which gets the
    /// VMM's handshake and userfaultfd, made from `userfaultfd` (the
    /// caller's open `/dev/userfaultfd`). Both descriptors are sent after
    /// the slot images. The VMM answers once vCPU and device state are
    /// loaded and the guest runs; loading may fault pages in, so the page
    /// server must be serving meanwhile (another thread or process).
    pub fn restore_lazy(
        &mut self,
        dir: &Path,
        slots: &[(usize, &Path, &File)],
        userfaultfd: &File,
        page_server: &UnixStream,
        timeout: Duration,
    ) -> Result<String, ClientError> {
        self.restore_call(dir, slots, Some((userfaultfd, page_server)), timeout)
    }

    /// The restore request: the slot images' descriptors, then, lazily,
    /// `/dev/userfaultfd`'s and the page server's.
    fn restore_call(
        &mut self,
        dir: &Path,
        slots: &[(usize, &Path, &File)],
        lazy: Option<(&File, &UnixStream)>,
        timeout: Duration,
    ) -> Result<String, ClientError> {
        let req = Request::Restore {
            dir: dir.to_path_buf(),
            slots: slots
                .iter()
                .map(|(slot, name, _)| RestoreSlot {
                    slot: *slot,
                    path: name.to_path_buf(),
                })
                .collect(),
            lazy: lazy.is_some(),
        };
        let mut fds: Vec<BorrowedFd<'_>> = slots.iter().map(|(_, _, f)| f.as_fd()).collect();
        if let Some((userfaultfd, page_server)) = lazy {
            fds.push(userfaultfd.as_fd());
            fds.push(page_server.as_fd());
        }
        match self.call_with(&req, &fds, timeout)? {
            Reply::Restored { id } => Ok(id),
            other => Err(self.unexpected("restore", &other)),
        }
    }

    /// Parks the vCPUs.
    pub fn pause(&mut self, timeout: Duration) -> Result<RunState, ClientError> {
        self.state_call(&Request::Pause {}, timeout)
    }

    /// Runs the vCPUs.
    pub fn resume(&mut self, timeout: Duration) -> Result<RunState, ClientError> {
        self.state_call(&Request::Resume {}, timeout)
    }

    fn state_call(&mut self, req: &Request, timeout: Duration) -> Result<RunState, ClientError> {
        match self.call(req, timeout)? {
            Reply::State { state } => Ok(state),
            other => Err(self.unexpected(req.op(), &other)),
        }
    }

    /// Snapshots the VM into the new directory `dir` (a node store's
    /// staging directory). A jailed VMM runs as its own user: if that user
    /// (the owner of the API socket, which the VMM created) is not the
    /// caller's, `dir` is first given to it (`chown`), so the VMM can write
    /// there; the store publishes it as before.
    pub fn snapshot(
        &mut self,
        dir: &Path,
        kind: Kind,
        timeout: Duration,
    ) -> Result<SnapshotInfo, ClientError> {
        self.give_to_vmm(dir)?;
        let req = Request::Snapshot {
            dir: dir.to_path_buf(),
            kind,
        };
        match self.call(&req, timeout)? {
            Reply::Snapshot(info) => Ok(info),
            other => Err(self.unexpected("snapshot", &other)),
        }
    }

    /// Makes `dir` the VMM's user's if the VMM runs as another user than
    /// the caller (a jailed VMM). A `dir` this process cannot see (a path
    /// inside a jail that is not bound at its host path) is left to the VMM
    /// to find or refuse.
    fn give_to_vmm(&self, dir: &Path) -> Result<(), ClientError> {
        let sock = std::fs::metadata(&self.path).map_err(self.io("looking at the API socket"))?;
        let Ok(meta) = std::fs::metadata(dir) else {
            return Ok(());
        };
        let owner = (sock.uid(), sock.gid());
        if sock.uid() == nix::unistd::geteuid().as_raw() || (meta.uid(), meta.gid()) == owner {
            return Ok(());
        }
        std::os::unix::fs::chown(dir, Some(owner.0), Some(owner.1)).map_err(self.io(format!(
            "giving the staging directory {} to the VMM's user {}",
            dir.display(),
            owner.0
        )))
    }

    /// Rolls the VM back in place to the snapshot in `dir`.
    pub fn rollback(&mut self, dir: &Path, timeout: Duration) -> Result<RollbackInfo, ClientError> {
        let req = Request::Rollback {
            dir: dir.to_path_buf(),
        };
        match self.call(&req, timeout)? {
            Reply::Rollback(info) => Ok(info),
            other => Err(self.unexpected("rollback", &other)),
        }
    }

    /// The VM's counters.
    pub fn stats(&mut self, timeout: Duration) -> Result<Stats, ClientError> {
        match self.call(&Request::Stats {}, timeout)? {
            Reply::Stats(s) => Ok(s),
            other => Err(self.unexpected("stats", &other)),
        }
    }

    /// Attaches the image at `path` to disk slot `slot` of the running VM.
    /// The file is opened here (read-only, or read-write) and its
    /// descriptor sent with the request, so a jailed VMM, which cannot open
    /// the caller's files, gets it too; a file this process cannot open is
    /// named by path, and the VMM's answer says what is wrong with it.
    pub fn attach_disk(
        &mut self,
        slot: usize,
        path: &Path,
        read_only: bool,
        timeout: Duration,
    ) -> Result<(), ClientError> {
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .ok();
        let req = Request::AttachDisk {
            slot,
            path: path.to_path_buf(),
            read_only,
            fd: file.is_some(),
        };
        let fds: Vec<BorrowedFd<'_>> = file.iter().map(AsFd::as_fd).collect();
        match self.call_with(&req, &fds, timeout)? {
            Reply::DiskAttached { slot: s } if s == slot => Ok(()),
            other => Err(self.unexpected("attach_disk", &other)),
        }
    }

    /// Empties disk slot `slot`; the guest must have stopped using its disk.
    pub fn detach_disk(&mut self, slot: usize, timeout: Duration) -> Result<(), ClientError> {
        match self.call(&Request::DetachDisk { slot }, timeout)? {
            Reply::DiskDetached { slot: s } if s == slot => Ok(()),
            other => Err(self.unexpected("detach_disk", &other)),
        }
    }

    /// Attaches the tap `tap` (opened with `IFF_TAP|IFF_NO_PI|IFF_VNET_HDR`)
    /// to the VM's detached network device by sending its descriptor;
    /// returns the interface's name. The caller may close its copy after.
    pub fn attach_net(
        &mut self,
        tap: BorrowedFd<'_>,
        timeout: Duration,
    ) -> Result<String, ClientError> {
        match self.call_with(&Request::AttachNet {}, &[tap], timeout)? {
            Reply::NetAttached { tap } => Ok(tap),
            other => Err(self.unexpected("attach_net", &other)),
        }
    }

    /// Stops the VM; the VMM process exits after answering.
    pub fn shutdown(&mut self, timeout: Duration) -> Result<(), ClientError> {
        match self.call(&Request::Shutdown {}, timeout)? {
            Reply::ShutDown {} => Ok(()),
            other => Err(self.unexpected("shutdown", &other)),
        }
    }
}

/// Writes all of `line` to `stream`, `fds` (if any) with its first bytes.
fn send(stream: &mut UnixStream, line: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
    if fds.is_empty() {
        return stream.write_all(line);
    }
    let fds: Vec<_> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let sent = loop {
        match sendmsg::<()>(
            stream.as_raw_fd(),
            &[IoSlice::new(line)],
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(n) => break n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    stream.write_all(&line[sent..])
}

fn remaining(deadline: Instant) -> Option<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    // A zero timeout means "block forever" to the socket API.
    (!left.is_zero()).then_some(left)
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), IoKind::WouldBlock | IoKind::TimedOut)
}

/// Whether `e` shows the VMM closed the connection without reading the
/// request: the send found it closed (and nothing came back), or the
/// answer's read was reset — a Unix socket closed with unread data in it.
/// The VMM reads and answers one request at a time, so the request cannot
/// have run.
fn never_read(e: &ClientError) -> bool {
    matches!(e, ClientError::Io { source, .. }
        if matches!(source.kind(), IoKind::ConnectionReset | IoKind::BrokenPipe))
}
