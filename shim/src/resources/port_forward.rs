//! `kubectl port-forward` into the pod's VM. containerd's CRI PortForward
//! enters the pod's network namespace and dials `localhost:<port>` there;
//! on Twig the pod's processes are in the guest. twig-net's
//! [`PortForward`] steers every TCP connection to 127.0.0.1/::1 of that
//! namespace into one listening socket; per accepted connection this
//! module opens `CONNECT <FORWARD_VSOCK_PORT>` on the VM's vsock socket,
//! asks the agent for the dialled port ([`Request`]), and copies bytes
//! both ways (an end of stream on one side becomes a `shutdown(SHUT_WR)`
//! on the other). A port nothing in the guest listens on — or a guest
//! without the listener — resets the client's connection, so containerd
//! reports an error as it does when its own dial is refused.
//!
//! The VM keeps its vsock socket across restores and rollbacks (the VMM
//! process is the same; connections open then are reset), so this runs
//! once per pod VM: started when the VM joined its network, stopped when
//! it stops. The set-up (~21 ms here, measured in release: aya's load of
//! the object and the verifier) runs on the accept thread, off the pod's
//! start. Idle, it is one thread blocked in
//! `accept`.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use twig_net::{Forwarded, PortForward};
use twig_proto::port_forward::{Request, Status, ANSWER_LEN};
use twig_proto::FORWARD_VSOCK_PORT;

/// Connections forwarded at once; more are reset.
pub const MAX_CONNECTIONS: usize = 256;
/// The stack of a connection's threads (they only copy).
const STACK: usize = 128 * 1024;

/// The port-forward of one pod VM: the accept thread and what stops it.
pub struct PortForwarder {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

struct Shared {
    stopped: AtomicBool,
    /// The attached forward, once the thread made it.
    forward: Mutex<Option<Arc<PortForward>>>,
}

impl PortForwarder {
    /// Starts forwarding the loopback of the network namespace `netns` to
    /// the guest behind the VMM's vsock socket `vsock` (`timeout` bounds
    /// the handshake with the VMM and the agent). A failure to attach is
    /// logged: the pod runs, without port-forward.
    pub fn start(netns: PathBuf, vsock: PathBuf, timeout: Duration) -> PortForwarder {
        let shared = Arc::new(Shared {
            stopped: AtomicBool::new(false),
            forward: Mutex::new(None),
        });
        let for_thread = shared.clone();
        let thread = std::thread::Builder::new()
            .name("port-forward".into())
            .spawn(move || run(&for_thread, &netns, vsock, timeout))
            .map_err(|e| tracing::warn!("port-forward: no thread: {e}"))
            .ok();
        PortForwarder {
            shared,
            thread: Mutex::new(thread),
        }
    }

