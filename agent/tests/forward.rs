//! The agent's port-forward listener (`--forward-listen unix://…`): a
//! request names a TCP port, the agent connects to it on the loopback of
//! its network namespace (the test's: `Agent::start_with` unshares pid and
//! mount namespaces only) and splices. Echo servers here run in the test.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::Agent;
use twig_agent::proto::port_forward::{Request, Status, ANSWER_LEN};

const T: Duration = Duration::from_secs(30);

struct Forwarder {
    agent: Agent,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Forwarder {
    fn start() -> Forwarder {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("forward.sock");
        let arg = format!("--forward-listen unix://{}", socket.display());
        let agent = Agent::start_with(&[], "", &[&arg]);
        Forwarder {
            agent,
            socket,
            _dir: dir,
        }
    }

    /// A connection to the listener (polled for until the agent made it).
    fn connect(&self) -> UnixStream {
        let deadline = Instant::now() + T;
        loop {
            match UnixStream::connect(&self.socket) {
                Ok(s) => {
                    s.set_read_timeout(Some(T)).expect("timeout");
                    return s;
                }
                Err(_) if Instant::now() < deadline => std::thread::yield_now(),
                Err(e) => panic!(
                    "connecting to {}: {e}\nlog:\n{}",
                    self.socket.display(),
                    self.agent.log()
                ),
            }
        }
    }

    /// Sends `request` and reads the answer. An agent at its cap answers
    /// `Busy` and closes without reading the request, so the write may find
    /// the connection closed (EPIPE); the answer is still there to read.
    fn open(&self, request: &[u8]) -> (UnixStream, Option<Status>) {
        let mut s = self.connect();
        if let Err(e) = s.write_all(request) {
            assert_eq!(e.kind(), ErrorKind::BrokenPipe, "write the request: {e}");
        }
        let mut answer = [0u8; ANSWER_LEN];
        s.read_exact(&mut answer).expect("read the answer");
        (s, Status::decode(&answer))
    }
}

/// An echo server on `address`: per connection, everything read is written
/// back; at the end of the client's stream its own ends. Returns the port.
fn echo_server(address: &str) -> u16 {
    let listener = TcpListener::bind(address).expect("bind");
    let port = listener.local_addr().expect("address").port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            std::thread::spawn(move || {
                let mut back = conn.try_clone().expect("clone");
                let _ = std::io::copy(&mut conn, &mut back);
                let _ = back.shutdown(Shutdown::Write);
            });
        }
    });
    port
}

fn request(port: u16, ipv6: bool) -> [u8; 8] {
    Request { port, ipv6 }.encode()
}

#[test]
fn bytes_go_both_ways_and_a_half_close_reaches_the_server() {
    let fwd = Forwarder::start();
    let port = echo_server("127.0.0.1:0");
    let (mut s, status) = fwd.open(&request(port, false));
    assert_eq!(status, Some(Status::Ok));
    s.write_all(b"hello").expect("write");
    let mut buf = [0u8; 5];
    s.read_exact(&mut buf).expect("echo");
    assert_eq!(&buf, b"hello");
    // More after a round trip, then our end of stream: the server sees it
    // (its echo ends) only if the half-close was passed on.
    let big = vec![7u8; 1 << 20];
    let mut writer = s.try_clone().expect("clone");
    let sent = big.clone();
    let w = std::thread::spawn(move || {
        writer.write_all(&sent).expect("write");
        writer.shutdown(Shutdown::Write).expect("shutdown");
    });
    let mut back = Vec::new();
    s.read_to_end(&mut back).expect("read to the end");
    w.join().expect("writer");
    assert_eq!(back.len(), big.len());
    assert!(back == big);
}

#[test]
fn a_server_on_the_other_family_is_found_too() {
    // Never skipped: a host without an IPv6 loopback fails here, loudly.
    if let Err(e) = TcpListener::bind("[::1]:0") {
        panic!("this test needs the IPv6 loopback (::1): {e}");
    }
    let fwd = Forwarder::start();
    let port = echo_server("[::1]:0");
    // Asked for IPv4 (what containerd dials first): the agent falls back.
    let (mut s, status) = fwd.open(&request(port, false));
    assert_eq!(status, Some(Status::Ok));
    s.write_all(b"six").expect("write");
    let mut buf = [0u8; 3];
    s.read_exact(&mut buf).expect("echo");
    assert_eq!(&buf, b"six");
}

#[test]
fn a_closed_port_is_refused_with_the_errno() {
    let fwd = Forwarder::start();
    let free = {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("address").port()
    };
    let (mut s, status) = fwd.open(&request(free, false));
    // ECONNREFUSED.
    assert_eq!(status, Some(Status::Failed(111)));
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).expect("closed");
    assert!(rest.is_empty());
}

#[test]
fn garbage_is_refused_and_the_listener_goes_on() {
    let fwd = Forwarder::start();
    let (mut s, status) = fwd.open(b"GET / HTTP/1.1\r\n\r\n");
    assert_eq!(status, Some(Status::BadRequest));
    // Closed after the answer (reset: the rest of the garbage was unread).
    let mut rest = Vec::new();
    match s.read_to_end(&mut rest) {
        Ok(_) => assert!(rest.is_empty(), "nothing after the answer"),
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
    }
    // Port 0, an unknown family.
    for bad in [request(0, false), *b"TWPF\x05\x00\x1f\x90"] {
        assert_eq!(fwd.open(&bad).1, Some(Status::BadRequest), "{bad:?}");
    }
    // A short request then the end of stream: closed without an answer.
    let mut s = fwd.connect();
    s.write_all(b"TW").expect("write");
    s.shutdown(Shutdown::Write).expect("shutdown");
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).expect("closed");
    assert!(rest.is_empty());
    // Still serving.
    let port = echo_server("127.0.0.1:0");
    let (mut s, status) = fwd.open(&request(port, false));
    assert_eq!(status, Some(Status::Ok));
    s.write_all(b"ok").expect("write");
    let mut buf = [0u8; 2];
    s.read_exact(&mut buf).expect("echo");
    assert_eq!(&buf, b"ok");
    assert!(Path::new(&fwd.socket).exists());
}

#[test]
fn past_the_cap_connections_are_answered_busy_until_one_closes() {
    // The agent's MAX_CONNECTIONS.
    const CAP: usize = 256;
    let fwd = Forwarder::start();
    let port = echo_server("127.0.0.1:0");
    let mut open = Vec::new();
    for i in 0..CAP {
        let (s, status) = fwd.open(&request(port, false));
        assert_eq!(status, Some(Status::Ok), "connection {i}");
        open.push(s);
    }
    assert_eq!(fwd.open(&request(port, false)).1, Some(Status::Busy));
    // One ends (both ways): its slot comes back once the agent saw it.
    let last = open.pop().expect("one");
    last.shutdown(Shutdown::Write).expect("half-close");
    let mut rest = Vec::new();
    (&last).read_to_end(&mut rest).expect("the echo's end");
    drop(last);
    let deadline = Instant::now() + T;
    loop {
        match fwd.open(&request(port, false)).1 {
            Some(Status::Ok) => break,
            Some(Status::Busy) if Instant::now() < deadline => std::thread::yield_now(),
            other => panic!("after a close: {other:?}"),
        }
    }
}
