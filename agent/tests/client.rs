//! The host client's vsock handshake, against a fake VMM vsock socket that
//! forwards an accepted `CONNECT 1024` to a real agent.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};

use common::{Agent, T};
use twig_agent::client::{AgentClient, Error};
use twig_agent::proto::vsock;

/// A fake VMM: accepts one connection on `uds`, reads the CONNECT line and
/// lets `respond` answer it (and possibly take the stream over).
fn fake_vmm(
    uds: &Path,
    respond: impl FnOnce(String, UnixStream) + Send + 'static,
) -> std::thread::JoinHandle<()> {
    let listener = UnixListener::bind(uds).unwrap();
    std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        respond(line, stream);
    })
}

fn splice(mut from: UnixStream, mut to: UnixStream) {
    let mut buf = [0u8; 8192];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}

#[test]
fn vsock_handshake_then_ttrpc() {
    let agent = Agent::start();
    // Wait until the agent serves.
    agent.client().ping(T).unwrap();
    let uds = agent.dir.path().join("vsock.sock");
    let agent_sock = agent.socket.clone();
    let vmm = fake_vmm(&uds, move |line, mut host| {
        assert_eq!(line, "CONNECT 1024\n");
        let guest = UnixStream::connect(&agent_sock).unwrap();
        host.write_all(b"OK 1073741824\n").unwrap();
        let (h2, g2) = (host.try_clone().unwrap(), guest.try_clone().unwrap());
        let t = std::thread::spawn(move || splice(h2, g2));
        splice(guest, host);
        t.join().unwrap();
    });
    let c = AgentClient::connect_vsock_uds(&uds, twig_agent::AGENT_VSOCK_PORT, T).unwrap();
    assert_eq!(c.ping(T).unwrap().version, env!("CARGO_PKG_VERSION"));
    drop(c);
    vmm.join().unwrap();
}

/// The handshake's own cases are tested in twig-proto; here: its errors
/// reach the client's callers as `Error::Vsock`, within the deadline.
#[test]
fn vsock_handshake_failures_are_errors_within_the_deadline() {
    let dir = tempfile::tempdir().unwrap();

    let refused = dir.path().join("refused.sock");
    let vmm = fake_vmm(&refused, |_, mut s| {
        s.write_all(b"NOPE\n").unwrap();
    });
    let e = AgentClient::connect_vsock_uds(&refused, 1024, T)
        .err()
        .unwrap();
    assert!(
        matches!(&e, Error::Vsock(vsock::Error::BadAnswer { answer, .. }) if answer == "NOPE"),
        "{e}"
    );
    vmm.join().unwrap();

    let silent = dir.path().join("silent.sock");
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let vmm = fake_vmm(&silent, move |_, s| {
        // Hold the connection open without answering until the client gave up.
        let _ = rx.recv_timeout(T);
        drop(s);
    });
    let t0 = Instant::now();
    let e = AgentClient::wait_ready(&silent, 1024, Duration::from_millis(300))
        .err()
        .unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(
        matches!(&e, Error::Vsock(vsock::Error::Timeout { .. })),
        "{e}"
    );
    assert!(e.to_string().contains("no answer within"), "{e}");
    tx.send(()).unwrap();
    vmm.join().unwrap();

    let e = AgentClient::connect_vsock_uds(&dir.path().join("missing.sock"), 1024, T)
        .err()
        .unwrap();
    assert!(
        matches!(e, Error::Vsock(vsock::Error::Connect { .. })),
        "{e}"
    );
}

/// A guest slower than an attempt's first bound (a node restoring many VMs
/// at once): every answer reaches the host 6 s after its connection. Each
/// attempt that runs out of time gives the next one longer, so the wait
/// ends with a client rather than at its deadline.
#[test]
fn wait_ready_outlasts_a_guest_slower_than_one_attempt() {
    const LAG: Duration = Duration::from_secs(6);
    let agent = Agent::start();
    agent.client().ping(T).unwrap();
    let uds = agent.dir.path().join("vsock.sock");
    let listener = UnixListener::bind(&uds).unwrap();
    let agent_sock = agent.socket.clone();
    // Serves connections until the test is done (the thread ends with the
    // process; each connection's threads end with its streams).
    std::thread::spawn(move || {
        for host in listener.incoming() {
            let Ok(host) = host else { return };
            let agent_sock = agent_sock.clone();
            std::thread::spawn(move || {
                let opened = Instant::now();
                let mut reader = BufReader::new(host.try_clone().unwrap());
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                let guest = UnixStream::connect(&agent_sock).unwrap();
                (&host).write_all(b"OK 1073741824\n").unwrap();
                let (h2, g2) = (host.try_clone().unwrap(), guest.try_clone().unwrap());
                std::thread::spawn(move || splice(h2, g2));
                std::thread::sleep(LAG.saturating_sub(opened.elapsed()));
                splice(guest, host);
            });
        }
    });
    let t0 = Instant::now();
    let client =
        AgentClient::wait_ready(&uds, twig_agent::AGENT_VSOCK_PORT, Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("after {:?}: {e}", t0.elapsed()));
    assert!(t0.elapsed() >= LAG, "answered after {:?}", t0.elapsed());
    drop(client);
}
