//! Port-forward (`kubectl port-forward`): a second listener, on vsock port
//! [`twig_agent::proto::FORWARD_VSOCK_PORT`] (or a Unix socket in host
//! tests), whose every connection asks for one TCP port of the guest's
//! loopback ([`port_forward::Request`]). The agent connects to it (127.0.0.1
//! or ::1 first as asked, then the other), answers one
//! [`port_forward::Status`], and copies bytes both ways until both sides
//! have finished sending; an end of stream on one side becomes a
//! `shutdown(SHUT_WR)` on the other. The VM's network namespace is the
//! pod's: its containers share it, so a server listening on 127.0.0.1 only
//! is reached.
//!
//! What arrives is untrusted: the request is fixed-size and read within
//! [`REQUEST_TIMEOUT`], anything malformed is answered `BadRequest` and
//! closed, and at most [`MAX_CONNECTIONS`] connections are served at once
//! (the next ones are answered `Busy` at once and closed, their request
//! unread: the accept loop never waits on them, and the host's write of
//! its request may then fail, EPIPE). One blocking `accept` and two
//! threads per open connection: nothing runs while nothing is forwarded.

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use twig_agent::proto::port_forward::{Request, Status, ANSWER_LEN, REQUEST_LEN};

/// Connections served at once; more are answered `Busy`.
pub const MAX_CONNECTIONS: usize = 256;
/// How long the request may take to arrive, and a loopback connect or an
/// answer to be taken.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// The stack of a connection's threads (they only copy).
const STACK: usize = 128 * 1024;

/// Where to listen: `unix://<path>` or `vsock://<cid>:<port>` (the cid is
/// ignored: any).
pub(crate) enum Listener {
    Unix(UnixListener),
    Vsock(OwnedFd),
}

impl Listener {
    pub(crate) fn bind(listen: &str) -> io::Result<Listener> {
        if let Some(path) = listen.strip_prefix("unix://") {
            // A stale socket from an earlier run would make bind fail.
            let _ = std::fs::remove_file(path);
            return UnixListener::bind(path).map(Listener::Unix);
        }
        let port = listen
            .strip_prefix("vsock://")
            .and_then(|rest| rest.rsplit_once(':'))
            .and_then(|(_, port)| port.parse::<u32>().ok())
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{listen:?} is neither unix://<path> nor vsock://<cid>:<port>"),
                )
            })?;
        use nix::sys::socket::{
            bind, listen as listen_on, socket, AddressFamily, Backlog, SockFlag, SockType,
            VsockAddr,
        };
        let fd = socket(
            AddressFamily::Vsock,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        bind(fd.as_raw_fd(), &VsockAddr::new(libc::VMADDR_CID_ANY, port))?;
        listen_on(&fd, Backlog::new(64).unwrap_or(Backlog::MAXCONN))?;
        Ok(Listener::Vsock(fd))
    }

    /// Binds `listen` and runs `serve` on it on a thread named `name`.
    pub(crate) fn serve_on(name: &str, listen: &str, serve: fn(Listener)) -> io::Result<()> {
        let listener = Listener::bind(listen)?;
        tracing::info!(listen, "{name} listener ready");
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || serve(listener))?;
        Ok(())
    }

    pub(crate) fn accept(&self) -> io::Result<OwnedFd> {
        match self {
            Listener::Unix(l) => l.accept().map(|(s, _)| OwnedFd::from(s)),
            Listener::Vsock(fd) => {
                let conn = nix::sys::socket::accept4(
                    fd.as_raw_fd(),
                    nix::sys::socket::SockFlag::SOCK_CLOEXEC,
                )?;
                // SAFETY: accept4 returned a new descriptor nobody owns.
                Ok(unsafe { OwnedFd::from_raw_fd(conn) })
            }
        }
    }
}

/// Binds `listen` and serves it on a thread of its own, forever.
pub fn start(listen: &str) -> io::Result<()> {
    Listener::serve_on("forward", listen, serve)
}

