//! Port-forward (`PortForward`): in a fresh network namespace, every TCP
//! connection to 127.0.0.1 or ::1, on any port, reaches the one listening
//! socket, which says the port dialled; other destinations are left to the
//! kernel. Needs root (namespaces, BPF).

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use nix::sched::{setns, CloneFlags};
use twig_net::PortForward;

const T: Duration = Duration::from_secs(10);

/// A named network namespace with `lo` up, deleted on drop.
struct Netns {
    name: String,
}

impl Netns {
    fn new() -> Netns {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "twig-fwd-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        );
        run(&["ip", "netns", "add", &name]);
        run(&["ip", "-n", &name, "link", "set", "lo", "up"]);
        Netns { name }
    }

    fn path(&self) -> PathBuf {
        Path::new("/var/run/netns").join(&self.name)
    }

    /// Runs `work` on a thread inside the namespace.
    fn run<T: Send>(&self, work: impl FnOnce() -> T + Send) -> T {
        let file = std::fs::File::open(self.path()).expect("open netns");
        std::thread::scope(|s| {
            s.spawn(|| {
                setns(&file, CloneFlags::CLONE_NEWNET).expect("setns");
                work()
            })
            .join()
            .expect("the thread in the namespace panicked")
        })
    }

    fn connect(&self, to: &str) -> std::io::Result<TcpStream> {
        let to: SocketAddr = to.parse().expect("address");
        self.run(|| TcpStream::connect_timeout(&to, T))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

fn run(args: &[&str]) {
    let status = Command::new(args[0])
        .args(&args[1..])
        .status()
        .expect("run");
    assert!(status.success(), "{args:?}: {status}");
}

/// Bytes written on one side come out of the other, both ways.
fn round_trip(client: &mut TcpStream, server: &mut TcpStream) {
    client.set_read_timeout(Some(T)).expect("timeout");
    server.set_read_timeout(Some(T)).expect("timeout");
    client.write_all(b"ping").expect("write");
    let mut buf = [0u8; 4];
    server.read_exact(&mut buf).expect("read");
    assert_eq!(&buf, b"ping");
    server.write_all(b"pong").expect("write");
    client.read_exact(&mut buf).expect("read");
    assert_eq!(&buf, b"pong");
}

#[test]
fn every_loopback_port_of_both_families_reaches_the_listener() {
    let ns = Netns::new();
    // Nothing listens: refused, as containerd sees it without Twig.
    let err = ns
        .connect("127.0.0.1:40001")
        .expect_err("nothing listens yet");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}");

    let forward = PortForward::attach(&ns.path()).expect("attach");
    for (to, port, ipv6) in [
        ("127.0.0.1:40001", 40001, false),
        ("127.0.0.1:1", 1, false),
        ("127.0.0.1:65535", 65535, false),
        ("[::1]:40002", 40002, true),
        ("[::1]:80", 80, true),
    ] {
        let mut client = ns.connect(to).unwrap_or_else(|e| panic!("{to}: {e}"));
        let mut got = forward.accept().expect("accept");
        assert_eq!((got.port, got.ipv6), (port, ipv6), "{to}");
        round_trip(&mut client, &mut got.stream);
    }
}

#[test]
fn other_destinations_are_left_to_the_kernel_and_loopback_ports_are_all_taken() {
    let ns = Netns::new();
    // A real socket of the namespace, on every address.
    let real = ns.run(|| TcpListener::bind("0.0.0.0:40010").expect("bind"));
    let forward = PortForward::attach(&ns.path()).expect("attach");

    // Another loopback address (and so any non-loopback one) is not
    // steered: the real listener gets it.
    let mut client = ns.connect("127.0.0.2:40010").expect("connect 127.0.0.2");
    real.set_nonblocking(false).expect("blocking");
    let (mut server, _) = real.accept().expect("the real listener accepts");
    round_trip(&mut client, &mut server);

    // 127.0.0.1 on the same port is the pod's (the guest's) loopback:
    // steered, even though a socket of the namespace listens there.
    let mut client = ns.connect("127.0.0.1:40010").expect("connect 127.0.0.1");
    let mut got = forward.accept().expect("accept");
    assert_eq!((got.port, got.ipv6), (40010, false));
    round_trip(&mut client, &mut got.stream);
    real.set_nonblocking(true).expect("nonblocking");
    assert_eq!(
        real.accept().expect_err("not the real one's").kind(),
        ErrorKind::WouldBlock
    );
}

#[test]
fn close_wakes_a_waiting_accept_and_drop_unlinks_the_program() {
    let ns = Netns::new();
    let forward = PortForward::attach(&ns.path()).expect("attach");
    std::thread::scope(|s| {
        let waiting = s.spawn(|| forward.accept());
        // No sleep: whether accept is already waiting or not, close makes
        // it (and every later one) fail.
        forward.close();
        assert!(waiting.join().expect("join").is_err());
    });
    assert!(forward.accept().is_err());
    // Closed but still linked: the program finds a closed socket, the
    // kernel's lookup finds nothing.
    let err = ns.connect("127.0.0.1:40020").expect_err("closed");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}");

    drop(forward);
    let real = ns.run(|| TcpListener::bind("127.0.0.1:40021").expect("bind"));
    let mut client = ns.connect("127.0.0.1:40021").expect("connect");
    let (mut server, _) = real.accept().expect("unlinked: the real listener");
    round_trip(&mut client, &mut server);
}

#[test]
fn a_second_attach_in_the_same_namespace_is_independent_and_a_missing_namespace_fails() {
    let err = PortForward::attach(Path::new("/var/run/netns/twig-fwd-no-such-namespace"))
        .expect_err("no namespace");
    assert!(
        err.to_string().contains("twig-fwd-no-such-namespace"),
        "{err}"
    );

    // Two namespaces, two forwards: each gets its own namespace's
    // connections.
    let (a, b) = (Netns::new(), Netns::new());
    let fa = PortForward::attach(&a.path()).expect("attach a");
    let fb = PortForward::attach(&b.path()).expect("attach b");
    let _ca = a.connect("127.0.0.1:41001").expect("connect a");
    let _cb = b.connect("127.0.0.1:41002").expect("connect b");
    assert_eq!(fa.accept().expect("accept a").port, 41001);
    assert_eq!(fb.accept().expect("accept b").port, 41002);
}