    /// Stops accepting and unlinks the program (connections being copied
    /// end with the VM's vsock socket). Idempotent.
    pub fn stop(&self) {
        self.shared.stopped.store(true, Ordering::SeqCst);
        if let Some(f) = self
            .shared
            .forward
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            f.close();
        }
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Drop for PortForwarder {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(shared: &Shared, netns: &std::path::Path, vsock: PathBuf, timeout: Duration) {
    let forward = match PortForward::attach(netns) {
        Ok(f) => Arc::new(f),
        Err(e) => {
            tracing::warn!(netns = %netns.display(), "port-forward is unavailable for the pod: {e}");
            return;
        }
    };
    {
        let mut slot = shared.forward.lock().unwrap_or_else(|p| p.into_inner());
        if shared.stopped.load(Ordering::SeqCst) {
            return;
        }
        *slot = Some(forward.clone());
    }
    tracing::debug!(netns = %netns.display(), "port-forward attached");
    let open = Arc::new(AtomicUsize::new(0));
    loop {
        let conn = match forward.accept() {
            Ok(c) => c,
            Err(_) if shared.stopped.load(Ordering::SeqCst) => return,
            Err(e) => {
                tracing::warn!("port-forward accept: {e}");
                if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) {
                    std::thread::sleep(Duration::from_millis(100));
                }
                continue;
            }
        };
        if open.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            open.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!(
                port = conn.port,
                "port-forward: too many connections; reset"
            );
            reset(&conn.stream);
            continue;
        }
        let count = Count(open.clone());
        let vsock = vsock.clone();
        let spawned = std::thread::Builder::new()
            .name("port-forward-conn".into())
            .stack_size(STACK)
            .spawn(move || {
                let _count = count;
                let port = conn.port;
                if let Err(e) = forward_one(conn, &vsock, timeout) {
                    tracing::info!(port, "port-forward: {e}");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("port-forward: no thread for a connection: {e}");
        }
    }
}

/// Counts an open connection until dropped.
struct Count(Arc<AtomicUsize>);

impl Drop for Count {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Closes `stream` with a reset (`SO_LINGER` 0), as a refused dial ends
/// containerd's copy with an error rather than an empty stream.
fn reset(stream: &TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt(2) with a `struct linger` of the size passed.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
}

/// One connection: the guest's answer, then the copy.
fn forward_one(conn: Forwarded, vsock: &std::path::Path, timeout: Duration) -> io::Result<()> {
    let guest = match open_guest(conn.port, conn.ipv6, vsock, timeout) {
        Ok(g) => g,
        Err(e) => {
            reset(&conn.stream);
            return Err(e);
        }
    };
    splice(conn.stream, guest)
}

/// The guest's end: the vsock handshake, the request, an `Ok` answer.
fn open_guest(
    port: u16,
    ipv6: bool,
    vsock: &std::path::Path,
    timeout: Duration,
) -> io::Result<UnixStream> {
    let mut guest =
        twig_proto::vsock::connect(vsock, FORWARD_VSOCK_PORT, timeout).map_err(io::Error::other)?;
    guest.set_read_timeout(Some(timeout))?;
    guest.set_write_timeout(Some(timeout))?;
    guest.write_all(&Request { port, ipv6 }.encode())?;
    let mut answer = [0u8; ANSWER_LEN];
    guest.read_exact(&mut answer)?;
    match Status::decode(&answer) {
        Some(Status::Ok) => {}
        Some(Status::Failed(errno)) => {
            return Err(io::Error::other(format!(
                "the guest's port {port}: {}",
                io::Error::from_raw_os_error(i32::from(errno))
            )))
        }
        other => {
            return Err(io::Error::other(format!(
                "the guest's port {port}: the agent answered {other:?}"
            )))
        }
    }
    guest.set_read_timeout(None)?;
    guest.set_write_timeout(None)?;
    Ok(guest)
}

/// Copies both ways until both ends have ended; an end of stream is passed
/// on as a half-close, an error ends both directions.
fn splice(client: TcpStream, guest: UnixStream) -> io::Result<()> {
    let (client_in, guest_out) = (client.try_clone()?, guest.try_clone()?);
    let up = std::thread::Builder::new()
        .name("port-forward-up".into())
        .stack_size(STACK)
        .spawn(move || {
            one_way(
                client_in,
                guest_out,
                |s: &TcpStream, h| s.shutdown(h),
                |s: &UnixStream, h| s.shutdown(h),
            )
        })?;
    let down = one_way(
        guest,
        client,
        |s: &UnixStream, h| s.shutdown(h),
        |s: &TcpStream, h| s.shutdown(h),
    );
    let up = up
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the copy panicked")));
    down.and(up)
}

fn one_way<R: Read, W: Write>(
    mut from: R,
    mut to: W,
    shut_from: impl Fn(&R, Shutdown) -> io::Result<()>,
    shut_to: impl Fn(&W, Shutdown) -> io::Result<()>,
) -> io::Result<()> {
    match io::copy(&mut from, &mut to) {
        Ok(_) => {
            let _ = shut_to(&to, Shutdown::Write);
            Ok(())
        }
        Err(e) => {
            let _ = shut_to(&to, Shutdown::Both);
            let _ = shut_from(&from, Shutdown::Both);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    //! Root only (a network namespace, BPF): the shim's half against a
    //! fake VMM whose "agent" echoes on guest port 7 and refuses others.

    use std::io::BufRead;
    use std::os::unix::net::UnixListener;
    use std::process::Command;
    use std::time::Instant;

    use super::*;

    const T: Duration = Duration::from_secs(10);

    struct Netns(String);

    impl Netns {
        fn new() -> Netns {
            let name = format!("twig-shim-fwd-{}", std::process::id());
            for args in [
                vec!["netns", "add", &name],
                vec!["-n", &name, "link", "set", "lo", "up"],
            ] {
                let status = Command::new("ip").args(&args).status().expect("ip");
                assert!(status.success(), "ip {args:?}");
            }
            Netns(name)
        }

        fn path(&self) -> PathBuf {
            PathBuf::from("/var/run/netns").join(&self.0)
        }

        /// Dials 127.0.0.1:`port` inside the namespace, as containerd does.
        fn dial(&self, port: u16) -> io::Result<TcpStream> {
            let file = std::fs::File::open(self.path()).expect("netns");
            std::thread::scope(|s| {
                s.spawn(|| {
                    nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
                    let to = std::net::SocketAddr::from(([127, 0, 0, 1], port));
                    TcpStream::connect_timeout(&to, T)
                })
                .join()
                .expect("dial thread")
            })
        }
    }

    impl Drop for Netns {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }

    /// A VMM's vsock socket whose guest echoes on port 7 (after an `Ok`)
    /// and refuses every other port.
    fn fake_vmm(path: &std::path::Path) {
        let listener = UnixListener::bind(path).expect("bind");
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { return };
                std::thread::spawn(move || {
                    let mut reader = io::BufReader::new(conn.try_clone().expect("clone"));
                    let mut line = String::new();
                    reader.read_line(&mut line).expect("CONNECT");
                    assert_eq!(line, format!("CONNECT {FORWARD_VSOCK_PORT}\n"));
                    let mut conn = conn;
                    conn.write_all(b"OK 1\n").expect("OK");
                    let mut request = [0u8; 8];
                    reader.read_exact(&mut request).expect("request");
                    let request = Request::decode(&request).expect("a good request");
                    if request.port != 7 {
                        let _ = conn.write_all(&Status::Failed(111).encode());
                        return;
                    }
                    conn.write_all(&Status::Ok.encode()).expect("answer");
                    let _ = io::copy(&mut reader, &mut conn);
                    let _ = conn.shutdown(Shutdown::Write);
                });
            }
        });
    }

    #[test]
    fn a_loopback_dial_reaches_the_guest_port_and_a_refused_one_is_reset() {
        let dir = tempfile::tempdir().expect("tempdir");
        let vsock = dir.path().join("vsock.sock");
        fake_vmm(&vsock);
        let ns = Netns::new();
        let err = ns.dial(7).expect_err("nothing forwards yet");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);

        let forwarder = PortForwarder::start(ns.path(), vsock, T);
        // The attach runs on the forwarder's thread: poll until it took.
        let deadline = Instant::now() + T;
        let mut client = loop {
            match ns.dial(7) {
                Ok(c) => break c,
                Err(e) if Instant::now() < deadline => {
                    assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
                    std::thread::yield_now();
                }
                Err(e) => panic!("never attached: {e}"),
            }
        };
        client.set_read_timeout(Some(T)).expect("timeout");
        client.write_all(b"through the guest").expect("write");
        client.shutdown(Shutdown::Write).expect("half-close");
        let mut back = Vec::new();
        client.read_to_end(&mut back).expect("echo, then its end");
        assert_eq!(back, b"through the guest");

        // The guest refuses port 8: accepted here, then reset.
        let mut refused = ns.dial(8).expect("accepted by the forward");
        refused.set_read_timeout(Some(T)).expect("timeout");
        let err = refused.read(&mut [0u8; 1]).expect_err("reset");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionReset, "{err}");

        forwarder.stop();
        let err = ns.dial(7).expect_err("stopped");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);
    }
}