fn serve(listener: Listener) {
    let open = Arc::new(AtomicUsize::new(0));
    loop {
        let conn = match listener.accept() {
            Ok(c) => c,
            Err(e) => {
                // EMFILE and the like: the next accept may succeed once a
                // connection closed; a blocking accept costs nothing.
                tracing::warn!("port-forward accept: {e}");
                if e.raw_os_error() == Some(libc::EMFILE) || e.raw_os_error() == Some(libc::ENFILE)
                {
                    std::thread::sleep(Duration::from_millis(100));
                }
                continue;
            }
        };
        let mut host = File::from(conn);
        if open.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            open.fetch_sub(1, Ordering::SeqCst);
            let _ = set_timeouts(&host, Some(REQUEST_TIMEOUT));
            let _ = host.write_all(&Status::Busy.encode());
            continue;
        }
        let count = Guard(open.clone());
        let spawned = std::thread::Builder::new()
            .name("forward-conn".into())
            .stack_size(STACK)
            .spawn(move || {
                let _count = count;
                if let Err(e) = forward(host) {
                    tracing::debug!("port-forward connection: {e}");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("port-forward: no thread for a connection: {e}");
        }
    }
}

/// Counts an open connection until dropped.
struct Guard(Arc<AtomicUsize>);

impl Drop for Guard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One connection: the request, the loopback connect, the answer, then
/// the copy both ways.
fn forward(mut host: File) -> io::Result<()> {
    set_timeouts(&host, Some(REQUEST_TIMEOUT))?;
    let mut request = [0u8; REQUEST_LEN];
    host.read_exact(&mut request)?;
    let Some(request) = Request::decode(&request) else {
        host.write_all(&Status::BadRequest.encode())?;
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a malformed request",
        ));
    };
    let tcp = match connect(request) {
        Ok(tcp) => tcp,
        Err(e) => {
            let errno = e
                .raw_os_error()
                .and_then(|n| u16::try_from(n).ok())
                .unwrap_or(libc::EIO as u16);
            host.write_all(&Status::Failed(errno).encode())?;
            return Err(e);
        }
    };
    let answer: [u8; ANSWER_LEN] = Status::Ok.encode();
    host.write_all(&answer)?;
    set_timeouts(&host, None)?;
    splice(host, tcp)
}

/// Connects to the port on the asked family's loopback, then the other's;
/// the error is the first family's.
fn connect(request: Request) -> io::Result<TcpStream> {
    let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, request.port));
    let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, request.port));
    let (first, second) = if request.ipv6 { (v6, v4) } else { (v4, v6) };
    TcpStream::connect_timeout(&first, REQUEST_TIMEOUT)
        .or_else(|e| TcpStream::connect_timeout(&second, REQUEST_TIMEOUT).map_err(|_| e))
}

/// Copies both ways until both ends have ended; an end of one direction is
/// passed on as a half-close, an error ends both.
fn splice(host: File, tcp: TcpStream) -> io::Result<()> {
    let (host_fd, tcp_fd) = (host.as_raw_fd(), tcp.as_raw_fd());
    let (host_in, tcp_out) = (host.try_clone()?, tcp.try_clone()?);
    let up = std::thread::Builder::new()
        .name("forward-up".into())
        .stack_size(STACK)
        .spawn(move || one_way(host_in, host_fd, tcp_fd, tcp_out))?;
    let down = one_way(tcp, tcp_fd, host_fd, host);
    let up = up
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the copy panicked")));
    down.and(up)
}

/// Copies `from` into `to` until the end of `from`, then shuts `to_fd`
/// down for writing; on an error both sockets are shut down entirely,
/// which ends the other direction too.
fn one_way(
    mut from: impl Read,
    from_fd: libc::c_int,
    to_fd: libc::c_int,
    mut to: impl Write,
) -> io::Result<()> {
    match io::copy(&mut from, &mut to) {
        Ok(_) => {
            shutdown(to_fd, libc::SHUT_WR);
            Ok(())
        }
        Err(e) => {
            shutdown(to_fd, libc::SHUT_RDWR);
            shutdown(from_fd, libc::SHUT_RDWR);
            Err(e)
        }
    }
}

fn shutdown(fd: libc::c_int, how: libc::c_int) {
    // SAFETY: shutdown(2) on a descriptor the caller holds open.
    unsafe { libc::shutdown(fd, how) };
}

pub(crate) fn set_timeouts(socket: &File, timeout: Option<Duration>) -> io::Result<()> {
    use nix::sys::socket::{setsockopt, sockopt};
    use nix::sys::time::TimeVal;
    let tv = timeout.map_or(TimeVal::new(0, 0), |t| {
        TimeVal::new(
            libc::time_t::try_from(t.as_secs()).unwrap_or(libc::time_t::MAX),
            0,
        )
    });
    setsockopt(socket, sockopt::ReceiveTimeout, &tv)?;
    setsockopt(socket, sockopt::SendTimeout, &tv)?;
    Ok(())
}
